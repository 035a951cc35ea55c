"""The durable store's publish log, driven step by step.

On a reactor with threads a durable LmdbStore acknowledges through its
publish log: each reactor turn's changes are one chunk, written and synced
by a thread while the reactor goes on, and LMDB takes them in checkpoints.
Here the "thread" is a ThreadedClock (tests.support.threaded_clock): a test
decides when a chunk is synced, and `clock.advance(0)` lands it on the
"reactor". A crash is the environment closed without a checkpoint: what
was logged must come back, what was not acknowledged must not.
"""

from __future__ import annotations

import errno
import os

import pytest
from twisted.internet.task import Clock

from backends.lmdb import LmdbStore
from backends.lmdb_log import LOG_FILE, PublishLog, encode_chunk, parse_chunks
from backends.lmdb_records import KEY
from tests.support.inprocess_broker import msgs, settings
from tests.support.lmdb_stores import FULL, bodies, expected, records
from tests.support.threaded_clock import ThreadedClock


def durable_store(path, clock) -> LmdbStore:
    return LmdbStore(settings(path, backend="lmdb", durable=True), clock)


def publish(store: LmdbStore, queue, messages) -> list:
    """Put new publishes as Topic.publish does; the list gets the commit's answer."""
    answers: list = []
    queue.put(messages, fresh=True)
    store.when_durable(answers.append)
    return answers


def logged_queue(path, clock: ThreadedClock):
    """A durable store with a publish log, and its queue "t" (registered: a checkpoint)."""
    store = durable_store(path, clock)
    q = store.open_queue("t")
    clock.advance(0)
    return store, q


def crash(store: LmdbStore, path, clock=None) -> LmdbStore:
    """The process dies: no checkpoint, no close of the log; a new store on the same directory."""
    store.env.close()
    store._log.close()
    return durable_store(path, clock or ThreadedClock())


def failing_once(store: LmdbStore) -> list[list[bytes]]:
    """The writer's next write fails as on a full disk, once; returns what it was asked to write."""
    real = store._log.append
    calls: list[list[bytes]] = []

    def append(data: list[bytes]) -> None:
        calls.append(data)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(data)

    store._log.append = append
    return calls


def synced(clock: ThreadedClock) -> None:
    """A reactor turn takes a chunk, the writer writes and syncs it, the next turn lands it."""
    clock.advance(0)
    clock.run_threads()
    clock.advance(0)


@pytest.fixture
def tclock() -> ThreadedClock:
    return ThreadedClock()


def test_publish_is_answered_and_readable_only_once_its_chunk_is_synced(tmp_path, tclock):
    store = durable_store(tmp_path, tclock)
    assert store._log is not None
    q = store.open_queue("t")
    tclock.advance(0)  # the registry: a checkpoint, as structure changes always are
    answers = publish(store, q, msgs(3))
    tclock.advance(0)  # the turn's chunk is handed to the thread
    assert answers == [] and q.read(10) == []
    assert tclock.run_threads() == 1
    assert answers == []  # synced, not landed on the reactor yet
    tclock.advance(0)
    assert answers == [None]
    assert bodies(q.read(10)) == expected(3)
    assert records(store) == []  # LMDB takes them at the next checkpoint
    store.close()


def count_appends(store: LmdbStore) -> list[int]:
    """Count the writer's appends (each one write and one fdatasync): the sizes written."""
    real = store._log.append
    sizes: list[int] = []

    def append(data: list[bytes]) -> None:
        sizes.append(sum(map(len, data)))
        real(data)

    store._log.append = append
    return sizes


