"""mqadmin's GET API over a fake cluster, and its HTTP client against a real server.

The cluster is two lookupds and two brokers answering canned documents
(tests/unit/admin_fixtures) through a fake `Upstream` that answers as the
real daemons do (nsqd's /stats filters, lookupd's 404 for an unknown
topic) or fails like a broker that is down. The API runs in-process on
mqadmin's real site. The last tests run `Upstream` itself against a
twisted.web server on 127.0.0.1.
"""

from __future__ import annotations

import copy
import json
import pathlib
from urllib.parse import parse_qs, urlsplit

import pytest
import pytest_twisted
from twisted.internet.task import Clock

from mqd.admin import api
from mqd.admin.endpoint import Admin
from mqd.admin.web import AdminSite
from mqd.clusterinfo.cluster import Cluster
from mqd.clusterinfo.upstream import UpstreamError, base_url
from mqd.options import MQADMIN_OPTIONS, resolve
from tests.support.admin_fakes import COUNTER_ROWS, CannedUpstream, real_upstream
from tests.support.http_client import HTTPClient, error
from tests.support.web_server import serving

FIXTURES = pathlib.Path(__file__).parent / "admin_fixtures"
NOW = 1_700_001_000
A, B = "10.0.0.1:4151", "10.0.0.2:4151"
LK1, LK2 = "lk1:4161", "lk2:4161"


def fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


def refused(url: str, method: str = "Get") -> str:
    """Go's error for a refused connection, as nsqadmin quotes it."""
    host = urlsplit(url).netloc
    return f'{method} "{url}": dial tcp {host}: connect: connection refused'


# -- a fake cluster -----------------------------------------------------------------------------


def nsqd_stats(doc):
    """nsqd's /stats?format=json: `topic` / `channel` filters, `include_clients=false`."""

    def answer(q):
        out = copy.deepcopy(doc)
        topic, channel = q.get("topic", [""])[0], q.get("channel", [""])[0]
        topics = out["topics"]
        if topic:
            topics = [t for t in topics if t["topic_name"] == topic] or None
        if topics and channel:
            for t in topics:
                t["channels"] = [c for c in t["channels"] if c["channel_name"] == channel]
            topics = [t for t in topics if t["channels"]]
        if q.get("include_clients", ["true"])[0] == "false":
            for t in topics or ():
                for c in t["channels"]:
                    c["clients"] = None
        out["topics"] = topics
        return 200, out

    return answer


def lookupd(registrations: dict[str, tuple[list[str], list[dict]]], nodes):
    """A lookupd holding `topic: (channels, producers)`; /lookup of an unknown topic is 404."""

    def lookup(q):
        topic = q.get("topic", [""])[0]
        if topic not in registrations:
            return 404, {"message": "TOPIC_NOT_FOUND"}
        channels, producers = registrations[topic]
        return 200, {"channels": channels, "producers": producers}

    def channels(q):
        return 200, {"channels": registrations.get(q.get("topic", [""])[0], ([], []))[0]}

    return {
        "/topics": {"topics": sorted(registrations)},
        "/lookup": lookup,
        "/channels": channels,
        "/nodes": nodes,
    }


def peer(node_json: dict) -> dict:
    return {k: v for k, v in node_json.items() if k not in ("topics", "tombstones")}


class FakeUpstream(CannedUpstream):
    """`Upstream`'s calls over canned answers per host; hosts in `down` refuse connections."""

    def __init__(self, hosts: dict[str, dict], down=()) -> None:
        self.hosts = hosts
        self.down = set(down)
        self.urls: list[str] = []

    def _canned(self, method: str, url: str) -> tuple[int, bytes]:
        self.urls.append(url)
        parts = urlsplit(url)
        if parts.netloc in self.down or parts.netloc not in self.hosts:
            raise UpstreamError(url, "connection refused")
        handler = self.hosts[parts.netloc].get(parts.path)
        if handler is None:
            return 404, b'{"message":"NOT_FOUND"}'
        code, body = handler(parse_qs(parts.query)) if callable(handler) else (200, handler)
        if not isinstance(body, bytes):
            body = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        return code, body

    def post(self, url: str, body: bytes = b"", timeout=None, headers=None):
        return self.get(url)  # a POST answers as a GET of the same path here, whatever its status


