"""Every store's retained log through IRetainedLog: offsets, reads and their bounds, expiry, time search, delete.

Each store kind of tests.support.retained_stores (memory, LMDB default,
LMDB --durable with a commit per turn, and with the publish log) is
driven on its own clock; LMDB tests also restart and crash the store,
fail a commit, and look at what the environment holds (the registry,
`meta`, a snapshot of it).
"""

from __future__ import annotations

import errno
import os

import pytest
from zope.interface.verify import verifyObject

import backends.retained_index as retained_index
from backends.interface import BackendError, IRetainedLog, IRetainingStore, OffsetOutOfRange
from backends.lmdb_batches import BATCH_HEAD
from backends.lmdb_records import KEY, RECORD_HEAD, RETAINED, RETAINED_META
from backends.retained_index import TimeIndex
from mqd.message import Run
from mqd.wire.log_frames import FRAME_OVERHEAD, iter_frames
from tests.support.inprocess_broker import failing_once
from tests.support.retained_stores import KINDS, LMDB_KINDS, LogStores, records_of

STAMPS = [1_000 + 10 * i for i in range(20)]


@pytest.fixture(params=KINDS)
def stores(request, tmp_path):
    s = LogStores(request.param, tmp_path)
    yield s
    s.close()


@pytest.fixture(params=LMDB_KINDS)
def lmdb_stores(request, tmp_path):
    s = LogStores(request.param, tmp_path)
    yield s
    s.close()


def filled(s: LogStores, stamps: list[int] = STAMPS, name: str = "t"):
    """The log of topic `name` holding records with `stamps` (offsets 0 on), readable."""
    log = s.store.open_log(name)
    log.append(records_of(stamps))
    s.settle()
    return log


def everything(log) -> list[tuple[int, int, bytes]]:
    return log.read(log.earliest(), 1 << 30, 1 << 40)


def expected(stamps: list[int], start: int = 0) -> list[tuple[int, int, bytes]]:
    return [(n, ts, b"%016d" % n + b"r%d" % n) for n, ts in enumerate(stamps, start)][start:]


def frames(log, offset: int, max_messages: int, max_bytes: int) -> tuple[list[tuple[int, int, bytes]], int]:
    """`read_frames` decoded back into what `read` gives: (offset, timestamp, id + body)."""
    data, after = log.read_frames(offset, max_messages, max_bytes)
    out = []
    for off, ts, attempts, msg_id, body in iter_frames(data):
        assert attempts == 0
        out.append((off, ts, msg_id + body))
    return out, after


# -- the interface ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [*KINDS, "dummy"])
def test_every_store_provides_the_retained_log_interfaces(kind, tmp_path):
    s = LogStores(kind, tmp_path)
    assert verifyObject(IRetainingStore, s.store)
    log = s.store.open_log("t")
    assert verifyObject(IRetainedLog, log)
    assert log.name == "t"
    assert log.kept is (kind != "dummy")
    assert (log.epoch == 0) is (kind == "dummy")
    assert 0 <= log.epoch < 1 << 63
    if kind != "dummy":  # which hands out a new one each time, as its queues
        assert s.store.open_log("t") is log
    s.close()


def test_the_dummy_log_keeps_nothing(tmp_path):
    s = LogStores("dummy", tmp_path)
    log = s.store.open_log("t")
    log.append(records_of(STAMPS))
    assert (log.earliest(), log.latest(), log.retained_bytes(), log.oldest_timestamp()) == (0, 0, 0, None)
    assert log.read(0, 10, 100) == []
    assert log.read_frames(0, 10, 100) == (b"", 0)
    assert log.frames_extent(0, 10, 100) == (0, 0)
    assert log.offset_for_timestamp(0) == 0
    assert log.expire(10**20, 1) == 0
    with pytest.raises(OffsetOutOfRange):
        log.read(1, 10, 100)
    assert s.store.log_names() == []


# -- appending and reading ------------------------------------------------------------------


