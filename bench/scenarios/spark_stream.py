"""``python -m bench spark-stream``: the `mqd` Structured Streaming source (and sink) under load.

Two measurements, each ``--runs`` times per broker (median), brokers
alternating within a repetition (mqd, nsqd; then nsqd, mqd; ...), a fresh
broker for every run:

1. Throughput. A broker (mqd ``--backend=memory``, or the real nsqd when
   ``--nsqd-bin`` or ``$NSQD_BIN`` points at it or an ``nsqd`` is on PATH),
   both with ``--mem-queue-size=10000000``, gets ``--messages`` 200-byte
   bodies pre-published by TCP MPUB (bench/harness/load.py). Then one `local[2]`
   query: ``readStream.format("mqd")`` -> ``foreachBatch`` that counts the
   batch and writes the count, as one message, with
   ``groupBy().count().write.format("mqd")`` to an output topic. Wall
   rate = N / (query start -> channel drained: depth 0 and in flight 0);
   the SparkSession is built once, before every run, so its start is not in
   it. Steady rate = rows / triggerExecution time of the micro-batches after
   the first (``query.recentProgress``). The counts read back from the
   output topic must add up to N, else the run fails. Each
   ``--max-per-trigger`` value is measured.

   The source holds a whole micro-batch in flight until Spark commits it,
   and NSQ caps what one connection may hold (``--max-rdy-count``, 2,500 by
   default), so both brokers are started with ``--max-rdy-count``
   (``--max-rdy``, default 200,000; 0 keeps the broker's default) and the
   source is given ``connectionsPerBroker = ceil(maxInFlight / max-rdy)``.

2. Latency. The query ``readStream.format("mqd").select("body")`` ->
   ``writeStream.format("mqd")`` (``trigger(processingTime="1 second")``)
   passes bodies through to an output topic; a paced writer process
   publishes ``--rate`` msgs/s for ``--seconds`` with the publish time
   (``time.time_ns()``) in each body, and a raw consumer process
   (bench/harness/load.py) on the output topic records arrival - publish time for
   every message: p50/p99.

3. The offset mode (bench/scenarios/spark_offsets.py): the same source
   without a channel reads a topic's retained log by offset, on an mqd
   with ``--retention-bytes``: ``--messages`` records read by the stream
   (Trigger.AvailableNow into a foreachBatch count; wall = N / (query
   start -> query ended), the SparkSession built before), by a batch read
   (``spark.read`` with the topic) and from a snapshot of the same records;
   and the latency above with the offset source (``mqd offsets``).
   ``--mode channel`` or ``--mode offset`` runs one mode only.

``--profile-source`` instead runs the source's driver side
(TopicStreamReader) without Spark on a pre-filled mqd broker under
cProfile, and under py-spy (all threads) when it is installed.

The machine may be shared: every figure carries the load average at its run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import multiprocessing as mp
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

from bench.harness import wire
from bench.harness.broker import NSQD_BIN_ENV, REPO, Broker, BrokerError, find_nsqd, nsqd_command
from bench.harness.load import ReaderConfig, WriterConfig, fill, reader_main, writer_main
from bench.harness.pyspy import pyspy_path, thread_table
from bench.harness.report import fmt, load_average, machine, median, percentile, save_json, today
from bench.scenarios.spark_offsets import (
    OffsetRun,
    offset_markdown,
    offset_reads,
    offset_warmup,
    retaining_broker,
)

MEM_QUEUE_SIZE = 10_000_000
TOPIC, CHANNEL = "stream", "spark"
# The latency runs' name for the offset mode on a retaining mqd (the others are brokers consumed by channel).
OFFSETS = "mqd offsets"
OUT_TOPIC, OUT_CHANNEL = "stream-out", "check"
now = time.perf_counter


# -- brokers -----------------------------------------------------------------------------------


def broker_for(kind: str, args: argparse.Namespace) -> Broker:
    """mqd (twistd, memory backend) or nsqd, on loopback ports, with the benchmark's flags."""
    extra = [f"--max-rdy-count={args.max_rdy}"] if args.max_rdy else []
    if kind == "mqd":
        return Broker("memory", MEM_QUEUE_SIZE, extra)
    return Broker(argv=nsqd_command(args.nsqd_bin, MEM_QUEUE_SIZE, extra))


