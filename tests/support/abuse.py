"""Resource abuse of a real broker: its memory, and a bystander's latency, under a hostile client.

Each `abuse_*` runs one kind of abuse for a while inside `measured`, which
samples the broker's RSS (and RssAnon, its private memory) and runs a
bystander that times PUB (or GET /ping) round trips. The tests assert on
what these report; `python -m bench torture` runs the same helpers longer
and prints the figures.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.broker import Sampler
from tests.support.control_checks import pub_round_trip, raw_http
from tests.support.fuzz_inputs import ID, identify_raw, json_bytes
from tests.support.processes import BrokerProcess
from tests.support.raw_conn import FRAME_MESSAGE, FRAME_RESPONSE, MAGIC_V2, RawConn, command
from tests.support.v2_frames import mpub_body, sized


class Bystander(threading.Thread):
    """PUB round trips on its own connection: the worst one is what a client saw.

    `http`: GET /ping round trips instead, for a broker where PUB needs an AUTH
    the bystander could not get either.
    """

    def __init__(self, broker: BrokerProcess, topic: str = "zz_bystander", http: bool = False) -> None:
        super().__init__(daemon=True, name="bystander")
        self.broker, self.topic, self.http = broker, topic, http
        self.stop_event = threading.Event()
        self.worst = 0.0
        self.round_trips = 0
        self.errors: list[str] = []

    def run(self) -> None:
        if self.http:
            self._run_http()
            return
        try:
            with RawConn(self.broker, timeout=60) as conn:
                while not self.stop_event.is_set():
                    t0 = time.monotonic()
                    answer = pub_round_trip(conn, self.topic, b"bystander")
                    took = time.monotonic() - t0
                    if answer != b"OK":
                        self.errors.append(answer.decode(errors="replace"))
                        return
                    self.worst = max(self.worst, took)
                    self.round_trips += 1
                    self.stop_event.wait(0.01)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            self.errors.append(repr(e))

    def _run_http(self) -> None:
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            try:
                answer = raw_http(self.broker, "GET", "/ping", None, timeout=60)
            except OSError as e:
                self.errors.append(repr(e))
                return
            if answer != (200, b"OK"):
                self.errors.append(repr(answer))
                return
            self.worst = max(self.worst, time.monotonic() - t0)
            self.round_trips += 1
            self.stop_event.wait(0.01)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(60)


def _rss_anon_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class AnonSampler(Sampler):
    """bench's RSS sampler, also keeping the peak of RssAnon: the heap and other
    private memory, without the LMDB pages mapped from the page cache (RssFile),
    which the kernel can take back and which grow with the backlog on disk."""

    def reset(self) -> None:
        super().reset()
        with self._lock:
            self.anon_peak = self.anon_baseline = _rss_anon_kb(self.pid)

    def _sample(self) -> None:
        super()._sample()
        anon = _rss_anon_kb(self.pid)
        with self._lock:
            self.anon_peak = max(self.anon_peak, anon)


@dataclass
class AbuseResult:
    name: str
    baseline_mb: float
    peak_mb: float
    worst_latency_ms: float
    bystander_round_trips: int
    bystander_errors: list[str]
    detail: str = ""
    anon_baseline_mb: float = 0.0
    anon_peak_mb: float = 0.0

    @property
    def growth_mb(self) -> float:
        return self.peak_mb - self.baseline_mb

    @property
    def anon_growth_mb(self) -> float:
        return self.anon_peak_mb - self.anon_baseline_mb


@contextmanager
def measured(broker: BrokerProcess, name: str, http_bystander: bool = False) -> Iterator[dict[str, Any]]:
    """Peak RSS of the broker and the bystander's worst PUB round trip during the block.

    Yields a dict the block may put a `detail` text into; the result is
    left in it under `result` once the block is done.
    """
    sampler = AnonSampler(broker.proc.pid, interval=0.05).start()
    baseline = sampler.window()[0]
    bystander = Bystander(broker, http=http_bystander)
    bystander.start()
    out: dict[str, Any] = {}
    try:
        yield out
    finally:
        bystander.stop()
        peak = sampler.window()[0]
        sampler.stop()
        out["result"] = AbuseResult(name, baseline, peak, bystander.worst * 1000,
                                    bystander.round_trips, bystander.errors, out.get("detail", ""),
                                    sampler.anon_baseline / 1024, sampler.anon_peak / 1024)


def _send_until(sock: socket.socket, data: bytes, stop_at: float) -> int:
    """Send `data` over and over until `stop_at`; a blocked send (the broker stopped
    reading) just waits. Returns the bytes the kernel took."""
    sock.settimeout(0.2)
    sent = 0
    view = memoryview(data)
    pos = 0
    while time.monotonic() < stop_at:
        try:
            n = sock.send(view[pos:])
        except TimeoutError:
            continue
        sent += n
        pos = (pos + n) % len(data)
    return sent


def lazy_reader(broker: BrokerProcess, rcvbuf: int) -> socket.socket:
    """A connection with a small receive buffer (set before connecting, so the
    TCP window stays small): what the client does not read piles up in the broker."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((broker.tcp_host, broker.tcp_port))
    return sock


