"""PUB, MPUB and DPUB: success, every error text, and bodies arriving in pieces."""

from __future__ import annotations

import struct

import pytest

from tests.support.inprocess_broker import scan
from tests.support.v2_client import Client, consumer
from tests.support.v2_frames import cmd, dpub, err, mpub, mpub_body, ok, pub, sized

I32 = struct.Struct(">i")


def queued(broker, topic="t") -> list[bytes]:
    t = broker.topics[topic]
    return [m.body for m in t._queue.mem] + [m.body for m in list(t._queue.backend._items)]


# -- PUB ---------------------------------------------------------------------------------


def test_pub_ok_creates_topic(connect, inproc_broker):
    c = connect()
    assert c.request(pub("t", b"hello")) == [ok()]
    topic = inproc_broker.topics["t"]
    assert topic.depth() == 1
    assert (topic.message_count, topic.message_bytes) == (1, 5)
    assert queued(inproc_broker) == [b"hello"]
    assert c.proto.pub_counts == {"t": 1}


def test_pub_binary_body(connect, inproc_broker):
    body = bytes(range(256)) + b"\n\r\n\x00"
    c = connect()
    assert c.request(pub("t", body)) == [ok()]
    assert queued(inproc_broker) == [body]


@pytest.mark.parametrize("line", [cmd("PUB"), b"PUB\r\n"])
def test_pub_no_topic(connect, inproc_broker, line):
    c = connect()
    assert c.request(line + sized(b"x")) == [err("E_INVALID PUB insufficient number of parameters")]
    assert c.closed
    assert inproc_broker.topics == {}


@pytest.mark.parametrize("topic, quoted", [(b"bad!", '"bad!"'), (b"", '""'), (b"a" * 65, '"' + "a" * 65 + '"')])
def test_pub_bad_topic(connect, inproc_broker, topic, quoted):
    c = connect()
    assert c.request(b"PUB " + topic + b"\n" + sized(b"x")) == [
        err(f"E_BAD_TOPIC PUB topic name {quoted} is not valid")
    ]
    assert c.closed
    assert inproc_broker.topics == {}


@pytest.mark.parametrize("size", [0, -1, -100])
def test_pub_size_not_positive(connect, inproc_broker, size):
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


def test_pub_big_body_in_many_chunks(connect, inproc_broker):
    body = bytes(i % 251 for i in range(1024 * 1024))
    data = pub("t", body) + pub("t", b"after")
    c = connect()
    for i in range(0, len(data), 4093):
        c.send(data[i : i + 4093])
    assert c.read() == [ok(), ok()]
    assert queued(inproc_broker) == [body, b"after"]


def test_pub_max_size_body_accepted(connect, inproc_broker):
    c = connect()
    assert c.request(pub("t", b"z" * 1048576)) == [ok()]
    assert inproc_broker.topics["t"].message_bytes == 1048576


def test_pub_responses_in_order(connect, inproc_broker):
    c = connect()
    frames = c.request(pub("a", b"1") + pub("b", b"2") + pub("bad!", b"3"))
    assert frames == [ok(), ok(), err('E_BAD_TOPIC PUB topic name "bad!" is not valid')]


# -- DPUB ---------------------------------------------------------------------------------


def test_dpub_ok(connect, inproc_broker):
    c = connect()
    assert c.request(dpub("t", 1000, b"later")) == [ok()]
    assert inproc_broker.topics["t"].message_count == 1


@pytest.mark.parametrize("line", [cmd("DPUB"), cmd("DPUB", "t")])
def test_dpub_insufficient_params(connect, inproc_broker, line):
    c = connect()
    assert c.request(line + sized(b"x")) == [err("E_INVALID DPUB insufficient number of parameters")]
    assert c.closed
    assert inproc_broker.topics == {}


def test_dpub_bad_topic(connect, inproc_broker):
    c = connect()
    assert c.request(dpub("bad!", 10, b"x")) == [err('E_BAD_TOPIC DPUB topic name "bad!" is not valid')]
    assert inproc_broker.topics == {}


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "1s"])
def test_dpub_could_not_parse(connect, value):
    c = connect()
    assert c.request(dpub("t", value, b"x")) == [err(f"E_INVALID DPUB could not parse timeout {value}")]
    assert c.closed


def test_dpub_out_of_range(connect, inproc_broker):
    c = connect()
    assert c.request(dpub("t", 3600001, b"x")) == [err("E_INVALID DPUB timeout 3600001 out of range 0-3600000")]
    assert c.closed
    assert "t" not in inproc_broker.topics


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


def test_dpub_body_in_chunks(connect, inproc_broker):
    data = dpub("t", 100, b"d" * 5000)
    c = connect()
    for i in range(0, len(data), 3):
        c.send(data[i : i + 3])
    assert c.read() == [ok()]
    assert queued(inproc_broker) == [b"d" * 5000]


