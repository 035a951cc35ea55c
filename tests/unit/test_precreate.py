"""A new topic's channels pre-created from the channels lookupd knows, as nsqd does.

nsqd asks every lookupd `/channels?topic=` when it creates a topic and
starts the topic only once those channels exist. Here the lookupd
connections are StringTransports on the broker's Clock (the fakes of
tests/support/lookup_peer_fakes.py) and the HTTP answer is a Deferred the test fires, so
the test decides when lookupd answers relative to the publishes; the
tests of the query's bearer secret end with one over real HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
import pytest_twisted
from twisted.internet import defer, task
from twisted.web import resource, server

from mqd.nsqd.lookup_peer import LookupService, channels_answer
from tests.support.lookup_peer_fakes import PORTS, FakeEndpoint
from tests.support.v2_client import Client, consumer


class FakeLookupdHTTP:
    """The lookupds' HTTP side: every query waits until the test answers it."""

    def __init__(self) -> None:
        self.queries: list[tuple[str, str, dict[str, str], defer.Deferred]] = []
        # The headers each query was sent with, in the order of `queries`.
        self.headers: list[dict[bytes, list[bytes]]] = []

    def __call__(self, url: str, method: str, params: dict[str, str],
                 headers: Mapping[bytes, list[bytes]]) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        self.queries.append((url, method, params, d))
        self.headers.append(dict(headers))
        return d

    def answer(self, i: int, *channels: str) -> None:
        self.queries[i][3].callback(json.dumps({"channels": list(channels)}).encode())

    def fail(self, i: int, error: Exception) -> None:
        self.queries[i][3].errback(error)


@pytest.fixture
def lookupd_http():
    return FakeLookupdHTTP()


@pytest.fixture
def lookup(inproc_broker, lookupd_http):
    """lookup(*addresses, identify=True, secret="", fetch=lookupd_http, http=None): a started LookupService.

    Each lookupd is connected (and identified, its HTTP API at
    `lookup<i>:<4161+i>`, or at `http` when given).
    """
    services = []

    def start(*addresses: str, identify: bool = True, secret: str = "", fetch=lookupd_http,
              http: tuple[str, int] | None = None) -> LookupService:
        inproc_broker.update_options(lookupd_tcp_address=list(addresses))
        endpoints: dict[str, FakeEndpoint] = {}

        def endpoint_for(address):
            endpoints[address] = FakeEndpoint(address)
            return endpoints[address]

        svc = LookupService(inproc_broker, PORTS, reactor=inproc_broker.clock, endpoint_for=endpoint_for,
                            fetch=fetch, secret=secret)
        svc.startService()
        services.append(svc)
        for i, address in enumerate(addresses):
            conn = endpoints[address].accept()
            if identify:
                conn.written()
                host, port = http or (f"lookup{i}", 4161 + i)
                info = {"tcp_port": 4160, "http_port": port, "version": "1.3.0",
                        "broadcast_address": host, "hostname": host}
                conn.reply(json.dumps(info).encode())
        return svc

    yield start
    for svc in services:
        if svc.running:
            svc.stopService()


def depths(broker, topic="t") -> dict[str, int]:
    return {name: ch.depth() for name, ch in broker.topics[topic].channels.items()}


