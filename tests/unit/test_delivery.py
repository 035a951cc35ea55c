"""Delivery semantics: RDY windows, attempts, timeouts, TOUCH, deferral, fan-out, ephemerality, sampling."""

from __future__ import annotations

import random

from tests.support.inprocess_broker import scan
from tests.support.v2_client import Client
from tests.support.v2_frames import Msg, cmd, dpub, err, identify, mpub, ok, pub


def bodies(msgs) -> list[bytes]:
    return [m.body for m in msgs]


def channel_of(broker, topic="t", channel="c"):
    return broker.topics[topic].channels[channel]


def one_in_flight(broker) -> tuple[Client, Msg]:
    """A client of t/c with RDY 1, and the one message "x" it was sent."""
    c = Client(broker)
    c.sub(rdy=1)
    Client(broker).send(pub("t", b"x"))
    [m] = c.messages()
    return c, m


# -- RDY window -------------------------------------------------------------------------


def test_nothing_flows_before_rdy(connect, publish):
    c = connect()
    c.sub()
    publish(b"1", b"2")
    assert c.raw() == b""


def test_rdy_is_a_window(connect, publish, inproc_broker):
    c = connect()
    c.sub()
    publish(*[b"%d" % i for i in range(6)])
    c.send(cmd("RDY", 2))
    m0, m1 = c.messages()
    assert bodies([m0, m1]) == [b"0", b"1"]
    assert c.raw() == b""
    # FIN frees a slot: one more flows without a new RDY.
    c.fin(m0)
    [m2] = c.messages()
    assert m2.body == b"2"
    assert c.proto.in_flight_count == 2
    # RDY 0 stops new deliveries; in-flight messages stay in flight.
    c.send(cmd("RDY", 0))
    c.fin(m1)
    assert c.raw() == b""
    assert channel_of(inproc_broker).in_flight_count() == 1
    publish(b"late")
    assert c.raw() == b""
    # A bigger window lets the rest flow at once.
    c.send(cmd("RDY", 10))
    assert bodies(c.messages()) == [b"3", b"4", b"5", b"late"]
    assert c.proto.in_flight_count == 5


def test_lowering_rdy_below_in_flight(connect, publish):
    c = connect()
    c.sub(rdy=3)
    publish(b"1", b"2", b"3", b"4")
    msgs = c.messages()
    assert len(msgs) == 3
    c.send(cmd("RDY", 1))
    c.fin(msgs[0])
    c.fin(msgs[1])
    assert c.raw() == b""  # 1 in flight, RDY 1: still full
    c.fin(msgs[2])
    assert bodies(c.messages()) == [b"4"]


def test_message_frame_fields(connect, publish, clock):
    c = connect()
    c.sub(rdy=1)
    publish(b"payload")
    [m] = c.messages()
    assert m.timestamp == int(clock.seconds() * 1e9)
    assert m.attempts == 1
    assert len(m.id) == 16
    int(m.id, 16)


# -- attempts and requeue -------------------------------------------------------------------


def test_attempts_increment_on_each_redelivery(connect, publish, inproc_broker):
    c = connect()
    c.sub(rdy=1)
    publish(b"x")
    [m] = c.messages()
    seen = [m.attempts]
    for _ in range(4):
        c.req(m)
        [m2] = c.messages()
        assert (m2.id, m2.body, m2.timestamp) == (m.id, m.body, m.timestamp)
        seen.append(m2.attempts)
    assert seen == [1, 2, 3, 4, 5]
    assert channel_of(inproc_broker).requeue_count == 4
    assert c.proto.requeue_count == 4


def test_req_with_delay_is_deferred(connect, publish, inproc_broker, clock):
    c = connect()
    c.sub(rdy=1)
    publish(b"x")
    [m] = c.messages()
    c.req(m, 5000)
    channel = channel_of(inproc_broker)
    assert (channel.deferred_count(), channel.in_flight_count(), channel.depth()) == (1, 0, 0)
    assert c.proto.in_flight_count == 0
    clock.advance(4.999)
    assert scan(inproc_broker) == 0
    assert c.raw() == b""
    clock.advance(0.001)
    assert scan(inproc_broker) == 1
    assert c.messages() == [Msg(m.timestamp, 2, m.id, b"x")]
    assert channel.deferred_count() == 0


def test_req_delay_frees_the_slot_for_others(connect, publish):
    c = connect()
    c.sub(rdy=1)
    publish(b"1", b"2")
    [m1] = c.messages()
    c.req(m1, 60000)
    assert bodies(c.messages()) == [b"2"]


# -- in-flight timeout ---------------------------------------------------------------------------


