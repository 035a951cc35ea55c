"""An in-process HTTP client for the nsqd API: real twisted.web, no sockets.

Requests are written as raw HTTP/1.1 into a `Site` protocol over a
StringTransport and the bytes it writes back are parsed, so the tests see
exactly what a client would (status, headers, body) while the broker runs
on the test's Clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from mqd.nsqd.http.site import NsqdSite

V1 = "nsq; version=1.0"


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def v1(self) -> bool:
        return self.header("X-NSQ-Content-Type") == V1

    @property
    def is_json(self) -> bool:
        return self.header("Content-Type") == "application/json; charset=utf-8"


def parse_response(raw: bytes, head: bool = False) -> Response | None:
    """The first complete response in `raw`, or None if it has not all arrived.

    `head`: the answer to a HEAD, whose Content-Length announces no body.
    """
    top, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = 0 if head else int(headers.get("content-length", "0"))
    if len(rest) < length:
        return None
    return Response(status, headers, rest[:length])


class HTTPClient:
    """Sends requests to an NsqdSite built on `broker`, one connection per request."""

    _port = 40000  # the client port of the last request

    def __init__(self, broker, ports: dict[str, int] | None = None) -> None:
        ports = ports if ports is not None else {"TCP": 4150, "HTTP": 4151}
        self.site = NsqdSite(broker, ports, reactor=broker.clock)

    def send(self, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> StringTransport:
        """Write the request; returns the transport the answer is written to."""
        self._port += 1
        addr = IPv4Address("TCP", "127.0.0.1", self._port)
        proto = self.site.buildProtocol(addr)
        transport = StringTransport(peerAddress=addr)
        proto.makeConnection(transport)
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
        for name, value in (headers or {}).items():
            lines.append(f"{name}: {value}")
        if body is not None and not any(k.lower() in ("content-length", "transfer-encoding")
                                        for k in (headers or {})):
            lines.append(f"Content-Length: {len(body)}")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")
        proto.dataReceived(data)
        transport.protocol = proto
        return transport

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> Response:
        """Send and return the answer, which must be complete without the clock moving."""
        transport = self.send(method, path, body, headers)
        response = parse_response(transport.value(), head=method == "HEAD")
        assert response is not None, "no complete response"
        # Closed, so the Clock does not pile up every connection's idle timeout.
        transport.protocol.connectionLost(Failure(ConnectionDone()))
        return response

    def turned(self, method: str, path: str, body: bytes | None = None,
               headers: dict[str, str] | None = None, turns: int = 10_000) -> Response:
        """As `request`, the broker's clock turned (`advance(0)`) until the answer is complete.

        For a handler that answers over several reactor turns: a large peek,
        built a slice at a time.
        """
        transport = self.send(method, path, body, headers)
        clock = self.site.broker.clock
        for _ in range(turns):
            response = parse_response(transport.value(), head=method == "HEAD")
            if response is not None:
                transport.protocol.connectionLost(Failure(ConnectionDone()))
                return response
            clock.advance(0)
        raise AssertionError(f"{method} {path}: no complete answer after {turns} turns")

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: bytes = b"", **kw: Any) -> Response:
        return self.request("POST", path, body, **kw)

    def put(self, path: str, body: bytes = b"", **kw: Any) -> Response:
        return self.request("PUT", path, body, **kw)


def error(response: Response) -> tuple[int, str]:
    """(status, message) of a V1 error, checking its headers on the way."""
    assert response.v1, response.headers
    assert response.is_json, response.headers
    body = response.json()
    assert list(body) == ["message"], body
    return response.status, body["message"]
