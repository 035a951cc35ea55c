"""mqlookupd's HTTP API: every endpoint's exact JSON, errors, and the time-based filtering."""

from __future__ import annotations

import json

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport

from mqd.lookup.protocol import LookupdFactory
from mqd.lookup.registry import GO_ZERO_TIME_NS, RegistrationDB
from tests.support.http_client import error
from tests.support.inprocess_broker import START_TIME
from tests.support.lookupd_clients import LookupdClient
from tests.support.v2_frames import sized


@pytest.fixture
def db(clock):
    return RegistrationDB(clock, inactive_producer_timeout=300, tombstone_lifetime=45)


@pytest.fixture
def http(db, clock):
    return LookupdClient(db, clock)


@pytest.fixture
def broker(db):
    """broker(n, *registrations) -> an identified V1 connection from broker number n."""
    factory = LookupdFactory(db, "lookup-host", {"TCP": 4160, "HTTP": 4161}, hostname="lhost")

    def make(n: int, *lines: str):
        addr = IPv4Address("TCP", f"10.0.0.{n}", 5000 + n)
        proto = factory.buildProtocol(addr)
        proto.makeConnection(StringTransport(peerAddress=addr))
        body = json.dumps({"version": "1.3.0", "tcp_port": 4150, "http_port": 4151,
                           "hostname": f"h{n}", "broadcast_address": f"b{n}"}).encode()
        proto.dataReceived(b"  V1IDENTIFY\n" + sized(body))
        for line in lines:
            proto.dataReceived(line.encode() + b"\n")
        assert not proto.transport.disconnecting
        return proto

    return make


def peer(n: int) -> dict:
    return {"remote_address": f"10.0.0.{n}:{5000 + n}", "hostname": f"h{n}",
            "broadcast_address": f"b{n}", "tcp_port": 4150, "http_port": 4151,
            "version": "1.3.0", "topology_zone": "", "topology_region": ""}


def ok_json(response):
    assert response.status == 200 and response.v1 and response.is_json, response
    return response.body


def test_ping_is_plain_text(http):
    r = http.get("/ping")
    assert (r.status, r.body, r.v1) == (200, b"OK", False)


def test_info(http):
    assert ok_json(http.get("/info")) == b'{"version":"1.3.0"}'


def test_unknown_path_and_wrong_method(http):
    assert error(http.get("/nope")) == (404, "NOT_FOUND")
    r = http.get("/topic/create?topic=t")
    assert error(r) == (405, "METHOD_NOT_ALLOWED")
    assert r.header("Allow") == "OPTIONS, POST"
    assert error(http.post("/lookup?topic=t")) == (405, "METHOD_NOT_ALLOWED")
    r = http.get("/topics/")
    assert (r.status, r.header("Location")) == (301, "/topics")


def test_empty_registry(http):
    assert ok_json(http.get("/topics")) == b'{"topics":[]}'
    assert ok_json(http.get("/channels?topic=t")) == b'{"channels":[]}'
    assert ok_json(http.get("/nodes")) == b'{"producers":[]}'
    assert ok_json(http.get("/debug")) == b"{}"
    assert error(http.get("/lookup?topic=t")) == (404, "TOPIC_NOT_FOUND")


def test_missing_and_bad_args(http):
    for path in ("/lookup", "/channels"):
        assert error(http.get(path)) == (400, "MISSING_ARG_TOPIC")
        assert error(http.get(path + "?topic=a;b")) == (400, "INVALID_REQUEST")
    assert error(http.post("/topic/create")) == (400, "MISSING_ARG_TOPIC")
    assert error(http.post("/topic/create?topic=bad!")) == (400, "INVALID_ARG_TOPIC")
    assert error(http.post("/topic/delete")) == (400, "MISSING_ARG_TOPIC")
    for path in ("/channel/create", "/channel/delete"):
        assert error(http.post(path)) == (400, "MISSING_ARG_TOPIC")
        assert error(http.post(path + "?topic=bad!&channel=c")) == (400, "INVALID_ARG_TOPIC")
        assert error(http.post(path + "?topic=t")) == (400, "MISSING_ARG_CHANNEL")
        assert error(http.post(path + "?topic=t&channel=bad!")) == (400, "INVALID_ARG_CHANNEL")
    assert error(http.post("/topic/tombstone?node=b1:4151")) == (400, "MISSING_ARG_TOPIC")
    assert error(http.post("/topic/tombstone?topic=t")) == (400, "MISSING_ARG_NODE")


def test_registered_brokers(http, broker):
    broker(1, "REGISTER t c", "REGISTER t d", "REGISTER u")
    broker(2, "REGISTER t c")
    lookup = json.loads(ok_json(http.get("/lookup?topic=t")))
    assert lookup == {"channels": ["c", "d"], "producers": [peer(1), peer(2)]}
    assert list(json.loads(ok_json(http.get("/lookup?topic=t")))) == ["channels", "producers"]
    assert ok_json(http.get("/topics")) == b'{"topics":["t","u"]}'
    assert ok_json(http.get("/channels?topic=t")) == b'{"channels":["c","d"]}'
    nodes = json.loads(ok_json(http.get("/nodes")))
    assert nodes == {"producers": [
        {**peer(1), "tombstones": [False, False], "topics": ["t", "u"]},
        {**peer(2), "tombstones": [False], "topics": ["t"]},
    ]}


