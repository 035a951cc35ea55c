"""Bearer secrets on the HTTP endpoints that show bodies: the decisions, the cache, the answers.

The broker runs on a task.Clock; its auth server is AuthClient's own test
seam (a fetch function answering per secret), so the TTL, the sharing of
one query between waiting requests and the bound of the cache are
driven step by step. The endpoints are reached through real twisted.web
(tests/support/http_client.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.python.failure import Failure

from mqd.http.auth import AuthClient, AuthError, parse_auth_response
from mqd.http.authorization import CACHE_SIZE, AuthCache
from mqd.lookup.registry import RegistrationDB
from tests.support.auth_fakes import answer
from tests.support.auth_fuzz import FULL_SECRET, guarded_lookupd, sending_secret
from tests.support.http_client import HTTPClient, error, parse_response
from tests.support.inprocess_broker import START_TIME, settings

SUB_ALL = {"topic": ".*", "channels": [".*"], "permissions": ["subscribe"]}


def grant(topic=".*", channels=(".*",), permissions=("subscribe",)) -> dict:
    return {"topic": topic, "channels": list(channels), "permissions": list(permissions)}


class AuthServer:
    """AuthClient's fetch: answers by secret (`answers`), records every query, or holds them (`hold`)."""

    def __init__(self) -> None:
        self.answers: dict[str, bytes] = {}
        self.queries: list[dict[str, str]] = []
        self.hold = False
        self.held: list[tuple[str, Deferred]] = []

    def __call__(self, url: str, method: str, params: dict[str, str]) -> Deferred:
        self.queries.append(dict(params))
        if self.hold:
            d: Deferred = Deferred()
            self.held.append((params["secret"], d))
            return d
        return self._answer(params["secret"])

    def _answer(self, secret: str) -> Deferred:
        body = self.answers.get(secret)
        if body is None:
            return fail(AuthError(f"got response 403 b'secret {secret} is not known here'"))
        return succeed(body)

    def release(self) -> None:
        held, self.held = self.held, []
        for secret, d in held:
            self._answer(secret).chainDeferred(d)


@pytest.fixture
def authd() -> AuthServer:
    return AuthServer()


@pytest.fixture
def secured(make_broker, tmp_path, authd, sync_threads):
    """A broker with auth configured (topic t, channels c and other, a message in each) and its HTTP client."""
    path = tmp_path / "secured"
    path.mkdir()
    broker = make_broker(path=str(path), auth_http_address=["127.0.0.1:4181"])
    broker.auth.fetch_function = authd
    http = HTTPClient(broker)
    assert http.post("/topic/create?topic=t").status == 200
    for channel in ("c", "other"):
        assert http.post(f"/channel/create?topic=t&channel={channel}").status == 200
    broker.topics["t"].publish([b"secret body"])
    return broker, http


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


# -- the Authorization header -------------------------------------------------------------


@pytest.mark.parametrize("header", [
    None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Token s1", "Bearer two words", "Bearers s1",
    "Bearer \x01x", "bearer\ts1",
])
def test_no_or_a_malformed_header_is_auth_required(secured, authd, header):
    broker, http = secured
    headers = {} if header is None else {"Authorization": header}
    r = http.turned("GET", "/channel/peek?topic=t&channel=c", headers=headers)
    assert error(r) == (401, "AUTH_REQUIRED")
    assert r.header("WWW-Authenticate") == "Bearer"
    assert authd.queries == []


def test_two_authorization_headers_are_malformed(secured, authd):
    broker, http = secured
    transport = http.send("GET", "/channel/peek?topic=t&channel=c",
                          headers={"Authorization": "Bearer s1", "authorization": "Bearer s1"})
    assert b"401" in transport.value().split(b"\r\n")[0] and authd.queries == []


@pytest.mark.parametrize("header", ["Bearer s1", "bearer s1", "BEARER   s1", "Bearer s1 "])
def test_the_scheme_is_case_insensitive_and_spaces_around_the_secret_do_not_count(secured, authd, header):
    broker, http = secured
    authd.answers["s1"] = answer(authorizations=[SUB_ALL])
    assert http.turned("GET", "/channel/peek?topic=t&channel=c", headers={"Authorization": header}).status == 200
    assert [q["secret"] for q in authd.queries] == ["s1"]


