"""The queue scan survives a bad entry: nothing is stranded, the rest of the pass goes on, logged once.

Each test breaks one thing (two in-flight messages with one id, a corrupt
heap entry, a method raising for one message, a whole channel raising)
and checks after every tick that each message of the channel is queued,
in flight or deferred exactly once, that the counts /stats reports and the
clients' in-flight counts agree with that, that the other entries and
channels were processed in the same pass, that the failure was logged once
with the channel and the message id, and that the scan keeps running.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter

import pytest
from twisted.logger import formatEvent

from mqd.message import Message
from mqd.nsqd.channel import Channel
from mqd.nsqd.inflight import InFlightQueue
from mqd.nsqd.overflow import OverflowQueue
from mqd.nsqd.pqueue import DeferredQueue
from mqd.nsqd.queuescan import QueueScanner
from tests.support.inprocess_broker import msgs
from tests.support.log_watch import LogWatch
from tests.support.v2_client import Client, consumer, publisher_client
from tests.support.v2_frames import Msg, cmd, dpub, ok


def check_places(channel: Channel, expected: int, table: bool = True) -> None:
    """Every message of `channel` in exactly one place, `expected` in all; every count agrees.

    `table=False` while two messages with one id are in flight: the table
    then holds only one of them.
    """
    queue, deferred, pq = channel.holdings()
    queued = [*queue.mem, *queue.backend._items]
    flying = [m for _, m in pq.entries()]
    waiting = [m for _, m in deferred.entries()]
    everything = queued + flying + waiting
    assert len(everything) == expected
    assert len({id(m) for m in everything}) == expected, "a message in two places"
    if table:
        held = channel._in_flight
        assert {id(m) for m in held.values()} == {id(m) for m in flying}
        assert all(held[m.id_key or m.data[:16]] is m for m in flying)  # m.id, not the property
        assert channel.in_flight_count() == len(flying)
    assert all(m.state is None for m in queued)
    assert all(m.state.__class__ is tuple for m in flying)
    assert all(m.state.__class__ is float for m in waiting)
    assert (channel.depth(), channel.deferred_count()) == (len(queued), len(waiting))
    assert len(pq) == len(flying)
    holding = Counter(m.state[0] for m in flying)
    for client in channel.clients:
        assert client.in_flight_count == holding[client]


def received(c: Client) -> list[Msg]:
    return [f for f in c.read() if isinstance(f, Msg)]


def failure_texts(watch: LogWatch) -> list[str]:
    return [formatEvent(e) for e in watch.events if "log_failure" in e]


@pytest.fixture
def scanner(make_broker, clock):
    """A running queue scan (every 100 ms) of a broker whose msg_timeout is 1 s."""
    broker = make_broker(msg_timeout="1s", queue_scan_interval="100ms")
    scanner = QueueScanner(broker)
    scanner.startService()
    yield scanner
    scanner.stopService()


def tick(scanner: QueueScanner, clock, seconds: float = 0.1) -> None:
    for _ in range(round(seconds / 0.1)):
        clock.advance(0.1)
    assert scanner._loop is not None and scanner._loop.running


def tick_until(scanner: QueueScanner, clock, done, limit: int = 30) -> None:
    """Tick until `done()`: the checks that follow see the pass in which it became true."""
    for _ in range(limit):
        tick(scanner, clock)
        if done():
            return
    raise AssertionError(f"not done after {limit} ticks")


# -- two in-flight messages with one id --------------------------------------------


def test_two_in_flight_messages_with_one_id_fin_of_one_then_timeouts(scanner, clock):
    """The failure of the field: the pass raised KeyError and stranded hundreds of messages."""
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=0)
    o = consumer(broker, "t", "other", rdy=0)
    channel = broker.topics["t"].channels["c"]
    other = broker.topics["t"].channels["other"]
    batch = msgs(500)
    dup_id = batch[10].id
    batch[400] = Message(dup_id, b"same id", 1_400)
    channel.put(batch)
    other.put(msgs(500))
    c.send(cmd("RDY", 500))
    o.send(cmd("RDY", 500))
    assert len(received(c)) == 500 and len(received(o)) == 500
    # FIN of the id reaches the later delivery (the table holds that one), and a few others.
    for msg_id in [dup_id, *(m.id for m in batch[:5])]:
        c.fin(msg_id)
    assert c.read() == []
    finished = 6
    with LogWatch() as watch:
        # The first tick sees the table and the heap disagree: the earlier
        # delivery of the id, which no FIN can reach, times out at once.
        tick(scanner, clock)
        check_places(channel, 500 - finished)
        assert channel.timeout_count == 1
        [again] = received(c)
        assert (again.id, again.body, again.attempts) == (dup_id, b"m10", 2)
        # At the deadline every other message times out, in both channels, in one pass.
        tick_until(scanner, clock, lambda: channel.timeout_count > 1)
        check_places(channel, 500 - finished)
        check_places(other, 500)
        # The redelivered one may share this tick (its deadline is 100 ms later).
        assert channel.timeout_count - 1 in (500 - finished - 1, 500 - finished)
        assert other.timeout_count == 500
        assert len(received(c)) == channel.timeout_count - 1  # redelivered: nothing stranded
        assert len(received(o)) == 500
        tick(scanner, clock, 5)
        check_places(channel, 500 - finished)
    [text] = failure_texts(watch)
    assert "<Channel t:c>" in text and dup_id.decode() in text


def test_duplicate_ids_delivered_again_keep_the_counts(scanner, clock):
    """Two pairs of one id, delivered over and over: the counts never drift, logged once."""
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=0)
    channel = broker.topics["t"].channels["c"]
    batch = msgs(100)
    batch[50] = Message(batch[0].id, b"a", 1)
    batch[60] = Message(batch[1].id, b"b", 1)
    channel.put(batch)
    c.send(cmd("RDY", 100))
    with LogWatch() as watch:
        for _ in range(40):
            tick(scanner, clock, 0.5)
            check_places(channel, 100, table=False)
            c.read()
        # Once they stop being delivered again, the table agrees with the heap.
        c.send(cmd("RDY", 0))
        tick(scanner, clock, 2)
        check_places(channel, 100)
        assert channel.depth() == 100
    assert len(failure_texts(watch)) == 1


# -- a message the pass fails on ---------------------------------------------------


def test_a_message_whose_id_raises_once_is_requeued_and_the_pass_goes_on(scanner, clock, monkeypatch):
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=200)
    channel = broker.topics["t"].channels["c"]
    channel.put(msgs(200))
    assert len(received(c)) == 200
    victim = channel._in_flight[b"%016d" % 77]
    real = Message.id
    raised: list[Message] = []

    def id_once(self):
        if self is victim and not raised:
            raised.append(self)
            raise RuntimeError("id unreadable")
        return real.fget(self)

    monkeypatch.setattr(Message, "id", property(id_once))
    with LogWatch() as watch:
        tick_until(scanner, clock, lambda: channel.timeout_count)
        assert raised == [victim]
        check_places(channel, 200)
        assert channel.timeout_count == 200
        assert sorted(m.body for m in received(c)) == sorted(m.body for m in msgs(200))
        tick(scanner, clock, 3)
        check_places(channel, 200)
    [text] = failure_texts(watch)
    assert "<Channel t:c>" in text and "0000000000000077" in text and "in-flight timeout" in text


def test_a_message_whose_id_always_raises_is_logged_once_per_kind(scanner, clock, monkeypatch):
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=50)
    channel = broker.topics["t"].channels["c"]
    channel.put(msgs(50))
    assert len(received(c)) == 50
    victim = channel._in_flight[b"%016d" % 7]
    real = Message.id

    def broken_id(self):
        if self is victim:
            raise RuntimeError("id unreadable")
        return real.fget(self)

    monkeypatch.setattr(Message, "id", property(broken_id))
    with LogWatch() as watch:
        for n in range(1, 6):  # each time out fails on the victim, and requeues it
            tick_until(scanner, clock, lambda n=n: channel.timeout_count >= n * 50)
            check_places(channel, 50)
            assert len(received(c)) == 50
        assert channel.timeout_count == 5 * 50
    texts = failure_texts(watch)
    assert len(texts) == 2  # the timeout, and the id read it retried: once each
    assert all("<Channel t:c>" in t and "0000000000000007" in t for t in texts)


# -- a corrupt heap entry ----------------------------------------------------------


def _root_deadline(value):
    def corrupt(pq):
        entry = pq._heap[0]
        pq._heap[0] = (value, *entry[1:])
    return corrupt


def _junk_entry(pq):
    pq._heap.append("junk")


def _not_a_message(pq):
    pq._heap[-1][3].append(object())


@pytest.mark.parametrize(
    ("corrupt", "early"),
    [(_root_deadline(None), 20), (_root_deadline(math.nan), 20), (_junk_entry, 0), (_not_a_message, 0)],
    ids=["none-deadline", "nan-deadline", "junk-entry", "not-a-message"],
)
def test_corrupt_in_flight_entry(scanner, clock, corrupt, early):
    """Repaired, not stranded: the entry's messages time out now if its deadline is gone."""
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=100)
    o = consumer(broker, "t", "other", rdy=100)
    channel = broker.topics["t"].channels["c"]
    other = broker.topics["t"].channels["other"]
    for i in range(5):  # five deliveries: five heap entries
        channel.put(msgs(20, 20 * i))
        other.put(msgs(20, 20 * i))
    assert len(received(c)) == 100 and len(received(o)) == 100
    corrupt(channel._in_flight_pq)
    with LogWatch() as watch:
        tick(scanner, clock)
        if early:  # met and repaired at once: a bad root stops the first pass
            check_places(channel, 100)
        assert channel.timeout_count == early
        # The pass that meets the bad entry at the deadline times out all the others too.
        tick_until(scanner, clock, lambda: channel.timeout_count > early)
        check_places(channel, 100)
        check_places(other, 100)
        # Every other message too, in that pass (the early ones may share it).
        assert channel.timeout_count in {100, 100 + early}
        assert other.timeout_count == 100
        assert len(received(c)) == channel.timeout_count  # every one delivered again
        tick(scanner, clock, 3)
        check_places(channel, 100)
    [text] = failure_texts(watch)
    assert "<Channel t:c>" in text and "in-flight queue" in text
    if early:
        assert "0000000000000000" in text  # the first delivery lost its deadline: its ids are named