def test_debug(http, broker, clock):
    broker(1, "REGISTER t c")
    http.post("/topic/create?topic=empty")
    data = json.loads(ok_json(http.get("/debug")))
    assert list(data) == ["channel:t:c", "client::", "topic:t:"]
    entry = {"broadcast_address": "b1", "hostname": "h1", "http_port": 4151,
             "id": "10.0.0.1:5001", "last_update": int(START_TIME) * 10**9, "tcp_port": 4150,
             "tombstoned": False, "tombstoned_at": GO_ZERO_TIME_NS,
             "topology_region": "", "topology_zone": "", "version": "1.3.0"}
    assert data == {key: [entry] for key in data}
    clock.advance(1)
    http.post("/topic/tombstone?topic=t&node=b1:4151")
    data = json.loads(ok_json(http.get("/debug")))
    assert data["topic:t:"][0]["tombstoned"] is True
    assert data["topic:t:"][0]["tombstoned_at"] == (int(START_TIME) + 1) * 10**9
    assert data["client::"][0]["tombstoned"] is False


def test_inactive_producers_are_hidden_until_they_ping(http, broker, clock):
    b1 = broker(1, "REGISTER t")
    broker(2, "REGISTER t")
    clock.advance(200)
    b1.dataReceived(b"PING\n")
    clock.advance(101)
    assert json.loads(http.get("/lookup?topic=t").body)["producers"] == [peer(1)]
    assert [n["broadcast_address"] for n in json.loads(http.get("/nodes").body)["producers"]] == ["b1"]
    # Hidden, not forgotten.
    assert len(json.loads(http.get("/debug").body)["topic:t:"]) == 2
    assert ok_json(http.get("/topics")) == b'{"topics":["t"]}'


def test_tombstone_hides_one_topic_for_its_lifetime(http, broker, clock):
    broker(1, "REGISTER t", "REGISTER u")
    broker(2, "REGISTER t")
    r = http.post("/topic/tombstone?topic=t&node=b1:4151")
    assert (r.status, r.body, r.v1) == (200, b"", True)
    assert json.loads(http.get("/lookup?topic=t").body)["producers"] == [peer(2)]
    assert json.loads(http.get("/lookup?topic=u").body)["producers"] == [peer(1)]
    nodes = json.loads(http.get("/nodes").body)["producers"]
    assert nodes[0]["topics"] == ["t", "u"] and nodes[0]["tombstones"] == [True, False]
    clock.advance(44.9)
    assert json.loads(http.get("/lookup?topic=t").body)["producers"] == [peer(2)]
    clock.advance(0.2)
    assert json.loads(http.get("/lookup?topic=t").body)["producers"] == [peer(1), peer(2)]
    assert json.loads(http.get("/nodes").body)["producers"][0]["tombstones"] == [False, False]


def test_tombstone_of_no_match_is_ok(http, broker):
    broker(1, "REGISTER t")
    assert http.post("/topic/tombstone?topic=t&node=b1:9999").status == 200
    assert http.post("/topic/tombstone?topic=nope&node=b1:4151").status == 200
    assert json.loads(http.get("/lookup?topic=t").body)["producers"] == [peer(1)]


def test_tombstone_ends_with_unregister(http, broker):
    b1 = broker(1, "REGISTER t")
    http.post("/topic/tombstone?topic=t&node=b1:4151")
    b1.dataReceived(b"UNREGISTER t\nREGISTER t\n")
    assert json.loads(http.get("/lookup?topic=t").body)["producers"] == [peer(1)]


def test_lookup_of_a_topic_without_producers(http, broker):
    b1 = broker(1, "REGISTER t c")
    b1.dataReceived(b"UNREGISTER t c\nUNREGISTER t\n")
    assert ok_json(http.get("/lookup?topic=t")) == b'{"channels":["c"],"producers":[]}'


def test_topic_create_and_delete(http, broker):
    r = http.post("/topic/create?topic=t")
    assert (r.status, r.body, r.v1) == (200, b"", True)
    assert ok_json(http.get("/topics")) == b'{"topics":["t"]}'
    assert ok_json(http.get("/lookup?topic=t")) == b'{"channels":[],"producers":[]}'
    broker(1, "REGISTER t c")
    r = http.post("/topic/delete?topic=t")
    assert (r.status, r.body) == (200, b"")
    assert ok_json(http.get("/topics")) == b'{"topics":[]}'
    assert ok_json(http.get("/channels?topic=t")) == b'{"channels":[]}'
    assert error(http.get("/lookup?topic=t")) == (404, "TOPIC_NOT_FOUND")
    # Unknown and even invalid names are fine.
    assert http.post("/topic/delete?topic=bad!").status == 200


def test_channel_create_and_delete(http):
    r = http.post("/channel/create?topic=t&channel=c")
    assert (r.status, r.body) == (200, b"")
    assert ok_json(http.get("/topics")) == b'{"topics":["t"]}'
    assert ok_json(http.get("/lookup?topic=t")) == b'{"channels":["c"],"producers":[]}'
    assert http.post("/channel/delete?topic=t&channel=c").status == 200
    assert ok_json(http.get("/channels?topic=t")) == b'{"channels":[]}'
    assert ok_json(http.get("/topics")) == b'{"topics":["t"]}'
    assert error(http.post("/channel/delete?topic=t&channel=c")) == (404, "CHANNEL_NOT_FOUND")
