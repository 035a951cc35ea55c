"""The LMDB store's queues on a real environment in tmp_path, driven by a task.Clock:
FIFO order, batches and depth, what each durability mode keeps, empty and delete.

A commit is scheduled with `callLater(0)`, so `clock.advance(0)` runs it;
"restart" means `store.close()` and a new LmdbStore on the same directory.
The environment itself (map growth, commit failures, foreign data) is in
test_lmdb_environment.py.
"""

from __future__ import annotations

import os

import pytest
from zope.interface.verify import verifyClass, verifyObject

import backends
from backends import IBackendQueue, IBackendStore, open_store
from backends.dummy import DummyStore
from backends.lmdb import ENV_DIR, FORMAT, LmdbQueue, LmdbStore
from backends.memory import MemoryStore
from mqd.message import Message
from tests.support.inprocess_broker import START_TIME, lmdb_store, msgs, settings
from tests.support.lmdb_stores import BOTH, bodies, expected, queue_t, records, reopen


def registry(store: LmdbStore) -> list[str]:
    with store.env.begin(db=store.registry_db) as txn:
        return [bytes(k).decode() for k, _ in txn.cursor()]


# -- interfaces ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lmdb", "memory", "dummy"])
def test_every_store_provides_the_interfaces(name, tmp_path, clock):
    store = open_store(name, settings(tmp_path, backend="lmdb"), clock)
    assert verifyObject(IBackendStore, store)
    queue = store.open_queue("t:c")
    assert verifyObject(IBackendQueue, queue)
    assert queue.name == "t:c"
    assert store.durable is False
    store.close()


def test_durable_lmdb_store_provides_the_interfaces(tmp_path, clock):
    store = lmdb_store(tmp_path, clock, durable=True)
    assert verifyObject(IBackendStore, store)
    assert verifyObject(IBackendQueue, store.open_queue("t"))
    assert verifyClass(IBackendQueue, LmdbQueue)
    assert store.durable is True
    store.close()


def test_store_classes_by_name():
    assert {"lmdb", "memory", "dummy"} <= set(backends.available())
    assert isinstance(open_store("memory"), MemoryStore)
    assert isinstance(open_store("dummy"), DummyStore)


def test_env_lives_under_data_path(tmp_path, clock):
    store = lmdb_store(tmp_path, clock)
    assert store.path == os.path.join(str(tmp_path), ENV_DIR)
    assert os.path.isfile(os.path.join(store.path, "data.mdb"))
    with store.env.begin(db=store.meta_db) as txn:
        assert txn.get(b"format") == FORMAT
    store.close()


# -- FIFO, batches, depth -----------------------------------------------------------------


@BOTH
def test_fifo_across_many_puts_and_batch_reads(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable)
    q = store.open_queue("t")
    for i in range(0, 1000, 100):
        q.put(msgs(100, i))
        if i % 300 == 0:
            clock.advance(0)
    assert q.depth() == 1000
    got = []
    while batch := q.read(77):
        assert len(batch) == 77 or q.depth() == 0
        got.extend(batch)
    assert bodies(got) == expected(1000)
    assert q.depth() == 0
    assert q.read(10) == []
    store.close()


@BOTH
def test_read_spans_committed_and_uncommitted(tmp_path, clock, durable):
    store, q = queue_t(tmp_path, clock, 3, durable=durable)
    assert store._writes.commit_call is not None and store._writes.commit_call.active()
    clock.advance(0)
    assert store._writes.commit_call is None
    assert [r[2] for r in records(store)] == expected(3)
    q.put(msgs(3, 3))  # not committed yet
    assert q.depth() == 6
    first = q.read(2)
    assert bodies(first) == expected(2)
    assert q.depth() == 4
    span = q.read(3)  # one committed, two uncommitted: durable hands out only the committed one
    assert bodies(span) == (expected(1, 2) if durable else expected(3, 2))
    assert q.depth() == (3 if durable else 1)
    clock.advance(0)
    assert bodies(q.read(10)) == (expected(3, 3) if durable else [b"m5"])
    assert q.depth() == 0
    store.close()


