"""``python -m bench memory``: RSS per queued message held in memory, and where those bytes go.

Three views of the same figure:

- **mqd**: a memory-backend twistd broker with a ``--mem-queue-size`` larger
  than the backlog gets N messages (MPUB, untimed) on one topic with 1, 2, ...
  channels; its RSS (and RssAnon, anonymous memory only) is read after the
  topic and channels exist, after a warm-up on another topic (so allocator
  arenas, buffers and code paths are already paid for), once /stats shows depth
  N on every channel, and again 2 s later (after the reactor's idle GC). The
  growth over the warm baseline divided by N is the cost of a queued message;
  the difference between 1 and 2 channels is what one more channel adds.
- **nsqd**: with ``--nsqd-bin`` (default: ``$NSQD_BIN``, else NSQ's binaries
  beside the checkout, if there; ``none`` to skip) a real nsqd gets the same
  run, alternating with mqd per channel count: the same ``--mem-queue-size``
  (larger than the backlog, so it stays in its in-memory Go channels), topic
  and channels created over HTTP before anything is published (so every
  channel holds the whole backlog), the same warm-up, count, body size and
  batch, and RSS read from /proc/PID at the same steps. Its RSS includes the
  Go runtime's garbage not yet collected (GOGC=100 lets the heap grow to twice
  the live data before a collection), which is part of what it costs to hold
  a backlog. One difference, for Go's collector: the warm-up's messages are
  collected (through Go's pprof heap endpoint, ``gc=1``) before the
  baseline, as mqd's refcounting frees them at once; left to the next
  collection, which the fill would trigger, they would inflate the baseline
  and shrink nsqd's figure. The topic is deleted before nsqd is stopped,
  because nsqd writes its in-memory backlog to disk on SIGTERM.
- **objects**: the same messages built in this process the way the broker
  builds them (``walk_binary`` slices of an MPUB, ``IdFactory`` ids,
  ``Message``, a channel's ``OverflowQueue``; ``Message.copy`` for the next
  channel), measured object by object with ``sys.getsizeof``, pymalloc's
  16-byte size classes, tracemalloc and this process's RSS growth.

Both brokers' baselines are read once their RSS stops moving after the
warm-up topic is deleted.

Without a real nsqd, its figure is derived from its reference run under
NSQ's benchmark conditions (nsqd 1.3.0): 1.2-1.4 GB of peak RSS with a 4 M
message backlog of which 1.6-1.8 M had spilled to disk, so 2.2-2.4 M messages
in memory. Peak RSS includes the Go runtime and up to GOGC=100's garbage
headroom, so it is an estimate (an upper one) of nsqd's per-message cost, not
a measurement under these conditions.

``python -m bench memory peaks`` (memory_peaks.py) measures instead how much
one request or one kind of client makes a broker grow.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import struct
import sys
import time
import tracemalloc
from dataclasses import dataclass, field

from bench.harness import wire
from bench.harness.broker import Broker, BrokerError, find_nsqd, nsqd_command, proc_memory
from bench.harness.load import fill
from bench.harness.report import heading, save_json
from bench.scenarios import memory_peaks
from bench.scenarios.compare import nsqd_version

TOPIC = "mem"
WARM_TOPIC = "mem_warm"
WARM_PAUSE = 1.0  # s at least after deleting the warm-up topic, before the baseline
STEADY_LIMIT = 30.0  # s at most waiting for the baseline RSS to stop moving
STEADY_KB = 256  # kB: RSS that moved less than this in STEADY_INTERVAL is steady
STEADY_INTERVAL = 0.5
SETTLE = 2.0  # s between the "full" and the "settled" reading
DEPTH_TIMEOUT = 120.0  # s for every channel to show the whole backlog in /stats

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
    broker: str = "mqd"  # or "nsqd"

    def bytes_per_msg(self, key: str = "VmRSS", step: str = "settled") -> float:
        return per_message(self.readings["warm"][key], self.readings[step][key], self.count)


def queue_size(args: argparse.Namespace) -> int:
    """Both brokers' ``--mem-queue-size``: twice the larger of backlog and warm-up, so none spills."""
    return max(args.count, args.warmup) * 2


def make_broker(name: str, args: argparse.Namespace) -> Broker:
    """A fresh mqd (memory backend, ``--broker-arg``) or, for ``nsqd``, the real nsqd of ``args.nsqd``."""
    if name == "nsqd":
        return Broker(argv=nsqd_command(args.nsqd, queue_size(args)))
    return Broker("memory", queue_size(args), args.broker_arg, keep=False)


def force_gc(http: str) -> bool:
    """Make a Go broker collect its garbage now; False if it does not serve Go's heap profile.

    nsqd serves Go's net/http/pprof, whose heap profile with ``gc=1`` runs a
    collection first. Python's refcounting frees at once, so mqd needs none.
    """
    try:
        wire.http_request(http, "/debug/pprof/heap", timeout=60, gc="1")
    except OSError:
        return False
    return True


