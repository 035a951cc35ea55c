"""The client protocol once connected, on StringTransports: commands, errors, messages, loss.

Server frames are built with the broker's framing; the read timeout runs on
a task.Clock. The last tests pair the client with a real broker protocol,
byte for byte, and check the endpoints connect() builds. The connection's
set-up (IDENTIFY, TLS, compression, AUTH) is in test_client_handshake.py.
"""

from __future__ import annotations

import struct

import pytest
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from mqd.client import errors
from mqd.client.config import Config
from mqd.client.errors import ConnectionClosed, HeartbeatTimeout
from mqd.client.message import Message, decode_message
from mqd.client.protocol import ConnectionFactory, NSQClientProtocol
from mqd.message import FRAME_HEAD, ID_SIZE
from mqd.wire.framing import CLOSE_WAIT, HEARTBEAT, OK
from tests.support.client_conn import (
    ADDRESS,
    MSG_ID,
    Conn,
    Recorder,
    TLSTransport,
    error,
    message_frame,
    outcome,
    ready,
    server_json,
)
from tests.support.v2_client import Client
from tests.support.v2_frames import sized

# -- commands and errors -------------------------------------------------------------


def test_command_bytes():
    conn = ready()
    conn.proto.pub("topic", b"abc")
    conn.proto.mpub("topic", [b"a", b"bc"])
    conn.proto.dpub("topic", 1500, b"later")
    conn.proto.sub("topic", "chan#ephemeral")
    assert conn.written() == (
        b"PUB topic\n" + sized(b"abc")
        + b"MPUB topic\n" + sized(struct.pack(">i", 2) + sized(b"a") + sized(b"bc"))
        + b"DPUB topic 1500\n" + sized(b"later")
        + b"SUB topic chan#ephemeral\n"
    )


def test_pipelined_answers_in_order():
    conn = ready()
    ds = [conn.proto.pub("t", b"%d" % i) for i in range(3)]
    assert conn.written() == b"".join(b"PUB t\n" + sized(b"%d" % i) for i in range(3))
    assert [outcome(d) for d in ds] == ["pending"] * 3
    conn.feed(OK)
    assert [outcome(d) for d in ds] == [b"OK", "pending", "pending"]
    conn.feed(OK + OK)
    assert [outcome(d) for d in ds] == [b"OK", b"OK", b"OK"]


def test_fatal_error_in_the_middle_of_a_pipeline():
    conn = ready()
    ds = [conn.proto.pub("t", b"x") for _ in range(3)]
    conn.feed(OK + error(b"E_BAD_MESSAGE PUB message too big 2000000 > 1048576"))
    assert outcome(ds[0]) == b"OK"
    err = outcome(ds[1])
    assert isinstance(err, errors.BadMessageError) and err.fatal
    assert outcome(ds[2]) == "pending"
    assert conn.transport.disconnecting
    conn.lose()
    later = outcome(ds[2])
    assert isinstance(later, ConnectionClosed) and later.reason is err
    closed = conn.delegate.events[-1]
    assert closed[0] == "closed" and closed[1].value is err
    # Nothing more goes out on a closed connection.
    assert isinstance(outcome(conn.proto.pub("t", b"y")), ConnectionClosed)


@pytest.mark.parametrize("text", [b"E_FIN_FAILED FIN 0123456789abcdef failed ID not in flight",
                                  b"E_REQ_FAILED REQ 0123456789abcdef failed ID not in flight",
                                  b"E_TOUCH_FAILED TOUCH 0123456789abcdef failed ID not in flight"])
def test_non_fatal_errors_pop_nothing(text):
    conn = ready()
    d = conn.proto.pub("t", b"x")
    conn.feed(error(text))
    assert outcome(d) == "pending"
    kind, err = conn.delegate.events[-1]
    assert kind == "error" and not err.fatal and str(err) == text.decode()
    assert not conn.transport.disconnecting
    conn.feed(OK)
    assert outcome(d) == b"OK"