def test_records_get_offsets_from_zero_in_order_and_read_back_whole(stores):
    log = stores.store.open_log("t")
    assert (log.earliest(), log.latest(), log.oldest_timestamp()) == (0, 0, None)
    log.append(records_of(STAMPS[:5]))
    log.append(records_of(STAMPS[5:], start=5))
    stores.settle()
    assert (log.earliest(), log.latest()) == (0, 20)
    assert everything(log) == expected(STAMPS)
    assert log.oldest_timestamp() == STAMPS[0]
    assert log.retained_bytes() == sum(FRAME_OVERHEAD + len(data) for _, _, data in expected(STAMPS))
    assert stores.store.log_names() == ["t"]


def test_appending_changes_nothing_of_the_messages(stores):
    log = stores.store.open_log("t")
    messages = records_of(STAMPS[:3])
    for m in messages:
        m.key = b"their own"
        m.attempts = 4
    log.append(messages, fresh=stores.durable)
    stores.settle()
    assert [(m.key, m.attempts) for m in messages] == [(b"their own", 4)] * 3
    assert everything(log) == expected(STAMPS[:3])


def test_a_run_is_retained_as_its_messages_would_be(stores, monkeypatch):
    # A publish held as a run (one timestamp, a list of id + body) and the
    # same publish as Messages leave the same records, split at the same bounds.
    monkeypatch.setattr(retained_index, "MAX_BATCH_RECORDS", 3)
    runs = stores.store.open_log("runs")
    messages = stores.store.open_log("messages")
    for start, stop in ((0, 1), (1, 8), (8, 9)):
        publish = records_of([STAMPS[start]] * (stop - start), start=start)
        runs.append(Run([m.data for m in publish], STAMPS[start]))
        messages.append(publish)
    stores.settle()
    assert everything(runs) == everything(messages)
    assert [ts for _, ts, _ in everything(runs)] == [STAMPS[0]] + [STAMPS[1]] * 7 + [STAMPS[8]]
    assert runs.retained_bytes() == messages.retained_bytes()
    assert runs.offset_for_timestamp(STAMPS[1] + 1) == 8


def test_durable_records_are_readable_only_once_committed(lmdb_stores):
    s = lmdb_stores
    log = s.store.open_log("t")
    s.settle()
    log.append(records_of(STAMPS[:3]), fresh=True)
    assert log.latest() == (0 if s.durable else 3)
    s.settle()
    assert log.latest() == 3
    assert everything(log) == expected(STAMPS[:3])


@pytest.mark.parametrize("settled", [True, False], ids=["written", "in memory"])
def test_read_bounds_count_messages_and_data_bytes_the_first_always_whole(stores, settled):
    log = stores.store.open_log("t")
    log.append(records_of(STAMPS))
    if settled or stores.durable:
        stores.settle()
    size = len(expected(STAMPS)[12][2])  # every record's data is as long from offset 10 on
    assert log.read(3, 4, 1 << 20) == expected(STAMPS)[3:7]
    assert log.read(3, 100, 0) == expected(STAMPS)[3:4]
    assert log.read(12, 100, 3 * size) == expected(STAMPS)[12:15]
    assert log.read(12, 100, 3 * size - 1) == expected(STAMPS)[12:14]
    assert log.read(18, 100, 1 << 20) == expected(STAMPS)[18:]
    assert log.read(20, 100, 1 << 20) == []
    assert log.read(5, 0, 1 << 20) == []
    for offset, count, limit in [(0, 20, 1 << 20), (3, 4, 1 << 20), (12, 100, 3 * size), (12, 100, 3 * size - 1),
                                 (19, 5, 0), (20, 5, 100), (0, 1, 0)]:
        records = log.read(offset, count, limit)
        assert frames(log, offset, count, limit) == (records, offset + len(records))


@pytest.mark.parametrize("settled", [True, False], ids=["written", "in memory"])
def test_frames_extent_measures_what_read_frames_would_build(stores, monkeypatch, settled):
    monkeypatch.setattr(retained_index, "MAX_BATCH_RECORDS", 3)
    log = stores.store.open_log("t")
    log.append(records_of(STAMPS[:7]))
    log.append(records_of(STAMPS[7:], start=7))
    if settled or stores.durable:
        stores.settle()
    size = len(expected(STAMPS)[12][2])
    for offset, count, limit in [(0, 20, 1 << 20), (3, 4, 1 << 20), (12, 100, 3 * size), (12, 100, 3 * size - 1),
                                 (19, 5, 0), (20, 5, 100), (0, 1, 0), (2, 9, 5 * size), (5, 0, 100)]:
        built, after = log.read_frames(offset, count, limit)
        assert log.frames_extent(offset, count, limit) == (len(built), after), (offset, count, limit)


