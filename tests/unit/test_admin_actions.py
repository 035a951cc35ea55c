"""mqadmin's actions (mqd.admin.actions): fan-out targets and order, per-target results, ACL,
/config's CIDR restriction, notifications, peek and snapshot proxies.

Requests go through real twisted.web (a Site over a StringTransport); the
lookupds and brokers are a fake upstream that records every URL and
answers from a table, or holds its answers until the test fires them, so
the order of the fan-out is observable. Time is a task.Clock.
"""

from __future__ import annotations

import base64
import json
from urllib.parse import urlsplit

import pytest
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress

from mqd.admin.actions import routes
from mqd.logs import set_log_level
from mqd.wire.go_json import decode_go_object
from tests.support.admin_fakes import L1, L2, N1, N2, Cluster, Down, peeked
from tests.support.http_client import Response, error

HOOK = "http://hooks.example:8080/nsqadmin"


@pytest.fixture
def cluster(clock):
    return Cluster(clock)


def ok_results(response: Response) -> list[tuple[str, str, str, bool]]:
    return [(r["target"], r["address"], r["path"], r["ok"]) for r in response.json()["results"]]


# -- create --------------------------------------------------------------------------------


def test_create_topic_declares_it_on_every_lookupd_only(cluster):
    r = cluster.request("POST", "/api/topics", {"topic": "t"})
    assert r.status == 200 and r.v1 and r.is_json
    assert cluster.posts() == [f"http://{L1}/topic/create?topic=t", f"http://{L2}/topic/create?topic=t"]
    assert r.json() == {"message": "", "results": [
        {"target": "lookupd", "address": L1, "path": "/topic/create", "ok": True, "error": None},
        {"target": "lookupd", "address": L2, "path": "/topic/create", "ok": True, "error": None}]}


def test_create_channel_declares_on_lookupds_then_creates_on_every_producer(cluster):
    r = cluster.request("POST", "/api/topics", {"topic": "t", "channel": "c"})
    assert r.status == 200
    q = "topic=t&channel=c"
    assert cluster.posts() == [
        f"http://{L1}/topic/create?topic=t", f"http://{L2}/topic/create?topic=t",
        f"http://{L1}/channel/create?{q}", f"http://{L2}/channel/create?{q}",
        f"http://{N1}/channel/create?{q}", f"http://{N2}/channel/create?{q}",
    ]
    assert [t for t, *_ in ok_results(r)] == ["lookupd"] * 4 + ["nsqd"] * 2
    assert all(ok for *_, ok in ok_results(r))


def test_create_without_lookupds_creates_on_every_configured_broker(clock):
    c = Cluster(clock, lookupds=(), **{"nsqd-http-address": [N1, N2]})
    r = c.request("POST", "/api/topics", {"topic": "t", "channel": "c"})
    assert r.status == 200
    assert c.posts() == [f"http://{N1}/topic/create?topic=t", f"http://{N2}/topic/create?topic=t",
                         f"http://{N1}/channel/create?topic=t&channel=c",
                         f"http://{N2}/channel/create?topic=t&channel=c"]


@pytest.mark.parametrize(("body", "message"), [
    (b"", "EOF"),
    (b"   ", "EOF"),
    (b"x", "invalid character 'x' looking for beginning of value"),
    (b'{"topic": "t"', "unexpected EOF"),
    (b'{topic: "t"}', "invalid character 't' looking for beginning of object key string"),
    (b'{"topic" "t"}', "invalid character '\"' after object key"),
    (b'{"topic": 5}', "json: cannot unmarshal number into Go struct field .topic of type string"),
    (b'[]', 'json: cannot unmarshal array into Go value of type struct { Topic string "json:\\"topic\\""; '
            'Channel string "json:\\"channel\\"" }'),
    (b'{"topic": "bad name"}', "INVALID_TOPIC"),
    (b'{"channel": "c"}', "INVALID_TOPIC"),
    (b"null", "INVALID_TOPIC"),
    (b'{"topic": "t", "channel": "c/d"}', "INVALID_CHANNEL"),
])
def test_create_refuses_what_nsqadmin_refuses_and_posts_nothing(cluster, body, message):
    assert error(cluster.request("POST", "/api/topics", body)) == (400, message)
    assert cluster.events == []
    assert cluster.notifications.events == []