# -- MPUB ------------------------------------------------------------------------------------


def test_mpub_ok(connect, inproc_broker):
    c = connect()
    bodies = [b"one", b"two", b"three"]
    assert c.request(mpub("t", bodies)) == [ok()]
    topic = inproc_broker.topics["t"]
    assert topic.depth() == 3
    assert (topic.message_count, topic.message_bytes) == (3, 11)
    assert queued(inproc_broker) == bodies
    assert c.proto.pub_counts == {"t": 3}
    ids = [m.id for m in topic._queue.mem]
    assert len(set(ids)) == 3


def test_mpub_no_topic(connect, inproc_broker):
    c = connect()
    assert c.request(cmd("MPUB") + sized(mpub_body([b"x"]))) == [
        err("E_INVALID MPUB insufficient number of parameters")
    ]
    assert inproc_broker.topics == {}


def test_mpub_bad_topic_doubles_the_code(connect, inproc_broker):
    c = connect()
    assert c.request(mpub("bad!", [b"x"])) == [err('E_BAD_TOPIC E_BAD_TOPIC MPUB topic name "bad!" is not valid')]
    assert c.closed
    assert inproc_broker.topics == {}


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


def test_mpub_creates_topic_before_body_is_validated(connect, inproc_broker):
    c = connect()
    assert c.request(cmd("MPUB", "t") + I32.pack(0)) == [err("E_BAD_BODY MPUB invalid body size 0")]
    assert "t" in inproc_broker.topics
    assert inproc_broker.topics["t"].depth() == 0


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


def test_mpub_message_size_zero(connect, inproc_broker):
    c = connect()
    body = I32.pack(3) + sized(b"a") + I32.pack(0) + sized(b"c")
    assert c.request(cmd("MPUB", "t") + sized(body)) == [err("E_BAD_MESSAGE MPUB invalid message(1) body size 0")]
    assert c.closed
    assert inproc_broker.topics["t"].depth() == 0  # nothing queued: validated before queueing


def test_mpub_message_too_big(make_broker):
    broker = make_broker(max_msg_size=10)
    c = Client(broker)
    assert c.request(mpub("t", [b"ok", b"x" * 11])) == [err("E_BAD_MESSAGE MPUB message too big 11 > 10")]
    assert broker.topics["t"].depth() == 0


def test_mpub_count_larger_than_body(connect, inproc_broker):
    # nsqd reads the messages from the stream, not from the declared body:
    # it waits for the third message (it fails only if the stream ends).
    c = connect()
    body = I32.pack(3) + sized(b"a") + sized(b"b")
    assert c.request(cmd("MPUB", "t") + sized(body)) == []
    assert not c.closed
    assert c.request(sized(b"c")) == [ok()]
    assert queued(inproc_broker) == [b"a", b"b", b"c"]


def test_mpub_message_overruns_body(connect, inproc_broker):
    c = connect()
    body = I32.pack(1) + I32.pack(10) + b"abc"
    assert c.request(cmd("MPUB", "t") + sized(body)) == []
    assert not c.closed
    assert c.request(b"defghij") == [ok()]
    assert queued(inproc_broker) == [b"abcdefghij"]


def test_mpub_body_without_count(connect, inproc_broker):
    # A declared size of 1-3 is in range for nsqd (it only refuses <= 0):
    # the count is read from the stream.
    c = connect()
    assert c.request(cmd("MPUB", "t") + sized(b"\x00\x00")) == []
    assert not c.closed
    assert c.request(b"\x00\x01" + sized(b"x")) == [ok()]
    assert queued(inproc_broker) == [b"x"]


def test_mpub_bytes_inside_declared_size_after_the_messages_are_commands(connect, inproc_broker):
    c = connect()
    body = mpub_body([b"a"]) + pub("t", b"b")
    assert c.request(cmd("MPUB", "t") + sized(body)) == [ok(), ok()]
    assert queued(inproc_broker) == [b"a", b"b"]


def messages_only(bodies: list[bytes]) -> bytes:
    """MPUB as squeaky and npm's nsq clients send it: the declared size counts the messages' bytes only."""
    return cmd("MPUB", "t") + I32.pack(sum(map(len, bodies))) + mpub_body(bodies)


def test_mpub_declared_size_of_message_bytes_only(connect, inproc_broker):
    c = connect()
    bodies = [b"hello", b"world", b"!"]
    assert c.request(messages_only(bodies) + pub("t", b"tail")) == [ok(), ok()]
    assert queued(inproc_broker) == bodies + [b"tail"]
    assert c.proto.pub_counts == {"t": 4}