def test_fatal_error_with_no_command_waiting_goes_to_the_delegate():
    conn = ready()
    conn.proto.rdy(100000)
    conn.feed(error(b"E_INVALID RDY count 100000 out of range 0-2500"))
    kind, err = conn.delegate.events[-1]
    assert kind == "error" and isinstance(err, errors.InvalidError)
    assert conn.transport.disconnecting


def test_cls_fires_on_close_wait():
    conn = ready()
    d = conn.proto.cls()
    assert conn.proto.closing
    assert conn.written() == b"CLS\n"
    conn.feed(CLOSE_WAIT)
    assert outcome(d) == b"CLOSE_WAIT"


def test_heartbeat_answered_with_nop_pops_nothing():
    conn = ready()
    d = conn.proto.pub("t", b"x")
    conn.written()
    conn.feed(HEARTBEAT)
    assert conn.written() == b"NOP\n"
    assert conn.delegate.kinds()[-1] == "heartbeat"
    assert outcome(d) == "pending"
    conn.feed(OK)
    assert outcome(d) == b"OK"


def test_unexpected_response_is_ignored():
    conn = ready()
    conn.feed(OK)
    assert not conn.transport.disconnecting


@pytest.mark.parametrize("data", [
    struct.pack(">ii", 2, 0),  # size below the type's 4 bytes
    struct.pack(">ii", 5, 7) + b"x",  # unknown frame type
    struct.pack(">ii", 9, 2) + b"short",  # message frame shorter than its header
])
def test_bad_frames_close_the_connection(data):
    conn = ready()
    d = conn.proto.pub("t", b"x")
    conn.feed(data)
    assert conn.transport.disconnecting
    conn.lose()
    err = outcome(d)
    assert isinstance(err, ConnectionClosed) and "protocol error" in str(err)


def test_message_before_the_handshake_ended_closes():
    conn = Conn()
    conn.feed(message_frame())
    assert conn.transport.disconnecting
    assert isinstance(conn.results[0].value, ConnectionClosed)


# -- the read timeout ----------------------------------------------------------------


def test_read_timeout_reports_heartbeat_timeout():
    conn = ready(read_timeout=10, heartbeat_interval=5)
    d = conn.proto.pub("t", b"x")
    conn.clock.advance(9.9)
    conn.feed(HEARTBEAT)  # any read restarts the deadline
    conn.clock.advance(9.9)
    assert not conn.transport.disconnecting
    conn.clock.advance(0.2)
    assert conn.transport.disconnected  # aborted: a dead peer would never drain a clean close
    conn.lose()
    assert isinstance(outcome(d), HeartbeatTimeout)
    kind, reason = conn.delegate.events[-1]
    assert kind == "closed" and isinstance(reason.value, HeartbeatTimeout)


def test_read_timeout_during_the_handshake():
    conn = Conn(read_timeout=5, heartbeat_interval=1)
    conn.clock.advance(5)
    assert conn.transport.disconnecting
    conn.lose()
    assert isinstance(conn.results[0].value, HeartbeatTimeout)


def test_no_timer_left_after_loss():
    conn = ready()
    conn.lose()
    assert conn.clock.getDelayedCalls() == []


# -- messages ---------------------------------------------------------------------------


def test_message_frame_to_message():
    conn = ready()
    conn.clock.advance(5)
    conn.feed(message_frame(b"payload", attempts=3, timestamp=123456789))
    kind, msg = conn.delegate.events[-1]
    assert kind == "message" and isinstance(msg, Message)
    assert (msg.id, msg.body, msg.attempts, msg.timestamp, msg.nsqd_address) == \
        (MSG_ID, b"payload", 3, 123456789, ADDRESS)
    assert type(msg.body) is bytes
    assert conn.proto.in_flight == 1
    assert conn.proto.last_message_at == conn.clock.seconds()
    assert not msg.has_responded()


def test_decode_message_matches_the_broker_layout():
    data = message_frame(b"abc", attempts=2, timestamp=42)
    assert len(data) == FRAME_HEAD.size + ID_SIZE + 3
    msg = decode_message(data[8:], "a:1")
    assert (msg.id, msg.body, msg.attempts, msg.timestamp, msg.nsqd_address) == (MSG_ID, b"abc", 2, 42, "a:1")
    with pytest.raises(ValueError):
        decode_message(b"\x00" * 25, "a:1")