def test_create_body_read_as_go_reads_it():
    # Keys fold case when no exact match; what follows the first value is not read.
    assert decode_go_object(b'{"TOPIC": "a", "Channel": "b"} trailing', ("topic", "channel")) == \
        {"topic": "a", "channel": "b"}
    assert decode_go_object(b'{"topic": null}', ("topic",)) == {"topic": ""}
    with pytest.raises(ValueError, match=r"^json: cannot unmarshal bool into Go struct field \.topic of type string$"):
        decode_go_object(b'{"Topic": true}', ("topic",))


# What nsqadmin 1.3.0 answered to each body (POST /api/topics), measured.
@pytest.mark.parametrize(("body", "message"), [
    (b"not json", "invalid character 'o' in literal null (expecting 'u')"),
    (b"nul", "unexpected EOF"),
    (b"tru", "unexpected EOF"),
    (b"-", "unexpected EOF"),
    (b"-x", "invalid character 'x' in numeric literal"),
    (b'{"a":nulx}', "invalid character 'x' in literal null (expecting 'l')"),
    (b"falsy", "invalid character 'y' in literal false (expecting 'e')"),
    (b'{"action":"\\x"}', "invalid character 'x' in string escape code"),
    (b'{"action":"\\u00zz"}', "invalid character 'z' in \\u hexadecimal character escape"),
    (b'{"action":"\\u0"}', "invalid character '\"' in \\u hexadecimal character escape"),
    (b"x", "invalid character 'x' looking for beginning of value"),
    (b'{"a" 1}', "invalid character '1' after object key"),
    # Numbers Go's scanner reads on into: a fraction or exponent without digits.
    (b"1.", "unexpected EOF"),
    (b"-1.", "unexpected EOF"),
    (b"1e+", "unexpected EOF"),
    (b"1.x", "invalid character 'x' after decimal point in numeric literal"),
    (b"1.e5", "invalid character 'e' after decimal point in numeric literal"),
    (b"1e+x", "invalid character 'x' in exponent of numeric literal"),
    (b'{"topic":1.}', "invalid character '}' after decimal point in numeric literal"),
    (b"[1e-]", "invalid character ']' in exponent of numeric literal"),
    (b'{"topic":1e5x}', "invalid character 'x' after object key:value pair"),
    # Inside an array the context is the array's, strings and nesting skipped.
    (b"[1 x]", "invalid character 'x' after array element"),
    (b'{"a":["x]" 1]}', "invalid character '1' after array element"),
    (b'{"a":{"b":1} x}', "invalid character 'x' after object key:value pair"),
    (b"[1,]", "invalid character ']' looking for beginning of value"),
    (b'{"a":1,}', "invalid character '}' looking for beginning of object key string"),
    # Go's scanner reads bytes: a character is named by its first byte, as a rune.
    ("é".encode(), "invalid character 'Ã' looking for beginning of value"),
    (b"\xff", "invalid character 'ÿ' looking for beginning of value"),
    (b'{"a":"\x01"}', "invalid character '\\x01' in string literal"),
    (b"-Infinity", "invalid character 'I' in numeric literal"),
    # Nesting: Go stops at 10,000 levels, Python's decoder long before.
    (b"[" * 100_000, "invalid character '[' exceeded max depth"),
    (b"[" * 5_000, "unexpected EOF"),
])
def test_malformed_bodies_get_gos_scanner_errors(body, message):
    with pytest.raises(ValueError) as caught:
        decode_go_object(body, ("topic", "channel"))
    assert str(caught.value) == message


def test_served_by_the_admin_site_under_its_base_path(clock):
    from mqd.admin.web import AdminSite

    c = Cluster(clock, **{"base-path": "/admin", "notification-http-endpoint": HOOK})
    c.site = AdminSite(c.admin, routes=routes(c.admin))
    r = c.request("POST", "/admin/api/topics/t/c", {"action": "pause"})
    assert r.status == 200 and len(r.json()["results"]) == 2
    assert c.sent()[0]["url"] == "http://admin.example:4171/admin/api/topics/t/c"
    assert c.request("PUT", "/admin/api/topics/t", {"action": "pause"}).status == 405


# -- pause / unpause / empty ---------------------------------------------------------------


@pytest.mark.parametrize("action", ["pause", "unpause", "empty"])
def test_topic_action_goes_to_every_producer_not_to_lookupds(cluster, action):
    r = cluster.request("POST", "/api/topics/t", {"action": action})
    assert r.status == 200
    assert cluster.posts() == [f"http://{N1}/topic/{action}?topic=t", f"http://{N2}/topic/{action}?topic=t"]
    assert r.json()["message"] == ""