# -- the deferred queue ------------------------------------------------------------


def test_corrupt_deferred_entries(scanner, clock):
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=0)
    channel = broker.topics["t"].channels["c"]
    p = publisher_client(broker)
    for i in range(10):
        assert p.request(dpub("t", 1000 + 100 * i, b"d%d" % i)) == [ok()]
    assert channel.deferred_count() == 10
    heap = channel._deferred._heap
    heap[0] = (None, *heap[0][1:])  # the first one due has lost its due time
    heap.append("junk")
    with LogWatch() as watch:
        tick(scanner, clock)
        check_places(channel, 10)
        assert channel.depth() == 1  # d0 lost its due time: due now rather than never
        tick(scanner, clock, 2)
        check_places(channel, 10)
        assert channel.depth() == 10
    c.send(cmd("RDY", 10))
    assert sorted(m.body for m in received(c)) == [b"d%d" % i for i in range(10)]
    [text] = failure_texts(watch)
    assert "deferred queue" in text and "<Channel t:c>" in text
    assert "message " in text  # d0, named by its id


def test_deferred_entry_that_is_not_a_message(scanner, clock):
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=10)
    channel = broker.topics["t"].channels["c"]
    p = publisher_client(broker)
    for i in range(3):
        assert p.request(dpub("t", 300, b"d%d" % i)) == [ok()]
    heapq.heappush(channel._deferred._heap, (0.0, -1, "not a message"))
    with LogWatch() as watch:
        tick_until(scanner, clock, lambda: channel.depth() or channel.in_flight_count())
    assert sorted(m.body for m in received(c)) == [b"d0", b"d1", b"d2"]
    check_places(channel, 3)
    [text] = failure_texts(watch)
    assert "deferred message" in text and "not a message" in text


