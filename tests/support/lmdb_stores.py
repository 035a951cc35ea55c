"""The LMDB backend on a real environment and a task.Clock: stores, and brokers restarted on it.

A commit is scheduled with `callLater(0)`, so `clock.advance(0)` runs it. A
restart is `close()` and a new store or broker on the same directory with a
clock at the same time; a crash skips `close()` and only releases the
data-path lock and the LMDB environment after a commit.
"""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from backends.lmdb import KEY, RECORD, LmdbQueue, LmdbStore
from mqd.nsqd.broker import Broker
from tests.support.inprocess_broker import lmdb_store, msgs, new_broker
from tests.support.v2_client import Client
from tests.support.v2_frames import HEARTBEAT, Msg


def bodies(messages) -> list[bytes]:
    return [m.body for m in messages]


def expected(n: int, start: int = 0, body: bytes = b"m") -> list[bytes]:
    return [body + b"%d" % i for i in range(start, start + n)]


def records(store: LmdbStore) -> list[tuple[int, int, bytes]]:
    """Every committed record: (queue id, sequence, body)."""
    with store.env.begin(db=store.data_db) as txn:
        return [(*KEY.unpack(k), bytes(v[RECORD.size:])) for k, v in txn.cursor()]


def queue_t(path, clock, n: int, **flags) -> tuple[LmdbStore, LmdbQueue]:
    """A new store and its queue "t" holding msgs(n), not committed yet."""
    store = lmdb_store(path, clock, **flags)
    q = store.open_queue("t")
    q.put(msgs(n))
    return store, q


FULL = "LMDB write failed: No space left on device"


def lmdb_broker(path, clock, **flags) -> Broker:
    return new_broker(path, clock, backend="lmdb", **flags)


def same_time(clock: Clock) -> Clock:
    """A new reactor clock for the next run, at the time the last one stopped."""
    c = Clock()
    c.advance(clock.seconds())
    return c


def restart(broker: Broker, **flags) -> Broker:
    broker.close()
    return lmdb_broker(broker.data_path, same_time(broker.clock), **flags)


def crash(broker: Broker, **flags) -> Broker:
    """The process dies after its last commit: no close(), no flush of memory."""
    broker.clock.advance(0)
    assert not broker.store._pending()
    broker.metadata.close()
    broker.store.env.close()
    return lmdb_broker(broker.data_path, same_time(broker.clock), **flags)


def delivered(c: Client) -> list:
    """Message frames written since the last read; heartbeats are skipped."""
    frames = [f for f in c.read() if f != HEARTBEAT]
    assert all(isinstance(f, Msg) for f in frames), frames
    return frames


# A test run in each durability mode of the store (the `durable` argument).
BOTH = pytest.mark.parametrize("durable", [False, True], ids=["default", "durable"])


def reopen(store: LmdbStore, path, clock, **flags) -> LmdbStore:
    """Close the store and open a new one on the same directory."""
    store.close()
    return lmdb_store(path, clock, **flags)