@pytest.mark.parametrize("offset", [-1, 21, 1000])
def test_an_offset_outside_the_log_names_its_bounds(stores, offset):
    log = filled(stores)
    for read in (log.read, log.read_frames, log.frames_extent):
        with pytest.raises(OffsetOutOfRange) as e:
            read(offset, 10, 100)
        assert (e.value.offset, e.value.earliest, e.value.latest) == (offset, 0, 20)


def test_below_the_earliest_kept_offset_is_out_of_range(stores):
    log = filled(stores)
    assert log.expire(STAMPS[5], 0) == 5
    stores.settle()
    with pytest.raises(OffsetOutOfRange) as e:
        log.read(4, 10, 100)
    assert (e.value.earliest, e.value.latest) == (5, 20)
    assert log.read(5, 1, 100) == expected(STAMPS)[5:6]


def test_reads_span_written_records_and_those_in_memory(lmdb_stores):
    s = lmdb_stores
    log = filled(s, STAMPS[:10])
    log.append(records_of(STAMPS[10:], start=10))
    if s.durable:
        s.settle()
    assert everything(log) == expected(STAMPS)
    assert frames(log, 8, 5, 1 << 20) == (expected(STAMPS)[8:13], 13)


# -- expiry ------------------------------------------------------------------------------------


def test_expire_by_time_drops_the_head_records_older_than_the_bound(stores):
    log = filled(stores)
    assert log.expire(STAMPS[0], 0) == 0
    assert log.expire(STAMPS[7] + 1, 0) == 8
    stores.settle()
    assert (log.earliest(), log.latest(), log.oldest_timestamp()) == (8, 20, STAMPS[8])
    assert everything(log) == expected(STAMPS)[8:]
    assert log.retained_bytes() == sum(FRAME_OVERHEAD + len(d) for _, _, d in expected(STAMPS)[8:])


def test_expire_by_time_stops_at_a_newer_head_record_when_the_clock_stepped_back(stores):
    stamps = [100, 500, 200, 300, 600]
    log = filled(stores, stamps)
    assert log.expire(400, 0) == 1  # 500 is not older: 200 and 300 behind it stay
    assert everything(log) == expected(stamps)[1:]


def test_expire_by_bytes_keeps_the_log_within_the_bound(stores):
    log = filled(stores)
    size = FRAME_OVERHEAD + len(expected(STAMPS)[12][2])
    assert log.expire(0, 5 * size) == 15
    stores.settle()
    assert (log.earliest(), log.retained_bytes()) == (15, 5 * size)
    assert log.expire(0, 5 * size) == 0
    assert log.expire(0, 5 * size - 1) == 1


def test_either_bound_expires_and_neither_more_than_it_must(stores):
    log = filled(stores)
    size = FRAME_OVERHEAD + len(expected(STAMPS)[12][2])
    assert log.expire(STAMPS[3], 100 * size) == 3  # time says 3, bytes nothing
    assert log.expire(STAMPS[3], 10 * size) == 7  # bytes says 7 more
    assert log.expire(0, 0) == 0
    assert log.earliest() == 10


def test_an_expiry_call_drops_a_bounded_number_of_records_in_whole_batches(lmdb_stores, monkeypatch):
    import backends.lmdb_retained as lmdb_retained

    s = lmdb_stores
    monkeypatch.setattr(lmdb_retained, "EXPIRE_RECORDS", 5)
    log = s.store.open_log("t")
    for start in range(0, 12, 3):
        log.append(records_of(STAMPS[start:start + 3], start=start))
    s.settle()
    assert [log.expire(10**18, 0) for _ in range(5)] == [3, 3, 3, 3, 0]
    assert (log.earliest(), log.latest(), log.retained_bytes()) == (12, 12, 0)
    log.append(records_of(STAMPS[12:], start=12))  # one batch of 8: more than a call's share, it goes whole
    s.settle()
    assert log.expire(10**18, 0) == 8