@BOTH
def test_read_spans_stored_records_and_cache_after_restart(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable)
    store.open_queue("t").put(msgs(4))
    store = reopen(store, tmp_path, clock, durable=durable)
    q = store.open_queue("t")
    assert q.depth() == 4
    q.put(msgs(2, 4))  # after four records on disk, before the commit
    assert q.depth() == 6
    if durable:  # only committed messages are handed out
        assert bodies(q.read(5)) == expected(4)
        clock.advance(0)
        assert bodies(q.read(5)) == expected(2, 4)
    else:
        assert bodies(q.read(5)) == expected(5)
        assert bodies(q.read(5)) == [b"m5"]
    store.close()


@BOTH
def test_depth_and_order_survive_restart(tmp_path, clock, durable):
    store, q = queue_t(tmp_path, clock, 10, durable=durable)
    clock.advance(0)
    q.put(msgs(5, 10))  # committed by close()
    store = reopen(store, tmp_path, clock, durable=durable)
    q = store.open_queue("t")
    assert q.depth() == 15
    got = q.read(6)
    assert bodies(got) == expected(6)
    assert [m.id for m in got] == [b"%016d" % i for i in range(6)]
    assert [m.timestamp for m in got] == [1_000 + i for i in range(6)]
    assert q.depth() == 9
    assert bodies(q.read(100)) == expected(9, 6)
    assert q.depth() == 0
    store.close()


def test_message_fields_round_trip(tmp_path, clock):
    store = lmdb_store(tmp_path, clock)
    big = bytes(range(256)) * 40
    m = Message(b"0123456789abcdef", big, 1_700_000_000_123_456_789, attempts=7,
                deferred_until=START_TIME + 12.5)
    store.open_queue("t").put([m])
    store = reopen(store, tmp_path, clock)
    (back,) = store.open_queue("t").read(1)
    assert (back.id, back.body, back.timestamp, back.attempts, back.deferred_until) == (
        b"0123456789abcdef", big, 1_700_000_000_123_456_789, 7, START_TIME + 12.5)
    store.close()


# -- default mode: reads remove records -------------------------------------------------


def test_default_read_removes_records(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 5)
    clock.advance(0)
    assert len(records(store)) == 5
    assert bodies(q.read(3)) == expected(3)
    clock.advance(0)
    assert [r[2] for r in records(store)] == [b"m3", b"m4"]
    store = reopen(store, tmp_path, clock)
    q = store.open_queue("t")
    assert q.depth() == 2
    assert bodies(q.read(10)) == [b"m3", b"m4"]
    store = reopen(store, tmp_path, clock)
    assert store.open_queue("t").depth() == 0
    assert records(store) == []
    store.close()


def test_default_read_before_commit_is_never_written(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 3)
    assert bodies(q.read(2)) == expected(2)
    clock.advance(0)
    assert [r[2] for r in records(store)] == [b"m2"]
    assert store._writes.dels == set()
    store = reopen(store, tmp_path, clock)
    assert bodies(store.open_queue("t").read(10)) == [b"m2"]
    store.close()


def test_default_finish_update_hold_keep_nothing(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 2)
    clock.advance(0)
    got = q.read(2)
    assert [m.key for m in got] == [None, None]
    got[0].attempts = 5
    q.update(got)
    q.finish(got)
    deferred = msgs(1, 9)
    deferred[0].deferred_until = START_TIME + 60
    q.hold(deferred)
    clock.advance(0)
    assert records(store) == []
    store = reopen(store, tmp_path, clock)
    assert store.open_queue("t").depth() == 0
    store.close()


# -- durable mode: records stay until FIN ---------------------------------------------


def test_durable_read_keeps_record_until_finish(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 4, durable=True)
    clock.advance(0)
    got = q.read(4)
    assert bodies(got) == expected(4)
    assert all(m.key is not None for m in got)
    assert q.depth() == 0
    clock.advance(0)
    assert len(records(store)) == 4
    q.finish(got[:2])
    assert got[0].key is None
    clock.advance(0)
    assert [r[2] for r in records(store)] == [b"m2", b"m3"]
    store = reopen(store, tmp_path, clock, durable=True)
    q = store.open_queue("t")
    assert q.depth() == 2
    assert bodies(q.read(10)) == [b"m2", b"m3"]
    store.close()