def test_many_messages_in_one_read_and_split_reads():
    conn = ready()
    frames = b"".join(message_frame(b"m%d" % i, msg_id=b"%016d" % i) for i in range(50))
    conn.feed(frames[:1000])
    conn.feed(frames[1000:1001])
    conn.feed(frames[1001:])
    msgs = [e[1] for e in conn.delegate.events if e[0] == "message"]
    assert [m.body for m in msgs] == [b"m%d" % i for i in range(50)]
    assert conn.proto.in_flight == 50


def test_finish_requeue_touch_bytes():
    conn = ready()
    conn.feed(message_frame(msg_id=b"a" * 16) + message_frame(msg_id=b"b" * 16, attempts=3)
              + message_frame(msg_id=b"c" * 16, attempts=20) + message_frame(msg_id=b"d" * 16))
    a, b, c, d = (e[1] for e in conn.delegate.events if e[0] == "message")
    conn.written()
    a.touch()
    a.finish()
    b.requeue()  # default_requeue_delay × attempts = 270 s
    c.requeue(backoff=False)  # 20 × 90 s capped by max_requeue_delay (15 m)
    d.requeue(2.5)
    assert conn.written() == (b"TOUCH " + b"a" * 16 + b"\n" + b"FIN " + b"a" * 16 + b"\n"
                              + b"REQ " + b"b" * 16 + b" 270000\n" + b"REQ " + b"c" * 16 + b" 900000\n"
                              + b"REQ " + b"d" * 16 + b" 2500\n")
    assert conn.proto.in_flight == 0
    assert [(e[0], e[1].id) + e[2:] for e in conn.delegate.events if e[0] in ("finished", "requeued")] == [
        ("finished", b"a" * 16), ("requeued", b"b" * 16, True), ("requeued", b"c" * 16, False),
        ("requeued", b"d" * 16, True)]
    assert all(m.has_responded() for m in (a, b, c, d))


def test_responding_twice_is_a_no_op():
    conn = ready()
    conn.feed(message_frame())
    msg = conn.delegate.events[-1][1]
    conn.written()
    msg.finish()
    msg.finish()
    msg.requeue(1)
    msg.touch()
    assert conn.written() == b"FIN " + MSG_ID + b"\n"
    assert conn.proto.in_flight == 0
    assert conn.delegate.kinds().count("finished") == 1


def test_auto_response_flag():
    conn = ready()
    conn.feed(message_frame())
    msg = conn.delegate.events[-1][1]
    assert not msg.is_auto_response_disabled()
    msg.disable_auto_response()
    assert msg.is_auto_response_disabled()


def test_fire_and_forget_bytes_and_rdy_state():
    conn = ready()
    conn.clock.advance(3)
    conn.proto.rdy(25)
    assert (conn.proto.rdy_count, conn.proto.last_rdy_count, conn.proto.last_rdy_at) == \
        (25, 25, conn.clock.seconds())
    at = conn.clock.seconds()
    conn.clock.advance(1)
    conn.proto.rdy(0)
    assert (conn.proto.rdy_count, conn.proto.last_rdy_at) == (0, at)
    conn.proto.fin(MSG_ID)
    conn.proto.req(MSG_ID, 1000)
    conn.proto.touch(MSG_ID)
    conn.proto.nop()
    assert conn.written() == (b"RDY 25\nRDY 0\nFIN " + MSG_ID + b"\nREQ " + MSG_ID + b" 1000\nTOUCH "
                              + MSG_ID + b"\nNOP\n")


# -- connection loss ------------------------------------------------------------------


def test_connection_loss_fails_everything():
    conn = ready()
    ds = [conn.proto.pub("t", b"x"), conn.proto.sub("t", "c"), conn.proto.cls()]
    conn.lose(ConnectionLost())
    for d in ds:
        err = outcome(d)
        assert isinstance(err, ConnectionClosed) and not isinstance(err, HeartbeatTimeout)
        assert isinstance(err.reason.value, ConnectionLost)
    assert not conn.proto.connected
    kind, reason = conn.delegate.events[-1]
    assert kind == "closed" and isinstance(reason.value, ConnectionLost)
    assert isinstance(outcome(conn.proto.pub("t", b"x")), ConnectionClosed)


