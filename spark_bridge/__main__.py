"""`python -m spark_bridge <command>`: the Spark bridge's command line.

- `snapshot` copies a broker's LMDB environment (a stopped broker's, or a
  running one's from outside its process) so analysis never touches the
  live data;
- `analyze` answers "what is stuck where, since when, and why" with
  PySpark (local by default, `--master` for a cluster) as a terminal
  table and an HTML report;
- `export` writes a snapshot as Parquet for tools outside Spark.

Imports are absolute so spark-submit can run this file directly
(`spark-submit .../spark_bridge/__main__.py analyze SNAPDIR`); pyspark is
imported only by `analyze`, so `snapshot` works without it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from spark_bridge.snapshot import Manifest, SnapshotError, take_snapshot


def summary(manifest: Manifest, path: str) -> str:
    """The manifest in a few lines, with the copy's throughput."""
    mb = manifest.bytes / 1e6
    rate = mb / manifest.copy_seconds if manifest.copy_seconds > 0 else float("inf")
    lines = [
        f"snapshot {path}",
        f"  broker {manifest.broker_id}, taken {manifest.created_at}, format {manifest.data_format}",
        f"  {mb:.1f} MB copied in {manifest.copy_seconds:.3f} s ({rate:.0f} MB/s)",
        f"  {len(manifest.queues)} queues, {manifest.total} messages",
    ]
    for q in manifest.queues:
        where = q.topic if q.channel is None else f"{q.topic} / {q.channel}"
        seqs = "" if q.count == 0 else f"  seq {q.first_seq}..{q.last_seq}"
        lines.append(f"    {where}: {q.count}{seqs}")
    return "\n".join(lines)


def _snapshot(args: argparse.Namespace) -> int:
    out = args.out
    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        out = os.path.join(args.data_path, "snapshots", stamp)
    try:
        manifest = take_snapshot(args.data_path, out, broker_id=args.broker_id)
    except (SnapshotError, OSError) as e:
        print(f"snapshot failed: {e}", file=sys.stderr)
        return 1
    print(summary(manifest, out))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spark_bridge", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    snap = sub.add_parser("snapshot", help="copy a broker's LMDB data to a consistent snapshot")
    snap.add_argument("--data-path", required=True, help="the broker's --data-path (or its mqd.lmdb)")
    snap.add_argument("--out", help="snapshot directory to create (default: DATA_PATH/snapshots/<UTC time>)")
    snap.add_argument("--broker-id", default=socket.gethostname(),
                      help="broker id recorded in the manifest (default: this host's name)")
    snap.set_defaults(run=_snapshot)

    an = sub.add_parser("analyze", help="backlog, ages, sizes, attempts and deferrals per queue, with PySpark")
    an.add_argument("snapshot", metavar="SNAPDIR", help="a snapshot directory")
    an.add_argument("--master", help="Spark master URL (default: spark-submit's, else local[*])")
    an.add_argument("--report", metavar="FILE", help="also write an HTML report with charts here")
    an.add_argument("--json-field", metavar="NAME", help="group JSON bodies by this top-level field")
    an.add_argument("--poison-attempts", type=int, default=None, metavar="N",
                    help="messages tried more than N times are poison (default: 5, as nsq clients)")
    an.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting, as spark-submit's --conf (repeatable)")
    an.add_argument("--partitions", type=int, metavar="N",
                    help="Spark partitions to read with (default: the session's parallelism)")
    an.set_defaults(run=_analyze)

    sm = sub.add_parser("sample", help="write a sample broker backlog (to try the bridge on)")
    sm.add_argument("--data-path", required=True, help="data directory to create (must not exist)")
    sm.add_argument("--messages", type=int, default=100_000, metavar="N")
    sm.add_argument("--body-size", type=int, default=200, metavar="BYTES")
    sm.set_defaults(run=_sample)

    ja = sub.add_parser("jvm-archive", help="build the JVM class archive that halves Spark's start "
                                            "on local masters (~40 s, ~190 MB under ~/.cache/mqd)")
    ja.set_defaults(run=_jvm_archive)

    ex = sub.add_parser("export", help="write a snapshot's messages to Parquet (no Spark needed)")
    ex.add_argument("snapshot", metavar="SNAPDIR", help="a snapshot directory")
    ex.add_argument("--format", choices=["parquet"], default="parquet")
    ex.add_argument("--out", required=True, metavar="FILE", help="the Parquet file to write")
    ex.add_argument("--topic", action="append", help="only this topic (repeatable)")
    ex.add_argument("--channel", action="append", help="only this channel (repeatable)")
    ex.set_defaults(run=_export)
    return p