def channel_counts(http_address: str, topic: str, channel: str) -> tuple[int, int]:
    """(depth, in_flight_count) of a channel from /stats."""
    got = wire.stats_counts(http_address, topic, channel)
    if got is None:
        raise BrokerError(f"no channel {topic}/{channel} in /stats")
    return got


def prepublish(address: tuple[str, int], topic: str, count: int, size: int) -> float:
    """`count` bodies by pipelined TCP MPUB of 1,000; returns msgs/s."""
    res = fill(address, topic, count, size=size, batch=1000, pipeline=4)
    return count / max(1e-9, res["t_end"] - res["t_start"])


def read_bodies(address: tuple[str, int], topic: str, channel: str, count: int) -> list[bytes]:
    """Read and FIN `count` messages of a channel (a small one: the per-batch counts)."""
    sock = wire.connect(address)
    try:
        wire.identify(sock)
        sock.sendall(f"SUB {topic} {channel}\nRDY 1000\n".encode())
        wire.expect(sock, b"OK", "SUB")
        bodies = []
        while len(bodies) < count:
            ftype, payload = wire.read_frame(sock)
            if ftype == wire.FRAME_MESSAGE:
                sock.sendall(b"FIN " + payload[10:26] + b"\n")
                bodies.append(payload[26:])
            elif ftype == wire.FRAME_RESPONSE and payload == wire.HEARTBEAT:
                sock.sendall(wire.NOP)
            elif ftype == wire.FRAME_ERROR:
                raise wire.ProtocolError(payload.decode(errors="replace"))
        return bodies
    finally:
        sock.close()


@contextlib.contextmanager
def running(kind: str, args: argparse.Namespace) -> Iterator[Broker]:
    broker = retaining_broker(args) if kind == OFFSETS else broker_for(kind, args)
    try:
        broker.start()
        if broker.http_address is None:
            raise BrokerError(f"{kind}: no 'HTTP: listening on' line:\n{broker.log_tail()}")
        yield broker
    finally:
        broker.stop()


# -- results -----------------------------------------------------------------------------------


@dataclass
class ThroughputRun:
    broker: str
    max_per_trigger: int
    messages: int
    seconds: float  # query start -> channel drained
    wall_rate: float
    steady_rate: float | None
    batches: int
    first_batch_s: float | None  # triggerExecution of the first non-empty batch
    durations_ms: dict[str, float] = field(default_factory=dict)  # median per non-empty batch
    prepublish_rate: float = 0.0
    load: float = 0.0


@dataclass
class LatencyRun:
    broker: str
    published: int
    received: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    load: float = 0.0


# -- throughput --------------------------------------------------------------------------------


def source_options(broker: Broker, args: argparse.Namespace, max_per_trigger: int,
                   checkpoint: str) -> dict[str, str]:
    address = f"{broker.address[0]}:{broker.address[1]}"
    options = {"topic": TOPIC, "channel": CHANNEL, "nsqd": address,
               "checkpointLocation": checkpoint, "maxMessagesPerTrigger": str(max_per_trigger)}
    if args.max_rdy:
        options["connectionsPerBroker"] = str(max(1, math.ceil(2 * max_per_trigger / args.max_rdy)))
    return options


def summarize_progress(progress: list) -> tuple[float | None, int, float | None, dict[str, float]]:
    """(steady rate, non-empty batches, first batch s, median durationMs per phase)."""
    full = [p for p in progress if p.numInputRows]
    if not full:
        return None, 0, None, {}
    first = full[0].durationMs.get("triggerExecution", 0) / 1000
    rest = full[1:] or full
    ms = sum(p.durationMs.get("triggerExecution", 0) for p in rest)
    steady = sum(p.numInputRows for p in rest) / (ms / 1000) if ms else None
    keys = sorted({k for p in rest for k in p.durationMs})
    phases = {k: statistics.median(p.durationMs.get(k, 0) for p in rest) for k in keys}
    return steady, len(full), first, phases


