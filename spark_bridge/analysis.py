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

A window of topics' retained logs (`resolve_window`, `read_window`,
`analyze_window`: "the last 6 hours of events", no snapshot needed) gets
the questions its rows can answer. A record of the log is what was
published (topic, id, publish time, body, the broker's address and the
offset), not where the message is now: no channel, no state, no
attempts, no due time. `window_rows` gives its rows the snapshot's
columns (kind "topic", state and deferred_until null, body_size, the
offset as sequence), so the same functions run on both; `analyze_window`
leaves out the questions of states, attempts, poison and deferrals, and
adds each broker's range. Ages are measured from the window's end: its
`until` time, else the moment its offsets were resolved.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from mqd.nsqd.snapshot_format import STATES, Manifest, read_manifest
from spark_bridge.datasource import FORMAT_NAME, register
from spark_bridge.records import SPARK_SCHEMA_DDL

if TYPE_CHECKING:
    from spark_bridge.log_fetch import BrokerLog
    from spark_bridge.log_options import Bound

__all__ = [
    "AGE_BUCKETS",
    "Analysis",
    "BrokerRange",
    "DEFAULT_POISON_ATTEMPTS",
    "DUE_BUCKETS",
    "PERCENTILES",
    "SIZE_BUCKETS",
    "STATES",
    "LogWindow",
    "WindowError",
    "WindowOptionError",
    "age_histogram",
    "analyze",
    "analyze_window",
    "attempts_histogram",
    "broker_counts",
    "bucket_counts",
    "deferred_backlog",
    "json_field",
    "json_field_counts",
    "poison_messages",
    "queue_summary",
    "read_snapshot",
    "read_window",
    "resolve_window",
    "size_histogram",
    "snapshot_time",
    "state_counts",
    "window_rows",
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

    path: str  # the snapshot; for a window, its topics
    manifest: Manifest | None  # None: a window of retained logs (`window`)
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
    # A window of retained logs: what it was, and per (topic, broker) its range and what was read of it.
    window: LogWindow | None = None
    brokers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(q["messages"] for q in self.queues)

    def state_total(self, state: str) -> int:
        """Messages in `state` over every queue."""
        return sum(q[state] for q in self.queues)

    @property
    def left_out(self) -> list[dict[str, Any]]:
        """The queues the snapshot did not take (ephemeral ones), as its manifest lists them."""
        return [] if self.manifest is None else list(self.manifest.left_out)

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
        queues=_with_empty_queues(queues, [(q.topic, q.channel, q.kind) for q in manifest.queues]),
        age_histogram=ages, size_histogram=sizes,
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


def _with_empty_queues(rows: list[dict[str, Any]], queues: Sequence[tuple[str, str | None, str]],
                       ) -> list[dict[str, Any]]:
    """The summary rows plus a zero row for each of `queues` (topic, channel, kind) that has none."""
    seen = {(r["topic"], r["channel"]) for r in rows}
    out = list(rows)
    for topic, channel, kind in queues:
        if (topic, channel) not in seen:
            out.append({"topic": topic, "channel": channel,
                        "kind": kind,
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


# -- a window of topics' retained logs -------------------------------------------------------------

# The options that bound a window: resolve_window turns them into offsets, read_window reads those.
_BOUND_OPTIONS = frozenset({"startingoffsets", "startingtimestamp", "endingoffsets", "endingtimestamp"})


class WindowError(ValueError):
    """A window of retained logs that cannot be resolved as asked: one line naming the option, broker and topic."""


class WindowOptionError(WindowError):
    """The window's options themselves are wrong (before any broker is asked)."""


@dataclass(frozen=True)
class BrokerRange:
    """Offsets [start, end) of `topic`'s retained log on broker `nsqd` (its TCP address), in the log's life `epoch`."""

    topic: str
    nsqd: str
    epoch: int
    start: int
    end: int

    @property
    def records(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class LogWindow:
    """A window of topics' retained logs, resolved to offsets once, so every question reads the same records.

    `ranges` has one entry per (topic, broker) that keeps the topic's log,
    empty ranges too, so the offsets name every broker; `missing` lists
    the (topic, broker) pairs whose broker has no such topic. `starting`
    and `ending` say how each end was given (earliest, latest, timestamp,
    offsets), `since` / `until` the times asked. `options` are the Spark
    options of the read without its bounds (brokers, client settings; the
    secret among them, hence not in the repr).
    """

    topics: tuple[str, ...]
    ranges: tuple[BrokerRange, ...]
    resolved_at: datetime
    starting: str
    ending: str
    since: datetime | None = None
    until: datetime | None = None
    missing: tuple[tuple[str, str], ...] = ()
    options: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def records(self) -> int:
        """Records between the bounds when they were resolved (fewer are read if some expire meanwhile)."""
        return sum(r.records for r in self.ranges)

    @property
    def as_of(self) -> datetime:
        """The window's end in time, the 'now' of its ages: `until` (if past), else when it was resolved."""
        return self.resolved_at if self.until is None else min(self.until, self.resolved_at)

    def brokers(self) -> list[str]:
        """The brokers of the ranges, in their order, each once."""
        return list(dict.fromkeys(r.nsqd for r in self.ranges))

    def offsets(self, end: bool) -> dict[str, dict[str, dict[str, int]]]:
        """The start (or end) offsets as the offset mode's JSON has them: topic -> broker -> epoch, offset."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for r in self.ranges:
            out.setdefault(r.topic, {})[r.nsqd] = {"epoch": r.epoch, "offset": r.end if end else r.start}
        return out

    def offsets_json(self, end: bool) -> str:
        return json.dumps(self.offsets(end), separators=(",", ":"))


def resolve_window(options: Mapping[str, str], now: datetime | None = None) -> LogWindow:
    """The window the offset mode's batch options name (topic(s), nsqd or lookupd, the bounds), as offsets.

    Each broker is asked its log's offsets (and where each time bound
    falls in it) now, once: the window read later is these offsets, even
    on a topic still being published to. The brokers are those the
    `nsqd` or `lookupd` option names then; `read_window` reads them by
    their TCP address. Raises WindowError (one line) for bad options, a
    broker or lookupd that cannot be asked or refuses, a topic without
    retention or on no broker, and offsets the logs do not hold.
    """
    from spark_bridge.log_brokers import BrokerError, LogBrokers
    from spark_bridge.log_fetch import LogFetchError, RetentionOff, TopicMissing
    from spark_bridge.log_options import log_options
    from spark_bridge.stream_options import StreamOptionError

    try:
        parsed = log_options(options, batch=True)
    except StreamOptionError as e:
        raise WindowOptionError(str(e)) from None
    resolved_at = now or datetime.now(UTC)
    brokers = LogBrokers(parsed)
    ranges: list[BrokerRange] = []
    missing: list[tuple[str, str]] = []
    for topic in parsed.topics:
        try:
            found, away = brokers.find(topic)
        except BrokerError as e:
            raise WindowError(str(e)) from None
        for why in away.values():
            raise WindowError(f"{why}; a window needs every broker of the topic (name the others with option "
                              "nsqd to analyse without it)")
        for bound, name in ((parsed.starting, "startingOffsets"), (parsed.ending, "endingOffsets")):
            named = (bound.offsets or {}).get(topic, {}) if bound.kind == "offsets" else {}
            unknown = sorted(set(named) - set(found))
            if unknown:
                raise WindowError(f"mqd: option {name} names nsqd {unknown[0]} for topic {topic!r}, which is not "
                                  f"one of its brokers ({', '.join(sorted(found)) or 'none'})")
        kept = 0
        for nsqd, broker in found.items():
            try:
                start, end, epoch = _log_range(broker, topic, parsed.starting, parsed.ending)
            except TopicMissing:
                missing.append((topic, nsqd))
                continue
            except RetentionOff as e:
                raise WindowError(f"{e}; or analyse a snapshot of the broker") from None
            except LogFetchError as e:
                raise WindowError(str(e)) from None
            if end < start:
                raise WindowError(f"mqd: the window of topic {topic!r} on nsqd {nsqd} ends before it starts "
                                  f"(offsets {start} to {end})")
            ranges.append(BrokerRange(topic, nsqd, epoch, start, end))
            kept += 1
        if not kept:
            where = (f"nsqd {', '.join(parsed.nsqd)}" if parsed.nsqd
                     else f"the brokers lookupd {', '.join(parsed.lookupd)} lists")
            raise WindowError(f"mqd: topic {topic!r} does not exist on {where}")
    read_options = {k: v for k, v in options.items()
                    if k.lower() not in _BOUND_OPTIONS and k.lower() not in ("nsqd", "lookupd")}
    read_options["nsqd"] = ",".join(dict.fromkeys(r.nsqd for r in ranges))

    def moment(ms: int | None) -> datetime | None:
        return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)

    return LogWindow(
        topics=parsed.topics, ranges=tuple(ranges), resolved_at=resolved_at,
        starting=parsed.starting.kind, ending=parsed.ending.kind,
        since=moment(parsed.starting.timestamp_ms), until=moment(parsed.ending.timestamp_ms),
        missing=tuple(missing), options=read_options)


def _log_range(broker: BrokerLog, topic: str, starting: Bound, ending: Bound) -> tuple[int, int, int]:
    """(start, end, epoch) of the window on one broker's log of `topic` (its bounds: log_options.Bound)."""
    from spark_bridge.log_fetch import log_offsets
    from spark_bridge.log_options import EARLIEST, LATEST

    # The times first, then the log's bounds: an offset found for a time is
    # then never past the latest (the log only grows while it is asked).
    at_time = {b.timestamp_ms: log_offsets(broker, topic, b.timestamp_ms)
               for b in (starting, ending) if b.kind == "timestamp"}
    offs = log_offsets(broker, topic)
    where = f"topic {topic} on nsqd {broker.nsqd}"
    if any(found.epoch != offs.epoch for found in at_time.values()):
        raise WindowError(f"mqd: the log of {where} was recreated while the window was resolved: try again")

    def offset(bound: Bound, name: str) -> int:
        if bound.kind == "earliest":
            return offs.earliest
        if bound.kind == "latest":
            return offs.latest
        if bound.kind == "timestamp":
            found = at_time[bound.timestamp_ms]
            first = found.latest if found.offset_for_timestamp is None else found.offset_for_timestamp
            return min(max(first, offs.earliest), offs.latest)
        given = (bound.offsets or {}).get(topic, {}).get(broker.nsqd)
        if given is None:
            raise WindowError(f"mqd: option {name} gives no offset for nsqd {broker.nsqd} of topic {topic!r}: "
                              "give every broker of the topic (-2 = earliest, -1 = latest)")
        value, epoch = given
        if epoch is not None and epoch != offs.epoch:
            raise WindowError(f"mqd: option {name}: the log of {where} is epoch {offs.epoch} now, not {epoch}: "
                              "the topic was deleted and created again since, and the records those offsets "
                              "name are gone")
        if value == EARLIEST:
            return offs.earliest
        if value == LATEST:
            return offs.latest
        if not offs.earliest <= value <= offs.latest:
            raise WindowError(f"mqd: option {name}: offset {value} is out of range for {where}: "
                              f"earliest {offs.earliest}, latest {offs.latest}")
        return value

    return offset(starting, "startingOffsets"), offset(ending, "endingOffsets"), offs.epoch


def read_window(spark: SparkSession, window: LogWindow, partitions: int | None = None) -> DataFrame:
    """The window's records, one row per record (the offset mode's rows: log_fetch.OFFSET_SCHEMA_DDL).

    Read by the brokers' TCP addresses at the resolved offsets, with
    `failOnDataLoss` false: records that expire before they are read are
    left out (compare the rows with `window.records`), not a failure.
    `partitions` (default: the session's parallelism) is `minPartitions`.
    """
    from spark_bridge.log_fetch import OFFSET_SCHEMA_DDL

    register(spark)
    n = partitions or spark.sparkContext.defaultParallelism
    reader = spark.read.format(FORMAT_NAME).schema(OFFSET_SCHEMA_DDL)
    for key, value in window.options.items():
        reader = reader.option(key, value)
    return (reader.option("startingOffsets", window.offsets_json(end=False))
            .option("endingOffsets", window.offsets_json(end=True))
            .option("minPartitions", n).option("failOnDataLoss", "false").load())


def window_rows(df: DataFrame) -> DataFrame:
    """Retained-log rows with the snapshot's columns the analysis uses (see the module), the log's kept too.

    kind "topic" (a log is the topic's, no channel's), state and
    deferred_until null (a record has neither), body_size, and the offset
    as `sequence` (the order within a broker's log).
    """
    return (df.withColumn("kind", F.lit("topic"))
            .withColumn("state", F.lit(None).cast("string"))
            .withColumn("deferred_until", F.lit(None).cast("timestamp"))
            .withColumn("body_size", F.octet_length("body"))
            .withColumn("sequence", F.col("offset")))


def broker_counts(df: DataFrame) -> DataFrame:
    """Per topic and broker (`nsqd`): records, bytes, first and last offset, oldest and newest publication.

    `df`: window_rows (body_size and offset).
    """
    return (df.groupBy("topic", "nsqd")
            .agg(F.count(F.lit(1)).alias("messages"), F.sum("body_size").alias("bytes"),
                 F.min("offset").alias("first_offset"), F.max("offset").alias("last_offset"),
                 F.min("timestamp").alias("oldest"), F.max("timestamp").alias("newest"))
            .transform(_sorted, "topic", "nsqd"))


def analyze_window(spark: SparkSession, window: LogWindow, *, json_field_name: str | None = None,
                   partitions: int | None = None, progress: Progress | None = None) -> Analysis:
    """The questions a window of retained logs can answer, over one read of it (as `analyze` reads a snapshot).

    Per topic: records, bytes, oldest and newest publication, ages (from
    `window.as_of`) and sizes with their percentiles and histograms, the
    JSON field's values; per broker: its range and the records read of
    it. No states, attempts, poison or deferrals: records have none.
    """
    as_of = window.as_of
    rows = window_rows(read_window(spark, window, partitions))
    if json_field_name is not None:
        rows = rows.withColumn("json_value", json_field(json_field_name))
    base = rows.drop("body").persist(StorageLevel.MEMORY_AND_DISK)
    steps: list[tuple[str, Callable[[], Any]]] = [
        (f"reading {window.records:,} records, per broker", lambda: broker_counts(base)),
        ("messages, ages and sizes per topic", lambda: queue_summary(base, as_of)),
        ("ages and sizes", lambda: bucket_counts(base, as_of)),
    ]
    if json_field_name is not None:
        steps.append((f"JSON field {json_field_name!r}", lambda: json_field_counts(base, json_field_name)))
    try:
        results, seconds = _run_concurrently(spark, steps, progress)
    finally:
        base.unpersist()
    brokers, queues, counts, *json_counts = results
    return Analysis(
        path=", ".join(window.topics), manifest=None, as_of=as_of, poison_attempts=DEFAULT_POISON_ATTEMPTS,
        queues=_with_empty_queues(queues, [(t, None, "topic") for t in window.topics]),
        age_histogram=_rollup_rows(counts, "age_bucket", AGE_BUCKETS, keep_due=False),
        size_histogram=_rollup_rows(counts, "size_bucket", SIZE_BUCKETS, keep_due=False),
        attempts_histogram=[], poison=[], deferred=[],
        json_field=json_field_name, json_counts=json_counts[0] if json_counts else [],
        seconds=seconds, window=window, brokers=_broker_rows(brokers, window),
    )


def _broker_rows(counted: list[dict[str, Any]], window: LogWindow) -> list[dict[str, Any]]:
    """Each range of the window with what was read of it (zero rows for ranges nothing was read of)."""
    read = {(r["topic"], r["nsqd"]): r for r in counted}
    out = []
    for r in window.ranges:
        got = read.get((r.topic, r.nsqd), {})
        out.append({"topic": r.topic, "nsqd": r.nsqd, "epoch": r.epoch, "start": r.start, "end": r.end,
                    "records": r.records, "messages": got.get("messages", 0), "bytes": got.get("bytes") or 0,
                    "first_offset": got.get("first_offset"), "last_offset": got.get("last_offset"),
                    "oldest": got.get("oldest"), "newest": got.get("newest")})
    return out
