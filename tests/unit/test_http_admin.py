"""POST /topic/* and /channel/*: argument errors as nsqd's, and their effect on delivery."""

from __future__ import annotations

import json

import pytest

from mqd.nsqd.metadata import METADATA_FILE
from tests.support.http_client import HTTPClient, error
from tests.support.inprocess_broker import new_broker
from tests.support.v2_client import Client, consumer
from tests.support.v2_frames import err, pub


def publish(broker, *bodies: bytes, topic="t") -> None:
    p = Client(broker)
    for body in bodies:
        p.send(pub(topic, body))


def metadata(broker) -> dict:
    with open(f"{broker.data_path}/{METADATA_FILE}") as f:
        return json.load(f)


def ok(response) -> bool:
    return (response.status, response.body, response.v1) == (200, b"", True)


# -- argument errors ---------------------------------------------------------------------


@pytest.mark.parametrize(("path", "expected"), [
    ("/topic/create", (400, "MISSING_ARG_TOPIC")),
    ("/topic/create?topic=", (400, "INVALID_TOPIC")),
    ("/topic/create?topic=a%20b", (400, "INVALID_TOPIC")),
    ("/topic/create?topic=t;", (400, "INVALID_REQUEST")),
    ("/topic/delete", (400, "MISSING_ARG_TOPIC")),
    ("/topic/delete?topic=nope", (404, "TOPIC_NOT_FOUND")),
    # delete and pause do not check the name: an invalid one is not found.
    ("/topic/delete?topic=b@d", (404, "TOPIC_NOT_FOUND")),
    ("/topic/delete?topic=%zz", (400, "INVALID_REQUEST")),
    ("/topic/empty", (400, "MISSING_ARG_TOPIC")),
    ("/topic/empty?topic=b@d", (400, "INVALID_TOPIC")),
    ("/topic/empty?topic=nope", (404, "TOPIC_NOT_FOUND")),
    ("/topic/pause", (400, "MISSING_ARG_TOPIC")),
    ("/topic/pause?topic=b@d", (404, "TOPIC_NOT_FOUND")),
    ("/topic/unpause?topic=nope", (404, "TOPIC_NOT_FOUND")),
])
def test_topic_argument_errors(http, path, expected):
    assert error(http.post(path)) == expected


CHANNEL_ENDPOINTS = ["create", "delete", "empty", "pause", "unpause"]


@pytest.mark.parametrize("action", CHANNEL_ENDPOINTS)
@pytest.mark.parametrize(("query", "expected"), [
    ("", (400, "MISSING_ARG_TOPIC")),
    ("?channel=c", (400, "MISSING_ARG_TOPIC")),
    ("?topic=b@d&channel=c", (400, "INVALID_ARG_TOPIC")),
    ("?topic=t", (400, "MISSING_ARG_CHANNEL")),
    ("?topic=t&channel=", (400, "INVALID_ARG_CHANNEL")),
    ("?topic=t&channel=b@d", (400, "INVALID_ARG_CHANNEL")),
    ("?topic=t&channel=c&x=%", (400, "INVALID_REQUEST")),
    ("?topic=nope&channel=c", (404, "TOPIC_NOT_FOUND")),
])
def test_channel_argument_errors(http, inproc_broker, action, query, expected):
    inproc_broker.topic("t")
    assert error(http.post(f"/channel/{action}{query}")) == expected
    assert "nope" not in inproc_broker.topics


@pytest.mark.parametrize("action", ["delete", "empty", "pause", "unpause"])
def test_unknown_channel_is_404(http, inproc_broker, action):
    inproc_broker.topic("t")
    assert error(http.post(f"/channel/{action}?topic=t&channel=c")) == (404, "CHANNEL_NOT_FOUND")


# -- create -----------------------------------------------------------------------------------


