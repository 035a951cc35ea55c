"""``python -m bench snapshot``: snapshot of a live broker: reactor stall, MB/s, then `analyze`.

A real broker (twistd, loopback ports) gets a backlog of `--messages`
messages of `--body-size` bytes on one topic with one channel, published
with pipelined TCP `MPUB`s; with `--mem-queue-size=100000` (default) 100,000
of them wait in memory and the rest in LMDB. Then a few thousand DPUBs
(deferred for 30 min) and a raw consumer with `RDY 2500` that never FINs
(in flight, with `--msg-timeout=15m` so none time out during the run).

Each `POST /snapshot` (`--repeat`, default 3) is taken while a probe
connection sends `GET /ping` on a keep-alive HTTP connection back to back:
its round trips while the POST is outstanding, against a baseline before,
show how long the reactor was held (the capture itself, plus whatever the
snapshot thread costs it: the GIL). Reported with the manifest's
`capture_seconds` (the capture's own time on the reactor), per 10,000 held
messages (memory queue + in flight + deferred), and MB/s: the manifest's
bytes over the POST's wall time and over `copy_seconds` (the LMDB copy).

Scenarios: the default LMDB mode; `--durable` adds the same with a durable
store; the memory backend with `--memory-messages` (default 100,000), all
held. Then `python -m spark_bridge analyze SNAP` (subprocess, wall time
until its pipes close, as the spark-bridge scenario does) on the last LMDB
snapshot, unless `--no-analyze`.

Usage::

    python -m bench snapshot [--messages 1000000] [--repeat 3] [--durable]
        [--no-memory] [--no-analyze] [--master local[2]] [--json PATH] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import threading
import time

from bench.harness import wire
from bench.harness.broker import Broker, proc_memory
from bench.harness.report import heading, load_average, percentile, save_json
from bench.harness.spark_cli import jvm_archive, run_analyze

now = time.perf_counter

TOPIC = "snap"
CHANNEL = "c"
DEFER_MS = 30 * 60 * 1000
PING = b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, RssAnon) in MB: RSS counts the LMDB pages the broker has mapped, RssAnon not."""
    try:
        memory = proc_memory(pid)
    except OSError:
        return 0.0, 0.0
    return memory.get("VmRSS", 0) / 1024, memory.get("RssAnon", 0) / 1024


def _body(i: int, size: int) -> bytes:
    head = b'{"type":"t%d","n":%d,"pad":"' % (i % 5, i)
    return head + b"x" * (size - len(head) - 2) + b'"}'


def fill(address: tuple[str, int], count: int, size: int, batch: int, pipeline: int = 4) -> float:
    """Publish `count` messages with pipelined MPUBs of `batch`; the seconds it took."""
    sock = wire.connect(address)
    wire.identify(sock, "bench-fill")
    started = now()
    sent = acked = 0
    outstanding = 0
    next_report = 100_000

    def command(first: int, n: int) -> bytes:
        parts = [struct.pack(">i", n)]
        for i in range(first, first + n):
            body = _body(i, size)
            parts.append(wire.SIZE.pack(len(body)))
            parts.append(body)
        payload = b"".join(parts)
        return f"MPUB {TOPIC}\n".encode() + wire.SIZE.pack(len(payload)) + payload

    pending: list[int] = []
    while acked < count:
        while sent < count and outstanding < pipeline:
            n = min(batch, count - sent)
            sock.sendall(command(sent, n))
            pending.append(n)
            sent += n
            outstanding += 1
        wire.expect(sock, b"OK", "MPUB")
        acked += pending.pop(0)
        outstanding -= 1
        if acked >= next_report or acked == count:
            elapsed = now() - started
            print(f"    fill: {acked:,} / {count:,} acked, {elapsed:.1f} s "
                  f"({acked / elapsed:,.0f} msgs/s)", flush=True)
            next_report += 100_000
    sock.close()
    return now() - started


