"""What the LMDB store holds in memory however much goes through it.

- A big commit (consumers that never read: their whole RDY windows time
  out and are requeued in one scan) went in one transaction. LMDB keeps the
  pages a transaction dirtied in a pool of its own and never gives them
  back, and the commit first built every encoded record in one list: 50
  stuck consumers' 125,000 1 KB messages left ~200 MB behind. A big commit
  now goes in transactions of at most _COMMIT_CHUNK records (or 4 MB),
  each encoded when its turn comes, the new publishes (durable) in the
  last one.
- Every record read or written maps its page into the process: RSS grew
  by what went through the store (page cache, which nsqd, reading its
  files, does not count). The store now unmaps them once they have grown
  by 64 MB (checked every few seconds and every 16,384 records read or
  written); the data stays in the page cache.
"""

from __future__ import annotations

import os

import pytest

import backends.lmdb_pages as lmdb_pages
from backends.lmdb import _COMMIT_CHUNK
from backends.lmdb_pages import _UNMAP_EVERY
from backends.lmdb_records import RECORD_SIZE
from tests.support.full_disk import SmallDisk, SmallDiskCursor, SmallDiskTxn
from tests.support.inprocess_broker import lmdb_store, msgs
from tests.support.lmdb_stores import bodies, expected, records


class CountingEnv(SmallDisk):
    """A store's environment with room for everything: the bodies each write transaction puts, failures on demand."""

    def __init__(self, store) -> None:
        super().__init__(store, room=1 << 40)
        self.txns: list[list[bytes]] = []
        self.fail_when = None  # called with a transaction's bodies: True makes its commit fail

    def begin(self, write=False, **kw):
        txn = self.real.begin(write=write, **kw)
        return _CountingTxn(self, txn) if write else txn


class _CountingTxn(SmallDiskTxn):
    def __init__(self, env: CountingEnv, real) -> None:
        super().__init__(env, real)
        self.bodies: list[bytes] = []

    def cursor(self, *args, **kw):
        return _CountingCursor(self, self.real.cursor(*args, **kw))

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and self.disk.fail_when is not None and self.disk.fail_when(self.bodies):
            self.disk.room = -1  # this commit does not fit
            try:
                super().__exit__(exc_type, *exc)
            finally:
                self.disk.room = 1 << 40
        super().__exit__(exc_type, *exc)
        if exc_type is None:
            self.disk.txns.append(self.bodies)


class _CountingCursor(SmallDiskCursor):
    def putmulti(self, items, *args, **kw):
        items = list(items)
        self.txn.bodies += [bytes(v[RECORD_SIZE:]) for _, v in items]
        return super().putmulti(items, *args, **kw)


@pytest.mark.parametrize("durable", [False, True], ids=["default", "durable"])
def test_big_commit_goes_in_bounded_transactions(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable)
    q = store.open_queue("t")
    clock.advance(0)
    env = CountingEnv(store)
    n = 3 * _COMMIT_CHUNK + 5
    q.put(msgs(n))
    clock.advance(0)
    assert [r[2] for r in records(store)] == expected(n)
    sizes = [len(t) for t in env.txns]
    assert sum(sizes) == n and len(sizes) == 4 and max(sizes) <= _COMMIT_CHUNK, sizes
    assert bodies(q.read(n)) == expected(n)
    store.close()


def test_small_commit_is_one_transaction(tmp_path, clock):
    store = lmdb_store(tmp_path, clock)
    q = store.open_queue("t")
    clock.advance(0)
    env = CountingEnv(store)
    q.put(msgs(_COMMIT_CHUNK))
    clock.advance(0)
    assert [len(t) for t in env.txns] == [_COMMIT_CHUNK]
    store.close()


def _durable_mix(tmp_path, clock):
    """A durable store with one commit pending: many acknowledged records (a requeue), then new publishes."""
    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t")
    clock.advance(0)
    q.put(msgs(2 * _COMMIT_CHUNK + 10))  # not a publish: messages moved or requeued, acknowledged before
    q.put(msgs(5, body=b"new"), fresh=True)
    waited: list = []
    store.when_durable(waited.append)
    return store, q, CountingEnv(store), waited


