"""The client protocol on a StringTransport, and the frames a fake nsqd answers it with.

`Conn` is an NSQClientProtocol with a recording delegate and its own
task.Clock; `ready()` is one whose IDENTIFY has been answered. Server frames
are built with the broker's framing.
"""

from __future__ import annotations

import json

from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from mqd.client.config import Config
from mqd.client.protocol import ConnectionDelegate, NSQClientProtocol
from mqd.message import Message as BrokerMessage
from mqd.message import frame_message
from mqd.wire.framing import frame

ADDRESS = "127.0.0.1:4150"
MSG_ID = b"0123456789abcdef"


class Recorder(ConnectionDelegate):
    """Every delegate callback, in order, as (kind, ...) tuples in `events`."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def message_received(self, conn, msg):
        self.events.append(("message", msg))

    def message_finished(self, conn, msg):
        self.events.append(("finished", msg))

    def message_requeued(self, conn, msg, backoff):
        self.events.append(("requeued", msg, backoff))

    def connection_ready(self, conn):
        self.events.append(("ready",))

    def connection_error(self, conn, err):
        self.events.append(("error", err))

    def heartbeat(self, conn):
        self.events.append(("heartbeat",))

    def connection_closed(self, conn, reason):
        self.events.append(("closed", reason))

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]


class TLSTransport(StringTransport):
    """StringTransport has no startTLS: record the call (the bytes stay plain here)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.tls_started: list = []

    def startTLS(self, creator, normal: bool = True) -> None:
        self.tls_started.append(creator)


def response(payload: bytes) -> bytes:
    return frame(0, payload)


def error(text: bytes) -> bytes:
    return frame(1, text)


def server_json(**fields) -> bytes:
    """nsqd's IDENTIFY answer (feature negotiation on)."""
    body = {
        "max_rdy_count": 2500, "version": "1.3.0", "max_msg_timeout": 900000,
        "msg_timeout": 60000, "tls_v1": False, "deflate": False, "deflate_level": 6,
        "max_deflate_level": 6, "snappy": False, "sample_rate": 0, "auth_required": False,
        "output_buffer_size": 16384, "output_buffer_timeout": 250,
    }
    body.update(fields)
    return response(json.dumps(body).encode())


def message_frame(body: bytes = b"hello", attempts: int = 1, msg_id: bytes = MSG_ID,
                  timestamp: int = 1_700_000_000_000_000_000) -> bytes:
    return frame_message(BrokerMessage(msg_id, body, timestamp, attempts))


class Conn:
    """A client protocol on a StringTransport, its delegate and clock."""

    def __init__(self, transport_cls=StringTransport, **options) -> None:
        options.setdefault("client_id", "cid")
        options.setdefault("hostname", "host.example")
        self.config = Config(**options)
        self.clock = Clock()
        self.clock.advance(1000)
        self.delegate = Recorder()
        self.proto = NSQClientProtocol(self.config, self.delegate, ADDRESS, clock=self.clock)
        self.transport = transport_cls()
        self.proto.makeConnection(self.transport)
        self.results: list = []
        self.proto.ready.addBoth(self.results.append)

    def feed(self, data: bytes) -> None:
        self.proto.dataReceived(data)

    def written(self) -> bytes:
        data = self.transport.value()
        self.transport.clear()
        return data

    def lose(self, reason=None) -> None:
        self.proto.connectionLost(Failure(reason or ConnectionDone()))

    def handshake(self, **server) -> Conn:
        self.written()
        self.feed(server_json(**server))
        assert self.proto.connected
        return self


def ready(**options) -> Conn:
    return Conn(**options).handshake()


_OUTCOMES: dict = {}


def outcome(d):
    """What a Deferred fired with (a Failure's exception), or "pending"; repeatable."""
    if d not in _OUTCOMES:
        box: list = []
        _OUTCOMES[d] = box
        d.addBoth(box.append)  # also consumes a failure: no "Unhandled error" at exit
    box = _OUTCOMES[d]
    if not box:
        return "pending"
    value = box[0]
    return value.value if isinstance(value, Failure) else value