def defer(address: tuple[str, int], count: int, size: int) -> None:
    """`count` DPUBs due in 30 min, pipelined in one write."""
    sock = wire.connect(address)
    wire.identify(sock, "bench-defer")
    sock.sendall(b"".join(
        f"DPUB {TOPIC} {DEFER_MS}\n".encode() + wire.SIZE.pack(size) + _body(-1 - i, size)
        for i in range(count)))
    for _ in range(count):
        wire.expect(sock, b"OK", "DPUB")
    sock.close()


class Holder(threading.Thread):
    """A consumer with RDY N that never FINs: N messages stay in flight on it."""

    def __init__(self, address: tuple[str, int], rdy: int) -> None:
        super().__init__(daemon=True, name="in-flight-holder")
        self.sock = wire.connect(address)
        wire.identify(self.sock, "bench-holder")
        self.sock.sendall(f"SUB {TOPIC} {CHANNEL}\n".encode())
        wire.expect(self.sock, b"OK", "SUB")
        self.sock.sendall(f"RDY {rdy}\n".encode())
        self.received = 0
        self.closed = False

    def run(self) -> None:
        try:
            while True:
                ftype, payload = wire.read_frame(self.sock)
                if ftype == wire.FRAME_MESSAGE:
                    self.received += 1
                elif ftype == wire.FRAME_RESPONSE and payload == wire.HEARTBEAT:
                    self.sock.sendall(wire.NOP)
        except (OSError, wire.ProtocolError):
            self.closed = True

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Probe(threading.Thread):
    """`GET /ping` round trips back to back on one keep-alive connection: (start, seconds) each."""

    def __init__(self, http_address: tuple[str, int]) -> None:
        super().__init__(daemon=True, name="probe")
        self.sock = socket.create_connection(http_address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()
        self.error: str | None = None

    def _answer(self, buf: bytes) -> bytes:
        """Read one whole response (headers + Content-Length body); what follows it."""
        while b"\r\n\r\n" not in buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise OSError("probe connection closed")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise OSError(f"probe answer {head[:40]!r}")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise OSError("probe connection closed")
            rest += chunk
        return rest[length:]

    def run(self) -> None:
        buf = b""
        samples = self.samples
        try:
            while not self.stopped.is_set():
                t = now()
                self.sock.sendall(PING)
                buf = self._answer(buf)
                samples.append((t, now() - t))
        except OSError as e:
            self.error = str(e)

    def window(self, start: float, end: float) -> list[float]:
        """Round trips that overlapped [start, end]."""
        return [d for t, d in list(self.samples) if t <= end and t + d >= start]

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)
        self.sock.close()


def pct(values: list[float], q: float) -> float:
    """The ``q`` percentile of unsorted round trips; NaN (printed as such) for none."""
    got = percentile(sorted(values), q)
    return float("nan") if got is None else got


def post_snapshot(http_address: str, name: str) -> tuple[float, dict]:
    """``POST /snapshot?out=NAME``: its wall time and the JSON answer."""
    started = now()
    body = wire.http_request(http_address, "/snapshot", "POST", timeout=600, out=name)
    return now() - started, json.loads(body)


