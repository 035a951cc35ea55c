"""The offset source's planning on the driver: offsets per trigger, the read limit's shares, data loss, partitions.

The brokers' answers are given by a stand-in for the driver's view of the
logs (its `now`), so every case is exact; the real brokers and Spark are
in tests/spark/test_log_source.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from spark_bridge import log_source
from spark_bridge.log_fetch import BrokerLog, LogOffsets
from spark_bridge.log_source import (
    MIN_RECORDS_PER_PARTITION,
    DataLossError,
    LogStreamReader,
    plan_ranges,
    share_limit,
)

A, B = "10.0.0.5:4150", "10.0.0.6:4150"


def offsets(epoch: int, earliest: int, latest: int) -> LogOffsets:
    return LogOffsets(epoch=epoch, earliest=earliest, latest=latest, offset_for_timestamp=None,
                      retained_bytes=0, oldest_timestamp=None)


class Logs(log_source._Logs):
    """The driver's view with the brokers' answers set by the test."""

    answers: dict[str, dict[str, LogOffsets | None]]

    def now(self, topic, *, strict, timestamp_ms=None):
        return {name: (BrokerLog(nsqd=name, http=name), offs) for name, offs in self.answers[topic].items()}

    def broker(self, topic, name):
        return BrokerLog(nsqd=name, http=name) if name in self.answers[topic] else None


def reader(**options: str) -> tuple[LogStreamReader, Logs]:
    r = LogStreamReader({"topic": "t", "nsqd": f"{A},{B}", **options})
    logs = Logs(r.options)
    r._logs = logs
    return r, logs


def at(**entries: tuple[int, int]) -> dict:
    return {"t": {(A if k == "a" else B): {"epoch": e, "offset": o} for k, (e, o) in entries.items()}}


def test_each_log_goes_to_its_latest_when_nothing_limits_it():
    r, logs = reader()
    logs.answers = {"t": {A: offsets(1, 0, 500), B: offsets(2, 10, 40)}}
    assert r.latestOffset(at(a=(1, 100), b=(2, 10)), ReadAllAvailable()) == at(a=(1, 500), b=(2, 40))


def test_max_offsets_per_trigger_is_shared_in_proportion_to_what_waits():
    r, logs = reader(maxOffsetsPerTrigger="100")
    assert r.getDefaultReadLimit().max_rows == 100
    logs.answers = {"t": {A: offsets(1, 0, 900), B: offsets(1, 0, 100)}}
    end = r.latestOffset(at(a=(1, 0), b=(1, 0)), r.getDefaultReadLimit())
    assert end == at(a=(1, 90), b=(1, 10))
    # Spark's own ReadAllAvailable (a final AvailableNow batch) is obeyed over the option.
    assert r.latestOffset(at(a=(1, 0), b=(1, 0)), ReadAllAvailable()) == at(a=(1, 900), b=(1, 100))


@given(st.dictionaries(st.integers(0, 9), st.integers(0, 10_000), max_size=6), st.integers(1, 20_000))
def test_shares_never_pass_the_limit_nor_what_waits_and_starve_no_log(waiting, most):
    shares = share_limit(waiting, most)
    assert sum(shares.values()) == min(most, sum(waiting.values()))
    assert all(0 <= shares[k] <= waiting[k] for k in waiting)
    if most >= len([n for n in waiting.values() if n]):
        assert all(shares[k] > 0 for k, n in waiting.items() if n)


def test_nothing_new_answers_the_start_itself():
    r, logs = reader()
    logs.answers = {"t": {A: offsets(1, 0, 100), B: offsets(1, 0, 0)}}
    start = at(a=(1, 100), b=(1, 0))
    assert r.latestOffset(start, ReadAllAvailable()) == start


def test_a_broker_new_to_the_query_is_read_from_its_earliest_from_the_next_batch():
    r, logs = reader()
    logs.answers = {"t": {A: offsets(1, 0, 100), B: offsets(3, 40, 90)}}
    end = r.latestOffset(at(a=(1, 100)), ReadAllAvailable())
    assert end == at(a=(1, 100), b=(3, 40))
    assert r.partitions(at(a=(1, 100)), end) == []


def test_a_broker_away_keeps_its_offsets():
    r, logs = reader()
    logs.answers = {"t": {A: None, B: offsets(1, 0, 50)}}
    assert r.latestOffset(at(a=(1, 70), b=(1, 0)), ReadAllAvailable()) == at(a=(1, 70), b=(1, 50))


def test_records_that_expired_unread_fail_the_query_naming_them():
    r, logs = reader()
    logs.answers = {"t": {A: offsets(1, 300, 400)}}
    with pytest.raises(DataLossError, match=rf"records 100-299 of topic t on nsqd {A} expired before they were read"):
        r.latestOffset(at(a=(1, 100)), ReadAllAvailable())


def test_without_fail_on_data_loss_the_read_goes_on_from_what_is_kept():
    r, logs = reader(failOnDataLoss="false")
    logs.answers = {"t": {A: offsets(1, 300, 400)}}
    end = r.latestOffset(at(a=(1, 100)), ReadMaxRows(50))
    assert end == at(a=(1, 350))


def test_a_recreated_log_is_data_loss_then_read_from_its_new_start():
    r, logs = reader()
    logs.answers = {"t": {A: offsets(9, 0, 30)}}
    with pytest.raises(DataLossError, match=r"was recreated \(epoch 1 -> 9\)"):
        r.latestOffset(at(a=(1, 100)), ReadAllAvailable())
    r, logs = reader(failOnDataLoss="false")
    logs.answers = {"t": {A: offsets(9, 0, 30)}}
    end = r.latestOffset(at(a=(1, 100)), ReadAllAvailable())
    assert end == at(a=(9, 0))
    assert r.partitions(at(a=(1, 100)), end) == []
    assert r.latestOffset(end, ReadAllAvailable()) == at(a=(9, 30))


def test_a_log_that_ends_before_the_query_read_to_is_data_loss_then_read_on_from_its_end():
    """A broker that lost what it had not synced gives those offsets to new records: as Kafka's offsets going back."""
    r, logs = reader()
    logs.answers = {"t": {A: offsets(1, 0, 80)}}
    with pytest.raises(DataLossError, match=rf"topic t on nsqd {A} now ends at offset 80, before offset 100"):
        r.latestOffset(at(a=(1, 100)), ReadAllAvailable())
    r, logs = reader(failOnDataLoss="false")
    logs.answers = {"t": {A: offsets(1, 0, 80)}}
    end = r.latestOffset(at(a=(1, 100)), ReadAllAvailable())
    assert end == at(a=(1, 80)) and r.partitions(at(a=(1, 100)), end) == []
    logs.answers = {"t": {A: offsets(1, 0, 130)}}
    assert r.latestOffset(end, ReadAllAvailable()) == at(a=(1, 130))


