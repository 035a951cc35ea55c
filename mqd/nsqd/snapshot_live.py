"""A live broker's whole queue state, written as a snapshot (manifest version 2).

A copy of the store's files holds only what the store holds: in the
default mode a backlog that fits `--mem-queue-size` is not in it at all,
nor is anything in flight or deferred. So a broker snapshot has two
halves taken at one reactor instant (`mqd.nsqd.capture`): a read transaction on
the store, opened right after a commit, and the messages the broker holds
outside the store, captured as plain tuples (a message object changes as
soon as the reactor runs on). Everything else happens here, in a thread:
the compact copy of the store in that transaction, then the held
messages written into the copy (never into the live store) as "held
rows", each with its state; a durable store's record of a held message is
removed from the copy, so every message appears once.

Held rows are keyed by their queue id with HELD_BIT set and their rank in
delivery order (queued, then deferred by due time, then in flight by
timeout), after every stored record in key order; their value is HELD's
header then the store's own record format.
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

import lmdb

from backends.lmdb_records import FORMAT, KEY, QID, RECORD
from mqd.nsqd.snapshot_format import (
    DEFERRED,
    HELD,
    HELD_BIT,
    IN_FLIGHT,
    MANIFEST_VERSION,
    QUEUED,
    Manifest,
    QueueInfo,
    SnapshotError,
    copy_store,
    new_snapshot_dir,
    publish_snapshot,
    utc_stamp,
)

__all__ = ["FIELDS", "LiveQueue", "LiveState", "snapshot_estimate", "write_live_snapshot"]

# The attributes of a message a capture takes, in this order (one
# attrgetter call per message): everything of its record, and its store key.
FIELDS = ("key", "id", "timestamp", "attempts", "deferred_until", "body")
# Room for LMDB's own pages around the held rows written into a copy.
_SLACK = 64 << 20
# LMDB's page layout, for the size estimate: page header, node header and
# index slot; a node larger than about half a page goes to overflow pages.
_PAGE_HEADER = 16
_NODE_HEADER = 8
_SLOT = 2
_MIN_KEYS = 2
# Pages of a snapshot's environment besides its records: the two meta
# pages, the roots of its databases, the free list.
_FIXED_PAGES = 16


@dataclass
class LiveQueue:
    """One queue's messages outside the store at the capture instant.

    `queued` holds the queued messages themselves, in delivery order, and
    `queued_keys` / `queued_attempts` / `queued_deferred` their store key,
    attempts and deferral at the instant (a message's id, body and
    timestamp never change; those three do as soon as it is delivered,
    requeued or FINished): a capture takes a reference and three values
    per message, the least the reactor can do (~1 ms per 10,000). The
    few thousand `deferred` and `in_flight` ones are FIELDS tuples paired
    with their due time, and their timeout and client index; all unsorted
    (sorted in the writer's thread, not on the reactor).
    """

    name: str
    topic: str
    channel: str | None
    queue_id: int
    stats: dict[str, int]
    queued: list = field(default_factory=list)
    queued_keys: list = field(default_factory=list)
    queued_attempts: list = field(default_factory=list)
    queued_deferred: list = field(default_factory=list)
    deferred: list[tuple[float, tuple]] = field(default_factory=list)
    in_flight: list[tuple[float, tuple, int]] = field(default_factory=list)

    @property
    def held(self) -> int:
        return len(self.queued) + len(self.deferred) + len(self.in_flight)

    def queued_fields(self) -> Iterator[tuple]:
        """The queued messages as FIELDS tuples, as they were at the instant."""
        for msg, key, attempts, deferred_until in zip(self.queued, self.queued_keys, self.queued_attempts,
                                                      self.queued_deferred, strict=True):
            yield key, msg.id, msg.timestamp, attempts, deferred_until, msg.body


@dataclass
class LiveState:
    """The broker at one instant, as the snapshot writer needs it: no live objects."""

    created_at: datetime
    backend: str
    durable: bool
    queues: list[LiveQueue]
    clients: list[dict[str, str]]
    left_out: list[dict[str, Any]]
    capture_seconds: float

    @cached_property
    def held_bytes(self) -> int:
        """About what the held rows add to a snapshot (keys, headers, bodies): counted once."""
        overhead = KEY.size + HELD.size + RECORD.size
        total = 0
        for q in self.queues:
            total += sum(overhead + m.body_size for m in q.queued)
            total += sum(overhead + len(e[1][-1]) for e in q.deferred)
            total += sum(overhead + len(e[1][-1]) for e in q.in_flight)
        return total


def snapshot_estimate(state: LiveState, env: lmdb.Environment | None = None) -> int:
    """At least the disk the snapshot of `state` (and `env`, the store) will take, in bytes.

    The broker counts this against its snapshot limits before writing
    (run it in a thread: it looks at every held message's size). The
    compact copy of the store is never larger than the pages the store
    uses; a `--durable` store's records of held messages are deleted from
    the copy, which copies each leaf page it touches (at most as many
    pages as there are such records, or as the store has); the held rows
    are appended in key order, filling leaf pages, and a row larger than
    about half a page takes whole overflow pages; the manifest is given
    room for every queue, client and left-out queue.
    """
    if env is not None:
        psize = env.stat()["psize"]
        store_pages = env.info()["last_pgno"] + 1
    else:
        psize = mmap.PAGESIZE
        store_pages = 0
    stored_held = sum(len(_stored_keys(q)) for q in state.queues) if env is not None else 0
    node_max = ((psize - _PAGE_HEADER) // _MIN_KEYS & -2) - _SLOT
    header = HELD.size + RECORD.size
    usable = psize - _PAGE_HEADER
    leaf_pages = overflow_pages = 0
    fill = usable  # the first row starts a page
    # Rows are appended in key order: a leaf page takes rows until the next does not fit.
    for q in sorted(state.queues, key=lambda q: q.queue_id):
        sizes = [m.body_size for m in q.queued]
        sizes += [len(e[1][-1]) for e in q.deferred]
        sizes += [len(e[1][-1]) for e in q.in_flight]
        for size in sizes:
            value = header + size
            node = _NODE_HEADER + KEY.size + value
            if node > node_max:
                # The leaf keeps the key and the first overflow page's number.
                overflow_pages += -(-(_PAGE_HEADER + value) // psize)
                node = _NODE_HEADER + KEY.size + 8
            node += (node & 1) + _SLOT
            if fill + node > usable:
                leaf_pages += 1
                fill = 0
            fill += node
    # Branch pages: one entry (a key and a page number) per child page.
    branch_pages = -(-(leaf_pages + overflow_pages) * (_NODE_HEADER + KEY.size + _SLOT) // psize) + 1
    manifest = 4096 + 1024 * (len(state.queues) + len(state.clients) + len(state.left_out))
    pages = (store_pages + min(stored_held, store_pages) + leaf_pages + overflow_pages + branch_pages
             + _FIXED_PAGES)
    return pages * psize + manifest


def _held_rows(queue: LiveQueue) -> list[tuple[bytes, bytes]]:
    """The queue's held rows in key order: (key, value)."""
    pack_key, pack_held, pack_record = KEY.pack, HELD.pack, RECORD.pack
    unpack_key = KEY.unpack
    qid = queue.queue_id | HELD_BIT
    rows = []
    rank = 0

    def add(state: int, timeout_at: float, client: int, fields: tuple) -> None:
        nonlocal rank
        key, msg_id, timestamp, attempts, deferred_until, body = fields
        seq = -1 if key is None else unpack_key(key)[1]
        rows.append((pack_key(qid, rank),
                     pack_held(state, timeout_at, client, seq)
                     + pack_record(timestamp, attempts & 0xFFFF, deferred_until, msg_id) + body))
        rank += 1

    for fields in queue.queued_fields():
        add(QUEUED, 0.0, -1, fields)
    for _due, fields in sorted(queue.deferred, key=_first):
        add(DEFERRED, 0.0, -1, fields)
    for timeout_at, fields, client in sorted(queue.in_flight, key=_first):
        add(IN_FLIGHT, timeout_at, client, fields)
    return rows


def _first(entry: tuple) -> Any:
    return entry[0]


def _stored_keys(queue: LiveQueue) -> list[bytes]:
    """Store keys of the held messages: a durable store still has their records."""
    keys = list(queue.queued_keys)
    keys += [f[0] for _, f in queue.deferred]
    keys += [f[0] for _, f, _ in queue.in_flight]
    return [k for k in keys if k is not None]


def write_live_snapshot(state: LiveState, out_dir: str | os.PathLike, *, env: lmdb.Environment | None = None,
                        txn: lmdb.Transaction[bytes] | None = None, broker_id: str | None = None,
                        node_id: int | None = None) -> Manifest:
    """Write the snapshot of `state` (plus what `txn` sees of `env`, an LMDB store) to `out_dir`.

    Run in a thread. `txn` is the read transaction opened at the capture
    instant; it is aborted here, whatever happens.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    try:
        tmp = new_snapshot_dir(out_dir)
    except BaseException:
        if txn is not None:
            txn.abort()
        raise
    try:
        stored: dict[int, QueueInfo] = {}
        seconds = 0.0
        if env is not None and txn is not None:
            try:
                _, queues, seconds = copy_store(env, txn, tmp)
            finally:
                txn.abort()
            stored = {q.queue_id: q for q in queues}
        removed = _write_held(tmp, state, fresh=env is None)
        live = {q.queue_id: q for q in state.queues}
        infos = []
        for qid in sorted(set(stored) | set(live)):
            infos.append(_queue_info(stored.get(qid), live.get(qid), removed.get(qid, 0)))
        infos.sort(key=lambda q: q.name)
        manifest = Manifest(
            format_version=MANIFEST_VERSION,
            broker_id=broker_id,
            node_id=node_id,
            created_at=utc_stamp(state.created_at),
            data_format=FORMAT.decode(),
            queues=infos,
            copy_seconds=seconds,
            source="broker",
            backend=state.backend,
            durable=state.durable,
            clients=state.clients,
            left_out=state.left_out,
            capture_seconds=state.capture_seconds,
        )
        return publish_snapshot(tmp, out_dir, manifest)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, lmdb.Error | OSError):
            # A full disk, say: one line for the operator, not a traceback.
            raise SnapshotError(f"{out_dir}: cannot write the snapshot ({e})") from None
        raise


def _write_held(tmp: str, state: LiveState, fresh: bool) -> dict[int, int]:
    """Put every held row into the snapshot's environment in `tmp`; stored records removed, by queue.

    `fresh`: no store was copied (memory or dummy backend), so the
    environment, its format mark and the queue registry are made here.
    """
    data_file = os.path.join(tmp, "data.mdb")
    size = os.path.getsize(data_file) if os.path.exists(data_file) else 0
    map_size = size + 2 * state.held_bytes + _SLACK
    removed: dict[int, int] = {}
    # No lock file: this thread is the only user of the private directory,
    # and a reader of the finished snapshot takes no LMDB lock either.
    env = lmdb.open(tmp, map_size=map_size, max_dbs=8, subdir=True, sync=False, metasync=False,
                    readahead=False, lock=False)
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn)
            registry = env.open_db(b"queues", txn=txn)
            data = env.open_db(b"messages", txn=txn)
            if fresh:
                txn.put(b"format", FORMAT, db=meta)
                for q in state.queues:
                    txn.put(q.name.encode(), QID.pack(q.queue_id), db=registry)
            for q in state.queues:
                gone = 0
                for key in _stored_keys(q):
                    if txn.delete(key, db=data):
                        gone += 1
                removed[q.queue_id] = gone
            cursor = txn.cursor(db=data)
            for q in sorted(state.queues, key=lambda q: q.queue_id):
                rows = _held_rows(q)
                if rows:
                    cursor.putmulti(rows, append=True)
        env.sync(True)
    finally:
        env.close()
    return removed


def _queue_info(stored: QueueInfo | None, live: LiveQueue | None, removed: int) -> QueueInfo:
    """The manifest's entry of a queue: its stored rows (less the held ones) plus its held rows."""
    if live is None:
        # In the store but not the broker (cannot happen for a queue the
        # broker has open): report its records as they are.
        assert stored is not None
        return stored
    stored_count = (stored.count - removed) if stored is not None else 0
    first = stored.first_seq if stored is not None and stored_count else None
    last = stored.last_seq if stored is not None and stored_count else None
    return QueueInfo(
        name=live.name, topic=live.topic, channel=live.channel, queue_id=live.queue_id,
        count=stored_count + live.held, first_seq=first, last_seq=last,
        stored=stored_count, held=live.held,
        queued=stored_count + len(live.queued), in_flight=len(live.in_flight),
        deferred=len(live.deferred), stats=dict(live.stats),
    )