def test_channel_action_goes_to_the_topics_producers(cluster):
    cluster.cluster.by_topic["t"] = [N2]
    r = cluster.request("POST", "/api/topics/t/c", {"action": "empty"})
    assert r.status == 200
    assert cluster.events[0] == ("topic_producers", "t", None)
    assert cluster.posts() == [f"http://{N2}/channel/empty?topic=t&channel=c"]


@pytest.mark.parametrize("body", [{"action": "delete"}, {}, {"action": "PAUSE"}])
def test_unknown_action_is_invalid_action(cluster, body):
    assert error(cluster.request("POST", "/api/topics/t/c", body)) == (400, "INVALID_ACTION")
    assert cluster.posts() == []


# -- delete --------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "kind", "query"), [
    ("/api/topics/t", "topic", "topic=t"),
    ("/api/topics/t/c", "channel", "topic=t&channel=c"),
])
def test_delete_goes_through_every_lookupd_before_any_broker(cluster, path, kind, query):
    cluster.upstream.hold = True
    transport = cluster.send("DELETE", path)
    # The producers are asked first: once lookupds forget the topic they cannot say who has it.
    assert cluster.events[0] == ("topic_producers", "t", None)
    assert cluster.upstream.release() == [f"http://{L1}/{kind}/delete?{query}", f"http://{L2}/{kind}/delete?{query}"]
    assert transport.value() == b""  # not answered while the brokers have not been asked
    assert cluster.upstream.release() == [f"http://{N1}/{kind}/delete?{query}", f"http://{N2}/{kind}/delete?{query}"]
    r = cluster.answer(transport)
    assert r.status == 200
    assert ok_results(r) == [("lookupd", L1, f"/{kind}/delete", True), ("lookupd", L2, f"/{kind}/delete", True),
                             ("nsqd", N1, f"/{kind}/delete", True), ("nsqd", N2, f"/{kind}/delete", True)]


def test_delete_with_one_broker_down_reports_it_and_the_others_success(cluster):
    cluster.upstream.answers[N2] = Down
    r = cluster.request("DELETE", "/api/topics/t")
    assert r.status == 200
    results = r.json()["results"]
    assert [(x["address"], x["ok"]) for x in results] == [(L1, True), (L2, True), (N1, True), (N2, False)]
    assert results[3]["error"] == "connection refused"
    # nsqadmin's wording: Go's error for the request.
    assert r.json()["message"] == (f'WARNING: Post "http://{N2}/topic/delete?topic=t": dial tcp {N2}: '
                                   "connect: connection refused")


def test_a_broker_error_is_reported_with_its_status_and_text(cluster):
    cluster.upstream.answers[N1] = (404, b'{"message":"TOPIC_NOT_FOUND"}')
    r = cluster.request("POST", "/api/topics/t", {"action": "pause"})
    assert r.status == 200
    assert r.json()["results"][0]["error"] == "404 TOPIC_NOT_FOUND"
    assert r.json()["results"][1]["ok"] is True


def test_every_target_failing_is_502_and_not_notified(clock):
    c = Cluster(clock, **{"notification-http-endpoint": HOOK})
    c.upstream.answers.update({N1: Down, N2: (500, b'{"message":"INTERNAL_ERROR"}')})
    status, message = error(c.request("POST", "/api/topics/t", {"action": "pause"}))
    assert status == 502
    assert message == (f'UPSTREAM_ERROR: Post "http://{N1}/topic/pause?topic=t": dial tcp {N1}: connect: '
                       'connection refused\ngot response 500 Internal Server Error "{\\"message\\":\\"INTERNAL_ERROR\\"}"')
    assert c.notifications.events == []


def test_lookupds_not_answering_with_no_producer_found_is_502(cluster):
    cluster.cluster.nodes = []
    cluster.cluster.errors = [f"{L1}: connection refused", f"{L2}: connection refused"]
    status, message = error(cluster.request("POST", "/api/topics/t", {"action": "empty"}))
    assert (status, message) == (502, f"UPSTREAM_ERROR: {L1}: connection refused\n{L2}: connection refused")


