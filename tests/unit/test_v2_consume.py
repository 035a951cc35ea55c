"""SUB, RDY, FIN, REQ, TOUCH, CLS and NOP: success paths and every error nsqd gives."""

from __future__ import annotations

import pytest

from mqd.nsqd.protocol.v2 import STATE_CLOSING, STATE_SUBSCRIBED
from tests.support.inprocess_broker import scan
from tests.support.v2_client import Client
from tests.support.v2_frames import CLOSE_WAIT, Msg, cmd, err, ok, pub

UNKNOWN_ID = b"0123456789abcdef"


@pytest.fixture
def consumer(connect):
    """A client subscribed to t/c with RDY 0."""
    c = connect()
    c.sub("t", "c")
    return c


# -- SUB ---------------------------------------------------------------------------


def test_sub_ok(connect, inproc_broker):
    c = connect()
    assert c.request(cmd("SUB", "t", "c")) == [ok()]
    assert c.proto.state == STATE_SUBSCRIBED
    channel = inproc_broker.topics["t"].channels["c"]
    assert channel.clients == [c.proto]
    assert c.proto.channel is channel
    assert c.proto.ready_count == 0


def test_sub_extra_params_ignored(connect, inproc_broker):
    c = connect()
    assert c.request(cmd("SUB", "t", "c", "extra", "more")) == [ok()]
    assert list(inproc_broker.topics["t"].channels) == ["c"]


@pytest.mark.parametrize("line", [cmd("SUB"), cmd("SUB", "t")])
def test_sub_insufficient_params(connect, inproc_broker, line):
    c = connect()
    assert c.request(line) == [err("E_INVALID SUB insufficient number of parameters")]
    assert c.closed
    assert inproc_broker.topics == {}


@pytest.mark.parametrize(
    "topic, quoted",
    [
        (b"bad!", '"bad!"'),
        (b"a" * 65, '"' + "a" * 65 + '"'),
        (b"t#ephemeral#ephemeral", '"t#ephemeral#ephemeral"'),
        (b"sp\tace", '"sp\\tace"'),
        (b"quo\"te", '"quo\\"te"'),
        (b"\xff", '"\\xff"'),
        (b"caf\xc3\xa9", '"café"'),
    ],
)
def test_sub_bad_topic(connect, inproc_broker, topic, quoted):
    c = connect()
    assert c.request(b"SUB " + topic + b" c\n") == [err(f"E_BAD_TOPIC SUB topic name {quoted} is not valid")]
    assert c.closed
    assert inproc_broker.topics == {}


def test_sub_bad_channel(connect, inproc_broker):
    c = connect()
    assert c.request(cmd("SUB", "t", "bad!")) == [err('E_BAD_CHANNEL SUB channel name "bad!" is not valid')]
    assert c.closed
    assert inproc_broker.topics == {}


def test_sub_topic_checked_before_channel(connect):
    c = connect()
    assert c.request(cmd("SUB", "bad!", "bad?")) == [err('E_BAD_TOPIC SUB topic name "bad!" is not valid')]


def test_sub_name_limits(connect, inproc_broker):
    name = "a" * 64
    c = connect()
    assert c.request(cmd("SUB", name, "x.y_z-1")) == [ok()]
    c = connect()
    assert c.request(cmd("SUB", "t#ephemeral", "c#ephemeral")) == [ok()]
    assert set(inproc_broker.topics) == {name, "t#ephemeral"}


def test_second_sub_is_fatal(consumer):
    assert consumer.request(cmd("SUB", "t", "other")) == [err("E_INVALID cannot SUB in current state")]
    assert consumer.closed


def test_sub_after_cls_is_fatal(consumer):
    assert consumer.request(cmd("CLS")) == [CLOSE_WAIT]
    assert consumer.request(cmd("SUB", "t", "c")) == [err("E_INVALID cannot SUB in current state")]


def test_max_channel_consumers(make_broker):
    broker = make_broker(max_channel_consumers=1)
    a = Client(broker)
    a.sub()
    b = Client(broker)
    assert b.request(cmd("SUB", "t", "c")) == [
        err("E_SUB_FAILED SUB failed consumers for t:c exceeds limit of 1")
    ]
    assert b.closed
    # Another channel has its own limit, and a freed slot can be taken again.
    Client(broker).sub("t", "other")
    a.lose()
    Client(broker).sub("t", "c")


