"""The queue scanner as a service on the clock, and clean shutdown of queues."""

from __future__ import annotations

import random

from mqd.nsqd.queuescan import QueueScanner
from tests.support.v2_client import Client
from tests.support.v2_frames import Msg, cmd, err, mpub, ok, pub


def test_scanner_runs_on_its_interval(make_broker, clock):
    broker = make_broker(msg_timeout="1s", queue_scan_interval="100ms", queue_scan_refresh_interval="5s")
    c = Client(broker)
    c.sub(rdy=1)
    scanner = QueueScanner(broker)
    scanner.startService()
    try:
        Client(broker).send(pub("t", b"x"))
        [m] = c.messages()
        # The channel existed when the scanner started: its list has it.
        clock.pump([0.1] * 9)
        assert c.raw() == b""
        clock.pump([0.1] * 2)  # first tick at or after the 1 s deadline
        assert c.messages() == [Msg(m.timestamp, 2, m.id, b"x")]
    finally:
        scanner.stopService()
    assert not scanner.running
    clock.advance(10)
    assert c.raw() == b""  # stopped: no more expiries
    assert broker.topics["t"].channels["c"].in_flight_count() == 1


def test_new_channel_seen_after_refresh_interval(make_broker, clock):
    broker = make_broker(msg_timeout="1s", queue_scan_refresh_interval="5s")
    scanner = QueueScanner(broker)
    scanner.startService()
    try:
        clock.advance(0.1)  # first tick: the (empty) channel list is built
        c = Client(broker)
        c.sub(rdy=1)
        Client(broker).send(pub("t", b"x"))
        c.messages()
        for _ in range(40):  # 4 s: expired at 1 s, but the channel is not in the list yet
            clock.advance(0.1)
        assert c.raw() == b""
        for _ in range(15):  # the list is rebuilt 5 s after the first tick
            clock.advance(0.1)
        [m] = [f for f in c.read() if isinstance(f, Msg)]
        assert m.attempts == 2
    finally:
        scanner.stopService()


def test_scan_counts_dirty_channels_and_samples(make_broker, clock):
    broker = make_broker(msg_timeout="1s", queue_scan_selection_count=2)
    clients = []
    for name in "abcde":
        c = Client(broker)
        c.sub("t", name, rdy=1)
        clients.append(c)
    Client(broker).send(pub("t", b"x"))
    for c in clients:
        assert len(c.messages()) == 1
        c.send(cmd("RDY", 0))
    clock.advance(1)
    scanner = QueueScanner(broker)
    scanner.refresh()
    random.seed(7)
    # A tick samples 2 channels at a time and samples again while more
    # than a quarter of the sample had work; repeated ticks catch up.
    first = scanner.scan()
    assert 2 <= first <= 5
    total = first + sum(scanner.scan() for _ in range(50))
    assert total == 5
    for name in "abcde":
        ch = broker.topics["t"].channels[name]
        assert (ch.timeout_count, ch.depth(), ch.in_flight_count()) == (1, 1, 0)
    assert scanner.scan() == 0


def test_channel_empty_drops_everything(make_broker, clock):
    broker = make_broker()
    c = Client(broker)
    c.sub(rdy=2)
    assert Client(broker).request(mpub("t", [b"1", b"2", b"3", b"4"])) == [ok()]
    m1, m2 = c.messages()
    c.send(cmd("REQ", m1.id, 5000))
    [m3] = c.messages()  # the freed slot is filled at once
    c.send(cmd("RDY", 0))
    channel = broker.topics["t"].channels["c"]
    assert (channel.depth(), channel.in_flight_count(), channel.deferred_count()) == (1, 2, 1)
    channel.empty()
    assert (channel.depth(), channel.in_flight_count(), channel.deferred_count()) == (0, 0, 0)
    assert c.proto.in_flight_count == 0
    assert not c.closed
    assert c.request(cmd("FIN", m2.id)) == [err(f"E_FIN_FAILED FIN {m2.id.decode()} failed ID not in flight")]
    clock.advance(10)
    assert QueueScanner(broker).scan() == 0
    c.send(cmd("RDY", 5))
    assert c.raw() == b""
    assert m3.body == b"3"


def test_topic_delete_disconnects_consumers(make_broker):
    broker = make_broker()
    a = Client(broker)
    a.sub("t", "a", rdy=1)
    b = Client(broker)
    b.sub("t", "b", rdy=1)
    assert Client(broker).request(pub("t", b"x")) == [ok()]
    assert broker.delete_topic("t")
    assert a.closed and b.closed
    assert broker.topics == {}
    a.lose()
    b.lose()
    # Publishing again recreates it, empty of the old channels.
    assert Client(broker).request(pub("t", b"y")) == [ok()]
    assert broker.topics["t"].channels == {}
    assert not broker.delete_topic("nope")


def test_broker_close_flushes_queues_to_backend(make_broker, clock):
    broker = make_broker()
    c = Client(broker)
    c.sub(rdy=2)
    p = Client(broker)
    assert p.request(mpub("t", [b"1", b"2", b"3", b"4"])) == [ok()]
    m1, m2 = c.messages()
    c.send(cmd("REQ", m2.id, 60000) + cmd("RDY", 0))
    c.read()
    assert p.request(pub("u", b"waiting-at-topic")) == [ok()]
    channel = broker.topics["t"].channels["c"]
    backend = channel._queue.backend
    topic_backend = broker.topics["u"]._queue.backend
    broker.close()
    assert c.closed and p.closed
    # Memory queue first, then in flight, then deferred; attempts travel along.
    assert [(m.body, m.attempts) for m in backend._items] == [(b"4", 0), (b"1", 1), (b"3", 1), (b"2", 1)]
    assert [m.body for m in topic_backend._items] == [b"waiting-at-topic"]
