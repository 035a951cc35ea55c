"""spark_bridge.records without Spark: decoding snapshot records to Arrow, planning partitions."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqd.nsqd.snapshot_format import QueueInfo, SnapshotError, read_manifest
from spark_bridge import records
from spark_bridge.records import (
    ARROW_SCHEMA,
    KeyRange,
    QueueFilter,
    open_snapshot,
    plan_partitions,
    read_ranges,
    snapshot_ranges,
)
from tests.support.known_snapshots import Held, build_snapshot, expected_rows, message, messages


def read_all(path, ranges=None, **kwargs) -> list[pa.RecordBatch]:
    manifest, env = open_snapshot(path)
    try:
        return list(read_ranges(env, snapshot_ranges(manifest) if ranges is None else ranges, **kwargs))
    finally:
        env.close()


def rows(batches: list[pa.RecordBatch]) -> list[dict]:
    return [row for b in batches for row in b.to_pylist()]


# -- decoding ---------------------------------------------------------------------------


def test_batches_have_exactly_the_schema_and_the_written_values(known_snapshot):
    batches = read_all(known_snapshot.path)
    for b in batches:
        assert b.schema.equals(ARROW_SCHEMA, check_metadata=True)
        assert [f.nullable for f in b.schema] == [True] * len(ARROW_SCHEMA)
    assert rows(batches) == known_snapshot.rows
    assert len(known_snapshot.rows) == 98


def test_a_batch_never_spans_queues_and_respects_batch_rows(known_snapshot):
    batches = read_all(known_snapshot.path, batch_rows=7)
    assert all(1 <= b.num_rows <= 7 for b in batches)
    for b in batches:
        assert len(set(zip(b.column("topic").to_pylist(), b.column("channel").to_pylist(),
                           strict=True))) == 1
    assert rows(batches) == known_snapshot.rows
    # 40 billing rows in batches of at most 7: 6 of 7 and one of 5.
    billing = [b.num_rows for b in batches if b.column("channel")[0].as_py() == "billing"]
    assert billing == [7, 7, 7, 7, 7, 5]


def test_column_values_in_detail(tmp_path):
    queues = {
        "t": [message(1, b"", timestamp=1_700_000_000_999_999_999)],
        "t:c": [
            message(2, b"abc", timestamp=1_000, attempts=65535, deferred_until=1_700_000_060.5),
            message(3, b"\x00\xff" * 1000, timestamp=1_700_000_000_000_000_001, attempts=0),
        ],
    }
    (batch_t, batch_c) = read_all(build_snapshot(tmp_path, queues))
    t, = batch_t.to_pylist()
    assert t == {
        "topic": "t", "channel": None, "kind": "topic", "state": "queued", "sequence": 0,
        "message_id": "0000000000000001",
        # ns -> us truncates: .999999999 s stays in its second.
        "timestamp": datetime(2023, 11, 14, 22, 13, 20, 999999, tzinfo=UTC),
        "attempts": 0, "deferred_until": None, "in_flight_client": None, "timeout_at": None,
        "body_size": 0, "body": b"",
    }
    c2, c3 = batch_c.to_pylist()
    assert (c2["channel"], c2["kind"], c2["sequence"], c2["message_id"]) == ("c", "channel", 0, "0000000000000002")
    assert c2["timestamp"] == datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC)
    assert c2["attempts"] == 65535
    assert c2["deferred_until"] == datetime(2023, 11, 14, 22, 14, 20, 500000, tzinfo=UTC)
    assert (c2["body_size"], c2["body"]) == (3, b"abc")
    assert c3["timestamp"] == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)
    assert (c3["sequence"], c3["body_size"], c3["body"]) == (1, 2000, b"\x00\xff" * 1000)
    assert c3["deferred_until"] is None
    # The Arrow types, not just the Python values.
    assert batch_c.column("deferred_until").type == pa.timestamp("us", tz="UTC")
    assert batch_c.column("deferred_until").null_count == 1
    assert batch_t.column("channel").null_count == 1


def test_snapshot_ranges_skip_empty_queues_and_follow_key_order(known_snapshot):
    manifest, env = open_snapshot(known_snapshot.path)
    env.close()
    ranges = snapshot_ranges(manifest)
    assert [(r.topic, r.channel, r.first, r.last, r.count) for r in ranges] == [
        ("orders", None, 0, 4, 5),
        ("orders", "billing", 0, 39, 40),
        # orders:ship is empty: no range.
        ("events", None, 0, 6, 7),
        ("events", "audit", 0, 11, 12),
        ("clicks", "web", 0, 29, 30),
        ("clicks", "mobile", 0, 2, 3),
        ("idle", None, 0, 0, 1),
    ]
    assert [r.queue_id for r in ranges] == sorted(r.queue_id for r in ranges)
    only = snapshot_ranges(manifest, QueueFilter(topics=frozenset({"orders"})))
    assert [(r.topic, r.channel) for r in only] == [("orders", None), ("orders", "billing")]


def test_held_rows_carry_their_state_client_and_timeout(tmp_path):
    """A live broker's snapshot: stored rows are queued, held rows say where each message was."""
    queues = {"t:c": messages(3, prefix=b"s")}
    held = {
        "t:c": [
            Held("in_flight", message(10, b"late", attempts=2), timeout_at=1_700_000_090.25, client=1),
            Held("deferred", message(11, b"due2", deferred_until=1_700_000_200.5)),
            Held("queued", message(12, b"mem")),
            Held("in_flight", message(13, b"early", attempts=1), timeout_at=1_700_000_030.5, client=0),
            Held("deferred", message(14, b"due1", attempts=3, deferred_until=1_700_000_100.75)),
        ],
        "t": [Held("queued", message(20, b"at-topic", deferred_until=1_700_000_500.0))],
    }
    clients = ["127.0.0.1:1111", "10.0.0.2:2222"]
    path = build_snapshot(tmp_path, queues, held=held, clients=clients)
    got = [row for batch in read_all(path) for row in batch.to_pylist()]
    assert got == expected_rows(queues, held=held, clients=clients)
    assert [(r["state"], r["body"], r["in_flight_client"]) for r in got] == [
        ("queued", b"s0", None), ("queued", b"s1", None), ("queued", b"s2", None),
        # Held rows: delivery order, then deferred by due time, in flight by timeout.
        ("queued", b"mem", None), ("deferred", b"due1", None), ("deferred", b"due2", None),
        ("in_flight", b"early", "127.0.0.1:1111"), ("in_flight", b"late", "10.0.0.2:2222"),
        ("queued", b"at-topic", None),
    ]
    assert got[6]["timeout_at"] == datetime(2023, 11, 14, 22, 13, 50, 500000, tzinfo=UTC)
    assert {r["sequence"] for r in got[3:]} == {None}
    manifest = read_manifest(path)
    assert (manifest.format_version, manifest.source) == (2, "broker")
    c = manifest.queue("t:c")
    assert (c.count, c.stored, c.held, c.queued, c.in_flight, c.deferred) == (8, 3, 5, 4, 2, 2)
    assert c.stats == {"depth": 4, "in_flight_count": 2, "deferred_count": 2}
    ranges = snapshot_ranges(manifest)
    assert [(r.channel, r.held, r.count) for r in ranges] == [("c", False, 3), ("c", True, 5), (None, True, 1)]


