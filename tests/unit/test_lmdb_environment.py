"""The LMDB store's environment in tmp_path, on a task.Clock: map growth, commit failures,
durability modes, and opening a directory that holds foreign or corrupt data.

A commit is scheduled with `callLater(0)`, so `clock.advance(0)` runs it;
"restart" means `store.close()` and a new LmdbStore on the same directory.
The queues' behaviour on the store is in test_lmdb.py.
"""

from __future__ import annotations

import os

import lmdb
import pytest

from backends import BackendError
from backends.lmdb import ENV_DIR, StoreOpenError
from mqd.message import Message
from tests.support.inprocess_broker import failing_once, lmdb_store, msgs
from tests.support.lmdb_stores import BOTH, bodies, expected, records, reopen

# -- map growth ----------------------------------------------------------------------


@BOTH
def test_map_grows_without_error(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable, lmdb_map_size=1 << 20)
    assert store.env.info()["map_size"] == 1 << 20
    q = store.open_queue("t")
    chunk = os.urandom(1024)
    waited = []
    for i in range(0, 5000, 500):
        q.put([Message(b"%016d" % j, chunk + b"%d" % j, j) for j in range(i, i + 500)])
    store.when_durable(waited.append)
    clock.advance(0)
    assert waited == [None]
    assert store.failure is None
    assert store.env.info()["map_size"] >= 8 << 20
    assert len(records(store)) == 5000
    store = reopen(store, tmp_path, clock, durable=durable, lmdb_map_size=1 << 20)
    q = store.open_queue("t")
    assert q.depth() == 5000
    got = q.read(5000)
    assert [m.body for m in got] == [chunk + b"%d" % j for j in range(5000)]
    store.close()


def test_map_waits_for_a_running_copy_before_growing(tmp_path, clock):
    store = lmdb_store(tmp_path, clock, lmdb_map_size=1 << 20)
    q = store.open_queue("t")
    store.copy_started()  # a snapshot thread is reading the map
    q.put([Message(b"%016d" % j, os.urandom(1024), j) for j in range(3000)])
    clock.advance(0)
    # The commit needs a bigger map but must not resize it under the copy.
    assert store.env.info()["map_size"] == 1 << 20
    assert records(store) == []
    store.copy_ended()
    clock.advance(0.05)
    assert store.env.info()["map_size"] > 1 << 20
    assert len(records(store)) == 3000
    store.close()


def test_map_grows_for_one_large_message(tmp_path, clock):
    store = lmdb_store(tmp_path, clock, lmdb_map_size=1 << 20)
    body = os.urandom(3 << 20)
    store.open_queue("t").put([Message(b"0" * 16, body, 1)])
    clock.advance(0)
    assert store.failure is None
    store = reopen(store, tmp_path, clock)
    assert bodies(store.open_queue("t").read(1)) == [body]
    store.close()


# -- commit failures -----------------------------------------------------------------


@BOTH
def test_failed_commit_keeps_everything_for_the_retry(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable)
    health = []
    store.health_listener = health.append
    q = store.open_queue("t")
    calls = failing_once(store)
    q.put(msgs(3))
    waited = []
    store.when_durable(waited.append)
    clock.advance(0)
    failure = "LMDB write failed: No space left on device"
    assert store.failure == failure
    assert health == [failure]
    assert waited == [failure if durable else None]
    with pytest.raises(BackendError, match="No space left on device"):
        q.put(msgs(1, 3))
    assert q.depth() == 3
    clock.advance(0.5)
    assert len(calls) == 1
    clock.advance(0.5)
    assert len(calls) == 2
    assert store.failure is None
    assert health == [failure, None]
    assert [r[2] for r in records(store)] == expected(3)
    q.put(msgs(1, 3))
    store = reopen(store, tmp_path, clock, durable=durable)
    assert bodies(store.open_queue("t").read(10)) == expected(4)
    store.close()


def test_failure_reported_once_per_incident(tmp_path, clock):
    store = lmdb_store(tmp_path, clock, durable=True)
    health = []
    store.health_listener = health.append
    real = store._write
    fails = [3]

    def write():
        if fails[0]:
            fails[0] -= 1
            raise lmdb.Error("No space left on device")
        return real()

    store._write = write
    store.open_queue("t").put(msgs(1))
    clock.advance(0)
    clock.advance(1)
    clock.advance(1)
    assert health == ["LMDB write failed: No space left on device"]
    clock.advance(1)
    assert health == ["LMDB write failed: No space left on device", None]
    assert store.failure is None
    store.close()


# -- durability modes ------------------------------------------------------------------


