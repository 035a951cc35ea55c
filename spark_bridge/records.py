"""A snapshot's messages as Arrow record batches, and how to split them into partitions.

This is the one decoder of snapshot records outside the broker: the Spark
data source (`datasource.py`) runs it in Spark's Python workers and the
Parquet export runs it in a plain process, so both produce the same rows.
It needs pyarrow and numpy, not Spark.

Decoding is vectorised because it is the whole cost of a scan: records are
gathered as two lists of bytes (keys, values; lists of tuples doubled the
time through the garbage collector's work on that many small tuples), turned into one
Arrow binary array, and the fixed 34-byte record header is cut out of its
data buffer with numpy. Python touches each record once, in the cursor
loop.

A partition is a list of key ranges. Spark's Python tasks cost ~45 ms each
here, so a scan is planned as about one partition per core, several
queues' ranges packed into each, a large queue split by sequence number.
"""

from __future__ import annotations

import math
import os
import weakref
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any, cast

import lmdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from backends.lmdb_records import KEY, RECORD
from mqd.nsqd.snapshot_format import (
    DATA_FILE,
    HELD,
    HELD_BIT,
    STATES,
    Manifest,
    QueueInfo,
    SnapshotError,
    hold_snapshot,
    kind_of,
    read_manifest,
)

__all__ = [
    "ARROW_SCHEMA",
    "BATCH_ROWS",
    "KeyRange",
    "QueueFilter",
    "SPARK_SCHEMA_DDL",
    "open_snapshot",
    "plan_partitions",
    "read_ranges",
    "snapshot_ranges",
]

# One row per message. Spark's Python data source checks every batch
# against this exactly, nullability included (DATA_SOURCE_RETURN_SCHEMA_MISMATCH
# otherwise; Spark DDL columns are nullable), so
# the Arrow and the Spark spelling are kept side by side.
_UTC_US = pa.timestamp("us", tz="UTC")
ARROW_SCHEMA = pa.schema([
    pa.field("topic", pa.string()),
    pa.field("channel", pa.string()),  # null for a topic's own queue
    pa.field("kind", pa.string()),  # "topic" or "channel"
    pa.field("state", pa.string()),  # "queued", "in_flight" or "deferred"
    pa.field("sequence", pa.int64()),  # position in its queue's store (null: never stored)
    pa.field("message_id", pa.string()),  # nsqd's 16 hex characters
    pa.field("timestamp", _UTC_US),  # when it was published
    pa.field("attempts", pa.int32()),
    pa.field("deferred_until", _UTC_US),  # null unless deferred (DPUB / REQ with delay)
    pa.field("in_flight_client", pa.string()),  # the holder's address; null unless in flight
    pa.field("timeout_at", _UTC_US),  # when it times out; null unless in flight
    pa.field("body_size", pa.int32()),
    pa.field("body", pa.binary()),
])
SPARK_SCHEMA_DDL = (
    "topic string, channel string, kind string, state string, sequence bigint, "
    "message_id string, timestamp timestamp, attempts int, deferred_until timestamp, "
    "in_flight_client string, timeout_at timestamp, body_size int, body binary"
)

BATCH_ROWS = 65536
# Batches are kept under this many bytes of records (one larger record alone).
BATCH_BYTES = 64 << 20
# Records in the first read of a scan, before their size is known.
_FIRST_ROWS = 256
_RECORD_FIELDS = [("ts", ">i8"), ("attempts", ">u2"), ("deferred", ">f8"), ("id", "S16")]
_KEY_DTYPE = np.dtype([("qid", ">u4"), ("seq", ">u8")])
_HEADER_DTYPE = np.dtype(_RECORD_FIELDS)
# A held row's header: HELD's fields, then the record's.
_HELD_HEADER_DTYPE = np.dtype([("state", "u1"), ("timeout", ">f8"), ("client", ">i4"), ("store_seq", ">i8"),
                               *_RECORD_FIELDS])
assert _KEY_DTYPE.itemsize == KEY.size and _HEADER_DTYPE.itemsize == RECORD.size
assert _HELD_HEADER_DTYPE.itemsize == HELD.size + RECORD.size
_STATE_NAMES = pa.array(STATES, pa.string())
_QUEUED = pa.scalar(STATES[0], pa.string())
_BODY_END = 2**31 - 1  # pc.binary_slice needs an explicit stop


@dataclass(frozen=True)
class KeyRange:
    """The records of one queue with `first <= seq <= last`; `count` is an estimate for planning.

    `held`: the queue's held rows (what a live broker held outside its
    store, keyed under queue_id | HELD_BIT), which name their in-flight
    client by an index into `clients`.
    """

    queue_id: int
    topic: str
    channel: str | None
    first: int
    last: int
    count: int
    held: bool = False
    clients: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return kind_of(self.channel)

    @property
    def key_id(self) -> int:
        """The queue id its keys carry."""
        return self.queue_id | HELD_BIT if self.held else self.queue_id


