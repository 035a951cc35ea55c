"""The client's Consumer against fake nsqds and a fake lookupd, on a task.Clock.

`Network` hands the consumer endpoints whose every connection is an `Nsqd`:
the server end, which answers the handshake and sends frames the test
chooses; `Lookupd` answers discovery queries from a list the test changes.
"""

from __future__ import annotations

import json
import struct

from twisted.internet import defer
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from zope.interface import implementer

from mqd.client.consumer import Consumer

RESPONSE, ERROR, MESSAGE = 0, 1, 2


def frame(ftype: int, payload: bytes) -> bytes:
    return struct.pack(">ii", len(payload) + 4, ftype) + payload


def msg_id(n: int) -> bytes:
    return b"%016x" % n


class ServerTransport(StringTransport):
    """Closing ends the connection on the next clock tick, as a reactor would."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.proto = None

    def loseConnection(self) -> None:
        if self.disconnecting:
            return
        self.disconnecting = True
        self.clock.callLater(0, self.proto.connectionLost, Failure(ConnectionDone()))

    abortConnection = loseConnection


class Nsqd:
    """The server end of one connection."""

    def __init__(self, address: str, proto, transport: ServerTransport) -> None:
        self.address = address
        self.proto = proto
        self.transport = transport
        self._seen = 0

    def send(self, ftype: int, payload: bytes) -> None:
        self.proto.dataReceived(frame(ftype, payload))

    def handshake(self, **server) -> None:
        """Answer IDENTIFY (feature negotiation) and then SUB."""
        assert self.transport.value().startswith(b"  V2IDENTIFY\n")
        answer = {"max_rdy_count": 2500, "version": "1.3.0", "max_msg_timeout": 900000,
                  "msg_timeout": 60000, "tls_v1": False, "deflate": False, "snappy": False,
                  "auth_required": False, "output_buffer_size": 16384,
                  "output_buffer_timeout": 250, "sample_rate": 0}
        answer.update(server)
        self.send(RESPONSE, json.dumps(answer).encode())
        self.commands()  # the handshake's bytes
        assert self.commands() == []
        # (SUB went out when the handshake ended)

    def subscribe(self, **server) -> list[bytes]:
        before = len(self.transport.value())
        self.handshake(**server)
        self._seen = before
        sub = self.commands()
        assert sub == [b"SUB t c"], sub
        self.send(RESPONSE, b"OK")
        return self.commands()

    def message(self, n: int, body: bytes = b"body", attempts: int = 1) -> None:
        self.send(MESSAGE, struct.pack(">qH", 1_700_000_000_000_000_000, attempts) + msg_id(n) + body)

    def commands(self) -> list[bytes]:
        """Command lines written since the last call (skipping the handshake's bodies)."""
        data = self.transport.value()
        new, self._seen = data[self._seen:], len(data)
        if new.startswith(b"  V2IDENTIFY\n"):
            return []
        return [line for line in new.split(b"\n") if line]

    def rdy(self) -> list[int]:
        return [int(c.split()[1]) for c in self.commands() if c.startswith(b"RDY ")]

    def close(self) -> None:
        self.transport.loseConnection()


class Network:
    """Endpoints for the consumer; every connection made is an Nsqd in `servers`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.servers: dict[str, list[Nsqd]] = {}
        self.refused: set[str] = set()
        self.attempts: list[tuple[float, str]] = []

    def endpoint(self, address: str):
        network = self

        @implementer(IStreamClientEndpoint)
        class Endpoint:
            def connect(self, factory):
                network.attempts.append((network.clock.seconds(), address))
                if address in network.refused:
                    return defer.fail(ConnectionRefusedError(address))
                proto = factory.buildProtocol(None)
                transport = ServerTransport(network.clock)
                transport.proto = proto
                proto.makeConnection(transport)
                network.servers.setdefault(address, []).append(
                    Nsqd(address, proto._protocol if hasattr(proto, "_protocol") else proto,
                         transport))
                return defer.succeed(proto)

        return Endpoint()

    def last(self, address: str) -> Nsqd:
        return self.servers[address][-1]


class PickLast:
    """The random choice among connections is always the last one."""

    def randrange(self, n: int) -> int:
        return n - 1

    def random(self) -> float:
        return 0.5


class Recorder:
    def __init__(self) -> None:
        self.messages = []
        self.result = None

    def __call__(self, msg):
        self.messages.append(msg)
        result = self.result
        if isinstance(result, Exception):
            raise result
        if callable(result):
            return result(msg)
        return result


def make(net, clock, handler=None, addresses=("a:4150",), **options) -> Consumer:
    consumer = Consumer("t", "c", handler or Recorder(), nsqd_tcp_addresses=addresses,
                        reactor=clock, endpoint_factory=net.endpoint, **options)
    consumer.startService()
    return consumer


class Lookupd(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.producers: list[tuple[str, int]] = []

    def render_GET(self, request):
        producers = [{"broadcast_address": h, "tcp_port": p, "http_port": 4151, "hostname": h,
                      "remote_address": f"{h}:1", "version": "1.3.0"} for h, p in self.producers]
        return json.dumps({"channels": ["c"], "producers": producers}).encode()