@pytest.mark.parametrize("form", ["whole", "messages"])
def test_mpub_both_size_forms_byte_by_byte(connect, inproc_broker, form):
    bodies = [b"m%d" % i for i in range(30)]
    data = mpub("t", bodies) if form == "whole" else messages_only(bodies)
    c = connect()
    c.send_bytewise(data + pub("t", b"tail"))
    assert c.read() == [ok(), ok()]
    assert queued(inproc_broker) == bodies + [b"tail"]


@pytest.mark.parametrize("declared", [1, 2, 3, 4])
def test_mpub_declared_size_below_the_count_size(connect, inproc_broker, declared):
    c = connect()
    assert c.request(cmd("MPUB", "t") + I32.pack(declared) + mpub_body([b"a", b"b"])) == [ok()]
    assert queued(inproc_broker) == [b"a", b"b"]


def test_mpub_declared_larger_than_what_follows_is_answered_once_the_messages_are_in(connect, inproc_broker):
    c = connect()
    assert c.request(cmd("MPUB", "t") + I32.pack(5242880) + mpub_body([b"a"])) == [ok()]
    assert c.request(pub("t", b"b")) == [ok()]
    assert queued(inproc_broker) == [b"a", b"b"]


def test_mpub_bad_message_arriving_later_publishes_nothing(connect, inproc_broker):
    c = connect()
    first = cmd("MPUB", "t") + sized(mpub_body([b"a", b"b", b"c"]))[:4] + I32.pack(3) + sized(b"a")
    assert c.request(first) == []
    assert c.request(I32.pack(0)) == [err("E_BAD_MESSAGE MPUB invalid message(1) body size 0")]
    assert c.closed
    assert inproc_broker.topics["t"].depth() == 0


def test_mpub_messages_over_max_body_size_refused_before_they_arrive(make_broker):
    # mqd's bound on a pending MPUB (nsqd has none but count x max-msg-size):
    # the messages' own bytes at most max-body-size; 4 + 4 x count + 100 here.
    broker = make_broker(max_body_size=100, max_msg_size=100)
    c = Client(broker)
    assert c.request(cmd("MPUB", "t") + I32.pack(4) + mpub_body([b"x" * 50, b"y" * 50])) == [ok()]
    c = Client(broker)
    head = cmd("MPUB", "t") + I32.pack(4) + I32.pack(2) + sized(b"x" * 60) + I32.pack(41)
    assert c.request(head) == [err("E_BAD_BODY MPUB body too big 113 > 112")]
    assert c.closed
    assert broker.topics["t"].depth() == 2  # the first client's


def test_mpub_message_bytes_form_at_max_body_size_is_not_cut_off(connect, inproc_broker, clock):
    # Over max-body-size bytes follow the declared size: the input kept
    # meanwhile must not trip the connection's input bound.
    bodies = [b"%07d" % i + b"." * 45 for i in range(100_000)]  # 5.2 MB of messages, 5.6 MB in all
    data = messages_only(bodies)
    assert sum(map(len, bodies)) <= 5242880 < len(data) - 65536
    c = connect()
    for i in range(0, len(data), 65536):
        c.send(data[i : i + 65536])
    assert not c.closed
    clock.advance(0)  # a big MPUB is published a chunk per reactor turn
    assert c.read() == [ok()]
    assert inproc_broker.topics["t"].message_count == 100_000


def test_mpub_large_batch_in_many_chunks(connect, inproc_broker, clock):
    bodies = [b"%06d" % i + b"." * (i % 97) for i in range(5000)]
    data = mpub("t", bodies) + pub("t", b"tail")
    c = connect()
    for i in range(0, len(data), 1500):
        c.send(data[i : i + 1500])
    clock.advance(0)  # a big MPUB is published a chunk per reactor turn
    assert c.read() == [ok(), ok()]
    assert queued(inproc_broker) == bodies + [b"tail"]
    assert inproc_broker.topics["t"].message_count == 5001


def test_dpub_range_follows_max_defer_timeout(make_broker):
    c = Client(make_broker(max_req_timeout="10s", max_defer_timeout="20s"))
    assert c.request(dpub("t", 20000, b"x")) == [ok()]
    assert c.request(dpub("t", 20001, b"x")) == [err("E_INVALID DPUB timeout 20001 out of range 0-20000")]
    assert c.closed


def test_req_stays_limited_by_max_req_timeout(make_broker):
    """--max-defer-timeout is for publishes only: a REQ past max-req-timeout is still clamped to it."""
    broker = make_broker(max_req_timeout="10s", max_defer_timeout="1h")
    c = consumer(broker)
    Client(broker).request(pub("t", b"x"))
    (msg,) = c.messages()
    c.req(msg, 60000)
    channel = broker.topics["t"].channels["c"]
    assert channel.deferred_count() == 1
    broker.clock.advance(10)
    scan(broker)
    assert [m.body for m in c.messages()] == [b"x"]