def test_topic_and_channel_create(http, inproc_broker, clock):
    assert ok(http.post("/topic/create?topic=t"))
    assert ok(http.post("/topic/create?topic=t"))
    assert ok(http.post("/channel/create?topic=t&channel=c"))
    assert ok(http.post("/channel/create?topic=t&channel=c"))
    assert list(inproc_broker.topics) == ["t"] and list(inproc_broker.topics["t"].channels) == ["c"]
    clock.advance(0)
    assert metadata(inproc_broker)["topics"] == [
        {"name": "t", "paused": False, "channels": [{"name": "c", "paused": False}]}]


def test_channel_create_gets_the_topic_backlog(http, inproc_broker):
    http.post("/topic/create?topic=t")
    publish(inproc_broker, b"a", b"b")
    assert inproc_broker.topics["t"].depth() == 2
    http.post("/channel/create?topic=t&channel=c")
    assert inproc_broker.topics["t"].depth() == 0
    assert inproc_broker.topics["t"].channels["c"].depth() == 2


# -- pause ----------------------------------------------------------------------------------------


def test_topic_pause_holds_messages_at_the_topic(http, inproc_broker):
    c = consumer(inproc_broker)
    assert ok(http.post("/topic/pause?topic=t"))
    assert metadata(inproc_broker)["topics"][0]["paused"] is True  # written before the answer
    publish(inproc_broker, b"a", b"b")
    topic = inproc_broker.topics["t"]
    assert (topic.depth(), topic.channels["c"].depth()) == (2, 0)
    assert c.read() == []
    assert ok(http.post("/topic/unpause?topic=t"))
    assert metadata(inproc_broker)["topics"][0]["paused"] is False
    assert [m.body for m in c.messages()] == [b"a", b"b"]
    assert topic.depth() == 0


def test_channel_pause_holds_messages_at_the_channel(http, inproc_broker):
    c = consumer(inproc_broker, rdy=1)
    publish(inproc_broker, b"a")
    [first] = c.messages()
    assert ok(http.post("/channel/pause?topic=t&channel=c"))
    meta = metadata(inproc_broker)["topics"][0]["channels"][0]
    assert meta == {"name": "c", "paused": True}
    publish(inproc_broker, b"b", b"c")
    # In flight can still be finished; nothing new is sent while paused.
    c.fin(first)
    assert c.read() == []
    channel = inproc_broker.topics["t"].channels["c"]
    assert (channel.depth(), channel.in_flight_count()) == (2, 0)
    # Unpausing resumes without the client sending RDY again.
    assert ok(http.post("/channel/unpause?topic=t&channel=c"))
    assert [m.body for m in c.messages()] == [b"b"]


def test_paused_flags_survive_restart(tmp_path, clock):
    broker = new_broker(tmp_path, clock)
    http = HTTPClient(broker)
    http.post("/topic/create?topic=t")
    http.post("/channel/create?topic=t&channel=c")
    http.post("/channel/create?topic=t&channel=d")
    http.post("/topic/pause?topic=t")
    http.post("/channel/pause?topic=t&channel=d")
    broker.close()
    broker = new_broker(tmp_path, clock)
    topic = broker.topics["t"]
    assert topic.paused
    assert (topic.channels["c"].paused, topic.channels["d"].paused) == (False, True)
    broker.close()


# -- empty ----------------------------------------------------------------------------------------


def test_topic_empty_drops_only_what_waits_at_the_topic(http, inproc_broker):
    c = consumer(inproc_broker, rdy=0)
    publish(inproc_broker, b"at-channel")
    http.post("/topic/pause?topic=t")
    publish(inproc_broker, b"at-topic-1", b"at-topic-2")
    assert ok(http.post("/topic/empty?topic=t"))
    topic = inproc_broker.topics["t"]
    assert (topic.depth(), topic.channels["c"].depth()) == (0, 1)
    http.post("/topic/unpause?topic=t")
    c.send(b"RDY 10\n")
    assert [m.body for m in c.messages()] == [b"at-channel"]


def test_topic_empty_drops_the_backend_part_too(make_broker):
    broker = make_broker(mem_queue_size=1)
    publish(broker, b"a", b"b", b"c")
    topic = broker.topics["t"]
    assert (topic.depth(), topic.backend_depth()) == (3, 2)
    assert ok(HTTPClient(broker).post("/topic/empty?topic=t"))
    assert (topic.depth(), topic.backend_depth()) == (0, 0)


