"""What sits in a snapshot, per topic and channel, as Spark DataFrames.

Every function takes DataFrames (or a SparkSession) and returns a
DataFrame, so users can run the same questions in their own jobs, filter
them further or join them with other data. `analyze` runs them all for
the command line and the report, reading the snapshot once: the rows
without their bodies (plus the one JSON field asked for) are cached, so
each question is a job over memory, not another Python-fed scan.

Ages are measured from the snapshot's own time (its manifest), so an
analysis of an old snapshot gives the same numbers today as then.

Percentiles are Spark's `percentile_approx` (nearest rank, rank error
below 1/10,000): exact for the sizes a test uses, and they scale on a
cluster where exact percentiles would gather every value of a queue.

Each row has a `state`: where the broker held the message at that instant
(STATES). A consumer that stopped reading without closing shows as a
large in-flight share of its channel with old ages (`queue_summary`,
`state_counts`); `deferred` counts the state, `scheduled` every message
with a due time (a DPUB still at its topic is queued, yet scheduled).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from mqd.nsqd.snapshot_format import STATES, Manifest, read_manifest
from spark_bridge.datasource import FORMAT_NAME, register
from spark_bridge.records import SPARK_SCHEMA_DDL

__all__ = [
    "AGE_BUCKETS",
    "Analysis",
    "DEFAULT_POISON_ATTEMPTS",
    "DUE_BUCKETS",
    "PERCENTILES",
    "SIZE_BUCKETS",
    "STATES",
    "age_histogram",
    "analyze",
    "attempts_histogram",
    "bucket_counts",
    "deferred_backlog",
    "json_field",
    "json_field_counts",
    "poison_messages",
    "queue_summary",
    "read_snapshot",
    "size_histogram",
    "snapshot_time",
    "state_counts",
    "with_age",
]

QUEUE = ["topic", "channel", "kind"]
PERCENTILES = (0.5, 0.9, 0.99)
# pynsq's max_tries and go-nsq's MaxAttempts default to 5: a message tried
# more often than that is one the consumers give up on.
DEFAULT_POISON_ATTEMPTS = 5
POISON_ROWS = 1000

# (label, upper bound exclusive); the last bucket is open-ended.
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("< 1 s", 1), ("1-10 s", 10), ("10-60 s", 60), ("1-10 min", 600), ("10-60 min", 3600),
    ("1-24 h", 86400), ("1-7 d", 7 * 86400), ("> 7 d", float("inf")),
)
SIZE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("< 100 B", 100), ("100 B-1 KB", 1000), ("1-10 KB", 10_000), ("10-100 KB", 100_000),
    ("100 KB-1 MB", 1_000_000), ("> 1 MB", float("inf")),
)
# Due in (seconds from the snapshot's time); "overdue" is due already.
DUE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("overdue", 0), ("< 1 min", 60), ("1-10 min", 600), ("10-60 min", 3600),
    ("1-24 h", 86400), ("> 24 h", float("inf")),
)


def read_snapshot(spark: SparkSession, path: str, partitions: int | None = None,
                  bodies: bool = True) -> DataFrame:
    """The snapshot's messages, one row per message (schema: records.ARROW_SCHEMA).

    Partitions default to the session's default parallelism: about one
    Python task per core, the cheapest split (each task costs ~45 ms).
    `bodies=False`: the body column is null, for jobs that do not read it.
    """
    register(spark)
    n = partitions or spark.sparkContext.defaultParallelism
    # The schema given here spares Spark a round trip to a Python worker to
    # ask the data source for it.
    return (spark.read.format(FORMAT_NAME).schema(SPARK_SCHEMA_DDL).option("partitions", n)
            .option("bodies", str(bodies).lower()).load(str(path)))


def snapshot_time(path: str) -> datetime:
    """When the snapshot was taken, from its manifest: the 'now' of every age."""
    return _manifest_time(read_manifest(path))


def _manifest_time(manifest: Manifest) -> datetime:
    return datetime.fromisoformat(manifest.created_at.replace("Z", "+00:00")).astimezone(UTC)


def _seconds_between(later: Column, earlier: Column) -> Column:
    return (F.unix_micros(later) - F.unix_micros(earlier)) / F.lit(1e6)


def with_age(df: DataFrame, as_of: datetime) -> DataFrame:
    """`df` plus `age_s`: seconds from publication to `as_of`."""
    return df.withColumn("age_s", _seconds_between(F.lit(as_of), F.col("timestamp")))


def _sorted(df: DataFrame, *order: str | Column) -> DataFrame:
    """`df` in one sorted partition, for results of a few rows per queue.

    `orderBy` would range-partition, which samples its input in a job of
    its own first: over a Python data source one more scan of the
    snapshot. `repartition(1)` (not coalesce, which would pull the scan
    itself into one task) moves the few rows to one sorted partition.
    """
    return df.repartition(1).sortWithinPartitions(*order)


def _bucket(value: Column, buckets: Sequence[tuple[str, float]]) -> Column:
    """The index of the first bucket whose bound `value` is below (the last one otherwise)."""
    expr = F.lit(len(buckets) - 1)
    for i in range(len(buckets) - 2, -1, -1):
        expr = F.when(value < F.lit(buckets[i][1]), F.lit(i)).otherwise(expr)
    return expr


def _labelled(df: DataFrame, index: str, buckets: Sequence[tuple[str, float]]) -> DataFrame:
    labels = F.array(*[F.lit(label) for label, _ in buckets])
    return df.withColumn("bucket", F.element_at(labels, F.col(index) + 1))


def _queue_order_columns() -> list[Column]:
    return [F.col("topic"), F.col("channel").asc_nulls_first()]


def _state_order() -> Column:
    """STATES' order as a sortable column (array_position is 1-based; unknown states last)."""
    return F.array_position(F.array(*[F.lit(s) for s in STATES]), F.col("state"))


