"""``python -m bench flame``: flame graphs of the broker under the bench load.

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
import subprocess
from pathlib import Path

from bench.harness.pyspy import pyspy_path, start_pyspy, stop_pyspy, top_table
from bench.harness.session import (
    SCENARIOS,
    BenchError,
    Session,
    open_session,
    parse_args,
    result_line,
)

FORMATS = {"raw": "txt", "speedscope": "speedscope.json", "flamegraph": "svg"}


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
    spy = start_pyspy(session.broker.pid, path, fmt, rate, native)
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


def main(argv: list[str]) -> int:
    own, args = parse(argv)
    own.out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with open_session(args) as session:
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
    for path in written:
        print(f"wrote {path}")
    raw = own.out / f"{own.scenario}.txt"
    if "raw" in own.formats and raw.exists():
        print()
        print(f"{own.scenario}: {top_table(raw.read_text(), own.top)}")
    return 0
