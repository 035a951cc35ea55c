"""A V2 connection's memory stays bounded whatever the client does.

- A client that never reads its answers: the broker stops reading the
  connection while its unsent output is over a bound (the protocol is a
  streaming producer of its transport) and stops handing it messages.
- A client that streams while its AUTH waits on the auth server: the
  connection is not read until the answer comes.
- A compressed stream that inflates to far more than was sent: it is
  inflated in bounded steps, with other connections served in between,
  and snappy chunks larger than the format allows close the connection.

Unit tests drive the protocol on StringTransports (the transport's
producer calls are made by hand, as the reactor's TCP transport makes
them); integration tests flood a real broker (plain, TLS, deflate, TLS +
deflate) and read its RSS from /proc.
"""

from __future__ import annotations

import json
import ssl
import struct
import time
import tracemalloc

import pytest

from mqd.nsqd.protocol.upgrades import UPGRADE_GAP
from mqd.wire.compression import SNAPPY_STREAM_HEADER
from tests.support.auth_fakes import FakeAuth, answer, auth
from tests.support.authd import PUBLISH, grant
from tests.support.certs import client_context, tls_flags
from tests.support.codec_clients import DeflateClient, SnappyClient
from tests.support.raw_conn import (
    FRAME_ERROR,
    FRAME_RESPONSE,
    RawConn,
    UpgradingConn,
    command,
    select_sockets,
)
from tests.support.v2_client import Client, tls_client
from tests.support.v2_frames import Msg, cmd, err, identify, ok, parse_frames, pub

BAD_ID = b"0123456789abcdef"
FIN_FAILED = b"E_FIN_FAILED FIN 0123456789abcdef failed ID not in flight"


def split_first_frame(data: bytes) -> tuple[bytes, bytes]:
    size = struct.unpack_from(">i", data)[0]
    return data[8:4 + size], data[4 + size:]


def compressed_client(connect, kind: str = "deflate"):
    """A client that negotiated `kind`, and its side of the codec."""
    c = connect()
    c.send(identify(feature_negotiation=True, **{kind: True}))
    _, rest = split_first_frame(c.raw())
    assert rest == b""  # the compressed OK is a later write, as nsqd sends it
    c.broker.clock.advance(UPGRADE_GAP)
    codec = DeflateClient() if kind == "deflate" else SnappyClient()
    assert parse_frames(codec.decompress(c.raw())) == [ok()]
    return c, codec


def consumer(connect, rdy=100):
    c = connect()
    c.sub(rdy=rdy)
    return c


# -- output for a client that does not read ----------------------------------------


def test_connection_is_a_streaming_producer_of_its_transport(connect):
    c = connect()
    assert c.transport.producer is c.proto
    assert c.transport.streaming is True


def test_output_backlog_stops_reading_until_drained(connect):
    c = consumer(connect)
    # The transport's write buffer passed its high-water mark.
    c.proto.pauseProducing()
    assert c.transport.producerState == "paused"
    c.proto.pauseProducing()  # the transport says it again on every write while full
    # ... and drained.
    c.proto.resumeProducing()
    assert c.transport.producerState == "producing"
    assert c.request(cmd("FIN", BAD_ID)) == [err(FIN_FAILED)]


def test_backed_up_consumer_is_not_handed_messages(connect, publish):
    c = consumer(connect, rdy=100)
    c.proto.pauseProducing()
    publish(b"a", b"b", b"c")
    assert c.read() == []
    assert c.proto.ready() == 0
    c.proto.resumeProducing()
    assert [m.body for m in c.messages()] == [b"a", b"b", b"c"]
    assert c.proto.ready() == 97


def test_close_while_paused_lets_the_transport_close(connect):
    """A registered producer keeps Twisted's transports (TLS's above all) from closing: it goes first."""
    c = consumer(connect)
    assert c.transport.producer is c.proto
    c.proto.pauseProducing()
    c.send(cmd("RDY", "x"))  # fatal
    assert c.closed
    assert c.transport.producer is None


