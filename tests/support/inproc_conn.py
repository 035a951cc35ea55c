"""RawConn's interface on an in-process broker: byte-level V2 checks without a process.

tests/support/raw_conn.py's RawConn speaks V2 by hand to a real broker
over a socket. InprocConn has the same calls (`send`, `read_frame`,
`read_message`, `expect_silence`, `expect_closed`) on a V2 protocol of an
in-process Broker over a StringTransport, so a test of exact bytes, frame
by frame, runs in memory with the same assertions. Time is the broker's
`task.Clock`: "silence for 0.2 s" is the clock advanced 0.2 s with nothing
written, and anything the broker does a reactor turn later is run by
advancing the clock by 0 before a read gives up.
"""

from __future__ import annotations

import itertools
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from mqd.nsqd.broker import Broker
from mqd.nsqd.protocol.v2 import V2Factory
from tests.support.http_client import HTTPClient
from tests.support.raw_conn import MAGIC_V2, FrameReader

_ports = itertools.count(30000)

# Reactor turns a read runs (clock.advance(0)) waiting for the broker to write.
TURNS = 100


class InprocConn(FrameReader):
    """A V2 connection to an in-process `broker`, read frame by frame like RawConn."""

    def __init__(self, broker: Broker, magic: bytes | None = MAGIC_V2) -> None:
        self.clock = broker.clock
        addr = IPv4Address("TCP", "127.0.0.1", next(_ports))
        self.proto = V2Factory(broker).buildProtocol(addr)
        self.transport = StringTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)
        self._buf = b""
        self._lost = False
        if magic is not None:
            self.send(magic)

    def send(self, data: bytes) -> None:
        assert not self.transport.disconnecting, "sending on a connection the broker closed"
        self.proto.dataReceived(data)

    def _take(self) -> None:
        """Move what the broker wrote (its output buffer flushed) into the read buffer."""
        if not self.transport.disconnecting:
            self.proto.flush_output()
        self._buf += self.transport.value()
        self.transport.clear()

    def _read_exactly(self, n: int) -> bytes:
        self._take()
        for _ in range(TURNS):
            if len(self._buf) >= n:
                break
            self.clock.advance(0)
            self._take()
        if len(self._buf) < n:
            state = "closed" if self.transport.disconnecting else "open"
            raise AssertionError(f"connection {state} with {len(self._buf)}/{n} bytes read")
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def expect_closed(self) -> None:
        """The broker has closed the connection, with nothing more written."""
        self.clock.advance(0)
        self._take()
        assert not self._buf, f"unread bytes before close: {self._buf!r}"
        assert self.transport.disconnecting, "the broker left the connection open"
        self.close()

    def expect_silence(self, seconds: float) -> None:
        """Nothing arrives while the clock moves `seconds`, and the connection stays open."""
        self.clock.advance(seconds)
        self._take()
        assert not self._buf, f"expected silence, got {self._buf!r}"
        assert not self.transport.disconnecting, "expected silence, the broker closed"

    def close(self) -> None:
        """What the reactor does once the socket is closed: connectionLost."""
        if not self._lost:
            self._lost = True
            self.proto.connectionLost(Failure(ConnectionDone()))

    def __enter__(self) -> InprocConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get(broker: Broker, path: str) -> tuple[int, Any]:
    """(status, JSON body) of a GET on the broker's HTTP API, as BrokerProcess.get answers it."""
    response = HTTPClient(broker).get(path)
    return response.status, response.json()