def test_expiring_everything_keeps_the_offsets_going(stores):
    log = filled(stores)
    assert log.expire(10**18, 0) == 20
    stores.settle()
    assert (log.earliest(), log.latest(), log.retained_bytes(), log.oldest_timestamp()) == (20, 20, 0, None)
    assert log.read(20, 10, 100) == []
    log.append(records_of([5, 6], start=20))
    stores.settle()
    assert everything(log) == expected(STAMPS + [5, 6])[20:]


def test_expiry_of_batches_not_written_yet_never_writes_them(tmp_path):
    s = LogStores("lmdb", tmp_path)
    log = s.store.open_log("t")
    log.append(records_of(STAMPS[:10]))
    log.append(records_of(STAMPS[10:], start=10))
    assert log.expire(STAMPS[15], 0) == 15  # before any commit
    s.settle()
    with s.store.env.begin(db=s.store.data_db) as txn:
        stored = [KEY.unpack(k)[1] for k, _ in txn.cursor() if KEY.unpack(k)[0] == log.qid]
    assert stored == [10]  # the second batch, whole: its first five records are below earliest
    assert everything(log) == expected(STAMPS)[15:]
    s.close()


def test_a_batch_goes_whole_only_once_every_record_of_it_must(stores):
    log = stores.store.open_log("t")
    log.append(records_of(STAMPS[:10]))
    log.append(records_of(STAMPS[10:], start=10))
    stores.settle()
    assert log.expire(STAMPS[3], 0) == 3
    assert (log.earliest(), log.oldest_timestamp()) == (3, STAMPS[3])
    assert log.expire(STAMPS[12], 0) == 9
    stores.settle()
    assert (log.earliest(), log.oldest_timestamp()) == (12, STAMPS[12])
    assert everything(log) == expected(STAMPS)[12:]
    assert log.retained_bytes() == sum(FRAME_OVERHEAD + len(d) for _, _, d in expected(STAMPS)[12:])
    with pytest.raises(OffsetOutOfRange):
        log.read_frames(11, 10, 100)
    if stores.lmdb:
        with stores.store.env.begin(db=stores.store.data_db) as txn:
            assert [KEY.unpack(k)[1] for k, _ in txn.cursor() if KEY.unpack(k)[0] == log.qid] == [10]


def test_a_publish_is_one_batch_split_only_past_the_bounds(stores, monkeypatch):
    log = stores.store.open_log("t")
    log.append(records_of(STAMPS[:8]))
    monkeypatch.setattr(retained_index, "MAX_BATCH_RECORDS", 3)
    log.append(records_of(STAMPS[8:], start=8))  # 12 records: 4 batches of 3
    stores.settle()
    assert everything(log) == expected(STAMPS)
    assert log.expire(STAMPS[13], 0) == 13
    assert everything(log) == expected(STAMPS)[13:]
    stores.settle()
    if stores.lmdb:
        with stores.store.env.begin(db=stores.store.data_db) as txn:
            assert [KEY.unpack(k)[1] for k, _ in txn.cursor() if KEY.unpack(k)[0] == log.qid] == [11, 14, 17]


def test_a_batch_is_split_past_its_bytes_bound(stores, monkeypatch):
    size = FRAME_OVERHEAD + len(expected(STAMPS)[12][2])
    monkeypatch.setattr(retained_index, "MAX_BATCH_BYTES", 4 * size)
    log = filled(stores, STAMPS[10:])  # 10 records of the same size
    stores.settle()
    assert [ts for _, ts, _ in everything(log)] == STAMPS[10:]
    # Batches of 4, 4 and 2: expiry takes a batch whole only once all of it is due.
    assert log.expire(STAMPS[14], 0) == 4
    assert log.earliest() == 4
    if stores.lmdb:
        stores.settle()
        with stores.store.env.begin(db=stores.store.data_db) as txn:
            assert [KEY.unpack(k)[1] for k, _ in txn.cursor() if KEY.unpack(k)[0] == log.qid] == [4, 8]


# -- the time search ---------------------------------------------------------------------------


def test_offset_for_timestamp_is_the_first_record_at_or_after_it(stores):
    log = filled(stores)
    assert log.offset_for_timestamp(0) == 0
    assert log.offset_for_timestamp(STAMPS[4]) == 4
    assert log.offset_for_timestamp(STAMPS[4] + 1) == 5
    assert log.offset_for_timestamp(STAMPS[-1] + 1) == 20