# -- the auth server's answers -------------------------------------------------------------


def test_the_auth_server_is_asked_as_auth_asks_it(secured, authd):
    broker, http = secured
    authd.answers["s1"] = answer(authorizations=[SUB_ALL])
    r = http.turned("GET", "/channel/peek?topic=t&channel=c", headers=bearer("s1"))
    assert r.status == 200
    assert [m["body_text"] for m in r.json()["messages"]] == ["secret body"]
    assert authd.queries == [{"remote_ip": "127.0.0.1", "tls": "false", "secret": "s1", "common_name": ""}]


def test_a_refused_secret_is_auth_failed_and_the_reason_stays_in_the_log(secured, authd):
    broker, http = secured
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        r = http.turned("GET", "/channel/peek?topic=t&channel=c", headers=bearer("nobody"))
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert error(r) == (401, "AUTH_FAILED")
    assert r.header("WWW-Authenticate") == 'Bearer error="invalid_token"'
    assert b"not known here" not in r.body
    warnings = [e for e in events if e.get("log_level") == LogLevel.warn and "AUTH failed" in e["log_format"]]
    assert len(warnings) == 1 and "not known here" in warnings[0]["error"]
    assert not any("log_failure" in e for e in events)


@pytest.mark.parametrize("body", [b"not json", b'{"ttl": 0, "authorizations": []}',
                                  answer(authorizations=[{"topic": "(?=x)", "channels": [".*"],
                                                          "permissions": ["subscribe"]}])])
def test_an_answer_nsqd_refuses_is_auth_failed(secured, authd, body):
    broker, http = secured
    authd.answers["s1"] = body
    assert error(http.turned("GET", "/channel/peek?topic=t&channel=c", headers=bearer("s1"))) == \
        (401, "AUTH_FAILED")


@pytest.mark.parametrize(("grants", "path", "status"), [
    ([SUB_ALL], "/channel/peek?topic=t&channel=c", 200),
    ([grant(channels=["^c$"])], "/channel/peek?topic=t&channel=c", 200),
    ([grant(channels=["^c$"])], "/channel/peek?topic=t&channel=other", 403),
    ([grant(topic="^u$")], "/channel/peek?topic=t&channel=c", 403),
    ([grant(permissions=["publish"])], "/channel/peek?topic=t&channel=c", 403),
    ([], "/channel/peek?topic=t&channel=c", 403),
    # A topic peek: any channel of the topic will do.
    ([grant(channels=["^c$"])], "/topic/peek?topic=t", 200),
    ([grant(topic="^u$")], "/topic/peek?topic=t", 403),
    ([grant(permissions=["publish"])], "/topic/peek?topic=t", 403),
    ([grant(channels=[])], "/topic/peek?topic=t", 403),
    ([grant(topic="^u$"), grant(permissions=["subscribe", "publish"])], "/topic/peek?topic=t", 200),
])
def test_the_grant_each_peek_needs(secured, authd, grants, path, status):
    broker, http = secured
    authd.answers["s1"] = answer(authorizations=grants)
    r = http.turned("GET", path, headers=bearer("s1"))
    if status == 200:
        assert r.status == 200, r.body
    else:
        assert error(r) == (403, "UNAUTHORIZED")


def test_names_come_before_the_grant_and_the_grant_before_existence(secured, authd):
    broker, http = secured
    authd.answers["s1"] = answer(authorizations=[grant(channels=["^c$", "^nope$"])])
    headers = bearer("s1")
    assert error(http.turned("GET", "/channel/peek?topic=t&channel=b@d", headers=headers)) == \
        (400, "INVALID_ARG_CHANNEL")
    # Not granted: a 403, whether the channel exists or not.
    assert error(http.turned("GET", "/channel/peek?topic=t&channel=zzz", headers=headers)) == \
        (403, "UNAUTHORIZED")
    assert error(http.turned("GET", "/channel/peek?topic=t&channel=nope", headers=headers)) == \
        (404, "CHANNEL_NOT_FOUND")