def queue_summary(df: DataFrame, as_of: datetime, poison_attempts: int = DEFAULT_POISON_ATTEMPTS,
                  ) -> DataFrame:
    """One row per queue: backlog, rows per state, bytes, ages, sizes, scheduled, poison.

    `scheduled` counts rows with deferred_until set, whatever their state.
    `in_flight_share` and `oldest_in_flight_age_s` (null: nothing in
    flight) are what tell a stuck consumer from a slow one: a slow one
    keeps few messages in flight, briefly.
    """
    aged = with_age(df, as_of)
    state = F.col("state")
    pct = F.array(*[F.lit(p) for p in PERCENTILES])
    out = aged.groupBy(*QUEUE).agg(
        F.count(F.lit(1)).alias("messages"),
        F.sum("body_size").alias("bytes"),
        F.min("timestamp").alias("oldest"),
        F.max("timestamp").alias("newest"),
        F.max("age_s").alias("oldest_age_s"),
        F.percentile_approx("age_s", pct, 10000).alias("age_pct_s"),
        F.percentile_approx("body_size", pct, 10000).alias("size_pct"),
        F.max("body_size").alias("size_max"),
        F.max("attempts").alias("max_attempts"),
        *[F.count_if(state == s).alias(s) for s in STATES],
        F.count("deferred_until").alias("scheduled"),
        F.max(F.when(state == "in_flight", F.col("age_s"))).alias("oldest_in_flight_age_s"),
        F.count_if(F.col("attempts") > poison_attempts).alias("poison"),
    )
    out = out.withColumn("in_flight_share", F.col("in_flight") / F.col("messages"))
    for i, p in enumerate(PERCENTILES):
        tag = f"p{round(p * 100)}"
        out = out.withColumn(f"age_{tag}_s", F.col("age_pct_s")[i])
        out = out.withColumn(f"size_{tag}", F.col("size_pct")[i])
    return _sorted(out.drop("age_pct_s", "size_pct"), *_queue_order_columns())


def state_counts(df: DataFrame, as_of: datetime) -> DataFrame:
    """Per queue and state (rows only for states present): messages, bytes, oldest, its age."""
    return (with_age(df, as_of).groupBy(*QUEUE, "state")
            .agg(F.count(F.lit(1)).alias("messages"), F.sum("body_size").alias("bytes"),
                 F.min("timestamp").alias("oldest"), F.max("age_s").alias("oldest_age_s"))
            .transform(_sorted, *_queue_order_columns(), _state_order()))


def bucket_counts(df: DataFrame, as_of: datetime) -> DataFrame:
    """Messages per queue, state, attempts, age, size and due bucket (-1: not deferred).

    Every histogram of the report, and the per-state table, is a roll-up
    of this one small table (bytes and the oldest publication carried
    along), so the whole set costs one pass over the messages.
    """
    aged = with_age(df, as_of)
    due_in = _seconds_between(F.col("deferred_until"), F.lit(as_of))
    return (aged.select(
                *QUEUE, "state", "attempts", "deferred_until", "body_size", "timestamp",
                _bucket(F.col("age_s"), AGE_BUCKETS).alias("age_bucket"),
                _bucket(F.col("body_size"), SIZE_BUCKETS).alias("size_bucket"),
                F.when(F.col("deferred_until").isNull(), F.lit(-1))
                 .otherwise(_bucket(due_in, DUE_BUCKETS)).alias("due_bucket"))
            .groupBy(*QUEUE, "state", "attempts", "age_bucket", "size_bucket", "due_bucket")
            .agg(F.count(F.lit(1)).alias("messages"), F.min("deferred_until").alias("next_due"),
                 F.sum("body_size").alias("bytes"), F.min("timestamp").alias("oldest")))