NODES_1 = fixture("lookupd_nodes_1.json")
NODES_2 = fixture("lookupd_nodes_2.json")
PEER_A = peer(NODES_1["producers"][1])
PEER_B = peer(NODES_1["producers"][0])


def broker_a():
    return {
        "/stats": nsqd_stats(fixture("stats_a.json")),
        "/info": {"version": "1.3.0", "broadcast_address": "10.0.0.1", "hostname": "host-a",
                  "http_port": 4151, "tcp_port": 4150, "start_time": 1_700_000_000},
        "/ping": "OK",
        "/config/durable": True,
        # mqd answers a string option unquoted, as nsqd does.
        "/config/backend": lambda q: (200, b"lmdb"),
    }


def broker_b():
    """A real nsqd: no durable / backend options."""
    return {
        "/stats": nsqd_stats(fixture("stats_b.json")),
        "/info": {"version": "1.2.1", "broadcast_address": "10.0.0.2", "hostname": "host-b",
                  "http_port": 4151, "tcp_port": 4150, "start_time": 1_700_000_500},
        "/ping": "OK",
        "/config/durable": lambda q: (400, {"message": "INVALID_OPTION"}),
        "/config/backend": lambda q: (400, {"message": "INVALID_OPTION"}),
    }


def hosts():
    return {
        LK1: lookupd({
            "orders": (["audit", "billing", "ship"], [PEER_A, PEER_B]),
            "events": ([], [PEER_B]),
            "drafts": (["pending"], []),
        }, NODES_1),
        LK2: lookupd({"orders": (["audit", "billing"], [PEER_A])}, NODES_2),
        A: broker_a(),
        B: broker_b(),
    }


class Client(HTTPClient):
    def __init__(self, site) -> None:
        self.site = site


@pytest.fixture
def make():
    """make(down=(), lookupds=(LK1, LK2), nsqds=()): an in-process mqadmin API over the fake cluster."""

    def build(down=(), lookupds=(LK1, LK2), nsqds=(), upstream_hosts=None):
        clock = Clock()
        clock.advance(NOW)
        flags = {"lookupd-http-address": list(lookupds)} if lookupds else {"nsqd-http-address": list(nsqds)}
        settings = resolve(MQADMIN_OPTIONS, flags)
        upstream = FakeUpstream(upstream_hosts or hosts(), down)
        admin = Admin(settings, clock, upstream=upstream, cluster=Cluster(upstream, lookupds, nsqds))
        client = Client(AdminSite(admin, api.routes(admin)))
        client.upstream = upstream
        client.admin = admin
        return client

    return build


@pytest.fixture
def http(make):
    return make()


def ok(response) -> dict:
    assert response.status == 200, response.body
    assert response.v1 and response.is_json
    return response.json()


# -- /api/topics ----------------------------------------------------------------------------------


def test_topics_union_of_lookupds(http):
    assert ok(http.get("/api/topics")) == {"topics": ["drafts", "events", "orders"], "message": ""}


def test_inactive_topics_with_their_declared_channels(http):
    assert ok(http.get("/api/topics?inactive=true")) == {"topics": {"drafts": ["pending"]}, "message": ""}


def test_topics_one_lookupd_down_is_a_warning(make):
    body = ok(make(down={LK2}).get("/api/topics"))
    assert body["topics"] == ["drafts", "events", "orders"]
    assert body["message"] == "WARNING: " + refused("http://lk2:4161/topics")


