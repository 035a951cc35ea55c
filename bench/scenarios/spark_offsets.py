"""The offset mode of the `mqd` format (topics' retained logs read by offset), for ``python -m bench spark-stream``.

Each repetition starts one mqd (``--backend=lmdb --retention-bytes=10GB``
by default), pre-publishes ``--messages`` bodies by TCP MPUB into a topic
with no channel (so they are in its retained log, and in its queue for
the snapshot), takes a snapshot of it (``POST /snapshot``), then runs, in
an order that alternates from one repetition to the next:

1. stream: ``readStream.format("mqd")`` with the topic and no channel,
   ``startingOffsets`` earliest, ``trigger(availableNow=True)`` ->
   ``foreachBatch`` counting each batch (the counts must add up to N).
   Wall rate = N / (query start -> query ended, awaitTermination); the
   SparkSession is built before, as the channel mode's figure is
   measured. Besides: the seconds outside the micro-batches (the query's
   start: the driver's Python source process started, the brokers asked
   where their logs are) and the micro-batches' addBatch.
2. batch: ``spark.read.format("mqd").option("topic", ...).load().count()``
   (every record the log holds when the read is planned).
3. snapshot: ``spark.read.format("mqd").load(SNAPDIR).count()``: the same
   records read from the snapshot instead (spark_bridge's snapshot reader).

The records are read, never consumed, so the three read one filled
broker. The first repetition's reads run ``--offset-warmup`` times
untimed before (default 3): they start Spark's Python workers, and the
JVM's JIT takes that many reads of a million rows to settle (its CPU per
read falls by a third over the first ten).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from bench.harness import wire
from bench.harness.broker import Broker, BrokerError
from bench.harness.load import fill
from bench.harness.report import fmt, load_average, median

__all__ = ["READS", "OffsetRun", "filled_broker", "offset_markdown", "offset_reads", "offset_source_options",
           "offset_warmup", "retaining_broker"]

TOPIC = "retained"
MEM_QUEUE_SIZE = 10_000_000
READS = ("stream", "batch", "snapshot")
now = time.perf_counter


@dataclass
class OffsetRun:
    """One timed read of the retained records (stream, batch or snapshot)."""

    what: str
    rep: int
    messages: int
    seconds: float  # query start -> query ended (stream); the count's call (batch, snapshot)
    rate: float
    outside_s: float | None = None  # stream: the query's seconds outside its micro-batches
    add_batch_s: float | None = None  # stream: addBatch summed over its micro-batches
    batches: int | None = None
    durations_ms: dict[str, float] = field(default_factory=dict)  # stream: summed per phase
    load: float = 0.0


def retaining_broker(args: argparse.Namespace) -> Broker:
    """mqd with retention on for every topic (the offset mode needs it), on loopback ports."""
    return Broker(args.offset_backend, MEM_QUEUE_SIZE, [f"--retention-bytes={args.retention_bytes}"])


@contextmanager
def filled_broker(args: argparse.Namespace, messages: int) -> Iterator[tuple[Broker, str]]:
    """A retaining mqd holding `messages` records of TOPIC, and the path of a snapshot of it."""
    broker = retaining_broker(args)
    try:
        broker.start()
        if broker.http_address is None or broker.address is None:
            raise BrokerError(f"mqd: no 'HTTP: listening on' line:\n{broker.log_tail()}")
        wire.http_create(broker.http_address, TOPIC)
        fill(broker.address, TOPIC, messages, size=args.size, batch=1000, pipeline=4)
        answer = json.loads(wire.http_request(broker.http_address, "/snapshot", "POST", timeout=600,
                                              out="offsets-bench"))
        yield broker, answer["path"]
    finally:
        broker.stop()


def offset_source_options(broker: Broker, **more: str) -> dict[str, str]:
    """The offset mode's options for TOPIC on `broker` (no channel: its log, by offset)."""
    assert broker.address is not None
    return {"topic": TOPIC, "nsqd": f"{broker.address[0]}:{broker.address[1]}", **more}


def stream_run(spark, broker: Broker, args: argparse.Namespace, messages: int, rep: int) -> OffsetRun:
    """(1): the whole log by the streaming source, Trigger.AvailableNow, into a foreachBatch count."""
    from pyspark.errors import StreamingQueryException

    counts: list[int] = []

    def each(batch_df, _batch_id: int) -> None:
        counts.append(batch_df.count())

    options = offset_source_options(broker, startingOffsets="earliest")
    if args.max_offsets_per_trigger:
        options["maxOffsetsPerTrigger"] = str(args.max_offsets_per_trigger)
    reader = spark.readStream.format("mqd")
    for key, value in options.items():
        reader = reader.option(key, value)
    checkpoint = tempfile.mkdtemp(prefix="spark-offsets-bench-")
    try:
        t0 = now()
        query = (reader.load().writeStream.foreachBatch(each).option("checkpointLocation", checkpoint)
                 .trigger(availableNow=True).start())
        try:
            if not query.awaitTermination(args.timeout):
                raise BrokerError(f"offset stream: not done after {args.timeout:g} s")
            seconds = now() - t0
            load = load_average()
        except StreamingQueryException as e:
            raise BrokerError(f"offset stream: the query failed: {e}") from None
        finally:
            query.stop()
        progress = query.recentProgress
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    if sum(counts) != messages:
        raise BrokerError(f"offset stream: the batches' counts add up to {sum(counts):,}, not {messages:,}")
    phases: dict[str, float] = {}
    for p in progress:
        for key, ms in p.durationMs.items():
            phases[key] = phases.get(key, 0) + ms
    inside = phases.get("triggerExecution", 0) / 1000
    return OffsetRun("stream", rep, messages, seconds, messages / seconds, seconds - inside,
                     phases.get("addBatch", 0) / 1000, sum(1 for p in progress if p.numInputRows), phases, load)


