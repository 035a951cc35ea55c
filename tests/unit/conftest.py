"""Shared fixtures and helpers for mqd's unit tests.

A broker runs on a `twisted.internet.task.Clock`, so heartbeats, read
timeouts, in-flight expiry and deferred delivery are driven by
`clock.advance()`; clients are V2 protocols on `StringTransport`s, and what
the broker wrote is parsed back into frames.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import lmdb
import pytest
from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from backends.lmdb import LmdbStore
from mqd.message import Message
from mqd.nsqd.broker import Broker
from mqd.nsqd.protocol.v2 import V2Factory
from mqd.nsqd.queuescan import QueueScanner
from mqd.options import MQD_OPTIONS, resolve

MAGIC = b"  V2"
RESPONSE, ERROR, MESSAGE = 0, 1, 2
# A reactor time in the present, so message timestamps and ids look real.
START_TIME = 1_700_000_000.0
NODE_ID = 7

_INT32 = struct.Struct(">i")


# -- frames --------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """A response (type 0) or error (type 1) frame."""

    type: int
    payload: bytes


@dataclass(frozen=True)
class Msg:
    """A message frame (type 2), decoded."""

    timestamp: int
    attempts: int
    id: bytes
    body: bytes


def ok() -> Frame:
    return Frame(RESPONSE, b"OK")


def err(text: str | bytes) -> Frame:
    return Frame(ERROR, text if isinstance(text, bytes) else text.encode())


HEARTBEAT = Frame(RESPONSE, b"_heartbeat_")
CLOSE_WAIT = Frame(RESPONSE, b"CLOSE_WAIT")


def parse_frames(data: bytes) -> list[Frame | Msg]:
    """Split what the broker wrote into frames; fails on a partial frame."""
    frames: list[Frame | Msg] = []
    pos = 0
    while pos < len(data):
        assert len(data) - pos >= 8, f"partial frame header at {pos}: {data[pos:]!r}"
        size, ftype = struct.unpack_from(">ii", data, pos)
        assert size >= 4, f"bad frame size {size} at {pos}"
        end = pos + 4 + size
        assert end <= len(data), f"partial frame at {pos}: needs {end}, have {len(data)}"
        payload = data[pos + 8 : end]
        if ftype == MESSAGE:
            assert len(payload) >= 26, f"message frame too short: {payload!r}"
            ts, attempts = struct.unpack_from(">qH", payload)
            frames.append(Msg(ts, attempts, payload[10:26], payload[26:]))
        else:
            assert ftype in (RESPONSE, ERROR), f"unknown frame type {ftype}"
            frames.append(Frame(ftype, payload))
        pos = end
    return frames


# -- commands -------------------------------------------------------------------


def _word(w) -> bytes:
    return w if isinstance(w, bytes) else str(w).encode()


def cmd(*words) -> bytes:
    """One command line: words joined by single spaces, ending in '\\n'."""
    return b" ".join(_word(w) for w in words) + b"\n"


def sized(data: bytes) -> bytes:
    """A body with its 4-byte big-endian size in front."""
    return _INT32.pack(len(data)) + data


def pub(topic, body: bytes) -> bytes:
    return cmd("PUB", topic) + sized(body)


def dpub(topic, ms, body: bytes) -> bytes:
    return cmd("DPUB", topic, ms) + sized(body)


def mpub_body(bodies: list[bytes]) -> bytes:
    return _INT32.pack(len(bodies)) + b"".join(sized(b) for b in bodies)


def mpub(topic, bodies: list[bytes]) -> bytes:
    return cmd("MPUB", topic) + sized(mpub_body(bodies))


def identify(**fields) -> bytes:
    return cmd("IDENTIFY") + sized(json.dumps(fields).encode())


# -- clients ----------------------------------------------------------------------


class Client:
    """A V2 connection to `broker` over a StringTransport."""

    def __init__(self, broker: Broker, *, magic: bool = True, port: int = 12345) -> None:
        self.broker = broker
        addr = IPv4Address("TCP", "127.0.0.1", port)
        self.proto = V2Factory(broker).buildProtocol(addr)
        self.transport = StringTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)
        self.lost = False
        if magic:
            self.send(MAGIC)

    def send(self, data: bytes) -> None:
        self.proto.dataReceived(data)

    def send_bytewise(self, data: bytes) -> None:
        for i in range(len(data)):
            self.proto.dataReceived(data[i : i + 1])

    def raw(self) -> bytes:
        """The bytes written since the last read, and forget them.

        Buffered message frames are flushed first, as the output-buffer
        timer would by the time a real client reads; tests of the buffer
        itself look at `transport.value()` directly.
        """
        self.proto.flush_output()
        data = self.transport.value()
        self.transport.clear()
        return data

    def read(self) -> list[Frame | Msg]:
        return parse_frames(self.raw())

    def messages(self) -> list[Msg]:
        """Read, expecting only message frames."""
        frames = self.read()
        assert all(isinstance(f, Msg) for f in frames), frames
        return frames  # type: ignore[return-value]

    def request(self, data: bytes) -> list[Frame | Msg]:
        """Send and return what came back."""
        self.send(data)
        return self.read()

    @property
    def closed(self) -> bool:
        return self.transport.disconnecting

    def lose(self) -> None:
        """What the reactor does once the socket is closed: connectionLost."""
        if not self.lost:
            self.lost = True
            self.proto.connectionLost(Failure(ConnectionDone()))

    def sub(self, topic="t", channel="c", rdy: int | None = None) -> None:
        assert self.request(cmd("SUB", topic, channel)) == [ok()]
        if rdy is not None:
            self.send(cmd("RDY", rdy))

    def fin(self, msg: Msg | bytes) -> None:
        self.send(cmd("FIN", msg.id if isinstance(msg, Msg) else msg))

    def req(self, msg: Msg | bytes, ms: int = 0) -> None:
        self.send(cmd("REQ", msg.id if isinstance(msg, Msg) else msg, ms))

    def touch(self, msg: Msg | bytes) -> None:
        self.send(cmd("TOUCH", msg.id if isinstance(msg, Msg) else msg))


def consumer(broker, topic="t", channel="c", rdy=100) -> Client:
    """A subscribed client with RDY `rdy`."""
    c = Client(broker)
    c.sub(topic, channel, rdy)
    return c


def scan(broker: Broker) -> int:
    """One queue-scan tick over every channel that exists now."""
    scanner = QueueScanner(broker)
    scanner.refresh()
    return scanner.scan()


def settings(tmp_path, **flags):
    # The in-memory store unless a test asks for another: most unit tests
    # look at what the queues hold; tests/unit/test_lmdb*.py use the real LMDB.
    values = {
        "data-path": str(tmp_path),
        "node-id": NODE_ID,
        "broadcast-address": "test-host",
        "backend": "memory",
    }
    values.update({k.replace("_", "-"): v for k, v in flags.items()})
    return resolve(MQD_OPTIONS, values)


def new_broker(path, clock: Clock, **flags) -> Broker:
    broker = Broker(settings(path, **flags), clock=clock)
    broker.open()
    return broker


def lmdb_store(path, clock: Clock, **flags) -> LmdbStore:
    """An LMDB store of its own (no broker) in `path`."""
    return LmdbStore(settings(path, backend="lmdb", **flags), clock)


def msgs(n: int, start: int = 0, body: bytes = b"m") -> list[Message]:
    """`n` messages numbered from `start`: id i in 16 digits, body `body`+i, timestamp 1000+i."""
    return [Message(b"%016d" % i, body + b"%d" % i, 1_000 + i) for i in range(start, start + n)]


def mpublish(broker: Broker, topic, bodies: list[bytes], port: int = 5000) -> None:
    """MPUB `bodies` from a new client of `broker` (any broker, not only the fixture's)."""
    p = Client(broker, port=port)
    assert p.request(identify(heartbeat_interval=-1)) == [ok()]
    assert p.request(mpub(topic, bodies)) == [ok()]


# -- fixtures ---------------------------------------------------------------------


@pytest.fixture
def clock() -> Clock:
    c = Clock()
    c.advance(START_TIME)
    return c


@pytest.fixture
def make_broker(tmp_path, clock):
    """make_broker(**flags): a broker on the test clock, data in tmp_path (or path=)."""

    def make(path=None, **flags) -> Broker:
        return new_broker(path or tmp_path, clock, **flags)

    return make


@pytest.fixture
def broker(make_broker) -> Broker:
    return make_broker()


@pytest.fixture
def connect(broker):
    """connect(**kw): a new client of the default broker."""
    ports = iter(range(20000, 30000))

    def make(**kw) -> Client:
        kw.setdefault("port", next(ports))
        return Client(broker, **kw)

    return make


@pytest.fixture
def publish(connect):
    """publish(*bodies, topic="t"): PUB one body or MPUB several, each answered OK."""
    p = connect()
    p.send(identify(heartbeat_interval=-1))
    assert p.read() == [ok()]

    def do(*data: bytes, topic="t"):
        if len(data) == 1:
            assert p.request(pub(topic, data[0])) == [ok()]
        else:
            assert p.request(mpub(topic, list(data))) == [ok()]

    return do


def failing_once(store, error="No space left on device"):
    """Make the store's next commit fail as a full disk would, once; returns the call log."""
    real = store._write
    calls = []

    def write():
        calls.append(1)
        if len(calls) == 1:
            raise lmdb.Error(error)
        return real()

    store._write = write
    return calls


# -- HTTP ----------------------------------------------------------------------------------


@pytest.fixture
def sync_threads(monkeypatch):
    """POST /snapshot writes in the request's call, not in a thread of the real reactor.

    The answer is then there when the request returns, and no snapshot
    thread outlives its test writing into a directory being removed.
    """
    import mqd.nsqd.http.snapshot as endpoint

    monkeypatch.setattr(endpoint.threads, "deferToThread",
                        lambda f, *a, **kw: defer.maybeDeferred(f, *a, **kw))


@pytest.fixture
def http(broker, sync_threads):
    """An in-process HTTP client of the default broker's API."""
    from tests.unit._http import HTTPClient

    return HTTPClient(broker)