def test_topics_every_lookupd_down_is_502(make):
    assert error(make(down={LK1, LK2}).get("/api/topics")) == (
        502, "UPSTREAM_ERROR: failed to query any nsqlookupd: " + refused("http://lk1:4161/topics") + "\n"
             + refused("http://lk2:4161/topics"))


def test_an_empty_cluster_lists_null_as_nsqadmin_does(make):
    empty_lookupd = lookupd({}, {"producers": []})
    http = make(lookupds=(LK1,), upstream_hosts={LK1: empty_lookupd})
    assert ok(http.get("/api/topics")) == {"topics": None, "message": ""}
    assert ok(http.get("/api/nodes")) == {"nodes": None, "message": ""}
    assert ok(http.get("/api/topics?inactive=true")) == {"topics": {}, "message": ""}
    no_topics = make(lookupds=(), nsqds=(A,), upstream_hosts={A: {**broker_a(), "/stats": {"topics": []}}})
    assert ok(no_topics.get("/api/topics")) == {"topics": None, "message": ""}


def test_topics_without_lookupd_from_the_brokers_stats(make):
    http = make(lookupds=(), nsqds=(A, B))
    assert ok(http.get("/api/topics")) == {"topics": ["events", "orders"], "message": ""}
    assert ok(http.get("/api/topics?inactive=true")) == {"topics": {}, "message": ""}


def test_inactive_topics_without_lookupd_warn_of_a_broker_down(make):
    """nsqadmin asks the brokers for their topics even then: a broker down is its warning, all down its 502."""
    stats = "/stats?format=json&include_clients=false&include_mem=false"
    body = ok(make(lookupds=(), nsqds=(A, B), down={B}).get("/api/topics?inactive=true"))
    assert body == {"topics": {}, "message": "WARNING: " + refused(f"http://{B}{stats}")}
    assert error(make(lookupds=(), nsqds=(A, B), down={A, B}).get("/api/topics?inactive=true")) == (
        502, "UPSTREAM_ERROR: failed to query any nsqd: " + refused(f"http://{A}{stats}") + "\n"
             + refused(f"http://{B}{stats}"))


# -- /api/topics/:topic -------------------------------------------------------------------------


def test_topic_summed_across_producers(http):
    body = ok(http.get("/api/topics/orders"))
    assert body["message"] == ""
    assert (body["node"], body["topic_name"], body["depth"], body["memory_depth"], body["backend_depth"],
            body["message_count"], body["paused"]) == ("*", "orders", 13, 10, 3, 158, True)
    assert [(n["node"], n["hostname"], n["depth"]) for n in body["nodes"]] == [(A, "host-a", 5), (B, "host-b", 8)]
    assert [c["channel_name"] for c in body["channels"]] == ["audit", "billing", "ship"]
    billing = body["channels"][1]
    assert (billing["depth"], billing["in_flight_count"], billing["client_count"]) == (30, 5, 3)
    # As nsqadmin: a topic page asks the brokers without clients.
    assert billing["clients"] is None
    assert all("include_clients=false" in u for u in http.upstream.urls if "/stats" in u)
    assert body["e2e_processing_latency"]["count"] == 80


def test_topic_asks_each_broker_for_that_topic_only(http):
    http.get("/api/topics/orders")
    stats = sorted(u for u in http.upstream.urls if "/stats" in u)
    assert stats == [f"http://{A}/stats?format=json&topic=orders&include_clients=false&include_mem=false",
                     f"http://{B}/stats?format=json&topic=orders&include_clients=false&include_mem=false"]


def test_topic_one_broker_down_counts_the_other_with_a_warning(make):
    body = ok(make(down={B}).get("/api/topics/orders"))
    assert (body["depth"], body["message_count"], body["paused"]) == (5, 107, False)
    assert [n["node"] for n in body["nodes"]] == [A]
    assert body["message"] == "WARNING: " + refused(
        f"http://{B}/stats?format=json&topic=orders&include_clients=false&include_mem=false")