def throughput_run(spark, kind: str, args: argparse.Namespace, max_per_trigger: int,
                   messages: int) -> ThroughputRun:
    from pyspark.sql import functions as F

    with running(kind, args) as broker:
        wire.http_create(broker.http_address, TOPIC, CHANNEL)
        wire.http_create(broker.http_address, OUT_TOPIC, OUT_CHANNEL)
        pub_rate = prepublish(broker.address, TOPIC, messages, args.size)
        checkpoint = tempfile.mkdtemp(prefix="spark-stream-bench-")
        address = f"{broker.address[0]}:{broker.address[1]}"

        def each(batch_df, _batch_id: int) -> None:
            (batch_df.groupBy().count().select(F.col("count").cast("string").alias("body"))
             .write.format("mqd").option("nsqd", address).option("topic", OUT_TOPIC)
             .mode("append").save())

        reader = spark.readStream.format("mqd")
        for key, value in source_options(broker, args, max_per_trigger, checkpoint).items():
            reader = reader.option(key, value)
        try:
            t0 = now()
            query = (reader.load().writeStream.foreachBatch(each)
                     .option("checkpointLocation", checkpoint).start())
            try:
                deadline = t0 + args.timeout
                while True:
                    depth, in_flight = channel_counts(broker.http_address, TOPIC, CHANNEL)
                    if depth == 0 and in_flight == 0:
                        break
                    if not query.isActive:
                        raise BrokerError(f"query ended: {query.exception()}")
                    if now() > deadline:
                        raise BrokerError(f"not drained after {args.timeout:g} s "
                                          f"(depth {depth}, in flight {in_flight})")
                    time.sleep(0.05)
                seconds = now() - t0
                load = load_average()
            finally:
                query.stop()
            progress = query.recentProgress
        finally:
            shutil.rmtree(checkpoint, ignore_errors=True)
        out_depth, _ = channel_counts(broker.http_address, OUT_TOPIC, OUT_CHANNEL)
        counted = sum(int(b) for b in read_bodies(broker.address, OUT_TOPIC, OUT_CHANNEL, out_depth))
        if counted != messages:
            raise BrokerError(f"the sink's per-batch counts add up to {counted:,}, not {messages:,}")
    steady, batches, first, phases = summarize_progress(progress)
    return ThroughputRun(kind, max_per_trigger, messages, seconds, messages / seconds, steady,
                         batches, first, phases, pub_rate, load)


# -- latency -----------------------------------------------------------------------------------