def test_channel_empty_drops_queued_in_flight_and_deferred(make_broker):
    broker = make_broker(mem_queue_size=2)
    http = HTTPClient(broker)
    c = consumer(broker, rdy=1)
    publish(broker, b"a", b"b", b"c", b"d")
    http.post("/pub?topic=t&defer=60000", b"later")
    [first] = c.messages()
    channel = broker.topics["t"].channels["c"]
    assert (channel.depth(), channel.in_flight_count(), channel.deferred_count()) == (3, 1, 1)
    assert channel.backend_depth() > 0
    assert ok(http.post("/channel/empty?topic=t&channel=c"))
    assert (channel.depth(), channel.backend_depth(), channel.in_flight_count(),
            channel.deferred_count()) == (0, 0, 0, 0)
    # The consumer stays; its old message is gone, new ones flow (its RDY slot is free).
    c.fin(first)
    assert c.read() == [err(b"E_FIN_FAILED FIN " + first.id + b" failed ID not in flight")]
    assert not c.closed
    publish(broker, b"e")
    assert [m.body for m in c.messages()] == [b"e"]


# -- delete ---------------------------------------------------------------------------------------


def test_channel_delete_disconnects_its_consumers(http, inproc_broker, clock):
    c = consumer(inproc_broker)
    other = consumer(inproc_broker, channel="other")
    publish(inproc_broker, b"a")
    c.messages()
    other.messages()
    assert ok(http.post("/channel/delete?topic=t&channel=c"))
    assert c.closed and not other.closed
    assert list(inproc_broker.topics["t"].channels) == ["other"]
    clock.advance(0)
    assert [ch["name"] for ch in metadata(inproc_broker)["topics"][0]["channels"]] == ["other"]
    assert error(http.post("/channel/delete?topic=t&channel=c")) == (404, "CHANNEL_NOT_FOUND")


def test_channel_delete_of_last_ephemeral_channel_deletes_ephemeral_topic(http, inproc_broker):
    http.post("/topic/create?topic=t%23ephemeral")
    http.post("/channel/create?topic=t%23ephemeral&channel=c")
    assert ok(http.post("/channel/delete?topic=t%23ephemeral&channel=c"))
    assert "t#ephemeral" not in inproc_broker.topics


def test_topic_delete_disconnects_every_consumer_and_a_publish_recreates_it(http, inproc_broker, clock):
    c = consumer(inproc_broker)
    d = consumer(inproc_broker, channel="d")
    publish(inproc_broker, b"a")
    assert ok(http.post("/topic/delete?topic=t"))
    assert c.closed and d.closed
    assert "t" not in inproc_broker.topics
    clock.advance(0)
    assert metadata(inproc_broker)["topics"] is None
    assert error(http.post("/topic/delete?topic=t")) == (404, "TOPIC_NOT_FOUND")
    assert http.post("/pub?topic=t", b"again").status == 200
    assert inproc_broker.topics["t"].depth() == 1 and not inproc_broker.topics["t"].channels


def test_channel_empty_on_durable_lmdb_forgets_in_flight_and_deferred(tmp_path, clock):
    """A durable store keeps delivered messages until FIN: empty must drop those records too."""
    broker = new_broker(tmp_path, clock, backend="lmdb", durable=True)
    http = HTTPClient(broker)
    c = consumer(broker, rdy=1)
    publish(broker, b"a", b"b")
    http.send("POST", "/pub?topic=t&defer=60000", b"later")
    clock.advance(0)
    assert len(c.messages()) == 1
    assert ok(http.post("/channel/empty?topic=t&channel=c"))
    clock.advance(0)
    # A crash: no clean close, only what was committed counts.
    broker.metadata.close()
    broker.store.env.close()
    broker = new_broker(tmp_path, clock, backend="lmdb", durable=True)
    channel = broker.topics["t"].channels["c"]
    assert (channel.depth(), channel.deferred_count()) == (0, 0)
    broker.close()
