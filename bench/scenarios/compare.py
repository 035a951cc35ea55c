"""``python -m bench compare``: an old mqd build, this checkout and the ceiling probe in one session.

A change to the broker's hot path is judged by the new build's figures against
the old build's and against the ceiling probe (bench/harness/probe.py: what one
Twisted process can relay at all), and figures taken at different times on a
shared machine do not compare. So the
three targets run the same load in one session, interleaved per repetition
(old, new, probe, old, new, probe, ...), each on a fresh broker process, and
each target's medians are set against the probe's and the old build's.

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

from bench.harness.broker import ERRORS, REPO, BenchError, broker_command
from bench.harness.report import fmt, heading, percent, ratio, save_json
from bench.harness.session import (
    SCENARIOS,
    Result,
    load_line,
    median_result,
    open_session,
    result_line,
)
from bench.harness.session import parse_args as bench_parse_args

# The build before the hot-path rework: the default "old build" the new one is measured against.
BASELINE = "22852c4d7f22d935be598c0148061f628097d6fb"
TARGETS = ("old", "new", "probe")


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


def target_argv(target: str, args: argparse.Namespace, old_tree: Path | None) -> list[str]:
    """The broker command of a target; ``{data}`` is replaced by Broker."""
    if target == "probe":
        return [sys.executable, "-m", "bench.harness.probe", "--tcp-address=127.0.0.1:0"]
    cmd = broker_command(args.backend, args.mem_queue_size, "{data}", args.broker_arg)
    if target == "old":
        # Broker puts this checkout on PYTHONPATH; env replaces it with the old tree (and execs,
        # so the pid the sampler watches is twistd's).
        return ["env", f"PYTHONPATH={old_tree}", *cmd]
    return cmd


def run_target(target: str, args: argparse.Namespace, argv: list[str], label: str) -> list[Result]:
    """One fresh broker, the scenarios in order, the broker stopped again."""
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    results = []
    with open_session(args, argv=argv, verbose=False) as session:
        for name in scenarios:
            res = getattr(session, name)()
            results.append(res)
            print(result_line(res, f"{target:<5} {name:<6} {label}"), flush=True)
    return results


def _ratio(new: float | None, base: float | None) -> str:
    return fmt(ratio(base, new), ".2f")


def table(medians: dict[str, dict[str, Result]], scenarios: tuple[str, ...]) -> list[str]:
    """Markdown rows: per scenario and target, msgs/s and the ratios to the probe and old build."""
    lines = [
        "| run | build | msgs/s in | msgs/s out | in ÷ probe | out ÷ probe | in ÷ old | out ÷ old "
        "| broker CPU | peak RSS (MB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in scenarios:
        probe = medians.get("probe", {}).get(name)
        old = medians.get("old", {}).get(name)
        for target in TARGETS:
            r = medians.get(target, {}).get(name)
            if r is None:
                continue
            vs_old = target == "new" and old is not None
            lines.append(
                f"| {name} | {target} | {fmt(r.rate_in)} | {fmt(r.rate_out)} "
                f"| {_ratio(r.rate_in, probe and probe.rate_in) if target != 'probe' else '-'} "
                f"| {_ratio(r.rate_out, probe and probe.rate_out) if target != 'probe' else '-'} "
                f"| {_ratio(r.rate_in, old.rate_in) if vs_old else '-'} "
                f"| {_ratio(r.rate_out, old.rate_out) if vs_old else '-'} "
                f"| {percent(r.cpu_pct)} | {fmt(r.rss_mb)} |"
            )
    return lines


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="python -m bench compare",
        description="Old mqd build vs this checkout vs the ceiling probe (bench/harness/probe.py), "
        "interleaved in one session; medians per target.",
        epilog="Any other flag of `python -m bench` (--duration, --backend, --batch, --writers, "
        "--broker-arg=..., --json, ...) applies to every target (the probe ignores broker flags).",
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
        default=",".join(TARGETS),
        help="comma-separated subset of old,new,probe (in this order within a repetition)",
    )
    mine, rest = p.parse_known_args(argv)
    targets = tuple(t.strip() for t in mine.targets.split(",") if t.strip())
    if not targets or set(targets) - set(TARGETS):
        p.error(f"--targets takes a subset of {','.join(TARGETS)}")
    mine.targets = tuple(t for t in TARGETS if t in targets)
    if mine.repeat < 1:
        p.error("--repeat must be at least 1")
    args = bench_parse_args([*rest, "--repeat", str(mine.repeat)])
    if args.nsqd_address or args.broker_cmd:
        p.error("compare starts its own brokers: no --nsqd-address, --nsqd-bin or --broker-cmd")
    return mine, args


def main(argv: list[str]) -> int:
    mine, args = parse_args(argv)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    try:
        old_rev = git("rev-parse", "--verify", f"{mine.old}^{{commit}}")
    except subprocess.CalledProcessError:
        print(f"error: unknown revision {mine.old!r}", file=sys.stderr)
        return 2
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
    lines = [
        heading(
            "mqd compare",
            f"{datetime.datetime.now(datetime.UTC):%H:%M} UTC",
            f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after",
        ),
        "",
        f"- old: `{old_rev[:10]}` ({mine.old}); new: `{new_desc}`; probe: bench/harness/probe.py",
        f"- mqd flags: `{flags}`",
        f"- load: {load_line(args)}; median of {args.repeat}, targets interleaved "
        f"({', '.join(mine.targets)}) per repetition, a fresh broker each",
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
