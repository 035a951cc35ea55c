"""``python -m bench spark-bridge``: snapshot + analyze + export of a broker backlog, end to end.

Fills an LMDB data directory with N messages through the real store (``LmdbStore``),
shaped like a broker's backlog: 4 topics with nearly empty topic queues and 2-3
channel queues of uneven sizes, nsqd-style 16-hex-char ids, timestamps over the
last ~6 hours, attempts mostly 0-1 with a tail up to 10 (> 5 is poison), ~2%
deferred, JSON bodies of exactly ``--body-size`` bytes with a ``type`` field of 5
values. Then, each timed on its own:

  1. ``take_snapshot(DATA_DIR, SNAPDIR)`` in-process (copy MB/s from the manifest
     and for the whole call), and ``python -m spark_bridge snapshot`` once as a
     subprocess (wall time including interpreter start);
  2. ``python -m spark_bridge analyze SNAPDIR --master M --json-field type
     --report FILE`` as a subprocess: wall time, msgs/s, its per-step timings
     (parsed from its stderr), peak RSS of its largest process. As on a
     machine set up as the README says: with the JVM class archive, built
     first (not timed) when missing; MQD_NO_JVM_ARCHIVE=1 runs without it;
  3. ``python -m spark_bridge export SNAPDIR --out FILE``: wall time, rows/s.

The fill is timed and printed but is not part of the benchmark. Targets
(1,000,000 x 200 B on local[2]): snapshot >= 500 MB/s, analyze < 25 s end to
end including the SparkSession start.

Usage::

    python -m bench spark-bridge [--messages 1000000] [--body-size 200]
        [--master local[2]] [--workdir DIR] [--keep] [--seed 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from bench.harness.report import heading, machine
from bench.harness.spark_cli import fail, jvm_archive, run_analyze, run_child
from mqd.nsqd.snapshot_format import take_snapshot
from spark_bridge.sample import MAX_MESSAGES, write_sample

TARGET_SNAPSHOT_MBS = 500.0
TARGET_ANALYZE_S = 25.0

now = time.perf_counter


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench spark-bridge",
                                description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--body-size", type=int, default=200, help="bytes per body (default 200)")
    p.add_argument("--master", default="local[2]", help="Spark master for analyze")
    p.add_argument("--workdir", help="where to put data, snapshots, report (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (data, snapshot, report, parquet)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json-field", default="type",
                   help="analyze's --json-field (default type; '' for none)")
    args = p.parse_args(argv)

    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="spark-bridge-bench-", dir=args.workdir)
    print(f"spark_bridge bench: {args.messages:,} messages x {args.body_size} B, "
          f"master {args.master}, {machine()}")
    print(f"workdir {workdir}", flush=True)
    try:
        return run(args, workdir)
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, workdir: str) -> int:
    n = args.messages
    data_dir = os.path.join(workdir, "data")
    snap_dir = os.path.join(workdir, "snap")
    snap_cli_dir = os.path.join(workdir, "snap-cli")
    report = os.path.join(workdir, "report.html")
    parquet = os.path.join(workdir, "snap.parquet")

    # 1. fill (not part of the benchmark)
    t0 = now()
    if n > MAX_MESSAGES:
        print(f"  (warning: more than {MAX_MESSAGES:,} messages, ids may repeat)")
    written = write_sample(data_dir, n, args.body_size, args.seed)
    fill_s = now() - t0
    print(f"fill:      {written['messages']:,} messages in {fill_s:.1f} s "
          f"({written['messages'] / fill_s:,.0f} msgs/s; {written['poison']:,} poison, "
          f"{written['deferred']:,} deferred), data {dir_bytes(data_dir) / 1e6:.1f} MB on disk",
          flush=True)

    # 2. snapshot, in-process from the path, then the CLI once
    t0 = now()
    manifest = take_snapshot(data_dir, snap_dir)
    snap_wall = now() - t0
    mb = manifest.bytes / 1e6
    copy_mbs = mb / manifest.copy_seconds if manifest.copy_seconds > 0 else float("inf")
    call_mbs = mb / snap_wall
    print(f"snapshot:  {mb:.1f} MB, copy {manifest.copy_seconds:.3f} s ({copy_mbs:,.0f} MB/s); "
          f"whole call {snap_wall:.3f} s ({call_mbs:,.0f} MB/s); "
          f"{len(manifest.queues)} queues, {manifest.total:,} messages", flush=True)
    if manifest.total != n:
        print(f"snapshot holds {manifest.total:,} messages, expected {n:,}", file=sys.stderr)
        return 1
    cli = run_child(["snapshot", "--data-path", data_dir, "--out", snap_cli_dir], workdir,
                    "snapshot")
    if cli["rc"] != 0:
        fail("snapshot CLI", cli)
        return 1
    print(f"snapshot CLI: {cli['wall']:.2f} s wall incl. interpreter start "
          f"({mb / cli['wall']:,.0f} MB/s)", flush=True)
    shutil.rmtree(snap_cli_dir, ignore_errors=True)

    # 3. analyze, on a machine set up as documented (the JVM class archive).
    archive = jvm_archive()
    json_args = ["--json-field", args.json_field] if args.json_field else []
    print(f"analyze:   python -m spark_bridge analyze SNAPDIR --master {args.master} "
          f"{' '.join(json_args)} --report report.html "
          f"(JVM class archive: {'yes' if archive else 'no'})", flush=True)
    an = run_analyze([snap_dir, "--master", args.master, *json_args, "--report", report],
                     report, workdir)
    if an is None:
        return 1
    steps = an["steps"]
    print(f"analyze:   {an['wall']:.1f} s wall end to end, {n / an['wall']:,.0f} msgs/s, "
          f"report {os.path.getsize(report) / 1e3:,.0f} kB", flush=True)
    print(f"           peak RSS: largest process {an['single_peak_mb']:,.0f} MB "
          f"({an['single_peak_name']}), whole tree {an['tree_peak_mb']:,.0f} MB (/proc, 100 ms); "
          f"getrusage {an['maxrss_mb']:,.0f} MB (largest waited-for process: the CLI waits for "
          "the JVM it launched)", flush=True)

    # 4. export
    ex = run_child(["export", snap_dir, "--out", parquet], workdir, "export")
    if ex["rc"] != 0 or not os.path.isfile(parquet):
        fail("export", ex)
        return 1
    pq_mb = os.path.getsize(parquet) / 1e6
    print(f"export:    {ex['wall']:.2f} s wall, {n / ex['wall']:,.0f} rows/s, "
          f"parquet {pq_mb:.1f} MB, peak RSS {ex['maxrss_mb']:,.0f} MB", flush=True)

    # 5. targets and table
    snap_ok = copy_mbs >= TARGET_SNAPSHOT_MBS
    an_ok = an["wall"] < TARGET_ANALYZE_S
    full = n == 1_000_000 and args.body_size == 200
    note = "" if full else " (targets are for 1,000,000 x 200 B)"
    print(f"\ntargets{note}:")
    print(f"  snapshot >= {TARGET_SNAPSHOT_MBS:.0f} MB/s: copy {copy_mbs:,.0f} MB/s -> "
          f"{met(snap_ok)}; whole call {call_mbs:,.0f} MB/s -> "
          f"{met(call_mbs >= TARGET_SNAPSHOT_MBS)}")
    print(f"  analyze < {TARGET_ANALYZE_S:.0f} s: {an['wall']:.1f} s -> {met(an_ok)}")

    spark_start = next((s for label, s in steps if label == "SparkSession start"), None)
    print()
    print(heading("mqd spark_bridge bench"))
    print()
    print(f"- data: {n:,} messages x {args.body_size} B, {len(manifest.queues)} queues, "
          f"master {args.master}")
    print()
    print("| step | wall | throughput | target |")
    print("|---|---:|---:|---|")
    print(f"| fill (LmdbStore, untimed) | {fill_s:.1f} s | {n / fill_s:,.0f} msgs/s | |")
    print(f"| snapshot copy ({mb:.0f} MB) | {manifest.copy_seconds:.3f} s | {copy_mbs:,.0f} MB/s "
          f"| >= {TARGET_SNAPSHOT_MBS:.0f} MB/s: {met(snap_ok)} |")
    print(f"| snapshot call (copy + manifest) | {snap_wall:.3f} s | {call_mbs:,.0f} MB/s "
          f"| >= {TARGET_SNAPSHOT_MBS:.0f} MB/s: {met(call_mbs >= TARGET_SNAPSHOT_MBS)} |")
    print(f"| snapshot CLI subprocess | {cli['wall']:.2f} s | {mb / cli['wall']:,.0f} MB/s | |")
    start = f", Spark start {spark_start:.1f} s" if spark_start is not None else ""
    start += ", JVM class archive" if archive else ", no JVM class archive"
    print(f"| analyze ({args.master}{start}) | {an['wall']:.1f} s | {n / an['wall']:,.0f} msgs/s "
          f"| < {TARGET_ANALYZE_S:.0f} s: {met(an_ok)} |")
    print(f"| export to Parquet | {ex['wall']:.2f} s | {n / ex['wall']:,.0f} rows/s | |")
    print(f"\npeak RSS: analyze {an['single_peak_mb']:,.0f} MB largest process "
          f"({an['single_peak_name']}), {an['tree_peak_mb']:,.0f} MB whole tree; "
          f"export {ex['maxrss_mb']:,.0f} MB")
    return 0
