"""Snapshots with exactly known content, for the Spark bridge's tests.

`build_snapshot(tmp_path, queues)` writes the messages into a fresh
LmdbStore (one queue per name, `topic` or `topic:channel`, in the dict's
order, so queue ids follow it), commits, takes a snapshot and returns its
directory. `expected_rows(queues)` is what reading that snapshot must give:
one dict per message, in the column order and Python types of
`pyarrow.RecordBatch.to_pylist()` (timestamps as aware UTC datetimes).

`STANDARD_QUEUES` is the content most tests share: several topics, topic
queues and channel queues, an empty queue, messages with attempts, deferred
messages, an empty body and a large one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from twisted.internet.task import Clock

from backends.lmdb import LmdbStore
from mqd.message import Message
from mqd.nsqd.snapshot_format import take_snapshot
from mqd.nsqd.snapshot_live import LiveQueue, LiveState, write_live_snapshot

__all__ = ["Held", "STANDARD_QUEUES", "build_snapshot", "expected_rows", "message", "messages", "micros"]

# 2023-11-14T22:13:20.123456789Z: sub-microsecond digits, so the ns -> us
# conversion is visible.
BASE_TS_NS = 1_700_000_000_123_456_789
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def message(n: int, body: bytes | None = None, *, timestamp: int | None = None,
            attempts: int = 0, deferred_until: float = 0.0) -> Message:
    """Message number `n`: id `%016x`, body `m<n>` unless given, published at BASE_TS_NS + n ms."""
    return Message(b"%016x" % n, b"m%d" % n if body is None else body,
                   BASE_TS_NS + n * 1_000_000 if timestamp is None else timestamp,
                   attempts, deferred_until)


def messages(count: int, start: int = 0, prefix: bytes = b"m", **kwargs: Any) -> list[Message]:
    """`count` messages numbered from `start`, bodies `<prefix><n>`."""
    return [message(n, prefix + b"%d" % n, **kwargs) for n in range(start, start + count)]


def utc_us(us: int) -> datetime:
    """Microseconds since the epoch as the aware UTC datetime Arrow gives back."""
    return _EPOCH + timedelta(microseconds=us)


def micros(value: datetime) -> int:
    """An aware datetime as microseconds since the epoch (exact)."""
    delta = value - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


@dataclass(frozen=True)
class Held:
    """A message a live broker held outside its store: its state, and when in flight, its timeout and client."""

    state: str
    message: Message
    timeout_at: float = 0.0
    client: int = -1


def build_snapshot(tmp_path: str | os.PathLike, queues: Mapping[str, list[Message]], *,
                   holes: Mapping[str, Iterable[int]] | None = None, name: str = "snap",
                   held: Mapping[str, list[Held]] | None = None, clients: Sequence[str] = (),
                   ) -> Path:
    """Write `queues` into a new store under tmp_path, snapshot it, return the snapshot directory.

    Queue `name` gets its messages at sequence numbers 0, 1, ...; `holes`
    names, per queue, sequence numbers removed again after the first commit
    (as FINs leave them in durable mode), so the snapshot's key ranges have
    gaps. With `held` the snapshot is a live broker's (manifest version 2,
    written by mqd.nsqd.snapshot_live): those messages are its held rows, in
    flight ones held by `clients[client]`. The Message objects given are
    not modified.
    """
    base = Path(tmp_path)
    options = SimpleNamespace(data_path=str(base / f"{name}-data"), durable=False,
                              sync_every=10**9, sync_timeout=0)
    store = LmdbStore(options, Clock())
    try:
        stored: dict[str, list[Message]] = {}
        for queue_name, msgs in queues.items():
            stored[queue_name] = [m.copy() for m in msgs]
            store.open_queue(queue_name).put(stored[queue_name])
        store.commit()
        for queue_name, seqs in (holes or {}).items():
            store.open_queue(queue_name).finish([stored[queue_name][s] for s in seqs])
        store.commit()
        out = base / name
        if held is None:
            take_snapshot(store.env, out, broker_id="test-broker", node_id=3)
        else:
            state = _live_state(store, queues, holes or {}, held, clients)
            store.commit()
            write_live_snapshot(state, out, env=store.env, txn=store.env.begin(buffers=False),
                                broker_id="test-broker", node_id=3)
    finally:
        store.close()
    return out


def _live_state(store: LmdbStore, queues: Mapping[str, list[Message]], holes: Mapping[str, Iterable[int]],
                held: Mapping[str, list[Held]], clients: Sequence[str]) -> LiveState:
    live = []
    for queue_name in _queue_order(queues, held):
        topic, _, channel = queue_name.partition(":")
        entries = held.get(queue_name, [])
        stored = len(queues.get(queue_name, [])) - len(set(holes.get(queue_name, ())))
        q = LiveQueue(queue_name, topic, channel or None, store.open_queue(queue_name).qid, stats={})
        for h in entries:
            m = h.message
            fields = (None, m.id, m.timestamp, m.attempts, m.deferred_until, m.body)
            if h.state == "queued":
                q.queued.append(m)
                q.queued_keys.append(None)
                q.queued_attempts.append(m.attempts)
                q.queued_deferred.append(m.deferred_until)
            elif h.state == "deferred":
                q.deferred.append((m.deferred_until, fields))
            else:
                q.in_flight.append((h.timeout_at, fields, h.client))
        q.stats = {"depth": stored + len(q.queued), "in_flight_count": len(q.in_flight),
                   "deferred_count": len(q.deferred)}
        live.append(q)
    return LiveState(created_at=datetime.now(UTC), backend="lmdb", durable=False, queues=live,
                     clients=[{"remote_address": c, "client_id": c, "hostname": c, "user_agent": "test"}
                              for c in clients],
                     left_out=[], capture_seconds=0.0)


def _queue_order(queues: Mapping[str, Any], held: Mapping[str, Any]) -> list[str]:
    """Queue names in queue id order: build_snapshot opens `queues`' first, then held-only ones."""
    return list(queues) + [name for name in held if name not in queues]