def scenario(
    label: str, backend: str, extra: list[str], args: argparse.Namespace, messages: int
) -> dict:
    """One broker: backlog, in flight, deferred, then --repeat snapshots under the probe."""
    print(f"\n== {label}: {messages:,} messages x {args.body_size} B, "
          f"--mem-queue-size={args.mem_queue_size}, {args.in_flight:,} in flight, "
          f"{args.deferred:,} deferred", flush=True)
    broker = Broker(backend, args.mem_queue_size, extra=["--msg-timeout=15m", *extra], keep=True)
    broker.start()
    result: dict = {"label": label, "backend": backend, "extra": extra, "messages": messages}
    try:
        assert broker.address is not None and broker.http_address is not None
        result["rss_start_mb"] = rss_mb(broker.pid)
        wire.create_topic_channel(broker.address, TOPIC, CHANNEL)
        result["fill_s"] = fill(broker.address, messages, args.body_size, args.batch)
        defer(broker.address, args.deferred, args.body_size)
        holder = Holder(broker.address, args.in_flight)
        holder.start()
        deadline = time.monotonic() + 60
        while holder.received < args.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"    in flight on the holder: {holder.received:,}", flush=True)
        time.sleep(1.0)  # let the broker settle (memory queue refilled from the store)

        probe = Probe(wire.parse_address(broker.http_address))
        probe.start()
        time.sleep(args.baseline)
        base_end = now()
        baseline = probe.window(base_end - args.baseline, base_end)
        result["rss_before_mb"] = rss_mb(broker.pid)
        runs = []
        for i in range(args.repeat):
            time.sleep(0.5)
            t0 = now()
            wall, answer = post_snapshot(broker.http_address, f"bench-{i}")
            t1 = now()
            time.sleep(0.05)  # the round trip in progress at t1 finishes
            during = probe.window(t0, t1)
            m = answer["manifest"]
            held = sum(q["held"] for q in m["queues"])
            ok = all(q["stats"] is None or (
                q["queued"] == q["stats"]["depth"] and q["in_flight"] == q["stats"]["in_flight_count"]
                and q["deferred"] == q["stats"]["deferred_count"]) for q in m["queues"])
            total = sum(q["count"] for q in m["queues"])
            run = {
                "path": answer["path"], "wall_s": wall, "bytes": m["bytes"],
                "copy_s": m["copy_seconds"], "capture_s": m["capture_seconds"], "held": held,
                "total": total, "stats_agree": ok,
                "probe_n": len(during), "probe_max_ms": 1000 * max(during, default=float("nan")),
                "probe_p99_ms": 1000 * pct(during, 0.99),
                "states": {k: sum(q[k] for q in m["queues"]) for k in ("queued", "in_flight", "deferred")},
            }
            runs.append(run)
            mb = run["bytes"] / 1e6
            copy = f"copy {run['copy_s']:.3f} s ({mb / run['copy_s']:,.0f} MB/s)" if run["copy_s"] else "no copy"
            print(f"    snapshot {i + 1}: {total:,} messages ({held:,} held; by state {run['states']}), "
                  f"{mb:.1f} MB in {wall:.3f} s ({mb / wall:,.0f} MB/s), {copy}; "
                  f"capture {1000 * run['capture_s']:.1f} ms "
                  f"({1e7 * run['capture_s'] / max(held, 1):.2f} ms per 10k held); "
                  f"probe during: {run['probe_n']} pings, max {run['probe_max_ms']:.1f} ms, "
                  f"p99 {run['probe_p99_ms']:.1f} ms; manifest = stats: {ok}", flush=True)
        probe.stop()
        if probe.error:
            print(f"    probe error: {probe.error}", flush=True)
        result["rss_after_mb"] = rss_mb(broker.pid)
        holder.close()
        result.update(
            runs=runs,
            baseline_n=len(baseline),
            baseline_p50_ms=1000 * pct(baseline, 0.5),
            baseline_p99_ms=1000 * pct(baseline, 0.99),
            baseline_max_ms=1000 * max(baseline, default=float("nan")),
        )
        print(f"    probe baseline ({args.baseline:.0f} s): {len(baseline)} pings, "
              f"p50 {result['baseline_p50_ms']:.2f} ms, p99 {result['baseline_p99_ms']:.2f} ms, "
              f"max {result['baseline_max_ms']:.1f} ms; broker RSS (RssAnon) {fmt_rss(result['rss_start_mb'])} "
              f"at start, {fmt_rss(result['rss_before_mb'])} before the snapshots, "
              f"{fmt_rss(result['rss_after_mb'])} after", flush=True)
    finally:
        broker.stop()
    result["workdir"] = str(broker.workdir)
    return result


