"""POST /pub and /mpub: nsqd's checks in nsqd's order, and what reaches the topic."""

from __future__ import annotations

import struct

import pytest
from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure

from backends import BackendError
from mqd.http.response import ApiError
from mqd.nsqd.http.publish import parse_binary_mpub, split_text_mpub
from tests.support.http_client import HTTPClient, error, parse_response
from tests.support.inprocess_broker import failing_once, new_broker, scan
from tests.support.v2_client import consumer
from tests.support.v2_frames import sized


def framed(*bodies: bytes, count: int | None = None) -> bytes:
    """A binary /mpub body; `count` overrides the number of messages it announces."""
    n = len(bodies) if count is None else count
    return struct.pack(">i", n) + b"".join(sized(b) for b in bodies)


# -- /pub -------------------------------------------------------------------------------


def test_pub_publishes_one_message(http, inproc_broker):
    c = consumer(inproc_broker)
    r = http.post("/pub?topic=t", b"hello\nworld")
    assert (r.status, r.body) == (200, b"OK") and r.v1
    assert [m.body for m in c.messages()] == [b"hello\nworld"]
    assert inproc_broker.topics["t"].message_count == 1


def test_pub_creates_the_topic(http, inproc_broker):
    http.post("/pub?topic=new", b"x")
    assert inproc_broker.topics["new"].depth() == 1


@pytest.mark.parametrize(("path", "body", "headers", "expected"), [
    # Content-Length is checked before anything else, even the topic.
    ("/pub", b"x" * 11, None, (413, "MSG_TOO_BIG")),
    # Then the body as read (here without a Content-Length: chunked).
    ("/pub", b"x" * 11, {"Transfer-Encoding": "chunked"}, (413, "MSG_TOO_BIG")),
    ("/pub", b"", None, (400, "MSG_EMPTY")),
    ("/pub?topic=t", b"", None, (400, "MSG_EMPTY")),
    ("/pub", b"x", None, (400, "MISSING_ARG_TOPIC")),
    ("/pub?channel=t", b"x", None, (400, "MISSING_ARG_TOPIC")),
    ("/pub?topic=", b"x", None, (400, "INVALID_TOPIC")),
    ("/pub?topic=a/b", b"x", None, (400, "INVALID_TOPIC")),
    ("/pub?topic=" + "a" * 65, b"x", None, (400, "INVALID_TOPIC")),
    ("/pub?topic=t;x", b"x", None, (400, "INVALID_REQUEST")),
    ("/pub?topic=%zz", b"x", None, (400, "INVALID_REQUEST")),
    ("/pub?topic=t&defer=abc", b"x", None, (400, "INVALID_DEFER")),
    ("/pub?topic=t&defer=-1", b"x", None, (400, "INVALID_DEFER")),
    ("/pub?topic=t&defer=1.5", b"x", None, (400, "INVALID_DEFER")),
    ("/pub?topic=t&defer=", b"x", None, (400, "INVALID_DEFER")),
    ("/pub?topic=t&defer=3600001", b"x", None, (400, "INVALID_DEFER")),
    ("/pub?topic=t&defer=99999999999999999999", b"x", None, (400, "INVALID_DEFER")),
    ("/pub?topic=t&defer=" + "9" * 5000, b"x", None, (400, "INVALID_DEFER")),  # a 500 once
])
def test_pub_errors(make_broker, path, body, headers, expected):
    http = HTTPClient(make_broker(max_msg_size=10))
    if headers and headers.get("Transfer-Encoding") == "chunked":
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    assert error(http.post(path, body, headers=headers)) == expected


def test_pub_at_the_size_limit_is_accepted(make_broker):
    broker = make_broker(max_msg_size=10)
    assert HTTPClient(broker).post("/pub?topic=t", b"x" * 10).status == 200


def test_pub_invalid_defer_still_creates_the_topic(http, inproc_broker):
    assert error(http.post("/pub?topic=made&defer=x", b"x")) == (400, "INVALID_DEFER")
    assert "made" in inproc_broker.topics and inproc_broker.topics["made"].depth() == 0


