"""Flame graphs of the broker under the bench load (issue #17).

``python -m bench flame [writer|reader|both] --out DIR`` runs the scenario with
py-spy attached to the broker for the timed part only (the untimed drain or
fill before it is not sampled) and writes, each from its own run of the
scenario (py-spy's blocking sampler ptrace-attaches, so two samplers cannot
share one process):

- ``DIR/<scenario>.txt``: collapsed stacks (``--format raw``), from which the top
  15 functions by self and by total samples are printed;
- ``DIR/<scenario>.speedscope.json``: for https://www.speedscope.app;
- ``DIR/<scenario>.svg``: py-spy's flame graph.

With ``--native`` (the default) C frames (CPython's own, libc, the broker's C
extensions) show up as well, so "self" time lands in e.g. ``memcpy`` or
``PyBytes_FromStringAndSize`` rather than in the Python line calling them. If
py-spy cannot sample native stacks here, it falls back to Python frames and says so.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import wire
from bench.broker import BrokerError
from bench.latency import broker_session
from bench.run import SCENARIOS, BenchError, Session, parse_args, result_line
from bench.stacks import frame_counts as _frame_counts
from bench.stacks import strip_line

FORMATS = {"raw": "txt", "speedscope": "speedscope.json", "flamegraph": "svg"}
TRUNK_SHARE = 0.9  # frames in at least this share of the samples: twistd's start-up, the reactor loop


def frame_name(frame: str) -> str:
    """``fn (file)`` without line number or install prefix; unresolved native addresses merged.

    ``0x7f3a... (libc.so.6)`` becomes ``? (libc.so.6)``: the addresses of one
    library without symbols are one entry, not hundreds.
    """
    name = strip_line(frame)
    if name.startswith("0x"):
        return "?" + name[name.find(" ("):] if " (" in name else "?"
    return name


def frame_counts(collapsed: str) -> tuple[collections.Counter, collections.Counter, int]:
    """bench.stacks.frame_counts with `frame_name`: a library's unresolved addresses as one entry."""
    return _frame_counts(collapsed, frame_name)


def top(
    counter: collections.Counter, samples: int, limit: int = 15, below: float | None = None
) -> list[tuple[str, int, float]]:
    """(function, samples, % of all samples), most first; only counts < ``below`` x samples if set."""
    if not samples:
        return []
    ranked = counter.most_common()
    if below is not None:
        ranked = [(f, n) for f, n in ranked if n < below * samples]
    return [(f, n, 100.0 * n / samples) for f, n in ranked[:limit]]


def top_table(collapsed: str, limit: int = 15) -> str:
    """The top ``limit`` by self and by total samples; total leaves out the trunk."""
    own, total, samples = frame_counts(collapsed)
    trunk = sum(1 for n in total.values() if n >= TRUNK_SHARE * samples)
    lines = [f"{samples:,} samples (idle excluded)"]
    for title, counter, below in (("self", own, None), ("total", total, TRUNK_SHARE)):
        note = "" if below is None else (
            f" ({trunk} trunk frames in >= {TRUNK_SHARE:.0%} of samples left out)"
        )
        lines.append(f"top {limit} by {title}{note}:")
        for i, (f, n, pct) in enumerate(top(counter, samples, limit, below), 1):
            lines.append(f"  {i:>2}. {pct:5.1f}%  {n:>7,}  {f}")
    return "\n".join(lines)


def pyspy_path() -> str:
    return shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")


def start_pyspy(pid: int, fmt: str, path: Path, rate: int, native: bool) -> subprocess.Popen:
    argv = [pyspy_path(), "record", "--pid", str(pid), "--format", fmt, "--rate", str(rate),
            "-o", str(path)]
    if native:
        argv.append("--native")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy reads the target's memory layout (and symbols) before sampling
    return proc


def stop_pyspy(proc: subprocess.Popen) -> str:
    """SIGINT (py-spy writes its file then); its stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err.decode(errors="replace")


def native_works(pid: int, out: Path) -> tuple[bool, str]:
    """Try a one-second native recording of ``pid``; (works, py-spy's complaint if not)."""
    probe = out / ".native-probe.txt"
    got = subprocess.run(
        [pyspy_path(), "record", "--pid", str(pid), "--native", "--duration", "1",
         "--format", "raw", "-o", str(probe)],
        capture_output=True, timeout=60,
    )
    ok = got.returncode == 0 and probe.exists()
    probe.unlink(missing_ok=True)
    return ok, (got.stderr.decode(errors="replace").strip().splitlines() or [""])[0]


def profile(session: Session, scenario: str, out: Path, fmt: str, rate: int, native: bool) -> Path:
    """One run of ``scenario`` with py-spy writing ``fmt``; the drain/fill stays unsampled."""
    if scenario == "reader":
        if not session.backlog:
            session.fill()
    elif session.backlog:
        session.drain()
    assert session.broker is not None
    path = out / f"{scenario}.{FORMATS[fmt]}"
    spy = start_pyspy(session.broker.pid, fmt, path, rate, native)
    try:
        res = getattr(session, scenario)()
    finally:
        err = stop_pyspy(spy)
    print(result_line(res, f"{scenario} ({fmt})") + "  [profiled: slower]", flush=True)
    if not path.exists():
        raise BenchError(f"py-spy wrote no {path}: {err.strip()[-500:]}")
    return path


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m bench flame",
        description="py-spy flame graphs of the broker under a bench scenario; any other option "
        "is python -m bench's (--duration, --backend, --writers, ...)",
    )
    p.add_argument("scenario", nargs="?", default="both", choices=SCENARIOS)
    p.add_argument("--out", required=True, type=Path, help="directory for the profiles")
    p.add_argument(
        "--formats", default="raw,speedscope,flamegraph",
        help="py-spy formats, one run each (raw gives the top lists)",
    )
    p.add_argument("--sample-rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--no-native", action="store_true", help="Python frames only")
    p.add_argument("--top", type=int, default=15, help="functions listed by self and by total")
    own, rest = p.parse_known_args(argv)
    own.formats = [f for f in own.formats.split(",") if f]
    bad = [f for f in own.formats if f not in FORMATS]
    if bad or not own.formats:
        p.error(f"--formats: some of {', '.join(FORMATS)}")
    args = parse_args([own.scenario, *rest])
    if args.repeat != 1 or args.nsqd_address:
        p.error("flame profiles one twistd broker run per format (no --repeat, --nsqd-address)")
    return own, args


def main(argv: list[str] | None = None) -> int:
    own, args = parse(sys.argv[1:] if argv is None else argv)
    own.out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        with broker_session(args) as session:
            assert session.broker is not None
            native = not own.no_native
            if native:
                native, why = native_works(session.broker.pid, own.out)
                if not native:
                    print(f"py-spy --native is not permitted here ({why}): "
                          "falling back to Python frames only", flush=True)
            print(f"py-spy {'--native ' if native else ''}at {own.sample_rate} Hz on the broker, "
                  f"one run per format: {', '.join(own.formats)}", flush=True)
            for fmt in own.formats:
                written.append(profile(session, own.scenario, own.out, fmt, own.sample_rate, native))
    except (BenchError, BrokerError, wire.ProtocolError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    raw = own.out / f"{own.scenario}.txt"
    if "raw" in own.formats and raw.exists():
        print()
        print(f"{own.scenario}: {top_table(raw.read_text(), own.top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