def test_a_lookupd_not_answering_is_a_warning_when_the_action_was_done(cluster):
    cluster.cluster.errors = [f"{L2}: connection refused"]
    r = cluster.request("POST", "/api/topics/t", {"action": "empty"})
    assert r.status == 200
    assert r.json()["message"] == f"WARNING: {L2}: connection refused"


def test_without_lookupds_a_broker_down_does_not_stop_the_others(clock):
    c = Cluster(clock, lookupds=(), **{"nsqd-http-address": [N1, N2]})
    c.upstream.answers[N1] = Down
    r = c.request("POST", "/api/topics", {"topic": "t"})
    assert r.status == 200
    assert [(x["address"], x["ok"], x["error"]) for x in r.json()["results"]] == \
        [(N1, False, "connection refused"), (N2, True, None)]


def test_nothing_to_do_is_no_error(cluster):
    cluster.cluster.nodes = []
    r = cluster.request("POST", "/api/topics/t", {"action": "pause"})
    assert r.status == 200 and r.json() == {"message": "", "results": []}


# -- tombstone -----------------------------------------------------------------------------


def test_tombstone_node_on_every_lookupd_then_delete_the_topic_on_it(cluster):
    cluster.upstream.hold = True
    transport = cluster.send("DELETE", f"/api/nodes/{N1}", json.dumps({"topic": "t"}).encode())
    node = N1.replace(":", "%3A")
    assert cluster.upstream.release() == [f"http://{L1}/topic/tombstone?topic=t&node={node}",
                                          f"http://{L2}/topic/tombstone?topic=t&node={node}"]
    assert cluster.upstream.release() == [f"http://{N1}/topic/delete?topic=t"]
    r = cluster.answer(transport)
    assert r.status == 200 and r.json()["message"] == ""
    assert [x["target"] for x in r.json()["results"]] == ["lookupd", "lookupd", "nsqd"]


@pytest.mark.parametrize(("body", "message"), [
    (b"", "INVALID_BODY"), (b"{", "INVALID_BODY"), (b'{"topic": 1}', "INVALID_BODY"),
    (b"{}", "INVALID_TOPIC"), (b'{"topic": "a b"}', "INVALID_TOPIC"),
])
def test_tombstone_refuses_a_bad_body(cluster, body, message):
    assert error(cluster.request("DELETE", f"/api/nodes/{N1}", body)) == (400, message)
    assert cluster.posts() == []


# -- ACL -----------------------------------------------------------------------------------


WRITES = [
    ("POST", "/api/topics", {"topic": "t"}),
    ("POST", "/api/topics/t", {"action": "pause"}),
    ("POST", "/api/topics/t/c", {"action": "unpause"}),
    ("DELETE", "/api/topics/t", None),
    ("DELETE", "/api/topics/t/c", None),
    ("DELETE", f"/api/nodes/{N1}", {"topic": "t"}),
    ("POST", f"/api/snapshot/{N1}", None),
]


@pytest.mark.parametrize(("method", "path", "body"), WRITES)
def test_without_admin_users_anyone_may_act(cluster, method, path, body):
    if "snapshot" in path:
        cluster.upstream.answers[N1] = (200, b'{"path": "/p", "manifest": {}}')
    assert cluster.request(method, path, body).status == 200


@pytest.mark.parametrize(("method", "path", "body"), WRITES)
@pytest.mark.parametrize("headers", [{}, {"X-Forwarded-User": "mallory"}, {"X-Forwarded-User": ""},
                                     {"X-Other-User": "alice"}])
def test_with_admin_users_anyone_else_is_forbidden(clock, method, path, body, headers):
    c = Cluster(clock, **{"admin-user": ["alice", "bob"]})
    assert error(c.request(method, path, body, headers=headers)) == (403, "FORBIDDEN")
    assert c.events == []


def test_an_admin_user_named_in_the_acl_header_may_act(clock):
    c = Cluster(clock, **{"admin-user": ["alice", "bob"], "acl-http-header": "X-Auth-User"})
    assert c.request("DELETE", "/api/topics/t", headers={"X-Auth-User": "bob"}).status == 200
    assert error(c.request("DELETE", "/api/topics/t", headers={"X-Forwarded-User": "bob"})) == (403, "FORBIDDEN")


def test_reads_need_no_admin_user(clock):
    c = Cluster(clock, **{"admin-user": ["alice"]})
    c.upstream.answers.update({N1: peeked(0, 0), N2: peeked(0, 0)})
    assert c.request("GET", "/api/peek/t/c").status == 200
    assert c.request("GET", "/config/log_level").status == 200