def fmt_rss(rss: tuple[float, float]) -> str:
    return f"{rss[0]:.0f} MB ({rss[1]:.0f})"


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def analyze(snap: str, expected: int, args: argparse.Namespace, workdir: str) -> dict | None:
    """`python -m spark_bridge analyze SNAP` end to end, as the spark-bridge scenario runs it."""
    archive = jvm_archive("    ")
    report = os.path.join(workdir, "report.html")
    print(f"\n== analyze: python -m spark_bridge analyze {snap} --master {args.master} --report report.html "
          f"(JVM class archive: {'yes' if archive else 'no'})", flush=True)
    an = run_analyze([snap, "--master", args.master, "--report", report], report, workdir)
    if an is None:
        return None
    print(f"    analyze: {an['wall']:.1f} s wall end to end, {expected / an['wall']:,.0f} msgs/s; "
          f"peak RSS {an['single_peak_mb']:,.0f} MB ({an['single_peak_name']})", flush=True)
    return {"wall_s": an["wall"], "msgs_per_s": expected / an["wall"], "archive": archive,
            "stdout_head": an["stdout"][:2000]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench snapshot", description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--memory-messages", type=int, default=100_000, help="backlog of the memory-backend run")
    p.add_argument("--body-size", type=int, default=200)
    p.add_argument("--mem-queue-size", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=5000, help="messages per MPUB")
    p.add_argument("--in-flight", type=int, default=2500, help="RDY of the consumer that never FINs")
    p.add_argument("--deferred", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--baseline", type=float, default=3.0, help="seconds of probe before the snapshots")
    p.add_argument("--durable", action="store_true", help="also a run with --durable")
    p.add_argument("--no-memory", action="store_true", help="skip the memory-backend run")
    p.add_argument("--no-analyze", action="store_true")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--json", help="save every figure to this file")
    p.add_argument("--keep", action="store_true", help="keep the brokers' data and snapshots")
    args = p.parse_args(argv)

    print(heading("snapshot bench", f"load average {load_average():.1f}"), flush=True)
    results = []
    workdirs = []
    try:
        results.append(scenario("lmdb", "lmdb", [], args, args.messages))
        workdirs.append(results[-1]["workdir"])
        if args.durable:
            results.append(scenario("lmdb --durable", "lmdb", ["--durable"], args, args.messages))
            workdirs.append(results[-1]["workdir"])
        if not args.no_memory:
            results.append(scenario("memory", "memory", [], args, args.memory_messages))
            workdirs.append(results[-1]["workdir"])
        an = None
        if not args.no_analyze:
            last = results[0]["runs"][-1]
            an = analyze(last["path"], last["total"], args, results[0]["workdir"])
            if an is None:
                return 1
        table(results, an, args)
        if args.json:
            save_json(args.json, args, results=results, analyze=an)
    finally:
        for w in workdirs:
            if args.keep:
                print(f"kept {w}")
            else:
                shutil.rmtree(w, ignore_errors=True)
    return 0


def table(results: list[dict], an: dict | None, args: argparse.Namespace) -> None:
    print("\n" + heading("mqd snapshot bench", f"load average {load_average():.1f} at the end",
                         f"median of {args.repeat} snapshots") + "\n")
    print("| broker | messages (held) | capture (reactor) | per 10k held | probe max / p99 "
          "(baseline) | snapshot wall | MB | MB/s wall | MB/s copy | broker RSS (RssAnon) before / after |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        runs = r["runs"]
        held = med(runs, "held")
        capture = med(runs, "capture_s")
        wall = med(runs, "wall_s")
        mb = med(runs, "bytes") / 1e6
        copy = med(runs, "copy_s")
        copy_mbs = f"{mb / copy:,.0f}" if copy else "–"
        print(f"| {r['label']} | {med(runs, 'total'):,.0f} ({held:,.0f}) | {1000 * capture:.1f} ms "
              f"| {1e7 * capture / held:.2f} ms | {med(runs, 'probe_max_ms'):.1f} / {med(runs, 'probe_p99_ms'):.1f} ms "
              f"({r['baseline_max_ms']:.1f} / {r['baseline_p99_ms']:.1f} ms) | {wall:.2f} s | {mb:.0f} "
              f"| {mb / wall:,.0f} | {copy_mbs} | {fmt_rss(r['rss_before_mb'])} / {fmt_rss(r['rss_after_mb'])} |")
    if an is not None:
        print(f"\nanalyze ({args.master}, JVM class archive: {'yes' if an['archive'] else 'no'}) on the "
              f"lmdb snapshot: {an['wall_s']:.1f} s end to end, {an['msgs_per_s']:,.0f} msgs/s")