def test_a_version_1_manifest_reads_as_queued(tmp_path):
    path = build_snapshot(tmp_path, {"t:c": messages(2)})
    data = json.loads((path / "manifest.json").read_text())
    for key in ("source", "backend", "durable", "clients", "left_out", "capture_seconds"):
        del data[key]
    for q in data["queues"]:
        for key in ("stored", "held", "queued", "in_flight", "deferred", "stats"):
            del q[key]
    data["format_version"] = 1
    (path / "manifest.json").write_text(json.dumps(data))
    manifest = read_manifest(path)
    q = manifest.queue("t:c")
    assert (q.count, q.stored, q.held, q.queued, q.in_flight, q.deferred, q.stats) == (2, 2, 0, 2, 0, 0, None)
    rows = [row for batch in read_all(path) for row in batch.to_pylist()]
    assert [(r["state"], r["in_flight_client"], r["timeout_at"]) for r in rows] == [("queued", None, None)] * 2


def test_open_snapshot_refuses_a_directory_that_is_not_a_snapshot(tmp_path):
    with pytest.raises(SnapshotError, match=f"{tmp_path}: not an mqd snapshot"):
        open_snapshot(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format_version": 1, "broker_id": null, "node_id": null, '
                                            '"created_at": "x", "data_format": "mqd-queues-1"}')
    with pytest.raises(SnapshotError, match=r"no data\.mdb"):
        open_snapshot(tmp_path)


# -- planning -----------------------------------------------------------------------------