def test_msg_timeout_requeues(make_broker, clock):
    broker = make_broker(msg_timeout="2s")
    c, m = one_in_flight(broker)
    channel = channel_of(broker)
    clock.advance(1.999)
    assert scan(broker) == 0
    assert c.raw() == b""
    clock.advance(0.001)
    assert scan(broker) == 1
    assert channel.timeout_count == 1
    assert channel.requeue_count == 0
    # The freed slot takes it again at once, one attempt later.
    assert c.messages() == [Msg(m.timestamp, 2, m.id, b"x")]
    assert c.proto.in_flight_count == 1


def test_fin_after_timeout_fails(make_broker, clock):
    broker = make_broker(msg_timeout="2s")
    c, m = one_in_flight(broker)
    c.send(cmd("RDY", 0))
    clock.advance(2)
    scan(broker)
    channel = channel_of(broker)
    assert (channel.timeout_count, channel.depth(), channel.in_flight_count()) == (1, 1, 0)
    assert c.proto.in_flight_count == 0
    assert c.request(cmd("FIN", m.id)) == [err(f"E_FIN_FAILED FIN {m.id.decode()} failed ID not in flight")]
    assert not c.closed


def test_identify_msg_timeout_applies(connect, publish, inproc_broker, clock):
    c = connect()
    assert c.request(identify(msg_timeout=1000)) == [ok()]
    c.sub(rdy=1)
    other = connect()
    other.sub(rdy=0)
    publish(b"x")
    [m] = c.messages()
    clock.advance(0.999)
    scan(inproc_broker)
    assert c.raw() == b""
    clock.advance(0.001)
    scan(inproc_broker)
    assert c.messages()[0].attempts == 2
    assert channel_of(inproc_broker).timeout_count == 1


def test_touch_postpones_timeout(make_broker, clock):
    broker = make_broker(msg_timeout="10s", max_msg_timeout="25s")
    c, m = one_in_flight(broker)
    clock.advance(8)
    c.touch(m)  # deadline now 18
    clock.advance(2)  # t = 10, the original deadline
    assert scan(broker) == 0
    clock.advance(6)  # t = 16
    c.touch(m)  # 26 would pass delivery + max-msg-timeout: 25
    clock.advance(8.999)  # t = 24.999
    assert scan(broker) == 0
    assert c.raw() == b""
    clock.advance(0.001)  # t = 25
    assert scan(broker) == 1
    assert c.messages() == [Msg(m.timestamp, 2, m.id, b"x")]
    assert channel_of(broker).timeout_count == 1


def test_touch_never_moves_deadline_earlier_than_max(make_broker, clock):
    broker = make_broker(msg_timeout="10s", max_msg_timeout="12s")
    c, m = one_in_flight(broker)
    for _ in range(5):
        clock.advance(2)
        c.touch(m)
        assert c.raw() == b""
    clock.advance(1.999)  # t = 11.999
    assert scan(broker) == 0
    clock.advance(0.001)  # t = 12
    assert scan(broker) == 1


def test_many_timeouts_in_one_scan(make_broker, clock):
    broker = make_broker(msg_timeout="1s")
    c = Client(broker)
    c.sub(rdy=100)
    Client(broker).send(mpub("t", [b"%d" % i for i in range(100)]))
    assert len(c.messages()) == 100
    c.send(cmd("RDY", 0))
    clock.advance(1)
    scan(broker)
    channel = channel_of(broker)
    assert (channel.timeout_count, channel.depth(), channel.in_flight_count()) == (100, 100, 0)
    c.send(cmd("RDY", 100))
    assert [m.body for m in c.messages()] == [b"%d" % i for i in range(100)]


# -- DPUB ------------------------------------------------------------------------------------------


def test_dpub_delivered_after_delay(connect, inproc_broker, clock):
    c = connect()
    c.sub(rdy=5)
    p = connect()
    assert p.request(dpub("t", 2000, b"later") + pub("t", b"now")) == [ok(), ok()]
    assert bodies(c.messages()) == [b"now"]
    channel = channel_of(inproc_broker)
    assert (channel.deferred_count(), channel.depth(), channel.message_count) == (1, 0, 2)
    clock.advance(1.999)
    scan(inproc_broker)
    assert c.raw() == b""
    clock.advance(0.001)
    scan(inproc_broker)
    [m] = c.messages()
    assert (m.body, m.attempts) == (b"later", 1)
    assert channel.deferred_count() == 0


def test_dpub_zero_is_immediate(connect):
    c = connect()
    c.sub(rdy=1)
    assert connect().request(dpub("t", 0, b"x")) == [ok()]
    assert bodies(c.messages()) == [b"x"]


def test_dpub_to_topic_without_channel_keeps_due_time(connect, inproc_broker, clock):
    p = connect()
    assert p.request(dpub("t", 2000, b"later")) == [ok()]
    assert inproc_broker.topics["t"].depth() == 1
    clock.advance(1)
    c = connect()
    c.sub(rdy=1)
    assert c.raw() == b""
    assert channel_of(inproc_broker).deferred_count() == 1
    clock.advance(0.999)
    scan(inproc_broker)
    assert c.raw() == b""
    clock.advance(0.001)
    scan(inproc_broker)
    assert bodies(c.messages()) == [b"later"]