def _held_rows(queue_name: str, entries: list[Held], clients: Sequence[str]) -> list[dict[str, Any]]:
    """A queue's held rows in the writer's order: queued, deferred by due, in flight by timeout."""
    order = ([h for h in entries if h.state == "queued"]
             + sorted((h for h in entries if h.state == "deferred"), key=lambda h: h.message.deferred_until)
             + sorted((h for h in entries if h.state == "in_flight"), key=lambda h: h.timeout_at))
    rows = []
    for h in order:
        row = _row(queue_name, None, h.message)
        row["state"] = h.state
        if h.state == "in_flight":
            row["in_flight_client"] = clients[h.client] if h.client >= 0 else None
            row["timeout_at"] = utc_us(round(h.timeout_at * 1_000_000))
        rows.append(row)
    return rows


def _row(queue_name: str, seq: int | None, m: Message) -> dict[str, Any]:
    topic, _, channel = queue_name.partition(":")
    return {
        "topic": topic,
        "channel": channel or None,
        "kind": "channel" if channel else "topic",
        "state": "queued",
        "sequence": seq,
        "message_id": m.id.decode(),
        "timestamp": utc_us(m.timestamp // 1000),
        "attempts": m.attempts,
        "deferred_until": utc_us(round(m.deferred_until * 1_000_000)) if m.deferred_until else None,
        "in_flight_client": None,
        "timeout_at": None,
        "body_size": len(m.body),
        "body": m.body,
    }


def expected_rows(queues: Mapping[str, list[Message]],
                  holes: Mapping[str, Iterable[int]] | None = None,
                  held: Mapping[str, list[Held]] | None = None,
                  clients: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The rows a reader of `build_snapshot(..., queues, holes=holes, held=held)` gives, in key order."""
    rows = []
    for queue_name, msgs in queues.items():
        gone = set((holes or {}).get(queue_name, ()))
        for seq, m in enumerate(msgs):
            if seq in gone:
                continue
            rows.append(_row(queue_name, seq, m))
    for queue_name in _queue_order(queues, held or {}):
        rows += _held_rows(queue_name, (held or {}).get(queue_name, []), clients)
    return rows


def _standard_queues() -> dict[str, list[Message]]:
    """The shared content: 5 topics, 8 queues (one empty), 98 messages.

    - orders: 5 messages left in the topic's own queue; orders:billing 40,
      every 4th with attempts = n % 7 + 1, and 3 deferred (to .5/.25/.75 s,
      exact in binary); orders:ship empty.
    - events: 7 in the topic queue; events:audit 12 with bodies of n * 100 bytes
      (the first one empty).
    - clicks:web 30 (attempts 1), clicks:mobile 3.
    - idle: a topic queue with one 5000-byte message.
    """
    billing = messages(40, start=100, prefix=b"bill-")
    for i, m in enumerate(billing):
        if i % 4 == 0:
            m.attempts = i % 7 + 1
    for i, frac in ((5, 0.5), (17, 0.25), (33, 0.75)):
        billing[i].deferred_until = 1_700_000_100 + i + frac
    return {
        "orders": messages(5, start=0, prefix=b"order-"),
        "orders:billing": billing,
        "orders:ship": [],
        "events": messages(7, start=200, prefix=b"event-"),
        "events:audit": [message(300 + i, b"a" * (i * 100)) for i in range(12)],
        "clicks:web": messages(30, start=400, prefix=b"click-", attempts=1),
        "clicks:mobile": messages(3, start=500, prefix=b"tap-"),
        "idle": [message(600, b"x" * 5000)],
    }


STANDARD_QUEUES = _standard_queues()


@dataclass(frozen=True)
class KnownSnapshot:
    """A snapshot written once per run from `queues`, and the rows reading it must give."""

    path: Path
    queues: dict[str, list[Message]]
    rows: list[dict[str, Any]]  # expected_rows(queues): key order, Arrow's Python types
