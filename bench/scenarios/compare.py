"""``python -m bench compare``: an old mqd build, this checkout, the ceiling probe and nsqd in one session.

A change to the broker's hot path is judged by the new build's figures against
the old build's, against the ceiling probe (bench/harness/probe.py: what one
Twisted process can relay at all) and against a real nsqd, and figures taken
at different times on a shared machine do not compare. So the targets run the
same load in one session, interleaved per repetition (old, new, probe, nsqd,
old, new, ...), each on a fresh broker process, and each target's medians are
set against the probe's, the old build's and nsqd's.

The load is ours (bench/harness/load.py) or, with ``--load nsq``, NSQ's own
bench_writer and bench_reader (bench/harness/nsqtools.py), the programs
nsqd's published figures come from; ``--channels N`` then runs one
bench_reader per channel at once (fan-out).

The old build is ``git archive REV`` unpacked into a temporary directory (it
only reads the repository, so it cannot disturb the working tree, the index or
a commit in progress) and run by the same twistd with that tree alone on
``PYTHONPATH``: its ``mqd``, ``backends`` and ``twisted/plugins`` come first,
ahead of the editable install of this checkout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import nsqtools
from bench.harness.broker import (
    ERRORS,
    NSQD_BIN_ENV,
    REPO,
    BenchError,
    broker_command,
    find_nsqd,
    nsqd_command,
)
from bench.harness.report import fmt, heading, percent, ratio, save_json
from bench.harness.session import (
    SCENARIOS,
    Result,
    Session,
    load_line,
    median_result,
    open_session,
    result_line,
)
from bench.harness.session import parse_args as bench_parse_args

# The build before the hot-path rework: the default "old build" the new one is measured against.
BASELINE = "22852c4d7f22d935be598c0148061f628097d6fb"
TARGETS = ("old", "new", "probe", "nsqd")
LOADS = ("ours", "nsq")
NSQ_BATCH = 200  # bench_writer's own default --batch-size, with which nsqd's figures were taken


def git(*args: str) -> str:
    """Read-only git queries on this checkout."""
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def export_tree(rev: str) -> Path:
    """Unpack the tree of ``rev`` into a fresh temporary directory."""
    dest = Path(tempfile.mkdtemp(prefix="mqd-old-"))
    archive = subprocess.Popen(["git", "archive", rev], cwd=REPO, stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() or untar.returncode:
        shutil.rmtree(dest, ignore_errors=True)
        raise BenchError(f"could not export revision {rev!r} (git archive | tar failed)")
    return dest


def cpu_list(text: str) -> set[int]:
    """The CPUs of a taskset-style list (``0``, ``0,2``, ``1-3``); ValueError if it names none or one that is not there."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        lo = int(first)
        hi = int(last) if last else lo
        if lo < 0 or hi < lo:
            raise ValueError(f"bad CPU range {part.strip()!r}")
        cpus.update(range(lo, hi + 1))
    absent = cpus - os.sched_getaffinity(0)
    if not cpus or absent:
        raise ValueError(f"no such CPU here: {sorted(absent) or text!r}")
    return cpus


def cpu_text(cpus: set[int]) -> str:
    """A CPU set as taskset writes a list: ``0,1``."""
    return ",".join(map(str, sorted(cpus)))


def target_argv(target: str, args: argparse.Namespace, old_tree: Path | None) -> list[str]:
    """The broker command of a target, pinned with ``taskset`` under ``--pin-broker``; ``{data}`` is replaced by Broker."""
    pin = ["taskset", "-c", cpu_text(args.pin_broker)] if args.pin_broker else []
    if target == "probe":
        durable = ["--durable={data}"] if args.probe_durable else []
        return [*pin, sys.executable, "-m", "bench.harness.probe", "--tcp-address=127.0.0.1:0", *durable]
    if target == "nsqd":
        # --backend and --broker-arg are mqd's: nsqd gets the equivalent flags only.
        return [*pin, *nsqd_command(args.nsqd, args.mem_queue_size)]
    cmd = broker_command(args.backend, args.mem_queue_size, "{data}", args.broker_arg)
    if target == "old":
        # Broker puts this checkout on PYTHONPATH; env replaces it with the old tree (and execs,
        # so the pid the sampler watches is twistd's).
        return [*pin, "env", f"PYTHONPATH={old_tree}", *cmd]
    return [*pin, *cmd]