def test_offset_for_timestamp_is_exact_when_the_clock_stepped_back(stores, monkeypatch):
    monkeypatch.setattr(retained_index, "FANOUT", 2)  # several levels with a few records
    stamps = [50, 10, 20, 90, 30, 40, 95, 60, 70, 15]
    log = filled(stores, stamps)

    def first_at_or_after(t: int, start: int) -> int:
        return next((i for i in range(start, len(stamps)) if stamps[i] >= t), len(stamps))

    for t in range(0, 100, 5):
        assert log.offset_for_timestamp(t) == first_at_or_after(t, 0), t
    log.expire(60, 0)  # 50, 10, 20 go; 90 stops it
    stores.settle()
    assert log.earliest() == 3
    for t in range(0, 100, 5):
        assert log.offset_for_timestamp(t) == first_at_or_after(t, 3), t


def test_offset_for_timestamp_is_exact_across_batches_when_the_clock_stepped_back(stores, monkeypatch):
    monkeypatch.setattr(retained_index, "FANOUT", 2)
    stamps = [50, 10, 20, 90, 30, 40, 95, 60, 70, 15, 12, 11, 80, 5]
    log = stores.store.open_log("t")
    for start in range(0, len(stamps), 3):
        log.append(records_of(stamps[start:start + 3], start=start))
    stores.settle()

    def first_at_or_after(t: int, start: int) -> int:
        return next((i for i in range(start, len(stamps)) if stamps[i] >= t), len(stamps))

    for head in (0, 1, 4, 7):
        assert log.expire(0, 0) == 0
        if head:
            log.expire(0, log.retained_bytes() - sum(FRAME_OVERHEAD + len(d) for _, _, d in
                                                     expected(stamps)[log.earliest():head]))
        assert log.earliest() == head
        for t in range(0, 100, 5):
            assert log.offset_for_timestamp(t) == first_at_or_after(t, head), (head, t)


def test_the_time_index_agrees_with_a_scan_whatever_the_timestamps(monkeypatch):
    monkeypatch.setattr(retained_index, "FANOUT", 3)
    import random

    rnd = random.Random(7)
    stamps: list[int] = []
    starts: list[int] = []  # the offsets where batches start
    index = TimeIndex()
    head = 0

    def top(i: int) -> int:
        end = starts[i + 1] if i + 1 < len(starts) else len(stamps)
        return max(stamps[starts[i]:end])

    def scan(lo: int, hi: int) -> list[tuple[int, int]]:
        return [(starts[i], top(i)) for i in range(len(starts)) if lo <= starts[i] < hi]

    for _ in range(400):
        if rnd.random() < 0.7:
            batch = [rnd.randint(0, 60) for _ in range(rnd.choice([1, 1, 2, 5, 12]))]
            starts.append(len(stamps))
            index.add(len(stamps), len(batch), max(batch))
            stamps += batch
        else:
            head = rnd.randint(head, len(stamps))
            index.trim(head)
        start, t = rnd.randint(head, len(stamps)), rnd.randint(-1, 61)
        want = next((starts[i] for i in range(len(starts)) if starts[i] >= start and top(i) >= t), None)
        assert index.find(start, t, scan) == want


# -- delete --------------------------------------------------------------------------------------


def test_delete_forgets_the_log_and_opening_it_again_is_a_new_epoch_from_zero(stores):
    log = filled(stores)
    epoch = log.epoch
    log.delete()
    stores.settle()
    assert stores.store.log_names() == []
    with pytest.raises(BackendError):
        log.append(records_of([1]))
    again = stores.store.open_log("t")
    assert again is not log
    assert again.epoch != epoch
    assert (again.earliest(), again.latest()) == (0, 0)
    again.append(records_of([7, 8]))
    stores.settle()
    assert everything(again) == expected([7, 8])


def test_a_deleted_log_leaves_nothing_in_lmdb(lmdb_stores):
    s = lmdb_stores
    log = filled(s)
    log.append(records_of([5], start=20))  # staged, maybe not written
    log.delete()
    s.settle()
    with s.store.env.begin() as txn:
        assert txn.get(RETAINED_META + b"t", db=s.store.meta_db) is None
        assert [k for k, _ in txn.cursor(db=s.store.data_db)] == []
        assert [k for k, _ in txn.cursor(db=s.store.registry_db)] == []
    s.restart()
    assert s.store.log_names() == []


