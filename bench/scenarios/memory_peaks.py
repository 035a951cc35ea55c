"""``python -m bench memory peaks``: how much one request or one kind of client makes a broker grow.

Each scenario on a fresh broker with a topic and a channel (``--channels N``:
N channels for the huge publishes, each keeping a copy): one huge TCP MPUB
(the most one-byte messages a default max-body-size holds), one huge text
``/mpub``, consumers that never read. Reported: the peak RSS over the RSS
before (the kernel's own peak, VmHWM, reset first where allowed), the peak
RssAnon (the heap without file pages, sampled every 20 ms), what is left 2 s
after, and the time. With ``--nsqd-bin`` the same scenarios on a real nsqd,
alternating mqd, nsqd, mqd, ... in the same session.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import wire
from bench.harness.broker import (
    BenchError,
    Broker,
    Sampler,
    find_nsqd,
    nsqd_command,
    proc_memory,
)
from bench.harness.load import huge_publish
from bench.harness.report import heading, median, save_json

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
    assert broker.address is not None
    answer = huge_publish(broker.address, broker.http_address, "big", count, text)
    if answer != b"OK":
        raise BenchError(f"the batch was answered {answer[:80]!r}")
    return f"{count:,} messages of 1 B by {'text /mpub' if text else 'TCP MPUB'}"


def _stuck_consumers(broker: Broker, args: argparse.Namespace) -> str:
    """`args.stuck` consumers (RDY 2500) that never read, one reading 20 KB/s, one FINing all,
    while `args.stuck_messages` 1 KB messages are published; ends once the healthy one has all."""
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
        raise BenchError(f"the healthy consumer got {len(seen):,} of {total:,} messages")
    return (f"{args.stuck} consumers never reading (RDY 2500, heartbeat 30 s), one reading 20 KB/s, "
            f"one FINing {total:,} x 1 KB")


STUCK_IDENTIFY = json.dumps({"heartbeat_interval": 30000, "client_id": "stuck"}).encode()


def _peak_broker(name: str, scenario: str, args: argparse.Namespace) -> Broker:
    mem_queue = args.mem_queue_size
    stuck = ["--msg-timeout=3s"] if scenario == "stuck" else []
    if name == "nsqd":
        return Broker(argv=nsqd_command(args.nsqd, mem_queue, stuck))
    extra = [*stuck, *(["--queue-scan-interval=50ms"] if stuck else []), *args.broker_arg]
    return Broker(args.backend, mem_queue, extra=extra)


def channel_names(count: int) -> list[str]:
    """The channels a huge publish's topic has (`--channels`): c, c2, c3, ..."""
    return ["c" if i == 0 else f"c{i + 1}" for i in range(count)]


def peak_run(name: str, scenario: str, args: argparse.Namespace) -> PeakRun:
    """One fresh broker (`name`: mqd or nsqd), one scenario; its RSS before, at the peak and after."""
    broker = _peak_broker(name, scenario, args)
    with broker:
        topic = "stuck" if scenario == "stuck" else "big"
        for channel in channel_names(1 if scenario == "stuck" else args.channels):
            wire.create_topic_channel(broker.address, topic, channel)
        time.sleep(0.5)
        exact = clear_peak(broker.pid)
        before = proc_memory(broker.pid)
        sampler = Sampler(broker.pid, interval=0.02).start()
        started = time.monotonic()
        if scenario == "stuck":
            detail = _stuck_consumers(broker, args)
        else:
            count = args.peak_count or (TEXT_LINES if scenario == "text" else MPUB_COUNT)
            detail = _huge_publish(broker, scenario == "text", count)
        seconds = time.monotonic() - started
        after = proc_memory(broker.pid)
        anon = sampler.anon_peak_kb()
        sampler.stop()
        time.sleep(2.0)
        settled = proc_memory(broker.pid)
    peak = after["VmHWM"] if exact else max(before["VmRSS"], after["VmRSS"])
    return PeakRun(name, scenario, before, peak, anon, after, settled, seconds, detail)


def peaks_report(runs: list[PeakRun], args: argparse.Namespace) -> str:
    lines = [
        heading("Memory peaks")
        + f"; mqd --backend={args.backend} --mem-queue-size={args.mem_queue_size}"
        + (f", nsqd {args.nsqd} --mem-queue-size={args.mem_queue_size}" if args.nsqd else "")
        + f"; {args.channels} channel{'s' if args.channels > 1 else ''} for mpub and text"
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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench memory peaks",
        description="peak RSS growth of one huge publish and of stuck consumers, mqd beside nsqd",
    )
    p.add_argument("--scenario", default=",".join(PEAK_SCENARIOS),
                   help=f"comma-separated, of {', '.join(PEAK_SCENARIOS)}")
    p.add_argument(
        "--nsqd-bin", "--nsqd", dest="nsqd", metavar="PATH",
        help="a real nsqd (or the directory of NSQ's binaries) to run the same scenarios on "
        "(default: $NSQD_BIN if set; 'none': mqd only)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of each, mqd and nsqd alternating")
    p.add_argument("--backend", default="lmdb")
    p.add_argument("--mem-queue-size", type=int, default=10000, help="both brokers'")
    p.add_argument("--peak-count", type=int, help="messages of the huge publish (default: as big as "
                   "max-body-size allows: 1,048,575 by MPUB, 2.6 M lines by /mpub)")
    p.add_argument("--channels", type=int, default=1,
                   help="channels of the huge publish's topic, mpub and text (each keeps a copy)")
    p.add_argument("--stuck", type=int, default=50, help="consumers that never read")
    p.add_argument("--stuck-messages", type=int, default=200_000)
    p.add_argument("--broker-arg", action="append", default=[], metavar="ARG", help="mqd only")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        args.nsqd = find_nsqd(args.nsqd)
    except ValueError as exc:
        p.error(f"--nsqd-bin: {exc}")
    if args.channels < 1:
        p.error("--channels: at least 1")
    args.scenarios = [s for s in args.scenario.split(",") if s]
    if not args.scenarios or set(args.scenarios) - set(PEAK_SCENARIOS):
        p.error(f"--scenario: comma-separated, of {', '.join(PEAK_SCENARIOS)}")
    runs: list[PeakRun] = []
    for _ in range(args.repeat):
        for scenario in args.scenarios:
            for name in ("mqd", "nsqd") if args.nsqd else ("mqd",):
                r = peak_run(name, scenario, args)
                runs.append(r)
                print(f"{scenario} {name}: RSS {r.before['VmRSS'] / 1024:,.0f} MB, peak +{r.rss_growth_mb:,.0f} "
                      f"MB, RssAnon peak +{r.anon_growth_mb:,.0f} MB, {r.seconds:.1f} s", flush=True)
    print()
    print(peaks_report(runs, args))
    if args.json:
        save_json(args.json, args, runs=runs)
    return 0