def test_the_progress_reports_each_logs_latest_offset_as_the_last_trigger_found_it():
    r, logs = reader()
    assert r.reportLatestOffset() is None
    logs.answers = {"t": {A: offsets(1, 0, 500), B: None}}
    r.latestOffset(at(a=(1, 100)), ReadMaxRows(10))
    assert r.reportLatestOffset() == at(a=(1, 500))


def test_available_now_reads_up_to_the_latest_offsets_when_it_began():
    r, logs = reader()
    logs.answers = {"t": {A: offsets(1, 0, 100)}}
    r.prepareForTriggerAvailableNow()
    logs.answers = {"t": {A: offsets(1, 0, 250)}}
    end = r.latestOffset(at(a=(1, 40)), ReadAllAvailable())
    assert end == at(a=(1, 100))
    assert r.latestOffset(end, ReadAllAvailable()) == end


def test_partitions_are_the_ranges_between_start_and_end_cut_for_min_partitions():
    r, logs = reader(minPartitions="4")
    logs.answers = {"t": {A: offsets(1, 0, 10**6), B: offsets(1, 0, 10**6)}}
    parts = r.partitions(at(a=(1, 0), b=(1, 500)), at(a=(1, 30_000), b=(1, 10_500)))
    spans = sorted((p.broker.nsqd, p.start, p.end) for p in parts)
    assert spans == [(A, 0, 10_000), (A, 10_000, 20_000), (A, 20_000, 30_000), (B, 500, 10_500)]
    assert {p.epoch for p in parts} == {1}


def test_a_range_is_never_cut_below_the_smallest_worthwhile_piece():
    ranges = [(BrokerLog(nsqd=A, http=A), "t", 0, MIN_RECORDS_PER_PARTITION + 1, 1)]
    assert len(plan_ranges(ranges, 64, True, 1 << 20)) == 1
