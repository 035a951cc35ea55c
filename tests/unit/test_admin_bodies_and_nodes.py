"""mqadmin and the brokers' bodies: the bearer secret passed on, a broker's 401/403 handed back,
peek bounded (max_body passed on, each answer read up to a bound), and actions on one node only
on a node the cluster knows.

Over the fakes of test_admin_actions (an upstream that records every
request, a cluster that says who produces what), through real twisted.web.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted

from mqd.admin.actions import PEEK_ANSWER_MAX
from mqd.clusterinfo.upstream import UpstreamError
from tests.support.admin_fakes import N1, N2, Cluster, Down, peeked, real_upstream
from tests.support.http_client import error

AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture
def mqadmin(clock) -> Cluster:
    return Cluster(clock)


def gets(mqadmin: Cluster) -> list[str]:
    return [url for kind, url, _ in mqadmin.events if kind == "GET"]


# -- peek -------------------------------------------------------------------------------------------


def test_peek_passes_the_bearer_secret_and_max_body_on_and_bounds_each_answer(mqadmin):
    mqadmin.upstream.answers.update({N1: peeked(1, 1), N2: peeked(1, 1)})
    r = mqadmin.request("GET", "/api/peek/t/c?max_body=100", headers=AUTH)
    assert r.status == 200
    assert gets(mqadmin) == [f"http://{N1}/channel/peek?topic=t&channel=c&state=queued&n=20&max_body=100",
                             f"http://{N2}/channel/peek?topic=t&channel=c&state=queued&n=20&max_body=100"]
    assert mqadmin.upstream.headers == [{b"Authorization": [b"Bearer s3cret"]}] * 2
    assert mqadmin.upstream.max_bytes == [PEEK_ANSWER_MAX] * 2


def test_peek_without_max_body_leaves_the_brokers_cap(mqadmin):
    mqadmin.upstream.answers.update({N1: peeked(0, 0), N2: peeked(0, 0)})
    assert mqadmin.request("GET", "/api/peek/t/c").status == 200
    assert all("max_body" not in url for url in gets(mqadmin))
    assert mqadmin.upstream.headers == [None, None]


def test_peek_numbers_of_thousands_of_digits_are_capped_not_converted(mqadmin):
    """Python refuses int() of over 4,300 digits: such an n or max_body is "more than any bound"."""
    mqadmin.upstream.answers.update({N1: peeked(0, 0), N2: peeked(0, 0)})
    huge = "9" * 5000
    assert mqadmin.request("GET", f"/api/peek/t/c?n={huge}&max_body={huge}").status == 200
    assert all(url.endswith(f"&n=1000&max_body={10**18}") for url in gets(mqadmin)), gets(mqadmin)


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", "garbage"])
def test_other_credentials_are_not_passed_on(mqadmin, header):
    mqadmin.upstream.answers.update({N1: peeked(0, 0), N2: peeked(0, 0)})
    assert mqadmin.request("GET", "/api/peek/t/c", headers={"Authorization": header}).status == 200
    assert mqadmin.upstream.headers == [None, None]


@pytest.mark.parametrize("value", ["x", "-1", "", "1.5"])
def test_peek_max_body_is_checked_as_the_brokers_check_it(mqadmin, value):
    assert error(mqadmin.request("GET", f"/api/peek/t/c?max_body={value}")) == (400, "INVALID_MAX_BODY")
    assert mqadmin.events == []


def test_peek_shows_each_nodes_more(mqadmin):
    full = dict(peeked(2, 9), more=True)
    mqadmin.upstream.answers.update({N1: full, N2: peeked(1, 1)})
    nodes = mqadmin.request("GET", "/api/peek/t/c").json()["nodes"]
    assert [(n["node"], n["more"]) for n in nodes] == [(N1, True), (N2, None)]


def refusal(code: int, message: str) -> tuple[int, bytes]:
    return code, json.dumps({"message": message}).encode()


@pytest.mark.parametrize(("answers", "expected"), [
    ((refusal(401, "AUTH_REQUIRED"), refusal(401, "AUTH_REQUIRED")), (401, "AUTH_REQUIRED")),
    ((refusal(401, "AUTH_FAILED"), Down), (401, "AUTH_FAILED")),
    ((refusal(403, "UNAUTHORIZED"), refusal(403, "UNAUTHORIZED")), (403, "UNAUTHORIZED")),
    ((refusal(403, "UNAUTHORIZED"), refusal(401, "AUTH_FAILED")), (401, "AUTH_FAILED")),
])
def test_when_no_node_answered_a_brokers_refusal_is_the_answer(mqadmin, answers, expected):
    mqadmin.upstream.answers.update(dict(zip((N1, N2), answers, strict=True)))
    r = mqadmin.request("GET", "/api/peek/t/c", headers=AUTH)
    assert error(r) == expected
    assert r.header("WWW-Authenticate") == ("Bearer" if expected[0] == 401 else None)


def test_one_node_refusing_is_that_nodes_error(mqadmin):
    mqadmin.upstream.answers.update({N1: refusal(403, "UNAUTHORIZED"), N2: peeked(1, 1)})
    r = mqadmin.request("GET", "/api/peek/t/c", headers=AUTH)
    assert r.status == 200
    assert [n["error"] for n in r.json()["nodes"]] == ["403 UNAUTHORIZED", None]
    assert r.json()["message"] == f"WARNING: nsqd {N1}: 403 UNAUTHORIZED"


# -- snapshot ---------------------------------------------------------------------------------------


def test_snapshot_passes_the_bearer_secret_on(mqadmin):
    mqadmin.upstream.answers[N1] = (200, json.dumps({"path": "/p", "manifest": {"queues": []}}).encode())
    assert mqadmin.request("POST", f"/api/snapshot/{N1}", headers=AUTH).status == 200
    assert mqadmin.upstream.headers == [{b"Authorization": [b"Bearer s3cret"]}]


@pytest.mark.parametrize(("code", "message"), [(401, "AUTH_REQUIRED"), (401, "AUTH_FAILED"), (403, "UNAUTHORIZED")])
def test_snapshot_hands_a_brokers_refusal_back(mqadmin, code, message):
    mqadmin.upstream.answers[N1] = refusal(code, message)
    r = mqadmin.request("POST", f"/api/snapshot/{N1}")
    assert error(r) == (code, message)
    assert r.header("WWW-Authenticate") == ("Bearer" if code == 401 else None)
    assert mqadmin.sent() == []


# -- actions on one node ----------------------------------------------------------------------------


@pytest.mark.parametrize("node", ["evil.example:80", "127.0.0.1:1", "10.0.0.1:4152", "nonsense"])
def test_tombstone_of_a_node_the_cluster_does_not_know_asks_nobody(mqadmin, node):
    r = mqadmin.request("DELETE", f"/api/nodes/{node}", {"topic": "t"})
    assert error(r) == (404, "NODE_NOT_FOUND")
    assert mqadmin.posts() == [] and mqadmin.sent() == []


def test_tombstone_when_no_lookupd_answers_is_502(clock):
    c = Cluster(clock, producers=())
    c.cluster.errors = ["lookupd1:4161: connection refused"]
    assert error(c.request("DELETE", f"/api/nodes/{N1}", {"topic": "t"})) == \
        (502, "UPSTREAM_ERROR: lookupd1:4161: connection refused")
    assert c.posts() == []


def test_snapshot_and_tombstone_check_the_node_the_same_way(mqadmin):
    for method, path, body in (("DELETE", "/api/nodes/{}", {"topic": "t"}), ("POST", "/api/snapshot/{}", None)):
        mqadmin.events.clear()
        assert error(mqadmin.request(method, path.format("x.example:1"), body)) == (404, "NODE_NOT_FOUND")
        assert mqadmin.events == [("producers", None, None)]


def test_tombstone_of_a_known_node_still_goes_everywhere(mqadmin):
    r = mqadmin.request("DELETE", f"/api/nodes/{N2}", {"topic": "t"})
    assert r.status == 200
    assert mqadmin.posts()[-1] == f"http://{N2}/topic/delete?topic=t"


# -- names no broker could hold --------------------------------------------------------------------


@pytest.mark.parametrize(("path", "message"), [("/api/peek/%ff/c", "INVALID_ARG_TOPIC"),
                                               ("/api/peek/t/%ff", "INVALID_ARG_CHANNEL"),
                                               ("/api/peek/a%20b/c", "INVALID_ARG_TOPIC")])
def test_peek_of_a_name_no_broker_could_hold_asks_nobody(mqadmin, path, message):
    assert error(mqadmin.request("GET", path)) == (400, message)
    assert mqadmin.events == []



# -- the upstream client, over real HTTP ---------------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_upstream_sends_the_headers_it_is_given_and_stops_reading_past_max_bytes():
    from twisted.internet import reactor
    from twisted.web import resource
    from twisted.web import server as web_server

    seen: list = []

    class Big(resource.Resource):
        isLeaf = True

        def render_GET(self, request):
            seen.append(request.getHeader(b"authorization"))
            request.setHeader(b"Content-Type", b"application/json")
            return json.dumps({"messages": ["x" * 100_000] * 10}).encode()

    port = reactor.listenTCP(0, web_server.Site(Big()), interface="127.0.0.1")
    upstream = real_upstream()
    url = f"http://127.0.0.1:{port.getHost().port}/channel/peek"
    try:
        doc = yield upstream.get_json(url, headers={b"Authorization": [b"Bearer s3cret"]})
        assert len(doc["messages"]) == 10
        with pytest.raises(UpstreamError, match="is over 100000"):
            yield upstream.get_json(url, max_bytes=100_000)
        assert seen == [b"Bearer s3cret", None]
    finally:
        yield upstream.close()
        yield port.stopListening()
