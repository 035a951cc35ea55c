"""GET /stats's content: nsqd's JSON schema field for field, its text page line for line."""

from __future__ import annotations

import json

import pytest

from mqd.nsqd.stats import client_stats, go_duration, nanoseconds_to_human, stats_json, stats_text
from tests.support.inprocess_broker import START_TIME, scan
from tests.support.v2_client import Client, tls_client
from tests.support.v2_frames import cmd, dpub, identify, mpub, ok, pub

TOPIC_KEYS = [
    "topic_name", "channels", "depth", "backend_depth", "message_count", "message_bytes",
    "paused", "e2e_processing_latency",
]
CHANNEL_KEYS = [
    "channel_name", "depth", "backend_depth", "in_flight_count", "deferred_count", "message_count",
    "requeue_count", "timeout_count", "client_count", "clients", "paused", "e2e_processing_latency",
]
CLIENT_KEYS = [
    "client_id", "hostname", "version", "remote_address", "state", "ready_count", "in_flight_count",
    "message_count", "finish_count", "requeue_count", "connect_ts", "sample_rate", "deflate", "snappy",
    "user_agent", "tls", "tls_cipher_suite", "tls_version", "tls_negotiated_protocol",
    "tls_negotiated_protocol_is_mutual",
]
MEMORY_KEYS = [
    "heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes", "gc_pause_usec_100",
    "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes", "gc_total_runs",
]
NO_E2E = {"count": 0, "percentiles": None}


@pytest.fixture
def broker(make_broker):
    b = make_broker(msg_timeout="2s")
    b.start_time = int(START_TIME)
    return b


@pytest.fixture
def producer(broker):
    p = Client(broker, port=5001)
    assert p.request(identify(client_id="prod", hostname="ph", user_agent="pub/1.0",
                              heartbeat_interval=-1)) == [ok()]
    return p


def publish(p: Client, topic: str, *bodies: bytes) -> None:
    data = pub(topic, bodies[0]) if len(bodies) == 1 else mpub(topic, list(bodies))
    assert p.request(data) == [ok()]


def consumer(broker, topic="t", channel="c", rdy=None, port=6001, **ident) -> Client:
    c = Client(broker, port=port)
    if ident:
        assert c.request(identify(**ident)) == [ok()]
    c.sub(topic, channel, rdy=rdy)
    return c


def topic_row(stats, name="t"):
    [row] = [t for t in stats["topics"] if t["topic_name"] == name]
    return row


def channel_row(stats, topic="t", channel="c"):
    [row] = [c for c in topic_row(stats, topic)["channels"] if c["channel_name"] == channel]
    return row


def roundtrip(stats):
    """What a client gets: the dict must be plain JSON."""
    return json.loads(json.dumps(stats))


# -- the JSON schema ---------------------------------------------------------------------


def test_empty_broker(broker):
    stats = roundtrip(stats_json(broker))
    assert list(stats) == ["version", "health", "start_time", "topics", "memory", "producers"]
    assert stats["version"] == "1.3.0"
    assert stats["health"] == "OK"
    assert stats["start_time"] == int(START_TIME)
    assert stats["topics"] == []            # no topics: [] (not null)
    assert stats["producers"] is None       # nobody published: null
    assert list(stats["memory"]) == MEMORY_KEYS
    assert all(isinstance(v, int) and v >= 0 for v in stats["memory"].values())
    assert stats["memory"]["heap_in_use_bytes"] > 0
    assert stats["memory"]["gc_total_runs"] >= 0