def kr(qid: int, first: int, last: int, count: int | None = None) -> KeyRange:
    return KeyRange(qid, f"t{qid}", None if qid % 2 else f"c{qid}", first, last,
                    last - first + 1 if count is None else count)


def assert_tiles(plan: list[list[KeyRange]], ranges: list[KeyRange]) -> None:
    """The plan's pieces, in order, cover every range's first..last exactly, nothing else."""
    pieces = [p for part in plan for p in part]
    for r in ranges:
        mine = [p for p in pieces if p.queue_id == r.queue_id]
        assert mine, r
        assert all((p.topic, p.channel) == (r.topic, r.channel) for p in mine)
        assert mine[0].first == r.first and mine[-1].last == r.last
        for a, b in zip(mine, mine[1:], strict=False):
            assert b.first == a.last + 1, (a, b)
        assert all(p.first <= p.last for p in mine)
    # Key order is kept: queue by queue, each queue's pieces by sequence.
    assert [(p.queue_id, p.first) for p in pieces] == sorted((p.queue_id, p.first) for p in pieces)
    assert {p.queue_id for p in pieces} == {r.queue_id for r in ranges}


def test_plan_balances_counts():
    ranges = [kr(1, 0, 4), kr(2, 0, 39), kr(3, 0, 6), kr(4, 0, 11), kr(5, 0, 29), kr(6, 0, 2), kr(7, 0, 0)]
    plan = plan_partitions(ranges, 4)
    assert [sum(p.count for p in part) for part in plan] == [25, 25, 25, 23]
    assert_tiles(plan, ranges)
    # Exact counts (no holes): each piece's count is its span.
    assert all(p.count == p.last - p.first + 1 for part in plan for p in part)


def test_plan_packs_several_queues_into_one_partition():
    ranges = [kr(1, 0, 1), kr(2, 5, 7), kr(3, 10, 13)]
    assert plan_partitions(ranges, 1) == [ranges]
    two = plan_partitions(ranges, 2)
    assert [[(p.queue_id, p.first, p.last) for p in part] for part in two] == [
        [(1, 0, 1), (2, 5, 7)], [(3, 10, 13)]]


def test_plan_splits_a_big_queue_by_sequence():
    big = kr(9, 1000, 1999)
    plan = plan_partitions([big], 3)
    assert [[(p.first, p.last, p.count) for p in part] for part in plan] == [
        [(1000, 1333, 334)], [(1334, 1667, 334)], [(1668, 1999, 332)]]
    assert_tiles(plan, [big])


def test_plan_split_with_holes_still_tiles():
    # 50 records spread over sequence numbers 0..199 (FINs left holes).
    sparse = kr(1, 0, 199, count=50)
    plan = plan_partitions([kr(0, 0, 9), sparse, kr(2, 300, 309)], 4)
    assert len(plan) == 4
    assert [sum(p.count for p in part) for part in plan] == [18, 18, 18, 16]
    assert_tiles(plan, [kr(0, 0, 9), sparse, kr(2, 300, 309)])


def test_plan_never_has_more_partitions_than_rows():
    ranges = [kr(1, 0, 0), kr(2, 7, 8)]
    plan = plan_partitions(ranges, 8)
    assert [[(p.queue_id, p.first, p.last) for p in part] for part in plan] == [
        [(1, 0, 0)], [(2, 7, 7)], [(2, 8, 8)]]
    assert plan_partitions([kr(1, 5, 5)], 64) == [[kr(1, 5, 5)]]


def test_plan_of_nothing():
    assert plan_partitions([], 4) == []
    assert plan_partitions([kr(1, 0, 0, count=0)], 4) == []
    # Fewer than one partition asked: one.
    assert plan_partitions([kr(1, 0, 9)], 0) == [[kr(1, 0, 9)]]


