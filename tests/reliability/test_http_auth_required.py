"""`--http-auth-required`: every HTTP endpoint of the broker and of mqlookupd asks who is calling.

The matrix: every route × {no secret, a secret the auth server refuses, a
secret without the grant the route needs (a near miss: the grant on
another topic or channel, or another permission), a secret with it},
asking a real auth server on loopback (tests/support/authd_server.py, its
own process, one for the module). The broker and the lookupd are in this
process, their sites reached through real twisted.web
(tests/support/http_client.py); the auth server's answers arrive on the
real reactor, so each request is polled until its answer is complete. A
refused request is answered exactly as peek answers it (status, body,
`WWW-Authenticate`) and changes nothing: the broker's stats and options,
its snapshots and lookupd's registrations are what they were.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.error import ConnectionDone
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from mqd.http.auth import AuthClient, parse_auth_response
from mqd.http.authorization import AuthCache
from mqd.lookup.http import LookupdSite
from mqd.lookup.registry import Registration, RegistrationDB
from mqd.nsqd.stats import stats_json
from mqd.options import LOOKUPD_OPTIONS, resolve
from tests.support.authd import AuthServer, grant
from tests.support.certs import client_context, make_certs, tls_flags
from tests.support.http_client import HTTPClient, Response, error, parse_response
from tests.support.lookupd_clients import LookupdClient
from tests.support.processes import NO_PROXY

pytestmark = pytest.mark.slow


def admin(topic: str = "^t$", channels: tuple[str, ...] = (".*",)) -> dict[str, Any]:
    return {"topic": topic, "channels": list(channels), "permissions": [], "admin": True}


def perm(*permissions: str, topic: str = "^t$") -> dict[str, Any]:
    return {"topic": topic, "channels": [".*"], "permissions": list(permissions)}


ADMIN_T = admin()
ADMIN_ALL = admin(".*")
ADMIN_OTHER_TOPIC = admin("^other$")
ADMIN_OTHER_CHANNEL = admin("^t$", ("^zzz$",))
PUB_T = perm("publish")
SUB_T = perm("subscribe")
PUB_SUB_T = perm("publish", "subscribe")
SUB_ALL = perm("subscribe", topic=".*")
SUB_OTHER = perm("subscribe", topic="^other$")

# The grants of a secret the auth server accepts but that holds nothing.
NOTHING: list[dict[str, Any]] = []


class Case(NamedTuple):
    """One route: its request, the grants that let it through and a near miss (None: any secret is enough)."""

    method: str
    path: str
    body: bytes | None
    granted: list[dict[str, Any]] | None   # None: open (no secret asked)
    near: list[dict[str, Any]] | None      # None: every accepted secret passes
    status: int                            # the answer with the grant


BROKER_CASES = {
    "ping": Case("GET", "/ping", None, None, None, 200),
    "info": Case("GET", "/info", None, None, None, 200),
    "stats-clients": Case("GET", "/stats?format=json", None, [ADMIN_ALL], [ADMIN_T, SUB_ALL], 200),
    "stats-text-clients": Case("GET", "/stats", None, [ADMIN_ALL], [PUB_SUB_T], 200),
    "stats-no-clients": Case("GET", "/stats?format=json&include_clients=false", None, NOTHING, None, 200),
    "metrics": Case("GET", "/metrics", None, NOTHING, None, 200),
    "pub": Case("POST", "/pub?topic=t", b"hello", [PUB_T], [SUB_T, perm("publish", topic="^other$")], 200),
    "mpub": Case("POST", "/mpub?topic=t", b"a\nb", [PUB_T], [SUB_T, ADMIN_T], 200),
    "topic-create": Case("POST", "/topic/create?topic=t", b"", [ADMIN_T], [ADMIN_OTHER_TOPIC, PUB_SUB_T], 200),
    "topic-delete": Case("POST", "/topic/delete?topic=t", b"", [ADMIN_T], [ADMIN_OTHER_TOPIC, PUB_SUB_T], 200),
    "topic-empty": Case("POST", "/topic/empty?topic=t", b"", [ADMIN_T], [ADMIN_OTHER_TOPIC], 200),
    "topic-pause": Case("POST", "/topic/pause?topic=t", b"", [ADMIN_T], [ADMIN_OTHER_TOPIC], 200),
    "topic-unpause": Case("POST", "/topic/unpause?topic=t", b"", [ADMIN_T], [PUB_SUB_T], 200),
    "channel-create": Case("POST", "/channel/create?topic=t&channel=new", b"", [ADMIN_T],
                           [ADMIN_OTHER_CHANNEL, ADMIN_OTHER_TOPIC], 200),
    "channel-delete": Case("POST", "/channel/delete?topic=t&channel=c", b"", [ADMIN_T],
                           [ADMIN_OTHER_CHANNEL], 200),
    "channel-empty": Case("POST", "/channel/empty?topic=t&channel=c", b"", [ADMIN_T], [ADMIN_OTHER_CHANNEL], 200),
    "channel-pause": Case("POST", "/channel/pause?topic=t&channel=c", b"", [ADMIN_T], [SUB_T], 200),
    "channel-unpause": Case("POST", "/channel/unpause?topic=t&channel=c", b"", [ADMIN_T], [PUB_SUB_T], 200),
    "channel-peek": Case("GET", "/channel/peek?topic=t&channel=c", None, [SUB_T], [PUB_T, ADMIN_ALL], 200),
    "topic-peek": Case("GET", "/topic/peek?topic=t", None, [SUB_T], [PUB_T, ADMIN_ALL], 200),
    "topic-retention-get": Case("GET", "/topic/retention?topic=t", None, [ADMIN_T],
                                [ADMIN_OTHER_TOPIC, PUB_SUB_T], 200),
    "topic-retention-post": Case("POST", "/topic/retention?topic=t&bytes=2MB", b"", [ADMIN_T],
                                 [ADMIN_OTHER_TOPIC, SUB_ALL], 200),
    "topic-offsets": Case("GET", "/topic/offsets?topic=t", None, [SUB_T], [PUB_T, ADMIN_ALL, SUB_OTHER], 200),
    "topic-read": Case("GET", "/topic/read?topic=t&offset=0", None, [SUB_T], [PUB_T, ADMIN_ALL], 200),
    "topic-read-json": Case("GET", "/topic/read?topic=t&offset=earliest&format=json", None, [SUB_T],
                            [PUB_T, SUB_OTHER], 200),
    "snapshot": Case("POST", "/snapshot", b"", [ADMIN_ALL, SUB_ALL], [ADMIN_T, SUB_ALL], 200),
    "config-get": Case("GET", "/config/log_level", None, [ADMIN_ALL], [ADMIN_T], 200),
    "config-put": Case("PUT", "/config/nsqlookupd_tcp_addresses", b"[]", [ADMIN_ALL],
                       [ADMIN_OTHER_TOPIC, PUB_SUB_T], 200),
}

LOOKUPD_CASES = {
    "ping": Case("GET", "/ping", None, None, None, 200),
    "info": Case("GET", "/info", None, None, None, 200),
    "debug": Case("GET", "/debug", None, NOTHING, None, 200),
    "lookup": Case("GET", "/lookup?topic=t", None, [SUB_T], [SUB_OTHER, ADMIN_T], 200),
    "lookup-by-publisher": Case("GET", "/lookup?topic=t", None, [PUB_T], [perm("publish", topic="^x$")], 200),
    "topics": Case("GET", "/topics", None, NOTHING, None, 200),
    "channels": Case("GET", "/channels?topic=t", None, [SUB_T], [SUB_OTHER], 200),
    "nodes": Case("GET", "/nodes", None, NOTHING, None, 200),
    "topic-create": Case("POST", "/topic/create?topic=t", b"", [ADMIN_T], [PUB_SUB_T, ADMIN_OTHER_TOPIC], 200),
    "topic-delete": Case("POST", "/topic/delete?topic=t", b"", [ADMIN_T], [ADMIN_OTHER_TOPIC], 200),
    "topic-tombstone": Case("POST", "/topic/tombstone?topic=t&node=h:4151", b"", [ADMIN_T], [PUB_SUB_T], 200),
    "channel-create": Case("POST", "/channel/create?topic=t&channel=new", b"", [ADMIN_T],
                           [ADMIN_OTHER_CHANNEL], 200),
    "channel-delete": Case("POST", "/channel/delete?topic=t&channel=c", b"", [ADMIN_T],
                           [ADMIN_OTHER_CHANNEL, SUB_ALL], 200),
}

CALLERS = ["no-secret", "wrong-secret", "without-grant", "with-grant"]


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory) -> Iterator[AuthServer]:
    """One auth server for the module: each case uses secrets of its own, so no answer is cached across cases."""
    server = AuthServer(tmp_path_factory.mktemp("authd"))
    yield server
    server.close()


@pytest_twisted.inlineCallbacks
def ask(client: HTTPClient, clock, method: str, path: str, body: bytes | None = None,
        secret: str | None = None):
    """The complete answer to one request, the real reactor turning while the auth server is asked."""
    headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
    transport = client.send(method, path, body, headers)
    for _ in range(4000):
        response = parse_response(transport.value(), head=method == "HEAD")
        if response is not None:
            transport.protocol.connectionLost(Failure(ConnectionDone()))
            return response
        clock.advance(0)
        yield deferLater(reactor, 0.002, lambda: None)
    raise AssertionError(f"{method} {path}: no complete answer")


def secret_for(auth_server: AuthServer, daemon: str, case: str, caller: str, c: Case) -> str | None:
    """The secret `caller` sends, its answer given to the auth server first."""
    if caller == "no-secret":
        return None
    secret = f"{daemon}-{case}-{caller}-{os.getpid()}"
    if caller == "without-grant":
        auth_server.answers[secret] = grant(*(c.near if c.near is not None else NOTHING))
    elif caller == "with-grant":
        auth_server.answers[secret] = grant(*(c.granted or NOTHING))
    return secret  # wrong-secret: the auth server does not know it (403: AUTH_FAILED)


def expect(response: Response, c: Case, caller: str) -> None:
    """What `caller` must get for `c`."""
    passes = (c.granted is None or caller == "with-grant"
              or (caller == "without-grant" and c.near is None))
    if passes:
        assert response.status == c.status, (response.status, response.body)
        return
    if caller == "no-secret":
        assert error(response) == (401, "AUTH_REQUIRED")
        assert response.header("WWW-Authenticate") == "Bearer"
    elif caller == "wrong-secret":
        assert error(response) == (401, "AUTH_FAILED")
        assert response.header("WWW-Authenticate") == 'Bearer error="invalid_token"'
    else:
        assert error(response) == (403, "UNAUTHORIZED")


# -- the broker ---------------------------------------------------------------------------


@pytest.fixture
def guarded_broker(make_broker, tmp_path, auth_server, sync_threads):
    """A broker under --http-auth-required: topic t (retaining), channels c and other, a message in t."""
    path = tmp_path / "guarded"
    path.mkdir()
    broker = make_broker(path=str(path), auth_http_address=[auth_server.address], http_auth_required=True,
                         retention_bytes="1MB")
    topic = broker.topic("t")
    for name in ("c", "other"):
        topic.channel(name)
    topic.publish([b"secret body"])
    return broker, HTTPClient(broker)


def broker_state(broker) -> Any:
    """What a refused request must leave as it was: queues, their flags and depths, options, snapshots."""
    stats = stats_json(broker, include_clients=False, include_mem=False)
    base = os.path.join(broker.data_path, "snapshots")
    snapshots = sorted(os.listdir(base)) if os.path.isdir(base) else []
    return stats, broker.options.as_dict(), snapshots


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("case", sorted(BROKER_CASES))
@pytest_twisted.inlineCallbacks
def test_every_broker_endpoint(guarded_broker, auth_server, clock, case, caller):
    broker, http = guarded_broker
    c = BROKER_CASES[case]
    secret = secret_for(auth_server, "mqd", case, caller, c)
    before = broker_state(broker)
    response = yield ask(http, clock, c.method, c.path, c.body, secret)
    expect(response, c, caller)
    if response.status in (401, 403):
        assert broker_state(broker) == before


@pytest_twisted.inlineCallbacks
def test_a_missing_topic_is_refused_before_anything_is_done(guarded_broker, auth_server, clock):
    """The grant's arguments are read as the endpoint reads them: the same 400, after the secret."""
    broker, http = guarded_broker
    auth_server.answers["admin-missing"] = grant(ADMIN_ALL)
    r = yield ask(http, clock, "POST", "/topic/create", b"", "admin-missing")
    assert error(r) == (400, "MISSING_ARG_TOPIC")
    r = yield ask(http, clock, "POST", "/topic/create?topic=bad!", b"", "admin-missing")
    assert error(r) == (400, "INVALID_TOPIC")
    r = yield ask(http, clock, "POST", "/topic/create")
    assert error(r) == (401, "AUTH_REQUIRED")
    assert "bad!" not in broker.topics


