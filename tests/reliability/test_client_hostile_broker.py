"""mqd.client, mq-*'s library, against a hostile broker and a hostile lookupd over real sockets.

A TCP server on 127.0.0.1 answers whatever hypothesis scripts: garbage
bytes, frames of types that do not exist, truncated frames, JSON nested
`[` × N or `{"a":` × N deep, sizes up to 2 GiB, OK and E_ answers where
none belongs, a valid-looking handshake first or not, some of it dripped
a byte at a time, then a close, an abort or silence. A Producer, a
Consumer and the broker's own lookupd client (mqd.nsqd.lookup_peer) connect
to it at once; a LookupdPoller asks a fake lookupd (twisted.web, or the
same raw server) whose answers are chosen the same way.

The oracle, per example:
- no traceback and no critical event logged (twisted.logger's
  log_failure: an exception out of dataReceived, "Unhandled error in
  Deferred", a failed callback);
- no hang: every publish, the consumer's first connection attempt, each
  lookupd poll and every stop settles within `SETTLE` seconds (the test's
  own bound; not a speed claim: the client's read_timeout is 0.25 s here);
- memory bounded: what a connection holds of an incomplete frame never
  exceeds the largest frame it accepts (max_msg_size plus a message
  header; --max-body-size for the lookupd client);
- a clean error: a publish either got its OK or failed with one of
  mqd.client.errors' types, the consumer's connect_to_nsqd likewise.

MQD_FUZZ_EXAMPLES=N runs N examples per test instead of the CI counts.
"""

from __future__ import annotations

import gc
import json
import os
import struct
from typing import Any

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, protocol, reactor
from twisted.internet.task import LoopingCall
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.web import resource, server

from mqd.client import discovery
from mqd.client.config import Config
from mqd.client.consumer import Consumer
from mqd.client.discovery import LookupdPoller
from mqd.client.errors import ConnectionClosed, NSQError, StoppedError
from mqd.client.producer import Producer
from mqd.client.protocol import NSQClientProtocol
from mqd.nsqd import lookup_peer as peer_module
from mqd.nsqd.lookup_peer import LookupPeer, LookupPeerProtocol
from tests.support.inprocess_broker import new_broker

_OVERRIDE = int(os.environ.get("MQD_FUZZ_EXAMPLES", "0"))
# Seconds: anything still pending after this is a hang. Every wait here ends within about a
# second (read_timeout 0.25 s, the poller's 0.25 s per lookupd, the peer's 0.3 s); the margin
# is for a loaded CI machine, not for the client.
SETTLE = 30.0
MAX_MSG_SIZE = 4096
MAX_BODY_SIZE = 65536  # the lookupd client's limit (--max-body-size)
LIBRARY_ERRORS = (NSQError, ConnectionClosed, StoppedError)


def examples(ci_count: int) -> settings:
    return settings(max_examples=_OVERRIDE or ci_count, deadline=None, derandomize=not _OVERRIDE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# -- what the hostile server says ----------------------------------------------------------


def frame(ftype: int, payload: bytes) -> bytes:
    return struct.pack(">ii", len(payload) + 4, ftype) + payload


IDENTIFY_OK = json.dumps({"max_rdy_count": 2500, "version": "1.3.0", "tls_v1": False,
                          "deflate": False, "snappy": False, "auth_required": False}).encode()

_json_value = st.one_of(st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=8), st.none(), st.lists(st.integers(), max_size=2))
_identify_like = st.dictionaries(
    st.sampled_from(["max_rdy_count", "tls_v1", "deflate", "snappy", "auth_required",
                     "deflate_level", "identity", "permission_count", "version"]),
    _json_value, max_size=5).map(lambda d: json.dumps(d).encode())
_deep = st.builds(lambda opener, n: opener * n, st.sampled_from([b"[", b'{"a":', b'{"a":[']),
                  st.sampled_from([64, 2000, 100_000]))
_answer = st.one_of(
    st.sampled_from([b"OK", b"CLOSE_WAIT", b"_heartbeat_", IDENTIFY_OK, b"[]", b"null", b"{}"]),
    _identify_like, _deep, st.binary(max_size=64))