def test_subscribed_connection_may_publish(consumer, inproc_broker):
    assert consumer.request(pub("other", b"x")) == [ok()]
    assert inproc_broker.topics["other"].depth() == 1


# -- RDY ---------------------------------------------------------------------------


def test_rdy_before_sub(connect):
    c = connect()
    assert c.request(cmd("RDY", 1)) == [err("E_INVALID cannot RDY in current state")]
    assert c.closed


def test_rdy_has_no_response(consumer):
    assert consumer.request(cmd("RDY", 10)) == []
    assert consumer.proto.ready_count == 10


def test_rdy_without_count_means_one(consumer, publish):
    publish(b"1", b"2")
    consumer.send(cmd("RDY"))
    assert [m.body for m in consumer.messages()] == [b"1"]
    assert consumer.proto.ready_count == 1


@pytest.mark.parametrize("count", ["abc", "-1", "+1", "1.5", "0x10", "１", "1e3"])
def test_rdy_could_not_parse(consumer, count):
    assert consumer.request(f"RDY {count}\n".encode()) == [err(f"E_INVALID RDY could not parse count {count}")]
    assert consumer.closed


def test_rdy_out_of_range(consumer):
    assert consumer.request(cmd("RDY", 2501)) == [err("E_INVALID RDY count 2501 out of range 0-2500")]
    assert consumer.closed


def test_rdy_empty_count_is_zero(consumer):
    # nsqd's ByteToBase10 reads an empty string as 0 (consecutive spaces).
    consumer.send(cmd("RDY", 5))
    assert consumer.request(b"RDY  5\n") == []
    assert consumer.proto.ready_count == 0


def test_rdy_max_accepted(consumer):
    assert consumer.request(cmd("RDY", 2500)) == []
    assert not consumer.closed


def test_rdy_range_follows_max_rdy_count(make_broker):
    c = Client(make_broker(max_rdy_count=100))
    c.sub()
    assert c.request(cmd("RDY", 100)) == []
    assert c.request(cmd("RDY", 101)) == [err("E_INVALID RDY count 101 out of range 0-100")]


def test_rdy_zero_accepted(consumer, publish):
    publish(b"x")
    assert consumer.request(cmd("RDY", 0)) == []
    assert not consumer.closed


# -- FIN ----------------------------------------------------------------------------


@pytest.mark.parametrize("verb, args", [("FIN", [UNKNOWN_ID]), ("REQ", [UNKNOWN_ID, 0]), ("TOUCH", [UNKNOWN_ID]),
                                        ("FIN", []), ("REQ", []), ("TOUCH", [])])
def test_message_commands_before_sub(connect, verb, args):
    c = connect()
    assert c.request(cmd(verb, *args)) == [err(f"E_INVALID cannot {verb} in current state")]
    assert c.closed


@pytest.mark.parametrize(
    "line, text",
    [
        (cmd("FIN"), "E_INVALID FIN insufficient number of params"),
        (cmd("TOUCH"), "E_INVALID TOUCH insufficient number of params"),
        (cmd("REQ"), "E_INVALID REQ insufficient number of params"),
        (cmd("REQ", UNKNOWN_ID), "E_INVALID REQ insufficient number of params"),
        (cmd("FIN", "abc"), "E_INVALID invalid message ID"),
        (cmd("FIN", UNKNOWN_ID + b"0"), "E_INVALID invalid message ID"),
        (cmd("FIN", ""), "E_INVALID invalid message ID"),
        (cmd("TOUCH", "abc"), "E_INVALID invalid message ID"),
        (cmd("REQ", "abc", 0), "E_INVALID invalid message ID"),
        (cmd("REQ", UNKNOWN_ID, "abc"), "E_INVALID REQ could not parse timeout abc"),
        (cmd("REQ", UNKNOWN_ID, "-1"), "E_INVALID REQ could not parse timeout -1"),
        (cmd("REQ", UNKNOWN_ID, "1.5"), "E_INVALID REQ could not parse timeout 1.5"),
    ],
)
def test_message_command_fatal_errors(consumer, line, text):
    assert consumer.request(line) == [err(text)]
    assert consumer.closed