def test_dpub_reaches_every_channel(connect, inproc_broker, clock):
    a = connect()
    a.sub("t", "a", rdy=1)
    b = connect()
    b.sub("t", "b", rdy=1)
    assert connect().request(dpub("t", 1000, b"x")) == [ok()]
    clock.advance(1)
    scan(inproc_broker)
    [ma], [mb] = a.messages(), b.messages()
    assert ma.id == mb.id


# -- fan-out and load-balancing ------------------------------------------------------------------------


def test_every_channel_gets_every_message(connect, publish):
    a = connect()
    a.sub("t", "a", rdy=10)
    b = connect()
    b.sub("t", "b", rdy=10)
    publish(b"1")
    publish(b"2", b"3")
    ma, mb = a.messages(), b.messages()
    assert bodies(ma) == bodies(mb) == [b"1", b"2", b"3"]
    assert [m.id for m in ma] == [m.id for m in mb]
    assert [m.timestamp for m in ma] == [m.timestamp for m in mb]
    # Each copy has its own attempts: a delivery on one channel is not
    # inherited by the next channel's copy.
    assert [m.attempts for m in ma + mb] == [1] * 6
    a.req(ma[0])
    assert a.messages()[0].attempts == 2
    b.fin(mb[0])
    assert b.raw() == b""


def test_a_fin_on_one_channel_leaves_the_other_channels_copy_in_flight(connect, publish, inproc_broker):
    a = connect()
    a.sub("t", "a", rdy=10)
    b = connect()
    b.sub("t", "b", rdy=10)
    publish(b"1", b"2")
    ma, mb = a.messages(), b.messages()
    for m in ma:
        a.fin(m)
    assert a.raw() == b""
    assert (channel_of(inproc_broker, channel="a").in_flight_count(),
            channel_of(inproc_broker, channel="b").in_flight_count()) == (0, 2)
    a.fin(ma[0])  # gone from a, whatever b still holds under the same id
    assert b"E_FIN_FAILED" in a.raw()
    for m in reversed(mb):
        b.fin(m)
    assert b.raw() == b""
    assert channel_of(inproc_broker, channel="b").in_flight_count() == 0


def test_clients_of_a_channel_share_its_messages(connect, publish, inproc_broker):
    a = connect()
    a.sub(rdy=200)
    b = connect()
    b.sub(rdy=200)
    for i in range(50):
        publish(b"single-%d" % i)
    publish(*[b"batch-%d" % i for i in range(150)])
    got_a, got_b = a.messages(), b.messages()
    ids_a, ids_b = {m.id for m in got_a}, {m.id for m in got_b}
    assert not ids_a & ids_b
    assert len(got_a) + len(got_b) == 200
    assert len(ids_a | ids_b) == 200
    assert 70 <= len(got_a) <= 130
    assert channel_of(inproc_broker).in_flight_count() == 200


def test_shared_channel_respects_each_window(connect, publish):
    a = connect()
    a.sub(rdy=1)
    b = connect()
    b.sub(rdy=3)
    publish(*[b"%d" % i for i in range(10)])
    assert len(a.messages()) == 1
    assert len(b.messages()) == 3


def test_topic_without_channel_holds_messages(connect, publish, inproc_broker):
    publish(b"1")
    publish(b"2", b"3")
    topic = inproc_broker.topics["t"]
    assert topic.depth() == 3
    assert topic.message_count == 3
    c = connect()
    c.sub(rdy=10)
    assert bodies(c.messages()) == [b"1", b"2", b"3"]
    assert topic.depth() == 0


def test_new_channel_gets_only_later_messages(connect, publish, inproc_broker):
    a = connect()
    a.sub("t", "a")
    publish(b"old")
    b = connect()
    b.sub("t", "b", rdy=5)
    publish(b"new")
    assert bodies(b.messages()) == [b"new"]
    assert channel_of(inproc_broker, "t", "a").depth() == 2


def test_paused_channel_stops_delivery(connect, publish, inproc_broker):
    c = connect()
    c.sub(rdy=5)
    channel = channel_of(inproc_broker)
    channel.pause()
    publish(b"1", b"2")
    assert c.raw() == b""
    assert channel.depth() == 2
    channel.unpause()
    assert bodies(c.messages()) == [b"1", b"2"]


def test_paused_topic_holds_messages(connect, publish, inproc_broker):
    c = connect()
    c.sub(rdy=5)
    topic = inproc_broker.topics["t"]
    topic.pause()
    publish(b"1", b"2")
    assert c.raw() == b""
    assert topic.depth() == 2
    topic.unpause()
    assert bodies(c.messages()) == [b"1", b"2"]