def steady_memory(pid: int) -> dict[str, int]:
    """proc_memory of ``pid`` once its RSS stops moving (at least WARM_PAUSE s, at most STEADY_LIMIT).

    A Go runtime hands freed pages back to the kernel over a few seconds
    after a collection; a baseline read before that would be too high.
    """
    time.sleep(WARM_PAUSE)
    last = proc_memory(pid)
    deadline = time.monotonic() + STEADY_LIMIT
    while time.monotonic() < deadline:
        time.sleep(STEADY_INTERVAL)
        now = proc_memory(pid)
        if abs(now["VmRSS"] - last["VmRSS"]) < STEADY_KB:
            return now
        last = now
    return last


def broker_run(args: argparse.Namespace, channels: int, name: str = "mqd") -> BrokerRun:
    """One fresh broker (mqd or nsqd), ``channels`` channels on the topic, ``args.count`` messages."""
    run = BrokerRun(channels, args.count, broker=name)
    broker = make_broker(name, args)
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
            if name == "nsqd":
                force_gc(http)  # see the module docstring
            run.readings["warm"] = steady_memory(broker.pid)
        else:
            run.readings["warm"] = proc_memory(broker.pid)
        t0 = time.monotonic()
        fill(address, TOPIC, args.count, args.size, args.batch)
        run.fill_seconds = time.monotonic() - t0
        deadline = time.monotonic() + DEPTH_TIMEOUT
        while True:
            stats = json.loads(wire.http_request(http, "/stats", timeout=60, format="json", topic=TOPIC))
            depths = [wire.channel_counts(stats, TOPIC, c) for c in names]
            if all(d is not None and d[0] == args.count for d in depths):
                break
            if time.monotonic() > deadline:
                raise BrokerError(f"channel depths {depths}, expected {args.count:,} each")
            time.sleep(0.1)
        run.readings["full"] = proc_memory(broker.pid)
        time.sleep(SETTLE)
        run.readings["settled"] = proc_memory(broker.pid)
        if name == "nsqd":
            # Measured; spare nsqd writing the backlog to disk on SIGTERM.
            with contextlib.suppress(OSError):
                wire.http_request(http, "/topic/delete", "POST", timeout=60, topic=TOPIC)
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
    """The second channel's copies, as ``Topic._fan_out`` makes them (``channel_copies``).

    Each is an object of its own sharing id and body; the first copy of a
    message also makes the id key that all its copies share.
    """
    from mqd.message import channel_copies

    queues[1].mem.extend(channel_copies(list(queues[0].mem)))


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
        "Message (6 slots + GC header)": sys.getsizeof(sample),
        f"data bytes (16-digit id + {size} B body)": sys.getsizeof(sample.data),
        "timestamp int (one per batch)": sys.getsizeof(sample.timestamp) / batch,
        "deque slot": sys.getsizeof(queues[0].mem) / len(queues[0].mem),
    }
    blocks = {
        k: (pymalloc_block(v) if k.startswith(("Message", "data")) else v)
        for k, v in parts.items()
    }
    copy_parts = {"Message copy": sys.getsizeof(sample), "deque slot": parts["deque slot"]}
    id_key = pymalloc_block(sys.getsizeof(sample.id_key))
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
        "id_key_pymalloc": id_key,
        "tracemalloc_first": (first - base) / n,
        "tracemalloc_second": (second - first) / n,
        "rss_first": per_message(rss0, rss1, n),
        "rss_second": per_message(rss1, rss2, n),
    }


# -- report ---------------------------------------------------------------------


def comparison(runs: list[BrokerRun]) -> list[tuple[int, float | None, float | None]]:
    """(channels, mqd B/msg, nsqd B/msg) per channel count, settled RSS; None where not measured."""
    table: dict[int, dict[str, float]] = {}
    for r in runs:
        table.setdefault(r.channels, {})[r.broker] = r.bytes_per_msg()
    return [(c, table[c].get("mqd"), table[c].get("nsqd")) for c in sorted(table)]


def comparison_table(runs: list[BrokerRun]) -> list[str]:
    """The markdown table channels | mqd B/msg | nsqd B/msg | mqd ÷ nsqd."""
    lines = ["| channels | mqd B/msg | nsqd B/msg | mqd ÷ nsqd |", "|---:|---:|---:|---:|"]
    for channels, mqd, nsqd in comparison(runs):
        quotient = f"{mqd / nsqd:.2f}" if mqd is not None and nsqd else "-"
        lines.append(
            f"| {channels} | {'-' if mqd is None else f'{mqd:,.0f}'} "
            f"| {'-' if nsqd is None else f'{nsqd:,.0f}'} | {quotient} |"
        )
    return lines


