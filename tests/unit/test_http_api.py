"""The nsqd HTTP API's conventions and routing: headers, error bodies, 404/405, redirects."""

from __future__ import annotations

import pytest

from mqd.http.args import Query, go_parse_bool, parse_query
from mqd.http.response import ApiError
from mqd.http.router import origin_path
from mqd.nsqd.http import status as status_module
from tests.support.http_client import HTTPClient, error

# -- /ping and /info -----------------------------------------------------------------


def test_ping_is_plain_text(http):
    r = http.get("/ping")
    assert (r.status, r.body) == (200, b"OK")
    assert r.header("Content-Type") == "text/plain; charset=utf-8"
    assert not r.v1


def test_ping_reports_storage_failure(http, inproc_broker):
    inproc_broker.set_health("LMDB write failed: No space left on device")
    r = http.get("/ping")
    assert (r.status, r.body) == (500, b"NOK - LMDB write failed: No space left on device")
    assert not r.v1
    inproc_broker.set_health(None)
    assert http.get("/ping").body == b"OK"


def test_info_has_every_nsqd_key(http, inproc_broker):
    r = http.get("/info")
    assert r.status == 200 and r.v1 and r.is_json
    info = r.json()
    assert info == {
        "version": "1.3.0",
        "broadcast_address": "test-host",
        "hostname": info["hostname"],
        "http_port": 4151,
        "tcp_port": 4150,
        "start_time": inproc_broker.start_time,
        "max_heartbeat_interval": 60_000_000_000,
        "max_output_buffer_size": 65536,
        "max_output_buffer_timeout": 30_000_000_000,
        "max_deflate_level": 6,
        "topology_zone": "",
        "topology_region": "",
    }
    # Compact JSON, as Go writes it.
    assert b": " not in r.body and b", " not in r.body


def test_info_port_of_a_unix_socket_is_minus_one(inproc_broker):
    info = HTTPClient(inproc_broker, ports={"HTTP": 4151}).get("/info").json()
    assert (info["http_port"], info["tcp_port"]) == (4151, -1)


# -- routing ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/nope", "/ping/x", "/topic", "/topic/frobnicate",
                                  "/config", "/config/", "/config/a/b", "/pub/x"])
def test_unknown_path_is_404(http, path):
    assert error(http.get(path)) == (404, "NOT_FOUND")


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("POST", "/ping", "GET, OPTIONS"),
    ("HEAD", "/ping", "GET, OPTIONS"),
    ("GET", "/pub?topic=t", "OPTIONS, POST"),
    ("PUT", "/mpub", "OPTIONS, POST"),
    ("GET", "/topic/create?topic=t", "OPTIONS, POST"),
    ("DELETE", "/channel/delete", "OPTIONS, POST"),
    ("POST", "/stats", "GET, OPTIONS"),
    ("POST", "/config/log_level", "GET, OPTIONS, PUT"),
])
def test_wrong_method_is_405(http, method, path, allow):
    r = http.request(method, path)
    if method == "HEAD":
        # No body comes back for HEAD; the status and headers still say 405.
        assert r.status == 405 and r.v1
    else:
        assert error(r) == (405, "METHOD_NOT_ALLOWED")
    assert r.header("Allow") == allow


def test_options_lists_the_methods(http):
    r = http.request("OPTIONS", "/pub")
    assert (r.status, r.body, r.header("Allow")) == (200, b"", "OPTIONS, POST")


@pytest.mark.parametrize(("method", "path", "code", "location"), [
    ("GET", "/ping/", 301, "/ping"),
    ("GET", "/PING", 301, "/ping"),
    ("GET", "//stats/?format=json", 301, "/stats?format=json"),
    ("GET", "/topic/../info", 301, "/info"),
    ("POST", "/pub/?topic=t", 307, "/pub?topic=t"),
    ("GET", "/Config/log_level/", 301, "/config/log_level"),
])
def test_near_miss_paths_redirect_as_httprouter(http, method, path, code, location):
    r = http.request(method, path, b"x" if method == "POST" else None)
    assert (r.status, r.header("Location")) == (code, location)


def test_absolute_form_target_is_routed_by_its_path(http, inproc_broker):
    """HTTP/1.1's absolute form (a proxy's request line) reaches the same route as Go's server sends it."""
    assert http.get("http://127.0.0.1:4151/ping").body == b"OK"
    assert (http.post("HTTP://anything/pub?topic=abs", b"m").status, inproc_broker.topics["abs"].message_count) == (200, 1)
    assert http.get("http://127.0.0.1:4151/PING").header("Location") == "/ping"
    assert error(http.get("http://127.0.0.1:4151")) == (404, "NOT_FOUND")


@pytest.mark.parametrize(("target", "path"), [
    (b"/stats", b"/stats"),
    (b"http://h:4151/stats", b"/stats"),
    (b"https://h/a/b", b"/a/b"),
    (b"http://h", b"/"),
    (b"/http://h/x", b"/http://h/x"),
])
def test_origin_path_of_every_target_form(target, path):
    assert origin_path(target) == path


