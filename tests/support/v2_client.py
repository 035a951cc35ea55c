"""A V2 client of an in-process broker: its protocol on a StringTransport, read back as frames."""

from __future__ import annotations

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from mqd.nsqd.broker import Broker
from mqd.nsqd.protocol.v2 import V2Factory
from mqd.nsqd.tlsconfig import ServerTLS
from tests.support.v2_frames import MAGIC, Frame, Msg, cmd, identify, mpub, ok, parse_frames


class Client:
    """A V2 connection to `broker` over a StringTransport."""

    def __init__(self, broker: Broker, *, magic: bool = True, port: int = 12345, tls=None) -> None:
        self.broker = broker
        addr = IPv4Address("TCP", "127.0.0.1", port)
        self.proto = V2Factory(broker, tls=tls).buildProtocol(addr)
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


def mpublish(broker: Broker, topic, bodies: list[bytes], port: int = 5000) -> None:
    """MPUB `bodies` from a new client of `broker` (any broker, not only the fixture's)."""
    assert publisher_client(broker, port).request(mpub(topic, bodies)) == [ok()]


def publisher_client(broker, port: int = 5000) -> Client:
    """A client that has said IDENTIFY with heartbeats off, ready to publish."""
    p = Client(broker, port=port)
    assert p.request(identify(heartbeat_interval=-1)) == [ok()]
    return p


class TLSStringTransport(StringTransport):
    """Records startTLS and what was written before and after it."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.tls_started_at: int | None = None

    def startTLS(self, ctx, normal=True) -> None:
        self.tls_started_at = len(self.value())
        self.ctx = ctx


def tls_client(broker, required="false") -> Client:
    """A client of `broker` (its TLS policy set to `required`) on a transport that records startTLS."""
    tls = ServerTLS(context=None, required=required)  # startTLS is faked: no context needed
    c = Client(broker, magic=False, tls=tls)
    c.transport = TLSStringTransport(peerAddress=c.transport.getPeer())
    c.proto.makeConnection(c.transport)
    c.send(b"  V2")
    return c
