"""The `mqd` Spark data source on a snapshot with known content, in a real local Spark session."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from spark_bridge.datasource import PUSHDOWN_CONF, register
from spark_bridge.records import SPARK_SCHEMA_DDL
from tests.support.known_snapshots import Held, build_snapshot, expected_rows, messages


def load(spark, path, partitions: int | None = None):
    reader = spark.read.format("mqd")
    if partitions is not None:
        reader = reader.option("partitions", str(partitions))
    return reader.load(str(path))


def key(row: dict) -> tuple:
    # Held rows of a live snapshot may have no store sequence: their id orders them.
    seq = row["sequence"]
    return row["topic"], row["channel"] or "", seq is None, seq or 0, row["message_id"]


def arrow_rows(df) -> list[dict]:
    """The DataFrame's rows as Arrow's Python values, sorted by queue and sequence."""
    return sorted(df.toArrow().to_pylist(), key=key)


@contextmanager
def pushdown_disabled(spark):
    """The session with Python filter pushdown off, then back on; `mqd` re-registered each time."""
    before = spark.conf.get(PUSHDOWN_CONF)
    spark.conf.set(PUSHDOWN_CONF, "false")
    register(spark)
    try:
        yield
    finally:
        spark.conf.set(PUSHDOWN_CONF, before)
        register(spark)


def test_all_rows_with_exactly_the_schema(spark, known_snapshot):
    df = load(spark, known_snapshot.path, partitions=3)
    assert df.schema == StructType.fromDDL(SPARK_SCHEMA_DDL)
    assert [(f.name, f.dataType.simpleString(), f.nullable) for f in df.schema] == [
        ("topic", "string", True), ("channel", "string", True), ("kind", "string", True),
        ("state", "string", True), ("sequence", "bigint", True), ("message_id", "string", True),
        ("timestamp", "timestamp", True), ("attempts", "int", True),
        ("deferred_until", "timestamp", True), ("in_flight_client", "string", True),
        ("timeout_at", "timestamp", True), ("body_size", "int", True),
        ("body", "binary", True)]
    assert arrow_rows(df) == sorted(known_snapshot.rows, key=key)


def test_values_through_spark_sql(spark, known_snapshot):
    """The same values seen by Spark's own expressions (microseconds, nulls, sizes)."""
    df = load(spark, known_snapshot.path)
    got = {(r.topic, r.channel, r.sequence): r for r in df.select(
        "topic", "channel", "sequence", "message_id", "attempts", "body_size",
        F.unix_micros("timestamp").alias("ts"), F.unix_micros("deferred_until").alias("deferred"),
        F.length("body").alias("length")).collect()}
    assert len(got) == len(known_snapshot.rows)
    for name, msgs in known_snapshot.queues.items():
        topic, _, channel = name.partition(":")
        for seq, m in enumerate(msgs):
            r = got[(topic, channel or None, seq)]
            assert r.message_id == m.id.decode()
            assert r.ts == m.timestamp // 1000
            assert r.deferred == (round(m.deferred_until * 1e6) if m.deferred_until else None)
            assert (r.attempts, r.body_size, r.length) == (m.attempts, len(m.body), len(m.body))


def test_partitions_option(spark, known_snapshot):
    for n in (1, 2, 5, 8):
        assert load(spark, known_snapshot.path, partitions=n).rdd.getNumPartitions() == n
    # Never more partitions than rows (98 here).
    assert load(spark, known_snapshot.path, partitions=500).rdd.getNumPartitions() == 98


def test_partitions_hold_contiguous_key_ranges_of_balanced_size(spark, known_snapshot):
    df = load(spark, known_snapshot.path, partitions=4)
    got = df.select(F.spark_partition_id().alias("pid"), "topic", "channel", "sequence").collect()
    pid_of = {(r.topic, r.channel, r.sequence): r.pid for r in got}
    assert len(pid_of) == len(got) == 98
    # Along the snapshot's key order the partition id never goes down: each
    # partition is one contiguous stretch of keys, and they come in order.
    along = [pid_of[(r["topic"], r["channel"], r["sequence"])] for r in known_snapshot.rows]
    assert along == sorted(along)
    assert sorted(Counter(along).items()) == [(0, 25), (1, 25), (2, 25), (3, 23)]


def test_an_empty_snapshot_reads_as_no_rows(spark, tmp_path):
    path = build_snapshot(tmp_path, {"t": [], "t:c": []})
    df = load(spark, path, partitions=4)
    assert df.count() == 0
    assert df.rdd.getNumPartitions() == 1


# name: (the filter, the same test on an expected row, rows of the queues it admits
# when its queue tests are pushed down: 98 when nothing can be pushed).
FILTERS = {
    "topic ==": (lambda: F.col("topic") == "orders", lambda r: r["topic"] == "orders", 45),
    "channel isin": (lambda: F.col("channel").isin("web", "audit"),
                     lambda r: r["channel"] in ("web", "audit"), 42),
    "channel isNull": (lambda: F.col("channel").isNull(), lambda r: r["channel"] is None, 13),
    "channel isNotNull": (lambda: F.col("channel").isNotNull(), lambda r: r["channel"] is not None, 85),
    "kind ==": (lambda: F.col("kind") == "topic", lambda r: r["kind"] == "topic", 13),
    "channel <=>": (lambda: F.col("channel").eqNullSafe("mobile"), lambda r: r["channel"] == "mobile", 3),
    "topic and channel": (lambda: (F.col("topic") == "clicks") & (F.col("channel") == "web"),
                          lambda r: (r["topic"], r["channel"]) == ("clicks", "web"), 30),
    "with a filter on attempts": (
        lambda: (F.col("topic") == "orders") & (F.col("attempts") > 2),
        lambda r: r["topic"] == "orders" and r["attempts"] > 2, 45),
    "or (not pushable)": (lambda: (F.col("topic") == "idle") | (F.col("attempts") > 5),
                          lambda r: r["topic"] == "idle" or r["attempts"] > 5, 98),
}