def _analyze(args: argparse.Namespace) -> int:
    from spark_bridge.analysis import DEFAULT_POISON_ATTEMPTS, analyze
    from spark_bridge.jvm_archive import java_options
    from spark_bridge.report import load_charting, render_text, write_html
    from spark_bridge.session import build_session
    from spark_bridge.snapshot import read_manifest

    try:
        read_manifest(args.snapshot)
    except (OSError, ValueError) as e:
        print(f"analyze failed: {args.snapshot}: not an mqd snapshot ({e})", file=sys.stderr)
        return 1
    # No web UI unless asked for (--conf spark.ui.enabled=true): a short
    # local run does not need one, and it costs start-up time.
    conf = {"spark.ui.enabled": "false"}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"analyze failed: --conf {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        conf[key] = value
    interactive = sys.stderr.isatty()
    launched_here = "PYSPARK_GATEWAY_PORT" not in os.environ  # else spark-submit started the JVM
    started = time.perf_counter()
    if args.report:
        # The driver only waits while the JVM starts: time to load matplotlib.
        threading.Thread(target=load_charting, name="load-charting", daemon=True).start()
    _status(f"starting Spark ({args.master or 'default master'})")
    spark = build_session(args.master, conf=conf, progress=interactive)
    _status(f"Spark ready in {time.perf_counter() - started:.1f} s (master {spark.sparkContext.master})")
    if (launched_here and spark.sparkContext.master.startswith("local")
            and not os.environ.get("MQD_NO_JVM_ARCHIVE") and java_options() is None):
        _status("hint: `python -m spark_bridge jvm-archive` (once, ~1 min) makes Spark start "
                "~3 s faster on this machine")

    def progress(step: int, steps: int, label: str, seconds: float | None) -> None:
        if seconds is None:
            _status(f"[{step}/{steps}] {label} ...")
        else:
            _status(f"[{step}/{steps}] {label}: {seconds:.1f} s")

    try:
        poison = DEFAULT_POISON_ATTEMPTS if args.poison_attempts is None else args.poison_attempts
        result = analyze(spark, args.snapshot, poison_attempts=poison,
                         json_field_name=args.json_field, partitions=args.partitions,
                         progress=progress)
    except BaseException:
        spark.stop()
        raise
    # Everything is collected: Spark shuts down (about a second) while the
    # report is drawn, which needs no Spark.
    stopping = threading.Thread(target=_shut_down, args=(spark,), name="spark-stop")
    stopping.start()
    try:
        print(render_text(result), end="")
        if args.report:
            _status("writing the HTML report ...")
            write_html(result, args.report)
            print(f"\nHTML report: {args.report}")
    finally:
        stopping.join()
    total = time.perf_counter() - started
    rate = result.total / total if total > 0 else 0
    print(f"analyzed {result.total:,} messages in {total:.1f} s ({rate:,.0f} msgs/s, "
          "Spark start included)")
    return 0


def _shut_down(spark) -> None:
    """Stop Spark, then let a JVM this process started exit now rather than when Python does.

    The JVM's own exit (its shutdown hooks, ~1 s) then also happens while
    the report is drawn, not after the command seems done: whoever reads
    our output through a pipe waits for every process holding it. The
    JVM pyspark launches exits when its stdin closes; under spark-submit
    there is no such child (the JVM started us) and nothing more to do.
    """
    from pyspark import SparkContext

    spark.stop()
    launched = SparkContext._gateway.proc  # None under spark-submit
    if launched is not None and launched.stdin is not None:
        launched.stdin.close()
        try:
            launched.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass  # it goes when Python exits, as it would have anyway


def _status(line: str) -> None:
    """Progress on stderr: the tables on stdout stay clean for pipes."""
    print(line, file=sys.stderr, flush=True)


def _export(args: argparse.Namespace) -> int:
    from spark_bridge.export import export_parquet
    from spark_bridge.records import QueueFilter

    where = QueueFilter()
    if args.topic:
        where = where.narrowed("topic", args.topic)
    if args.channel:
        where = where.narrowed("channel", args.channel)
    try:
        result = export_parquet(args.snapshot, args.out, where)
    except (SnapshotError, OSError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    rate = result.rows / result.seconds if result.seconds > 0 else 0
    print(f"exported {result.rows:,} messages to {result.path} ({result.bytes / 1e6:.1f} MB) "
          f"in {result.seconds:.2f} s ({rate:,.0f} msgs/s)")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from spark_bridge.sample import MAX_MESSAGES, write_sample

    if os.path.exists(args.data_path):
        print(f"sample failed: {args.data_path} already exists", file=sys.stderr)
        return 1
    if not 0 < args.messages <= MAX_MESSAGES:
        print(f"sample failed: --messages must be 1..{MAX_MESSAGES}", file=sys.stderr)
        return 2
    try:
        written = write_sample(args.data_path, args.messages, args.body_size)
    except ValueError as e:
        print(f"sample failed: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written['messages']:,} messages ({written['poison']:,} poison, "
          f"{written['deferred']:,} deferred) to {args.data_path}")
    return 0


def _jvm_archive(args: argparse.Namespace) -> int:
    from spark_bridge.jvm_archive import build_archive

    _status("building the JVM class archive (a sample analysis, then java -Xshare:dump) ...")
    started = time.perf_counter()
    try:
        path = build_archive()
    except (RuntimeError, OSError) as e:
        print(f"jvm-archive failed: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(path) / 1e6
    print(f"JVM class archive: {path} ({size:.0f} MB, {time.perf_counter() - started:.0f} s); "
          "local analyses use it from now on")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