@pytest.mark.parametrize(("grants", "status"), [
    ([SUB_ALL], 200),
    ([grant(channels=["^c$"])], 403),                      # not the channel "other"
    ([grant(channels=["^c$", "^other$"])], 200),
    ([grant(channels=["^c$", "^other$"]), grant(topic="^lonely$", channels=["^x$"])], 200),
    ([grant(topic="^t$", channels=[".*"])], 403),         # not the topic without channels
    ([grant(permissions=["publish"])], 403),
])
def test_a_snapshot_needs_every_topic_and_channel(secured, authd, grants, status):
    broker, http = secured
    assert http.post("/topic/create?topic=lonely").status == 200
    authd.answers["s1"] = answer(authorizations=grants)
    r = http.turned("POST", "/snapshot?out=s", body=b"", headers=bearer("s1"))
    if status == 200:
        assert r.status == 200, r.body
        assert sum(q["count"] for q in r.json()["manifest"]["queues"]) == 2
    else:
        assert error(r) == (403, "UNAUTHORIZED")
        assert not (Path(broker.data_path) / "snapshots" / "s").exists()


def test_a_snapshot_without_a_secret_writes_nothing(secured, authd):
    broker, http = secured
    r = http.turned("POST", "/snapshot?out=s", body=b"")
    assert error(r) == (401, "AUTH_REQUIRED") and r.header("WWW-Authenticate") == "Bearer"
    r = http.turned("POST", "/snapshot?out=s", body=b"", headers=bearer("nobody"))
    assert error(r) == (401, "AUTH_FAILED")
    assert not (Path(broker.data_path) / "snapshots" / "s").exists()


def test_other_endpoints_need_no_secret(secured, authd):
    """As nsqd: AUTH covers the TCP port and the bodies, not nsqd's own HTTP API."""
    broker, http = secured
    assert http.get("/stats?format=json").status == 200
    assert http.post("/pub?topic=t", b"x").status == 200
    assert authd.queries == []


# -- without auth configured ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/channel/peek?topic=t&channel=c", "/topic/peek?topic=t", "/topic/peek?topic=nope",
                                  "/channel/peek?topic=t&channel=c&n=0"])
def test_without_auth_the_header_changes_nothing(make_broker, path):
    broker = make_broker()
    broker.topic("t").channel("c")
    broker.topics["t"].publish([b"a", b"b"])
    http = HTTPClient(broker)
    plain = http.turned("GET", path)
    for header in ("Bearer s1", "garbage", "Basic x"):
        again = http.turned("GET", path, headers={"Authorization": header})
        assert (again.status, again.body) == (plain.status, plain.body)
        assert again.header("WWW-Authenticate") is None


# -- the cache --------------------------------------------------------------------------------


class Options:
    auth_http_address = ["127.0.0.1:4181"]
    auth_http_request_method = "get"
    http_client_connect_timeout = 1.0
    http_client_request_timeout = 1.0


def cache_on(clock: Clock, server: AuthServer, size: int = CACHE_SIZE) -> AuthCache:
    return AuthCache(AuthClient(Options(), clock, fetch=server), clock, size=size)


def key(secret: str, ip: str = "10.0.0.1", tls: bool = False, cn: str = "") -> tuple:
    return (secret, ip, tls, cn)


def fired(d: Deferred):
    out: list = []
    d.addBoth(out.append)
    assert out, "not fired"
    return out[0]


def test_an_answer_is_kept_until_its_ttl_runs_out(clock, authd):
    cache = cache_on(clock, authd)
    authd.answers["s1"] = answer(ttl=10, authorizations=[SUB_ALL])
    first = fired(cache.state(key("s1")))
    clock.advance(9.9)
    assert fired(cache.state(key("s1"))) is first
    assert len(authd.queries) == 1
    clock.advance(0.1)
    assert fired(cache.state(key("s1"))) is not first
    assert len(authd.queries) == 2


