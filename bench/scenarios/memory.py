"""``python -m bench memory``: RSS per queued message held in memory, and where those bytes go.

Two views of the same figure:

- **broker**: a memory-backend twistd broker with a ``--mem-queue-size`` larger
  than the backlog gets N messages (MPUB, untimed) on one topic with 1, 2, ...
  channels; its RSS (and RssAnon, anonymous memory only) is read after the
  topic and channels exist, after a warm-up on another topic (so allocator
  arenas, buffers and code paths are already paid for), once /stats shows depth
  N on every channel, and again 2 s later (after the reactor's idle GC). The
  growth over the warm baseline divided by N is the cost of a queued message;
  the difference between 1 and 2 channels is what one more channel adds.
- **objects**: the same messages built in this process the way the broker
  builds them (``walk_binary`` slices of an MPUB, ``IdFactory`` ids,
  ``Message``, a channel's ``OverflowQueue``; ``Message.copy`` for the next
  channel), measured object by object with ``sys.getsizeof``, pymalloc's
  16-byte size classes, tracemalloc and this process's RSS growth.

nsqd's figure is derived from its reference run under NSQ's benchmark
conditions (nsqd 1.3.0): 1.2-1.4 GB of peak RSS with a 4 M message backlog of
which 1.6-1.8 M had spilled to disk, so 2.2-2.4 M messages in memory. Peak RSS includes the Go runtime and up to GOGC=100's
garbage headroom, so it is an estimate (an upper one) of nsqd's per-message
cost, not a measurement under these conditions.

``python -m bench memory peaks`` (memory_peaks.py) measures instead how much
one request or one kind of client makes a broker grow.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import struct
import sys
import time
import tracemalloc
from dataclasses import dataclass, field

from bench.harness import wire
from bench.harness.broker import Broker, BrokerError, proc_memory
from bench.harness.load import fill
from bench.harness.report import heading, save_json
from bench.scenarios import memory_peaks

TOPIC = "mem"
WARM_TOPIC = "mem_warm"

# nsqd 1.3.0's reference run: peak RSS 1.2-1.4 GB, 4 M backlog, 1.6-1.8 M of it on disk.
NSQD_RSS_GB = (1.2, 1.4)
NSQD_BACKLOG = 4_000_000
NSQD_ON_DISK = (1_600_000, 1_800_000)


def pymalloc_block(size: int) -> int:
    """Bytes an object of ``size`` really takes: pymalloc's 16-byte classes up to 512 B.

    Larger objects go to the system malloc (16-byte aligned, plus its own
    8-byte header), counted the same way here.
    """
    if size <= 512:
        return (size + 15) // 16 * 16
    return (size + 8 + 15) // 16 * 16


def per_message(before_kb: float, after_kb: float, count: int) -> float:
    """Bytes per message of an RSS growth given in kB."""
    return (after_kb - before_kb) * 1024 / count if count else 0.0


def nsqd_estimate() -> tuple[float, float, float]:
    """(low, middle, high) bytes per in-memory message from nsqd's reference figures.

    Low: the smallest RSS over the most messages in memory; high: the reverse.
    """
    in_mem = [NSQD_BACKLOG - d for d in NSQD_ON_DISK]  # 2.4 M, 2.2 M
    low = NSQD_RSS_GB[0] * 1e9 / max(in_mem)
    high = NSQD_RSS_GB[1] * 1e9 / min(in_mem)
    mid = sum(NSQD_RSS_GB) / 2 * 1e9 / (sum(in_mem) / 2)
    return low, mid, high


# -- the broker ----------------------------------------------------------------


@dataclass
class BrokerRun:
    channels: int
    count: int
    readings: dict[str, dict[str, int]] = field(default_factory=dict)  # step -> proc_memory
    fill_seconds: float = 0.0

    def bytes_per_msg(self, key: str = "VmRSS", step: str = "settled") -> float:
        return per_message(self.readings["warm"][key], self.readings[step][key], self.count)


def broker_run(args: argparse.Namespace, channels: int) -> BrokerRun:
    """One fresh broker, ``channels`` channels on the topic, ``args.count`` messages."""
    run = BrokerRun(channels, args.count)
    size = max(args.count, args.warmup) * 2
    broker = Broker("memory", size, args.broker_arg, keep=False)
    try:
        address = broker.start()
        http = broker.http_address
        if http is None:
            raise BrokerError("the broker logged no HTTP address")
        names = [f"c{i}" for i in range(channels)]
        wire.http_create(http, TOPIC, *names)
        wire.http_create(http, WARM_TOPIC, "w")
        run.readings["created"] = proc_memory(broker.pid)
        if args.warmup:
            fill(address, WARM_TOPIC, args.warmup, args.size, args.batch)
            wire.http_request(http, "/topic/delete", "POST", timeout=60, topic=WARM_TOPIC)
            time.sleep(1.0)
        run.readings["warm"] = proc_memory(broker.pid)
        t0 = time.monotonic()
        fill(address, TOPIC, args.count, args.size, args.batch)
        run.fill_seconds = time.monotonic() - t0
        deadline = time.monotonic() + 120
        while True:
            stats = json.loads(wire.http_request(http, "/stats", timeout=60, format="json", topic=TOPIC))
            depths = [wire.channel_counts(stats, TOPIC, c) for c in names]
            if all(d is not None and d[0] == args.count for d in depths):
                break
            if time.monotonic() > deadline:
                raise BrokerError(f"channel depths {depths}, expected {args.count:,} each")
            time.sleep(0.1)
        run.readings["full"] = proc_memory(broker.pid)
        time.sleep(2.0)
        run.readings["settled"] = proc_memory(broker.pid)
    finally:
        broker.stop()
    return run


# -- the objects ---------------------------------------------------------------


def _mpub_payload(count: int, size: int) -> bytes:
    body = b"x" * size
    return struct.pack(">i", count) + (wire.SIZE.pack(size) + body) * count


def _build(count: int, size: int, batch: int) -> list:
    """Two channels' queues of ``count`` messages, made as MPUB + Topic._fan_out make them."""
    from backends.memory import MemoryQueue
    from mqd.message import IdFactory, Message
    from mqd.nsqd.batches import walk_binary
    from mqd.nsqd.overflow import OverflowQueue

    ids_factory = IdFactory(1)
    queues = [OverflowQueue(count * 2, MemoryQueue(f"{TOPIC}:c{i}")) for i in range(2)]
    now_ns = time.time_ns()
    payload = _mpub_payload(batch, size)
    for _ in range(count // batch):
        bodies: list[bytes] = []
        walk_binary(payload, 4, len(payload), 0, batch, 1 << 20, bodies)
        ts = now_ns  # one int per publish, shared by its messages
        now_ns += 1_000_000
        ids = ids_factory.new_ids(batch, ts)
        queues[0].put([Message(i, b, ts) for i, b in zip(ids, bodies, strict=True)])
    return queues


def _copy_to_second(queues: list) -> None:
    """The second channel's copies (``Message.copy``: own object, shared id and body)."""
    append = queues[1].mem.append
    for msg in queues[0].mem:
        append(msg.copy())


def object_breakdown(count: int, size: int, batch: int) -> dict:
    """Per-message bytes of what a queued message holds, built as the broker builds it.

    Built twice: once for this process's RSS growth, once under tracemalloc
    (whose own bookkeeping would inflate the RSS figure).
    """
    n = (count // batch) * batch
    gc.collect()
    rss0 = proc_memory(os.getpid())["VmRSS"]
    queues = _build(count, size, batch)
    rss1 = proc_memory(os.getpid())["VmRSS"]
    _copy_to_second(queues)
    rss2 = proc_memory(os.getpid())["VmRSS"]

    sample = queues[0].mem[0]
    parts = {
        "Message (9 slots + GC header)": sys.getsizeof(sample),
        f"body bytes ({size} B)": sys.getsizeof(sample.body),
        "id bytes (16 hex digits)": sys.getsizeof(sample.id),
        "timestamp int (one per batch)": sys.getsizeof(sample.timestamp) / batch,
        "deque slot": sys.getsizeof(queues[0].mem) / len(queues[0].mem),
    }
    blocks = {
        k: (pymalloc_block(v) if k.startswith(("Message", "body", "id")) else v)
        for k, v in parts.items()
    }
    copy_parts = {"Message copy": sys.getsizeof(sample), "deque slot": parts["deque slot"]}
    del queues, sample
    gc.collect()

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    queues = _build(count, size, batch)
    first = tracemalloc.get_traced_memory()[0]
    _copy_to_second(queues)
    second = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del queues
    return {
        "count": n,
        "getsizeof": parts,
        "getsizeof_total": sum(parts.values()),
        "pymalloc": blocks,
        "pymalloc_total": sum(blocks.values()),
        "copy_getsizeof": copy_parts,
        "copy_pymalloc_total": pymalloc_block(copy_parts["Message copy"]) + copy_parts["deque slot"],
        "tracemalloc_first": (first - base) / n,
        "tracemalloc_second": (second - first) / n,
        "rss_first": per_message(rss0, rss1, n),
        "rss_second": per_message(rss1, rss2, n),
    }


# -- report ---------------------------------------------------------------------


def report(runs: list[BrokerRun], objects: dict | None, args: argparse.Namespace) -> str:
    low, mid, high = nsqd_estimate()
    lines = [
        heading("mqd memory per queued message"),
        "",
        f"- broker: twistd mqd --backend=memory --mem-queue-size=2x the backlog; "
        f"{args.count:,} messages of {args.size} B by MPUB x{args.batch}; warm-up "
        f"{args.warmup:,} messages on another topic, deleted before the baseline",
        "",
        "| channels | RSS warm (MB) | RSS full (MB) | RSS settled (MB) | bytes/msg RSS "
        "| bytes/msg RssAnon | per channel added (RSS) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    prev: BrokerRun | None = None
    for r in runs:
        added = "-"
        if prev is not None:
            added = f"{(r.bytes_per_msg() - prev.bytes_per_msg()) / (r.channels - prev.channels):,.0f}"
        lines.append(
            f"| {r.channels} | {r.readings['warm']['VmRSS'] / 1024:,.0f} "
            f"| {r.readings['full']['VmRSS'] / 1024:,.0f} "
            f"| {r.readings['settled']['VmRSS'] / 1024:,.0f} | {r.bytes_per_msg():,.0f} "
            f"| {r.bytes_per_msg('RssAnon'):,.0f} | {added} |"
        )
        prev = r
    lines += [
        "",
        f"nsqd 1.3.0 (estimate from its reference run: {NSQD_RSS_GB[0]}-{NSQD_RSS_GB[1]} GB peak RSS for "
        f"{NSQD_BACKLOG / 1e6:.0f} M messages, {NSQD_ON_DISK[0] / 1e6:.1f}-"
        f"{NSQD_ON_DISK[1] / 1e6:.1f} M of them on disk, so 2.2-2.4 M in memory, one channel): "
        f"{low:,.0f}-{high:,.0f} bytes/msg, ~{mid:,.0f} in the middle; peak RSS includes the "
        "Go runtime and GC headroom, so this is an upper estimate.",
    ]
    if objects:
        lines += [
            "",
            f"Where a queued message's bytes go ({objects['count']:,} messages built in-process "
            "as the broker builds them):",
            "",
            "| object | sys.getsizeof | pymalloc block |",
            "|---|---:|---:|",
        ]
        for k, v in objects["getsizeof"].items():
            lines.append(f"| {k} | {v:,.1f} | {objects['pymalloc'][k]:,.1f} |")
        lines += [
            f"| **first channel** | {objects['getsizeof_total']:,.1f} "
            f"| {objects['pymalloc_total']:,.1f} |",
            f"| **each further channel** (Message copy + deque slot; body and id shared) "
            f"| {sum(objects['copy_getsizeof'].values()):,.1f} "
            f"| {objects['copy_pymalloc_total']:,.1f} |",
            "",
            f"tracemalloc: {objects['tracemalloc_first']:,.0f} B/msg first channel, "
            f"{objects['tracemalloc_second']:,.0f} B/msg second; this process's RSS growth: "
            f"{objects['rss_first']:,.0f} / {objects['rss_second']:,.0f} B/msg.",
        ]
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench memory",
        description="RSS per queued message held in memory (memory backend), per channel, "
        "beside nsqd's estimate, and an in-process breakdown by object",
    )
    p.add_argument("--count", type=int, default=1_000_000, help="messages queued")
    p.add_argument("--size", type=int, default=200, help="body bytes")
    p.add_argument("--batch", type=int, default=200, help="messages per MPUB (NSQ's bench: 200)")
    p.add_argument("--channels", default="1,2", help="channel counts to measure, one broker each")
    p.add_argument("--warmup", type=int, default=50_000, help="messages of the warm-up")
    p.add_argument(
        "--breakdown-count", type=int, default=200_000,
        help="messages built in-process for the per-object breakdown (0: skip)",
    )
    p.add_argument("--broker-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        args.channels = sorted({int(x) for x in args.channels.split(",") if x})
    except ValueError:
        p.error("--channels: comma-separated counts")
    if not args.channels or min(args.channels) < 1:
        p.error("--channels: counts of at least 1")
    if args.count < 1 or args.size < 8 or args.batch < 1:
        p.error("--count and --batch must be positive, --size at least 8")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["peaks"]:
        return memory_peaks.main(argv[1:])
    args = parse(argv)
    runs: list[BrokerRun] = []
    for c in args.channels:
        print(f"broker with {c} channel(s): {args.count:,} x {args.size} B ...", flush=True)
        r = broker_run(args, c)
        runs.append(r)
        for step in ("created", "warm", "full", "settled"):
            m = r.readings[step]
            print(f"  {step:<8} RSS {m['VmRSS'] / 1024:8,.1f} MB  RssAnon "
                  f"{m['RssAnon'] / 1024:8,.1f} MB", flush=True)
        print(f"  fill {r.fill_seconds:.1f} s; {r.bytes_per_msg():,.0f} B/msg RSS, "
              f"{r.bytes_per_msg('RssAnon'):,.0f} B/msg RssAnon "
              f"(full, before the 2 s settle: {r.bytes_per_msg(step='full'):,.0f})", flush=True)
    objects = None
    if args.breakdown_count:
        objects = object_breakdown(args.breakdown_count, args.size, args.batch)
    print()
    print(report(runs, objects, args))
    if args.json:
        save_json(args.json, args, runs=runs, objects=objects, nsqd_estimate=nsqd_estimate())
    return 0
