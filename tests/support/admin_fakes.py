"""mqadmin in process over a fake upstream and cluster that record every request.

`Cluster` is an Admin whose lookupds and brokers are `FakeUpstream` and
`FakeCluster`: they record every URL and answer from a table, or hold
their answers until the test fires them, so the order of a fan-out is
observable. Time is a task.Clock.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web import resource

from mqd.admin.actions import routes
from mqd.admin.endpoint import Admin
from mqd.admin.notify import Notifier
from mqd.clusterinfo.upstream import Upstream, UpstreamError
from mqd.http.router import ApiSite
from mqd.options import MQADMIN_OPTIONS, resolve
from tests.support.http_client import Response, parse_response

L1, L2 = "lookupd1:4161", "lookupd2:4161"
N1, N2 = "10.0.0.1:4151", "10.0.0.2:4151"


def producer(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {"broadcast_address": host, "hostname": host, "http_port": int(port), "tcp_port": 4150,
            "version": "1.3.0"}


class CannedUpstream:
    """`Upstream`'s calls over canned answers: a subclass gives `_canned(method, url)` -> (code, body bytes).

    `get_json` and `post` fail as the real client does, with an
    UpstreamError carrying the status and body, on an answer that is not a
    success.
    """

    def _canned(self, method: str, url: str) -> tuple[int, bytes]:
        raise NotImplementedError

    def get(self, url: str, headers=None) -> Deferred:
        return maybeDeferred(self._canned, "GET", url)

    def get_json(self, url: str, headers=None, max_bytes=None) -> Deferred:
        def parse(answer):
            code, body = answer
            if code != 200:
                raise UpstreamError(url, f"got response {code} {body!r}", code, body)
            return json.loads(body)

        return self.get(url).addCallback(parse)

    def post(self, url: str, body: bytes = b"", timeout=None, headers=None) -> Deferred:
        def check(answer):
            code, text = answer
            if not 200 <= code < 300:
                raise UpstreamError(url, f"got response {code} {text!r}", code, text, "POST")
            return answer

        return maybeDeferred(self._canned, "POST", url).addCallback(check)


class Down:
    """An `answers` entry: the target cannot be reached."""


class FakeUpstream:
    """Records every request in `events`; answers by address from `answers` (default 200, empty).

    An answer is (status, body), a JSON value for get_json, or `Down`; what
    is not a usable answer fails with an UpstreamError as mqadmin's Upstream
    fails (a status other than 2xx keeps its code and body). With `hold`,
    POSTs wait in `waiting` until the test fires them.
    """

    def __init__(self, events: list) -> None:
        self.events = events
        self.answers: dict[str, Any] = {}
        self.hold = False
        self.waiting: list[tuple[str, Deferred]] = []
        self.timeouts: list = []
        # The extra headers of each request, and the answer bound of each GET.
        self.headers: list = []
        self.max_bytes: list = []

    def _answer(self, url: str, default: Any, method: str = "GET") -> Deferred:
        answer = self.answers.get(urlsplit(url).netloc, default)
        if answer is Down:
            return fail(UpstreamError(url, "connection refused", method=method))
        if isinstance(answer, tuple) and not 200 <= answer[0] < 300:
            code, body = answer
            return fail(UpstreamError(url, f"got response {code} {body!r}", code, body, method))
        return succeed(answer)

    def post(self, url: str, body: bytes = b"", timeout: float | None = None, headers=None) -> Deferred:
        self.events.append(("POST", url, body))
        self.timeouts.append(timeout)
        self.headers.append(headers)
        if self.hold:
            d = Deferred()
            self.waiting.append((url, d))
            return d
        return self._answer(url, (200, b""), "POST")

    def get_json(self, url: str, headers=None, max_bytes=None) -> Deferred:
        self.events.append(("GET", url, None))
        self.headers.append(headers)
        self.max_bytes.append(max_bytes)
        return self._answer(url, {})

    def release(self) -> list[str]:
        """Fire every held POST with 200; the URLs released."""
        waiting, self.waiting = self.waiting, []
        for _, d in waiting:
            d.callback((200, b""))
        return [url for url, _ in waiting]


class FakeCluster:
    """Who produces what: the same producers for every topic unless `by_topic` says otherwise."""

    def __init__(self, events: list, producers: list[str], errors: list[str] | None = None) -> None:
        self.events = events
        self.nodes = [producer(a) for a in producers]
        self.errors = errors or []
        self.by_topic: dict[str, list[str]] = {}

    def node_url(self, node: str) -> str:
        return "http://" + node

    def using(self, upstream) -> FakeCluster:
        """As Cluster.using: the same answers (this fake asks no upstream)."""
        return self

    def topic_producers(self, topic: str) -> Deferred:
        self.events.append(("topic_producers", topic, None))
        nodes = [producer(a) for a in self.by_topic[topic]] if topic in self.by_topic else self.nodes
        # As Cluster: None when every lookupd failed.
        return succeed((None if self.errors and not nodes else nodes, list(self.errors)))

    def producers(self) -> Deferred:
        self.events.append(("producers", None, None))
        return succeed((None if self.errors and not self.nodes else self.nodes, list(self.errors)))


class Dispatch(resource.Resource):
    """The part of web.py's router these tests need: `:name` segments, 405 for other methods."""

    isLeaf = True

    def __init__(self, table: dict[str, Any]) -> None:
        super().__init__()
        self.table = table

    def render(self, request):
        parts = request.path.decode().split("/")
        for pattern, endpoint in self.table.items():
            segments = pattern.split("/")
            if len(segments) != len(parts):
                continue
            params = {}
            for s, p in zip(segments, parts, strict=True):
                if s.startswith(":") and p:
                    params[s[1:]] = p
                elif s != p:
                    break
            else:
                if request.method.decode() not in endpoint.methods:
                    request.setResponseCode(405)
                    return b""
                return endpoint.render(request, params)
        request.setResponseCode(404)
        return b""