@dataclass(frozen=True)
class QueueFilter:
    """Which queues a scan reads: the topic/channel filters pushed down by Spark (None = any).

    Each set holds the values allowed; `channel` may contain None, meaning
    the topic's own queue. The filters are ANDed, as Spark pushes them.
    """

    topics: frozenset[str] | None = None
    channels: frozenset[str | None] | None = None
    kinds: frozenset[str] | None = None

    def admits(self, q: QueueInfo) -> bool:
        return ((self.topics is None or q.topic in self.topics)
                and (self.channels is None or q.channel in self.channels)
                and (self.kinds is None or q.kind in self.kinds))

    def narrowed(self, column: str, allowed: Iterable[str | None]) -> QueueFilter:
        """This filter ANDed with `column IN allowed`."""
        field = {"topic": "topics", "channel": "channels", "kind": "kinds"}[column]
        new, old = frozenset(allowed), getattr(self, field)
        changes: dict[str, Any] = {field: new if old is None else old & new}
        return replace(self, **changes)


def snapshot_ranges(manifest: Manifest, where: QueueFilter | None = None) -> list[KeyRange]:
    """A range per queue the filter admits with stored rows, then one per queue with held rows, in key order."""
    queues = [q for q in sorted(manifest.queues, key=lambda q: q.queue_id)
              if where is None or where.admits(q)]
    clients = tuple(c.get("remote_address", "") for c in manifest.clients)
    # A queue with stored rows has their seq range.
    stored = [KeyRange(q.queue_id, q.topic, q.channel, cast(int, q.first_seq), cast(int, q.last_seq),
                       q.stored)
              for q in queues if q.stored]
    held = [KeyRange(q.queue_id, q.topic, q.channel, 0, q.held - 1, q.held, True, clients)
            for q in queues if q.held]
    return stored + held