def test_data_after_close_is_ignored():
    conn = ready()
    conn.proto.close()
    assert conn.transport.disconnecting
    conn.feed(message_frame())
    assert "message" not in conn.delegate.kinds()


def test_factory_builds_the_protocol():
    config = Config()
    delegate = Recorder()
    clock = Clock()
    factory = ConnectionFactory(config, delegate, ADDRESS, clock=clock)
    proto = factory.buildProtocol(None)
    assert isinstance(proto, NSQClientProtocol)
    assert (proto.config, proto.delegate, proto.address, proto.clock) == (config, delegate, ADDRESS, clock)


# -- against the broker's own protocol -------------------------------------------------


class Pair:
    """The client and a broker V2 connection, bytes shuttled between their StringTransports."""

    def __init__(self, broker, clock, **options) -> None:
        self.server = Client(broker, magic=False)
        self.clock = clock
        self.delegate = Recorder()
        self.client = NSQClientProtocol(Config(**options), self.delegate, ADDRESS, clock=clock)
        self.transport = TLSTransport()
        self.client.makeConnection(self.transport)
        self.results: list = []
        self.client.ready.addBoth(self.results.append)

    def pump(self, rounds: int = 10) -> None:
        for _ in range(rounds):
            up = self.transport.value()
            self.transport.clear()
            if up:
                self.server.send(up)
            self.clock.advance(0.01)  # the broker's upgrade gap and output buffer
            self.server.proto.flush_output()
            down = self.server.transport.value()
            self.server.transport.clear()
            if down:
                self.client.dataReceived(down)
            if not up and not down:
                return


@pytest.mark.parametrize("options", [{}, {"snappy": True}, {"deflate": True, "deflate_level": 1}],
                         ids=["plain", "snappy", "deflate"])
def test_against_the_broker(inproc_broker, clock, options):
    pair = Pair(inproc_broker, clock, max_in_flight=10, **options)
    pair.pump()
    assert pair.results == [pair.client], pair.results
    assert pair.client.server["max_rdy_count"] == inproc_broker.options.max_rdy_count
    if options:
        assert pair.client.compression == next(iter(options))
    published = [pair.client.pub("t", b"m%d" % i) for i in range(3)]
    published.append(pair.client.mpub("t", [b"x", b"y"]))
    subscribed = pair.client.sub("t", "c")
    pair.pump()
    assert [outcome(d) for d in published] == [b"OK"] * 4
    assert outcome(subscribed) == b"OK"
    pair.client.rdy(10)
    pair.pump()
    msgs = [e[1] for e in pair.delegate.events if e[0] == "message"]
    assert [m.body for m in msgs] == [b"m0", b"m1", b"m2", b"x", b"y"]
    for m in msgs:
        m.finish()
    pair.pump()
    assert inproc_broker.topics["t"].channels["c"].in_flight_count() == 0
    assert "error" not in pair.delegate.kinds()
    closed = pair.client.cls()
    pair.pump()
    assert outcome(closed) == b"CLOSE_WAIT"


def test_against_the_broker_errors(inproc_broker, clock):
    pair = Pair(inproc_broker, clock)
    pair.pump()
    pair.client.sub("t", "c")
    pair.client.fin(b"f" * 16)  # not in flight: non-fatal
    bad = pair.client.pub("bad*topic", b"x")
    pair.pump()
    errs = [e[1] for e in pair.delegate.events if e[0] == "error"]
    assert [type(e) for e in errs] == [errors.FinFailedError]
    failed = outcome(bad)
    assert isinstance(failed, errors.BadTopicError)
    assert str(failed) == 'E_BAD_TOPIC PUB topic name "bad*topic" is not valid'
    assert pair.server.closed