# -- LMDB: the registry, restarts, crashes, failures ------------------------------------------------


def test_queue_names_leave_the_logs_out_and_log_names_list_them(lmdb_stores):
    s = lmdb_stores
    s.store.open_queue("t")
    s.store.open_queue("t:c")
    filled(s, name="t")
    filled(s, name="u")
    assert s.store.queue_names() == ["t", "t:c"]
    assert s.store.log_names() == ["t", "u"]
    s.restart()
    assert s.store.queue_names() == ["t", "t:c"]
    assert s.store.log_names() == ["t", "u"]


@pytest.mark.parametrize("how", ["restart", "crash"])
def test_a_log_comes_back_whole_with_its_epoch(lmdb_stores, how):
    s = lmdb_stores
    log = filled(s, STAMPS[:12])
    log.append(records_of(STAMPS[12:], start=12))
    log.expire(STAMPS[4], 0)
    s.settle()
    epoch, size = log.epoch, log.retained_bytes()
    getattr(s, how)()
    log = s.store.open_log("t")
    assert (log.epoch, log.earliest(), log.latest()) == (epoch, 4, 20)
    assert (log.retained_bytes(), log.oldest_timestamp()) == (size, STAMPS[4])
    assert everything(log) == expected(STAMPS)[4:]
    assert log.offset_for_timestamp(STAMPS[9]) == 9


def test_offsets_are_never_given_again_after_everything_expired_and_a_restart(lmdb_stores):
    s = lmdb_stores
    log = filled(s)
    log.expire(10**18, 0)
    s.settle()
    with s.store.env.begin(db=s.store.meta_db) as txn:
        assert RETAINED.unpack(txn.get(RETAINED_META + b"t")) == (log.epoch, 20)
    epoch = log.epoch
    s.restart()
    log = s.store.open_log("t")
    assert (log.epoch, log.earliest(), log.latest()) == (epoch, 20, 20)
    log.append(records_of([1], start=20))
    s.settle()
    assert everything(log) == expected(STAMPS + [1])[20:]


def test_a_stored_head_below_the_floor_is_dropped_at_open(tmp_path):
    s = LogStores("lmdb", tmp_path)
    log = s.store.open_log("t")
    for start in (0, 4, 12):
        log.append(records_of(STAMPS[start:{0: 4, 4: 12, 12: 20}[start]], start=start))
    s.settle()
    qid, epoch = log.qid, log.epoch
    s.store.close()
    s.reopen()
    store = s.store
    # The floor landed, the deletion of the head did not (a shutdown on a full disk).
    with store.env.begin(write=True, db=store.meta_db) as txn:
        txn.put(RETAINED_META + b"t", RETAINED.pack(epoch, 6))
    log = store.open_log("t")
    assert (log.earliest(), log.latest(), log.oldest_timestamp()) == (6, 20, STAMPS[6])
    assert everything(log) == expected(STAMPS)[6:]
    assert log.retained_bytes() == sum(FRAME_OVERHEAD + len(d) for _, _, d in expected(STAMPS)[6:])
    s.settle()
    with store.env.begin(db=store.data_db) as txn:
        assert [KEY.unpack(k)[1] for k, _ in txn.cursor() if KEY.unpack(k)[0] == qid] == [4, 12]
    s.close()


def test_durable_crash_replays_every_committed_record_from_the_publish_log(tmp_path):
    s = LogStores("durable_log", tmp_path)
    log = filled(s, STAMPS[:5])
    log.append(records_of(STAMPS[5:], start=5), fresh=True)
    s.settle()  # landed: answered, readable; LMDB has not taken them (no checkpoint due)
    assert s.store._log.size > 0
    epoch = log.epoch
    s.crash()
    log = s.store.open_log("t")
    assert (log.epoch, log.earliest(), log.latest()) == (epoch, 0, 20)
    assert everything(log) == expected(STAMPS)