def test_durable_big_commit_writes_new_publishes_last(tmp_path, clock):
    store, q, env, waited = _durable_mix(tmp_path, clock)
    clock.advance(0)
    assert waited == [None]
    assert all(not b.startswith(b"new") for t in env.txns[:-1] for b in t)
    assert [b for b in env.txns[-1] if b.startswith(b"new")] == expected(5, body=b"new")
    assert len(records(store)) == 2 * _COMMIT_CHUNK + 15
    store.close()


def test_durable_big_commit_failing_at_its_end_keeps_what_was_written_and_drops_the_publishes(tmp_path, clock):
    store, q, env, waited = _durable_mix(tmp_path, clock)
    env.fail_when = lambda txn_bodies: any(b.startswith(b"new") for b in txn_bodies)
    clock.advance(0)
    assert waited == ["LMDB write failed: mdb_txn_commit: No space left on device"]
    assert len(records(store)) == 2 * _COMMIT_CHUNK  # the bounded transactions before it stay
    env.fail_when = None
    clock.advance(1)  # the retry writes the rest of the acknowledged records, never the refused ones
    assert store.failure is None
    assert [r[2] for r in records(store)] == expected(2 * _COMMIT_CHUNK + 10)
    assert q.depth() == 2 * _COMMIT_CHUNK + 10
    assert bodies(q.read(10_000)) == expected(2 * _COMMIT_CHUNK + 10)
    store.close()


def test_durable_big_commit_failing_early_writes_no_publish(tmp_path, clock):
    store, q, env, waited = _durable_mix(tmp_path, clock)
    env.fail_when = lambda txn_bodies: True
    clock.advance(0)
    assert waited and waited[0] is not None
    assert records(store) == []
    env.fail_when = None
    clock.advance(1)
    assert [r[2] for r in records(store)] == expected(2 * _COMMIT_CHUNK + 10)
    store.close()


def _mapped_rss_kb(path: str) -> int | None:
    """Rss of this process's mapping of `path` (/proc/self/smaps), None if not mapped."""
    target = " " + os.path.realpath(path)
    rss = None
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
                inside = line.rstrip("\n").endswith(target)
            elif inside and line.startswith("Rss:"):
                rss = (rss or 0) + int(line.split()[1])
    return rss


@pytest.mark.skipif(lmdb_pages._madvise is None, reason="needs madvise and /proc/self/maps (Linux)")
def test_pages_read_through_the_map_are_released_and_records_stay_readable(tmp_path, clock, monkeypatch):
    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t")
    clock.advance(0)
    body = b"x" * 1000
    for start in range(0, 4000, 1000):
        q.put(msgs(1000, start, body=body))
        clock.advance(0)
    data = os.path.join(store.path, "data.mdb")
    q._tail.clear()  # as after a restart: reads go through the map
    got = q.read(2000)
    assert (_mapped_rss_kb(data) or 0) > 1000  # ~2 MB of records read, mapped
    assert store.release_mapped_pages() > 0
    assert _mapped_rss_kb(data) == 0
    got += q.read(10_000)  # the rest, and the data is intact
    assert bodies(got) == [body + b"%d" % i for i in range(4000)]
    q.finish(got)

    # Done by the store itself once they have grown by _UNMAP_ABOVE: checked after a commit
    # past _UNMAP_RECORDS records, and every _UNMAP_EVERY seconds.
    monkeypatch.setattr(lmdb_pages, "_UNMAP_RECORDS", 100)
    monkeypatch.setattr(lmdb_pages, "_UNMAP_ABOVE", 0)
    q.put(msgs(200, body=body))
    clock.advance(0)
    assert store.io_records == 0
    q._tail.clear()
    q.read(1)
    assert (_mapped_rss_kb(data) or 0) > 0
    clock.advance(_UNMAP_EVERY)
    assert _mapped_rss_kb(data) == 0
    store.close()