def test_topic_every_producer_down_is_502(make):
    status, message = error(make(down={A, B}).get("/api/topics/orders"))
    assert status == 502
    assert message.startswith('UPSTREAM_ERROR: failed to query any nsqd: Get "http://10.0.0.1:4151/stats?')
    assert message.count("connection refused") == 2


LOOKUP_404 = 'got response 404 Not Found "{\\"message\\": \\"TOPIC_NOT_FOUND\\"}"'


def test_topic_unknown_everywhere_is_nsqadmins_502(http):
    """Every lookupd answers 404: nsqadmin's 502, each lookupd's answer quoted as Go quotes it."""
    assert error(http.get("/api/topics/ghost")) == (
        502, f"UPSTREAM_ERROR: failed to query any nsqlookupd: {LOOKUP_404}\n{LOOKUP_404}")


def test_topic_unknown_to_one_lookupd_is_no_warning(http):
    assert ok(http.get("/api/topics/events"))["message"] == ""


def test_topic_unknown_to_the_lookupd_that_answered_quotes_every_lookupd(make):
    """One lookupd down, the other never heard of the topic: nsqadmin's 502 quotes both."""
    assert error(make(down={LK1}).get("/api/topics/ghost")) == (
        502, "UPSTREAM_ERROR: failed to query any nsqlookupd: " + refused("http://lk1:4161/lookup?topic=ghost")
             + f"\n{LOOKUP_404}")


def test_topic_unknown_without_lookupd_is_nsqadmins_502(make):
    assert error(make(lookupds=(), nsqds=(A, B)).get("/api/topics/ghost")) == (
        502, "UPSTREAM_ERROR: failed to query any nsqd: ")


def test_topic_declared_without_producer_is_empty(http):
    body = ok(http.get("/api/topics/drafts"))
    assert (body["depth"], body["message_count"], body["nodes"], body["channels"]) == (0, 0, None, None)


def test_topic_without_lookupd(make):
    body = ok(make(lookupds=(), nsqds=(A, B)).get("/api/topics/events"))
    assert [n["node"] for n in body["nodes"]] == [B]
    assert body["depth"] == 3


# -- /api/topics/:topic/:channel ------------------------------------------------------------------


def test_channel_with_every_client(http):
    body = ok(http.get("/api/topics/orders/billing"))
    assert body["message"] == ""
    assert (body["topic_name"], body["channel_name"], body["depth"], body["memory_depth"],
            body["deferred_count"], body["requeue_count"], body["timeout_count"], body["message_count"],
            body["paused"]) == ("orders", "billing", 30, 21, 3, 4, 1, 150, True)
    assert [(c["node"], c["client_id"]) for c in body["clients"]] == [(A, "worker-1"), (B, "worker-0"),
                                                                      (B, "worker-2")]
    assert body["clients"][0]["connected"] == (NOW - 1_700_000_100) * 1_000_000_000
    assert [n["node"] for n in body["nodes"]] == [A, B]
    stats = [u for u in http.upstream.urls if "/stats" in u]
    assert all("topic=orders&channel=billing" in u and "include_clients" not in u for u in stats)


def test_channel_on_one_broker(http):
    body = ok(http.get("/api/topics/orders/ship"))
    assert [n["node"] for n in body["nodes"]] == [B]
    # No client anywhere: null, as nsqadmin's sum of the nodes' clients.
    assert body["clients"] is None


def test_channel_unknown_is_404(http):
    assert error(http.get("/api/topics/orders/nope")) == (404, "CHANNEL_NOT_FOUND")


def test_channel_of_unknown_topic_is_nsqadmins_502(http, make):
    assert error(http.get("/api/topics/ghost/nope")) == (
        502, f"UPSTREAM_ERROR: failed to query any nsqlookupd: {LOOKUP_404}\n{LOOKUP_404}")
    assert error(make(lookupds=(), nsqds=(A, B)).get("/api/topics/ghost/nope")) == (
        502, "UPSTREAM_ERROR: failed to query any nsqd: ")


