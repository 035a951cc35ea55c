"""Count JSON events per kind in event-time windows, from one topic to another topic and Parquet.

    python -m examples.events_pipeline --nsqd 127.0.0.1:4150 --topic events \\
        --out-topic event_counts --parquet /tmp/counts --checkpoint /tmp/ckpt

    # nightly, from the topic's retained log: what came since the last run, then stop
    python -m examples.events_pipeline --mode offset --available-now --nsqd 127.0.0.1:4150 \\
        --topic events --out-topic event_counts --parquet /data/counts --checkpoint /data/ckpt-nightly

The query, on Structured Streaming:

1. `spark.readStream.format("mqd")` reads `--topic`, one row per message
   (`body` binary), in one of the source's two modes (`--mode`):
   - `channel` (the default): it consumes channel `--channel`, as any NSQ
     consumer does, and runs until stopped;
   - `offset`: it reads the topic's retained log by offset (brokers run
     with retention), consuming nothing: from `--starting-offsets`
     (earliest by default) or `--since` on the query's first run, from
     where the checkpoint says on every later one. With `--available-now`
     (Spark's `Trigger.AvailableNow`) a run reads what the logs held when
     it started, in micro-batches of at most `--max-per-trigger`, and
     stops: the nightly re-run of a window is a cron job;
2. `from_json(cast(body as string))` parses `{"user", "kind", "ts"}`;
   a body that is not such JSON, or has no `ts`, is skipped;
3. `withWatermark("ts", --watermark)` then tumbling windows of `--window`
   by kind, counted. The output mode is append: a window's row is emitted
   once, when the watermark (the latest event time seen, less
   `--watermark`) has passed its end, so it is final. Events older than
   the watermark are dropped as late;
4. every micro-batch's closed windows go, through `foreachBatch`, both to
   Parquet and to `--out-topic` as JSON messages, except those of kind
   "flush" (the event publish_events.py sends to close a run's windows):

       {"window_start": "2026-11-26T12:00:00.000Z",
        "window_end": "2026-11-26T12:00:10.000Z", "kind": "click", "count": 61}

Why foreachBatch rather than two `writeStream`s: two queries would each
read the topic, and two readers on one channel split its messages between
them (NSQ's channel semantics); two channels would count everything twice.
One query reads once and writes the same rows to both places.

Delivery. The source hands Spark each message in exactly one committed
micro-batch (in channel mode its write-ahead log is under `--checkpoint`;
in offset mode a batch is a range of offsets Spark keeps there, read again
as the same records). A micro-batch replayed after a crash writes Parquet
again under the same `batch_id=<id>` directory, replacing what it wrote
before, so Parquet is exactly once; the topic is at least once (nsqd has
no idempotent publish): a replay may publish a window's row twice,
identical each time, so a consumer can keep the last row per
(window_start, kind).

Runs of the offset mode with one checkpoint follow on from each other: a
window still open at the end of a run (the watermark has not passed its
end) stays in the checkpoint's state and is emitted by a later run, once
newer events move the watermark. To compute a window again from scratch
(a fixed job, a lost output), run with a new `--checkpoint` (and a new
`--parquet`) from `--since` the window's start.

Read the results with `spark.read.parquet(PARQUET)` (the `batch_id`
directories become a column) or any NSQ consumer of `--out-topic`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mqd.client.config import parse_duration
from mqd.moments import parse_since

__all__ = [
    "EVENT_SCHEMA",
    "FLUSH_KIND",
    "PipelineConfig",
    "main",
    "start_pipeline",
    "window_counts",
    "write_batch",
]

EVENT_SCHEMA = "user string, kind string, ts timestamp"
FLUSH_KIND = "flush"
COUNT_COLUMNS = ("window_start", "window_end", "kind", "count")


@dataclass(frozen=True)
class PipelineConfig:
    """Where the pipeline reads and writes, and its windows; durations are Go-style ("10s")."""

    topic: str
    out_topic: str
    parquet: str
    checkpoint: str
    nsqd: str | None = None  # comma-separated TCP addresses
    lookupd: str | None = None  # comma-separated lookupd HTTP addresses
    channel: str = "event-counts"
    window: str = "10s"
    watermark: str = "5s"
    trigger: str = "5s"
    max_per_trigger: int = 10_000
    # "channel": consume `channel`; "offset": read the topic's retained log (no channel).
    mode: str = "channel"
    # Offset mode, on the query's first run: startingOffsets, or startingTimestamp (ms) when given.
    starting_offsets: str = "earliest"
    since_ms: int | None = None
    # Trigger.AvailableNow (offset mode): read what the logs hold at the start, then stop.
    available_now: bool = False

    def broker_options(self) -> dict[str, str]:
        """The `nsqd` / `lookupd` options both the source and the sink take."""
        out = {}
        if self.nsqd:
            out["nsqd"] = self.nsqd
        if self.lookupd:
            out["lookupd"] = self.lookupd
        if not out:
            raise ValueError("give --nsqd or --lookupd")
        return out


def spark_interval(duration: str) -> str:
    """A Go-style duration ("10s", "1m30s", "500ms") as a Spark interval string."""
    return f"{round(parse_duration(duration) * 1000)} milliseconds"


def window_counts(events: Any, window: str, watermark: str) -> Any:
    """Per tumbling `window` of event time and kind, how many events (append-mode ready).

    `events` is the source's DataFrame (a binary `body` column of JSON).
    Columns of the result: window_start, window_end, kind, count.

    Every event is counted, "flush" ones too: a filter on `kind` here,
    even one written after `withWatermark`, is pushed below it by Spark's
    optimizer, and the flush events would no longer move the watermark.
    write_batch drops their rows instead.
    """
    from pyspark.sql import functions as F

    parsed = (events
              .select(F.from_json(F.col("body").cast("string"), EVENT_SCHEMA).alias("e"))
              .select("e.*")
              .where(F.col("ts").isNotNull() & F.col("kind").isNotNull()))
    return (parsed
            .withWatermark("ts", spark_interval(watermark))
            .groupBy(F.window("ts", spark_interval(window)).alias("w"), "kind")
            .count()
            .select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                    "kind", "count"))


def write_batch(batch: Any, batch_id: int, config: PipelineConfig) -> None:
    """One micro-batch's closed windows to Parquet (`batch_id=<id>`, replaced on replay) and the topic."""
    from pyspark.sql import functions as F

    # Dropped here, not before the aggregation (see window_counts).
    batch = batch.where(F.col("kind") != FLUSH_KIND).persist()
    try:
        if batch.isEmpty():  # a batch that only moved the watermark, or closed no window
            return
        (batch.coalesce(1).write.mode("overwrite")
         .parquet(os.path.join(config.parquet, f"batch_id={batch_id}")))
        writer = (batch.select(F.to_json(F.struct(*COUNT_COLUMNS)).alias("body"))
                  .write.format("mqd").option("topic", config.out_topic).mode("append"))
        for key, value in config.broker_options().items():
            writer = writer.option(key, value)
        writer.save()
    finally:
        batch.unpersist()