def test_every_field(broker, producer):
    c = consumer(broker, rdy=5, client_id="cons", hostname="ch", user_agent="sub/2.0")
    publish(producer, "t", b"hello", b"world!")
    stats = roundtrip(stats_json(broker))
    [t] = stats["topics"]
    assert list(t) == TOPIC_KEYS
    assert t == {
        "topic_name": "t", "channels": t["channels"], "depth": 0, "backend_depth": 0,
        "message_count": 2, "message_bytes": 11, "paused": False, "e2e_processing_latency": NO_E2E,
    }
    [ch] = t["channels"]
    assert list(ch) == CHANNEL_KEYS
    assert ch == {
        "channel_name": "c", "depth": 0, "backend_depth": 0, "in_flight_count": 2, "deferred_count": 0,
        "message_count": 2, "requeue_count": 0, "timeout_count": 0, "client_count": 1,
        "clients": ch["clients"], "paused": False, "e2e_processing_latency": NO_E2E,
    }
    [client] = ch["clients"]
    assert list(client) == CLIENT_KEYS
    assert client == {
        "client_id": "cons", "hostname": "ch", "version": "V2", "remote_address": "127.0.0.1:6001",
        "state": 3, "ready_count": 5, "in_flight_count": 2, "message_count": 2, "finish_count": 0,
        "requeue_count": 0, "connect_ts": int(START_TIME), "sample_rate": 0, "deflate": False,
        "snappy": False, "user_agent": "sub/2.0", "tls": False, "tls_cipher_suite": "",
        "tls_version": "", "tls_negotiated_protocol": "", "tls_negotiated_protocol_is_mutual": False,
    }
    [prod] = stats["producers"]
    assert list(prod) == CLIENT_KEYS[:15] + ["pub_counts"] + CLIENT_KEYS[15:]
    assert prod["pub_counts"] == [{"topic": "t", "count": 2}]
    assert (prod["client_id"], prod["hostname"], prod["user_agent"], prod["state"]) == ("prod", "ph", "pub/1.0", 0)
    assert prod["remote_address"] == "127.0.0.1:5001"
    c.lose()


def test_counters_through_a_message_life(broker, producer, clock):
    """Publish, deliver, FIN, REQ now, REQ later, timeout, each where nsqd counts it."""
    publish(producer, "t", b"a")            # no channel yet: waits at the topic
    s = stats_json(broker)
    assert topic_row(s)["depth"] == 1 and topic_row(s)["channels"] == []
    assert (topic_row(s)["message_count"], topic_row(s)["message_bytes"]) == (1, 1)

    c = consumer(broker)                    # the channel drains the topic
    s = stats_json(broker)
    assert topic_row(s)["depth"] == 0
    ch = channel_row(s)
    # Drained from the topic: nsqd counts a channel put for these too.
    assert (ch["depth"], ch["message_count"], ch["in_flight_count"]) == (1, 1, 0)

    publish(producer, "t", b"bb", b"ccc")
    c.send(cmd("RDY", 3))
    m1, m2, _ = c.messages()
    ch = channel_row(stats_json(broker))
    assert (ch["depth"], ch["in_flight_count"], ch["message_count"]) == (0, 3, 3)

    c.fin(m1)
    c.req(m2)                                # back to the queue, and out again at once
    [m2b] = c.messages()
    c.req(m2b, ms=10_000)                    # deferred
    s = stats_json(broker)
    ch = channel_row(s)
    assert (ch["depth"], ch["in_flight_count"], ch["deferred_count"]) == (0, 1, 1)
    assert (ch["requeue_count"], ch["timeout_count"], ch["message_count"]) == (2, 0, 3)
    [cl] = ch["clients"]
    assert (cl["message_count"], cl["finish_count"], cl["requeue_count"], cl["in_flight_count"]) == (4, 1, 2, 1)

    c.send(cmd("RDY", 0))
    clock.advance(2)                          # m3 times out
    scan(broker)
    s = stats_json(broker)
    ch = channel_row(s)
    assert (ch["depth"], ch["in_flight_count"], ch["timeout_count"], ch["requeue_count"]) == (1, 0, 1, 2)
    assert ch["clients"][0]["in_flight_count"] == 0
    # Requeues and timeouts are not new messages for the topic or the channel.
    assert (topic_row(s)["message_count"], ch["message_count"]) == (3, 3)
    c.lose()


def test_dpub_counts_as_channel_message_and_deferred(broker, producer):
    consumer(broker)
    assert producer.request(dpub("t", 5000, b"later")) == [ok()]
    s = stats_json(broker)
    ch = channel_row(s)
    assert (ch["message_count"], ch["deferred_count"], ch["depth"]) == (1, 1, 0)
    assert topic_row(s)["message_count"] == 1


def test_fan_out_counts_per_channel(broker, producer):
    consumer(broker, channel="a", port=6001)
    consumer(broker, channel="b", port=6002)
    publish(producer, "t", b"x", b"y")
    s = stats_json(broker)
    assert [c["channel_name"] for c in topic_row(s)["channels"]] == ["a", "b"]
    assert [c["message_count"] for c in topic_row(s)["channels"]] == [2, 2]
    assert topic_row(s)["message_count"] == 2


def test_disconnect_with_messages_in_flight_counts_timeouts(broker, producer):
    """nsqd lets a gone consumer's messages time out; mqd requeues them at once but counts them so."""
    c = consumer(broker, rdy=5)
    publish(producer, "t", b"1", b"2")
    c.lose()
    ch = channel_row(stats_json(broker))
    assert (ch["timeout_count"], ch["depth"], ch["in_flight_count"], ch["client_count"]) == (2, 2, 0, 0)
    assert ch["clients"] == []


