"""The nsqd HTTP API root.

This first cut serves what scripts use to check a broker is up (`/ping`,
`/info`); the rest of nsqd's API is issue #4. Unknown paths answer as nsqd
does: 404 {"message":"NOT_FOUND"}.
"""

from __future__ import annotations

import json
import socket

from twisted.web import resource

from ..protocol.v2 import NSQ_VERSION

__all__ = ["NsqdAPI"]


def _json(request, status: int, payload) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json; charset=utf-8")
    request.setHeader(b"X-NSQ-Content-Type", b"nsq; version=1.0")
    return json.dumps(payload, separators=(",", ":")).encode()


class _Leaf(resource.Resource):
    isLeaf = True

    def __init__(self, api: NsqdAPI) -> None:
        super().__init__()
        self.api = api


class Ping(_Leaf):
    def render_GET(self, request) -> bytes:
        request.setHeader(b"Content-Type", b"text/plain; charset=utf-8")
        health = self.api.broker.health
        if health:
            request.setResponseCode(500)
            return f"NOK - {health}".encode()
        return b"OK"

    render_HEAD = render_GET


class Info(_Leaf):
    def render_GET(self, request) -> bytes:
        return _json(request, 200, self.api.info())


class NotFound(_Leaf):
    def render(self, request) -> bytes:
        return _json(request, 404, {"message": "NOT_FOUND"})


class NsqdAPI(resource.Resource):
    def __init__(self, broker, ports) -> None:
        super().__init__()
        self.broker = broker
        # Bound ports, filled in once the listeners are up (port 0 picks one).
        self.ports = ports
        self.putChild(b"ping", Ping(self))
        self.putChild(b"info", Info(self))

    def getChild(self, path, request):
        return NotFound(self)

    def info(self) -> dict:
        opts = self.broker.options
        return {
            "version": NSQ_VERSION,
            "broadcast_address": opts.broadcast_address,
            "hostname": socket.gethostname(),
            "http_port": opts.broadcast_http_port or self.ports.get("HTTP", 0),
            "tcp_port": opts.broadcast_tcp_port or self.ports.get("TCP", 0),
            "start_time": self.broker.start_time,
        }