def plan_partitions(ranges: Sequence[KeyRange], partitions: int) -> list[list[KeyRange]]:
    """Split the ranges into at most `partitions` lists of about equal row counts.

    Ranges are taken in key order and packed; one that does not fit in what
    is left of a partition is cut by sequence number, assuming its records
    spread evenly over first..last (holes left by FINs in durable mode make
    the counts estimates; every record is still read exactly once, because
    the cuts tile the sequence range). Never more partitions than rows.
    """
    total = sum(r.count for r in ranges)
    if total == 0:
        return []
    n = max(1, min(partitions, total))
    target = math.ceil(total / n)
    plan: list[list[KeyRange]] = [[]]
    room = target
    for r in ranges:
        first, count = r.first, r.count
        while count:
            if room == 0:
                plan.append([])
                room = target
            if count <= room:
                plan[-1].append(replace(r, first=first, count=count))
                room -= count
                break
            # Cut: the first `room` of an estimated `count` records.
            span = r.last - first + 1
            cut = first + max(1, span * room // count) - 1
            plan[-1].append(replace(r, first=first, last=cut, count=room))
            first, count, room = cut + 1, count - room, 0
    return plan


def open_snapshot(snapshot_dir: str | os.PathLike[str]) -> tuple[Manifest, lmdb.Environment]:
    """The manifest and a read-only handle on a finished snapshot (nothing writes it: no LMDB lock).

    The snapshot is held (`hold_snapshot`: the broker removes no snapshot a
    reader holds) until the environment is garbage collected, which for
    every caller here is right after it closes it.
    """
    path = os.fspath(snapshot_dir)
    hold = hold_snapshot(path)
    try:
        manifest = read_manifest(path)
        if not os.path.exists(os.path.join(path, DATA_FILE)):
            raise SnapshotError(f"{path}: not an mqd snapshot (no {DATA_FILE})")
        env = lmdb.open(path, readonly=True, lock=False, max_dbs=8, subdir=True, readahead=True)
    except BaseException:
        hold.close()
        raise
    weakref.finalize(env, hold.close)
    return manifest, env


def read_ranges(env: lmdb.Environment, ranges: Iterable[KeyRange], batch_rows: int = BATCH_ROWS,
                bodies: bool = True) -> Iterator[pa.RecordBatch]:
    """Record batches of every record in the ranges, in key order; a batch never spans queues.

    `bodies=False` leaves the body column null (body_size stays right):
    Spark prunes no columns of a Python data source, so a job that never
    looks at bodies would otherwise ship every one of them to the JVM.

    Keys and values come from two cursors in step, each drained by
    `islice` into a list in C: no Python bytecode runs per record (a
    per-record loop was 60 % of a scan). The range's end is found by
    bisecting the sorted keys.

    Bodies may be up to max-msg-size each, and one Arrow binary array holds
    at most 2 GiB: the first read is small, later ones are sized by the
    largest record seen, and a read over BATCH_BYTES is cut into several
    batches by size.
    """
    messages = env.open_db(b"messages", create=False)
    pack = KEY.pack
    rows = min(batch_rows, _FIRST_ROWS)
    with env.begin(db=messages, buffers=False) as txn:
        key_cursor, value_cursor = txn.cursor(), txn.cursor()
        for r in ranges:
            start, end = pack(r.key_id, r.first), pack(r.key_id, r.last)
            if not key_cursor.set_range(start) or not value_cursor.set_range(start):
                continue
            keys_it = key_cursor.iternext(keys=True, values=False)
            values_it = value_cursor.iternext(keys=False, values=True)
            while True:
                wanted = rows
                keys = list(islice(keys_it, wanted))
                if not keys:
                    break
                values = list(islice(values_it, len(keys)))
                done = keys[-1] > end
                if done:
                    cut = bisect_right(keys, end)
                    del keys[cut:], values[cut:]
                if keys:
                    sizes = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
                    for lo, hi in _byte_slices(sizes):
                        if hi - lo == len(keys):
                            yield _batch(r, keys, values, sizes, bodies)
                        else:
                            yield _batch(r, keys[lo:hi], values[lo:hi], sizes[lo:hi], bodies)
                    rows = min(batch_rows, max(16, BATCH_BYTES // int(sizes.max())))
                if done or len(keys) < wanted:
                    break


def _byte_slices(sizes: np.ndarray) -> Iterator[tuple[int, int]]:
    """[lo, hi) index ranges of at most BATCH_BYTES each (a larger record alone)."""
    n = len(sizes)
    total = np.cumsum(sizes)
    if total[-1] <= BATCH_BYTES:
        yield 0, n
        return
    lo, base = 0, 0
    while lo < n:
        hi = max(lo + 1, int(np.searchsorted(total, base + BATCH_BYTES, side="right")))
        yield lo, hi
        base, lo = int(total[hi - 1]), hi


def _batch(r: KeyRange, keys: list[bytes], values: list[bytes], sizes: np.ndarray,
           bodies: bool) -> pa.RecordBatch:
    n = len(keys)
    dtype = _HELD_HEADER_DTYPE if r.held else _HEADER_DTYPE
    size = dtype.itemsize
    # The values as one Arrow binary array built from a join and their
    # lengths (4x faster than pa.array on the list).
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:], dtype=np.int32)
    raw = pa.BinaryArray.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(values))])
    # Every header is `size` bytes, so the sliced headers are one contiguous
    # run of fixed-size records numpy reads in place.
    headers = pc.binary_slice(raw, 0, size)
    first = np.frombuffer(headers.buffers()[1], dtype=np.int32, count=1, offset=4 * headers.offset)[0]
    header = np.frombuffer(headers.buffers()[2], dtype=dtype, count=n, offset=int(first))
    deferred = header["deferred"].astype(np.float64)
    if r.held:
        state = _STATE_NAMES.take(pa.array(header["state"].astype(np.int32)))
        store_seq = header["store_seq"].astype(np.int64)
        sequence = pa.array(store_seq, pa.int64(), mask=store_seq < 0)
        client = header["client"].astype(np.int64)
        names = pa.array(r.clients + ("",), pa.string())
        in_flight_client = names.take(pa.array(np.where(client < 0, len(r.clients), client), pa.int64()))
        in_flight_client = pc.if_else(pa.array(client < 0), pa.scalar(None, pa.string()), in_flight_client)
        timeout = header["timeout"].astype(np.float64)
        timeout_at = pa.array(np.rint(timeout * 1e6).astype(np.int64), _UTC_US, mask=timeout <= 0)
    else:
        state = pa.repeat(_QUEUED, n)
        sequence = pa.array(np.frombuffer(b"".join(keys), dtype=_KEY_DTYPE)["seq"].astype(np.int64),
                            pa.int64())
        in_flight_client = pa.nulls(n, pa.string())
        timeout_at = pa.nulls(n, _UTC_US)
    columns = [
        pa.repeat(pa.scalar(r.topic, pa.string()), n),
        pa.repeat(pa.scalar(r.channel, pa.string()), n),
        pa.repeat(pa.scalar(r.kind, pa.string()), n),
        state,
        sequence,
        pa.array(header["id"], pa.binary(16)).cast(pa.binary()).cast(pa.string()),
        pa.array(header["ts"].astype(np.int64) // 1000, _UTC_US),
        pa.array(header["attempts"].astype(np.int32), pa.int32()),
        pa.array(np.rint(deferred * 1e6).astype(np.int64), _UTC_US, mask=deferred <= 0),
        in_flight_client,
        timeout_at,
        pa.array(np.diff(offsets) - size, pa.int32()),
        pc.binary_slice(raw, size, _BODY_END) if bodies else pa.nulls(n, pa.binary()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