@pytest.mark.parametrize("verb, args", [("FIN", []), ("TOUCH", []), ("REQ", [0]), ("REQ", [1000])])
def test_unknown_id_is_not_fatal(consumer, verb, args):
    assert consumer.request(cmd(verb, UNKNOWN_ID, *args)) == [
        err(f"E_{verb}_FAILED {verb} {UNKNOWN_ID.decode()} failed ID not in flight")
    ]
    assert not consumer.closed
    assert consumer.request(cmd("RDY", 1) + cmd("NOP")) == []
    assert consumer.proto.ready_count == 1


@pytest.mark.parametrize("verb, args", [("FIN", []), ("TOUCH", []), ("REQ", [0])])
def test_not_owner_is_not_fatal(connect, publish, verb, args):
    a = connect()
    a.sub(rdy=1)
    b = connect()
    b.sub(rdy=1)
    publish(b"x")
    msgs = a.messages() + b.messages()
    assert len(msgs) == 1
    owner, other = (a, b) if a.proto.in_flight_count else (b, a)
    m = msgs[0]
    assert other.request(cmd(verb, m.id, *args)) == [
        err(f"E_{verb}_FAILED {verb} {m.id.decode()} failed client does not own message")
    ]
    assert not other.closed
    assert owner.proto.in_flight_count == 1
    owner.fin(m)
    assert owner.raw() == b""
    assert owner.proto.in_flight_count == 0


def test_fin_success(consumer, publish, inproc_broker):
    publish(b"x")
    consumer.send(cmd("RDY", 1))
    [m] = consumer.messages()
    channel = inproc_broker.topics["t"].channels["c"]
    assert channel.in_flight_count() == 1
    assert consumer.request(cmd("FIN", m.id)) == []
    assert channel.in_flight_count() == 0
    assert consumer.proto.in_flight_count == 0
    assert consumer.proto.finish_count == 1
    assert consumer.proto.message_count == 1
    assert channel.depth() == 0
    assert consumer.request(cmd("FIN", m.id)) == [
        err(f"E_FIN_FAILED FIN {m.id.decode()} failed ID not in flight")
    ]
    assert not consumer.closed


def test_fin_batch_in_one_chunk(consumer, publish, inproc_broker):
    publish(*[b"%d" % i for i in range(6)])
    consumer.send(cmd("RDY", 3))
    first = consumer.messages()
    assert [m.body for m in first] == [b"0", b"1", b"2"]
    consumer.send(b"".join(cmd("FIN", m.id) for m in first))
    assert [m.body for m in consumer.messages()] == [b"3", b"4", b"5"]
    assert consumer.proto.finish_count == 3


# -- REQ ---------------------------------------------------------------------------


def test_req_zero_redelivers_at_once(consumer, publish, inproc_broker):
    publish(b"x")
    consumer.send(cmd("RDY", 1))
    [m] = consumer.messages()
    assert consumer.request(cmd("REQ", m.id, 0)) == [Msg(m.timestamp, 2, m.id, b"x")]
    channel = inproc_broker.topics["t"].channels["c"]
    assert channel.requeue_count == 1
    assert consumer.proto.requeue_count == 1
    assert channel.in_flight_count() == 1


def test_req_goes_to_tail(consumer, publish):
    publish(b"1", b"2", b"3")
    consumer.send(cmd("RDY", 1))
    [m1] = consumer.messages()
    consumer.req(m1)
    assert [m.body for m in consumer.messages()] == [b"2"]


def test_req_timeout_clamped_to_max(make_broker, clock):
    broker = make_broker(max_req_timeout="10s")
    c = Client(broker)
    c.sub(rdy=1)
    Client(broker).send(pub("t", b"x"))
    [m] = c.messages()
    assert c.request(cmd("REQ", m.id, 3_600_000)) == []
    assert not c.closed
    channel = broker.topics["t"].channels["c"]
    assert channel.deferred_count() == 1
    clock.advance(9.999)
    scan(broker)
    assert c.raw() == b""
    clock.advance(0.001)
    scan(broker)
    assert c.messages() == [Msg(m.timestamp, 2, m.id, b"x")]
    assert channel.deferred_count() == 0