def test_chunks_taken_while_the_writer_syncs_are_written_together_and_land_in_order(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    appends = count_appends(store)
    first = publish(store, q, msgs(2))
    tclock.advance(0)
    second = publish(store, q, msgs(2, 2))
    tclock.advance(0)
    assert len(tclock.jobs) == 1  # the writer is busy: the second chunk waits in its inbox
    assert tclock.run_threads() == 1
    assert len(appends) == 1  # both chunks, one write and one sync
    assert [epoch for epoch, _ in parse_chunks((tmp_path / "mqd.lmdb" / LOG_FILE).read_bytes())] == [store._log_writer.epoch - 1,
                                                                       store._log_writer.epoch]
    tclock.advance(0)
    assert first == [None] and second == [None]
    assert bodies(q.read(10)) == expected(4)
    store.close()


def test_a_failed_write_fails_every_chunk_after_it_unwritten(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    calls = failing_once(store)
    first = publish(store, q, msgs(2))
    tclock.advance(0)
    tclock.run_threads()  # the first write fails
    second = publish(store, q, msgs(2, 2))
    store.commit()  # taken before the reactor hears of the failure...
    tclock.run_threads()
    tclock.advance(0)
    assert first == [FULL] and second == [FULL]  # ...so it fails too, never written
    assert len(calls) == 1
    assert q.depth() == 0 and q.read(10) == []
    tclock.advance(store.RETRY_AFTER)
    tclock.run_threads()
    tclock.advance(0)
    assert store.failure is None
    store.close()


def test_crash_after_the_answer_keeps_the_messages_and_the_fins(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    answers = publish(store, q, msgs(4))
    synced(tclock)
    assert answers == [None]
    q.finish(q.read(1))  # the first is FINished...
    tclock.advance(0)
    assert tclock.jobs == []  # ...which nobody waits for: it goes with the next chunk
    marker = publish(store, q, msgs(1, 9))
    synced(tclock)
    assert marker == [None]  # everything before the marker is synced, the FIN too
    assert records(store) == []
    store = crash(store, tmp_path)
    q = store.open_queue("t")
    assert bodies(q.read(10)) == expected(3, 1) + expected(1, 9)
    assert store._log.size == 0  # replayed into LMDB: the log starts again
    store.close()


def test_crash_before_the_chunk_is_synced_loses_only_the_unanswered(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    answered = publish(store, q, msgs(2))
    synced(tclock)
    unanswered = publish(store, q, msgs(2, 2))
    tclock.advance(0)  # handed to the thread, never written
    assert answered == [None] and unanswered == []
    store = crash(store, tmp_path)
    assert bodies(store.open_queue("t").read(10)) == expected(2)
    store.close()


@pytest.mark.parametrize("cut", [0, 3], ids=["whole", "torn"])
def test_replay_takes_whole_chunks_and_drops_a_torn_last_one(tmp_path, tclock, cut):
    store, q = logged_queue(tmp_path, tclock)
    publish(store, q, msgs(2))
    synced(tclock)
    extra = msgs(1, 7)
    extra[0].key = KEY.pack(q.qid, 100)
    chunk = b"".join(encode_chunk(store._log_writer.epoch + 1, [extra], [], []))
    with open(tmp_path / "mqd.lmdb" / LOG_FILE, "r+b") as f:
        f.seek(store._log.size)  # right after the live chunks, as a crash mid-write leaves it
        f.write(chunk[:len(chunk) - cut])
    store = crash(store, tmp_path)
    got = bodies(store.open_queue("t").read(10))
    assert got == (expected(2) + expected(1, 7) if not cut else expected(2))
    store.close()


def test_a_checkpoint_empties_the_log_and_replay_skips_older_chunks(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    publish(store, q, msgs(3))
    synced(tclock)
    log_path = tmp_path / "mqd.lmdb" / LOG_FILE
    stale = log_path.read_bytes()
    assert [epoch for epoch, _ in parse_chunks(stale)] == [store._log_writer.epoch]
    q.finish(q.read(3))
    tclock.advance(0)
    assert tclock.jobs == []
    tclock.advance(0.25)  # quiet: the checkpoint comes on its own, with the FINs
    assert records(store) == [] and store._log.size == 0
    # A log the checkpoint emptied, back as it was (the truncate not on disk
    # at a crash): its chunks are older than the checkpoint, so the FINished
    # messages do not return.
    log_path.write_bytes(stale)
    store = crash(store, tmp_path)
    assert store.open_queue("t").read(10) == []
    store.close()


def test_enough_pending_records_are_checkpointed_into_lmdb(tmp_path, tclock, monkeypatch):
    monkeypatch.setattr("backends.lmdb._CHECKPOINT_RECORDS", 5)
    store, q = logged_queue(tmp_path, tclock)
    publish(store, q, msgs(6))
    synced(tclock)  # landed; 6 records pending: LMDB takes them now
    assert [body for _, _, body in records(store)] == expected(6)
    assert store._log.size == 0
    assert bodies(q.read(10)) == expected(6)
    store.close()


def test_a_failed_chunk_answers_the_error_and_its_publishes_never_appear(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    real = store._log.append
    full = [True]

    def append(data: list[bytes]) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(data)

    store._log.append = append
    health: list = []
    store.health_listener = health.append
    answers = publish(store, q, msgs(2))
    synced(tclock)
    assert answers == [FULL]
    assert store.failure == FULL and health == [FULL]
    assert q.depth() == 0 and q.read(10) == []
    full[0] = False
    tclock.advance(store.RETRY_AFTER)  # the retry writes a chunk: the disk has room again
    tclock.run_threads()
    tclock.advance(0)
    assert store.failure is None and health == [FULL, None]
    again = publish(store, q, msgs(1, 5))
    synced(tclock)
    assert again == [None]
    assert bodies(q.read(10)) == expected(1, 5)
    store = crash(store, tmp_path)
    assert bodies(store.open_queue("t").read(10)) == expected(1, 5)
    store.close()


def test_a_failed_chunk_keeps_the_fins_it_held_for_the_next(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    publish(store, q, msgs(3))
    synced(tclock)
    failing_once(store)
    q.finish(q.read(1))
    refused = publish(store, q, msgs(1, 9))
    tclock.advance(0)
    tclock.run_threads()  # fails
    tclock.advance(0)
    assert refused == [FULL] and store.failure == FULL
    tclock.advance(store.RETRY_AFTER)  # the retry carries the FIN again (a chunk or a checkpoint)
    tclock.run_threads()
    tclock.advance(0)
    assert store.failure is None
    store = crash(store, tmp_path)
    assert bodies(store.open_queue("t").read(10)) == expected(2, 1)
    store.close()


def test_close_waits_for_the_chunk_in_flight_and_checkpoints_everything(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    answers = publish(store, q, msgs(2))
    tclock.advance(0)
    job = tclock.jobs.pop()
    job[0](*job[1])  # the thread finishes while the reactor is closing
    store.begin_close()
    store.close()
    assert answers == [None]
    reopened = durable_store(tmp_path, Clock())
    assert [body for _, _, body in records(reopened)] == expected(2)
    reopened.close()


def test_a_log_left_by_a_durable_crash_is_replayed_by_a_store_that_is_not_durable(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    publish(store, q, msgs(2))
    synced(tclock)
    store.env.close()
    store._log.close()
    plain = LmdbStore(settings(tmp_path, backend="lmdb"), Clock())
    assert plain._log is None
    assert bodies(plain.open_queue("t").read(10)) == expected(2)
    plain.close()


def test_without_threads_a_durable_store_commits_to_lmdb_each_turn(tmp_path):
    clock = Clock()
    store = durable_store(tmp_path, clock)
    assert store._log is None
    q = store.open_queue("t")
    answers = publish(store, q, msgs(2))
    clock.advance(0)
    assert answers == [None]
    assert [body for _, _, body in records(store)] == expected(2)
    store.close()


def test_the_log_writes_more_buffers_than_one_system_call_takes_in_their_order(tmp_path):
    log = PublishLog(str(tmp_path / LOG_FILE))
    pieces = [b"%05d" % i for i in range(2500)]  # more than IOV_MAX buffers
    log.append(pieces)
    log.append([b"end"])
    assert (tmp_path / LOG_FILE).read_bytes() == b"".join(pieces) + b"end"
    assert log.size == 5 * 2500 + 3
    log.close()


def test_a_short_write_of_the_log_is_completed_in_place(tmp_path, monkeypatch):
    log = PublishLog(str(tmp_path / LOG_FILE))
    log.append([b"head"])

    def short(fd, buffers, offset):  # the kernel takes 3 bytes of the first buffer only
        return os.pwrite(fd, bytes(buffers[0])[:3], offset)

    monkeypatch.setattr(os, "pwritev", short)
    log.append([b"abcdef", b"ghij"])
    assert (tmp_path / LOG_FILE).read_bytes() == b"headabcdefghij"
    assert log.size == 14
    log.close()


def test_a_queue_emptied_while_its_chunk_is_written_answers_the_publisher_and_stays_empty(tmp_path, tclock):
    store, q = logged_queue(tmp_path, tclock)
    first = publish(store, q, msgs(3))
    tclock.advance(0)  # the chunk is handed to the writer
    q.empty()
    second = publish(store, q, msgs(2))
    synced(tclock)
    synced(tclock)
    assert first == [None] and second == [None]
    # The emptied chunk's messages never become readable; what came after it does.
    assert len(q.read(10)) == 2 and q.depth() == 0
    store.close()