def test_pub_with_defer_is_held_until_due(http, inproc_broker, clock):
    c = consumer(inproc_broker)
    assert http.post("/pub?topic=t&defer=5000", b"later").status == 200
    assert http.post("/pub?topic=t&defer=0", b"now").status == 200
    assert [m.body for m in c.messages()] == [b"now"]
    assert inproc_broker.topics["t"].channels["c"].deferred_count() == 1
    clock.advance(5)
    scan(inproc_broker)
    assert [m.body for m in c.messages()] == [b"later"]


def test_pub_to_an_exiting_topic_is_503(http, inproc_broker):
    inproc_broker.topic("t").exiting = True
    assert error(http.post("/pub?topic=t", b"x")) == (503, "EXITING")
    assert error(http.post("/mpub?topic=t", b"x\ny")) == (503, "EXITING")


def test_pub_backend_failure_is_500_and_unhealthy(http, inproc_broker, monkeypatch):
    def refuse(self, msgs):
        raise BackendError("LMDB write failed: No space left on device")

    monkeypatch.setattr(type(inproc_broker.topic("t")), "put", refuse)
    assert error(http.post("/pub?topic=t", b"x")) == (500, "INTERNAL_ERROR")
    assert inproc_broker.health == "LMDB write failed: No space left on device"
    assert http.get("/ping").body == b"NOK - LMDB write failed: No space left on device"
    assert error(http.post("/mpub?topic=t", b"x")) == (500, "INTERNAL_ERROR")


# -- /mpub ---------------------------------------------------------------------------------


def test_mpub_text_mode_splits_lines_and_skips_empty_ones(http, inproc_broker):
    c = consumer(inproc_broker)
    r = http.post("/mpub?topic=t", b"one\ntwo\n\nthree\r\nfour\n")
    assert (r.status, r.body) == (200, b"OK") and r.v1
    assert [m.body for m in c.messages()] == [b"one", b"two", b"three\r", b"four"]
    assert http.post("/mpub?topic=t", b"five\nsix").status == 200
    assert [m.body for m in c.messages()] == [b"five", b"six"]


def test_mpub_with_nothing_to_publish_is_ok(http, inproc_broker):
    assert http.post("/mpub?topic=t", b"").body == b"OK"
    assert http.post("/mpub?topic=t", b"\n\n").body == b"OK"
    assert inproc_broker.topics["t"].message_count == 0


@pytest.mark.parametrize("flag", ["true", "1", "T", "TRUE", "yes", "bogus", ""])
def test_mpub_binary_mode(http, inproc_broker, flag):
    c = consumer(inproc_broker)
    r = http.post(f"/mpub?topic=t&binary={flag}", framed(b"a\nb", b"c"))
    assert (r.status, r.body) == (200, b"OK")
    assert [m.body for m in c.messages()] == [b"a\nb", b"c"]


@pytest.mark.parametrize("flag", ["false", "0", "f", "False"])
def test_mpub_binary_false_is_text(http, inproc_broker, flag):
    c = consumer(inproc_broker)
    assert http.post(f"/mpub?topic=t&binary={flag}", b"a\nb").status == 200
    assert [m.body for m in c.messages()] == [b"a", b"b"]


@pytest.mark.parametrize(("body", "expected"), [
    (b"", "BAD_BODY"),
    (b"\x00\x00", "BAD_BODY"),
    (framed(count=0), "BAD_BODY"),
    (framed(count=-1), "BAD_BODY"),
    (framed(b"x", count=10**6), "BAD_BODY"),
    (framed(b"x", count=2), "BAD_MESSAGE"),
    (framed(b"x") + b"", "OK"),
    (framed(b"x") + b"trailing bytes are ignored", "OK"),
    (struct.pack(">ii", 1, 0), "BAD_MESSAGE"),
    (struct.pack(">ii", 1, -5), "BAD_MESSAGE"),
    (struct.pack(">ii", 1, 11) + b"x" * 11, "BAD_MESSAGE"),
    (struct.pack(">ii", 1, 5) + b"abc", "BAD_MESSAGE"),
    (struct.pack(">ii", 1, 3), "BAD_MESSAGE"),
])
def test_mpub_binary_errors(make_broker, body, expected):
    http = HTTPClient(make_broker(max_msg_size=10, max_body_size=1000))
    r = http.post("/mpub?topic=t&binary=true", body)
    if expected == "OK":
        assert r.status == 200
    else:
        assert error(r) == (413, expected)


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/mpub?topic=t", b"x" * 21, (413, "BODY_TOO_BIG")),
    ("/mpub?topic=t", b"12345\n" * 3 + b"1234", (413, "BODY_TOO_BIG")),
    ("/mpub?topic=t", b"a\n" + b"x" * 11 + b"\n", (413, "MSG_TOO_BIG")),
    ("/mpub?topic=t&binary=true", framed(b"x" * 10, b"y" * 10), (413, "BODY_TOO_BIG")),
    ("/mpub", b"x", (400, "MISSING_ARG_TOPIC")),
    ("/mpub?topic=b@d", b"x", (400, "INVALID_TOPIC")),
    ("/mpub?topic=t;", b"x", (400, "INVALID_REQUEST")),
])
def test_mpub_errors(make_broker, path, body, expected):
    broker = make_broker(max_msg_size=10, max_body_size=20)
    assert error(HTTPClient(broker).post(path, body)) == expected
    assert broker.topics.get("t") is None or broker.topics["t"].message_count == 0