def test_not_connected_once_closing():
    conn = ready()
    conn.feed(error(b"E_INVALID cannot SUB in current state"))
    assert not conn.proto.connected
    other = ready()
    other.proto.close()
    assert not other.proto.connected and other.transport.disconnecting


# -- endpoints and connect() ------------------------------------------------------------


def test_client_endpoint_address_forms():
    from twisted.internet import endpoints
    from twisted.internet.testing import MemoryReactorClock

    from mqd.client.protocol import client_endpoint

    reactor = MemoryReactorClock()
    ep = client_endpoint(reactor, "nsqd.example:4150", 2.5)
    assert isinstance(ep, endpoints.HostnameEndpoint)
    assert ep._timeout == 2.5 and ep._bindAddress is None
    ep6 = client_endpoint(reactor, "[::1]:4150", 1.0, "[::1]:0")
    assert isinstance(ep6, endpoints.TCP6ClientEndpoint)
    assert (ep6._host, ep6._port, ep6._timeout, ep6._bindAddress) == ("::1", 4150, 1.0, ("::1", 0))
    assert client_endpoint(reactor, "h:1", 1.0, "10.0.0.2")._bindAddress == ("10.0.0.2", 0)
    assert client_endpoint(reactor, "h:1", 1.0, "10.0.0.2:5000")._bindAddress == ("10.0.0.2", 5000)
    with pytest.raises(ValueError, match="bad nsqd address 'nsqd'"):
        client_endpoint(reactor, "nsqd", 1.0)


def test_connect_fires_after_the_handshake(monkeypatch):
    from twisted.internet import defer

    from mqd.client import protocol as client_protocol

    clock = Clock()
    built = []

    class FakeEndpoint:
        def __init__(self, reactor, address, timeout, local_addr):
            built.append((address, timeout, local_addr))

        def connect(self, factory):
            proto = factory.buildProtocol(None)
            self.transport = StringTransport()
            proto.makeConnection(self.transport)
            built.append(proto)
            return defer.succeed(proto)

    monkeypatch.setattr(client_protocol, "client_endpoint", FakeEndpoint)
    config = Config(dial_timeout=3, local_addr="127.0.0.1")
    d = client_protocol.connect(clock, ADDRESS, config, Recorder())
    assert built[0] == (ADDRESS, 3.0, "127.0.0.1")
    proto = built[1]
    assert outcome(d) == "pending"
    proto.dataReceived(server_json())
    assert outcome(d) is proto
    assert proto.clock is clock


def test_connect_fails_with_the_handshake_error(monkeypatch):
    from twisted.internet import defer

    from mqd.client import protocol as client_protocol

    protos = []

    class FakeEndpoint:
        def __init__(self, *args):
            pass

        def connect(self, factory):
            proto = factory.buildProtocol(None)
            proto.makeConnection(StringTransport())
            protos.append(proto)
            return defer.succeed(proto)

    monkeypatch.setattr(client_protocol, "client_endpoint", FakeEndpoint)
    d = client_protocol.connect(Clock(), ADDRESS, Config(), None)
    protos[0].dataReceived(error(b"E_BAD_BODY IDENTIFY failed to decode JSON body"))
    assert isinstance(outcome(d), errors.BadBodyError)


def test_delegate_hears_of_the_loss_before_the_commands_fail():
    conn = ready()
    order = []
    conn.proto.pub("t", b"x").addErrback(lambda f: order.append(("errback", conn.proto.connected)))
    conn.delegate.connection_closed = lambda c, reason: order.append(("closed", reason.type))
    conn.lose(ConnectionLost())
    assert order == [("closed", ConnectionLost), ("errback", False)]
    late = outcome(conn.proto.pub("t", b"y"))
    assert isinstance(late, ConnectionClosed) and isinstance(late.reason.value, ConnectionLost)


def test_commands_while_closing_fail_at_once():
    conn = ready()
    conn.feed(error(b"E_BAD_TOPIC PUB topic name \"x y\" is not valid"))
    late = outcome(conn.proto.pub("t", b"y"))
    assert isinstance(late, ConnectionClosed) and isinstance(late.reason, errors.BadTopicError)
    assert conn.written() == b""