@settings(max_examples=300, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 100)), min_size=1, max_size=8),
    partitions=st.integers(1, 16),
)
def test_plan_properties(spans, partitions):
    # (span, percent kept): counts below the span are holes.
    ranges, first = [], 0
    for qid, (span, kept) in enumerate(spans, start=1):
        count = max(1, span * kept // 100)
        ranges.append(kr(qid, first, first + span - 1, count))
        first += span + 3
    total = sum(r.count for r in ranges)
    plan = plan_partitions(ranges, partitions)
    assert 1 <= len(plan) <= min(partitions, total)
    assert all(part for part in plan)
    assert sum(p.count for part in plan for p in part) == total
    assert_tiles(plan, ranges)


# -- queue filters ------------------------------------------------------------------------


def qi(name: str) -> QueueInfo:
    topic, _, channel = name.partition(":")
    return QueueInfo(name, topic, channel or None, 1, 1, 0, 0)


def test_queue_filter_admits():
    everything = QueueFilter()
    assert all(everything.admits(qi(n)) for n in ("a", "a:x", "b:y"))
    f = QueueFilter(topics=frozenset({"a"}))
    assert [f.admits(qi(n)) for n in ("a", "a:x", "b", "b:x")] == [True, True, False, False]
    f = QueueFilter(channels=frozenset({"x", None}))
    assert [f.admits(qi(n)) for n in ("a", "a:x", "a:y")] == [True, True, False]
    f = QueueFilter(kinds=frozenset({"channel"}))
    assert [f.admits(qi(n)) for n in ("a", "a:x")] == [False, True]
    f = QueueFilter(topics=frozenset({"a"}), channels=frozenset({"x"}), kinds=frozenset({"channel"}))
    assert [f.admits(qi(n)) for n in ("a", "a:x", "a:y", "b:x")] == [False, True, False, False]


def test_queue_filter_narrowed_intersects():
    f = QueueFilter().narrowed("topic", ["a", "b"])
    assert f == QueueFilter(topics=frozenset({"a", "b"}))
    g = f.narrowed("topic", ["b", "c"]).narrowed("channel", ["x", None])
    assert g == QueueFilter(topics=frozenset({"b"}), channels=frozenset({"x", None}))
    assert f.topics == frozenset({"a", "b"})  # the original is unchanged
    empty = g.narrowed("kind", ["topic"]).narrowed("kind", ["channel"])
    assert empty.kinds == frozenset()
    assert not any(empty.admits(qi(n)) for n in ("b", "b:x"))
    with pytest.raises(KeyError):
        f.narrowed("body", ["x"])


# -- reading a plan -------------------------------------------------------------------------


def test_reading_every_partition_of_a_plan_gives_every_record_once(tmp_path):
    queues = {
        "a": messages(3, prefix=b"a"),
        "big:c": messages(300, start=1000, prefix=b"big"),
        "big": messages(40, start=2000, prefix=b"top"),
        "b:gone": messages(5, start=3000),
        "z:z": messages(17, start=4000),
    }
    holes = {
        # Records removed at the start, middle and end, and a whole queue emptied.
        "big:c": [0, 1, *range(50, 180), 250, 298, 299],
        "big": list(range(0, 40, 2)),
        "b:gone": list(range(5)),
        "z:z": [16],
    }
    path = build_snapshot(tmp_path, queues, holes=holes)
    want = expected_rows(queues, holes)
    manifest, env = open_snapshot(path)
    try:
        info = manifest.queue("big:c")
        assert (info.count, info.first_seq, info.last_seq) == (300 - 135, 2, 297)
        assert manifest.queue("b:gone").count == 0
        for n in (1, 2, 3, 5, 8, 64):
            plan = plan_partitions(snapshot_ranges(manifest), n)
            got = [row for part in plan for row in rows(list(read_ranges(env, part)))]
            assert got == want, n
        # A range entirely in a hole reads nothing, and stops at its queue's end.
        qid = manifest.queue("big:c").queue_id
        assert list(read_ranges(env, [KeyRange(qid, "big", "c", 60, 170, 111)])) == []
        assert list(read_ranges(env, [KeyRange(qid, "big", "c", 298, 400, 1)])) == []
    finally:
        env.close()


def test_batches_are_cut_by_bytes_as_well_as_rows(tmp_path, monkeypatch):
    # Records of ~1 KB with BATCH_BYTES at 10 KB: no batch holds more than
    # 10 KB of records, except a single record larger than that, alone.
    monkeypatch.setattr(records, "BATCH_BYTES", 10_000)
    queues = {"big": [message(n, b"x" * 1000) for n in range(60)]
              + [message(60, b"y" * 25_000)] + [message(n, b"z" * 10) for n in range(61, 70)]}
    batches = read_all(build_snapshot(tmp_path, queues))
    assert rows(batches) == expected_rows(queues)
    for b in batches:
        stored = sum(size + records.RECORD.size for size in b.column("body_size").to_pylist())
        assert stored <= 10_000 or b.num_rows == 1
    assert any(b.num_rows == 1 and b.column("body_size")[0].as_py() == 25_000 for b in batches)