def test_mpub_body_too_big_by_content_length_comes_before_the_topic(make_broker):
    http = HTTPClient(make_broker(max_body_size=20))
    assert error(http.post("/mpub", b"x" * 21)) == (413, "BODY_TOO_BIG")


def test_mpub_text_at_the_body_limit_is_accepted(make_broker):
    broker = make_broker(max_msg_size=10, max_body_size=20)
    assert HTTPClient(broker).post("/mpub?topic=t", b"123456789\n123456789\n").status == 200
    assert broker.topics["t"].message_count == 2


def test_split_and_parse_helpers():
    assert split_text_mpub(b"a\nb", 100, 10) == [b"a", b"b"]
    assert split_text_mpub(b"\n", 100, 10) == []
    with pytest.raises(ApiError):
        split_text_mpub(b"a" * 11, 100, 10)
    assert parse_binary_mpub(framed(b"a", b"bc"), 10, 100) == [b"a", b"bc"]


# -- durable mode: answered once committed ----------------------------------------------------


@pytest.fixture
def durable(tmp_path, clock):
    broker = new_broker(tmp_path, clock, backend="lmdb", durable=True)
    yield broker
    broker.close()


def test_durable_pub_answers_after_the_commit(durable, clock):
    http = HTTPClient(durable)
    transport = http.send("POST", "/pub?topic=t", b"x")
    assert transport.value() == b""
    assert durable.store._pending()
    clock.advance(0)
    r = parse_response(transport.value())
    assert (r.status, r.body) == (200, b"OK") and r.v1
    assert not durable.store._pending()
    transport = http.send("POST", "/mpub?topic=t", b"a\nb")
    assert transport.value() == b""
    clock.advance(0)
    assert parse_response(transport.value()).body == b"OK"
    assert durable.topics["t"].depth() == 3


def test_durable_pub_failed_commit_is_500(durable, clock):
    failing_once(durable.store)
    http = HTTPClient(durable)
    transport = http.send("POST", "/pub?topic=t", b"x")
    clock.advance(0)
    assert error(parse_response(transport.value())) == (500, "INTERNAL_ERROR")
    assert durable.health == "LMDB write failed: No space left on device"
    # While the store is failing, a publish is refused at once.
    assert error(http.post("/pub?topic=t", b"y")) == (500, "INTERNAL_ERROR")


def test_durable_pub_client_gone_before_the_commit(durable, clock):
    http = HTTPClient(durable)
    transport = http.send("POST", "/pub?topic=t", b"x")
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    clock.advance(0)  # answering a request whose connection is gone must not raise
    assert durable.topics["t"].depth() == 1


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=xyz"])
def test_form_content_type_is_still_a_message(http, inproc_broker, content_type):
    """curl -d labels the body a form; nsqd publishes it as it is, and so does mqd."""
    c = consumer(inproc_broker)
    r = http.post("/pub?topic=t", b"a=b&c=%zz", headers={"Content-Type": content_type})
    assert r.body == b"OK"
    assert [m.body for m in c.messages()] == [b"a=b&c=%zz"]