def test_durable_crash_before_the_commit_loses_only_what_nobody_could_read(tmp_path):
    s = LogStores("durable", tmp_path)
    log = filled(s, STAMPS[:5])
    log.append(records_of(STAMPS[5:], start=5), fresh=True)  # no commit ran
    s.crash()
    log = s.store.open_log("t")
    assert log.latest() == 5
    log.append(records_of([1], start=5), fresh=True)
    s.settle()
    assert everything(log)[-1] == (5, 1, b"%016d" % 5 + b"r5")


def test_a_failed_durable_commit_drops_its_records_and_gives_their_offsets_again(tmp_path):
    s = LogStores("durable", tmp_path)
    log = filled(s, STAMPS[:5])
    failing_once(s.store)
    answers: list = []
    log.append(records_of(STAMPS[5:8], start=5), fresh=True)
    s.store.when_durable(answers.append)
    s.clock.advance(0)
    assert answers and answers[0] is not None  # the publisher hears of the failure
    assert (log.latest(), everything(log)) == (5, expected(STAMPS[:5]))
    s.clock.advance(s.store.RETRY_AFTER)  # the retry succeeds: healthy again
    assert s.store.failure is None
    log.append(records_of([7, 8], start=50), fresh=True)
    s.settle()
    assert [(o, ts) for o, ts, _ in everything(log)][5:] == [(5, 7), (6, 8)]


def test_a_failed_chunk_drops_its_records_and_renumbers_those_staged_after_it(tmp_path):
    s = LogStores("durable_log", tmp_path)
    log = filled(s, STAMPS[:5])
    store, clock = s.store, s.clock
    real = store._log.append
    calls: list = []

    def append(data):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(data)

    store._log.append = append
    first: list = []
    later: list = []
    log.append(records_of([100, 101], start=5), fresh=True)
    store.when_durable(first.append)
    clock.advance(0)  # the chunk goes to the writer
    clock.run_threads()  # whose write fails
    log.append(records_of([200, 201, 202], start=7), fresh=True)  # staged meanwhile
    store.when_durable(later.append)
    clock.advance(0)  # the failure lands
    assert first and first[0] is not None and not later
    assert log.latest() == 5
    clock.advance(store.RETRY_AFTER)
    s.settle()
    assert later == [None]
    assert [(o, ts) for o, ts, _ in everything(log)][5:] == [(5, 200), (6, 201), (7, 202)]
    epoch = log.epoch
    s.crash()
    log = s.store.open_log("t")
    assert (log.epoch, [(o, ts) for o, ts, _ in everything(log)][5:]) == (epoch, [(5, 200), (6, 201), (7, 202)])


def test_a_failed_commit_in_default_mode_keeps_the_records_and_retries(tmp_path):
    s = LogStores("lmdb", tmp_path)
    log = s.store.open_log("t")
    s.settle()
    failing_once(s.store)
    log.append(records_of(STAMPS[:3]))
    s.clock.advance(0)
    assert s.store.failure is not None
    assert everything(log) == expected(STAMPS[:3])
    with pytest.raises(BackendError):
        log.append(records_of([1], start=3))
    s.clock.advance(s.store.RETRY_AFTER)
    assert s.store.failure is None
    s.restart()
    assert everything(s.store.open_log("t")) == expected(STAMPS[:3])


def test_a_publish_is_stored_as_one_record_of_its_timestamps_lengths_and_data(tmp_path):
    s = LogStores("lmdb", tmp_path)
    log = filled(s, [8, 8])  # a publish: one timestamp
    log.append(records_of([5, 9, 7], start=2))
    s.settle()
    with s.store.env.begin() as txn:
        assert txn.get(b"t/log", db=s.store.registry_db) is not None
        stored = [(KEY.unpack(k)[1], bytes(v)) for k, v in txn.cursor(db=s.store.data_db)]
    assert [first for first, _ in stored] == [0, 2]
    datas = [data for _, _, data in expected([8, 8, 5, 9, 7])]
    # One timestamp for the whole batch: RECORD_HEAD's.
    assert stored[0][1] == (RECORD_HEAD.pack(8, 0, 0.0) + BATCH_HEAD.pack(2, 0)
                            + b"".join(len(d).to_bytes(4, "big") for d in datas[:2]) + b"".join(datas[:2]))
    # Timestamps of their own: RECORD_HEAD's is the largest.
    assert stored[1][1] == (RECORD_HEAD.pack(9, 0, 0.0) + BATCH_HEAD.pack(3, 1)
                            + b"".join(t.to_bytes(8, "big") for t in (5, 9, 7))
                            + b"".join(len(d).to_bytes(4, "big") for d in datas[2:]) + b"".join(datas[2:]))
    assert frames(log, 1, 10, 1 << 20) == (expected([8, 8, 5, 9, 7])[1:], 5)
    s.close()