def test_channel_declared_on_lookupd_only_is_zeros(http):
    body = ok(http.get("/api/topics/drafts/pending"))
    assert (body["depth"], body["client_count"], body["nodes"], body["clients"]) == (0, 0, [], None)


def test_channel_one_broker_down(make):
    body = ok(make(down={A}).get("/api/topics/orders/billing"))
    assert (body["depth"], [c["client_id"] for c in body["clients"]]) == (20, ["worker-0", "worker-2"])
    assert body["message"].startswith(f'WARNING: Get "http://{A}/stats?')


# -- /api/nodes ---------------------------------------------------------------------------------


def test_nodes_from_lookupds(http):
    body = ok(http.get("/api/nodes"))
    assert body["message"] == ""
    assert [(n["hostname"], n["out_of_date"], len(n["remote_addresses"])) for n in body["nodes"]] == [
        ("host-a", False, 2), ("host-b", True, 1)]
    assert body["nodes"][1]["topics"] == [{"topic": "events", "tombstoned": True},
                                          {"topic": "orders", "tombstoned": False}]


def test_nodes_one_lookupd_down(make):
    body = ok(make(down={LK1}).get("/api/nodes"))
    assert [n["hostname"] for n in body["nodes"]] == ["host-a"]
    assert body["message"] == "WARNING: " + refused("http://lk1:4161/nodes")


def test_nodes_without_lookupd_from_info(make):
    body = ok(make(lookupds=(), nsqds=(A, B)).get("/api/nodes"))
    assert [(n["hostname"], n["version"], n["remote_addresses"]) for n in body["nodes"]] == [
        ("host-a", "1.3.0", None), ("host-b", "1.2.1", None)]
    assert body["nodes"][1]["topics"] == [{"topic": "events", "tombstoned": False},
                                          {"topic": "orders", "tombstoned": False}]


def test_nodes_without_lookupd_a_broker_down_is_quoted_at_info_as_nsqadmin_asks_it(make):
    body = ok(make(lookupds=(), nsqds=(A, B), down={B}).get("/api/nodes"))
    assert [n["hostname"] for n in body["nodes"]] == ["host-a"]
    assert body["message"] == "WARNING: " + refused(f"http://{B}/info")


def test_node_its_topics_and_totals(http):
    body = ok(http.get(f"/api/nodes/{B}"))
    assert (body["node"], body["total_messages"], body["total_clients"], body["message"]) == (B, 54, 2, "")
    assert [t["topic_name"] for t in body["topics"]] == ["events", "orders"]
    assert [c["client_id"] for c in body["topics"][1]["channels"][0]["clients"]] == ["worker-2", "worker-0"]


def test_node_unknown_is_404(http):
    assert error(http.get("/api/nodes/9.9.9.9:4151")) == (404, "NODE_NOT_FOUND")


def test_node_down_is_502(make):
    status, message = error(make(down={B}).get(f"/api/nodes/{B}"))
    assert (status, message) == (502, "UPSTREAM_ERROR: failed to query any nsqd: " + refused(
        f"http://{B}/stats?format=json&include_mem=false"))


# -- /api/counter ---------------------------------------------------------------------------------


def test_counter(http):
    body = ok(http.get("/api/counter"))
    assert body["message"] == ""
    assert body["stats"] == COUNTER_ROWS
    # In the byte order of a Go map's keys, as nsqadmin writes them.
    assert list(body["stats"]) == sorted(body["stats"])


def test_counter_one_broker_down(make):
    body = ok(make(down={B}).get("/api/counter"))
    assert sorted(body["stats"]) == [f"orders:audit:{A}", f"orders:billing:{A}"]
    assert body["message"].startswith(f'WARNING: Get "http://{B}/stats?')


# -- /api/health (mqd) ----------------------------------------------------------------------------