def test_when_durable(tmp_path, clock):
    plain = lmdb_store(tmp_path / "a", clock)
    got = []
    plain.open_queue("t").put(msgs(1))
    plain.when_durable(got.append)
    assert got == [None]  # not durable: at once
    plain.close()
    durable = lmdb_store(tmp_path / "b", clock, durable=True)
    durable.open_queue("t").put(msgs(1))
    durable.when_durable(got.append)
    durable.when_durable(got.append)
    assert got == [None]
    clock.advance(0)
    assert got == [None, None, None]
    durable.when_durable(got.append)  # nothing pending: the next turn says so
    clock.advance(0)
    assert got == [None] * 4
    durable.close()


def test_sync_every_and_sync_timeout(tmp_path, clock, monkeypatch):
    store = lmdb_store(tmp_path, clock, sync_every=10, sync_timeout="2s")
    syncs = []
    real = store.sync

    def sync():
        syncs.append(store._unsynced)
        real()

    monkeypatch.setattr(store, "sync", sync)
    q = store.open_queue("t")
    q.put(msgs(4))
    clock.advance(0)
    assert syncs == []
    q.put(msgs(6, 4))
    clock.advance(0)
    assert syncs == [10]
    q.put(msgs(1, 10))
    clock.advance(0)
    assert syncs == [10]
    clock.advance(2.0)
    assert syncs == [10, 1]
    clock.advance(2.0)  # nothing written since: no sync
    assert syncs == [10, 1]
    store.close()


def test_group_commit_is_one_transaction_per_turn(tmp_path, clock, monkeypatch):
    store = lmdb_store(tmp_path, clock)
    writes = []
    real = store._write

    def write():
        writes.append(len(store._writes.puts))
        return real()

    monkeypatch.setattr(store, "_write", write)
    queues = [store.open_queue(f"q{i}") for i in range(5)]
    clock.advance(0)
    assert writes == [0]  # the registry entries
    for q in queues:
        for i in range(10):
            q.put(msgs(1, i))
    assert writes == [0]
    clock.advance(0)
    assert writes == [0, 50]
    clock.advance(0)
    assert writes == [0, 50]
    store.close()


# -- opening: foreign and corrupt data -----------------------------------------------------


def snapshot(path) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            if f != "lock.mdb":
                with open(full, "rb") as fh:
                    out[os.path.relpath(full, path)] = fh.read()
    return out


def test_garbage_data_file_refused(tmp_path, clock):
    env_dir = tmp_path / ENV_DIR
    env_dir.mkdir()
    (env_dir / "data.mdb").write_bytes(b"\xde\xad\xbe\xef" * 16384)
    before = snapshot(tmp_path)
    with pytest.raises(StoreOpenError, match="not a usable LMDB environment") as info:
        lmdb_store(tmp_path, clock)
    assert str(env_dir) in str(info.value)
    assert snapshot(tmp_path) == before


def test_foreign_named_database_refused(tmp_path, clock):
    env_dir = tmp_path / ENV_DIR
    env = lmdb.open(str(env_dir), max_dbs=4)
    other = env.open_db(b"someone-else")
    with env.begin(write=True, db=other) as txn:
        txn.put(b"precious", b"data")
    env.close()
    before = snapshot(tmp_path)
    with pytest.raises(StoreOpenError, match="not mqd's") as info:
        lmdb_store(tmp_path, clock)
    assert "someone-else" in str(info.value)
    assert snapshot(tmp_path) == before
    env = lmdb.open(str(env_dir), max_dbs=4)
    with env.begin(db=env.open_db(b"someone-else", create=False)) as txn:
        assert txn.get(b"precious") == b"data"
    env.close()


def test_foreign_plain_keys_refused(tmp_path, clock):
    env = lmdb.open(str(tmp_path / ENV_DIR))
    with env.begin(write=True) as txn:
        txn.put(b"user:1", b"alice")
    env.close()
    before = snapshot(tmp_path)
    with pytest.raises(StoreOpenError, match="not mqd's"):
        lmdb_store(tmp_path, clock)
    assert snapshot(tmp_path) == before


def test_unknown_format_mark_refused(tmp_path, clock):
    store = lmdb_store(tmp_path, clock)
    store.open_queue("t").put(msgs(2))
    with store.env.begin(write=True, db=store.meta_db) as txn:
        txn.put(b"format", b"mqd-queues-99")
    store.close()
    before = snapshot(tmp_path)
    with pytest.raises(StoreOpenError, match="unknown data format b'mqd-queues-99'"):
        lmdb_store(tmp_path, clock)
    assert snapshot(tmp_path) == before


def test_env_path_is_a_file(tmp_path, clock):
    (tmp_path / ENV_DIR).write_bytes(b"not a directory")
    with pytest.raises(StoreOpenError, match=ENV_DIR):
        lmdb_store(tmp_path, clock)
    assert (tmp_path / ENV_DIR).read_bytes() == b"not a directory"