def test_each_part_of_the_key_counts(clock, authd):
    cache = cache_on(clock, authd)
    authd.answers["s1"] = authd.answers["s2"] = answer(authorizations=[SUB_ALL])
    for k in (key("s1"), key("s2"), key("s1", ip="10.0.0.2"), key("s1", tls=True), key("s1", cn="alice"),
              key("s1")):
        fired(cache.state(k))
    assert [(q["secret"], q["remote_ip"], q["tls"], q["common_name"]) for q in authd.queries] == [
        ("s1", "10.0.0.1", "false", ""), ("s2", "10.0.0.1", "false", ""), ("s1", "10.0.0.2", "false", ""),
        ("s1", "10.0.0.1", "true", ""), ("s1", "10.0.0.1", "false", "alice")]


def test_waiting_requests_share_one_query(clock, authd):
    cache = cache_on(clock, authd)
    authd.answers["s1"] = answer(authorizations=[SUB_ALL])
    authd.hold = True
    waiting = [cache.state(key("s1")) for _ in range(5)]
    assert len(authd.queries) == 1
    authd.release()
    states = [fired(d) for d in waiting]
    assert all(s is states[0] for s in states) and states[0].grants
    assert fired(cache.state(key("s1"))) is states[0] and len(authd.queries) == 1


def test_a_refusal_is_not_kept_and_fails_every_waiter(clock, authd):
    cache = cache_on(clock, authd)
    authd.hold = True
    waiting = [cache.state(key("s1")) for _ in range(3)]
    authd.release()
    for d in waiting:
        failure = fired(d)
        assert failure.check(AuthError)
    assert len(cache) == 0
    authd.hold = False
    authd.answers["s1"] = answer(authorizations=[SUB_ALL])
    assert fired(cache.state(key("s1"))).grants and len(authd.queries) == 2


def test_the_cache_is_bounded_and_drops_the_oldest(clock, authd):
    cache = cache_on(clock, authd, size=3)
    for i in range(5):
        authd.answers[f"s{i}"] = answer(authorizations=[SUB_ALL])
        fired(cache.state(key(f"s{i}")))
    assert len(cache) == 3
    asked = len(authd.queries)
    for i in (2, 3, 4):
        fired(cache.state(key(f"s{i}")))
    assert len(authd.queries) == asked
    fired(cache.state(key("s0")))
    assert len(authd.queries) == asked + 1


def test_the_default_bound(clock, authd):
    cache = cache_on(clock, authd)
    for i in range(CACHE_SIZE + 10):
        authd.answers[f"s{i}"] = answer(authorizations=[SUB_ALL])
        fired(cache.state(key(f"s{i}")))
    assert len(cache) == CACHE_SIZE == 1024


def test_through_http_the_answer_is_cached_per_client(secured, authd):
    broker, http = secured
    authd.answers["s1"] = answer(ttl=30, authorizations=[SUB_ALL])
    for _ in range(3):
        assert http.turned("GET", "/topic/peek?topic=t", headers=bearer("s1")).status == 200
    assert len(authd.queries) == 1
    broker.clock.advance(30)
    assert http.turned("GET", "/topic/peek?topic=t", headers=bearer("s1")).status == 200
    assert len(authd.queries) == 2


# -- AuthState.allows_topic ---------------------------------------------------------------------


@pytest.mark.parametrize(("grants", "topic", "allowed"), [
    ([SUB_ALL], "t", True),
    ([grant(topic="^t")], "tx", True),
    ([grant(topic="^t$")], "u", False),
    ([grant(permissions=["publish"])], "t", False),
    ([grant(channels=[])], "t", False),
    ([grant(channels=["^only$"])], "t", True),
])
def test_allows_topic(grants, topic, allowed):
    state = parse_auth_response(json.dumps({"ttl": 1, "authorizations": grants}).encode(), START_TIME)
    assert state.allows_topic(topic) is allowed


@pytest.mark.parametrize(("pattern", "allowed"), [(".*", True), ("^t$", False), ("\ufffd", True)])
def test_a_name_of_undecodable_bytes_is_matched_as_go_reads_it(pattern, allowed):
    """`%ff` in a query is a lone surrogate here, which re2 cannot take: Go's regexp reads the byte as U+FFFD."""
    everything = {"topic": pattern, "channels": [".*"], "permissions": ["publish", "subscribe"], "admin": True}
    state = parse_auth_response(json.dumps({"ttl": 1, "authorizations": [everything]}).encode(), START_TIME)
    name = "\udcff"
    assert [state.allows(name, ""), state.allows(name, name), state.allows_topic(name), state.allows_admin(name),
            state.allows_admin(name, name)] == [allowed] * 5