def abuse_never_reading_consumer(broker: BrokerProcess, seconds: float, *,
                                 size: int = 16384) -> dict[str, Any]:
    """SUB + RDY 2500 and never read, next to a consumer that reads and FINs, while
    unique messages are published.

    With a short --msg-timeout the never-reading client is handed 2500 new
    messages a timeout; their frames sit in its write buffer after the
    other consumer has finished them. Without flow control that memory is
    never given back while the client stays connected.
    """
    topic = "abuse_never_reading"
    sock = lazy_reader(broker, 4096)
    sock.sendall(MAGIC_V2 + command(f"SUB {topic} c") + command("RDY 2500"))
    stop = threading.Event()
    counts = {"published": 0, "finished": 0}

    def reader() -> None:
        with RawConn(broker, timeout=2) as conn:
            conn.send(command(f"SUB {topic} c") + command("RDY 2500"))
            fins: list[bytes] = []
            while not stop.is_set():
                try:
                    frame_type, payload = conn.read_frame()
                except TimeoutError:
                    continue
                if frame_type == FRAME_MESSAGE:
                    fins.append(b"FIN " + payload[10:26] + b"\n")
                    if len(fins) >= 100:
                        conn.send(b"".join(fins))
                        counts["finished"] += len(fins)
                        fins.clear()

    fast = threading.Thread(target=reader, daemon=True)
    fast.start()
    with measured(broker, "never-reading consumer") as out:
        deadline = time.monotonic() + seconds
        seq = 0
        with RawConn(broker, timeout=30) as publisher:
            while time.monotonic() < deadline:
                bodies = [b"%012d" % (seq + i) + b"y" * (size - 12) for i in range(50)]
                seq += len(bodies)
                publisher.send(command(f"MPUB {topic}", mpub_body(bodies)))
                assert publisher.read_frame() == (FRAME_RESPONSE, b"OK")
                counts["published"] = seq
        stop.set()
        fast.join(10)
        out["detail"] = (f"{counts['published']:,} x {size} B published, "
                         f"{counts['finished']:,} FINished by the other consumer")
    sock.close()
    return out


def abuse_fin_flood(broker: BrokerProcess, seconds: float) -> dict[str, Any]:
    """`FIN <unknown id>` forever, never reading the E_FIN_FAILED answers."""
    sock = lazy_reader(broker, 4096)
    sock.sendall(MAGIC_V2 + command("SUB abuse_fin_flood c"))
    block = (b"FIN " + ID + b"\n") * 3000
    with measured(broker, "FIN flood, never reading") as out:
        sent = _send_until(sock, block, time.monotonic() + seconds)
        out["detail"] = f"{sent // 21:,} FINs taken by the kernel"
    sock.close()
    return out