def run_target(target: str, args: argparse.Namespace, argv: list[str], label: str) -> list[Result]:
    """One fresh broker, the scenarios in order, the broker stopped again."""
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    results = []
    cls = nsqtools.NsqToolSession if args.load == "nsq" else Session
    with open_session(args, cls=cls, argv=argv, verbose=False) as session:
        for name in scenarios:
            res = getattr(session, name)()
            results.append(res)
            print(result_line(res, f"{target:<5} {name:<6} {label}"), flush=True)
    return results


def _ratio(new: float | None, base: float | None) -> str:
    return fmt(ratio(base, new), ".2f")


# The ratio columns: (base target, the targets that get a ratio to it).
_RATIOS = (("probe", ("old", "new", "nsqd")), ("old", ("new",)), ("nsqd", ("old", "new", "probe")))


def table(medians: dict[str, dict[str, Result]], scenarios: tuple[str, ...]) -> list[str]:
    """Markdown rows: per scenario and target, msgs/s, the ratios to the probe, old build, nsqd, and CPU.

    Beside the broker's CPU share: the share of a core it waited for one
    (ready, but the scheduler ran something else: on a machine the load
    shares, a one-threaded broker's ceiling) and its CPU per message.

    A pair of ratio columns (``in ÷ base``, ``out ÷ base``) is there when its
    base target ran, and filled for the rows of the targets it applies to.
    """
    bases = [(base, rows) for base, rows in _RATIOS if base in medians]
    head = "| run | build | msgs/s in | msgs/s out |"
    rule = "|---|---|---:|---:|"
    for base, _ in bases:
        head += f" in ÷ {base} | out ÷ {base} |"
        rule += "---:|---:|"
    lines = [head + " broker CPU | waited for CPU | CPU µs/msg | peak RSS (MB) |", rule + "---:|---:|---:|---:|"]
    for name in scenarios:
        for target in TARGETS:
            r = medians.get(target, {}).get(name)
            if r is None:
                continue
            row = f"| {name} | {target} | {fmt(r.rate_in)} | {fmt(r.rate_out)} |"
            for base, rows in bases:
                b = medians[base].get(name)
                if target in rows and b is not None:
                    row += f" {_ratio(r.rate_in, b.rate_in)} | {_ratio(r.rate_out, b.rate_out)} |"
                else:
                    row += " - | - |"
            lines.append(row + f" {percent(r.cpu_pct)} | {percent(r.wait_pct)} | {fmt(cpu_per_message(r), '.2f')} "
                         f"| {fmt(r.rss_mb)} |")
    return lines