def _rollup(counts: DataFrame, column: str, buckets: Sequence[tuple[str, float]] | None = None,
            ) -> DataFrame:
    """bucket_counts summed per queue and `column` (labelled with `buckets` if given)."""
    out = counts.groupBy(*QUEUE, column).agg(F.sum("messages").cast("long").alias("messages"),
                                             F.min("next_due").alias("next_due"))
    if buckets is not None:
        out = (_labelled(out.filter(F.col(column) >= 0), column, buckets)
               .withColumnRenamed(column, "bucket_index"))
        column = "bucket_index"
    return _sorted(out, "topic", F.col("channel").asc_nulls_first(), column)


def age_histogram(df: DataFrame, as_of: datetime) -> DataFrame:
    """Per queue, messages in each AGE_BUCKETS age bucket (rows only for non-empty buckets)."""
    return _rollup(bucket_counts(df, as_of), "age_bucket", AGE_BUCKETS).drop("next_due")


def size_histogram(df: DataFrame) -> DataFrame:
    """Per queue, messages in each SIZE_BUCKETS body size bucket."""
    return _rollup(bucket_counts(df, datetime.now(UTC)), "size_bucket", SIZE_BUCKETS).drop("next_due")


def attempts_histogram(df: DataFrame) -> DataFrame:
    """Per queue and attempts count, how many messages (0 = never delivered)."""
    return _rollup(bucket_counts(df, datetime.now(UTC)), "attempts").drop("next_due")


def deferred_backlog(df: DataFrame, as_of: datetime) -> DataFrame:
    """Per queue and DUE_BUCKETS bucket: deferred messages (DPUB, REQ with delay) and the next due."""
    return _rollup(bucket_counts(df, as_of), "due_bucket", DUE_BUCKETS)


def poison_messages(df: DataFrame, threshold: int = DEFAULT_POISON_ATTEMPTS) -> DataFrame:
    """Messages tried more than `threshold` times, most-tried first, with their ids."""
    return (df.filter(F.col("attempts") > threshold)
            .select(*QUEUE, "message_id", "attempts", "timestamp", "deferred_until", "body_size",
                    "sequence")
            .transform(_sorted, F.desc("attempts"), "topic", "channel", "sequence"))


def json_field(name: str) -> Column:
    """The field `name` of a JSON body as a string (null: not JSON, or no such field).

    Spark 4's variant functions parse about twice as fast as
    get_json_object here; try_ variants keep a non-JSON body from failing
    the job.
    """
    path = "$['" + name.replace("\\", "\\\\").replace("'", "\\'") + "']"
    return F.try_variant_get(F.try_parse_json(F.col("body").cast("string")), path, "string")


def json_field_counts(df: DataFrame, name: str) -> DataFrame:
    """Per queue and value of the JSON field `name` in the bodies: messages, bytes, oldest."""
    with_value = df if "json_value" in df.columns else df.withColumn("json_value", json_field(name))
    return (with_value.groupBy(*QUEUE, "json_value")
            .agg(F.count(F.lit(1)).alias("messages"), F.sum("body_size").alias("bytes"),
                 F.min("timestamp").alias("oldest"))
            .transform(_sorted, "topic", F.col("channel").asc_nulls_first(), F.desc("messages"),
                     "json_value"))


@dataclass
class Analysis:
    """The answers of `analyze`, collected to the driver (a few rows per queue)."""

    path: str
    manifest: Manifest
    as_of: datetime
    poison_attempts: int
    queues: list[dict[str, Any]]
    age_histogram: list[dict[str, Any]]
    size_histogram: list[dict[str, Any]]
    attempts_histogram: list[dict[str, Any]]
    poison: list[dict[str, Any]]
    deferred: list[dict[str, Any]]
    json_field: str | None = None
    json_counts: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    # state_counts' rows (rolled up from the bucket counts).
    states: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(q["messages"] for q in self.queues)

    def state_total(self, state: str) -> int:
        """Messages in `state` over every queue."""
        return sum(q[state] for q in self.queues)

    @property
    def left_out(self) -> list[dict[str, Any]]:
        """The queues the snapshot did not take (ephemeral ones), as its manifest lists them."""
        return list(self.manifest.left_out)

    @property
    def poison_total(self) -> int:
        return sum(q["poison"] for q in self.queues)