def test_nan_due_time_does_not_hold_back_the_others(scanner, clock):
    broker = scanner.broker
    consumer(broker, "t", "c", rdy=0)
    channel = broker.topics["t"].channels["c"]
    p = publisher_client(broker)
    for i in range(3):
        assert p.request(dpub("t", 500, b"d%d" % i)) == [ok()]
    heap = channel._deferred._heap
    heap[0] = (math.nan, *heap[0][1:])
    with LogWatch() as watch:
        tick(scanner, clock)
        assert channel.depth() == 1  # due now rather than never
        tick(scanner, clock, 0.6)
    check_places(channel, 3)
    assert channel.depth() == 3
    assert len(failure_texts(watch)) == 1


# -- the scan itself ---------------------------------------------------------------


def test_a_raising_channel_does_not_skip_the_others_in_the_same_tick(make_broker, clock, monkeypatch):
    broker = make_broker(msg_timeout="1s")
    consumers = {name: consumer(broker, "t", name, rdy=10) for name in "abc"}
    channels = broker.topics["t"].channels
    for ch in channels.values():
        ch.put(msgs(10))
    for c in consumers.values():
        assert len(received(c)) == 10
    bad = channels["b"]
    real_in_flight, real_deferred = Channel.process_in_flight, Channel.process_deferred

    def process_in_flight(self, now):
        if self is bad:
            raise RuntimeError("broken in-flight")
        return real_in_flight(self, now)

    def process_deferred(self, now):
        if self is bad:
            raise RuntimeError("broken deferred")
        return real_deferred(self, now)

    monkeypatch.setattr(Channel, "process_in_flight", process_in_flight)
    monkeypatch.setattr(Channel, "process_deferred", process_deferred)
    scanner = QueueScanner(broker)
    scanner.refresh()
    clock.advance(1)
    with LogWatch() as watch:
        assert scanner.scan() == 2
        assert scanner.scan() == 0
    assert channels["a"].timeout_count == channels["c"].timeout_count == 10
    assert bad.timeout_count == 0
    texts = failure_texts(watch)
    assert len(texts) == 2  # once per kind, not per tick
    assert all("<Channel t:b>" in t for t in texts)