_error_text = st.sampled_from([
    b"E_INVALID invalid command", b"E_BAD_BODY IDENTIFY failed to decode JSON body",
    b"E_AUTH_FAILED AUTH failed", b"E_UNAUTHORIZED AUTH no authorizations found",
    b"E_FIN_FAILED FIN 0123456789abcdef failed ID not in flight", b"E_NEW_CODE", b"",
    b"E_BAD_TOPIC PUB topic name \"t\" is not valid"])
_message = st.builds(lambda body, n: struct.pack(">qH", 1_700_000_000_000_000_000, 1)
                     + b"%016x" % n + body, st.binary(max_size=64), st.integers(0, 2**60))

_frame = st.one_of(
    st.builds(frame, st.just(0), _answer),
    st.builds(frame, st.just(1), _error_text),
    st.builds(frame, st.just(2), _message),
    st.builds(frame, st.integers(-3, 9), st.binary(max_size=32)),  # types that do not exist
)
_huge_size = st.builds(
    lambda size, ftype, tail: struct.pack(">ii", size, ftype) + tail,
    st.one_of(st.integers(MAX_MSG_SIZE + 31, 2**31 - 1), st.integers(-2**31, 3),
              st.just(int.from_bytes(b"HTTP", "big"))),
    st.integers(0, 2), st.binary(max_size=128))