def test_no_redirect_to_a_route_without_the_method(http):
    # /pub/ is off by a slash, but /pub takes no GET: 404 as httprouter.
    assert error(http.get("/pub/")) == (404, "NOT_FOUND")


def test_bad_escape_in_path_is_400(http):
    assert http.get("/pi%zzng").status == 400


def test_accept_header_changes_nothing(http):
    """nsq 1.x ignores Accept; the old envelope is never sent."""
    plain = http.get("/info")
    legacy = http.get("/info", headers={"Accept": "application/vnd.nsq; version=1.0"})
    other = http.get("/info", headers={"Accept": "text/html"})
    assert plain.json().keys() == legacy.json().keys() == other.json().keys()
    assert "status_code" not in plain.json()
    for r in (plain, legacy, other):
        assert r.v1 and r.is_json
    r = http.post("/pub?topic=t", b"x", headers={"Accept": "application/vnd.nsq; version=1.0"})
    assert (r.status, r.body) == (200, b"OK")


def test_string_success_is_raw_text_and_empty_success_has_no_type(http):
    r = http.post("/pub?topic=t", b"x")
    assert (r.status, r.body, r.header("Content-Type")) == (200, b"OK", "text/plain; charset=utf-8")
    assert r.v1
    r = http.post("/topic/create?topic=t2")
    assert (r.status, r.body, r.header("Content-Type")) == (200, b"", None)
    assert r.v1


def test_unexpected_exception_is_500_internal_error(http, inproc_broker, monkeypatch):
    def boom(name):
        raise RuntimeError("boom")

    monkeypatch.setattr(inproc_broker, "topic", boom)
    assert error(http.post("/topic/create?topic=t")) == (500, "INTERNAL_ERROR")


# -- /stats routing -----------------------------------------------------------------------


def test_stats_json_and_text(http, inproc_broker):
    http.post("/pub?topic=t", b"x")
    r = http.get("/stats?format=json")
    assert r.status == 200 and r.v1 and r.is_json
    assert [t["topic_name"] for t in r.json()["topics"]] == ["t"]
    r = http.get("/stats")
    assert r.status == 200 and r.v1
    assert r.header("Content-Type") == "text/plain; charset=utf-8"
    assert r.body.startswith(b"nsqd v1.3.0")
    assert http.get("/stats?format=JSON").body.startswith(b"nsqd v")


@pytest.mark.parametrize(("query", "args"), [
    ("", (None, None, True, True)),
    ("topic=t&channel=c", ("t", "c", True, True)),
    ("topic=&channel=", (None, None, True, True)),
    ("include_clients=false&include_mem=0", (None, None, False, False)),
    ("include_clients=1&include_mem=true", (None, None, True, True)),
    ("include_clients=no&include_mem=False", (None, None, True, True)),
])
def test_stats_parameters(http, monkeypatch, query, args):
    seen = []
    monkeypatch.setattr(status_module, "stats_json", lambda broker, *a: seen.append(a) or {})
    monkeypatch.setattr(status_module, "stats_text", lambda broker, *a: seen.append(a) or "")
    http.get(f"/stats?format=json&{query}")
    http.get(f"/stats?{query}")
    assert seen == [args, args]


def test_stats_bad_query_is_400(http):
    assert error(http.get("/stats?format=json;x")) == (400, "INVALID_REQUEST")


# -- query parsing as Go's url.ParseQuery ------------------------------------------------


def test_parse_query_as_go():
    assert parse_query(b"") == {}
    assert parse_query(b"topic=a&topic=b&x&y=&&z=1%2B2+3") == {
        "topic": ["a", "b"], "x": [""], "y": [""], "z": ["1+2 3"]}
    assert Query(parse_query(b"topic=a&topic=b")).first("topic") == "a"
    assert parse_query(b"a=%41%42").first("a") == "AB"
    for bad in (b"a=1;b=2", b"a=%zz", b"a=%4", b"%=1", b"ok=1&a=%"):
        with pytest.raises(ValueError):
            parse_query(bad)


def test_go_parse_bool():
    for v in ("1", "t", "T", "TRUE", "true", "True"):
        assert go_parse_bool(v) is True
    for v in ("0", "f", "F", "FALSE", "false", "False"):
        assert go_parse_bool(v) is False
    for v in ("", "yes", "tRue", "2"):
        assert go_parse_bool(v) is None


def test_api_error_carries_code_and_text():
    e = ApiError(413, "MSG_TOO_BIG")
    assert (e.code, e.message, str(e)) == (413, "MSG_TOO_BIG", "413 MSG_TOO_BIG")


def test_redirect_page_escapes_the_query(http):
    r = http.get('/ping/?"><b>x')
    assert r.status == 301
    assert b"<b>" not in r.body and b"&quot;&gt;&lt;b&gt;" in r.body
