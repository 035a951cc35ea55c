"""The broker's lookupd peers against a fake nsqlookupd: every connection attempt goes to the test.

`FakeEndpoint` records the attempts of a peer's ClientService and lets the
test accept or refuse each; an accepted one is a `Conn` over a
StringTransport, which checks the IDENTIFY and answers what the test says.
"""

from __future__ import annotations

import json
import struct

from twisted.internet import defer
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.testing import StringTransportWithDisconnection

from mqd import NSQ_VERSION
from mqd.nsqd.lookup_peer import MAGIC_V1
from tests.support.v2_frames import sized

PORTS = {"TCP": 4150, "HTTP": 4151}
LOOKUPD_INFO = {"tcp_port": 4160, "http_port": 4161, "version": NSQ_VERSION,
                "broadcast_address": "lookup-host", "hostname": "lookup-host"}


class FakeEndpoint:
    """Records connection attempts; the test decides each one's fate."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.attempts: list[tuple[defer.Deferred, object]] = []

    def connect(self, factory):
        d = defer.Deferred()
        self.attempts.append((d, factory))
        return d

    def accept(self) -> Conn:
        d, factory = self.attempts[-1]
        conn = Conn(factory)
        d.callback(conn.proxy)
        return conn

    def refuse(self) -> None:
        d, _ = self.attempts[-1]
        d.errback(ConnectionRefusedError())


class Conn:
    """One connection to the fake lookupd."""

    def __init__(self, factory) -> None:
        self.proxy = factory.buildProtocol(None)
        self.transport = StringTransportWithDisconnection()
        self.transport.protocol = self.proxy
        self.proxy.makeConnection(self.transport)
        self._read = 0

    def written(self) -> bytes:
        """Bytes the broker wrote since the last call."""
        data = self.transport.value()
        new, self._read = data[self._read:], len(data)
        return new

    def lines(self) -> list[bytes]:
        return self.written().splitlines()

    def identified(self) -> list[bytes]:
        """Check the magic and IDENTIFY, answer it; returns the lines that followed."""
        data = self.written()
        assert data.startswith(MAGIC_V1 + b"IDENTIFY\n")
        rest = data[len(MAGIC_V1 + b"IDENTIFY\n"):]
        (size,) = struct.unpack(">I", rest[:4])
        self.identify = json.loads(rest[4:4 + size])
        self.reply(json.dumps(LOOKUPD_INFO).encode())
        return rest[4 + size:].splitlines()

    def reply(self, *payloads: bytes) -> None:
        self.proxy.dataReceived(b"".join(sized(p) for p in payloads))

    def ok(self, n: int = 1) -> None:
        self.reply(*[b"OK"] * n)

    @property
    def open(self) -> bool:
        return self.transport.connected and not self.transport.disconnecting