def test_pause_empty_delete(broker, producer):
    consumer(broker, rdy=0)
    publish(producer, "t", b"1", b"2")
    broker.topics["t"].pause()
    broker.topics["t"].channels["c"].pause()
    s = stats_json(broker)
    assert topic_row(s)["paused"] is True and channel_row(s)["paused"] is True
    publish(producer, "t", b"3")             # a paused topic keeps it
    s = stats_json(broker)
    assert (topic_row(s)["depth"], channel_row(s)["depth"]) == (1, 2)

    broker.topics["t"].empty()
    broker.topics["t"].channels["c"].empty()
    s = stats_json(broker)
    assert (topic_row(s)["depth"], channel_row(s)["depth"]) == (0, 0)
    assert (topic_row(s)["message_count"], channel_row(s)["message_count"]) == (3, 2)

    broker.delete_topic("t")
    assert stats_json(broker)["topics"] == []


def test_sorted_by_name(broker, producer):
    for topic in ("zeta", "alpha", "mid"):
        publish(producer, topic, b"x")
    for i, channel in enumerate(("c2", "c10", "b")):
        consumer(broker, "mid", channel, port=7000 + i)
    s = stats_json(broker)
    assert [t["topic_name"] for t in s["topics"]] == ["alpha", "mid", "zeta"]
    assert [c["channel_name"] for c in topic_row(s, "mid")["channels"]] == ["b", "c10", "c2"]


# -- options of the request -------------------------------------------------------------------


def test_include_clients_false(broker, producer):
    consumer(broker)
    publish(producer, "t", b"x")
    s = stats_json(broker, include_clients=False)
    assert channel_row(s)["clients"] is None
    assert channel_row(s)["client_count"] == 1
    assert s["producers"] is None


def test_include_mem_false(broker):
    assert "memory" not in stats_json(broker, include_mem=False)


def test_topic_filter(broker, producer):
    publish(producer, "a", b"x")
    publish(producer, "b", b"yy")
    s = stats_json(broker, topic="b")
    assert [t["topic_name"] for t in s["topics"]] == ["b"]
    # Producers are not filtered, but their pub_counts are.
    assert s["producers"][0]["pub_counts"] == [{"topic": "b", "count": 1}]
    assert stats_json(broker)["producers"][0]["pub_counts"] == [
        {"topic": "a", "count": 1}, {"topic": "b", "count": 1}]


def test_topic_filter_unknown_topic(broker, producer):
    publish(producer, "a", b"x")
    s = stats_json(broker, topic="nope")
    # nsqd returns before gathering anything: both null.
    assert s["topics"] is None and s["producers"] is None


def test_channel_filter(broker):
    consumer(broker, "a", "c1", port=6001)
    consumer(broker, "a", "c2", port=6002)
    consumer(broker, "b", "c2", port=6003)
    consumer(broker, "c", "c3", port=6004)
    s = stats_json(broker, channel="c2")
    assert [(t["topic_name"], [c["channel_name"] for c in t["channels"]]) for t in s["topics"]] == [
        ("a", ["c2"]), ("b", ["c2"])]
    s = stats_json(broker, topic="a", channel="c1")
    assert [(t["topic_name"], [c["channel_name"] for c in t["channels"]]) for t in s["topics"]] == [
        ("a", ["c1"])]
    assert stats_json(broker, topic="c", channel="c1")["topics"] == []
    # Empty parameters are no filter.
    assert len(stats_json(broker, topic="", channel="")["topics"]) == 3


def test_producer_filtered_pub_counts_omitted(broker, producer):
    publish(producer, "a", b"x")
    consumer(broker, "b", "c")
    [prod] = stats_json(broker, topic="b")["producers"]
    assert "pub_counts" not in prod


def test_unhealthy(broker):
    broker.set_health("disk full")
    assert stats_json(broker)["health"] == "NOK - disk full"
    broker.set_health(None)
    assert stats_json(broker)["health"] == "OK"


# -- the text page ----------------------------------------------------------------------------


def test_text_empty(broker, clock):
    clock.advance(61.5)
    lines = stats_text(broker, include_mem=False).split("\n")
    assert lines[0].startswith("nsqd v1.3.0 (built w/")
    assert lines[1].startswith("start_time 2023-11-1")
    assert lines[2] == "uptime 1m1.5s"
    assert lines[3:] == ["", "Health: OK", "", "Topics: None", "", "Producers: None", ""]