# -- /config/:opt --------------------------------------------------------------------------


def test_config_answers_nsqadmins_option_names_and_values(clock):
    c = Cluster(clock, **{"nsqd-http-address": [N1], "admin-user": ["alice"]})
    assert c.request("GET", "/config/nsqlookupd_http_addresses").json() == [L1, L2]
    assert c.request("GET", "/config/nsqd_http_addresses").json() == [N1]
    assert c.request("GET", "/config/admin_users").json() == ["alice"]
    assert c.request("GET", "/config/http_client_connect_timeout").json() == 2_000_000_000
    assert c.request("GET", "/config/log_level").json() == 2
    assert c.request("GET", "/config/acl_http_header").body == b"X-Forwarded-User"
    assert error(c.request("GET", "/config/nope")) == (400, "INVALID_OPTION")


@pytest.mark.parametrize(("peer", "cidr", "allowed"), [
    (IPv4Address("TCP", "127.0.0.1", 1), "127.0.0.1/8", True),
    (IPv4Address("TCP", "127.3.4.5", 1), "127.0.0.1/8", True),
    (IPv4Address("TCP", "10.1.2.3", 1), "127.0.0.1/8", False),
    (IPv6Address("TCP", "::1", 1), "127.0.0.1/8", False),
    (IPv6Address("TCP", "::ffff:127.0.0.1", 1), "127.0.0.1/8", True),
    (IPv4Address("TCP", "10.1.2.3", 1), "10.0.0.0/8", True),
    (IPv4Address("TCP", "192.168.1.1", 1), "", True),
])
def test_config_only_from_the_allowed_cidr(clock, peer, cidr, allowed):
    c = Cluster(clock, **{"allow-config-from-cidr": cidr})
    for method, body in (("GET", None), ("PUT", b"warn")):
        r = c.request(method, "/config/log_level", body, peer=peer)
        if allowed:
            assert r.status == 200
        else:
            assert error(r) == (403, "FORBIDDEN")
    set_log_level("info")


def test_config_from_a_unix_socket_has_no_remote_ip(cluster):
    assert error(cluster.request("GET", "/config/log_level", peer=UNIXAddress("/tmp/admin.sock"))) == \
        (400, "INVALID_REMOTE_ADDR")


def test_put_of_more_than_a_mebibyte_is_too_big(cluster):
    body = b'["a:1"' + b" " * (1 << 20) + b"]"
    assert error(cluster.request("PUT", "/config/nsqlookupd_http_addresses", body)) == (413, "INVALID_VALUE")


def test_put_lookupd_addresses_changes_where_actions_go(cluster):
    r = cluster.request("PUT", "/config/nsqlookupd_http_addresses", b'["lookupd3:4161"]')
    assert r.status == 200 and r.json() == ["lookupd3:4161"]
    assert cluster.request("GET", "/config/nsqlookupd_http_addresses").json() == ["lookupd3:4161"]
    cluster.request("DELETE", "/api/topics/t")
    assert [u for u in cluster.posts() if "lookupd" in u] == ["http://lookupd3:4161/topic/delete?topic=t"]


def test_put_log_level(cluster):
    try:
        r = cluster.request("PUT", "/config/log_level", b"DEBUG")
        assert r.status == 200 and r.json() == 1
        assert cluster.admin.settings.log_level == "debug"
    finally:
        set_log_level("info")


@pytest.mark.parametrize(("opt", "body", "expected"), [
    ("nsqlookupd_http_addresses", b"", (413, "INVALID_VALUE")),
    ("nsqlookupd_http_addresses", b"[1]", (400, "INVALID_VALUE")),
    ("nsqlookupd_http_addresses", b'"a:1"', (400, "INVALID_VALUE")),
    ("nsqlookupd_http_addresses", b'["no-port"]', (400, "INVALID_VALUE")),
    ("nsqlookupd_http_addresses", b'["a:1"] x', (400, "INVALID_VALUE")),
    ("log_level", b"loud", (400, "INVALID_VALUE")),
    ("log_level", b"", (413, "INVALID_VALUE")),
    ("http_address", b"0.0.0.0:1", (400, "INVALID_OPTION")),
    ("nope", b"x", (400, "INVALID_OPTION")),
])
def test_put_refusals(cluster, opt, body, expected):
    assert error(cluster.request("PUT", f"/config/{opt}", body)) == expected
    assert cluster.request("GET", "/config/nsqlookupd_http_addresses").json() == [L1, L2]