def test_req_default_max_is_one_hour(consumer, publish, inproc_broker, clock):
    publish(b"x")
    consumer.send(cmd("RDY", 1))
    [m] = consumer.messages()
    consumer.send(cmd("REQ", m.id, 3_600_001))
    assert consumer.raw() == b""
    channel = inproc_broker.topics["t"].channels["c"]
    assert channel.peek("deferred", 1)[0][1] == pytest.approx(clock.seconds() + 3600)


# -- TOUCH ------------------------------------------------------------------------------


def test_touch_success_has_no_response(consumer, publish):
    publish(b"x")
    consumer.send(cmd("RDY", 1))
    [m] = consumer.messages()
    assert consumer.request(cmd("TOUCH", m.id)) == []
    assert consumer.proto.in_flight_count == 1


# -- CLS -----------------------------------------------------------------------------------


def test_cls_before_sub(connect):
    c = connect()
    assert c.request(cmd("CLS")) == [err("E_INVALID cannot CLS in current state")]
    assert c.closed


def test_cls_then_rdy_ignored_fin_allowed(consumer, publish, inproc_broker):
    publish(b"1", b"2", b"3")
    consumer.send(cmd("RDY", 2))
    m1, m2 = consumer.messages()
    assert consumer.request(cmd("CLS")) == [CLOSE_WAIT]
    assert consumer.proto.state == STATE_CLOSING
    assert consumer.proto.ready_count == 0
    assert not consumer.closed
    # RDY is silently ignored, even out of range values.
    assert consumer.request(cmd("RDY", 100)) == []
    assert consumer.request(cmd("RDY", 999999)) == []
    assert consumer.proto.ready_count == 0
    # In-flight messages can still be finished and requeued; nothing new is sent.
    assert consumer.request(cmd("FIN", m1.id)) == []
    assert consumer.request(cmd("TOUCH", m2.id)) == []
    assert consumer.request(cmd("REQ", m2.id, 0)) == []
    publish(b"4")
    assert consumer.raw() == b""
    channel = inproc_broker.topics["t"].channels["c"]
    assert channel.in_flight_count() == 0
    assert channel.depth() == 3
    assert consumer.request(cmd("FIN", UNKNOWN_ID)) == [
        err(f"E_FIN_FAILED FIN {UNKNOWN_ID.decode()} failed ID not in flight")
    ]
    assert consumer.request(cmd("CLS")) == [err("E_INVALID cannot CLS in current state")]
    assert consumer.closed


def test_cls_validation_errors_still_fatal(consumer):
    consumer.send(cmd("CLS"))
    consumer.read()
    assert consumer.request(cmd("FIN", "short")) == [err("E_INVALID invalid message ID")]
    assert consumer.closed


# -- NOP ----------------------------------------------------------------------------------------


def test_nop_in_every_state(connect):
    c = connect()
    assert c.request(cmd("NOP")) == []
    c.sub()
    assert c.request(cmd("NOP")) == []
    c.send(cmd("CLS"))
    c.read()
    assert c.request(cmd("NOP") + cmd("NOP", "ignored", "args")) == []
    assert not c.closed


def test_fin_run_with_failures_between_answers_each_in_place(consumer, publish, inproc_broker):
    """One read alternating FINs that succeed and fail: every failure gets its
    error where it stood, every success counts, and the deliveries the
    successes made room for come before the first error."""
    publish(*[b"%d" % i for i in range(5)])
    consumer.send(cmd("RDY", 3))
    first = consumer.messages()
    bad = [b"%016d" % i for i in range(3)]
    stream = b"".join(cmd("FIN", m.id) + cmd("FIN", b) for m, b in zip(first, bad, strict=True))
    frames = consumer.request(stream)
    assert frames == [
        Msg(first[0].timestamp, 1, frames[0].id, b"3"),
        err(f"E_FIN_FAILED FIN {bad[0].decode()} failed ID not in flight"),
        Msg(first[0].timestamp, 1, frames[2].id, b"4"),
        err(f"E_FIN_FAILED FIN {bad[1].decode()} failed ID not in flight"),
        err(f"E_FIN_FAILED FIN {bad[2].decode()} failed ID not in flight"),
    ]
    assert consumer.proto.finish_count == 3
    assert not consumer.closed