def test_three_channels_first_delivery_attempts(connect, publish):
    clients = []
    for name in ("a", "b", "c"):
        c = connect()
        c.sub("t", name, rdy=5)
        clients.append(c)
    publish(b"x")
    publish(b"y", b"z")
    for c in clients:
        assert [(m.body, m.attempts) for m in c.messages()] == [(b"x", 1), (b"y", 1), (b"z", 1)]


def test_no_delivery_after_a_fatal_error(connect, publish, inproc_broker):
    c = connect()
    c.sub()
    publish(b"1", b"2")
    # RDY opens the window, but the fatal error in the same read closes the
    # connection: nothing may follow the error frame.
    assert c.request(cmd("RDY", 5) + cmd("FOO")) == [err("E_INVALID invalid command FOO")]
    assert c.proto.in_flight_count == 0
    channel = channel_of(inproc_broker)
    assert channel.depth() == 2
    c.lose()
    d = connect()
    d.sub(rdy=5)
    assert [(m.body, m.attempts) for m in d.messages()] == [(b"1", 1), (b"2", 1)]


def test_timed_out_client_not_fed_while_closing(connect, publish, inproc_broker, clock):
    c = connect()
    c.sub(rdy=5)
    clock.pump([10] * 6)
    assert c.closed
    c.read()
    publish(b"x")  # connectionLost has not run yet
    assert c.raw() == b""
    assert channel_of(inproc_broker).depth() == 1


# -- ephemeral -----------------------------------------------------------------------------------------


def test_ephemeral_channel_deleted_with_last_client(connect, inproc_broker):
    a = connect()
    a.sub("t", "c#ephemeral", rdy=1)
    b = connect()
    b.sub("t", "c#ephemeral", rdy=1)
    assert connect().request(mpub("t", [b"1", b"2", b"3"])) == [ok()]
    a.lose()
    assert "c#ephemeral" in inproc_broker.topics["t"].channels
    b.lose()
    assert "c#ephemeral" not in inproc_broker.topics["t"].channels
    assert "t" in inproc_broker.topics  # a normal topic stays


def test_ephemeral_topic_deleted_with_last_channel(connect, inproc_broker):
    c = connect()
    c.sub("t#ephemeral", "c#ephemeral")
    c.lose()
    assert inproc_broker.topics == {}


def test_ephemeral_topic_with_durable_channel_stays(connect, inproc_broker):
    c = connect()
    c.sub("t#ephemeral", "c")
    c.lose()
    assert list(inproc_broker.topics) == ["t#ephemeral"]
    assert list(inproc_broker.topics["t#ephemeral"].channels) == ["c"]


def test_ephemeral_topic_without_channel_stays(connect, inproc_broker):
    assert connect().request(pub("t#ephemeral", b"x")) == [ok()]
    assert list(inproc_broker.topics) == ["t#ephemeral"]


def test_ephemeral_overflow_dropped(make_broker):
    broker = make_broker(mem_queue_size=5)
    p = Client(broker)
    for i in range(8):
        assert p.request(pub("t#ephemeral", b"%d" % i)) == [ok()]
    topic = broker.topics["t#ephemeral"]
    assert (topic.depth(), topic.backend_depth(), topic.message_count) == (5, 0, 8)
    c = Client(broker)
    c.sub("t#ephemeral", "c#ephemeral", rdy=10)
    assert bodies(c.messages()) == [b"0", b"1", b"2", b"3", b"4"]


def test_resubscribe_after_ephemeral_channel_deleted(connect, inproc_broker):
    a = connect()
    a.sub("t", "c#ephemeral")
    a.lose()
    b = connect()
    b.sub("t", "c#ephemeral", rdy=1)
    assert connect().request(pub("t", b"x")) == [ok()]
    assert bodies(b.messages()) == [b"x"]


def test_deleted_channel_disconnects_clients(connect, inproc_broker):
    c = connect()
    c.sub(rdy=1)
    inproc_broker.topics["t"].delete_channel("c")
    assert c.closed
    assert c.proto.channel is None
    c.lose()


# -- sampling ----------------------------------------------------------------------------------------------


def test_sample_rate_roughly_respected(connect, publish, inproc_broker):
    random.seed(20240101)
    c = connect()
    assert c.request(identify(sample_rate=30)) == [ok()]
    c.sub(rdy=2500)
    publish(*[b"%d" % i for i in range(2000)])
    got = c.messages()
    # (s + 1) % are kept: about 620 of 2000.
    assert 500 <= len(got) <= 740
    channel = channel_of(inproc_broker)
    assert channel.in_flight_count() == len(got)
    assert channel.depth() == 0  # the rest are consumed, not requeued
    assert c.proto.message_count == len(got)
    assert all(m.attempts == 1 for m in got)
