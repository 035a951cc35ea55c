"""`python -m spark_bridge <command>`: the Spark bridge's command line.

Only `snapshot` exists so far: it copies a broker's LMDB environment (a
stopped broker's, or a running one's from outside its process) so the
analysis never touches the live data. `analyze` and `export` are
announced so scripts get a clear error instead of argparse's generic one.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from .snapshot import Manifest, SnapshotError, take_snapshot

NOT_BUILT = ("analyze", "export")


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
    for name in NOT_BUILT:
        sub.add_parser(name, help="not built yet (issue #7)", add_help=False).set_defaults(run=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if args.command in NOT_BUILT:
        print(f"{args.command}: not built yet, issue #7", file=sys.stderr)
        return 2
    if args.command is None:
        p.print_help(sys.stderr)
        return 2
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
