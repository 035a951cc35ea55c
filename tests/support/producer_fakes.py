"""The client's Producer against a fake nsqd whose connections the test accepts or refuses.

`Endpoint.accept()` hands the producer a connection over a StringTransport
and answers its IDENTIFY; `Server` is nsqd's side of it. `Outcome` watches
what a publish's Deferred fired with.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from mqd.client.config import Config
from mqd.wire.framing import FRAME_TYPE_ERROR, FRAME_TYPE_RESPONSE, frame
from tests.support.v2_frames import MAGIC, cmd, sized

ADDRESS = "127.0.0.1:4150"
OK = frame(FRAME_TYPE_RESPONSE, b"OK")
# What nsqd answers IDENTIFY with when nothing more is negotiated.
IDENTIFY_ANSWER = json.dumps({
    "max_rdy_count": 2500, "version": "1.3.0", "max_msg_timeout": 900000, "msg_timeout": 60000,
    "tls_v1": False, "deflate": False, "deflate_level": 6, "max_deflate_level": 6, "snappy": False,
    "sample_rate": 0, "auth_required": False, "output_buffer_size": 16384, "output_buffer_timeout": 250,
}).encode()


def error(text: str) -> bytes:
    return frame(FRAME_TYPE_ERROR, text.encode())


_PENDING = object()


class Outcome:
    """What a Deferred fired with, watched from the end of its chain."""

    def __init__(self, d: defer.Deferred) -> None:
        self.value: Any = _PENDING
        d.addBoth(self._got)

    def _got(self, result: Any) -> None:
        self.value = result  # a Failure is kept here, not left unhandled

    @property
    def fired(self) -> bool:
        return self.value is not _PENDING

    def result(self) -> Any:
        assert self.fired, "the Deferred has not fired"
        assert not isinstance(self.value, Failure), f"failed: {self.value!r}"
        return self.value

    def error(self) -> BaseException:
        assert self.fired, "the Deferred has not fired"
        assert isinstance(self.value, Failure), f"fired with {self.value!r}"
        return self.value.value


class Server:
    """One accepted connection: what the producer wrote, and frames written back to it."""

    def __init__(self, proto, transport: StringTransport) -> None:
        self.proto = proto  # ClientService's proxy around the NSQClientProtocol
        self.transport = transport

    def take(self) -> bytes:
        data = self.transport.value()
        self.transport.clear()
        return data

    def send(self, *frames: bytes) -> None:
        self.proto.dataReceived(b"".join(frames))

    def lose(self, reason: Exception | None = None) -> None:
        self.proto.connectionLost(Failure(reason or ConnectionDone()))

    @property
    def closed_by_client(self) -> bool:
        return self.transport.disconnecting


class Endpoint:
    """A client endpoint whose connection attempts the test accepts or refuses."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.attempts: list[tuple[Any, defer.Deferred]] = []

    def connect(self, factory) -> defer.Deferred:
        d = defer.Deferred()
        self.attempts.append((factory, d))
        return d

    def accept(self, handshake: bool = True) -> Server:
        assert self.attempts, "no connection attempt"
        factory, d = self.attempts.pop(0)
        address = IPv4Address("TCP", "127.0.0.1", 4150)
        proto = factory.buildProtocol(address)
        transport = StringTransport(peerAddress=address)
        proto.makeConnection(transport)
        d.callback(proto)
        server = Server(proto, transport)
        if handshake:
            assert server.take() == MAGIC + cmd("IDENTIFY") + sized(self.config.identify_body())
            server.send(frame(FRAME_TYPE_RESPONSE, IDENTIFY_ANSWER))
        return server

    def refuse(self, reason: Exception | None = None) -> None:
        assert self.attempts, "no connection attempt"
        _factory, d = self.attempts.pop(0)
        d.errback(reason or ConnectionRefusedError("refused"))
