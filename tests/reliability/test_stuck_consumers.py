"""Consumers that stay connected but do not read: what they may pin, and when they are closed.

A stuck consumer may pin its RDY window of messages and one transport
buffer, never more: while its output is backed up it is handed nothing, so
a message that times out is not written to it again while its earlier copy
is still held unsent. Its output must drain within its heartbeat interval
(nsqd's write deadline): a connection whose transport stays backed up
longer is closed and its in-flight messages go back to the channel, while a
slow reader that drains each write in time keeps its connection.

Unit tests drive the protocol on a StringTransport that pauses and resumes
its producer as Twisted's TCP transport does, count the bytes held for the
client and move time with the Clock and the queue scan; the integration
test measures a real broker's RSS with consumers that never read.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport

from mqd.nsqd.protocol.v2 import V2Factory
from tests.support.abuse import lazy_reader, measured
from tests.support.inprocess_broker import scan
from tests.support.raw_conn import FRAME_MESSAGE, FRAME_RESPONSE, RawConn, command, select_sockets
from tests.support.v2_client import Client
from tests.support.v2_frames import (
    MAGIC,
    Msg,
    cmd,
    identify,
    mpub,
    mpub_body,
    ok,
    parse_frames,
    pub,
)

BODY_SIZE = 1024
# Twisted's TCP transport pauses its producer once more than this is unsent.
BUFFER_SIZE = 64 * 1024
FRAME_OVERHEAD = 4 + 4 + 8 + 2 + 16


class SocketLikeTransport(StringTransport):
    """A StringTransport whose producer is paused and resumed as Twisted's TCP transport does it.

    Over `bufferSize` unsent bytes pause it (on the write that passes the
    mark), and it is resumed once everything written is taken, here by the
    peer reading (`take`): what `value()` holds is the transport's buffer.
    """

    bufferSize = BUFFER_SIZE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.paused = False

    def write(self, data: bytes) -> None:
        super().write(data)
        self._check()

    def writeSequence(self, seq) -> None:
        super().write(b"".join(seq))
        self._check()

    def _check(self) -> None:
        if self.producer is not None and not self.paused and len(self.value()) > self.bufferSize:
            self.paused = True
            self.producer.pauseProducing()

    def take(self, n: int | None = None) -> bytes:
        """The peer reads up to `n` bytes (all when None); an empty buffer resumes the producer."""
        data = self.value()
        n = len(data) if n is None else n
        taken, rest = data[:n], data[n:]
        self.clear()
        StringTransport.write(self, rest)
        if not rest and self.paused and self.producer is not None:
            self.paused = False
            self.producer.resumeProducing()
        return taken


class StuckClient(Client):
    """A V2 client on a SocketLikeTransport; reading is explicit (`take`)."""

    def __init__(self, broker, port: int) -> None:
        self.broker = broker
        addr = IPv4Address("TCP", "127.0.0.1", port)
        self.proto = V2Factory(broker).buildProtocol(addr)
        self.transport = SocketLikeTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)
        self.lost = False
        self.stream = b""
        self.send(MAGIC)

    def raw(self) -> bytes:
        return self.transport.take()

    def take(self, n: int | None = None) -> list:
        """Read up to `n` bytes and return the whole frames they complete."""
        self.stream += self.transport.take(n)
        pos, end = 0, len(self.stream)
        while end - pos >= 4:
            size = struct.unpack_from(">i", self.stream, pos)[0]
            if end - pos - 4 < size:
                break
            pos += 4 + size
        frames = parse_frames(self.stream[:pos])
        self.stream = self.stream[pos:]
        return frames

    def buffered(self) -> int:
        """Bytes the broker holds for this client: the transport's buffer and the protocol's own."""
        return len(self.transport.value()) + self.proto._output.pending_bytes()

    @property
    def aborted(self) -> bool:
        """abortConnection was called (StringTransport's `disconnected`), not just loseConnection."""
        return self.transport.disconnected


def stuck_consumer(broker, port: int, rdy: int = 2500, **fields) -> StuckClient:
    c = StuckClient(broker, port)
    if fields:
        c.send(identify(**fields))
        assert c.read() == [ok()]
    c.sub()
    c.send(cmd("RDY", rdy))
    return c


def bodies(n: int, start: int = 0) -> list[bytes]:
    return [b"%08d" % (start + i) + b"x" * (BODY_SIZE - 8) for i in range(n)]


@pytest.fixture
def publisher(connect):
    p = connect()
    p.send(identify(heartbeat_interval=-1))
    assert p.read() == [ok()]

    def do(batch: list[bytes]) -> None:
        for i in range(0, len(batch), 500):  # under the size a big MPUB is published in steps
            assert p.request(mpub("t", batch[i:i + 500])) == [ok()]

    return do


# -- nsqd's write deadline ---------------------------------------------------------------


def test_output_not_drained_within_heartbeat_interval_closes(inproc_broker, clock, publisher, connect):
    c = stuck_consumer(inproc_broker, 40001)
    publisher(bodies(200))
    assert c.transport.paused, "200 KB unsent must pause the producer"
    hb = c.proto.heartbeat_interval
    clock.advance(hb - 0.1)
    assert not c.aborted
    clock.advance(0.2)
    assert c.aborted, "output backed up for a heartbeat interval must close the connection"
    # The reactor then calls connectionLost: its in-flight messages go back at once.
    c.lose()
    channel = inproc_broker.topic("t").channel("c")
    assert channel.in_flight_count() == 0
    healthy = connect()
    healthy.sub(rdy=2500)
    assert sorted(m.body for m in healthy.messages()) == bodies(200)


def test_write_deadline_is_per_write_a_slow_reader_keeps_its_connection(inproc_broker, clock, publisher):
    """The deadline runs while one write waits, as nsqd's per-write SetWriteDeadline does.

    300 KB are held for a reader that takes 40 KiB every 5 s: the whole
    backlog takes ~40 s to read, longer than the 30 s heartbeat interval,
    but what each resume hands the transport (two 64 KiB steps) is taken
    within it, and the broker reads the client again within two heartbeat
    intervals, so the connection stays and its FINs all succeed.
    """
    c = stuck_consumer(inproc_broker, 40002, msg_timeout=300_000)
    batch = bodies(300)
    publisher(batch)
    assert c.buffered() > 300 * BODY_SIZE
    got: list[Msg] = []
    for _ in range(20):
        clock.advance(5)
        got += [f for f in c.take(40 * 1024) if isinstance(f, Msg)]
        assert not c.aborted, f"slow reader closed after {len(got)} messages"
        if len(got) == len(batch):
            break
    assert sorted(m.body for m in got) == batch
    assert c.transport.producerState == "producing"
    c.send(b"".join(cmd("FIN", m.id) for m in got))
    assert c.take() == []  # every FIN succeeded
    assert inproc_broker.topic("t").channel("c").in_flight_count() == 0


def test_slow_reader_not_read_for_two_heartbeats_is_closed(inproc_broker, clock, publisher, connect):
    """A backlog that takes longer than two heartbeat intervals to read keeps the broker from
    reading the client that long: the read timeout closes it (nsqd closes such slow readers
    when their heartbeat answers come too late), and its messages go to others."""
    c = stuck_consumer(inproc_broker, 40007, heartbeat_interval=10_000)
    publisher(bodies(300))
    closed_at = None
    for t in range(1, 40):
        clock.advance(1)
        if t % 8 == 0:
            c.take(2 * BUFFER_SIZE + 4096)  # each write (two steps) taken within the 10 s interval
        if c.aborted:
            closed_at = t
            break
    assert closed_at == 20, closed_at
    c.lose()
    healthy = connect()
    healthy.sub(rdy=2500)
    assert sorted(m.body for m in healthy.messages()) == bodies(300)


def test_closing_a_stuck_connection_aborts_it_after_the_heartbeat_interval(inproc_broker, clock, publisher):
    """A close waits for the output to be written (loseConnection): a client that never reads
    would keep it, and what it holds, forever. nsqd's last write has its deadline too."""
    c = stuck_consumer(inproc_broker, 40003)
    publisher(bodies(200))
    c.send(cmd("RDY", "x"))  # fatal: E_INVALID, then close once written
    assert c.transport.disconnecting
    assert not c.transport.producer
    clock.advance(c.proto.heartbeat_interval + 0.1)
    assert c.aborted


# -- what a stuck consumer pins ------------------------------------------------------


def test_stuck_consumer_holds_at_most_its_rdy_window(inproc_broker, clock, publisher, connect):
    """Bytes held for a never-reading consumer stay under RDY x frame size + the transport
    buffer however much is published and however often its messages time out; a healthy
    consumer on the same channel gets and finishes every message."""
    rdy = 2500
    stuck = stuck_consumer(inproc_broker, 40005, rdy=rdy, msg_timeout=1000, heartbeat_interval=60_000)
    # Its whole window first, in one delivery (PUBs of one read are published as one batch).
    p = connect()
    assert p.request(b"".join(pub("t", b) for b in bodies(rdy))) == [ok()] * rdy
    assert stuck.proto.message_count == rdy
    healthy = connect()
    healthy.sub(rdy=2500)
    channel = inproc_broker.topic("t").channel("c")
    bound = rdy * (BODY_SIZE + FRAME_OVERHEAD) + 2 * BUFFER_SIZE
    finished: set[bytes] = set()
    peak = stuck.buffered()
    total = rdy
    for _ in range(25):  # 25 x 2 s < the 60 s heartbeat interval
        publisher(bodies(1000, total))
        total += 1000
        clock.advance(2)
        scan(inproc_broker)  # the stuck consumer's in-flight messages time out
        for m in healthy.read():
            if isinstance(m, Msg):
                finished.add(m.body)
                healthy.fin(m)
        peak = max(peak, stuck.buffered())
        assert not stuck.aborted
    assert channel.timeout_count >= rdy, "the stuck consumer's window must have timed out"
    assert peak <= bound, f"{peak} bytes held for a stuck consumer (bound {bound})"
    # Never handed a message again while its earlier copies are unsent.
    assert stuck.proto.message_count == rdy
    # What it held went to the healthy consumer; once it is closed, nothing is left.
    clock.advance(60)
    assert stuck.aborted
    stuck.lose()
    for _ in range(5):
        for m in healthy.read():
            if isinstance(m, Msg):
                finished.add(m.body)
                healthy.fin(m)
        clock.advance(1)
        scan(inproc_broker)
    assert finished == set(bodies(total))
    assert channel.depth() == 0 and channel.in_flight_count() == 0


def test_timed_out_message_not_rewritten_while_its_copy_is_unsent(inproc_broker, clock, publisher):
    """A window that times out while the client is reading its backlog slowly is not
    written again until the earlier copies have all been handed on."""
    c = stuck_consumer(inproc_broker, 40006, rdy=500, msg_timeout=1000)
    publisher(bodies(500))
    clock.advance(2)
    scan(inproc_broker)  # all 500 time out while (nearly) all their frames are still held
    assert inproc_broker.topic("t").channel("c").timeout_count == 500
    seen: list[bytes] = []
    while True:
        frames = c.take(BUFFER_SIZE // 4)
        seen += [f.id for f in frames if isinstance(f, Msg)]
        if not c.transport.value() and not c.buffered():
            break
    first = seen[:500]
    assert len(set(first)) == 500, "a message was written twice within its first window"
    # Once all of it is handed on, the window is delivered again (the kernel may
    # still hold the old copies: that is the client's to read).
    assert len(seen) >= 500


# -- the real broker: RSS with stuck consumers ---------------------------------------------------

# MQD_STUCK_FIGURES=1: the README's figures (50 stuck consumers, 200k messages or
# MQD_STUCK_MESSAGES, nsqd's default 30 s heartbeat interval); CI runs a smaller
# case in ~15 s.
FIGURES = os.environ.get("MQD_STUCK_FIGURES") == "1"
STUCK = 50 if FIGURES else 10
MESSAGES = int(os.environ.get("MQD_STUCK_MESSAGES", 200_000 if FIGURES else 30_000))
HEARTBEAT_MS = 30_000 if FIGURES else 5_000
STUCK_RDY = 2500


def _wait_closed(socks: list[socket.socket], deadline: float) -> int:
    """Read what the kernel holds for each socket until the broker's close shows (EOF, reset)
    or `deadline`; the number closed by then."""
    open_socks = set(socks)
    for s in socks:
        s.setblocking(False)
    while open_socks and time.monotonic() < deadline:
        readable, _ = select_sockets(list(open_socks), [], 0.2)
        for s in readable:
            try:
                if not s.recv(1 << 20):
                    open_socks.discard(s)
            except BlockingIOError:
                pass
            except OSError:
                open_socks.discard(s)
    return len(socks) - len(open_socks)


def _rss_anon_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def test_stuck_consumers_on_a_real_broker_keep_memory_bounded(start_broker):
    """N consumers (RDY 2500) that never read, one that reads 20 KB/s, and a healthy one,
    while 1 KB messages are published (LMDB, the default): the broker's RssAnon stays
    within N x RDY x 1 KB x 2 + 200 MB, every message reaches the healthy consumer, and
    the stuck ones are closed by the write deadline."""
    broker = start_broker("--msg-timeout=3s", "--queue-scan-interval=50ms")
    topic = "stuck"
    hello = (MAGIC + identify(heartbeat_interval=HEARTBEAT_MS) + command(f"SUB {topic} c")
             + command(f"RDY {STUCK_RDY}"))
    stuck = []
    for _ in range(STUCK):
        s = lazy_reader(broker, 4096)
        s.sendall(hello)
        stuck.append(s)
    stop = threading.Event()
    seen: set[bytes] = set()
    counts = {"messages": 0, "slow_bytes": 0}

    def slow_reader() -> None:
        s = lazy_reader(broker, 4096)
        s.sendall(hello)
        s.settimeout(0.5)
        while not stop.is_set():
            try:
                data = s.recv(2048)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            counts["slow_bytes"] += len(data)
            time.sleep(0.1)  # ~20 KB/s

    def healthy() -> None:
        with RawConn(broker, timeout=1) as conn:
            conn.send(command(f"SUB {topic} c") + command("RDY 2500"))
            buf = b""
            while not stop.is_set():
                try:
                    data = conn.sock.recv(1 << 20)
                except TimeoutError:
                    continue
                if not data:
                    return
                buf += data
                pos, end, out = 0, len(buf), []
                while end - pos >= 8:
                    size, ftype = struct.unpack_from(">ii", buf, pos)
                    if end - pos - 4 < size:
                        break
                    if ftype == FRAME_MESSAGE:
                        counts["messages"] += 1
                        seen.add(buf[pos + 34:pos + 42])
                        out.append(b"FIN " + buf[pos + 18:pos + 34] + b"\n")
                    elif ftype == FRAME_RESPONSE and buf[pos + 8:pos + 4 + size] == b"_heartbeat_":
                        out.append(b"NOP\n")
                    pos += 4 + size
                buf = buf[pos:]
                if out:
                    conn.send(b"".join(out))

    threads = [threading.Thread(target=slow_reader, daemon=True), threading.Thread(target=healthy, daemon=True)]
    started = time.monotonic()
    with measured(broker, f"{STUCK} stuck consumers") as out:
        for t in threads:
            t.start()
        with RawConn(broker, timeout=30) as publisher:
            for start in range(0, MESSAGES, 500):
                publisher.send(command(f"MPUB {topic}", mpub_body(bodies(500, start))))
                assert publisher.read_frame() == (FRAME_RESPONSE, b"OK")
        deadline = time.monotonic() + (300 if FIGURES else 40)
        while len(seen) < MESSAGES and time.monotonic() < deadline:
            time.sleep(0.2)
        out["detail"] = f"{len(seen):,} of {MESSAGES:,} x 1 KB received by the healthy consumer"
    elapsed = time.monotonic() - started
    # Each was paused within moments of the first delivery: the write deadline closes it one
    # heartbeat interval later (the read timeout alone would take two).
    # (Not read before then: reading them would make them consumers that drain.)
    time.sleep(max(0.0, started + HEARTBEAT_MS / 1000 * 1.5 + 2 - time.monotonic()))
    closed = _wait_closed(stuck, time.monotonic() + 5)
    code, stats = broker.get("/stats?format=json&topic=stuck")
    assert code == 200
    left = [c for ch in stats["topics"][0]["channels"] for c in ch["clients"]]
    stop.set()
    for t in threads:
        t.join(5)
    for s in stuck:
        s.close()
    time.sleep(1)
    end_anon = _rss_anon_mb(broker.proc.pid)
    r = out["result"]
    print(f"\n{STUCK} stuck consumers (RDY {STUCK_RDY}, heartbeat {HEARTBEAT_MS / 1000:.0f} s) + 1 slow "
          f"reader, {MESSAGES:,} x 1 KB on LMDB, all received in {elapsed:.0f} s: VmRSS {r.baseline_mb:.0f} "
          f"-> peak {r.peak_mb:.0f} MB, RssAnon {r.anon_baseline_mb:.0f} -> peak {r.anon_peak_mb:.0f} MB, "
          f"{end_anon:.0f} MB once the stuck ones were closed; healthy consumer got "
          f"{counts['messages']:,} frames ({len(seen):,} distinct); slow reader read "
          f"{counts['slow_bytes'] / 1024:.0f} KB; {closed} of {STUCK} stuck consumers closed within "
          f"{HEARTBEAT_MS / 1000 * 1.5 + 2:.0f} s; clients left: {len(left)}")
    bound_mb = STUCK * STUCK_RDY * BODY_SIZE * 2 / 2**20 + 200
    assert r.anon_growth_mb < bound_mb, f"RssAnon grew by {r.anon_growth_mb:.0f} MB (bound {bound_mb:.0f} MB)"
    assert len(seen) == MESSAGES, f"{MESSAGES - len(seen)} messages never reached the healthy consumer"
    assert closed == STUCK, f"{STUCK - closed} stuck consumers still connected"
    assert broker.running
    broker.stop_cleanly()