def test_a_snapshot_of_a_store_with_a_log_is_taken_and_read(tmp_path):
    from mqd.nsqd.snapshot_format import take_snapshot
    from spark_bridge.records import open_snapshot, read_ranges, snapshot_ranges
    from tests.support.inprocess_broker import msgs

    s = LogStores("lmdb", tmp_path / "data")
    s.store.open_queue("t").put(msgs(3))
    filled(s, STAMPS[:5])
    s.store.close()
    manifest = take_snapshot(tmp_path / "data", tmp_path / "snap")
    queue = next(q for q in manifest.queues if q.name == "t")
    assert (queue.count, queue.first_seq, queue.last_seq) == (3, 0, 2)
    read, env = open_snapshot(tmp_path / "snap")
    try:
        rows = [r for b in read_ranges(env, snapshot_ranges(read)) for r in b.to_pylist()]
    finally:
        env.close()
    assert [r["body"] for r in rows if r["topic"] == "t"] == [b"m0", b"m1", b"m2"]


def test_a_snapshot_does_not_show_a_log_as_a_queue(tmp_path):
    from mqd.nsqd.snapshot_format import take_snapshot

    s = LogStores("lmdb", tmp_path / "data")
    s.store.open_queue("t")
    filled(s, STAMPS[:5])
    s.store.close()
    manifest = take_snapshot(tmp_path / "data", tmp_path / "snap")
    assert [q.name for q in manifest.queues] == ["t"]


def test_records_a_full_disk_shutdown_could_not_write_come_back_from_the_spill_file(tmp_path):
    from backends.lmdb_spill import SPILL_FILE
    from tests.support.full_disk import SmallDisk

    s = LogStores("lmdb", tmp_path)
    log = filled(s, STAMPS[:3])
    epoch = log.epoch
    for n in range(3, 103):  # readable, not written: a batch each
        log.append(records_of([5], start=n))
    SmallDisk(s.store, room=40)
    s.store.close()  # 40 written, 60 spilled
    assert (tmp_path / SPILL_FILE).exists()
    s.reopen()  # which reads the spill file back
    log = s.store.open_log("t")
    assert (log.epoch, log.earliest(), log.latest()) == (epoch, 0, 103)
    assert everything(log) == expected(STAMPS[:3] + [5] * 100)
    s.settle()
    assert not (tmp_path / SPILL_FILE).exists()
    s.restart()
    assert everything(s.store.open_log("t")) == expected(STAMPS[:3] + [5] * 100)


def test_a_batch_partly_expired_and_spilled_comes_back_from_the_same_earliest(tmp_path):
    from backends.lmdb_spill import SPILL_FILE
    from tests.support.full_disk import SmallDisk

    s = LogStores("lmdb", tmp_path)
    log = filled(s, STAMPS[:3])
    log.append(records_of(STAMPS[3:10], start=3))  # readable, not written
    log.append(records_of(STAMPS[10:], start=10))
    assert log.expire(STAMPS[6], 0) == 6  # the first batch whole, the second from offset 6
    epoch = log.epoch
    SmallDisk(s.store, room=1)  # the new earliest only: both batches spilled
    s.store.close()
    assert (tmp_path / SPILL_FILE).exists()
    s.reopen()
    log = s.store.open_log("t")
    assert (log.epoch, log.earliest(), log.latest(), log.oldest_timestamp()) == (epoch, 6, 20, STAMPS[6])
    assert everything(log) == expected(STAMPS)[6:]
    assert log.retained_bytes() == sum(FRAME_OVERHEAD + len(d) for _, _, d in expected(STAMPS)[6:])
    s.restart()
    log = s.store.open_log("t")
    assert (log.earliest(), everything(log)) == (6, expected(STAMPS)[6:])