def test_a_lookupd_asked_about_a_topic_of_undecodable_bytes_answers_it(clock):
    """A grant is checked before the name, so it meets whatever the query holds (`/lookup` takes any name)."""
    db = RegistrationDB(clock)
    lookupd = sending_secret(guarded_lookupd(db, clock), "publisher")
    assert error(lookupd.get("/lookup?topic=%ff")) == (404, "TOPIC_NOT_FOUND")
    assert error(sending_secret(lookupd, "t-admin").post("/topic/create?topic=%ff")) == (403, "UNAUTHORIZED")
    assert error(sending_secret(lookupd, FULL_SECRET).post("/topic/create?topic=%ff")) == (400, "INVALID_ARG_TOPIC")


def test_the_peek_options_defaults(tmp_path):
    s = settings(tmp_path)
    assert (s.peek_max_body_bytes, s.peek_max_bytes) == (64 << 10, 4 << 20)


# -- --http-auth-required: every endpoint behind a secret (the real-auth-server matrix is
# tests/reliability/test_http_auth_required.py; these drive the waiting step by step) ------


@pytest.fixture
def required(make_broker, tmp_path, authd, sync_threads):
    """A broker under --http-auth-required (topic t, channel c), asking `authd`, and its HTTP client."""
    path = tmp_path / "required"
    path.mkdir()
    broker = make_broker(path=str(path), auth_http_address=["127.0.0.1:4181"], http_auth_required=True)
    broker.auth.fetch_function = authd
    broker.topic("t").channel("c")
    return broker, HTTPClient(broker)


ADMIN_T = {"topic": "^t$", "channels": [".*"], "permissions": [], "admin": True}


def test_a_request_waits_for_the_auth_server_then_is_answered_by_the_endpoint(required, authd):
    broker, http = required
    authd.answers["ops"] = answer(authorizations=[ADMIN_T])
    authd.hold = True
    transport = http.send("POST", "/topic/pause?topic=t", b"", headers=bearer("ops"))
    assert transport.value() == b"" and not broker.topics["t"].paused
    authd.release()
    r = parse_response(transport.value())
    assert (r.status, r.body, r.v1) == (200, b"", True)
    assert broker.topics["t"].paused
    # Cached: answered in the request's own turn, without asking again.
    assert http.post("/topic/unpause?topic=t", headers=bearer("ops")).status == 200
    assert len(authd.queries) == 1 and not broker.topics["t"].paused


def test_a_client_gone_while_the_auth_server_is_asked_gets_nothing_and_changes_nothing(required, authd):
    broker, http = required
    authd.answers["ops"] = answer(authorizations=[ADMIN_T])
    authd.hold = True
    transport = http.send("POST", "/topic/delete?topic=t", b"", headers=bearer("ops"))
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    authd.release()
    assert transport.value() == b"" and "t" in broker.topics


def test_an_auth_server_that_cannot_be_asked_is_auth_failed_on_every_guarded_endpoint(required, authd):
    broker, http = required
    for method, path in (("POST", "/pub?topic=t"), ("GET", "/stats"), ("PUT", "/config/log_level"),
                         ("POST", "/channel/empty?topic=t&channel=c"), ("GET", "/metrics")):
        r = http.request(method, path, b"x" if method != "GET" else None, headers=bearer("unknown"))
        assert error(r) == (401, "AUTH_FAILED"), path
    assert http.get("/ping").status == 200 and http.get("/info").status == 200


def test_without_the_option_the_admin_endpoints_stay_open_with_auth_configured(secured, authd):
    broker, http = secured
    assert http.post("/topic/pause?topic=t").status == 200
    assert http.post("/pub?topic=t", b"x").status == 200
    assert http.get("/stats?format=json").status == 200
    assert authd.queries == []
