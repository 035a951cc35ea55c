"""AUTH and the auth checks on SUB/PUB/MPUB/DPUB, against a fake auth server.

The broker's HTTP fetch is replaced by a function that records each query
and answers with a Deferred the test fires, so the tests can show that
commands sent while the auth server is being asked wait their turn.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet.defer import fail, succeed

from mqd.http.auth import AuthError, auth_urls, parse_auth_response
from mqd.nsqd.stats import client_stats
from tests.support.auth_fakes import FakeAuth, answer, auth
from tests.support.v2_client import Client
from tests.support.v2_frames import cmd, dpub, err, identify, mpub, ok, pub


@pytest.fixture
def auth_broker(make_broker, tmp_path):
    path = tmp_path / "auth"
    path.mkdir()
    broker = make_broker(path=str(path), auth_http_address=["127.0.0.1:4181"])
    fake = FakeAuth()
    broker.auth.fetch_function = fake
    broker.fake_auth = fake
    return broker


@pytest.fixture
def aconnect(auth_broker):
    ports = iter(range(30000, 40000))
    return lambda: Client(auth_broker, port=next(ports))


def authed(c, fake, body=None) -> dict:
    fake.auto = body if body is not None else answer()
    [frame] = c.request(auth())
    fake.auto = None
    assert frame.type == 0, frame
    return json.loads(frame.payload)


# -- configuration --------------------------------------------------------------


def test_auth_urls():
    assert auth_urls(["a:1", "https://b/x"]) == ["http://a:1/auth", "https://b/x"]


def test_identify_reports_auth_required(aconnect, connect):
    c = aconnect()
    [frame] = c.request(identify(feature_negotiation=True))
    assert json.loads(frame.payload)["auth_required"] is True
    plain = connect()
    [frame] = plain.request(identify(feature_negotiation=True))
    assert json.loads(frame.payload)["auth_required"] is False


def test_auth_disabled_without_server(connect):
    c = connect()
    assert c.request(auth()) == [err("E_AUTH_DISABLED AUTH disabled")]
    assert c.closed


# -- AUTH ------------------------------------------------------------------------


def test_auth_success_and_query(aconnect, auth_broker):
    fake = auth_broker.fake_auth
    c = aconnect()
    assert authed(c, fake) == {"identity": "alice", "identity_url": "http://id/alice", "permission_count": 1}
    [(url, method, params)] = fake.calls
    assert (url, method) == ("http://127.0.0.1:4181/auth", "get")
    assert params == {"remote_ip": "127.0.0.1", "tls": "false", "secret": "s3cret", "common_name": ""}
    assert c.request(pub("t", b"x")) == [ok()]


def test_commands_wait_for_the_auth_answer(aconnect, auth_broker):
    fake = auth_broker.fake_auth
    c = aconnect()
    # AUTH and a PUB in one read, then more bytes while the server is asked.
    c.send(auth() + pub("t", b"a"))
    assert c.read() == []
    c.send(pub("t", b"b"))
    assert c.read() == []
    assert auth_broker.topics.get("t") is None
    fake.reply(answer())
    frames = c.read()
    assert frames[0].type == 0 and json.loads(frames[0].payload)["identity"] == "alice"
    assert frames[1:] == [ok(), ok()]
    assert auth_broker.topics["t"].depth() == 2


def test_second_auth_is_fatal(aconnect, auth_broker):
    c = aconnect()
    authed(c, auth_broker.fake_auth)
    assert c.request(auth()) == [err("E_INVALID AUTH already set")]
    assert c.closed


def test_auth_server_failure(aconnect, auth_broker):
    fake = auth_broker.fake_auth
    fake.auto_fail = True
    c = aconnect()
    assert c.request(auth()) == [err("E_AUTH_FAILED AUTH failed")]
    assert c.closed


@pytest.mark.parametrize("body", [b"not json", b"[]", answer(ttl=0),
                                  answer(authorizations=[{"topic": ".*", "channels": [".*"],
                                                          "permissions": ["admin"]}]),
                                  answer(authorizations=[{"topic": "(", "channels": [], "permissions": []}])])
def test_invalid_answers_fail(aconnect, auth_broker, body):
    c = aconnect()
    c.send(auth())
    auth_broker.fake_auth.reply(body)
    assert c.read() == [err("E_AUTH_FAILED AUTH failed")]


def test_no_authorizations(aconnect, auth_broker):
    c = aconnect()
    c.send(auth())
    auth_broker.fake_auth.reply(answer(authorizations=[]))
    assert c.read() == [err("E_UNAUTHORIZED AUTH no authorizations found")]
    assert c.closed


def test_servers_tried_in_turn(make_broker):
    broker = make_broker(auth_http_address=["a:1", "b:2"])
    seen = []

    def fetch(url, method, params):
        seen.append(url)
        return fail(AuthError("down")) if len(seen) == 1 else succeed(answer())

    broker.auth.fetch_function = fetch
    c = Client(broker)
    [frame] = c.request(auth())
    assert frame.type == 0
    assert sorted(seen) == ["http://a:1/auth", "http://b:2/auth"]


# -- checks ----------------------------------------------------------------------


@pytest.mark.parametrize("data, verb", [
    (cmd("SUB", "t", "c"), "SUB"),
    (pub("t", b"x"), "PUB"),
    (mpub("t", [b"x"]), "MPUB"),
    (dpub("t", 10, b"x"), "DPUB"),
])
def test_auth_first(aconnect, data, verb):
    c = aconnect()
    assert c.request(data) == [err(f"E_AUTH_FIRST AUTH required before {verb}")]
    assert c.closed


PUB_ONLY = [{"topic": "^orders$", "channels": [".*"], "permissions": ["publish"]}]
SUB_ONLY = [{"topic": "ord", "channels": ["^arch"], "permissions": ["subscribe"]}]


def test_publish_permission(aconnect, auth_broker):
    c = aconnect()
    authed(c, auth_broker.fake_auth, answer(authorizations=PUB_ONLY))
    assert c.request(pub("orders", b"x")) == [ok()]
    assert c.request(mpub("orders", [b"x", b"y"])) == [ok()]
    assert c.request(pub("orders2", b"x")) == [err('E_UNAUTHORIZED AUTH failed for PUB on "orders2" ""')]
    assert c.closed


def test_subscribe_permission_regex_unanchored(aconnect, auth_broker):
    c = aconnect()
    authed(c, auth_broker.fake_auth, answer(authorizations=SUB_ONLY))
    assert c.request(cmd("SUB", "new_orders", "archive")) == [ok()]
    d = aconnect()
    authed(d, auth_broker.fake_auth, answer(authorizations=SUB_ONLY))
    assert d.request(cmd("SUB", "orders", "billing")) == [
        err('E_UNAUTHORIZED AUTH failed for SUB on "orders" "billing"')]
    e = aconnect()
    authed(e, auth_broker.fake_auth, answer(authorizations=SUB_ONLY))
    assert e.request(pub("orders", b"x")) == [err('E_UNAUTHORIZED AUTH failed for PUB on "orders" ""')]


def test_expired_answer_is_fetched_again(aconnect, auth_broker, clock):
    fake = auth_broker.fake_auth
    c = aconnect()
    authed(c, fake, answer(ttl=10))
    assert c.request(pub("t", b"1")) == [ok()]
    clock.advance(11)
    c.send(pub("t", b"2") + pub("t", b"3"))
    assert c.read() == []  # waiting for the auth server again
    assert len(fake.calls) == 2
    fake.reply(answer(ttl=10))
    assert c.read() == [ok(), ok()]
    clock.advance(11)
    c.send(pub("t", b"4"))
    fake.reply(answer(ttl=10, authorizations=SUB_ONLY))
    assert c.read() == [err('E_UNAUTHORIZED AUTH failed for PUB on "t" ""')]
    assert auth_broker.topics["t"].depth() == 3


def test_requery_failure(aconnect, auth_broker, clock):
    fake = auth_broker.fake_auth
    c = aconnect()
    authed(c, fake, answer(ttl=1))
    clock.advance(2)
    fake.auto_fail = True
    assert c.request(cmd("SUB", "t", "c")) == [err("E_AUTH_FAILED AUTH failed")]
    assert c.closed


def test_connection_lost_while_asking(aconnect, auth_broker):
    c = aconnect()
    c.send(auth())
    c.lose()
    auth_broker.fake_auth.reply(answer())  # ignored, nothing raised
    assert c.read() == []


def test_stats_rows(aconnect, auth_broker):
    c = aconnect()
    row = client_stats(c.proto)
    assert "authed" not in row and "auth_identity" not in row
    authed(c, auth_broker.fake_auth)
    row = client_stats(c.proto)
    assert (row["authed"], row["auth_identity"], row["auth_identity_url"]) == (True, "alice", "http://id/alice")
    keys = list(row)
    assert keys.index("user_agent") + 1 == keys.index("authed")
    d = aconnect()
    authed(d, auth_broker.fake_auth, answer(identity="", identity_url=""))
    row = client_stats(d.proto)
    assert row["authed"] is True and "auth_identity" not in row and "auth_identity_url" not in row


def test_parse_keeps_identity_and_expiry():
    state = parse_auth_response(answer(ttl=5), 100.0)
    assert (state.identity, state.expires, state.permission_count) == ("alice", 105.0, 1)
    assert state.allows("t", "c") and state.allows("t", "")