def cpu_per_message(r: Result) -> float | None:
    """The broker's CPU time per message it handled, in µs: per message out when any went out, else in.

    A broker's rate is bounded by its cost per message times the cores it
    can use. Beside the rate, this tells the two apart: with one channel
    or many, a broker that spends no more CPU per delivered message than
    another yet delivers fewer is short of cores (mqd runs on one), not
    slower per message. Computed from the medians (CPU share ÷ rate).
    """
    rate = r.rate_out or r.rate_in
    if r.cpu_pct is None or not rate:
        return None
    return 1e4 * r.cpu_pct / rate


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m bench compare",
        description="Old mqd build vs this checkout vs the ceiling probe (bench/harness/probe.py) "
        "vs a real nsqd, interleaved in one session; medians per target.",
        epilog="Any other flag of `python -m bench` (--duration, --size, --writers, --json, ...) "
        "applies to every target; --backend and --broker-arg=... to the mqd builds (old, new) "
        "only. --load nsq uses --duration, --size, --batch, --rdy and --timeout of them.",
    )
    p.add_argument(
        "--old",
        default=BASELINE,
        metavar="REV",
        help=f"git revision of the old build (default {BASELINE[:10]}, before the hot-path rework)",
    )
    p.add_argument("--repeat", type=int, default=3, help="repetitions per target (median)")
    p.add_argument(
        "--targets",
        default=None,
        help="comma-separated subset of old,new,probe,nsqd (in this order within a repetition; "
        "default old,new,probe)",
    )
    p.add_argument(
        "--nsqd",
        metavar="PATH",
        help="NSQ's nsqd, or the directory of NSQ's binaries (bench_writer and bench_reader are "
        f"taken from beside it); default ${NSQD_BIN_ENV}, else nsq-1.3.0/bin of a 'shared' "
        "directory beside the checkout when there is one; 'none': no default",
    )
    p.add_argument(
        "--load",
        choices=LOADS,
        default="ours",
        help="writer/reader/both load: ours (bench/harness/load.py) or nsq (NSQ's bench_writer "
        "and bench_reader, beside --nsqd)",
    )
    p.add_argument(
        "--channels",
        type=int,
        default=1,
        metavar="N",
        help="with --load nsq: N channels on the topic, one bench_reader each at once (fan-out)",
    )
    p.add_argument(
        "--batch",
        type=int,
        help=f"messages per MPUB (default: 100 for our load, {NSQ_BATCH} for --load nsq)",
    )
    p.add_argument(
        "--probe-durable",
        action="store_true",
        help="the probe as the floor of a durable broker: a publish answered once its log chunk "
        "is synced (bench/harness/probe.py --durable)",
    )
    p.add_argument(
        "--pin-broker",
        metavar="CPUS",
        help="run every broker on these CPUs only (taskset list: 0, 0,2, 1-3), e.g. one core per "
        "broker, as mqd is deployed; with --pin-load, brokers and load do not share a core",
    )
    p.add_argument(
        "--pin-load",
        metavar="CPUS",
        help="run the load (and this harness) on these CPUs only",
    )
    mine, rest = p.parse_known_args(argv)
    if mine.targets is None:
        mine.targets = "old,new,probe"
    targets = tuple(t.strip() for t in mine.targets.split(",") if t.strip())
    if not targets or set(targets) - set(TARGETS):
        p.error(f"--targets takes a subset of {','.join(TARGETS)}")
    mine.targets = tuple(t for t in TARGETS if t in targets)
    if mine.repeat < 1:
        p.error("--repeat must be at least 1")
    if mine.channels < 1:
        p.error("--channels must be at least 1")
    if mine.channels > 1 and mine.load != "nsq":
        p.error("--channels needs --load nsq (our load reads one channel)")
    batch = mine.batch if mine.batch is not None else (NSQ_BATCH if mine.load == "nsq" else None)
    if batch is not None:
        rest += ["--batch", str(batch)]
    args = bench_parse_args([*rest, "--repeat", str(mine.repeat)])
    if args.nsqd_address or args.broker_cmd:
        p.error("compare starts its own brokers: no --nsqd-address, --nsqd-bin or --broker-cmd")
    if mine.load == "nsq" and (args.count is not None or args.mode != "mpub"):
        p.error("--load nsq runs for --duration with MPUB: no --count or --mode pub")
    args.load, args.channels = mine.load, mine.channels
    args.probe_durable = mine.probe_durable
    try:
        args.pin_broker = cpu_list(mine.pin_broker) if mine.pin_broker else None
        args.pin_load = cpu_list(mine.pin_load) if mine.pin_load else None
    except ValueError as exc:
        p.error(f"--pin-broker / --pin-load: {exc}")
    if args.pin_broker and shutil.which("taskset") is None:
        p.error("--pin-broker needs taskset (util-linux)")
    args.nsqd = args.bench_writer = args.bench_reader = None
    if "nsqd" in mine.targets or mine.load == "nsq":
        try:
            args.nsqd = find_nsqd(mine.nsqd, use_beside=True)
            if args.nsqd is not None and mine.load == "nsq":
                args.bench_writer = find_nsqd(args.nsqd, nsqtools.WRITER, use_env=False)
                args.bench_reader = find_nsqd(args.nsqd, nsqtools.READER, use_env=False)
        except ValueError as exc:
            p.error(f"--nsqd: {exc}")
        if args.nsqd is None:
            p.error(
                "the nsqd target and --load nsq need NSQ's binaries: --nsqd PATH (nsqd or the "
                f"directory of NSQ's binaries) or ${NSQD_BIN_ENV}"
            )
    return mine, args


