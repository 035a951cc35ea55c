"""Running ``python -m spark_bridge`` as a user would, and what its run cost.

Shared by the scenarios that time the Spark bridge's CLI (spark-bridge,
snapshot): a subprocess with this checkout first on the path, its wall time,
exit code, output with arrival times, and the peak RSS of its whole process
tree (the driver, its JVM, Spark's Python workers); and where analyze's wall
time went, read from its progress lines.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

from bench.harness.broker import REPO, checkout_env

now = time.perf_counter


class TreeSampler(threading.Thread):
    """Peak RSS of a process and its descendants, sampled from /proc every 100 ms.

    getrusage/wait4 give the largest single waited-for process, never the sum
    of a tree that runs at once (the driver, its JVM, Spark's Python workers).
    """

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_total = 0  # bytes, whole tree at once
        self.peak_single = 0  # bytes, largest single process
        self.peak_name = ""
        self.stopped = threading.Event()

    def sample(self) -> None:
        procs: dict[int, tuple[int, int, str]] = {}  # pid -> (ppid, rss bytes, comm)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            procs[int(entry)] = (int(fields[1]), int(fields[21]) * self.PAGE, comm)
        tree, frontier = set(), {self.pid}
        while frontier:
            tree |= frontier
            frontier = {p for p, (pp, _, _) in procs.items() if pp in frontier} - tree
        total = 0
        for p in tree:
            if p in procs:
                _, rss, comm = procs[p]
                total += rss
                if rss > self.peak_single:
                    self.peak_single, self.peak_name = rss, comm
        self.peak_total = max(self.peak_total, total)

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            self.sample()


def run_child(args: list[str], log_dir: str, name: str, echo_stderr: bool = False) -> dict:
    """Run `python -m spark_bridge ARGS`; wall time, exit code, output, memory.

    Reaped with os.wait4 so the rusage is this child's alone (and of the
    descendants it waited for): ru_maxrss is one process's peak, not a sum.
    A /proc sampler sees the whole tree (the JVM included). Each stderr line
    is kept with its arrival time since the start.
    """
    cmd = [sys.executable, "-m", "spark_bridge", *args]
    out_path = os.path.join(log_dir, f"{name}.stdout")
    err_lines: list[tuple[float, str]] = []
    t0 = now()
    with open(out_path, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True,
                             env=checkout_env(), cwd=REPO)
        sampler = TreeSampler(p.pid)
        sampler.start()
        assert p.stderr is not None
        for line in p.stderr:
            err_lines.append((now() - t0, line))
            if echo_stderr:
                print(f"    | {line.rstrip()}", flush=True)
        sampler.stopped.set()
        _pid, status, usage = os.wait4(p.pid, 0)
    wall = now() - t0
    sampler.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    with open(out_path) as f:
        stdout = f.read()
    return {
        "cmd": cmd,
        "rc": p.returncode,
        "wall": wall,
        "stdout": stdout,
        "stderr": "".join(line for _, line in err_lines),
        "stderr_lines": err_lines,
        "maxrss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
        "tree_peak_mb": sampler.peak_total / 2**20,
        "single_peak_mb": sampler.peak_single / 2**20,
        "single_peak_name": sampler.peak_name,
    }


STEP = re.compile(r"^\[(\d+)/(\d+)\] (.+): ([\d.]+) s$")
READY = re.compile(r"^Spark ready in ([\d.]+) s\b")
TOTAL = re.compile(r"^analyzed [\d,]+ messages in ([\d.]+) s", re.M)


def breakdown(res: dict) -> list[tuple[str, float]]:
    """Where analyze's wall time went, from its progress lines and final summary.

    The CLI times itself from just before the SparkSession start to after the
    report is written. Its questions run as concurrent Spark jobs, all
    submitted at once, so their span is the slowest one's time (each job's
    own time, from submission, is listed under it). What neither covers:
    creating the DataFrame (Spark asks a Python process for the data
    source), the roll-ups, the text and HTML reports (Spark and its JVM
    shut down meanwhile). Before it: interpreter start and imports (the
    arrival of "starting Spark"); after it: interpreter exit.
    """
    rows: list[tuple[str, float]] = []
    first = next((t for t, line in res["stderr_lines"] if line.startswith("starting Spark")), None)
    if first is not None:
        rows.append(("interpreter start, imports", first))
    session = 0.0
    jobs: list[tuple[str, float]] = []
    for _, line in res["stderr_lines"]:
        line = line.strip()
        if m := READY.match(line):
            session = float(m.group(1))
            rows.append(("SparkSession start", session))
        elif m := STEP.match(line):
            jobs.append((f"  [{m.group(1)}/{m.group(2)}] {m.group(3)}", float(m.group(4))))
    span = max((s for _, s in jobs), default=0.0)
    rows.append(("questions (concurrent jobs)", span))
    rows += sorted(jobs)
    m = TOTAL.search(res["stdout"])
    if m and first is not None:
        cli_total = float(m.group(1))
        rows.append(("DataFrame, roll-ups, reports, Spark stop", cli_total - session - span))
        rows.append(("exit", res["wall"] - first - cli_total))
    return rows


def fail(what: str, res: dict) -> None:
    print(f"\n{what} failed (exit {res['rc']}): {' '.join(res['cmd'])}", file=sys.stderr)
    print(res["stdout"][-4000:], file=sys.stderr)
    print(res["stderr"][-4000:], file=sys.stderr)


def jvm_archive(prefix: str = "") -> bool:
    """Whether analyze runs with the JVM class archive, as on a machine set up as documented.

    Builds it (untimed) when missing; ``MQD_NO_JVM_ARCHIVE=1`` runs without it.
    """
    from spark_bridge.jvm_archive import build_archive, java_options

    archive = not os.environ.get("MQD_NO_JVM_ARCHIVE")
    if archive and java_options() is None:
        started = now()
        build_archive()
        print(f"{prefix}set-up: JVM class archive built in {now() - started:.0f} s "
              "(python -m spark_bridge jvm-archive, once per machine; not timed)", flush=True)
    return archive


def run_analyze(args: list[str], report: str, workdir: str) -> dict | None:
    """``python -m spark_bridge analyze ARGS`` (stderr echoed) and where its time went.

    None (and the output printed) unless it exits 0 and wrote ``report``.
    """
    an = run_child(["analyze", *args], workdir, "analyze", echo_stderr=True)
    if an["rc"] != 0 or not os.path.isfile(report):
        fail("analyze" + ("" if an["rc"] != 0 else " (no report file)"), an)
        return None
    an["steps"] = breakdown(an)
    for label, seconds in an["steps"]:
        print(f"    {label:<42} {seconds:6.1f} s")
    return an