def abuse_slow_consumer(broker: BrokerProcess, seconds: float, *, size: int = 4096) -> dict[str, Any]:
    """A consumer reading 8 KB every 50 ms (FINning what it got) while publishers flood."""
    topic = "abuse_slow"
    sock = lazy_reader(broker, 8192)
    sock.sendall(MAGIC_V2 + command(f"SUB {topic} c") + command("RDY 2500"))
    stop = threading.Event()
    published = [0]

    def flood() -> None:
        with RawConn(broker, timeout=60) as conn:
            batch = command(f"MPUB {topic}", mpub_body([b"s" * size] * 100))
            while not stop.is_set():
                conn.send(batch)
                conn.read_frame()
                published[0] += 100

    flooder = threading.Thread(target=flood, daemon=True)
    with measured(broker, "slow consumer") as out:
        flooder.start()
        buf = b""
        fins = 0
        sock.settimeout(0.05)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                buf += sock.recv(8192)
            except TimeoutError:
                pass
            while len(buf) >= 8:
                frame_size, frame_type = struct.unpack(">ii", buf[:8])
                if len(buf) < 4 + frame_size:
                    break
                payload, buf = buf[8:4 + frame_size], buf[4 + frame_size:]
                if frame_type == FRAME_MESSAGE:
                    sock.sendall(b"FIN " + payload[10:26] + b"\n")
                    fins += 1
            time.sleep(0.05)
        stop.set()
        flooder.join(30)
        out["detail"] = f"{published[0]:,} published, {fins:,} read and FINished"
    sock.close()
    return out


def abuse_deflate_bomb(broker: BrokerProcess, seconds: float) -> dict[str, Any]:
    """IDENTIFY deflate, then ~1000:1 compressed NOPs without reading anything."""
    conn = RawConn(broker, timeout=10)
    conn.send(identify_raw(json_bytes(feature_negotiation=True, deflate=True, deflate_level=1)))
    frame_type, payload = conn.read_frame()
    assert frame_type == FRAME_RESPONSE and json.loads(payload)["deflate"], payload
    sock = conn.sock  # from here on the broker reads deflate; what it writes is never read
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = compressor.compress(b"NOP\n" * (8 << 20)) + compressor.flush(zlib.Z_SYNC_FLUSH)
    with measured(broker, "deflate bomb") as out:
        sent = _send_until(sock, chunk, time.monotonic() + seconds)
        inflated = sent * (32 << 20) // len(chunk)
        out["detail"] = (f"{sent:,} compressed bytes taken by the kernel "
                         f"({inflated >> 20:,} MB of NOPs inflated)")
    sock.close()
    return out


def abuse_huge_mpub(broker: BrokerProcess, seconds: float) -> dict[str, Any]:
    """MPUBs of max-body-size (5 MB) in 1-byte messages, not reading the answers."""
    topic = "abuse_huge_mpub"
    per = (5 * 1024 * 1024 - 4) // 5
    body = mpub_body([b"x"] * per)
    data = command(f"MPUB {topic}", body)
    sock = socket.create_connection((broker.tcp_host, broker.tcp_port))
    sock.sendall(MAGIC_V2)
    with measured(broker, "huge MPUB (5 MB of 1-byte messages)") as out:
        sent = _send_until(sock, data, time.monotonic() + seconds)
        out["detail"] = f"{sent // len(data):,} MPUBs of {per:,} messages"
    sock.close()
    return out


def abuse_auth_pending(broker: BrokerProcess, seconds: float) -> dict[str, Any]:
    """AUTH against an auth server that never answers, then PUBs without reading.

    The broker must be started with --auth-http-address pointing at a socket
    that accepts and never responds (see `silent_server`).
    """
    sock = socket.create_connection((broker.tcp_host, broker.tcp_port))
    sock.sendall(MAGIC_V2 + identify_raw(json_bytes(feature_negotiation=True))
                 + b"AUTH\n" + sized(b"secret"))
    block = command("PUB abuse_auth", b"z" * 1000) * 64
    with measured(broker, "AUTH pending, PUBs streaming (bystander: GET /ping)",
                  http_bystander=True) as out:
        sent = _send_until(sock, block, time.monotonic() + seconds)
        out["detail"] = f"{sent:,} bytes sent behind the pending AUTH"
    sock.close()
    return out


@contextmanager
def silent_server() -> Iterator[str]:
    """A listening socket that never accepts: HTTP requests to it hang. Yields HOST:PORT."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()