def test_health_per_broker(http):
    body = ok(http.get("/api/health"))
    assert body["message"] == ""
    a, b = body["nodes"]
    assert {k: a[k] for k in ("node", "address", "hostname", "up", "healthy", "ping", "durable", "backend",
                              "version", "start_time", "registered", "error")} == {
        "node": A, "address": f"http://{A}", "hostname": "host-a", "up": True, "healthy": True, "ping": "OK",
        "durable": True, "backend": "lmdb", "version": "1.3.0", "start_time": 1_700_000_000,
        "registered": True, "error": None}
    # A real nsqd has no durable / backend options.
    assert (b["node"], b["up"], b["durable"], b["backend"], b["version"]) == (B, True, None, None, "1.2.1")


def test_health_unhealthy_store(make):
    h = hosts()
    h[A]["/ping"] = lambda q: (500, "NOK - No space left on device")
    body = ok(make(upstream_hosts=h).get("/api/health"))
    a = body["nodes"][0]
    assert (a["up"], a["healthy"], a["ping"]) == (True, False, "NOK - No space left on device")


def test_health_broker_down_and_gone_from_lookupd(make):
    http = make()
    ok(http.get("/api/health"))
    # B stops: lookupds drop it at once, its port refuses connections.
    http.upstream.down.add(B)
    for lk in (LK1, LK2):
        nodes = http.upstream.hosts[lk]["/nodes"]
        http.upstream.hosts[lk]["/nodes"] = {"producers": [p for p in nodes["producers"]
                                                           if p["hostname"] != "host-b"]}
    body = ok(http.get("/api/health"))
    a, b = body["nodes"]
    assert (a["up"], a["registered"]) == (True, True)
    assert (b["node"], b["up"], b["registered"], b["hostname"]) == (B, False, False, "host-b")
    assert b["error"] == f"http://{B}/ping: connection refused"
    assert body["message"] == "WARNING: " + refused(f"http://{B}/ping")


# -- /api/lookup (mqd) ----------------------------------------------------------------------------


def test_lookup_what_each_lookupd_holds(http):
    body = ok(http.get("/api/lookup"))
    assert body["message"] == ""
    lk1, lk2 = body["lookupds"]
    assert (lk1["address"], lk1["up"], lk1["error"]) == (LK1, True, None)
    assert lk1["topics"] == [
        {"topic": "drafts", "channels": ["pending"], "producers": []},
        {"topic": "events", "channels": [], "producers": [B]},
        {"topic": "orders", "channels": ["audit", "billing", "ship"], "producers": [A, B]},
    ]
    assert [n["hostname"] for n in lk1["nodes"]] == ["host-a", "host-b"]
    assert lk2["topics"] == [{"topic": "orders", "channels": ["audit", "billing"], "producers": [A]}]


def test_lookup_one_down(make):
    body = ok(make(down={LK2}).get("/api/lookup"))
    lk2 = body["lookupds"][1]
    assert (lk2["up"], lk2["error"], lk2["topics"]) == (False, "http://lk2:4161/topics: connection refused", [])
    assert body["message"] == "WARNING: http://lk2:4161/topics: connection refused"


def test_lookup_all_down_is_502(make):
    assert error(make(down={LK1, LK2}).get("/api/lookup"))[0] == 502


# -- Upstream against a real server -------------------------------------------------------------


def test_base_url():
    assert base_url("127.0.0.1:4151") == "http://127.0.0.1:4151"
    assert base_url("https://h:4152/") == "https://h:4152"


