"""In-process clients of mqlookupd: a V1 TCP connection (a broker's side) and an HTTP client."""

from __future__ import annotations

import json

from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport

from mqd.lookup.http import LookupdSite
from mqd.lookup.registry import RegistrationDB
from tests.support.http_client import HTTPClient
from tests.support.v2_frames import sized

# What a broker identifies itself with on connecting to mqlookupd.
IDENTIFY = {"version": "1.3.0", "tcp_port": 4150, "http_port": 4151, "hostname": "box",
            "broadcast_address": "b1", "topology_zone": "z", "topology_region": "r"}


class Conn:
    """A V1 connection from 10.0.0.1:`port` to a LookupdFactory's protocol, over a StringTransport."""

    def __init__(self, factory, port: int) -> None:
        addr = IPv4Address("TCP", "10.0.0.1", port)
        self.proto = factory.buildProtocol(addr)
        self.transport = StringTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)

    def send(self, data: bytes) -> bytes:
        """Feed bytes; returns what was written back since the last call."""
        self.proto.dataReceived(data)
        out = self.transport.value()
        self.transport.clear()
        return out

    def identify(self, **changes) -> bytes:
        body = json.dumps({**IDENTIFY, **changes}).encode()
        return self.send(b"IDENTIFY\n" + sized(body))

    @property
    def closed(self) -> bool:
        return self.transport.disconnecting

    def close(self) -> None:
        self.proto.connectionLost(None)


class LookupdClient(HTTPClient):
    """The in-process HTTP client of tests/support/http_client.py, on a LookupdSite."""

    def __init__(self, db: RegistrationDB, clock) -> None:
        self.site = LookupdSite(db, reactor=clock)
