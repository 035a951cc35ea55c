"""PUB, MPUB and DPUB: success, every error text, and bodies arriving in pieces."""

from __future__ import annotations

import struct

import pytest

from .conftest import Client, cmd, dpub, err, mpub, mpub_body, ok, pub, sized

I32 = struct.Struct(">i")


def queued(broker, topic="t") -> list[bytes]:
    t = broker.topics[topic]
    return [m.body for m in t._queue.mem] + [m.body for m in list(t._queue.backend._items)]


# -- PUB ---------------------------------------------------------------------------------


def test_pub_ok_creates_topic(connect, broker):
    c = connect()
    assert c.request(pub("t", b"hello")) == [ok()]
    topic = broker.topics["t"]
    assert topic.depth() == 1
    assert (topic.message_count, topic.message_bytes) == (1, 5)
    assert queued(broker) == [b"hello"]
    assert c.proto.pub_counts == {"t": 1}


def test_pub_binary_body(connect, broker):
    body = bytes(range(256)) + b"\n\r\n\x00"
    c = connect()
    assert c.request(pub("t", body)) == [ok()]
    assert queued(broker) == [body]


@pytest.mark.parametrize("line", [cmd("PUB"), b"PUB\r\n"])
def test_pub_no_topic(connect, broker, line):
    c = connect()
    assert c.request(line + sized(b"x")) == [err("E_INVALID PUB insufficient number of parameters")]
    assert c.closed
    assert broker.topics == {}


@pytest.mark.parametrize("topic, quoted", [(b"bad!", '"bad!"'), (b"", '""'), (b"a" * 65, '"' + "a" * 65 + '"')])
def test_pub_bad_topic(connect, broker, topic, quoted):
    c = connect()
    assert c.request(b"PUB " + topic + b"\n" + sized(b"x")) == [
        err(f"E_BAD_TOPIC PUB topic name {quoted} is not valid")
    ]
    assert c.closed
    assert broker.topics == {}


@pytest.mark.parametrize("size", [0, -1, -100])
def test_pub_size_not_positive(connect, broker, size):
    c = connect()
    assert c.request(cmd("PUB", "t") + I32.pack(size)) == [
        err(f"E_BAD_MESSAGE PUB invalid message body size {size}")
    ]
    assert c.closed


def test_pub_too_big_default(connect):
    c = connect()
    assert c.request(cmd("PUB", "t") + I32.pack(1048577)) == [
        err("E_BAD_MESSAGE PUB message too big 1048577 > 1048576")
    ]
    assert c.closed


def test_pub_too_big_vs_max_msg_size(make_broker):
    broker = make_broker(max_msg_size=10)
    c = Client(broker)
    assert c.request(pub("t", b"x" * 10)) == [ok()]
    assert c.request(pub("t", b"x" * 11)) == [err("E_BAD_MESSAGE PUB message too big 11 > 10")]
    assert broker.topics["t"].depth() == 1


def test_pub_big_body_in_many_chunks(connect, broker):
    body = bytes(i % 251 for i in range(1024 * 1024))
    data = pub("t", body) + pub("t", b"after")
    c = connect()
    for i in range(0, len(data), 4093):
        c.send(data[i : i + 4093])
    assert c.read() == [ok(), ok()]
    assert queued(broker) == [body, b"after"]


def test_pub_max_size_body_accepted(connect, broker):
    c = connect()
    assert c.request(pub("t", b"z" * 1048576)) == [ok()]
    assert broker.topics["t"].message_bytes == 1048576


def test_pub_responses_in_order(connect, broker):
    c = connect()
    frames = c.request(pub("a", b"1") + pub("b", b"2") + pub("bad!", b"3"))
    assert frames == [ok(), ok(), err('E_BAD_TOPIC PUB topic name "bad!" is not valid')]


# -- DPUB ---------------------------------------------------------------------------------


def test_dpub_ok(connect, broker):
    c = connect()
    assert c.request(dpub("t", 1000, b"later")) == [ok()]
    assert broker.topics["t"].message_count == 1