@pytest.fixture
def server():
    """A twisted.web server on 127.0.0.1:0 answering like a small nsqd."""
    from twisted.web import resource

    class Answer(resource.Resource):
        isLeaf = True

        def render_GET(self, request):
            if request.path == b"/info":
                request.setHeader(b"Content-Type", b"application/json")
                return b'{"version":"1.3.0"}'
            if request.path == b"/broken":
                request.setResponseCode(500)
                return b'{"message":"INTERNAL_ERROR"}'
            if request.path == b"/text":
                return b"not json"
            request.setResponseCode(404)
            return b'{"message":"NOT_FOUND"}'

        def render_POST(self, request):
            if request.path == b"/topic/create":
                self.posted = (request.args, request.content.read(), request.getHeader(b"content-type"))
                return b""
            request.setResponseCode(400)
            return b'{"message":"MISSING_ARG_TOPIC"}'

    root = Answer()
    with serving(root) as root.address:
        yield root


@pytest_twisted.inlineCallbacks
def test_upstream_get_json_and_post(server):
    upstream = real_upstream()
    try:
        doc = yield upstream.get_json(base_url(server.address) + "/info")
        assert doc == {"version": "1.3.0"}
        code, body = yield upstream.post(base_url(server.address) + "/topic/create?topic=t")
        assert (code, body) == (200, b"")
        assert server.posted == ({b"topic": [b"t"]}, b"", None)
        yield upstream.post(base_url(server.address) + "/topic/create", b'{"action":"x"}')
        assert server.posted == ({}, b'{"action":"x"}', b"application/json")
        code, body = yield upstream.get(base_url(server.address) + "/broken")
        assert (code, body) == (500, b'{"message":"INTERNAL_ERROR"}')
    finally:
        yield upstream.close()


@pytest_twisted.inlineCallbacks
def test_upstream_http_errors(server):
    upstream = real_upstream()
    url = base_url(server.address)
    try:
        with pytest.raises(UpstreamError) as e:
            yield upstream.get_json(url + "/broken")
        assert (e.value.url, e.value.code) == (url + "/broken", 500)
        assert str(e.value) == f"{url}/broken: got response 500 b'{{\"message\":\"INTERNAL_ERROR\"}}'"
        with pytest.raises(UpstreamError, match="invalid JSON"):
            yield upstream.get_json(url + "/text")
        with pytest.raises(UpstreamError) as e:
            yield upstream.post(url + "/topic/delete")
        assert e.value.code == 400 and e.value.body == b'{"message":"MISSING_ARG_TOPIC"}'
    finally:
        yield upstream.close()


@pytest_twisted.inlineCallbacks
def test_upstream_connection_refused():
    from twisted.internet import reactor
    from twisted.web import server as web_server
    from twisted.web.resource import Resource

    # A port that was just free: nothing listens there now.
    port = reactor.listenTCP(0, web_server.Site(Resource()), interface="127.0.0.1")
    address = f"127.0.0.1:{port.getHost().port}"
    yield port.stopListening()
    upstream = real_upstream()
    with pytest.raises(UpstreamError) as e:
        yield upstream.get_json(base_url(address) + "/stats")
    assert str(e.value) == f"http://{address}/stats: connection refused"
    assert e.value.code is None


@pytest_twisted.inlineCallbacks
def test_upstream_request_timeout():
    """A broker that accepts the connection and never answers fails after --http-client-request-timeout."""
    from twisted.internet import protocol, reactor

    silent = protocol.Factory.forProtocol(protocol.Protocol)
    port = reactor.listenTCP(0, silent, interface="127.0.0.1")
    upstream = real_upstream(**{"http-client-request-timeout": "0.2s"})
    try:
        start = reactor.seconds()
        with pytest.raises(UpstreamError) as e:
            yield upstream.get_json(f"http://127.0.0.1:{port.getHost().port}/stats")
        assert e.value.reason == "request timed out"
        assert reactor.seconds() - start < 3
    finally:
        yield upstream.close()
        yield port.stopListening()