@pytest_twisted.inlineCallbacks
def test_a_cached_answer_is_not_asked_again(guarded_broker, auth_server, clock):
    broker, http = guarded_broker
    auth_server.answers["cached-publisher"] = grant(PUB_T)
    for _ in range(3):
        r = yield ask(http, clock, "POST", "/pub?topic=t", b"m", "cached-publisher")
        assert r.status == 200
    assert [q["secret"] for q in auth_server.queries].count("cached-publisher") == 1


# -- mqlookupd ----------------------------------------------------------------------------


@pytest.fixture
def guarded_lookupd(clock, auth_server):
    """An mqlookupd under --http-auth-required: topic t with channel c registered."""
    settings = resolve(LOOKUPD_OPTIONS, {"auth-http-address": [auth_server.address], "http-auth-required": True})
    db = RegistrationDB(clock, inactive_producer_timeout=300, tombstone_lifetime=45)
    db.add_registration(Registration("topic", "t", ""))
    db.add_registration(Registration("channel", "t", "c"))
    client = LookupdClient(db, clock)
    client.site = LookupdSite(db, reactor=clock, auth=AuthCache(AuthClient(settings, clock), clock))
    return db, client


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("case", sorted(LOOKUPD_CASES))
@pytest_twisted.inlineCallbacks
def test_every_lookupd_endpoint(guarded_lookupd, auth_server, clock, case, caller):
    db, http = guarded_lookupd
    c = LOOKUPD_CASES[case]
    secret = secret_for(auth_server, "mqlookupd", case, caller, c)
    before = sorted(map(str, db.registrations()))
    response = yield ask(http, clock, c.method, c.path, c.body, secret)
    expect(response, c, caller)
    if response.status in (401, 403):
        assert sorted(map(str, db.registrations())) == before