@pytest.mark.parametrize("line", [cmd("DPUB"), cmd("DPUB", "t")])
def test_dpub_insufficient_params(connect, broker, line):
    c = connect()
    assert c.request(line + sized(b"x")) == [err("E_INVALID DPUB insufficient number of parameters")]
    assert c.closed
    assert broker.topics == {}


def test_dpub_bad_topic(connect, broker):
    c = connect()
    assert c.request(dpub("bad!", 10, b"x")) == [err('E_BAD_TOPIC DPUB topic name "bad!" is not valid')]
    assert broker.topics == {}


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "1s"])
def test_dpub_could_not_parse(connect, value):
    c = connect()
    assert c.request(dpub("t", value, b"x")) == [err(f"E_INVALID DPUB could not parse timeout {value}")]
    assert c.closed


def test_dpub_out_of_range(connect, broker):
    c = connect()
    assert c.request(dpub("t", 3600001, b"x")) == [err("E_INVALID DPUB timeout 3600001 out of range 0-3600000")]
    assert c.closed
    assert "t" not in broker.topics


def test_dpub_range_is_inclusive(connect):
    c = connect()
    assert c.request(dpub("t", 3600000, b"x") + dpub("t", 0, b"y")) == [ok(), ok()]


def test_dpub_range_follows_max_req_timeout(make_broker):
    c = Client(make_broker(max_req_timeout="10s"))
    assert c.request(dpub("t", 10000, b"x")) == [ok()]
    assert c.request(dpub("t", 10001, b"x")) == [err("E_INVALID DPUB timeout 10001 out of range 0-10000")]


def test_dpub_body_errors(make_broker):
    broker = make_broker(max_msg_size=10)
    c = Client(broker)
    assert c.request(cmd("DPUB", "t", 5) + I32.pack(0)) == [err("E_BAD_MESSAGE DPUB invalid message body size 0")]
    c = Client(broker)
    assert c.request(dpub("t", 5, b"x" * 11)) == [err("E_BAD_MESSAGE DPUB message too big 11 > 10")]


def test_dpub_body_in_chunks(connect, broker):
    data = dpub("t", 100, b"d" * 5000)
    c = connect()
    for i in range(0, len(data), 3):
        c.send(data[i : i + 3])
    assert c.read() == [ok()]
    assert queued(broker) == [b"d" * 5000]


# -- MPUB ------------------------------------------------------------------------------------


def test_mpub_ok(connect, broker):
    c = connect()
    bodies = [b"one", b"two", b"three"]
    assert c.request(mpub("t", bodies)) == [ok()]
    topic = broker.topics["t"]
    assert topic.depth() == 3
    assert (topic.message_count, topic.message_bytes) == (3, 11)
    assert queued(broker) == bodies
    assert c.proto.pub_counts == {"t": 3}
    ids = [m.id for m in topic._queue.mem]
    assert len(set(ids)) == 3


def test_mpub_no_topic(connect, broker):
    c = connect()
    assert c.request(cmd("MPUB") + sized(mpub_body([b"x"]))) == [
        err("E_INVALID MPUB insufficient number of parameters")
    ]
    assert broker.topics == {}


def test_mpub_bad_topic_doubles_the_code(connect, broker):
    c = connect()
    assert c.request(mpub("bad!", [b"x"])) == [err('E_BAD_TOPIC E_BAD_TOPIC MPUB topic name "bad!" is not valid')]
    assert c.closed
    assert broker.topics == {}


@pytest.mark.parametrize("size", [0, -1])
def test_mpub_body_size_not_positive(connect, size):
    c = connect()
    assert c.request(cmd("MPUB", "t") + I32.pack(size)) == [err(f"E_BAD_BODY MPUB invalid body size {size}")]
    assert c.closed


def test_mpub_body_too_big(connect):
    c = connect()
    assert c.request(cmd("MPUB", "t") + I32.pack(5242881)) == [err("E_BAD_BODY MPUB body too big 5242881 > 5242880")]
    assert c.closed