# -- notifications -------------------------------------------------------------------------


def test_each_action_posts_nsqadmins_event(clock):
    c = Cluster(clock, **{"notification-http-endpoint": HOOK})
    auth = base64.b64encode(b"carol:secret").decode()
    c.request("POST", "/api/topics?x=1", {"topic": "t", "channel": "c"},
              headers={"Authorization": f"Basic {auth}", "User-Agent": "curl/8"})
    assert [(kind, url) for kind, url, _ in c.notifications.events] == [("POST", HOOK), ("POST", HOOK)]
    first, second = c.sent()
    assert first == {"action": "create_topic", "topic": "t", "timestamp": int(clock.seconds()), "user": "carol",
                     "remote_ip": f"127.0.0.1:{c.port}", "user_agent": "curl/8",
                     "url": "http://admin.example:4171/api/topics?x=1", "via": "admin-host"}
    assert list(first)[:4] == ["action", "topic", "timestamp", "user"]
    assert second["action"] == "create_channel" and second["channel"] == "c"


@pytest.mark.parametrize(("method", "path", "body", "event"), [
    ("POST", "/api/topics/t", {"action": "pause"}, {"action": "pause_topic", "topic": "t"}),
    ("POST", "/api/topics/t", {"action": "unpause"}, {"action": "unpause_topic", "topic": "t"}),
    ("POST", "/api/topics/t", {"action": "empty"}, {"action": "empty_topic", "topic": "t"}),
    ("POST", "/api/topics/t/c", {"action": "pause"}, {"action": "pause_channel", "topic": "t", "channel": "c"}),
    ("POST", "/api/topics/t/c", {"action": "unpause"}, {"action": "unpause_channel", "topic": "t", "channel": "c"}),
    ("POST", "/api/topics/t/c", {"action": "empty"}, {"action": "empty_channel", "topic": "t", "channel": "c"}),
    ("DELETE", "/api/topics/t", None, {"action": "delete_topic", "topic": "t"}),
    ("DELETE", "/api/topics/t/c", None, {"action": "delete_channel", "topic": "t", "channel": "c"}),
    ("DELETE", f"/api/nodes/{N1}", {"topic": "t"}, {"action": "tombstone_topic_producer", "topic": "t", "node": N1}),
])
def test_action_names_and_fields(clock, method, path, body, event):
    c = Cluster(clock, **{"notification-http-endpoint": HOOK, "admin-user": ["dave"]})
    r = c.request(method, path, body, headers={"X-Forwarded-User": "dave", "X-Scheme": "https"})
    assert r.status == 200
    [sent] = c.sent()
    assert {k: sent[k] for k in event} == event
    assert not {"channel", "node"} - set(event) & set(sent)  # left out when empty, as nsqadmin's omitempty
    assert sent["user"] == "dave"  # no basic auth: the proxy's user
    assert sent["url"] == f"https://admin.example:4171{path}"


def test_no_endpoint_no_notification(cluster):
    cluster.request("POST", "/api/topics/t", {"action": "pause"})
    assert cluster.notifications.events == []


def test_notifications_go_in_order_one_at_a_time_and_never_hold_the_action(clock):
    c = Cluster(clock, **{"notification-http-endpoint": HOOK})
    c.notifications.hold = True
    assert c.request("POST", "/api/topics/t", {"action": "pause"}).status == 200
    assert c.request("POST", "/api/topics/t", {"action": "unpause"}).status == 200
    assert len(c.notifications.waiting) == 1  # the second waits for the first
    c.notifications.release()
    c.notifications.release()
    assert [e["action"] for e in c.sent()] == ["pause_topic", "unpause_topic"]
    assert c.admin.notifier.pending == 0


def test_a_failing_endpoint_fails_no_action_and_is_logged_once(clock):
    from twisted.logger import globalLogPublisher

    c = Cluster(clock, **{"notification-http-endpoint": HOOK})
    c.notifications.answers[urlsplit(HOOK).netloc] = Down
    logged: list[dict] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        for _ in range(3):
            assert c.request("POST", "/api/topics/t", {"action": "pause"}).status == 200
        c.notifications.answers[urlsplit(HOOK).netloc] = (200, b"")
        c.request("POST", "/api/topics/t", {"action": "pause"})
    finally:
        globalLogPublisher.removeObserver(logged.append)
    texts = [e["log_format"] for e in logged if e.get("log_namespace") == "mqd.admin.notify"]
    assert sum("failed to POST notification" in t for t in texts) == 1
    assert sum("get through again" in t for t in texts) == 1
    assert c.admin.notifier.failed == 0