Progress = Callable[[int, int, str, float | None], None]


def analyze(spark: SparkSession, path: str, *, poison_attempts: int = DEFAULT_POISON_ATTEMPTS,
            json_field_name: str | None = None, partitions: int | None = None,
            progress: Progress | None = None) -> Analysis:
    """Every question of the report, over one scan of the snapshot.

    `progress(step, steps, label, seconds)` is called as each step is
    submitted (seconds None; they are all submitted at once, see
    _run_concurrently) and as it finishes (seconds taken).
    """
    path = str(path)
    manifest = read_manifest(path)
    as_of = _manifest_time(manifest)
    rows = read_snapshot(spark, path, partitions, bodies=json_field_name is not None)
    if json_field_name is not None:
        rows = rows.withColumn("json_value", json_field(json_field_name))
    base = rows.drop("body").persist(StorageLevel.MEMORY_AND_DISK)
    # No job of its own fills the cache: the questions' jobs fill it as they
    # read (each takes every partition whole), which saves a job, about a
    # second on local[2]. The poison listing, the cheapest, carries the
    # reading's name in the progress lines.
    steps: list[tuple[str, Callable[[], Any]]] = [
        (f"reading {manifest.total:,} messages, poison messages (attempts > {poison_attempts})",
         lambda: poison_messages(base, poison_attempts).limit(POISON_ROWS)),
        ("backlog, ages and sizes per queue", lambda: queue_summary(base, as_of, poison_attempts)),
        ("ages, sizes, attempts and due times", lambda: bucket_counts(base, as_of)),
    ]
    if json_field_name is not None:
        steps.append((f"JSON field {json_field_name!r}",
                      lambda: json_field_counts(base, json_field_name)))
    try:
        results, seconds = _run_concurrently(spark, steps, progress)
    finally:
        base.unpersist()
    poison, queues, counts, *json_counts = results
    # The histograms are roll-ups of the few collected bucket counts, done
    # here: four more Spark jobs for them cost several seconds on
    # local[2]; tests/spark check they equal the DataFrame functions'.
    ages = _rollup_rows(counts, "age_bucket", AGE_BUCKETS, keep_due=False)
    sizes = _rollup_rows(counts, "size_bucket", SIZE_BUCKETS, keep_due=False)
    attempts = _rollup_rows(counts, "attempts", None, keep_due=False)
    deferred = _rollup_rows(counts, "due_bucket", DUE_BUCKETS, keep_due=True)
    return Analysis(
        path=path, manifest=manifest, as_of=as_of, poison_attempts=poison_attempts,
        queues=_with_empty_queues(queues, manifest), age_histogram=ages, size_histogram=sizes,
        attempts_histogram=attempts, poison=poison, deferred=deferred,
        json_field=json_field_name, json_counts=json_counts[0] if json_counts else [],
        seconds=seconds, states=_state_rows(counts, as_of),
    )


def _run_concurrently(spark: SparkSession, steps: Sequence[tuple[str, Callable[[], Any]]],
                      progress: Progress | None) -> tuple[list[Any], dict[str, float]]:
    """Each step's result (DataFrames collected) and seconds, all submitted to Spark at once.

    While the first job waits for Python workers to start and read, the
    driver plans and compiles the other queries: ~1.3 s less of ~23 s on
    local[2]. The jobs share the cache: a task that needs a partition
    another job is filling waits for it rather than reading the snapshot
    again. Progress is reported from this thread, finishes as they come.
    """
    sc = spark.sparkContext
    # Tagged, so a failure cancels these jobs and not others of the session.
    tag = f"mqd-analyze-{uuid.uuid4().hex}"

    def run(step: Callable[[], Any]) -> tuple[Any, float]:
        started = time.perf_counter()
        sc.addJobTag(tag)  # per thread
        try:
            result = step()
            if isinstance(result, DataFrame):
                result = _collect(result)
        finally:
            sc.removeJobTag(tag)
        return result, time.perf_counter() - started

    results: list[Any] = [None] * len(steps)
    seconds: dict[str, float] = {}
    with ThreadPoolExecutor(len(steps), thread_name_prefix="analyze") as pool:
        pending = {}
        for i, (label, step) in enumerate(steps):
            if progress:
                progress(i + 1, len(steps), label, None)
            pending[pool.submit(run, step)] = i
        try:
            for done in as_completed(pending):
                i = pending[done]
                label = steps[i][0]
                results[i], seconds[label] = done.result()
                if progress:
                    progress(i + 1, len(steps), label, seconds[label])
        except BaseException:
            sc.cancelJobsWithTag(tag)  # the others fail fast instead of running on
            raise
    return results, {label: seconds[label] for label, _ in steps}