def start_pipeline(spark: Any, config: PipelineConfig) -> Any:
    """Start the query on `spark` (a session with the `mqd` format registered); its StreamingQuery."""
    reader = spark.readStream.format("mqd").option("topic", config.topic)
    if config.mode == "offset":
        # No channel: the retained log by offset; Spark's checkpoint keeps where the query is.
        reader = (reader.option("startingOffsets", config.starting_offsets)
                  .option("maxOffsetsPerTrigger", str(config.max_per_trigger)))
        if config.since_ms is not None:
            reader = reader.option("startingTimestamp", str(config.since_ms))
    elif config.mode == "channel":
        reader = (reader.option("channel", config.channel)
                  .option("checkpointLocation", config.checkpoint)
                  .option("maxMessagesPerTrigger", str(config.max_per_trigger)))
    else:
        raise ValueError(f"mode {config.mode!r}: channel or offset")
    for key, value in config.broker_options().items():
        reader = reader.option(key, value)
    counts = window_counts(reader.load(), config.window, config.watermark)
    writer = (counts.writeStream
              .outputMode("append")
              .foreachBatch(lambda batch, batch_id: write_batch(batch, batch_id, config))
              .option("checkpointLocation", config.checkpoint)
              .queryName(f"event-counts-{config.topic}"))
    if config.available_now:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime=spark_interval(config.trigger)).start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.events_pipeline",
        description="Count JSON events per kind in event-time windows, to a topic and Parquet.")
    parser.add_argument("--nsqd", help="brokers' TCP addresses, comma-separated (host:4150)")
    parser.add_argument("--lookupd", help="nsqlookupd HTTP addresses, comma-separated (host:4161)")
    parser.add_argument("--topic", default="events", help="where events are read (%(default)s)")
    parser.add_argument("--mode", choices=("channel", "offset"), default="channel",
                        help="consume a channel, or read the topic's retained log by offset (%(default)s)")
    parser.add_argument("--channel", default=None, help="channel mode: the channel read (event-counts)")
    parser.add_argument("--starting-offsets", default=None, metavar="earliest|latest|JSON",
                        help="offset mode, the query's first run: where it starts (earliest)")
    parser.add_argument("--since", default=None, metavar="DURATION|RFC3339",
                        help="offset mode, the query's first run: from the first record published at or "
                             "after this time (6h: six hours ago, or 2026-11-26T00:00:00Z)")
    parser.add_argument("--available-now", action="store_true",
                        help="offset mode: read what the logs hold now, in micro-batches, then stop "
                             "(Trigger.AvailableNow)")
    parser.add_argument("--out-topic", default="event_counts",
                        help="where window counts are published (%(default)s)")
    parser.add_argument("--parquet", required=True, help="directory of the counts' Parquet files")
    parser.add_argument("--checkpoint", required=True,
                        help="the query's checkpoint (and the source's write-ahead log)")
    parser.add_argument("--window", default="10s", help="tumbling window length (%(default)s)")
    parser.add_argument("--watermark", default="5s",
                        help="how late an event may be and still count (%(default)s)")
    parser.add_argument("--trigger", default="5s", help="micro-batch interval (%(default)s)")
    parser.add_argument("--max-per-trigger", type=int, default=10_000,
                        help="most messages in one micro-batch (%(default)s; offset mode: maxOffsetsPerTrigger)")
    parser.add_argument("--run-for", default=None,
                        help="stop after this long (e.g. 2m); default: until Ctrl-C")
    parser.add_argument("--master", default=None, help="Spark master (default local[*])")
    args = parser.parse_args(argv)
    if not args.nsqd and not args.lookupd:
        parser.error("give --nsqd or --lookupd")
    if args.mode == "channel":
        for flag in ("starting_offsets", "since", "available_now"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} goes with --mode offset (a channel has no offsets: "
                             "it hands out what arrives)")
    elif args.channel is not None:
        parser.error("--channel goes with --mode channel (the offset mode reads the log without one)")
    if args.since is not None and args.starting_offsets is not None:
        parser.error("use --since or --starting-offsets not both")
    since_ms = None
    if args.since is not None:
        try:
            since_ms = parse_since(args.since).ms(time.time())
        except ValueError as e:
            parser.error(f"--since {args.since!r}: {e}")
    config = PipelineConfig(
        topic=args.topic, out_topic=args.out_topic, parquet=os.path.abspath(args.parquet),
        checkpoint=os.path.abspath(args.checkpoint), nsqd=args.nsqd, lookupd=args.lookupd,
        channel=args.channel or "event-counts", window=args.window, watermark=args.watermark,
        trigger=args.trigger, max_per_trigger=args.max_per_trigger, mode=args.mode,
        starting_offsets=args.starting_offsets or "earliest", since_ms=since_ms,
        available_now=args.available_now)

    from spark_bridge.session import build_session

    spark = build_session(args.master, app_name="mqd-events-pipeline")
    query = start_pipeline(spark, config)
    source = (f"{config.topic}'s retained log" if config.mode == "offset"
              else f"{config.topic} channel {config.channel}")
    until = "until what it holds now is read" if config.available_now else "Ctrl-C stops"
    print(f"counting {source} -> {config.out_topic} and {config.parquet} ({until})", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: query.stop())
    deadline = None if args.run_for is None else time.monotonic() + parse_duration(args.run_for)
    reported = -1
    read = 0

    def report_batches() -> None:
        nonlocal reported, read
        for progress in query.recentProgress:  # every batch, however fast they come
            if progress["batchId"] > reported:
                reported = progress["batchId"]
                read += progress.get("numInputRows") or 0
                if progress.get("numInputRows"):
                    print(f"batch {reported}: {progress['numInputRows']} messages, watermark "
                          f"{progress.get('eventTime', {}).get('watermark')}", file=sys.stderr)

    try:
        while query.isActive:
            query.awaitTermination(1)
            report_batches()
            if deadline is not None and time.monotonic() > deadline:
                break
        report_batches()
    except KeyboardInterrupt:
        pass
    finally:
        query.stop()
        failure = query.exception()
        spark.stop()
    if failure is not None:
        print(f"the query failed: {failure}", file=sys.stderr)
        return 1
    if config.available_now:
        print(f"done: {read} messages in {reported + 1} micro-batches", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