class Cluster:
    """An Admin over the fakes, with a client that speaks HTTP to its routes."""

    def __init__(self, clock, lookupds=(L1, L2), producers=(N1, N2), **flags) -> None:
        self.clock = clock
        self.events: list = []
        flags.setdefault("lookupd-http-address", list(lookupds))
        self.settings = resolve(MQADMIN_OPTIONS, flags)
        self.upstream = FakeUpstream(self.events)
        self.notifications = FakeUpstream([])
        self.cluster = FakeCluster(self.events, list(producers))
        self.admin = Admin(settings=self.settings, reactor=clock, upstream=self.upstream, cluster=self.cluster)
        self.admin.notifier = Notifier(self.notifications, self.settings, clock=clock, hostname="admin-host")
        self.site = ApiSite(Dispatch(routes(self.admin)), reactor=clock)
        self.port = 50000

    def send(self, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None, peer=None) -> StringTransport:
        self.port += 1
        addr = peer or IPv4Address("TCP", "127.0.0.1", self.port)
        proto = self.site.buildProtocol(addr)
        transport = StringTransport(peerAddress=addr)
        proto.makeConnection(transport)
        lines = [f"{method} {path} HTTP/1.1", "Host: admin.example:4171"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        lines.append(f"Content-Length: {len(body or b'')}")
        proto.dataReceived(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        transport.protocol = proto
        return transport

    def answer(self, transport: StringTransport) -> Response:
        response = parse_response(transport.value())
        assert response is not None, "no complete response"
        transport.protocol.connectionLost(Failure(ConnectionDone()))
        return response

    def request(self, method: str, path: str, body: Any = None, **kw) -> Response:
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        return self.answer(self.send(method, path, body, **kw))

    def posts(self) -> list[str]:
        return [url for kind, url, _ in self.events if kind == "POST"]

    def sent(self) -> list[dict]:
        return [json.loads(body) for _, _, body in self.notifications.events]


def peeked(n: int, total: int) -> dict:
    return {"topic": "t", "channel": "c", "state": "queued", "total": total,
            "messages": [{"id": f"{i:016x}", "attempts": 1, "body_text": f"m{i}"} for i in range(n)]}


def real_upstream(**flags):
    from twisted.internet import reactor

    flags.setdefault("nsqd-http-address", ["127.0.0.1:4151"])
    return Upstream(reactor, resolve(MQADMIN_OPTIONS, flags))


# What /api/counter answers for the two canned brokers of tests/unit/admin_fixtures/
# (their addresses are N1 and N2): the aggregation and the HTTP API expect the same rows.
COUNTER_ROWS = {
    f"orders:audit:{N1}": {"node": N1, "topic_name": "orders", "channel_name": "audit", "message_count": 7},
    f"orders:billing:{N1}": {"node": N1, "topic_name": "orders", "channel_name": "billing",
                             "message_count": 100},
    f"orders:billing:{N2}": {"node": N2, "topic_name": "orders", "channel_name": "billing",
                             "message_count": 50},
    f"orders:ship:{N2}": {"node": N2, "topic_name": "orders", "channel_name": "ship", "message_count": 1},
}