_truncated = st.builds(lambda f, cut: f[:max(1, len(f) * cut // 100)], _frame, st.integers(1, 99))
_piece = st.one_of(_frame, _frame, _truncated, _huge_size, st.binary(min_size=1, max_size=200),
                   st.integers(0, 255).map(lambda b: frame(2, bytes([b]) * 65536)))


@st.composite
def scripts(draw) -> dict[str, Any]:
    """What the server does once it has read the client's first bytes."""
    steps: list[tuple[str, Any]] = []
    if draw(st.booleans()):  # a handshake that works, so that the rest reaches a live connection
        steps.append(("send", frame(0, IDENTIFY_OK)))
        steps.append(("send", frame(0, b"OK")))  # SUB's, or a PUB's
    for piece in draw(st.lists(_piece, min_size=1, max_size=5)):
        if draw(st.integers(0, 5)) == 0:  # a slow drip: one byte at a time
            for byte in piece[:40]:
                steps.append(("send", bytes([byte])))
                steps.append(("wait", 0.02))
        else:
            steps.append(("send", piece))
    return {"steps": steps, "end": draw(st.sampled_from(["close", "close", "abort", "silent"]))}


class Hostile(protocol.Protocol):
    """Plays its factory's script to whoever connects."""

    def connectionMade(self) -> None:
        self.factory.connections += 1
        self.started = False
        self.pending = None
        self.factory.open.append(self)

    def dataReceived(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            self._play(list(self.factory.script["steps"]))

    def _play(self, steps: list) -> None:
        self.pending = None
        while steps:
            kind, arg = steps.pop(0)
            if kind == "send":
                self.transport.write(arg)
            else:
                self.pending = reactor.callLater(arg, self._play, steps)
                return
        end = self.factory.script["end"]
        if end == "close":
            self.transport.loseConnection()
        elif end == "abort":
            self.transport.abortConnection()

    def connectionLost(self, reason=None) -> None:
        if self.pending is not None and self.pending.active():
            self.pending.cancel()
        self.factory.open.remove(self)


class HostileFactory(protocol.Factory):
    protocol = Hostile
    noisy = False

    def __init__(self) -> None:
        self.script: dict[str, Any] = {"steps": [], "end": "close"}
        self.connections = 0
        self.open: list[Hostile] = []


# -- watching the client ---------------------------------------------------------------------


class Watch:
    """Bad log events, and the most any connection held of an incomplete frame."""

    def __init__(self, monkeypatch) -> None:
        self.bad: list[str] = []
        self.held = {"client": 0, "peer": 0}
        watch = self

        client_received = NSQClientProtocol.dataReceived

        def client_data(proto, data):
            client_received(proto, data)
            held = proto._chunks_len if proto._chunks else 0
            assert held <= proto.max_frame_size + 4, (held, proto.max_frame_size)
            watch.held["client"] = max(watch.held["client"], held)

        peer_received = LookupPeerProtocol.dataReceived

        def peer_data(proto, data):
            peer_received(proto, data)
            held = len(proto._buffer)
            assert held <= proto.peer.max_response_size() + 4 or proto.closing, held
            watch.held["peer"] = max(watch.held["peer"], held)

        monkeypatch.setattr(NSQClientProtocol, "dataReceived", client_data)
        monkeypatch.setattr(LookupPeerProtocol, "dataReceived", peer_data)

    def __call__(self, event: dict) -> None:
        if "log_failure" in event or event.get("log_level") == LogLevel.critical:
            failure = event.get("log_failure")
            self.bad.append(f"{event.get('log_namespace')}: {formatEvent(event)}\n"
                            + (failure.getTraceback() if failure is not None else ""))

    def check(self, full: bool = False) -> None:
        # A Deferred failed unheard logs "Unhandled error in Deferred" when collected: the
        # young generations after each example (a full collection costs ~0.2 s here), all
        # of it once at the end of the test.
        gc.collect(2 if full else 1)
        bad, self.bad = self.bad, []
        assert not bad, "\n".join(bad[:3])


@pytest.fixture
def watch(monkeypatch):
    w = Watch(monkeypatch)
    globalLogPublisher.addObserver(w)
    try:
        yield w
        w.check(full=True)
    finally:
        globalLogPublisher.removeObserver(w)


@pytest.fixture
def hostile():
    factory = HostileFactory()
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    yield factory, f"127.0.0.1:{port.getHost().port}"
    for proto in list(factory.open):
        proto.transport.abortConnection()
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


@pytest.fixture
def lookup_broker(tmp_path):
    """A broker (on the real reactor) for the lookupd client to announce."""
    broker = new_broker(tmp_path, reactor, max_body_size=MAX_BODY_SIZE)
    yield broker
    broker.close()


async def settled(d: defer.Deferred, what: str) -> Any:
    """d's result (a Failure kept as one), or a failed test if it did not fire within SETTLE."""
    outcome: list = []
    d.addTimeout(SETTLE, reactor)
    d.addBoth(outcome.append)
    await d
    result = outcome[0]
    assert not isinstance(getattr(result, "value", None), defer.TimeoutError), f"{what}: hung"
    return result


def client_config() -> Config:
    return Config(read_timeout=0.25, heartbeat_interval=-1, dial_timeout=2, max_msg_size=MAX_MSG_SIZE,
                  auth_secret="secret")


def is_clean(result: Any) -> bool:
    """A publish's or connection's outcome: a value, or one of the library's errors."""
    value = getattr(result, "value", None)
    return value is None or isinstance(value, LIBRARY_ERRORS)


# -- the broker ------------------------------------------------------------------------------


@examples(60)
@given(script=scripts())
@pytest_twisted.ensureDeferred
async def test_hostile_broker(hostile, lookup_broker, watch, monkeypatch, script):
    monkeypatch.setattr(peer_module, "COMMAND_TIMEOUT", 0.3)  # nsqd's 1 s, shortened for the test
    factory, address = hostile
    factory.script = script
    producer = Producer(address, client_config(), reactor=reactor, max_outstanding=2)
    consumer = Consumer("t", "c", lambda message: None, config=client_config(), reactor=reactor)
    peer = LookupPeer(lookup_broker, address, {"TCP": 4150, "HTTP": 4151}, reactor)
    peer_outcome = watch_peer(peer)
    producer.startService()
    consumer.startService()
    peer.start()
    try:
        publishes = [producer.publish("t", b"one"), producer.multi_publish("t", [b"a", b"b"])]
        connected = consumer.connect_to_nsqd(address)
        for d in publishes:
            result = await settled(d, "a publish")
            assert is_clean(result), result
        result = await settled(connected, "the consumer's first connection")
        assert is_clean(result), result
        # The lookupd client: its first connection identified, or gone.
        await settled(peer_outcome, "the lookupd client's first connection")
    finally:
        await settled(producer.stop(), "the producer's stop")
        await settled(consumer.stop(), "the consumer's stop")
        await settled(peer.stop(), "the lookupd client's stop")
    watch.check()


def watch_peer(peer: LookupPeer) -> defer.Deferred:
    """Fires once a connection of the peer was identified, or has ended (call before start)."""
    done: defer.Deferred = defer.Deferred()
    disconnected = peer.disconnected

    def ended(proto: LookupPeerProtocol) -> None:
        disconnected(proto)
        if not done.called:
            done.callback(None)

    def check() -> None:
        proto = peer.protocol
        if proto is not None and proto.lookupd_info is not None and not done.called:
            done.callback(None)

    peer.disconnected = ended  # what the peer's connection calls when it is lost
    loop = LoopingCall(check)
    loop.clock = reactor
    loop.start(0.02)
    return done.addBoth(lambda result: (loop.stop(), result)[1])


# -- lookupd's HTTP answers --------------------------------------------------------------------


LOOKUPD_LIMIT = 65536  # the poller's MAX_RESPONSE_SIZE, lowered so that passing it is quick
HUGE = b"x" * (LOOKUPD_LIMIT * 3)

_http_body = st.one_of(
    _deep, st.binary(max_size=300), _identify_like,
    st.sampled_from([b'{"producers": "x"}', b'{"producers": [1, null, {"tcp_port": "1"}]}',
                     b'{"data": [], "status_code": 200}', b"[]", b"null", b"",
                     b'{"producers": [{"broadcast_address": "h", "tcp_port": 4150}]}']),
    st.just(HUGE),
)


class Lookupd(resource.Resource):
    """Answers /lookup with the example's status and body, perhaps a byte at a time.

    The body goes out in 16 KiB writes without a Content-Length (chunked),
    so that a body over the limit is cut while it arrives, not refused
    from its header.
    """

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.answer: dict[str, Any] = {"code": 200, "body": b"{}", "drip": False}

    def render_GET(self, request):
        request.setResponseCode(self.answer["code"])
        body = self.answer["body"]
        step, delay = (1, 0.02) if self.answer["drip"] else (16384, 0)
        if self.answer["drip"]:
            body = body[:30]
        calls: list = []

        def write(rest: bytes) -> None:
            if request.finished or request.channel is None:
                return
            if not rest:
                request.finish()
                return
            request.write(rest[:step])
            calls.append(reactor.callLater(delay, write, rest[step:]))

        request.notifyFinish().addErrback(lambda _: [c.cancel() for c in calls if c.active()])
        write(body)
        return server.NOT_DONE_YET


@pytest.fixture
def lookupd():
    res = Lookupd()
    site = server.Site(res)
    site.noisy = False
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    yield res, f"127.0.0.1:{port.getHost().port}"
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


@examples(30)
@given(code=st.sampled_from([200, 200, 200, 404, 500, 301]), body=_http_body,
       drip=st.integers(0, 5).map(lambda n: n == 0), raw=st.integers(0, 4).map(lambda n: n == 0),
       script=scripts())
@pytest_twisted.ensureDeferred
async def test_hostile_lookupd(lookupd, hostile, watch, monkeypatch, code, body, drip, raw, script):
    monkeypatch.setattr(discovery, "MAX_RESPONSE_SIZE", LOOKUPD_LIMIT)
    res, http_address = lookupd
    factory, raw_address = hostile
    res.answer = {"code": code, "body": body, "drip": drip}
    factory.script = script  # a "lookupd" that does not even speak HTTP
    seen: list = []
    poller = LookupdPoller("t", [raw_address if raw else http_address], 60.0, 0.0, seen.append,
                           clock=reactor, timeout=0.25)
    try:
        result = await settled(poller.poll(), "a lookupd poll")
        assert result is None or isinstance(result, set), result  # never an error
        if result is not None:
            assert all(isinstance(a, str) and ":" in a for a in result)
    finally:
        poller.stop()
    watch.check()