def test_mpub_body_too_big_vs_max_body_size(make_broker):
    broker = make_broker(max_body_size=100, max_msg_size=100)
    c = Client(broker)
    ok_body = mpub_body([b"x" * 40, b"y" * 40])  # 4 + 2 * 44 = 92 bytes
    assert c.request(cmd("MPUB", "t") + sized(ok_body)) == [ok()]
    big = mpub_body([b"x" * 45, b"y" * 45])  # 102 bytes
    assert c.request(cmd("MPUB", "t") + sized(big)) == [err("E_BAD_BODY MPUB body too big 102 > 100")]


def test_mpub_creates_topic_before_body_is_validated(connect, broker):
    c = connect()
    assert c.request(cmd("MPUB", "t") + I32.pack(0)) == [err("E_BAD_BODY MPUB invalid body size 0")]
    assert "t" in broker.topics
    assert broker.topics["t"].depth() == 0


@pytest.mark.parametrize("count", [0, -1])
def test_mpub_count_not_positive(connect, count):
    c = connect()
    assert c.request(cmd("MPUB", "t") + sized(I32.pack(count) + sized(b"x"))) == [
        err(f"E_BAD_BODY MPUB invalid message count {count}")
    ]


def test_mpub_count_above_limit(make_broker):
    broker = make_broker(max_body_size=104)  # (104 - 4) / 5 = 20 messages at most
    c = Client(broker)
    assert c.request(cmd("MPUB", "t") + sized(I32.pack(21) + b"\x00" * 96)) == [
        err("E_BAD_BODY MPUB invalid message count 21")
    ]
    c = Client(broker)
    assert c.request(mpub("t", [b"x"] * 20)) == [ok()]


def test_mpub_message_size_zero(connect, broker):
    c = connect()
    body = I32.pack(3) + sized(b"a") + I32.pack(0) + sized(b"c")
    assert c.request(cmd("MPUB", "t") + sized(body)) == [err("E_BAD_MESSAGE MPUB invalid message(1) body size 0")]
    assert c.closed
    assert broker.topics["t"].depth() == 0  # nothing queued: validated before queueing


def test_mpub_message_too_big(make_broker):
    broker = make_broker(max_msg_size=10)
    c = Client(broker)
    assert c.request(mpub("t", [b"ok", b"x" * 11])) == [err("E_BAD_MESSAGE MPUB message too big 11 > 10")]
    assert broker.topics["t"].depth() == 0


def test_mpub_count_larger_than_body(connect):
    c = connect()
    body = I32.pack(3) + sized(b"a") + sized(b"b")
    assert c.request(cmd("MPUB", "t") + sized(body)) == [
        err("E_BAD_MESSAGE MPUB failed to read message(2) body size")
    ]


def test_mpub_message_overruns_body(connect):
    c = connect()
    body = I32.pack(1) + I32.pack(10) + b"abc"
    assert c.request(cmd("MPUB", "t") + sized(body)) == [err("E_BAD_MESSAGE MPUB failed to read message body")]


def test_mpub_body_without_count(connect):
    c = connect()
    assert c.request(cmd("MPUB", "t") + sized(b"\x00\x00")) == [err("E_BAD_BODY MPUB failed to read message count")]


def test_mpub_trailing_bytes_in_body_rejected(connect, broker):
    # mqd frames MPUB by its declared size (nsqd would read the rest as commands).
    c = connect()
    body = mpub_body([b"a"]) + b"NOP\n"
    assert c.request(cmd("MPUB", "t") + sized(body)) == [err(f"E_BAD_BODY MPUB invalid body size {len(body)}")]
    assert broker.topics["t"].depth() == 0


def test_mpub_large_batch_in_many_chunks(connect, broker, clock):
    bodies = [b"%06d" % i + b"." * (i % 97) for i in range(5000)]
    data = mpub("t", bodies) + pub("t", b"tail")
    c = connect()
    for i in range(0, len(data), 1500):
        c.send(data[i : i + 1500])
    clock.advance(0)  # a big MPUB is published a chunk per reactor turn
    assert c.read() == [ok(), ok()]
    assert queued(broker) == bodies + [b"tail"]
    assert broker.topics["t"].message_count == 5001