def latency_run(spark, kind: str, args: argparse.Namespace) -> LatencyRun:
    """Publish -> sink latency through a query: a channel consumed (a broker's name), or OFFSETS (its log read)."""
    ctx = mp.get_context("spawn")
    with running(kind, args) as broker:
        wire.http_create(broker.http_address, TOPIC, *([] if kind == OFFSETS else [CHANNEL]))
        wire.http_create(broker.http_address, OUT_TOPIC, OUT_CHANNEL)
        address = f"{broker.address[0]}:{broker.address[1]}"
        checkpoint = tempfile.mkdtemp(prefix="spark-stream-lat-")
        per_trigger = max(10_000, 4 * int(args.rate))
        reader = spark.readStream.format("mqd")
        if kind == OFFSETS:
            # The log from what is published once the query runs; Spark keeps the offsets.
            options = {"topic": TOPIC, "nsqd": address, "startingOffsets": "latest"}
        else:
            options = source_options(broker, args, per_trigger, checkpoint)
        for key, value in options.items():
            reader = reader.option(key, value)
        expected = int(args.rate * args.seconds)
        queue = ctx.Queue()
        start = ctx.Event()
        progress = ctx.Array("q", 1, lock=False)
        rcfg = ReaderConfig(broker.address, OUT_TOPIC, OUT_CHANNEL, rdy=2500, duration=None,
                            expected=expected, idle_timeout=args.seconds + 30, sample_every=1,
                            client_id="latency")
        wcfg = WriterConfig(broker.address, TOPIC, size=args.size, batch=10, pipeline=8,
                            duration=args.seconds, rate=args.rate)
        procs = [ctx.Process(target=reader_main, args=(0, rcfg, queue, start, progress)),
                 ctx.Process(target=writer_main, args=(0, wcfg, queue, start))]
        query = None
        try:
            query = (reader.load().select("body").writeStream.format("mqd")
                     .option("nsqd", address).option("topic", OUT_TOPIC)
                     .option("checkpointLocation", checkpoint)
                     .trigger(processingTime="1 second").start())
            # Past the query's start-up: its first (empty) trigger has run.
            deadline = now() + 120
            while not query.recentProgress:
                if not query.isActive or now() > deadline:
                    raise BrokerError(f"query did not start: {query.exception()}")
                time.sleep(0.1)
            for p in procs:
                p.start()
            results: dict[str, dict] = {}
            ready = 0
            while ready < 2:
                what, who, data = queue.get(timeout=60)
                if what == "error":
                    raise BrokerError(data)
                ready += what == "ready"
            start.set()
            load_at = now() + args.seconds / 2
            load = load_average()
            while len(results) < 2:
                what, who, data = queue.get(timeout=args.seconds + 90)
                if what == "error":
                    raise BrokerError(data)
                if what == "result":
                    results[who] = data
                if now() >= load_at:
                    load = load_average()
        finally:
            for p in procs:
                if p.pid is not None:
                    p.join(10)
                    if p.is_alive():
                        p.kill()
            if query is not None:
                query.stop()
            shutil.rmtree(checkpoint, ignore_errors=True)
    lat = array("q")
    lat.frombytes(results["r0"]["latency_ns"])
    values = sorted(lat)
    published = results["w0"]["messages"]
    received = results["r0"]["messages"] + results["r0"]["late"]

    def ms(q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else v / 1e6

    return LatencyRun(kind, published, received, ms(0.50), ms(0.99), ms(1.0), load)


# -- the source without Spark -----------------------------------------------------------------


def source_loop(address: str, messages: int, max_per_trigger: int, max_rdy: int) -> dict:
    """Drive TopicStreamReader as Spark's driver would: offsets, WAL, partitions, commit.

    Reads the partitions' Arrow batches too (rows_of), as Spark's tasks would,
    so the loop covers the whole source minus Spark's own scheduling.
    """
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_bridge.stream_source import TopicStreamReader, rows_of

    checkpoint = tempfile.mkdtemp(prefix="spark-stream-src-")
    options = {"topic": TOPIC, "channel": CHANNEL, "nsqd": address,
               "checkpointLocation": checkpoint, "maxMessagesPerTrigger": str(max_per_trigger)}
    if max_rdy:
        options["connectionsPerBroker"] = str(max(1, math.ceil(2 * max_per_trigger / max_rdy)))
    phases = {"latestOffset": 0.0, "partitions": 0.0, "rows_of": 0.0, "commit": 0.0}
    reader = TopicStreamReader(options)
    t0 = now()
    try:
        start = reader.initialOffset()
        got = batches = 0
        idle = 0
        while got < messages:
            t = now()
            end = reader.latestOffset(start, ReadMaxRows(max_per_trigger))
            phases["latestOffset"] += now() - t
            if end == start:
                idle += 1
                time.sleep(0.01)
                continue
            t = now()
            parts = reader.partitions(start, end)
            phases["partitions"] += now() - t
            t = now()
            for p in parts:
                for b in rows_of(p.value):
                    got += b.num_rows
            phases["rows_of"] += now() - t
            t = now()
            reader.commit(end)
            phases["commit"] += now() - t
            batches += 1
            start = end
        seconds = now() - t0
    finally:
        reader.stop()
        shutil.rmtree(checkpoint, ignore_errors=True)
    return {"messages": got, "seconds": seconds, "rate": got / seconds, "batches": batches,
            "idle_polls": idle, "phases": phases}


def profile_source(args: argparse.Namespace) -> int:
    """The source's driver side alone on mqd: plain, under cProfile, under py-spy (a child)."""
    results = []
    mpt = args.max_per_trigger[0]
    for mode in ("plain", "cprofile", "py-spy"):
        pyspy = pyspy_path()
        if mode == "py-spy" and not os.path.exists(pyspy):
            print("py-spy not installed: skipped (pip install py-spy)")
            continue
        with running("mqd", args) as broker:
            wire.http_create(broker.http_address, TOPIC, CHANNEL)
            prepublish(broker.address, TOPIC, args.messages, args.size)
            address = f"{broker.address[0]}:{broker.address[1]}"
            if mode == "plain":
                r = source_loop(address, args.messages, mpt, args.max_rdy)
            elif mode == "cprofile":
                prof = cProfile.Profile()
                prof.enable()
                r = source_loop(address, args.messages, mpt, args.max_rdy)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
                print(out.getvalue())
                if args.profile_out:
                    prof.dump_stats(f"{args.profile_out}.pstats")
            else:
                path = f"{args.profile_out or tempfile.mktemp(prefix='spark-stream-')}.pyspy.txt"
                cmd = [pyspy, "record", "--rate", "200", "--format", "raw", "--threads",
                       "--subprocesses", "-o", path, "--", sys.executable, "-m", "bench", "spark-stream",
                       "_source-loop", address, str(args.messages), str(mpt), str(args.max_rdy)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode != 0 or not lines:
                    print(f"py-spy failed ({proc.returncode}): {proc.stderr[-2000:]}")
                    continue
                r = json.loads(lines[-1])
                print(f"py-spy samples: {path}")
                with open(path) as f:
                    print(thread_table(f.read()))
        r["mode"] = mode
        r["load"] = load_average()
        results.append(r)
        print(f"{mode}: {r['messages']:,} msgs in {r['seconds']:.2f} s = {r['rate']:,.0f} msgs/s, "
              f"{r['batches']} batches, phases " + ", ".join(
                  f"{k} {v:.2f} s" for k, v in r["phases"].items())
              + f", load {r['load']:.2f}", flush=True)
    return 0


# -- report ------------------------------------------------------------------------------------


def nsqd_version(path: str) -> str:
    try:
        return subprocess.run([path, "--version"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "nsqd"
    except OSError:
        return "nsqd"


def markdown(args: argparse.Namespace, header: dict, tput: list[ThroughputRun],
             lat: list[LatencyRun], offsets: list[OffsetRun] | None = None) -> str:
    rdy = (f"`--max-rdy-count={args.max_rdy}` on both brokers, source `connectionsPerBroker` = "
           f"ceil(2 x maxMessagesPerTrigger / {args.max_rdy})" if args.max_rdy
           else "brokers' default `--max-rdy-count` (2,500), the source's default connections")
    lines = [
        f"Spark streaming source/sink, {header['date']}, {header['machine']}, "
        f"Python {header['python']}, PySpark {header['pyspark']}, {header['nsqd']}, "
        f"spark_bridge from {header['spark_bridge']}",
        "",
        f"- `local[2]` (build_session), SparkSession start {header['session_s']:.1f} s "
        "(not in the rates); median of "
        f"{args.runs}; load average (1 min) at each run given as min-max of the runs",
    ]
    if header["brokers"]:
        lines.insert(2, f"- channel mode: mqd `--backend=memory --mem-queue-size={MEM_QUEUE_SIZE}`, nsqd "
                        f"`--mem-queue-size={MEM_QUEUE_SIZE}`; {rdy}; a fresh broker per run, brokers "
                        "alternating")
    if tput:
        lines += [
            f"- channel mode throughput: {args.messages:,} x {args.size} B pre-published by MPUB, query "
            "source -> foreachBatch(groupBy().count().write.format(\"mqd\")) (the per-batch "
            "counts read back add up to N); wall = N / (query start -> channel depth 0 and "
            "in flight 0); steady = rows / triggerExecution of the non-empty batches after the first",
            "",
            "| broker | maxMessagesPerTrigger | wall msgs/s | steady msgs/s | s to drain | batches "
            "| first batch s | median batch ms (latestOffset / addBatch / walCommit / commitOffsets) "
            "| load |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
    for mpt in args.max_per_trigger:
        for kind in header["brokers"]:
            runs = [r for r in tput if r.broker == kind and r.max_per_trigger == mpt]
            if not runs:
                continue
            ph = {k: median([r.durations_ms.get(k) for r in runs])
                  for k in ("latestOffset", "addBatch", "walCommit", "commitOffsets")}
            loads = [r.load for r in runs]
            lines.append(
                f"| {kind} | {mpt:,} | {fmt(median([r.wall_rate for r in runs]))} "
                f"| {fmt(median([r.steady_rate for r in runs]))} "
                f"| {fmt(median([r.seconds for r in runs]), '.1f')} "
                f"| {fmt(median([r.batches for r in runs]), '.0f')} "
                f"| {fmt(median([r.first_batch_s for r in runs]), '.1f')} "
                f"| {' / '.join(fmt(ph[k], '.0f') for k in ph)} "
                f"| {min(loads):.1f}-{max(loads):.1f} |")
    lines += offset_markdown(args, offsets or [])
    if lat:
        lines += [
            "",
            f"- latency: {args.rate:,.0f} msgs/s for {args.seconds:g} s (paced MPUB of 10, publish "
            "time in each body) -> query select(body) -> writeStream.format(\"mqd\"), "
            "trigger 1 s -> raw consumer on the output topic (arrival - publish time, every message); "
            f"`{OFFSETS}`: the source reads the topic's retained log by offset (no channel, "
            f"startingOffsets latest) on mqd `--backend={args.offset_backend} "
            f"--retention-bytes={args.retention_bytes}`",
            "",
            "| source | published | received | p50 ms | p99 ms | max ms | load |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for kind in header["latency"]:
            runs = [r for r in lat if r.broker == kind]
            if not runs:
                continue
            loads = [r.load for r in runs]
            lines.append(
                f"| {kind} | {fmt(median([r.published for r in runs]))} "
                f"| {fmt(median([r.received for r in runs]))} "
                f"| {fmt(median([r.p50_ms for r in runs]))} | {fmt(median([r.p99_ms for r in runs]))} "
                f"| {fmt(median([r.max_ms for r in runs]))} | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines)


def _alternating(runs: int, brokers: list[str], what: str, run, failures: list[str]):
    """(repetition, broker, result) of `run(broker)` for each broker `runs` times, the order
    alternating; a run that fails is noted in `failures` and skipped."""
    for rep in range(runs):
        for kind in brokers if rep % 2 == 0 else brokers[::-1]:
            try:
                result = run(kind)
            except (BrokerError, wire.ProtocolError, OSError) as exc:
                failures.append(f"{what} {kind} run {rep + 1}: {exc}")
                print(f"error: {failures[-1]}", file=sys.stderr, flush=True)
                continue
            yield rep, kind, result


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench spark-stream",
        description="Throughput and latency of the mqd Structured Streaming source and sink, "
        "on mqd and (if found) nsqd.")
    p.add_argument("--nsqd-bin", help="nsqd binary, or the directory of NSQ's binaries "
                   "(default: $NSQD_BIN, else nsqd on PATH; 'none' for mqd only)")
    p.add_argument("--messages", type=int, default=1_000_000, help="pre-published per throughput run")
    p.add_argument("--size", type=int, default=200, help="body bytes")
    p.add_argument("--runs", type=int, default=3, help="runs per broker and setting (median)")
    p.add_argument("--max-per-trigger", type=lambda s: [int(x) for x in s.split(",")],
                   default=[50_000, 100_000, 200_000], help="comma separated")
    p.add_argument("--max-rdy", type=int, default=200_000,
                   help="brokers' --max-rdy-count (0: their default, 2,500)")
    p.add_argument("--rate", type=float, default=5000.0, help="latency: msgs/s published")
    p.add_argument("--seconds", type=float, default=20.0, help="latency: seconds published")
    p.add_argument("--skip", choices=("throughput", "latency"), action="append", default=[])
    p.add_argument("--mode", choices=("channel", "offset"), action="append",
                   help="channel: the source consumes a channel (mqd, nsqd); offset: it reads the topic's "
                   "retained log by offset (mqd), beside a batch read and a snapshot's (default: both)")
    p.add_argument("--offset-backend", default="lmdb", help="offset mode: the retaining mqd's --backend")
    p.add_argument("--retention-bytes", default="10GB", help="offset mode: the mqd's --retention-bytes")
    p.add_argument("--offset-warmup", type=int, default=3,
                   help="offset mode: untimed rounds of its three reads before the first timed one")
    p.add_argument("--max-offsets-per-trigger", type=int, default=0,
                   help="offset mode: the stream's maxOffsetsPerTrigger (0: none, one micro-batch)")
    p.add_argument("--timeout", type=float, default=600.0, help="per throughput run")
    p.add_argument("--profile-source", action="store_true",
                   help="profile TopicStreamReader without Spark instead (mqd only)")
    p.add_argument("--profile-out", help="with --profile-source: file prefix for the profiles")
    p.add_argument("--json", metavar="PATH", help="also write every run as JSON")
    p.add_argument("--tree", help="import spark_bridge from this directory instead (e.g. a patched "
                   "copy), here and in Spark's Python workers (through PYTHONPATH)")
    args = p.parse_args(argv)
    args.mode = args.mode or ["channel", "offset"]
    value = args.nsqd_bin or os.environ.get(NSQD_BIN_ENV) or shutil.which("nsqd") or "none"
    try:
        args.nsqd_bin = find_nsqd(value)
    except ValueError as exc:
        p.error(f"--nsqd-bin: {exc}")
    return args


def use_tree(tree: str) -> None:
    """spark_bridge from `tree` first, in this process and in every process started after."""
    tree = os.path.abspath(tree)
    if not os.path.isdir(os.path.join(tree, "spark_bridge")):
        raise SystemExit(f"--tree: no spark_bridge package in {tree}")
    sys.path.insert(0, tree)
    sys.path.append(str(REPO))  # bench itself, once '' means the tree
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH"),
                                                             str(REPO)]))
    # Spark's Python processes run `python -m ...` in the JVM's directory, which comes
    # first on their path: it must be the tree, not this checkout.
    os.chdir(tree)


def main(argv: list[str]) -> int:
    if argv[:1] == ["_source-loop"]:  # the py-spy child of --profile-source
        address, messages, mpt, max_rdy = argv[1], *map(int, argv[2:5])
        print(json.dumps(source_loop(address, messages, mpt, max_rdy)), flush=True)
        return 0
    args = parse(argv)
    if args.tree:
        use_tree(args.tree)
    if args.profile_source:
        return profile_source(args)
    import pyspark

    from spark_bridge.session import build_session

    channel = "channel" in args.mode
    brokers = ["mqd"] + (["nsqd"] if args.nsqd_bin else []) if channel else []
    t = now()
    spark = build_session("local[2]", conf={"spark.ui.enabled": "false"})
    session_s = now() - t
    header = {
        "date": today(), "machine": machine(),
        "python": platform.python_version(), "pyspark": pyspark.__version__,
        "nsqd": nsqd_version(args.nsqd_bin) if args.nsqd_bin else "no nsqd",
        "session_s": session_s, "brokers": brokers,
        "latency": brokers + ([OFFSETS] if "offset" in args.mode else []),
        "spark_bridge": os.path.dirname(os.path.dirname(sys.modules["spark_bridge"].__file__)),
    }
    print(f"SparkSession local[2] in {session_s:.1f} s; load {load_average():.2f}", flush=True)
    if args.tree:
        worker = spark.sparkContext.parallelize([0], 1).map(
            lambda _: __import__("spark_bridge").__file__).collect()[0]
        print(f"spark_bridge in Spark's Python workers: {worker}", flush=True)
        if not worker.startswith(os.path.abspath(args.tree)):
            raise SystemExit("--tree: Spark's workers do not import spark_bridge from it")
    tput: list[ThroughputRun] = []
    lat: list[LatencyRun] = []
    offsets: list[OffsetRun] = []
    failures: list[str] = []
    try:
        if channel:
            # Untimed: the first query of a session starts Spark's Python workers.
            r = throughput_run(spark, "mqd", args, args.max_per_trigger[0], 20_000)
            print(f"warm-up: 20,000 in {r.seconds:.1f} s", flush=True)
        if "throughput" not in args.skip and "offset" in args.mode:
            offsets = offset_reads(spark, args, failures)
        if "throughput" not in args.skip and channel:
            for mpt in args.max_per_trigger:
                def run(kind, mpt=mpt):
                    return throughput_run(spark, kind, args, mpt, args.messages)
                for rep, kind, r in _alternating(args.runs, brokers, f"throughput {mpt}", run,
                                                 failures):
                    tput.append(r)
                    print(f"{kind:<4} mpt {mpt:>7,} run {rep + 1}: {r.wall_rate:>9,.0f} msgs/s "
                          f"wall ({r.seconds:.1f} s), steady {fmt(r.steady_rate)}, "
                          f"{r.batches} batches, first {fmt(r.first_batch_s, '.1f')} s, "
                          f"phases {json.dumps({k: round(v) for k, v in r.durations_ms.items()})}"
                          f", load {r.load:.2f}", flush=True)
        if "latency" not in args.skip:
            if "offset" in args.mode and not offsets:
                # Untimed: the offset source's first read in this session (its modules, the JIT).
                print(f"offset warm-up: 20,000 in {offset_warmup(spark, args):.1f} s", flush=True)
            for rep, kind, r in _alternating(args.runs, header["latency"], "latency",
                                             lambda kind: latency_run(spark, kind, args), failures):
                lat.append(r)
                print(f"{kind:<4} latency run {rep + 1}: {r.received:,}/{r.published:,} "
                      f"p50 {fmt(r.p50_ms)} ms p99 {fmt(r.p99_ms)} ms max {fmt(r.max_ms)} ms, "
                      f"load {r.load:.2f}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        spark.stop()
    print()
    print(markdown(args, header, tput, lat, offsets))
    if failures:
        print("\nfailed runs (left out of the medians):\n  " + "\n  ".join(failures))
    if args.json:
        save_json(args.json, args, throughput=tput, latency=lat, offsets=offsets, header=header,
                  failures=failures)
    return 1 if failures else 0
