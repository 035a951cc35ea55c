"""The nsqd HTTP API over real HTTP against a running broker.

Requests go through http.client (no proxy, no extra dependency); consumers
are raw V2 sockets so a test sees exactly what is delivered and when a
connection is closed.
"""

from __future__ import annotations

import http.client
import json
import struct
import time
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.processes import FAST_SCAN, wait_for
from tests.support.raw_conn import FRAME_ERROR, FRAME_RESPONSE, RawConn, command
from tests.support.v2_frames import mpub_body

V1 = "nsq; version=1.0"
JSON_TYPE = "application/json; charset=utf-8"


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    @property
    def v1(self) -> bool:
        return self.headers.get("X-NSQ-Content-Type") == V1

    def json(self) -> Any:
        assert self.headers.get("Content-Type") == JSON_TYPE, dict(self.headers)
        return json.loads(self.body)

    def error(self) -> tuple[int, str]:
        """(status, message) of a V1 error, checking the V1 header and exact JSON body."""
        assert self.v1, dict(self.headers)
        body = self.json()
        assert self.body == json.dumps({"message": body["message"]}, separators=(",", ":")).encode()
        return self.status, body["message"]


def call(broker, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    conn = http.client.HTTPConnection(broker.http_host, broker.http_port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        conn.close()


def post(broker, path: str, body: bytes = b"", **kw: Any) -> Reply:
    return call(broker, "POST", path, body, **kw)


def ok_empty(reply: Reply) -> bool:
    return (reply.status, reply.body, reply.v1) == (200, b"", True)


def stats(broker, topic: str) -> dict:
    """The topic's entry in /stats?format=json (None if the broker has no such topic)."""
    body = call(broker, "GET", f"/stats?format=json&topic={topic}").json()
    return (body["topics"] or [None])[0]


def subscribe(broker, topic: str, channel: str, rdy: int = 10) -> RawConn:
    conn = RawConn(broker)
    conn.send(command(f"SUB {topic} {channel}"))
    assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
    conn.send(command(f"RDY {rdy}"))
    return conn


def bodies(conn: RawConn, n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        _, _, msg_id, body = conn.read_message()
        conn.send(command(f"FIN {msg_id.decode()}"))
        out.append(body)
    return out


# -- /ping, /info, conventions ---------------------------------------------------------------


def test_ping_and_info(twistd_broker):
    r = call(twistd_broker, "GET", "/ping")
    assert (r.status, r.body, r.v1) == (200, b"OK", False)
    r = call(twistd_broker, "GET", "/info")
    assert r.status == 200 and r.v1
    info = r.json()
    assert info["version"] == "1.3.0"
    assert (info["http_port"], info["tcp_port"]) == (twistd_broker.http_port, twistd_broker.tcp_port)
    assert info["max_heartbeat_interval"] == 60_000_000_000
    assert info["max_output_buffer_timeout"] == 30_000_000_000
    assert (info["max_output_buffer_size"], info["max_deflate_level"]) == (65536, 6)
    assert (info["topology_zone"], info["topology_region"]) == ("", "")


def test_not_found_method_not_allowed_and_redirects(twistd_broker):
    assert call(twistd_broker, "GET", "/nope").error() == (404, "NOT_FOUND")
    assert call(twistd_broker, "GET", "/ping/extra").error() == (404, "NOT_FOUND")
    r = call(twistd_broker, "GET", "/pub?topic=t")
    assert r.error() == (405, "METHOD_NOT_ALLOWED")
    assert r.headers["Allow"] == "OPTIONS, POST"
    assert post(twistd_broker, "/ping").error() == (405, "METHOD_NOT_ALLOWED")
    assert call(twistd_broker, "DELETE", "/topic/delete?topic=t").error() == (405, "METHOD_NOT_ALLOWED")
    r = call(twistd_broker, "GET", "/ping/")
    assert (r.status, r.headers["Location"]) == (301, "/ping")


def test_accept_header_is_ignored(twistd_broker, name):
    """go-nsq and pynsq send the pre-1.0 Accept header; the answer is V1 all the same."""
    legacy = {"Accept": "application/vnd.nsq; version=1.0"}
    r = post(twistd_broker, f"/pub?topic={name()}", b"x", headers=legacy)
    assert (r.status, r.body, r.v1) == (200, b"OK", True)
    r = call(twistd_broker, "GET", "/info", headers=legacy)
    assert r.v1 and "status_code" not in r.json()
    assert post(twistd_broker, "/pub", b"x", headers=legacy).error() == (400, "MISSING_ARG_TOPIC")


# -- /pub and /mpub -----------------------------------------------------------------------------


def test_pub_delivers_and_answers_ok(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c") as conn:
        r = post(twistd_broker, f"/pub?topic={topic}", b"hello")
        assert (r.status, r.body, r.v1) == (200, b"OK", True)
        assert bodies(conn, 1) == [b"hello"]


@pytest.fixture
def small_broker(start_broker):
    return start_broker("--max-msg-size=10", "--max-body-size=30", "--max-req-timeout=10s",
                        *FAST_SCAN)


def test_pub_errors(small_broker, name):
    b = small_broker
    topic = name()
    assert post(b, "/pub", b"x" * 11).error() == (413, "MSG_TOO_BIG")
    chunked = iter([b"x" * 6, b"x" * 5])  # no Content-Length: too big once read
    assert post(b, f"/pub?topic={topic}", chunked).error() == (413, "MSG_TOO_BIG")
    assert post(b, f"/pub?topic={topic}", b"").error() == (400, "MSG_EMPTY")
    assert post(b, "/pub", b"x").error() == (400, "MISSING_ARG_TOPIC")
    assert post(b, "/pub?topic=b@d", b"x").error() == (400, "INVALID_TOPIC")
    assert post(b, "/pub?topic=t;x", b"x").error() == (400, "INVALID_REQUEST")
    assert post(b, f"/pub?topic={topic}&defer=soon", b"x").error() == (400, "INVALID_DEFER")
    assert post(b, f"/pub?topic={topic}&defer=-1", b"x").error() == (400, "INVALID_DEFER")
    assert post(b, f"/pub?topic={topic}&defer=10001", b"x").error() == (400, "INVALID_DEFER")
    assert post(b, f"/pub?topic={topic}", b"x" * 10).status == 200
    assert stats(b, topic)["depth"] == 1


def test_pub_defer(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c") as conn:
        start = time.monotonic()
        assert post(twistd_broker, f"/pub?topic={topic}&defer=300", b"later").status == 200
        assert post(twistd_broker, f"/pub?topic={topic}", b"now").status == 200
        assert bodies(conn, 1) == [b"now"]
        assert bodies(conn, 1) == [b"later"]
        assert time.monotonic() - start >= 0.29


def test_mpub_text_mode(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c") as conn:
        r = post(twistd_broker, f"/mpub?topic={topic}", b"one\ntwo\n\nthree\nfour\n")
        assert (r.status, r.body, r.v1) == (200, b"OK", True)
        assert bodies(conn, 4) == [b"one", b"two", b"three", b"four"]
        assert post(twistd_broker, f"/mpub?topic={topic}&binary=false", b"five\nsix").status == 200
        assert bodies(conn, 2) == [b"five", b"six"]
        assert post(twistd_broker, f"/mpub?topic={topic}", b"\n\n").body == b"OK"
        conn.expect_silence(0.1)


@pytest.mark.parametrize("flag", ["true", "1", "non-normalized"])
def test_mpub_binary_mode(twistd_broker, name, flag):
    topic = name()
    with subscribe(twistd_broker, topic, "c") as conn:
        r = post(twistd_broker, f"/mpub?topic={topic}&binary={flag}", mpub_body([b"a\nb", b"c"]))
        assert (r.status, r.body) == (200, b"OK")
        assert bodies(conn, 2) == [b"a\nb", b"c"]


def test_mpub_errors(small_broker, name):
    b = small_broker
    topic = name()
    assert post(b, f"/mpub?topic={topic}", b"x" * 31).error() == (413, "BODY_TOO_BIG")
    assert post(b, f"/mpub?topic={topic}", b"a\n" + b"x" * 11).error() == (413, "MSG_TOO_BIG")
    assert post(b, f"/mpub?topic={topic}&binary=true", b"\x00").error() == (413, "BAD_BODY")
    assert post(b, f"/mpub?topic={topic}&binary=true", struct.pack(">i", 0)).error() == (413, "BAD_BODY")
    bad_size = struct.pack(">ii", 1, 11) + b"x" * 11
    assert post(b, f"/mpub?topic={topic}&binary=true", bad_size).error() == (413, "BAD_MESSAGE")
    short = struct.pack(">ii", 2, 1) + b"x"
    assert post(b, f"/mpub?topic={topic}&binary=true", short).error() == (413, "BAD_MESSAGE")
    assert post(b, "/mpub", b"x").error() == (400, "MISSING_ARG_TOPIC")
    assert post(b, "/mpub?topic=b@d", b"x").error() == (400, "INVALID_TOPIC")
    assert stats(b, topic)["message_count"] == 0


def test_durable_pub_is_answered_once_on_disk(start_broker, name):
    broker = start_broker("--durable", *FAST_SCAN)
    topic = name()
    assert post(broker, f"/pub?topic={topic}", b"one").body == b"OK"
    assert post(broker, f"/mpub?topic={topic}", b"two\nthree").body == b"OK"
    broker.crash()
    broker.start()
    with subscribe(broker, topic, "c") as conn:
        assert sorted(bodies(conn, 3)) == [b"one", b"three", b"two"]


# -- topic and channel administration --------------------------------------------------------------


def test_topic_and_channel_argument_errors(twistd_broker, name):
    topic = name()
    assert post(twistd_broker, "/topic/create").error() == (400, "MISSING_ARG_TOPIC")
    assert post(twistd_broker, "/topic/create?topic=b@d").error() == (400, "INVALID_TOPIC")
    assert post(twistd_broker, "/topic/delete?topic=nope").error() == (404, "TOPIC_NOT_FOUND")
    assert post(twistd_broker, "/topic/empty?topic=nope").error() == (404, "TOPIC_NOT_FOUND")
    assert post(twistd_broker, "/topic/pause?topic=nope").error() == (404, "TOPIC_NOT_FOUND")
    assert post(twistd_broker, "/topic/unpause?topic=nope").error() == (404, "TOPIC_NOT_FOUND")
    # /channel/create does not create the topic.
    assert post(twistd_broker, f"/channel/create?topic={topic}&channel=c").error() == (404, "TOPIC_NOT_FOUND")
    assert ok_empty(post(twistd_broker, f"/topic/create?topic={topic}"))
    for action in ("create", "delete", "empty", "pause", "unpause"):
        base = f"/channel/{action}"
        assert post(twistd_broker, base).error() == (400, "MISSING_ARG_TOPIC")
        assert post(twistd_broker, f"{base}?topic=b@d&channel=c").error() == (400, "INVALID_ARG_TOPIC")
        assert post(twistd_broker, f"{base}?topic={topic}").error() == (400, "MISSING_ARG_CHANNEL")
        assert post(twistd_broker, f"{base}?topic={topic}&channel=b@d").error() == (400, "INVALID_ARG_CHANNEL")
        if action != "create":
            assert post(twistd_broker, f"{base}?topic={topic}&channel=c").error() == (404, "CHANNEL_NOT_FOUND")
    assert ok_empty(post(twistd_broker, f"/channel/create?topic={topic}&channel=c"))
    assert twistd_broker.channels_in_metadata().get(topic) in (None, ["c"])


def test_topic_pause_holds_messages_and_unpause_resumes(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c") as conn:
        assert ok_empty(post(twistd_broker, f"/topic/pause?topic={topic}"))
        assert post(twistd_broker, f"/mpub?topic={topic}", b"a\nb").status == 200
        conn.expect_silence(0.3)
        t = stats(twistd_broker, topic)
        assert (t["paused"], t["depth"], t["channels"][0]["depth"]) == (True, 2, 0)
        assert ok_empty(post(twistd_broker, f"/topic/unpause?topic={topic}"))
        assert bodies(conn, 2) == [b"a", b"b"]
        assert stats(twistd_broker, topic)["paused"] is False


def test_channel_pause_holds_messages_and_unpause_resumes(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c") as conn, subscribe(twistd_broker, topic, "other") as other:
        assert ok_empty(post(twistd_broker, f"/channel/pause?topic={topic}&channel=c"))
        assert post(twistd_broker, f"/pub?topic={topic}", b"x").status == 200
        assert bodies(other, 1) == [b"x"]  # other channels are not paused
        conn.expect_silence(0.3)
        ch = stats(twistd_broker, topic)["channels"][0]
        assert (ch["channel_name"], ch["paused"], ch["depth"]) == ("c", True, 1)
        # No RDY is sent again: unpausing is enough.
        assert ok_empty(post(twistd_broker, f"/channel/unpause?topic={topic}&channel=c"))
        assert bodies(conn, 1) == [b"x"]


def test_pause_is_on_disk_at_once_and_survives_a_crash(twistd_broker, name):
    topic = name()
    post(twistd_broker, f"/topic/create?topic={topic}")
    post(twistd_broker, f"/channel/create?topic={topic}&channel=c")
    post(twistd_broker, f"/channel/create?topic={topic}&channel=d")
    assert ok_empty(post(twistd_broker, f"/topic/pause?topic={topic}"))
    assert ok_empty(post(twistd_broker, f"/channel/pause?topic={topic}&channel=d"))
    # Written before the answer: a crash right now keeps the flags.
    meta = {t["name"]: t for t in twistd_broker.metadata()["topics"]}[topic]
    assert meta["paused"] is True
    assert {c["name"]: c["paused"] for c in meta["channels"]} == {"c": False, "d": True}
    twistd_broker.crash()
    twistd_broker.start()
    t = stats(twistd_broker, topic)
    assert t["paused"] is True
    assert {c["channel_name"]: c["paused"] for c in t["channels"]} == {"c": False, "d": True}
    with subscribe(twistd_broker, topic, "c") as conn:
        post(twistd_broker, f"/pub?topic={topic}", b"held")
        conn.expect_silence(0.3)
        post(twistd_broker, f"/topic/unpause?topic={topic}")
        assert bodies(conn, 1) == [b"held"]


def test_topic_empty_leaves_channels_alone(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c", rdy=0) as conn:
        post(twistd_broker, f"/pub?topic={topic}", b"in-channel")
        post(twistd_broker, f"/topic/pause?topic={topic}")
        post(twistd_broker, f"/mpub?topic={topic}", b"at-topic-1\nat-topic-2")
        assert stats(twistd_broker, topic)["depth"] == 2
        assert ok_empty(post(twistd_broker, f"/topic/empty?topic={topic}"))
        t = stats(twistd_broker, topic)
        assert (t["depth"], t["channels"][0]["depth"]) == (0, 1)
        post(twistd_broker, f"/topic/unpause?topic={topic}")
        conn.send(command("RDY 10"))
        assert bodies(conn, 1) == [b"in-channel"]
        conn.expect_silence(0.2)


def test_channel_empty_drops_in_flight_and_keeps_the_consumer(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c", rdy=1) as conn:
        post(twistd_broker, f"/mpub?topic={topic}", b"a\nb\nc")
        post(twistd_broker, f"/pub?topic={topic}&defer=60000", b"deferred")
        _, _, first_id, body = conn.read_message()
        assert body == b"a"
        ch = stats(twistd_broker, topic)["channels"][0]
        assert (ch["depth"], ch["in_flight_count"], ch["deferred_count"]) == (2, 1, 1)
        assert ok_empty(post(twistd_broker, f"/channel/empty?topic={topic}&channel=c"))
        ch = stats(twistd_broker, topic)["channels"][0]
        assert (ch["depth"], ch["in_flight_count"], ch["deferred_count"]) == (0, 0, 0)
        conn.send(command(f"FIN {first_id.decode()}"))
        kind, payload = conn.read_frame()
        assert kind == FRAME_ERROR and payload.startswith(b"E_FIN_FAILED")
        post(twistd_broker, f"/pub?topic={topic}", b"after")
        assert bodies(conn, 1) == [b"after"]


def test_channel_delete_closes_its_consumers(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c") as conn, subscribe(twistd_broker, topic, "keep") as keep:
        post(twistd_broker, f"/pub?topic={topic}", b"x")
        assert bodies(keep, 1) == [b"x"]
        conn.read_message()
        assert ok_empty(post(twistd_broker, f"/channel/delete?topic={topic}&channel=c"))
        conn.expect_closed()
        assert [c["channel_name"] for c in stats(twistd_broker, topic)["channels"]] == ["keep"]
        assert post(twistd_broker, f"/channel/delete?topic={topic}&channel=c").error() == (404, "CHANNEL_NOT_FOUND")
        post(twistd_broker, f"/pub?topic={topic}", b"y")
        assert bodies(keep, 1) == [b"y"]


def test_topic_delete_closes_every_consumer_and_a_publish_recreates_it(twistd_broker, name):
    topic = name()
    with subscribe(twistd_broker, topic, "c") as c1, subscribe(twistd_broker, topic, "d") as c2:
        post(twistd_broker, f"/pub?topic={topic}", b"x")
        assert ok_empty(post(twistd_broker, f"/topic/delete?topic={topic}"))
        for conn in (c1, c2):
            conn.sock.settimeout(5)
            try:
                while True:  # the message may have been sent before the close
                    conn.read_frame()
            except (ConnectionError, OSError):
                pass
    assert stats(twistd_broker, topic) is None
    assert post(twistd_broker, f"/topic/delete?topic={topic}").error() == (404, "TOPIC_NOT_FOUND")
    assert post(twistd_broker, f"/pub?topic={topic}", b"again").status == 200
    t = stats(twistd_broker, topic)
    assert (t["depth"], t["channels"]) == (1, [])
    wait_for(lambda: not twistd_broker.channels_in_metadata().get(topic),
             what="the metadata to drop the deleted channels")


# -- /config ------------------------------------------------------------------------------------


def test_config_get_and_put(twistd_broker):
    r = call(twistd_broker, "GET", "/config/nsqlookupd_tcp_addresses")
    assert (r.status, r.json(), r.v1) == (200, [], True)
    addresses = ["127.0.0.1:4160", "127.0.0.2:4160"]
    r = call(twistd_broker, "PUT", "/config/nsqlookupd_tcp_addresses", json.dumps(addresses).encode())
    assert (r.status, r.json()) == (200, addresses)
    assert call(twistd_broker, "GET", "/config/nsqlookupd_tcp_addresses").json() == addresses
    assert call(twistd_broker, "GET", "/config/msg_timeout").json() == 60_000_000_000
    assert call(twistd_broker, "GET", "/config/nope").error() == (400, "INVALID_OPTION")
    assert call(twistd_broker, "PUT", "/config/msg_timeout", b"1s").error() == (400, "INVALID_OPTION")
    assert call(twistd_broker, "PUT", "/config/log_level", b"").error() == (413, "INVALID_VALUE")
    assert call(twistd_broker, "PUT", "/config/log_level", b"bad").error() == (400, "INVALID_VALUE")
    assert call(twistd_broker, "PUT", "/config/nsqlookupd_tcp_addresses", b"{").error() == (400, "INVALID_VALUE")
    assert call(twistd_broker, "GET", "/config/log_level").json() == 2


def test_config_log_level_applies_at_once(twistd_broker):
    call(twistd_broker, "GET", "/info")
    assert "GET /info" not in twistd_broker.log()
    r = call(twistd_broker, "PUT", "/config/log_level", b"debug")
    assert (r.status, r.json()) == (200, 1)
    call(twistd_broker, "GET", "/info?after=debug")
    deadline = time.monotonic() + 5
    while "GET /info?after=debug" not in twistd_broker.log():
        assert time.monotonic() < deadline, twistd_broker.describe()
        time.sleep(0.02)
    assert call(twistd_broker, "PUT", "/config/log_level", b"info").json() == 2


# -- /stats routing ------------------------------------------------------------------------------


def test_stats_formats(twistd_broker, name):
    topic = name()
    post(twistd_broker, f"/pub?topic={topic}", b"x")
    r = call(twistd_broker, "GET", "/stats")
    assert r.status == 200 and r.v1
    assert r.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert r.body.startswith(b"nsqd v1.3.0") and topic.encode() in r.body
    body = call(twistd_broker, "GET", f"/stats?format=json&topic={topic}&include_mem=false").json()
    assert [t["topic_name"] for t in body["topics"]] == [topic]
    assert "memory" not in body
    assert call(twistd_broker, "GET", "/stats?format=json&topic=none-such").json()["topics"] is None