def test_listed_channels_get_every_message_from_the_first(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160")
    publish(b"m1")
    # The topic's creation asked lookupd, at the HTTP address its IDENTIFY gave.
    assert [(u, m, p) for u, m, p, _ in lookupd_http.queries] == [
        ("http://lookup0:4161/channels", "get", {"topic": "t"})]
    publish(b"m2", b"m3")
    topic = inproc_broker.topics["t"]
    assert topic.held and topic.depth() == 3 and not topic.channels

    lookupd_http.answer(0, "a", "b")

    assert not topic.held and topic.depth() == 0
    assert depths(inproc_broker) == {"a": 3, "b": 3}
    publish(b"m4")
    assert depths(inproc_broker) == {"a": 4, "b": 4}
    for channel in ("a", "b"):
        c = consumer(inproc_broker, channel=channel)
        assert [m.body for m in c.messages()] == [b"m1", b"m2", b"m3", b"m4"]


def test_channel_subscribed_while_held_waits_with_the_listed_ones(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160")
    publish(b"m1")
    c = consumer(inproc_broker, channel="c")
    publish(b"m2")
    assert c.messages() == []  # nothing handed out before lookupd answered

    lookupd_http.answer(0, "a")

    assert [m.body for m in c.messages()] == [b"m1", b"m2"]
    assert depths(inproc_broker) == {"c": 0, "a": 2}


def test_every_lookupd_is_asked_and_the_topic_waits_for_all(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160", "10.0.0.2:4160")
    publish(b"m1")
    assert sorted(u for u, *_ in lookupd_http.queries) == [
        "http://lookup0:4161/channels", "http://lookup1:4162/channels"]
    lookupd_http.answer(0, "a", "b")
    assert inproc_broker.topics["t"].held and not inproc_broker.topics["t"].channels
    lookupd_http.answer(1, "b", "c")
    assert depths(inproc_broker) == {"a": 1, "b": 1, "c": 1}


def test_a_failed_lookupd_is_skipped(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160", "10.0.0.2:4160")
    publish(b"m1")
    lookupd_http.fail(0, defer.TimeoutError("no answer"))
    lookupd_http.answer(1, "a")
    assert depths(inproc_broker) == {"a": 1}


def test_no_answer_at_all_releases_the_topic(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160")
    publish(b"m1")
    lookupd_http.queries[0][3].callback(b"not json")
    topic = inproc_broker.topics["t"]
    assert not topic.held and not topic.channels and topic.depth() == 1
    c = consumer(inproc_broker, channel="c")
    assert [m.body for m in c.messages()] == [b"m1"]


def test_ephemeral_and_invalid_names_are_not_created(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160")
    publish(b"m1")
    lookupd_http.answer(0, "a#ephemeral", "bad name", "x" * 65, "ok")
    assert depths(inproc_broker) == {"ok": 1}


def test_ephemeral_topic_is_not_held(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160")
    c = consumer(inproc_broker, topic="e#ephemeral", channel="c")
    publish(b"m1", topic="e#ephemeral")
    assert lookupd_http.queries == []
    assert [m.body for m in c.messages()] == [b"m1"]


def test_lookupd_not_identified_yet_is_not_asked(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160", identify=False)
    c = consumer(inproc_broker, channel="c")
    publish(b"m1")
    assert lookupd_http.queries == []
    assert not inproc_broker.topics["t"].held
    assert [m.body for m in c.messages()] == [b"m1"]


def test_topic_deleted_while_held_gets_no_channels(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160")
    publish(b"m1")
    topic = inproc_broker.topics["t"]
    inproc_broker.delete_topic("t")
    lookupd_http.answer(0, "a")
    assert not topic.channels and "t" not in inproc_broker.topics


def test_existing_topic_is_not_asked_again(inproc_broker, lookup, lookupd_http, publish):
    lookup("10.0.0.1:4160")
    publish(b"m1")
    lookupd_http.answer(0, "a")
    publish(b"m2")
    Client(inproc_broker).sub(channel="z")
    assert len(lookupd_http.queries) == 1


def test_http_address_of_an_ipv6_lookupd(inproc_broker, lookup):
    svc = lookup("10.0.0.1:4160")
    peer = svc.peers["10.0.0.1:4160"]
    peer.protocol.lookupd_info = {"broadcast_address": "::1", "http_port": 4161}
    assert svc.http_addresses() == ["[::1]:4161"]
    peer.protocol.lookupd_info = {"broadcast_address": "", "http_port": 4161}
    assert svc.http_addresses() == []


@pytest.mark.parametrize("body, expected", [
    (b'{"channels":["a","b"]}', ["a", "b"]),
    (b'{"channels":[]}', []),
    (b'{"channels":null}', []),
])
def test_channels_answer(body, expected):
    assert channels_answer(body) == expected


@pytest.mark.parametrize("body", [b"[]x", b'{"channels":"a"}', b'{"channels":[1]}'])
def test_channels_answer_refuses_other_shapes(body):
    with pytest.raises(ValueError):
        channels_answer(body)


# -- the query's bearer secret (--http-client-auth-secret) ------------------------------------


@pytest.mark.parametrize("secret, sent", [("", {}), ("s3cret", {b"Authorization": [b"Bearer s3cret"]})])
def test_the_query_carries_the_secret_only_when_one_is_given(inproc_broker, lookup, lookupd_http, publish,
                                                             secret, sent):
    lookup("10.0.0.1:4160", "10.0.0.2:4160", secret=secret)
    publish(b"m1")
    assert lookupd_http.headers == [sent, sent]
    lookupd_http.answer(0, "a")
    lookupd_http.answer(1)
    assert depths(inproc_broker) == {"a": 1}


class _GuardedChannels(resource.Resource):
    """A lookupd's `/channels` that requires `Bearer good`, as mqlookupd with --http-auth-required; records what came."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bytes, bytes | None]] = []

    def render_GET(self, request):
        authorization = request.getHeader(b"authorization")
        self.seen.append((request.uri, authorization))
        request.setHeader(b"Content-Type", b"application/json")
        if authorization != b"Bearer good":
            request.setResponseCode(401)
            return b'{"message":"AUTH_REQUIRED"}'
        return b'{"channels":["from-lookupd"]}'


@pytest.fixture
def guarded_lookupd():
    from twisted.internet import reactor

    channels = _GuardedChannels()
    port = reactor.listenTCP(0, server.Site(channels), interface="127.0.0.1")
    yield channels, port.getHost().port
    port.stopListening()


@pytest.mark.parametrize("secret, channels", [("good", {"from-lookupd": 1}), ("", {})])
@pytest_twisted.inlineCallbacks
def test_over_http_the_secret_gets_the_channels_of_a_lookupd_that_requires_it(inproc_broker, lookup, publish,
                                                                             guarded_lookupd, secret, channels):
    from twisted.internet import reactor

    guarded, port = guarded_lookupd
    lookup("10.0.0.1:4160", secret=secret, fetch=None, http=("127.0.0.1", port))
    publish(b"m1")
    topic = inproc_broker.topics["t"]
    for _ in range(500):
        if not topic.held:
            break
        yield task.deferLater(reactor, 0.01, lambda: None)
    assert not topic.held
    assert guarded.seen == [(b"/channels?topic=t", b"Bearer " + secret.encode() if secret else None)]
    assert depths(inproc_broker) == channels