@pytest_twisted.inlineCallbacks
def test_upstream_retries_over_https_on_tls_required(server):
    """nsqd --tls-required answers plain HTTP 403 with its https_port: the request is retried there."""
    from twisted.internet import reactor
    from twisted.web import resource
    from twisted.web import server as web_server

    class TLSRequired(resource.Resource):
        isLeaf = True

        def render_GET(self, request):
            request.setResponseCode(403)
            return json.dumps({"message": "TLS_REQUIRED", "https_port": https_port}).encode()

    https_port = int(server.address.rsplit(":", 1)[1])  # stands in for the HTTPS listener
    port = reactor.listenTCP(0, web_server.Site(TLSRequired()), interface="127.0.0.1")
    upstream = real_upstream()
    tried = []
    real_once = upstream._once

    def once(method, url, *rest):
        tried.append(url)
        # The retry goes to https://; answer it from the plain test server instead.
        return real_once(method, url.replace("https://", "http://"), *rest)

    upstream._once = once
    try:
        doc = yield upstream.get_json(f"http://127.0.0.1:{port.getHost().port}/info")
        assert doc == {"version": "1.3.0"}
        assert tried == [f"http://127.0.0.1:{port.getHost().port}/info", f"https://127.0.0.1:{https_port}/info"]
    finally:
        yield upstream.close()
        yield port.stopListening()


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for `localhost` signed by itself (so it is its own CA), and its key, as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest_twisted.inlineCallbacks
def test_upstream_https_verification(tmp_path):
    """HTTPS brokers: verified against --http-client-tls-root-ca-file, or not at all when insecure."""
    from twisted.internet import reactor, ssl
    from twisted.web import resource
    from twisted.web import server as web_server

    class Info(resource.Resource):
        isLeaf = True

        def render_GET(self, request):
            return b'{"version":"1.3.0"}'

    cert_path, key_path = self_signed(tmp_path)
    with open(cert_path, "rb") as c, open(key_path, "rb") as k:
        server_cert = ssl.PrivateCertificate.loadPEM(c.read() + k.read())
    port = reactor.listenSSL(0, web_server.Site(Info()), server_cert.options(), interface="127.0.0.1")
    url = f"https://localhost:{port.getHost().port}/info"
    upstreams = []
    try:
        trusting = real_upstream(**{"http-client-tls-root-ca-file": cert_path})
        insecure = real_upstream(**{"http-client-tls-insecure-skip-verify": True})
        default = real_upstream()  # the platform's CAs: a self-signed certificate is refused
        upstreams += [trusting, insecure, default]
        assert (yield trusting.get_json(url)) == {"version": "1.3.0"}
        assert (yield insecure.get_json(url)) == {"version": "1.3.0"}
        with pytest.raises(UpstreamError) as e:
            yield default.get_json(url)
        assert e.value.code is None and e.value.url == url
    finally:
        for u in upstreams:
            yield u.close()
        yield port.stopListening()


def test_tls_options_checked_at_start(tmp_path):
    from mqd.clusterinfo.upstream import ClientTLS
    from mqd.options import ConfigError

    with pytest.raises(ConfigError, match="cannot read --http-client-tls-root-ca-file"):
        ClientTLS(root_ca_file=str(tmp_path / "missing.pem"))
    (tmp_path / "empty.pem").write_text("nothing\n")
    with pytest.raises(ConfigError, match="no certificate"):
        ClientTLS(root_ca_file=str(tmp_path / "empty.pem"))
    cert_path, key_path = self_signed(tmp_path)
    assert ClientTLS(cert_file=cert_path, key_file=key_path)._client_cert is not None


def test_health_without_lookupd_a_configured_broker_down(make):
    body = ok(make(lookupds=(), nsqds=(A, B), down={B}).get("/api/health"))
    a, b = body["nodes"]
    assert (a["node"], a["up"], a["registered"], a["durable"]) == (A, True, True, True)
    assert (b["node"], b["address"], b["up"], b["registered"]) == (B, f"http://{B}", False, False)
    assert body["message"].startswith("WARNING: " + refused(f"http://{B}/info") + "\n")
    assert body["message"].endswith("\n" + refused(f"http://{B}/ping"))