def count_run(spark, what: str, broker: Broker, snapshot: str, messages: int, rep: int) -> OffsetRun:
    """(2) or (3): the records counted by a batch read of the log, or of the snapshot."""
    reader = spark.read.format("mqd")
    if what == "batch":
        for key, value in offset_source_options(broker).items():
            reader = reader.option(key, value)
    t0 = now()
    got = (reader.load() if what == "batch" else reader.load(snapshot)).count()
    seconds = now() - t0
    if got != messages:
        raise BrokerError(f"offset {what}: counted {got:,} records, not {messages:,}")
    return OffsetRun(what, rep, messages, seconds, messages / seconds, load=load_average())


def offset_reads(spark, args: argparse.Namespace, failures: list[str]) -> list[OffsetRun]:
    """--runs repetitions of the three reads, each on a freshly filled broker, the order alternating."""
    runs: list[OffsetRun] = []
    for rep in range(args.runs):
        order = READS if rep % 2 == 0 else READS[::-1]
        try:
            with filled_broker(args, args.messages) as (broker, snapshot):
                if rep == 0:
                    t = now()
                    for _ in range(args.offset_warmup):
                        for what in READS:  # untimed: Spark's Python workers started, the JIT settled
                            _read(spark, what, broker, snapshot, args, rep)
                    print(f"offset warm-up: the three reads {args.offset_warmup} times in {now() - t:.1f} s",
                          flush=True)
                for what in order:
                    r = _read(spark, what, broker, snapshot, args, rep)
                    runs.append(r)
                    extra = (f" (outside the micro-batches {r.outside_s:.2f} s, addBatch {fmt(r.add_batch_s, '.2f')} s,"
                             f" {r.batches} batches)" if what == "stream" else "")
                    print(f"offset {what:<8} run {rep + 1}: {r.rate:>9,.0f} msgs/s ({r.seconds:.2f} s){extra}, "
                          f"load {r.load:.2f}", flush=True)
        except (BrokerError, wire.ProtocolError, OSError) as exc:
            failures.append(f"offset run {rep + 1}: {exc}")
            print(f"error: {failures[-1]}", flush=True)
    return runs


def offset_warmup(spark, args: argparse.Namespace, messages: int = 20_000) -> float:
    """One untimed stream read of a small log (the latency runs' warm-up when no offset read ran before)."""
    t = now()
    with filled_broker(args, messages) as (broker, _snapshot):
        stream_run(spark, broker, args, messages, 0)
    return now() - t


def _read(spark, what: str, broker: Broker, snapshot: str, args: argparse.Namespace, rep: int) -> OffsetRun:
    if what == "stream":
        return stream_run(spark, broker, args, args.messages, rep)
    return count_run(spark, what, broker, snapshot, args.messages, rep)


def offset_markdown(args: argparse.Namespace, runs: list[OffsetRun]) -> list[str]:
    """The offset mode's lines of the report: one row per read, medians over the repetitions."""
    if not runs:
        return []
    mpt = f"maxOffsetsPerTrigger {args.max_offsets_per_trigger:,}" if args.max_offsets_per_trigger else \
        "no maxOffsetsPerTrigger (one micro-batch)"
    lines = [
        "",
        f"- offset mode: mqd `--backend={args.offset_backend} --retention-bytes={args.retention_bytes}`, "
        f"{args.messages:,} x {args.size} B pre-published by MPUB to a topic without channels; per "
        "repetition one broker, the three reads in alternating order. stream: readStream (topic, no "
        f"channel, startingOffsets earliest, {mpt}, Trigger.AvailableNow) -> foreachBatch count, wall = "
        "N / (query start -> query ended); batch: spark.read (topic) .count(); snapshot: "
        "spark.read.load(POST /snapshot's path).count()",
        "",
        "| read | msgs/s | s | outside micro-batches s | addBatch s | batches | load |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for what in READS:
        got = [r for r in runs if r.what == what]
        if not got:
            continue
        loads = [r.load for r in got]
        lines.append(
            f"| {what} | {fmt(median([r.rate for r in got]))} | {fmt(median([r.seconds for r in got]), '.2f')} "
            f"| {fmt(median([r.outside_s for r in got]), '.2f')} | {fmt(median([r.add_batch_s for r in got]), '.2f')} "
            f"| {fmt(median([r.batches for r in got]), '.0f')} | {min(loads):.1f}-{max(loads):.1f} |")
    return lines