def test_text_memory_lines(broker):
    lines = stats_text(broker).split("\n")
    at = lines.index("Memory:")
    assert lines[at - 1] == ""
    mem = lines[at + 1:at + 10]
    assert [line[3:28].rstrip() for line in mem] == MEMORY_KEYS
    for line in mem:
        assert line.startswith("   ") and line[28] == "\t" and line[29:].isdigit()


def test_text_known_state(broker, producer, clock):
    c = consumer(broker, "orders", "archive", rdy=2, hostname="worker1", user_agent="pynsq/0.9.1")
    consumer(broker, "orders", "slow#ephemeral", port=6002)
    publish(producer, "orders", b"a", b"b", b"c")
    m1, m2 = c.messages()
    c.fin(m1)
    c.req(m2, ms=60_000)
    publish(producer, "audit", b"zz")
    broker.topics["audit"].pause()
    broker.topics["orders"].channels["slow#ephemeral"].pause()
    clock.advance(45.25)  # within the clients' heartbeat timeout
    text = stats_text(broker, include_mem=False)
    lines = text.split("\n")
    assert lines[2:] == [
        "uptime 45.25s",
        "",
        "Health: OK",
        "",
        "Topics:",
        "*P [audit          ] depth: 1     be-depth: 0     msgs: 1        e2e%: ",
        "",
        "   [orders         ] depth: 0     be-depth: 0     msgs: 3        e2e%: ",
        "      [archive                  ] depth: 0     be-depth: 0     inflt: 1    def: 1    "
        "re-q: 1     timeout: 0     msgs: 3        e2e%: ",
        "        [V2 worker1:6001 pynsq/0.9.1] state: 3 inflt: 1    rdy: 2    fin: 1        "
        "re-q: 1        msgs: 3        connected: 45s",
        "   *P [slow#ephemeral           ] depth: 3     be-depth: 0     inflt: 0    def: 0    "
        "re-q: 0     timeout: 0     msgs: 3        e2e%: ",
        "        [V2 127.0.0.1:6002       ] state: 3 inflt: 0    rdy: 0    fin: 0        "
        "re-q: 0        msgs: 0        connected: 45s",
        "",
        "Producers:",
        "   [V2 ph:5001 pub/1.0      ] msgs: 4        topics: audit=1,orders=3 connected: 45s",
        "",
    ]


def test_text_without_clients(broker, producer):
    consumer(broker)
    publish(producer, "t", b"x")
    lines = stats_text(broker, include_clients=False, include_mem=False).split("\n")
    assert not any(line.startswith("        [V2") for line in lines)
    assert lines[-3:] == ["", "Producers: None", ""]


def test_text_unhealthy(broker):
    broker.set_health("boom")
    assert "\nHealth: NOK - boom\n" in stats_text(broker, include_mem=False)


@pytest.mark.parametrize(("ns", "text"), [
    (0, "0s"), (1, "1ns"), (999, "999ns"), (1_000, "1µs"), (1_500, "1.5µs"), (2_250_000, "2.25ms"),
    (1_000_000_000, "1s"), (3_500_000_000, "3.5s"), (60_000_000_000, "1m0s"),
    (3_723_500_000_000, "1h2m3.5s"), (3_600_000_000_000, "1h0m0s"), (-1_500_000_000, "-1.5s"),
])
def test_go_duration(ns, text):
    assert go_duration(ns) == text


@pytest.mark.parametrize(("ns", "text"), [
    (0, "0.0ns"), (1000, "1000.0ns"), (1500, "1.5us"), (2_500_000, "2.5ms"), (3_000_000_001, "3.0s"),
])
def test_nanoseconds_to_human(ns, text):
    assert nanoseconds_to_human(ns) == text


def test_tls_and_topology_fields(broker):
    """Go reports NegotiatedProtocolIsMutual true for every TLS connection; topology only when set."""
    c = tls_client(broker)
    c.send(identify(feature_negotiation=True, tls_v1=True, topology_zone="z1", topology_region="r1"))
    c.raw()
    row = client_stats(c.proto)
    assert (row["tls"], row["tls_negotiated_protocol_is_mutual"]) == (True, True)
    assert list(row)[-2:] == ["topology_zone", "topology_region"]
    assert (row["topology_zone"], row["topology_region"]) == ("z1", "r1")
    plain = Client(broker, port=5002)
    plain.request(identify(client_id="x"))
    row = client_stats(plain.proto)
    assert row["tls_negotiated_protocol_is_mutual"] is False
    assert "topology_zone" not in row and "topology_region" not in row
