"""RSS per queued message held in memory, and where those bytes go (issue #17).

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

nsqd's figure is derived from BENCH.md's reference: 1.2-1.4 GB of peak RSS with
a 4 M message backlog of which 1.6-1.8 M had spilled to disk, so 2.2-2.4 M
messages in memory. Peak RSS includes the Go runtime and up to GOGC=100's
garbage headroom, so it is an estimate (an upper one) of nsqd's per-message
cost, not a measurement under these conditions.

``python -m bench memory peaks`` measures instead how much one request or one
kind of client makes a broker grow (peak RSS, peak RssAnon, what is left
after): one huge MPUB, one huge text /mpub, consumers that never read; with
``--nsqd PATH`` the same scenarios on nsqd, alternating, in the same session.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import struct
import sys
import time
import tracemalloc
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import wire
from bench.broker import Broker, BrokerError
from bench.client import channel_counts
from bench.run import machine, save_json
from bench.writer import WriterConfig, publish

TOPIC = "mem"
WARM_TOPIC = "mem_warm"

# BENCH.md: nsqd 1.3.0, peak RSS 1.2-1.4 GB, 4 M backlog, 1.6-1.8 M of it on disk.
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
    """(low, middle, high) bytes per in-memory message from nsqd's BENCH.md figures.

    Low: the smallest RSS over the most messages in memory; high: the reverse.
    """
    in_mem = [NSQD_BACKLOG - d for d in NSQD_ON_DISK]  # 2.4 M, 2.2 M
    low = NSQD_RSS_GB[0] * 1e9 / max(in_mem)
    high = NSQD_RSS_GB[1] * 1e9 / min(in_mem)
    mid = sum(NSQD_RSS_GB) / 2 * 1e9 / (sum(in_mem) / 2)
    return low, mid, high


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of ``pid`` in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0])
    return out


# -- the broker ----------------------------------------------------------------


@dataclass
class BrokerRun:
    channels: int
    count: int
    readings: dict[str, dict[str, int]] = field(default_factory=dict)  # step -> proc_memory
    fill_seconds: float = 0.0

    def bytes_per_msg(self, key: str = "VmRSS", step: str = "settled") -> float:
        return per_message(self.readings["warm"][key], self.readings[step][key], self.count)


def _http(address: str, path: str, method: str = "GET", **query: str) -> bytes:
    url = f"http://{address}{path}" + ("?" + urllib.parse.urlencode(query) if query else "")
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read()


def _fill(address: tuple[str, int], topic: str, count: int, size: int, batch: int) -> None:
    cfg = WriterConfig(
        address=address, topic=topic, size=size, batch=batch, mode="mpub", pipeline=4,
        duration=None, count=count,
    )
    got = publish(cfg)["messages"]
    if got != count:
        raise RuntimeError(f"published {got:,} of {count:,} messages")


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
        for topic, chans in ((TOPIC, names), (WARM_TOPIC, ["w"])):
            _http(http, "/topic/create", "POST", topic=topic)
            for c in chans:
                _http(http, "/channel/create", "POST", topic=topic, channel=c)
        run.readings["created"] = proc_memory(broker.pid)
        if args.warmup:
            _fill(address, WARM_TOPIC, args.warmup, args.size, args.batch)
            _http(http, "/topic/delete", "POST", topic=WARM_TOPIC)
            time.sleep(1.0)
        run.readings["warm"] = proc_memory(broker.pid)
        t0 = time.monotonic()
        _fill(address, TOPIC, args.count, args.size, args.batch)
        run.fill_seconds = time.monotonic() - t0
        deadline = time.monotonic() + 120
        while True:
            stats = json.loads(_http(http, "/stats", format="json", topic=TOPIC))
            depths = [channel_counts(stats, TOPIC, c) for c in names]
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
        f"mqd memory per queued message, {datetime.date.today().isoformat()}, {machine()}, "
        f"Python {sys.version.split()[0]}",
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
        f"nsqd (estimate from BENCH.md: {NSQD_RSS_GB[0]}-{NSQD_RSS_GB[1]} GB peak RSS for "
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


# -- peaks: one huge publish, stuck consumers, side by side with nsqd -------------------------

# The scenarios of `python -m bench memory peaks`, each run on a fresh broker:
# a TCP MPUB of the most one-byte messages a default max-body-size holds; a text
# /mpub of 2.6 M one-byte lines; consumers that never read.
PEAK_SCENARIOS = ("mpub", "text", "stuck")
MPUB_COUNT = 1_048_575
TEXT_LINES = 2_600_000


def clear_peak(pid: int) -> bool:
    """Reset the kernel's peak RSS (VmHWM) of `pid` to its current RSS; False if not allowed.

    Writing 5 to /proc/PID/clear_refs does that (Linux >= 4.0), so VmHWM read
    afterwards is the exact peak of what follows, not a sample of it.
    """
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class AnonPeak:
    """Samples RssAnon (the heap, without file pages mapped from the page cache) every 20 ms."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid = pid
        self.peak = proc_memory(pid)["RssAnon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="anon-peak")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, proc_memory(self.pid)["RssAnon"])
            except (OSError, KeyError):  # gone (a zombie's status has no RssAnon)
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


@dataclass
class PeakRun:
    broker: str  # "mqd" or "nsqd"
    scenario: str
    before: dict[str, int]  # proc_memory before the scenario
    peak_rss_kb: int  # VmHWM at the end (exact, when clear_peak worked), else sampled
    peak_anon_kb: int  # sampled every 20 ms
    after: dict[str, int]  # right after the scenario
    settled: dict[str, int]  # 2 s later
    seconds: float
    detail: str = ""

    @property
    def rss_growth_mb(self) -> float:
        return (self.peak_rss_kb - self.before["VmRSS"]) / 1024

    @property
    def anon_growth_mb(self) -> float:
        return (self.peak_anon_kb - self.before["RssAnon"]) / 1024


def _huge_publish(broker: Broker, text: bool, count: int) -> str:
    import http.client

    if text:
        host, port = wire.parse_address(broker.http_address or "")
        conn = http.client.HTTPConnection(host, port, timeout=900)
        conn.request("POST", "/mpub?topic=big", b"x\n" * count)
        answer = conn.getresponse().read()
        conn.close()
    else:
        body = struct.pack(">i", count) + b"\x00\x00\x00\x01x" * count
        sock = wire.connect(broker.address)
        wire.identify(sock, "big")
        sock.sendall(b"MPUB big\n" + wire.SIZE.pack(len(body)) + body)
        del body
        answer = wire.read_response(sock, "MPUB")
        sock.close()
    if answer != b"OK":
        raise RuntimeError(f"the batch was answered {answer[:80]!r}")
    return f"{count:,} messages of 1 B by {'text /mpub' if text else 'TCP MPUB'}"


def _stuck_consumers(broker: Broker, args: argparse.Namespace) -> str:
    """`args.stuck` consumers (RDY 2500) that never read, one reading 20 KB/s, one FINing all,
    while `args.stuck_messages` 1 KB messages are published; ends once the healthy one has all."""
    import socket
    import threading

    size = 1024
    hello = (wire.MAGIC + b"IDENTIFY\n" + wire.SIZE.pack(len(STUCK_IDENTIFY)) + STUCK_IDENTIFY
             + b"SUB stuck c\nRDY 2500\n")

    def lazy() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(broker.address)
        s.sendall(hello)
        return s

    stuck = [lazy() for _ in range(args.stuck)]
    stop = threading.Event()
    seen: set[bytes] = set()

    def slow() -> None:
        s = lazy()
        s.settimeout(0.5)
        while not stop.is_set():
            try:
                if not s.recv(2048):
                    return
            except TimeoutError:
                continue
            except OSError:
                return
            time.sleep(0.1)  # ~20 KB/s
        s.close()

    def healthy() -> None:
        s = wire.connect(broker.address)
        s.sendall(b"SUB stuck c\nRDY 2500\n")
        s.settimeout(0.5)
        buf = b""
        while not stop.is_set():
            try:
                data = s.recv(1 << 20)
            except TimeoutError:
                continue
            if not data:
                return
            buf += data
            pos, end, out = 0, len(buf), []
            while end - pos >= 8:
                n, ftype = wire.HEADER.unpack_from(buf, pos)
                if end - pos - 4 < n:
                    break
                if ftype == wire.FRAME_MESSAGE:
                    seen.add(buf[pos + 34:pos + 42])
                    out.append(b"FIN " + buf[pos + 18:pos + 34] + b"\n")
                elif buf[pos + 8:pos + 4 + n] == wire.HEARTBEAT:
                    out.append(wire.NOP)
                pos += 4 + n
            buf = buf[pos:]
            if out:
                s.sendall(b"".join(out))
        s.close()

    threads = [threading.Thread(target=slow, daemon=True), threading.Thread(target=healthy, daemon=True)]
    for t in threads:
        t.start()
    total = args.stuck_messages
    pub = wire.connect(broker.address)
    try:
        for start in range(0, total, 500):
            n = min(500, total - start)
            body = struct.pack(">i", n) + b"".join(
                wire.SIZE.pack(size) + b"%08d" % (start + i) + b"x" * (size - 8) for i in range(n))
            pub.sendall(b"MPUB stuck\n" + wire.SIZE.pack(len(body)) + body)
            wire.expect(pub, b"OK", "MPUB")
        deadline = time.monotonic() + 300
        while len(seen) < total and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        pub.close()
        for t in threads:
            t.join(5)
        for s in stuck:
            s.close()
    if len(seen) < total:
        raise RuntimeError(f"the healthy consumer got {len(seen):,} of {total:,} messages")
    return (f"{args.stuck} consumers never reading (RDY 2500, heartbeat 30 s), one reading 20 KB/s, "
            f"one FINing {total:,} x 1 KB")


STUCK_IDENTIFY = json.dumps({"heartbeat_interval": 30000, "client_id": "stuck"}).encode()


def _peak_broker(name: str, scenario: str, args: argparse.Namespace) -> Broker:
    mem_queue = args.mem_queue_size
    stuck = ["--msg-timeout=3s"] if scenario == "stuck" else []
    if name == "nsqd":
        return Broker(argv=[args.nsqd, "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                            "--data-path={data}", f"--mem-queue-size={mem_queue}", *stuck])
    extra = [*stuck, *(["--queue-scan-interval=50ms"] if stuck else []), *args.broker_arg]
    return Broker(args.backend, mem_queue, extra=extra)


def peak_run(name: str, scenario: str, args: argparse.Namespace) -> PeakRun:
    """One fresh broker (`name`: mqd or nsqd), one scenario; its RSS before, at the peak and after."""
    broker = _peak_broker(name, scenario, args)
    with broker:
        topic = "stuck" if scenario == "stuck" else "big"
        wire.create_topic_channel(broker.address, topic, "c")
        time.sleep(0.5)
        exact = clear_peak(broker.pid)
        before = proc_memory(broker.pid)
        sampler = AnonPeak(broker.pid)
        started = time.monotonic()
        if scenario == "stuck":
            detail = _stuck_consumers(broker, args)
        else:
            count = args.peak_count or (TEXT_LINES if scenario == "text" else MPUB_COUNT)
            detail = _huge_publish(broker, scenario == "text", count)
        seconds = time.monotonic() - started
        after = proc_memory(broker.pid)
        anon = sampler.stop()
        time.sleep(2.0)
        settled = proc_memory(broker.pid)
    peak = after["VmHWM"] if exact else max(before["VmRSS"], after["VmRSS"])
    return PeakRun(name, scenario, before, peak, anon, after, settled, seconds, detail)


def peaks_report(runs: list[PeakRun], args: argparse.Namespace) -> str:
    from statistics import median

    lines = [
        f"Memory peaks, {datetime.date.today().isoformat()}, {machine()}, Python {sys.version.split()[0]}; "
        f"mqd --backend={args.backend} --mem-queue-size={args.mem_queue_size}"
        + (f", nsqd {args.nsqd} --mem-queue-size={args.mem_queue_size}" if args.nsqd else "")
        + f"; median of {args.repeat}",
        "",
        "| scenario | broker | RSS before (MB) | peak RSS growth (MB) | peak RssAnon growth (MB) "
        "| RSS growth left 2 s after (MB) | seconds |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for scenario in args.scenarios:
        for name in ("mqd", "nsqd"):
            rs = [r for r in runs if r.scenario == scenario and r.broker == name]
            if not rs:
                continue
            lines.append(
                f"| {scenario} | {name} | {median(r.before['VmRSS'] for r in rs) / 1024:,.0f} "
                f"| {median(r.rss_growth_mb for r in rs):,.0f} | {median(r.anon_growth_mb for r in rs):,.0f} "
                f"| {median((r.settled['VmRSS'] - r.before['VmRSS']) / 1024 for r in rs):,.0f} "
                f"| {median(r.seconds for r in rs):.1f} |")
    lines += ["", "Scenarios: " + "; ".join(sorted({f"{r.scenario}: {r.detail}" for r in runs}))]
    return "\n".join(lines)


def peaks_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench memory peaks",
        description="peak RSS growth of one huge publish and of stuck consumers, mqd beside nsqd",
    )
    p.add_argument("--scenario", default=",".join(PEAK_SCENARIOS),
                   help=f"comma-separated, of {', '.join(PEAK_SCENARIOS)}")
    p.add_argument("--nsqd", metavar="PATH", help="an nsqd binary to run the same scenarios on")
    p.add_argument("--repeat", type=int, default=1, help="runs of each, mqd and nsqd alternating")
    p.add_argument("--backend", default="lmdb")
    p.add_argument("--mem-queue-size", type=int, default=10000, help="both brokers'")
    p.add_argument("--peak-count", type=int, help="messages of the huge publish (default: as big as "
                   "max-body-size allows: 1,048,575 by MPUB, 2.6 M lines by /mpub)")
    p.add_argument("--stuck", type=int, default=50, help="consumers that never read")
    p.add_argument("--stuck-messages", type=int, default=200_000)
    p.add_argument("--broker-arg", action="append", default=[], metavar="ARG", help="mqd only")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.scenarios = [s for s in args.scenario.split(",") if s]
    if not args.scenarios or set(args.scenarios) - set(PEAK_SCENARIOS):
        p.error(f"--scenario: comma-separated, of {', '.join(PEAK_SCENARIOS)}")
    runs: list[PeakRun] = []
    try:
        for _ in range(args.repeat):
            for scenario in args.scenarios:
                for name in ("mqd", "nsqd") if args.nsqd else ("mqd",):
                    r = peak_run(name, scenario, args)
                    runs.append(r)
                    print(f"{scenario} {name}: RSS {r.before['VmRSS'] / 1024:,.0f} MB, peak +{r.rss_growth_mb:,.0f} "
                          f"MB, RssAnon peak +{r.anon_growth_mb:,.0f} MB, {r.seconds:.1f} s", flush=True)
    except (BrokerError, RuntimeError, OSError, wire.ProtocolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print()
    print(peaks_report(runs, args))
    if args.json:
        save_json(args.json, args, "runs", runs)
    return 0


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["peaks"]:
        return peaks_main(argv[1:])
    args = parse(argv)
    runs: list[BrokerRun] = []
    try:
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
    except (BrokerError, RuntimeError, OSError, wire.ProtocolError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    objects = None
    if args.breakdown_count:
        objects = object_breakdown(args.breakdown_count, args.size, args.batch)
    print()
    print(report(runs, objects, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "machine": machine(),
                       "args": vars(args), "runs": [asdict(r) for r in runs],
                       "objects": objects, "nsqd_estimate": nsqd_estimate()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