@pytest.mark.parametrize("name", FILTERS)
def test_filters_give_the_right_rows(spark, known_snapshot, name):
    column, predicate, admitted = FILTERS[name]
    want = sorted((r for r in known_snapshot.rows if predicate(r)), key=key)
    assert want  # every filter here selects something
    assert arrow_rows(load(spark, known_snapshot.path, partitions=4).where(column())) == want
    # Evidence of the pushdown: only the admitted queues' rows are planned,
    # one per partition when more partitions are asked than there are rows.
    planned = load(spark, known_snapshot.path, partitions=200).where(column()).rdd.getNumPartitions()
    assert planned == admitted


def test_pushdown_plans_only_the_admitted_queues(spark, known_snapshot):
    """clicks:mobile holds 3 rows: pushed down, 8 partitions asked plan 3; without pushdown, 8."""
    def query():
        return (load(spark, known_snapshot.path, partitions=8)
                .where((F.col("topic") == "clicks") & (F.col("channel") == "mobile")))

    pushed = query()
    assert pushed.rdd.getNumPartitions() == 3
    assert sorted(r.body for r in pushed.select("body").collect()) == [b"tap-500", b"tap-501", b"tap-502"]
    # A channel test alone prunes the topic queues too.
    assert load(spark, known_snapshot.path, partitions=64).where(
        F.col("channel").isNull()).rdd.getNumPartitions() == 13
    with pushdown_disabled(spark):
        plain = query()
        assert plain.rdd.getNumPartitions() == 8
        assert sorted(r.body for r in plain.select("body").collect()) == [b"tap-500", b"tap-501", b"tap-502"]
    assert query().rdd.getNumPartitions() == 3


def test_queries_work_with_pushdown_disabled_at_runtime(spark, known_snapshot):
    """No DATA_SOURCE_PUSHDOWN_DISABLED: register() picks the reader without pushFilters."""
    with pushdown_disabled(spark):
        assert spark.conf.get(PUSHDOWN_CONF) == "false"
        df = load(spark, known_snapshot.path, partitions=2)
        assert df.count() == 98
        got = arrow_rows(df.where((F.col("channel").isin("billing", "web")) & (F.col("attempts") > 1)))
        assert got == sorted((r for r in known_snapshot.rows
                              if r["channel"] in ("billing", "web") and r["attempts"] > 1), key=key)
        assert len(got) == 8
    assert spark.conf.get(PUSHDOWN_CONF) == "true"
    assert load(spark, known_snapshot.path).where(F.col("topic") == "idle").count() == 1


def test_a_directory_that_is_not_a_snapshot_is_a_clear_error(spark, tmp_path):
    (tmp_path / "data.mdb").write_bytes(b"")
    with pytest.raises(Exception) as failure:
        load(spark, tmp_path).collect()
    text = str(failure.value)
    assert f"{tmp_path} is not an mqd snapshot (no manifest.json)" in text
    with pytest.raises(Exception, match="no snapshot given"):
        spark.read.format("mqd").load().collect()


def test_a_snapshot_with_holes_reads_every_record_once(spark, tmp_path):
    queues = {"t:c": messages(200), "t": messages(10, start=500)}
    holes = {"t:c": [0, *range(20, 150), 199], "t": [3]}
    path = build_snapshot(tmp_path, queues, holes=holes)
    def order(pair):
        return pair[0] or "", pair[1]

    want = sorted(((r["channel"], r["sequence"]) for r in expected_rows(queues, holes)), key=order)
    for n in (1, 3, 7):
        df = load(spark, path, partitions=n)
        got = [(r.channel, r.sequence) for r in df.select("channel", "sequence").collect()]
        assert sorted(got, key=order) == want


def test_held_rows_read_through_spark_with_their_states(spark, tmp_path):
    """A live broker's snapshot: stored and held rows, every state, in any partitioning."""
    queues = {"t:c": messages(50)}
    held = {"t:c": [Held("queued", m) for m in messages(20, start=100)]
                   + [Held("in_flight", m, timeout_at=1_700_000_100.0 + m.timestamp % 7, client=0)
                      for m in messages(5, start=200)]
                   + [Held("deferred", m) for m in messages(3, start=300, deferred_until=1_700_000_500.0)]}
    path = build_snapshot(tmp_path, queues, held=held, clients=["127.0.0.1:5555"])
    want = sorted(expected_rows(queues, held=held, clients=["127.0.0.1:5555"]), key=key)
    for n in (1, 4):
        df = load(spark, path, partitions=n)
        assert arrow_rows(df) == want
    counts = {r.state: r["count"] for r in load(spark, path).groupBy("state").count().collect()}
    assert counts == {"queued": 70, "in_flight": 5, "deferred": 3}
    holders = load(spark, path).filter(F.col("state") == "in_flight").select("in_flight_client").distinct()
    assert [r.in_flight_client for r in holders.collect()] == ["127.0.0.1:5555"]