def _rollup_rows(counts: list[dict[str, Any]], column: str,
                 buckets: Sequence[tuple[str, float]] | None, keep_due: bool) -> list[dict[str, Any]]:
    """`_rollup(...)` of collected bucket_counts rows, with the same rows in the same order."""
    sums: dict[tuple, list[Any]] = {}
    for r in counts:
        value = r[column]
        if buckets is not None and value < 0:
            continue
        entry = sums.setdefault((r["topic"], r["channel"], r["kind"], value), [0, None])
        entry[0] += r["messages"]
        due = r["next_due"]
        if due is not None and (entry[1] is None or due < entry[1]):
            entry[1] = due
    out = []
    for (topic, channel, kind, value), (messages, next_due) in sorted(
            sums.items(), key=lambda item: (*_queue_order(item[0][0], item[0][1]), item[0][3])):
        row: dict[str, Any] = {"topic": topic, "channel": channel, "kind": kind}
        row["bucket_index" if buckets is not None else column] = value
        row["messages"] = messages
        if keep_due:
            row["next_due"] = next_due
        if buckets is not None:
            row["bucket"] = buckets[value][0]
        out.append(row)
    return out


def _state_rows(counts: list[dict[str, Any]], as_of: datetime) -> list[dict[str, Any]]:
    """`state_counts(...)` of collected bucket_counts rows: the same rows, in the same order."""
    sums: dict[tuple, list[Any]] = {}
    for r in counts:
        entry = sums.setdefault((r["topic"], r["channel"], r["kind"], r["state"]), [0, 0, None])
        entry[0] += r["messages"]
        entry[1] += r["bytes"]
        if entry[2] is None or r["oldest"] < entry[2]:
            entry[2] = r["oldest"]
    order = {s: i for i, s in enumerate(STATES)}
    out = []
    for (topic, channel, kind, state), (messages, size, oldest) in sorted(
            sums.items(), key=lambda item: (*_queue_order(item[0][0], item[0][1]),
                                            order.get(item[0][3], len(STATES)))):
        # Spark's age, to the same float: whole microseconds, then / 1e6.
        age = (as_of - oldest) // timedelta(microseconds=1) / 1e6
        out.append({"topic": topic, "channel": channel, "kind": kind, "state": state,
                    "messages": messages, "bytes": size, "oldest": oldest, "oldest_age_s": age})
    return out


def _collect(df: DataFrame) -> list[dict[str, Any]]:
    """The rows as dicts, timestamps made UTC-aware (pyspark hands back naive local times)."""
    rows = [r.asDict() for r in df.collect()]
    for row in rows:
        for key, value in row.items():
            if isinstance(value, datetime) and value.tzinfo is None:
                row[key] = value.astimezone(UTC)
    return rows


def _with_empty_queues(rows: list[dict[str, Any]], manifest: Manifest) -> list[dict[str, Any]]:
    """The summary rows plus a zero row for each queue the manifest lists empty."""
    seen = {(r["topic"], r["channel"]) for r in rows}
    out = list(rows)
    for q in manifest.queues:
        if (q.topic, q.channel) not in seen:
            out.append({"topic": q.topic, "channel": q.channel,
                        "kind": q.kind,
                        "messages": 0, "bytes": 0, "oldest": None, "newest": None,
                        "oldest_age_s": None, "size_max": None, "max_attempts": None,
                        **dict.fromkeys(STATES, 0), "scheduled": 0,
                        "oldest_in_flight_age_s": None, "in_flight_share": None, "poison": 0,
                        **{f"age_p{round(p * 100)}_s": None for p in PERCENTILES},
                        **{f"size_p{round(p * 100)}": None for p in PERCENTILES}})
    out.sort(key=lambda r: _queue_order(r["topic"], r["channel"]))
    return out


def _queue_order(topic: str, channel: str | None) -> tuple[str, bool, str]:
    """Report order in Python, as `_sorted`'s in Spark: by topic, its own queue before its channels."""
    return topic, channel is not None, channel or ""