def report(
    runs: list[BrokerRun], objects: dict | None, args: argparse.Namespace, nsqd_desc: str = ""
) -> str:
    low, mid, high = nsqd_estimate()
    measured_nsqd = any(r.broker == "nsqd" for r in runs)
    lines = [
        heading("mqd memory per queued message"),
        "",
        f"- mqd: twistd mqd --backend=memory --mem-queue-size={queue_size(args):,}"
        + (f" {' '.join(args.broker_arg)}" if args.broker_arg else ""),
    ]
    if measured_nsqd:
        lines.append(f"- nsqd: {nsqd_desc or args.nsqd} --mem-queue-size={queue_size(args):,}")
    lines += [
        f"- load: {args.count:,} messages of {args.size} B by MPUB x{args.batch} on one topic whose "
        f"channels exist before the first publish; warm-up {args.warmup:,} messages on another "
        "topic, deleted before the baseline (read once RSS is steady"
        + ("; nsqd's garbage collected first" if measured_nsqd else "")
        + "); RSS growth over that baseline once every channel holds the backlog, read "
        f"{SETTLE:g} s later",
        "",
        "| broker | channels | RSS warm (MB) | RSS full (MB) | RSS settled (MB) | bytes/msg RSS "
        "| bytes/msg RssAnon | per channel added (RSS) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("mqd", "nsqd"):
        prev: BrokerRun | None = None
        for r in (r for r in runs if r.broker == name):
            added = "-"
            if prev is not None:
                added = (
                    f"{(r.bytes_per_msg() - prev.bytes_per_msg()) / (r.channels - prev.channels):,.0f}"
                )
            lines.append(
                f"| {name} | {r.channels} | {r.readings['warm']['VmRSS'] / 1024:,.0f} "
                f"| {r.readings['full']['VmRSS'] / 1024:,.0f} "
                f"| {r.readings['settled']['VmRSS'] / 1024:,.0f} | {r.bytes_per_msg():,.0f} "
                f"| {r.bytes_per_msg('RssAnon'):,.0f} | {added} |"
            )
            prev = r
    if measured_nsqd:
        lines += [
            "",
            "Side by side (settled RSS growth per queued message):",
            "",
            *comparison_table(runs),
        ]
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
            f"| id key (made once, by the first copy, and shared by all copies) "
            f"| - | {objects['id_key_pymalloc']:,.1f} |",
            f"| **each further channel** (Message copy + deque slot; id and body shared) "
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
        "beside a real nsqd measured the same way (or nsqd's estimate), and an in-process "
        "breakdown by object",
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
    p.add_argument("--broker-arg", action="append", default=[], metavar="ARG", help="mqd only")
    p.add_argument(
        "--nsqd-bin", "--nsqd", dest="nsqd", metavar="PATH",
        help="a real nsqd (or the directory of NSQ's binaries) measured the same way, "
        "alternating with mqd (default: $NSQD_BIN, else NSQ's binaries beside the checkout "
        "if there; 'none': mqd only)",
    )
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
    try:
        args.nsqd = find_nsqd(args.nsqd, use_beside=True)
    except ValueError as exc:
        p.error(f"--nsqd-bin: {exc}")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["peaks"]:
        return memory_peaks.main(argv[1:])
    args = parse(argv)
    nsqd_desc = nsqd_version(args.nsqd) if args.nsqd else ""
    names = ("mqd", "nsqd") if args.nsqd else ("mqd",)
    runs: list[BrokerRun] = []
    for c in args.channels:
        for name in names:
            print(f"{name} with {c} channel(s): {args.count:,} x {args.size} B ...", flush=True)
            r = broker_run(args, c, name)
            runs.append(r)
            for step in ("created", "warm", "full", "settled"):
                m = r.readings[step]
                print(f"  {step:<8} RSS {m['VmRSS'] / 1024:8,.1f} MB  RssAnon "
                      f"{m['RssAnon'] / 1024:8,.1f} MB", flush=True)
            print(f"  fill {r.fill_seconds:.1f} s; {r.bytes_per_msg():,.0f} B/msg RSS, "
                  f"{r.bytes_per_msg('RssAnon'):,.0f} B/msg RssAnon "
                  f"(full, before the {SETTLE:g} s settle: {r.bytes_per_msg(step='full'):,.0f})",
                  flush=True)
    objects = None
    if args.breakdown_count:
        objects = object_breakdown(args.breakdown_count, args.size, args.batch)
    print()
    print(report(runs, objects, args, nsqd_desc))
    if args.json:
        save_json(args.json, args, runs=runs, objects=objects, nsqd_estimate=nsqd_estimate(),
                  nsqd_version=nsqd_desc or None, comparison=comparison(runs))
    return 0
