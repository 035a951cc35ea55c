"""The broker's whole queue state at one reactor instant, for a snapshot.

`capture(broker)` runs on the reactor and returns plain data
(`mqd.nsqd.snapshot_live.LiveState`) plus, on an LMDB store, a read transaction
opened right after a commit: together they are every message the broker
holds at that instant, each exactly once. Nothing can run between the
commit, the transaction and the capture (one reactor call), so a message
moving from memory to flight, or from the store to memory, is seen on
exactly one side.

What the capture takes per queued message is a reference and the three
fields that change once the reactor runs on (store key, attempts,
deferral), in flat lists: no object per message (a tuple each cost three
times as much, a fifth of it in the collector); bodies are shared, not
copied. Messages a queue holds as a run of a publish (mqd.message.Run)
are the exception: the capture makes a Message of its own for each,
since the run's are made only as the queue hands them out. In-flight and deferred messages (a few thousand) are taken as
tuples. Sorting,
encoding and writing happen in the snapshot thread. Measured in bench/
(`python -m bench snapshot`).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from operator import attrgetter
from typing import TYPE_CHECKING, Any, cast

from backends import BackendError
from mqd.nsqd.snapshot_live import FIELDS, LiveQueue, LiveState

if TYPE_CHECKING:
    import lmdb

    from backends import IBackendStore
    from backends.lmdb import LmdbStore
    from mqd.message import Message
    from mqd.nsqd.broker import Broker
    from mqd.nsqd.overflow import OverflowQueue

__all__ = ["StoreNotReady", "capture"]

_fields = attrgetter(*FIELDS)
_key = attrgetter("key")
_attempts = attrgetter("attempts")
_deferred_until = attrgetter("deferred_until")


class StoreNotReady(Exception):
    """The store cannot give a consistent cut now (a failing or pending commit): no snapshot."""


class _Clients:
    """The clients holding in-flight messages, numbered in the order first seen."""

    __slots__ = ("rows", "_index")

    def __init__(self) -> None:
        self.rows: list[dict[str, str]] = []
        self._index: dict[int, int] = {}

    def index(self, client: Any) -> int:
        if client is None:
            return -1
        n = self._index.get(id(client))
        if n is None:
            n = self._index[id(client)] = len(self.rows)
            self.rows.append({
                "remote_address": client.remote_address,
                "client_id": client.client_id,
                "hostname": client.hostname,
                "user_agent": client.user_agent,
            })
        return n


def _queued(live: LiveQueue, queue: OverflowQueue, stored: bool) -> LiveQueue:
    """Take the queued messages of `queue` into `live`: references, and what of them can change."""
    mem = queue.mem
    refs = mem.peek(mem.count)
    refs += _backend_held(queue, stored)
    live.queued = refs
    live.queued_keys = [*map(_key, refs)]
    live.queued_attempts = [*map(_attempts, refs)]
    live.queued_deferred = [*map(_deferred_until, refs)]
    return live


def _backend_held(queue: OverflowQueue, stored: bool) -> list[Message]:
    """What the backend holds in memory: everything unless it is the store the copy comes from."""
    backend = queue.backend
    if stored or not backend.depth():
        return []
    return backend.peek(backend.depth())


def capture(broker: Broker) -> tuple[LiveState, lmdb.Environment | None, lmdb.Transaction[bytes] | None]:
    """Take the broker's queue state now; on LMDB also the store's read transaction of this instant.

    Raises StoreNotReady while the store is failing or could not commit:
    a snapshot then would miss what the store has not written.
    """
    started = time.perf_counter()
    store = broker.store
    env = getattr(store, "env", None) if broker.options.backend == "lmdb" else None
    txn = None
    if env is not None:
        try:
            txn = cast("LmdbStore", store).cut()  # only the LMDB store has an `env`
        except BackendError as e:
            raise StoreNotReady(str(e)) from None
    try:
        state = _capture_queues(broker, env is not None)
    except BaseException:
        if txn is not None:
            txn.abort()
        raise
    state.capture_seconds = time.perf_counter() - started
    return state, env, txn


def _capture_queues(broker: Broker, stored: bool) -> LiveState:
    clients = _Clients()
    queues: list[LiveQueue] = []
    left_out: list[dict[str, Any]] = []
    next_id = 1

    def queue_id(overflow: OverflowQueue) -> int:
        # An LMDB queue's own id (the copy's records carry it); the other
        # stores have none, so the snapshot numbers their queues.
        nonlocal next_id
        qid = getattr(overflow.backend, "qid", None)
        if qid is None:
            qid, next_id = next_id, next_id + 1
        return qid

    for topic in broker.topics.values():
        channels = list(topic.channels.values())
        if topic.ephemeral:
            left_out.append(_left_out(topic.name, None, topic.depth(), 0, 0))
            left_out += [_left_out(topic.name, c.name, c.depth(), c.in_flight_count(),
                                   c.deferred_count()) for c in channels]
            continue
        overflow = topic.holdings()
        queues.append(_queued(LiveQueue(
            name=topic.name, topic=topic.name, channel=None, queue_id=queue_id(overflow),
            stats={"depth": len(overflow), "in_flight_count": 0, "deferred_count": 0},
        ), overflow, stored))
        for channel in channels:
            if channel.ephemeral:
                left_out.append(_left_out(topic.name, channel.name, channel.depth(),
                                          channel.in_flight_count(), channel.deferred_count()))
                continue
            overflow, deferred, in_flight = channel.holdings()
            index = clients.index
            queues.append(_queued(LiveQueue(
                name=f"{topic.name}:{channel.name}", topic=topic.name, channel=channel.name,
                queue_id=queue_id(overflow),
                stats={"depth": len(overflow), "in_flight_count": channel.in_flight_count(),
                       "deferred_count": channel.deferred_count()},
                deferred=[(due, _fields(m)) for due, m in deferred.entries()],
                in_flight=[(deadline, _fields(m), index(m.client)) for deadline, m in in_flight.entries()],
            ), overflow, stored))
    return LiveState(
        created_at=datetime.now(UTC), backend=broker.options.backend,
        durable=bool(cast("IBackendStore", broker.store).durable),  # a snapshot needs an open broker
        queues=queues, clients=clients.rows, left_out=left_out, capture_seconds=0.0,
    )


def _left_out(topic: str, channel: str | None, depth: int, in_flight: int, deferred: int) -> dict[str, Any]:
    return {"topic": topic, "channel": channel, "reason": "ephemeral", "depth": depth,
            "in_flight_count": in_flight, "deferred_count": deferred}