def test_request_body_kept_in_memory_is_bounded(make_broker):
    """A huge body (chunked, so no Content-Length) is refused without being stored whole."""
    broker = make_broker(max_msg_size=10, max_body_size=20)
    http = HTTPClient(broker)
    bodies = []
    real = http.site.getContentFile

    def spy(length):
        bodies.append(real(length))
        return bodies[-1]

    http.site.getContentFile = spy
    chunk = b"x" * 1000
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(100)) + b"0\r\n\r\n"
    r = http.post("/pub?topic=t", chunked, headers={"Transfer-Encoding": "chunked"})
    assert error(r) == (413, "MSG_TOO_BIG")
    r = http.post("/mpub?topic=t", chunked, headers={"Transfer-Encoding": "chunked"})
    assert error(r) == (413, "BODY_TOO_BIG")
    assert [b.stored for b in bodies] == [21, 21]
    chunked = b"5\r\nab\ncd\r\n0\r\n\r\n"
    assert http.post("/mpub?topic=t", chunked, headers={"Transfer-Encoding": "chunked"}).body == b"OK"
    assert broker.topics["t"].message_count == 2


def test_pub_defer_with_leading_zeros_parses_as_go_does(http, inproc_broker):
    assert http.post("/pub?topic=t&defer=" + "0" * 30 + "5", b"x").status == 200
    assert inproc_broker.topics["t"].depth() == 1


# -- --max-defer-timeout (nsq PR #1504) ------------------------------------------------------


@pytest.mark.parametrize("path", ["/pub?topic=t&defer=", "/mpub?topic=t&defer="])
def test_defer_is_limited_by_max_defer_timeout(make_broker, path):
    broker = make_broker(max_defer_timeout="10s")
    http = HTTPClient(broker)
    assert http.post(path + "10000", b"x").status == 200
    assert error(http.post(path + "10001", b"x")) == (400, "INVALID_DEFER")
    assert broker.topics["t"].message_count == 1


def test_max_defer_timeout_defaults_to_max_req_timeout(make_broker):
    broker = make_broker(max_req_timeout="10s")
    assert broker.options.max_defer_timeout == 10.0
    http = HTTPClient(broker)
    assert error(http.post("/pub?topic=t&defer=10001", b"x")) == (400, "INVALID_DEFER")
    assert error(http.post("/mpub?topic=t&defer=10001", b"x")) == (400, "INVALID_DEFER")


def test_max_defer_timeout_may_pass_max_req_timeout(make_broker):
    http = HTTPClient(make_broker(max_req_timeout="10s", max_defer_timeout="2h"))
    assert http.post("/pub?topic=t&defer=7200000", b"x").status == 200
    assert error(http.post("/pub?topic=t&defer=7200001", b"x")) == (400, "INVALID_DEFER")


@pytest.mark.parametrize("defer", ["abc", "-1", "", "1.5"])
def test_mpub_invalid_defer(http, inproc_broker, defer):
    assert error(http.post("/mpub?topic=t&defer=" + defer, b"a\nb")) == (400, "INVALID_DEFER")
    assert inproc_broker.topics["t"].message_count == 0


@pytest.mark.parametrize("binary", [False, True])
def test_mpub_with_defer_is_held_until_due(http, inproc_broker, clock, binary):
    c = consumer(inproc_broker)
    if binary:
        r = http.post("/mpub?topic=t&binary=true&defer=5000", framed(b"a", b"b"))
    else:
        r = http.post("/mpub?topic=t&defer=5000", b"a\nb\n")
    assert r.body == b"OK"
    assert http.post("/mpub?topic=t&defer=0", b"now").status == 200
    assert [m.body for m in c.messages()] == [b"now"]
    assert inproc_broker.topics["t"].channels["c"].deferred_count() == 2
    clock.advance(5)
    scan(inproc_broker)
    assert sorted(m.body for m in c.messages()) == [b"a", b"b"]


def test_big_mpub_with_defer_defers_every_chunk(make_broker, clock):
    from mqd.nsqd.batches import CHUNK_MESSAGES

    broker = make_broker(max_body_size=1 << 24)
    http = HTTPClient(broker)
    consumer(broker, rdy=0)
    n = CHUNK_MESSAGES * 2 + 1
    transport = http.send("POST", "/mpub?topic=t&defer=5000", b"\n".join(b"%d" % i for i in range(n)))
    assert parse_response(transport.value()) is None  # published over several turns
    for _ in range(50):
        clock.advance(0)
    assert parse_response(transport.value()).body == b"OK"
    channel = broker.topics["t"].channels["c"]
    assert channel.deferred_count() == n and channel.depth() == 0
