"""Regressions found reviewing the full-disk, stuck-consumer and storage fixes: the LMDB spill file and metadata writes."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest

from backends.lmdb import StoreOpenError
from backends.lmdb_spill import SPILL_DONE, SPILL_END, SPILL_FILE, SPILL_MAGIC
from tests.support.full_disk import SmallDisk
from tests.support.inprocess_broker import lmdb_store, msgs, new_broker
from tests.support.lmdb_stores import bodies, expected, queue_t


def test_spilled_queue_opened_after_first_commit_not_counted_twice(tmp_path, clock):
    """A queue opened once the spilled records are back in LMDB finds them there, and only there."""
    store, q = queue_t(tmp_path, clock, 3)
    clock.advance(0)
    q.put(msgs(100, 3))
    SmallDisk(store, room=40)
    store.close()  # 60 spilled
    assert (tmp_path / SPILL_FILE).exists()

    store = lmdb_store(tmp_path, clock)
    clock.advance(0)  # the first commit writes the spilled records back...
    assert not (tmp_path / SPILL_FILE).exists()
    q = store.open_queue("t")  # ... before this queue is opened
    assert q.depth() == 103
    got = q.read(500)
    assert bodies(got) == expected(103)
    assert q.depth() == 0
    store.close()


def test_spill_file_with_a_cut_entry_header_is_corrupt_not_a_crash(tmp_path, clock):
    """A spill file whose checksum holds but whose last entry header is cut stops start-up with one line."""
    body = b"\x02\x00\x00"  # 3 bytes of a 9-byte entry header
    (tmp_path / SPILL_FILE).write_bytes(
        SPILL_MAGIC + body + SPILL_END.pack(SPILL_DONE, 1, zlib.crc32(body)))
    with pytest.raises(StoreOpenError, match="corrupt spill file"):
        lmdb_store(tmp_path, clock)


def test_metadata_write_scheduled_before_an_answered_one_is_not_repeated(tmp_path, clock):
    """/topic/pause writes at once (metadata.written); the write its change also scheduled has nothing left to do."""
    broker = new_broker(tmp_path, clock)
    writes = []
    real = broker.metadata._write_file
    broker.metadata._write_file = lambda data, seq: (writes.append(seq), real(data, seq))[1]
    broker.topic("t").pause()  # schedules a write
    d = broker.metadata.written()  # and the answer waits for one now
    assert d.called and len(writes) == 1
    clock.advance(0)
    assert len(writes) == 1
    broker.close()


def test_chunked_batch_answer_that_raises_is_logged_not_lost(clock):
    """The Cooperator drops a task's exception silently: a failing answer of a big batch must be logged."""
    from twisted.logger import globalLogPublisher

    from mqd.nsqd.batches import publish_in_chunks

    class _Topic:
        exiting = False
        name = "t"
        store = SimpleNamespace(durable=False)

        def __init__(self) -> None:
            self.clock = clock

        def publish(self, bodies, defer=0.0) -> None:  # as Topic.publish
            pass

    def done(error) -> None:
        raise RuntimeError("answer failed")

    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        publish_in_chunks(clock, _Topic(), iter([(0, 1)]), lambda chunk: [b"x"], done)
        for _ in range(4):
            clock.advance(0)
    finally:
        globalLogPublisher.removeObserver(events.append)
    failures = [e for e in events if "log_failure" in e]
    assert len(failures) == 1
    assert failures[0]["log_failure"].check(RuntimeError)