def test_durable_reads_only_committed_messages(tmp_path, clock):
    """Nothing put is handed out before the commit holding it: a failed commit may still drop it."""
    store, q = queue_t(tmp_path, clock, 3, durable=True)
    assert q.depth() == 3 and q.read(10) == [] and q.peek(10) == []
    clock.advance(0)
    assert bodies(q.peek(10)) == expected(3)
    assert bodies(q.read(10)) == expected(3)
    store.close()


def test_durable_finish_before_commit_never_writes(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 3, durable=True)
    clock.advance(0)
    got = q.read(2)
    q.finish(got)
    clock.advance(0)
    assert [r[2] for r in records(store)] == [b"m2"]
    store.close()


def test_durable_update_rewrites_attempts_and_deferral(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 3, durable=True)
    clock.advance(0)
    a, b, c = q.read(3)
    a.attempts = 4
    b.attempts = 2
    b.deferred_until = START_TIME + 30
    q.update([a, b])
    clock.advance(0)
    store = reopen(store, tmp_path, clock, durable=True)
    q = store.open_queue("t")
    got = q.read(10)
    assert bodies(got) == expected(3)
    assert [m.attempts for m in got] == [4, 2, 0]
    assert [m.deferred_until for m in got] == [0.0, START_TIME + 30, 0.0]
    store.close()


def test_durable_update_before_commit_writes_latest_state(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 1, durable=True)
    clock.advance(0)
    (m,) = q.read(1)
    m.attempts = 3
    q.update([m])
    store = reopen(store, tmp_path, clock, durable=True)
    (back,) = store.open_queue("t").read(1)
    assert (back.body, back.attempts) == (b"m0", 3)
    store.close()


def test_durable_hold_is_hidden_until_restart(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 1, durable=True)
    later = msgs(1, 1)
    later[0].deferred_until = START_TIME + 45
    q.hold(later)
    assert later[0].key is not None
    q.put(msgs(1, 2))
    assert q.depth() == 2
    clock.advance(0)
    assert bodies(q.read(10)) == [b"m0", b"m2"]
    # Also hidden once read from disk rather than from the cache.
    q.put(msgs(1, 3))
    clock.advance(0)
    assert bodies(q.read(10)) == [b"m3"]
    clock.advance(0)
    assert [r[2] for r in records(store)] == [b"m0", b"m1", b"m2", b"m3"]
    store = reopen(store, tmp_path, clock, durable=True)
    q = store.open_queue("t")
    assert q.depth() == 4
    got = q.read(10)
    assert bodies(got) == [b"m0", b"m1", b"m2", b"m3"]
    assert [m.deferred_until for m in got] == [0.0, START_TIME + 45, 0.0, 0.0]
    store.close()


def test_durable_hold_hidden_when_reading_committed_records(tmp_path, clock):
    store = lmdb_store(tmp_path, clock, durable=True)
    store.open_queue("t")
    store.close()
    # After a restart nothing is cached: reads go to disk and must pass held keys.
    store, q = queue_t(tmp_path, clock, 2, durable=True)
    held = msgs(1, 2)
    held[0].deferred_until = START_TIME + 5
    q.hold(held)
    q.put(msgs(2, 3))
    clock.advance(0)
    q._tail.clear()  # as if the read cache had been trimmed
    assert bodies(q.read(10)) == [b"m0", b"m1", b"m3", b"m4"]
    q.update(held)  # rewritten, still hidden until FIN: its message lives outside the queue
    assert q.read(10) == []
    store.close()


def test_durable_many_messages_beyond_read_cache(tmp_path, clock, monkeypatch):
    import backends.lmdb_queue as mod

    monkeypatch.setattr(mod, "READ_CACHE", 10)
    store, q = queue_t(tmp_path, clock, 50, durable=True)
    clock.advance(0)
    assert len(q._tail) == 10
    q.put(msgs(5, 50))
    clock.advance(0)
    got = []
    while batch := q.read(7):
        got.extend(batch)
    assert bodies(got) == expected(55)
    store.close()


# -- empty, delete, many queues ------------------------------------------------------