def nsqd_version(nsqd: str) -> str:
    """``nsqd v1.3.0 (built w/go1.19.8)``, as ``nsqd --version`` says it; the path if it says nothing."""
    try:
        out = subprocess.run(
            [nsqd, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return nsqd
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else nsqd


def describe_load(args: argparse.Namespace) -> str:
    return nsqtools.load_line(args) if args.load == "nsq" else load_line(args)


def main(argv: list[str]) -> int:
    mine, args = parse_args(argv)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    try:
        old_rev = git("rev-parse", "--verify", f"{mine.old}^{{commit}}")
    except subprocess.CalledProcessError:
        print(f"error: unknown revision {mine.old!r}", file=sys.stderr)
        return 2
    if args.pin_load:
        # The load's processes (and the harness) inherit this process's CPUs.
        os.sched_setaffinity(0, args.pin_load)
    head = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    new_desc = f"{head[:10]}" + (" + uncommitted changes" if dirty else "")
    load_before = os.getloadavg()
    old_tree = export_tree(old_rev) if "old" in mine.targets else None
    runs: dict[str, dict[str, list[Result]]] = {t: {s: [] for s in scenarios} for t in mine.targets}
    failures: list[str] = []
    try:
        argvs = {t: target_argv(t, args, old_tree) for t in mine.targets}
        for t in mine.targets:
            print(f"{t}: {' '.join(argvs[t])}", flush=True)
        for rep in range(args.repeat):
            for t in mine.targets:
                try:
                    for res in run_target(t, args, argvs[t], f"{rep + 1}/{args.repeat}"):
                        runs[t][res.scenario].append(res)
                except ERRORS as exc:
                    failures.append(f"{t} {rep + 1}: {exc}")
                    print(f"error: {t} repetition {rep + 1}: {exc}", file=sys.stderr, flush=True)
    finally:
        if old_tree is not None:
            shutil.rmtree(old_tree, ignore_errors=True)
    load_after = os.getloadavg()

    medians = {
        t: {s: median_result(rs) for s, rs in by_s.items() if rs} for t, by_s in runs.items()
    }
    print()
    for s in scenarios:
        for t in mine.targets:
            if s in medians[t]:
                print(result_line(medians[t][s], f"{t:<5} {s:<6} median"))
    flags = " ".join(
        [f"--backend={args.backend}", f"--mem-queue-size={args.mem_queue_size}", *args.broker_arg]
    )
    builds = {
        "old": f"old: `{old_rev[:10]}` ({mine.old})",
        "new": f"new: `{new_desc}`",
        "probe": "probe: bench/harness/probe.py" + (" --durable" if args.probe_durable else ""),
    }
    lines = [
        heading(
            "mqd compare",
            f"{datetime.datetime.now(datetime.UTC):%H:%M} UTC",
            f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after",
        ),
        "",
        "- " + "; ".join(builds[t] for t in mine.targets if t in builds),
        f"- mqd flags: `{flags}`",
        *([f"- nsqd: {nsqd_version(args.nsqd)}, `nsqd --mem-queue-size={args.mem_queue_size}`"]
          if "nsqd" in mine.targets else []),
        f"- load: {describe_load(args)}; median of {args.repeat}, targets interleaved "
        f"({', '.join(mine.targets)}) per repetition, a fresh broker each",
        *([f"- pinned: brokers to CPU {cpu_text(args.pin_broker) if args.pin_broker else 'any'}, "
           f"load to CPU {cpu_text(args.pin_load) if args.pin_load else 'any'}"]
          if args.pin_broker or args.pin_load else []),
        "",
        *table(medians, scenarios),
    ]
    print()
    print("\n".join(lines))
    if failures:
        print("\nfailed runs (left out of the medians):\n  " + "\n  ".join(failures))
    if args.json:
        save_json(
            args.json, args, date=datetime.datetime.now(datetime.UTC).isoformat(), old=old_rev,
            new=head, new_dirty=dirty, runs=runs, median=medians, failures=failures,
        )
    return 1 if failures else 0