# -- what the admin grant is ----------------------------------------------------------------


def test_admin_is_only_json_true_and_never_fails_an_answer_nsqd_accepts():
    for value, is_admin in ((True, True), ("true", False), (1, False), (None, False), ({}, False)):
        body = grant({"topic": ".*", "channels": [".*"], "permissions": ["publish"], "admin": value})
        state = parse_auth_response(json.dumps(body).encode(), 0)
        assert state.allows("t", "")
        assert state.allows_admin("t") is is_admin
        assert state.allows_admin_everywhere() is is_admin


@pytest.mark.parametrize(("pattern", "everywhere"), [
    (".*", True), ("^.*$", True), (".+", True), ("^.+$", True),
    ("", False), ("^t$", False), (".*t", False), ("t|.*", False),
])
def test_the_broker_wide_admin_is_a_written_out_wildcard(pattern, everywhere):
    body = grant({"topic": pattern, "channels": [], "permissions": [], "admin": True})
    state = parse_auth_response(json.dumps(body).encode(), 0)
    assert state.allows_admin_everywhere() is everywhere


# -- the daemons as they run ----------------------------------------------------------------


def call(opener, url: str, method: str = "GET", secret: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if secret is not None:
        req.add_header("Authorization", f"Bearer {secret}")
    try:
        with opener.open(req, timeout=15) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_twistd_mqd_over_http_and_https(start_broker, auth_server, tmp_path):
    certs = make_certs(tmp_path / "certs")
    broker = start_broker(f"--auth-http-address={auth_server.address}", "--http-auth-required",
                          *tls_flags(certs))
    auth_server.answers["proc-admin"] = grant(ADMIN_T, PUB_T)
    https = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(
        context=client_context(certs)))
    for base, opener in ((f"http://{broker.http_address}", NO_PROXY),
                         (f"https://127.0.0.1:{broker.https_port}", https)):
        assert call(opener, f"{base}/ping") == (200, b"OK")
        assert call(opener, f"{base}/info")[0] == 200
        status, body = call(opener, f"{base}/topic/create?topic=t", "POST")
        assert (status, json.loads(body)) == (401, {"message": "AUTH_REQUIRED"})
        status, body = call(opener, f"{base}/topic/create?topic=other", "POST", "proc-admin")
        assert (status, json.loads(body)) == (403, {"message": "UNAUTHORIZED"})
        assert call(opener, f"{base}/topic/create?topic=t", "POST", "proc-admin") == (200, b"")
        status, body = call(opener, f"{base}/stats?format=json", secret="proc-admin")
        assert (status, json.loads(body)) == (403, {"message": "UNAUTHORIZED"})
    status, body = call(NO_PROXY, f"http://{broker.http_address}/stats?format=json&include_clients=false",
                        secret="proc-admin")
    assert status == 200 and [t["topic_name"] for t in json.loads(body)["topics"]] == ["t"]


def test_twistd_mqlookupd(start_lookupd, auth_server):
    lookupd = start_lookupd(f"--auth-http-address={auth_server.address}", "--http-auth-required")
    auth_server.answers["proc-lookupd"] = grant(ADMIN_T)
    base = f"http://{lookupd.http_address}"
    assert call(NO_PROXY, f"{base}/ping") == (200, b"OK")
    status, body = call(NO_PROXY, f"{base}/topics")
    assert (status, json.loads(body)) == (401, {"message": "AUTH_REQUIRED"})
    status, body = call(NO_PROXY, f"{base}/topic/create?topic=t", "POST", "proc-wrong")
    assert (status, json.loads(body)) == (401, {"message": "AUTH_FAILED"})
    assert call(NO_PROXY, f"{base}/topic/create?topic=t", "POST", "proc-lookupd") == (200, b"")
    status, body = call(NO_PROXY, f"{base}/topics", secret="proc-lookupd")
    assert (status, json.loads(body)) == (200, {"topics": ["t"]})