@BOTH
def test_empty_drops_records_and_keeps_the_queue(tmp_path, clock, durable):
    store, q = queue_t(tmp_path, clock, 5, durable=durable)
    clock.advance(0)
    q.put(msgs(2, 5))  # uncommitted: dropped too
    q.empty()
    assert q.depth() == 0
    assert q.read(10) == []
    q.put(msgs(2, 100))  # same turn, after the empty: survives
    assert q.depth() == 2
    clock.advance(0)
    assert [r[2] for r in records(store)] == [b"m100", b"m101"]
    assert registry(store) == ["t"]
    store = reopen(store, tmp_path, clock, durable=durable)
    assert store.queue_names() == ["t"]
    q = store.open_queue("t")
    assert q.depth() == 2
    assert bodies(q.read(10)) == [b"m100", b"m101"]
    store.close()


def test_durable_empty_drops_read_and_held_records(tmp_path, clock):
    store, q = queue_t(tmp_path, clock, 3, durable=True)
    clock.advance(0)
    in_flight = q.read(2)
    held = msgs(1, 9)
    held[0].deferred_until = START_TIME + 10
    q.hold(held)
    q.empty()
    clock.advance(0)
    assert records(store) == []
    q.finish(in_flight)  # a late FIN of a dropped message changes nothing
    clock.advance(0)
    store = reopen(store, tmp_path, clock, durable=True)
    assert store.open_queue("t").depth() == 0
    store.close()


@BOTH
def test_empty_leaves_other_queues_alone(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable)
    a, b, c = (store.open_queue(n) for n in ("a", "b", "c"))
    for q in (a, b, c):
        q.put(msgs(3, body=q.name.encode()))
    clock.advance(0)
    b.empty()
    clock.advance(0)
    store = reopen(store, tmp_path, clock, durable=durable)
    assert [store.open_queue(n).depth() for n in ("a", "b", "c")] == [3, 0, 3]
    assert bodies(store.open_queue("a").read(9)) == expected(3, body=b"a")
    assert bodies(store.open_queue("c").read(9)) == expected(3, body=b"c")
    store.close()


@BOTH
def test_delete_drops_records_and_registry_name(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable)
    q = store.open_queue("t:c")
    keep = store.open_queue("t")
    q.put(msgs(4))
    keep.put(msgs(1, body=b"k"))
    clock.advance(0)
    assert registry(store) == ["t", "t:c"]
    q.delete()
    clock.advance(0)
    assert registry(store) == ["t"]
    assert [r[2] for r in records(store)] == [b"k0"]
    assert store.queue_names() == ["t"]
    store = reopen(store, tmp_path, clock, durable=durable)
    assert store.queue_names() == ["t"]
    again = store.open_queue("t:c")
    assert again.depth() == 0
    store.close()


def test_delete_then_recreate_in_same_turn(tmp_path, clock):
    store = lmdb_store(tmp_path, clock)
    old = store.open_queue("t")
    old.put(msgs(3))
    clock.advance(0)
    old.delete()
    new = store.open_queue("t")
    assert new is not old and new.qid != old.qid
    new.put(msgs(1, 7))
    clock.advance(0)
    store = reopen(store, tmp_path, clock)
    assert store.queue_names() == ["t"]
    assert bodies(store.open_queue("t").read(10)) == [b"m7"]
    store.close()


def test_create_then_delete_before_commit(tmp_path, clock):
    store = lmdb_store(tmp_path, clock)
    q = store.open_queue("gone")
    q.put(msgs(2))
    q.delete()
    clock.advance(0)
    assert registry(store) == []
    assert records(store) == []
    store.close()


@BOTH
def test_many_queues_are_isolated(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable)
    names = [f"topic{i:03d}" if i % 2 else f"topic{i:03d}:ch" for i in range(200)]
    for i, name in enumerate(names):
        store.open_queue(name).put(msgs(i % 7 + 1, body=name.encode() + b"-"))
        if i % 50 == 0:
            clock.advance(0)
    for name in names[:100]:
        q = store.open_queue(name)
        assert bodies(q.read(1)) == [name.encode() + b"-0"]
    store = reopen(store, tmp_path, clock, durable=durable)
    assert store.queue_names() == sorted(names)
    for i, name in enumerate(names):
        q = store.open_queue(name)
        n = i % 7 + 1
        if i < 100 and not durable:
            assert q.depth() == n - 1
            assert bodies(q.read(100)) == expected(n - 1, 1, name.encode() + b"-")
        else:
            assert q.depth() == n
            assert bodies(q.read(100)) == expected(n, 0, name.encode() + b"-")
    store.close()