def test_tls_handshake_pause_keeps_reading(inproc_broker):
    """Until the handshake is done the TLS layer holds the OK back and pauses its producer:
    the connection must still read, or the handshake never completes."""
    c = tls_client(inproc_broker)
    c.send(identify(feature_negotiation=True, tls_v1=True))
    assert c.proto.tls and not c.proto.tls_version
    c.proto.pauseProducing()
    assert c.transport.producerState == "producing"
    c.proto.resumeProducing()
    assert c.transport.producerState == "producing"


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class _Frames:
    """Counts the frames of a stream fed in pieces, without keeping them."""

    def __init__(self) -> None:
        self.buf = b""
        self.errors = 0
        self.other: list[tuple[int, bytes]] = []

    def feed(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, end = 0, len(buf)
        unpack = struct.unpack_from
        while end - pos >= 8:
            size, ftype = unpack(">ii", buf, pos)
            if end - pos - 4 < size:
                break
            payload = buf[pos + 8:pos + 4 + size]
            if ftype == FRAME_ERROR and payload == FIN_FAILED:
                self.errors += 1
            elif not (ftype == FRAME_RESPONSE and payload == b"_heartbeat_"):
                self.other.append((ftype, payload))
            pos += 4 + size
        self.buf = buf[pos:]


FLOOD = 20 * 1024 * 1024


@pytest.mark.parametrize("kind", ["plain", "tls", "deflate", "tls+deflate"])
def test_client_that_never_reads_keeps_broker_memory_bounded(start_broker, certs, kind):
    broker = start_broker(*tls_flags(certs)) if kind.startswith("tls") else start_broker()
    pid = broker.proc.pid
    flooder = UpgradingConn(broker)
    if kind != "plain":
        flooder.negotiate(tls=client_context(certs) if kind.startswith("tls") else None,
                          deflate=kind.endswith("deflate"))
    flooder.send(command("SUB flood ch"))
    assert flooder.read_frame() == (FRAME_RESPONSE, b"OK")
    line = b"FIN " + BAD_ID + b"\n"
    count = FLOOD // len(line)
    stream = line * count + command("PUB flood", b"last")
    wire = flooder.codec.compress(stream) if flooder.codec else stream
    baseline = _rss_kib(pid)
    peak = baseline

    # Phase 1: send without reading, until all is sent or the broker stops taking it.
    sock = flooder.sock
    sock.setblocking(False)
    sent, stalled_since = 0, None
    while sent < len(wire):
        _, writable = select_sockets([], [sock], 0.2)
        peak = max(peak, _rss_kib(pid))
        if writable:
            try:
                sent += sock.send(wire[sent:sent + 1024 * 1024])
                stalled_since = None
                continue
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                pass
        stalled_since = stalled_since or time.monotonic()
        if time.monotonic() - stalled_since > 2.0:
            break
    # Let the broker work through what it took, and watch its memory while it does.
    last_growth = time.monotonic()
    deadline = last_growth + 30
    while time.monotonic() - last_growth < 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
        rss = _rss_kib(pid)
        if rss > peak + 512:
            last_growth = time.monotonic()
        peak = max(peak, rss)
    growth_mib = (peak - baseline) / 1024
    print(f"{kind}: sent {sent / 2**20:.1f} of {len(wire) / 2**20:.1f} MiB on the wire "
          f"({len(stream) / 2**20:.1f} MiB of commands) unread; RSS +{growth_mib:.1f} MiB")
    assert growth_mib < 64, f"RSS grew by {growth_mib:.0f} MiB for a client that never reads"
    if flooder.codec is None:
        # The broker stopped reading it, as nsqd does once the socket buffers are full.
        assert sent < len(wire), f"the broker read all {sent} bytes of a client that never reads"

    # Another client is served meanwhile.
    with RawConn(broker) as control:
        control.send(command("PUB control", b"x"))
        assert control.read_frame() == (FRAME_RESPONSE, b"OK")

    # Phase 2: reading the answers lets everything through, in order, and the connection works.
    frames = _Frames()
    deadline = time.monotonic() + 120
    while not frames.other and time.monotonic() < deadline:
        want_write = [sock] if sent < len(wire) else []
        readable, writable = select_sockets([sock], want_write, 1.0)
        if writable:
            try:
                sent += sock.send(wire[sent:sent + 1024 * 1024])
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                pass
        if readable or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            try:
                chunk = sock.recv(1024 * 1024)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                continue
            assert chunk, "the broker closed the connection"
            frames.feed(flooder._decode(chunk))
    assert frames.other == [(FRAME_RESPONSE, b"OK")]
    assert frames.errors == count
    sock.setblocking(True)
    sock.settimeout(5)
    flooder.send(command("PUB flood", b"again"))
    assert flooder.read_frame() == (FRAME_RESPONSE, b"OK")
    flooder.close()


@pytest.mark.parametrize("deflate", [False, True])
def test_tls_connection_with_a_producer_still_closes_on_a_fatal_error(start_broker, certs, deflate):
    """The TLS layer keeps a connection whose producer is registered open: closing unregisters it."""
    broker = start_broker(*tls_flags(certs))
    with UpgradingConn(broker) as conn:
        conn.negotiate(tls=client_context(certs), deflate=deflate)
        conn.send(command("RDY 1"))
        assert conn.read_frame() == (FRAME_ERROR, b"E_INVALID cannot RDY in current state")
        conn.expect_closed()


# -- input while AUTH waits on the auth server --------------------------------------


@pytest.fixture
def auth_broker(make_broker, tmp_path):
    path = tmp_path / "auth"
    path.mkdir()
    broker = make_broker(path=str(path), auth_http_address=["127.0.0.1:4181"],
                         max_body_size=4096, max_msg_size=1024)
    broker.auth.fetch_function = broker.fake_auth = FakeAuth()
    return broker


def test_pending_auth_stops_reading(auth_broker):
    c = Client(auth_broker)
    c.send(auth() + pub("t", b"a"))
    assert c.transport.producerState == "paused"
    auth_broker.fake_auth.reply(answer())
    assert c.transport.producerState == "producing"
    [identity, published] = c.read()
    assert json.loads(identity.payload)["identity"] == "alice"
    assert published == ok()


def test_auth_and_output_pauses_are_independent(auth_broker):
    c = Client(auth_broker)
    c.send(auth())
    c.proto.pauseProducing()  # output backed up too
    auth_broker.fake_auth.reply(answer())
    assert c.transport.producerState == "paused"  # still backed up
    c.proto.resumeProducing()
    assert c.transport.producerState == "producing"
    # The other order.
    d = Client(auth_broker, port=5555)
    d.proto.pauseProducing()
    d.send(auth())
    d.proto.resumeProducing()
    assert d.transport.producerState == "paused"  # still waiting for the auth server
    auth_broker.fake_auth.reply(answer())
    assert d.transport.producerState == "producing"


def test_auth_failure_closes_with_the_producer_unregistered(auth_broker):
    c = Client(auth_broker)
    c.send(auth())
    auth_broker.fake_auth.pending.pop(0).errback(ConnectionRefusedError("refused"))
    assert c.read() == [err("E_AUTH_FAILED AUTH failed")]
    assert c.closed
    assert c.transport.producer is None


def test_input_kept_during_auth_on_a_deflate_connection_is_parsed_once(auth_broker):
    """What waited for the auth server is plaintext already: it must not be inflated again."""
    c, codec = compressed_client(lambda: Client(auth_broker))
    c.send(codec.compress(auth() + pub("t", b"a")))
    auth_broker.fake_auth.reply(answer())
    frames = parse_frames(codec.decompress(c.raw()))
    assert not c.closed
    assert [f.type for f in frames] == [0, 0] and frames[1] == ok()
    assert auth_broker.topics["t"].depth() == 1


def test_client_streaming_while_auth_waits_keeps_broker_memory_bounded(start_broker, authd):
    authd.answers["slow"] = grant(PUBLISH, identity="slowpoke")
    authd.slow.add("slow")  # answered after 3 s
    broker = start_broker(f"--auth-http-address={authd.address}", "--http-client-request-timeout=10s")
    pid = broker.proc.pid
    with RawConn(broker, timeout=15) as conn:
        conn.send(command("IDENTIFY", b"{}"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        baseline = peak = _rss_kib(pid)
        conn.send(command("AUTH", b"slow"))
        # Stream NOPs while the auth server thinks, until the broker stops taking them.
        flood = b"NOP\n" * (50 * 1024 * 1024)  # 200 MiB
        sock = conn.sock
        sock.setblocking(False)
        sent, stalled_since, started = 0, None, time.monotonic()
        while sent < len(flood) and time.monotonic() - started < 2.5:
            _, writable = select_sockets([], [sock], 0.1)
            peak = max(peak, _rss_kib(pid))
            if writable:
                try:
                    sent += sock.send(flood[sent:sent + 1024 * 1024])
                    stalled_since = None
                    continue
                except BlockingIOError:
                    pass
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > 1.0:
                break
        peak = max(peak, _rss_kib(pid))
        growth_mib = (peak - baseline) / 1024
        print(f"sent {sent / 2**20:.1f} MiB while AUTH waited; RSS +{growth_mib:.1f} MiB")
        assert growth_mib < 64, f"RSS grew by {growth_mib:.0f} MiB while AUTH waited"
        assert sent < len(flood), "the broker read everything while AUTH waited"
        # Once the answer is in, the connection reads on: the rest of the line, then a PUB.
        sock.setblocking(True)
        sock.settimeout(15)
        conn.send(flood[sent:sent + (-sent % 4)] + command("PUB t", b"after"))
        frame_type, payload = conn.read_frame()
        assert frame_type == FRAME_RESPONSE and json.loads(payload)["identity"] == "slowpoke"
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")


def test_input_piling_up_past_any_command_closes(auth_broker):
    """Input that arrives while parsing waits (a TLS record decrypted after the pause) is
    bounded by what one command can need: max-body-size and a line."""
    c = Client(auth_broker)
    c.send(auth())
    c.send(b"NOP\n" * 1024)  # a little is kept
    assert not c.closed
    c.send(b"NOP\n" * (256 * 1024 // 4))  # 256 KiB: more than a 4 KiB body and a 64 KiB line
    assert c.closed


# -- compressed input that inflates to much more ------------------------------------


BOMB_NOPS = 4 * 1024 * 1024  # 16 MiB of NOP once inflated


def _bomb(codec) -> bytes:
    return codec.compress(b"NOP\n" * BOMB_NOPS + pub("t", b"after the bomb"))


def reactor_turn(clock) -> None:
    """Run the calls due now, as one reactor iteration does: not those they schedule."""
    due = [call for call in clock.getDelayedCalls() if call.getTime() <= clock.seconds()]
    for call in due:
        clock.calls.remove(call)
        call.called = 1
        call.func(*call.args, **call.kw)


def test_deflate_bomb_is_inflated_in_bounded_steps(connect, publish, clock, inproc_broker):
    c, codec = compressed_client(connect)
    bomb = _bomb(codec)
    assert len(bomb) < 64 * 1024
    tracemalloc.start()
    try:
        c.send(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024, f"one read inflated to {peak} bytes"
    assert codec.decompress(c.raw()) == b""  # not through the bomb yet
    # A bystander is served while the bomb waits.
    publish(b"bystander")
    assert inproc_broker.topics["t"].depth() == 1
    steps = 0
    while not c.transport.value():
        reactor_turn(clock)
        steps += 1
        assert steps < 1000
        publish(b"bystander %d" % steps)  # served between any two steps
    assert parse_frames(codec.decompress(c.raw())) == [ok()]
    assert steps >= 16 * 1024 * 1024 // (256 * 1024)  # at most 256 KiB a turn
    assert inproc_broker.topics["t"].depth() == 1 + steps + 1  # bystanders and the bomb's PUB


def test_paused_connection_stops_inflating(connect, clock, inproc_broker):
    c, codec = compressed_client(connect)
    c.send(_bomb(codec))
    c.proto.pauseProducing()  # its output backed up meanwhile
    for _ in range(200):
        clock.advance(0)
    assert c.transport.value() == b""
    assert "t" not in inproc_broker.topics
    c.proto.resumeProducing()
    for _ in range(200):
        clock.advance(0)
    assert parse_frames(codec.decompress(c.raw())) == [ok()]
    assert inproc_broker.topics["t"].depth() == 1


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_stepwise_inflating_keeps_compressed_streams_whole(connect, inproc_broker, clock, kind):
    c, codec = compressed_client(connect, kind)
    bodies = [bytes([i]) * (100_000 + i) for i in range(5)]
    data = codec.compress(b"".join(pub("t", b) for b in bodies))
    c.send(data[:5])
    c.send(data[5:])
    clock.advance(0)
    assert parse_frames(codec.decompress(c.raw())) == [ok()] * 5
    assert inproc_broker.topics["t"].depth() == 5


def test_deflate_bomb_does_not_stall_other_clients(start_broker):
    broker = start_broker()
    pid = broker.proc.pid
    with UpgradingConn(broker) as bomber, RawConn(broker, timeout=5) as control:
        bomber.negotiate(deflate=True)
        baseline = _rss_kib(pid)
        bomber.send(b"NOP\n" * (25 * 1024 * 1024))  # 100 MiB inflated, ~100 KB sent
        time.sleep(0.2)
        worst, peak = 0.0, baseline
        for i in range(10):
            started = time.monotonic()
            control.send(command("PUB control", b"%d" % i))
            assert control.read_frame() == (FRAME_RESPONSE, b"OK")
            worst = max(worst, time.monotonic() - started)
            peak = max(peak, _rss_kib(pid))
            time.sleep(0.05)
        growth_mib = (peak - baseline) / 1024
        print(f"deflate bomb: slowest answer to another client {worst * 1000:.0f} ms; RSS +{growth_mib:.1f} MiB")
        assert worst < 1.0
        assert growth_mib < 64


def _snappy_chunk_header(chunk_type: int, length: int) -> bytes:
    return bytes([chunk_type]) + length.to_bytes(3, "little")


# Go's snappy reader (nsqd's) reads a chunk into a buffer of
# maxEncodedLenOfMaxBlockSize + checksum = 76490 + 4 bytes; a longer one is refused.
SNAPPY_MAX_CHUNK = 76494


@pytest.mark.parametrize("chunk_type", [0x00, 0x01, 0x80])
def test_oversize_snappy_chunk_header_closes(connect, chunk_type):
    c, _ = compressed_client(connect, "snappy")
    c.send(SNAPPY_STREAM_HEADER + _snappy_chunk_header(chunk_type, SNAPPY_MAX_CHUNK + 1))
    assert c.closed
    assert c.raw() == b""  # nsqd closes without a frame


def test_snappy_chunk_at_the_limit_is_awaited(connect):
    c, _ = compressed_client(connect, "snappy")
    c.send(SNAPPY_STREAM_HEADER + _snappy_chunk_header(0x00, SNAPPY_MAX_CHUNK))
    assert not c.closed


def test_snappy_uncompressed_chunk_over_block_size_closes(connect):
    import cramjam

    c, _ = compressed_client(connect, "snappy")
    data = b"x" * 65537
    crc = bytes(cramjam.snappy.compress(data))[10:14]  # any checksum: the size is checked first
    c.send(SNAPPY_STREAM_HEADER + _snappy_chunk_header(0x01, 4 + len(data)) + crc + data)
    assert c.closed


def test_snappy_compressed_chunk_over_block_size_closes(connect):
    c, _ = compressed_client(connect, "snappy")
    # A block that declares 1 MiB of output (varint), within the chunk size limit.
    block = b"\x80\x80\x40" + b"\x00" * 100
    c.send(SNAPPY_STREAM_HEADER + _snappy_chunk_header(0x00, 4 + len(block)) + b"\0\0\0\0" + block)
    assert c.closed


def test_bystander_messages_flow_while_a_bomb_is_inflated(connect, publish, clock, inproc_broker):
    c, codec = compressed_client(connect)
    reader = consumer(connect, rdy=10)
    c.send(_bomb(codec))
    publish(b"during")
    assert [m.body for m in reader.messages() if isinstance(m, Msg)] == [b"during"]
    for _ in range(1000):
        if c.transport.value():
            break
        clock.advance(0)
    assert parse_frames(codec.decompress(c.raw())) == [ok()]