def test_the_loop_survives_a_failing_tick(scanner, clock, monkeypatch):
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=5)
    broker.topics["t"].channels["c"].put(msgs(5))
    assert len(received(c)) == 5
    tick(scanner, clock)  # the channel list is built
    calls: list[int] = []

    def channels():
        calls.append(1)
        raise RuntimeError("no channel list")

    monkeypatch.setattr(broker, "channels", channels)
    monkeypatch.setattr(scanner, "refresh_interval", 0.0)
    with LogWatch() as watch:
        tick(scanner, clock, 1)
        # The list could not be rebuilt: the last one is still scanned.
        assert len(received(c)) == 5
        assert broker.topics["t"].channels["c"].timeout_count == 5
    assert len(calls) >= 9
    assert len(failure_texts(watch)) == 1
    monkeypatch.setattr(scanner, "scan", lambda: 1 / 0)
    with LogWatch() as watch:
        tick(scanner, clock, 1)
    assert len(failure_texts(watch)) == 1


# -- the heaps: a pop that raises halfway loses nothing ------------------------------


def test_in_flight_pop_raising_halfway_puts_back_what_it_took():
    q = InFlightQueue()
    everything = []
    for i in range(6):
        state = (object(), 0.0)
        batch = msgs(5, 5 * i)
        for m in batch:
            m.state = state
        q.push_batch(batch, float(i), state)
        everything += batch
    q._heap.append((2.5, -1, (object(), 0.0), "not a list of messages"))
    with pytest.raises(AttributeError):
        q.pop_due(10.0)
    # Nothing lost its deadline; the ones taken before the raise are due now.
    assert q.repair(10.0, everything) == []
    assert len(q) == 30
    assert q.pop_due(5.0) == everything[15:]
    assert q.pop_due(10.0) == everything[:15]
    assert len(q) == 0


def test_in_flight_repair_finds_held_messages_whose_entry_was_lost():
    q = InFlightQueue()
    state = (object(), 0.0)
    batch = msgs(4)
    for m in batch:
        m.state = state
    q.push_batch(batch, 5.0, state)
    q._heap[0] = "junk"
    assert q.repair(1.0, batch) == batch
    assert q.pop_due(1.0) == batch


def test_deferred_pop_raising_halfway_puts_back_what_it_took():
    q = DeferredQueue()
    waiting = msgs(10)
    for i, m in enumerate(waiting):
        q.push(m, float(i))
    [extra] = msgs(1, 99)
    q._heap.append((None, -1, extra))
    with pytest.raises(TypeError):
        q.pop_due(5.0)
    assert q.repair(5.0) == [extra]
    assert len(q) == 11
    assert q.pop_due(5.0) == [*waiting[:6], extra]
    assert q.pop_due(100.0) == waiting[6:]


def test_a_queue_that_refuses_the_requeue_leaves_them_in_memory(scanner, clock, monkeypatch):
    broker = scanner.broker
    c = consumer(broker, "t", "c", rdy=30)
    channel = broker.topics["t"].channels["c"]
    channel.put(msgs(30))
    assert len(received(c)) == 30
    c.send(cmd("RDY", 0))
    real = OverflowQueue.put_accepted
    calls: list[int] = []

    def put_accepted(self, batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise OSError("store gone")
        return real(self, batch)

    monkeypatch.setattr(OverflowQueue, "put_accepted", put_accepted)
    with LogWatch() as watch:
        tick_until(scanner, clock, lambda: channel.timeout_count)
        check_places(channel, 30)
        assert channel.depth() == 30 and calls == [30]
    [text] = failure_texts(watch)
    assert "requeueing" in text and "<Channel t:c>" in text