# -- peek ----------------------------------------------------------------------------------


def test_peek_asks_every_producer_and_answers_per_node(cluster):
    cluster.upstream.answers.update({N1: peeked(2, 5), N2: peeked(1, 1)})
    r = cluster.request("GET", "/api/peek/t/c?state=queued&n=2")
    assert r.status == 200
    gets = [url for kind, url, _ in cluster.events if kind == "GET"]
    assert gets == [f"http://{N1}/channel/peek?topic=t&channel=c&state=queued&n=2",
                    f"http://{N2}/channel/peek?topic=t&channel=c&state=queued&n=2"]
    body = r.json()
    assert (body["topic"], body["channel"], body["state"], body["message"]) == ("t", "c", "queued", "")
    assert [(n["node"], n["total"], len(n["messages"]), n["error"]) for n in body["nodes"]] == \
        [(N1, 5, 2, None), (N2, 1, 1, None)]
    assert cluster.posts() == []


def test_peek_defaults_and_a_node_down(cluster):
    cluster.upstream.answers.update({N1: peeked(1, 1), N2: Down})
    r = cluster.request("GET", "/api/peek/t/c")
    assert [url for kind, url, _ in cluster.events if kind == "GET"][0].endswith("state=queued&n=20")
    nodes = r.json()["nodes"]
    assert nodes[1] == {"node": N2, "total": None, "messages": [], "more": None, "error": "connection refused"}
    assert r.json()["message"] == f"WARNING: nsqd {N2}: connection refused"


@pytest.mark.parametrize(("query", "message"), [("state=gone", "INVALID_STATE"), ("n=0", "INVALID_N"),
                                                 ("n=x", "INVALID_N")])
def test_peek_checks_its_arguments_as_the_brokers_do(cluster, query, message):
    assert error(cluster.request("GET", f"/api/peek/t/c?{query}")) == (400, message)
    assert cluster.events == []


def test_peek_with_every_node_down_is_502(cluster):
    cluster.upstream.answers.update({N1: Down, N2: Down})
    status, message = error(cluster.request("GET", "/api/peek/t/c?state=deferred"))
    assert status == 502 and message.startswith("UPSTREAM_ERROR: ")


# -- snapshot ------------------------------------------------------------------------------


def test_snapshot_proxies_to_the_broker(clock):
    c = Cluster(clock, **{"notification-http-endpoint": HOOK})
    manifest = {"total": 3, "queues": []}
    c.upstream.answers[N2] = (200, json.dumps({"path": "/data/snapshots/x", "manifest": manifest}).encode())
    r = c.request("POST", f"/api/snapshot/{N2}")
    assert r.status == 200
    assert r.json() == {"node": N2, "path": "/data/snapshots/x", "manifest": manifest}
    assert c.posts() == [f"http://{N2}/snapshot"]
    # A store's copy takes long: not the 5 s of an admin action.
    assert c.upstream.timeouts == [600.0]
    assert c.sent()[0]["action"] == "create_snapshot" and c.sent()[0]["node"] == N2


@pytest.mark.parametrize(("status", "text"), [(507, "SNAPSHOT_LIMIT"), (503, "STORE_FAILED"), (404, "NOT_FOUND")])
def test_snapshot_passes_the_brokers_error_on(cluster, status, text):
    cluster.upstream.answers[N1] = (status, json.dumps({"message": text}).encode())
    assert error(cluster.request("POST", f"/api/snapshot/{N1}")) == (status, text)


def test_snapshot_of_a_broker_down_is_502(cluster):
    cluster.upstream.answers[N1] = Down
    assert error(cluster.request("POST", f"/api/snapshot/{N1}")) == (502, "UPSTREAM_ERROR: connection refused")


def test_snapshot_only_of_a_node_of_the_cluster(cluster):
    assert error(cluster.request("POST", "/api/snapshot/evil.example:80")) == (404, "NODE_NOT_FOUND")
    assert cluster.posts() == []
