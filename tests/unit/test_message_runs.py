"""Fresh publishes held as runs: the same messages, in the same order, as Message objects would be.

A publish of several messages that no store keeps and that is not
deferred is one mqd.message.Run shared by every queue it goes to; the
queue's memory (mqd.nsqd.overflow.MemQueue) makes Messages as it hands
them out. Whatever reads a queue (take, untake, peek, iterating, a
requeue, a close, a snapshot's capture, /stats depths) must see exactly
what a queue of Messages would hold.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from zope.interface import implementer

from backends import BackendError
from backends.memory import MemoryQueue, MemoryStore
from mqd.message import ID_SIZE, Message, Run, new_messages, new_run, run_messages
from mqd.nsqd.capture import capture
from mqd.nsqd.delivery import DeliveryBatch
from mqd.nsqd.interfaces import IConsumer, ITopicLifecycle
from mqd.nsqd.overflow import MemQueue, OverflowQueue
from mqd.nsqd.topic import Topic
from tests.support.inprocess_broker import settings as broker_settings


def ids(start: int, n: int) -> list[bytes]:
    return [b"%016x" % i for i in range(start, start + n)]


def fields(m: Message) -> tuple:
    """What a queued message is, whichever object holds it."""
    return m.id, m.body, m.timestamp, m.attempts, m.state, m.key


def run_of(start: int, n: int, ts: int = 7) -> Run:
    return new_run(ids(start, n), [b"r%d" % i for i in range(start, start + n)], ts)


def msgs_of(start: int, n: int, ts: int = 7) -> list[Message]:
    return new_messages(ids(start, n), [b"m%d" % i for i in range(start, start + n)], ts)


# -- a run and its messages ------------------------------------------------------------------


def delivered(channel) -> list[bytes]:
    """The bodies a consumer added to `channel` now is given."""
    consumer = Consumer()
    channel.add_client(consumer)
    channel.deliver()
    return [m.body for m in consumer.got]


def test_a_run_makes_what_a_publish_of_messages_makes():
    run = run_of(0, 5, ts=42)
    made = run_messages(run, 1, 4)
    expected = new_messages(ids(1, 3), [b"r1", b"r2", b"r3"], 42)
    assert [fields(m) for m in made] == [fields(m) for m in expected]
    assert all(m.id_key is None for m in made)  # one holder: no id object made


def test_channels_of_a_shared_run_share_one_id_object_per_message():
    run = run_of(0, 6)
    run.share()
    first = run_messages(run, 0, 4)
    second = run_messages(run, 0, 2) + run_messages(run, 2, 6)
    assert [m.id for m in first] == ids(0, 4)
    for a, b in zip(first, second, strict=False):
        assert a is not b and a.id_key is b.id_key and a.data is b.data
    assert [m.id_key for m in second] == ids(0, 6)


def test_a_message_made_for_reading_leaves_the_run_ids_alone():
    run = run_of(0, 3)
    run.share()
    assert [m.id for m in run_messages(run, 0, 3, keyed=False)] == ids(0, 3)
    assert run.keys == []


def test_a_copy_made_from_a_run_counts_its_own_attempts():
    run = run_of(0, 2)
    run.share()
    (a,), (b,) = run_messages(run, 0, 1), run_messages(run, 0, 1)
    a.attempts += 1
    assert b.attempts == 0


# -- the memory queue against a plain list -----------------------------------------------------


def test_take_crosses_runs_and_messages_in_order():
    q = MemQueue()
    q.extend(msgs_of(0, 2))
    q.add(run_of(2, 3))
    q.add(msgs_of(5, 1))
    q.add(run_of(6, 2))
    assert len(q) == 8
    got = q.take(3) + q.take(1) + q.take(10)
    assert [m.id for m in got] == ids(0, 8)
    assert len(q) == 0 and not q and q.take(5) == []


def test_untake_at_a_run_boundary_comes_back_first():
    q = MemQueue()
    q.add(run_of(0, 4))
    q.add(run_of(4, 4))
    first = q.take(2)
    more = q.take(3)  # the rest of the first run and one of the second
    q.untake(more)
    q.untake(first)
    assert [m.id for m in q.peek(8)] == ids(0, 8)
    again = q.take(8)
    assert again[:5] == first + more  # the very objects given back
    assert [m.id for m in again] == ids(0, 8)


def test_peek_and_iterating_see_what_take_gets_and_move_nothing():
    q = MemQueue()
    q.add(run_of(0, 5))
    q.take(2)
    q.extend(msgs_of(5, 2))
    q.add(run_of(7, 3))
    expected = [(m.id, m.body) for m in q.peek(100)]
    assert [(m.id, m.body) for m in q] == expected
    assert [(m.id, m.body) for m in q.peek(4)] == expected[:4]
    assert q.peek(0) == []
    assert len(q) == 8
    assert [(m.id, m.body) for m in q.take(8)] == expected


def test_clear_forgets_runs_and_where_the_first_was_taken_to():
    q = MemQueue()
    q.add(run_of(0, 5))
    q.take(2)
    q.clear()
    assert len(q) == 0
    q.add(run_of(10, 2))
    assert [m.id for m in q.take(5)] == ids(10, 2)


# A plain list is the model: every operation on both, then the same messages in the same order.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("messages"), st.integers(0, 4)),
        st.tuples(st.just("run"), st.integers(1, 6)),
        st.tuples(st.just("take"), st.integers(0, 8)),
        st.tuples(st.just("untake"), st.integers(0, 8)),
        st.tuples(st.just("peek"), st.integers(0, 12)),
        st.tuples(st.just("clear"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_memory_queue_behaves_as_a_list(steps):
    q = MemQueue()
    model: list[Message] = []
    taken: list[Message] = []  # the last take, for untake
    next_id = 0
    for op, n in steps:
        if op == "messages":
            new = msgs_of(next_id, n)
            next_id += n
            q.extend(new)
            model += new
        elif op == "run":
            run = run_of(next_id, n)
            next_id += n
            q.add(run)
            model += run_messages(run, 0, n, keyed=False)
        elif op == "take":
            taken = q.take(n)
            assert [fields(m) for m in taken] == [fields(m) for m in model[:n]]
            del model[:n]
        elif op == "untake":
            back = taken[len(taken) - min(n, len(taken)):]
            taken = taken[:len(taken) - len(back)]
            q.untake(back)
            model[:0] = back
        elif op == "peek":
            assert [fields(m) for m in q.peek(n)] == [fields(m) for m in model[:n]]
        else:
            q.clear()
            model.clear()
            taken = []
        assert len(q) == len(model)
    assert [fields(m) for m in q] == [fields(m) for m in model]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, 1), st.integers(0, 7)), max_size=30))
def test_two_channels_of_shared_runs_take_apart_with_one_id_object_each(sizes, takes):
    queues = (MemQueue(), MemQueue())
    first = 0
    for n in sizes:
        run = run_of(first, n)
        first += n
        run.share()
        for q in queues:
            q.add(run)
    got: tuple[list[Message], list[Message]] = ([], [])
    for which, n in takes:
        got[which].extend(queues[which].take(n))
    for which in (0, 1):
        got[which].extend(queues[which].take(first))
        assert [m.id for m in got[which]] == ids(0, first)
        assert all(m.attempts == 0 and m.state is None and m.key is None for m in got[which])
    for a, b in zip(*got, strict=True):
        assert a is not b and a.id_key is b.id_key and a.data is b.data


# -- the bounded queue: memory, then the backend ------------------------------------------------


def test_a_run_past_the_memory_bound_overflows_in_order():
    queue = OverflowQueue(3, MemoryQueue("q"))
    queue.put(run_of(0, 2))
    queue.put(run_of(2, 4))  # one fits, three overflow
    queue.put(run_of(6, 2))  # the backend holds some: all of it there
    assert (len(queue), queue.mem.count, queue.backend_depth()) == (8, 3, 5)
    assert [m.id for m in queue.peek(8)] == ids(0, 8)
    got = []
    while queue:
        got += queue.take(2)
    assert [m.id for m in got] == ids(0, 8)


class MessagesOnlyQueue(MemoryQueue):
    """A backend that checks it is given Messages only, as every store is."""

    def put(self, messages, fresh: bool = False) -> None:
        assert all(isinstance(m, Message) for m in messages)
        super().put(messages, fresh)


def test_the_backend_gets_a_runs_overflow_as_messages():
    backend = MessagesOnlyQueue("q")
    queue = OverflowQueue(3, backend)
    queue.put(run_of(0, 5))  # three stay in memory (as Messages: the run is cut), two overflow
    queue.put(run_of(5, 4))
    assert (queue.mem.count, backend.depth()) == (3, 6)
    got = queue.take(10)
    got += queue.take(10)
    assert [m.id for m in got] == ids(0, 9)
    assert not queue


def test_a_run_that_fits_stays_a_run_and_counts_its_messages():
    queue = OverflowQueue(10, MemoryQueue("q"))
    queue.put(run_of(0, 10))
    assert (len(queue), queue.backend_depth(), repr(queue.mem)) == (10, 0, "<MemQueue 10 messages, 1 runs>")


def test_close_hands_a_runs_messages_to_the_backend_in_order():
    backend = MemoryQueue("q")
    queue = OverflowQueue(100, backend)
    queue.put(run_of(0, 4))
    queue.take(1)
    queue.put(msgs_of(4, 1))
    queue.close(msgs_of(5, 1))
    assert [m.id for m in backend.peek(10)] == ids(1, 5)
    assert len(queue.mem) == 0


# -- topics and channels ------------------------------------------------------------------------


@implementer(ITopicLifecycle)
class Listener:
    def channel_created(self, topic, channel) -> None:
        pass

    def channel_deleted(self, topic, channel) -> None:
        pass

    def topic_abandoned(self, topic) -> None:
        pass


@implementer(IConsumer)
class Consumer:
    """A subscribed client with a RDY, keeping the messages it is sent."""

    msg_timeout = 60.0
    sample_rate = 0
    remote_address = "127.0.0.1:1"
    client_id = hostname = user_agent = "test"

    def __init__(self, rdy: int = 100) -> None:
        self.rdy = rdy
        self.in_flight_count = 0
        self.got: list[Message] = []

    def ready(self) -> int:
        return self.rdy - self.in_flight_count

    def sending_messages(self, count) -> None:
        self.in_flight_count += count

    def send_messages(self, messages) -> None:
        self.got += messages

    def finished_messages(self, count) -> None:
        self.in_flight_count -= count

    def requeued_message(self) -> None:
        self.in_flight_count -= 1

    def timed_out_messages(self, count) -> None:
        self.in_flight_count -= count

    def in_flight_cleared(self) -> None:
        self.in_flight_count = 0

    def channel_gone(self) -> None:
        pass


@pytest.fixture
def topic(tmp_path, clock) -> Topic:
    options = broker_settings(tmp_path, mem_queue_size=1000)
    store = MemoryStore(options)

    def open_queue(name: str, ephemeral: bool) -> OverflowQueue:
        return OverflowQueue(options.mem_queue_size, store.open_queue(name))

    return Topic("t", clock=clock, options=options, store=store, open_queue=open_queue,
                 listener=Listener(), deliveries=DeliveryBatch())


def bodies(start: int, n: int) -> list[bytes]:
    return [b"b%d" % i for i in range(start, start + n)]


def test_a_publish_is_one_run_shared_by_every_channel(topic):
    a, b = topic.channel("a"), topic.channel("b")
    topic.publish(bodies(0, 5))
    (qa, _, _), (qb, _, _) = a.holdings(), b.holdings()
    assert (a.depth(), b.depth(), topic.message_count) == (5, 5, 5)
    assert topic.message_bytes == sum(map(len, bodies(0, 5)))
    assert repr(qa.mem) == repr(qb.mem) == "<MemQueue 5 messages, 1 runs>"
    ca, cb = Consumer(rdy=3), Consumer(rdy=5)
    a.add_client(ca)
    b.add_client(cb)
    a.deliver()
    b.deliver()
    assert [m.body for m in ca.got] == bodies(0, 3)
    assert [m.body for m in cb.got] == bodies(0, 5)
    for x, y in zip(ca.got, cb.got, strict=False):
        assert x is not y and x.id_key is y.id_key and x.id == y.id
    assert (a.depth(), a.in_flight_count(), b.depth()) == (2, 3, 0)


def test_a_single_message_or_a_deferred_publish_stays_a_message(topic):
    channel = topic.channel("c")
    topic.publish([b"one"])
    topic.publish(bodies(0, 2), defer=5.0)
    queue, deferred, _ = channel.holdings()
    assert repr(queue.mem) == "<MemQueue 1 messages, 0 runs>"
    assert len(deferred) == 2


def test_requeued_messages_go_behind_the_runs_in_order(topic):
    channel = topic.channel("c")
    topic.publish(bodies(0, 4))
    topic.publish(bodies(4, 4))
    consumer = Consumer(rdy=3)
    channel.add_client(consumer)
    channel.deliver()
    first = consumer.got[0]
    channel.requeue(consumer, first.id, 0)
    consumer.rdy = 0
    assert [m.body for m, _, _ in channel.peek("queued", 10)] == bodies(3, 5) + [b"b0"]
    consumer.rdy = 100
    channel.deliver()
    assert [m.body for m in consumer.got[3:]] == bodies(3, 5) + [b"b0"]
    assert consumer.got[-1] is first and first.attempts == 2


def test_runs_waiting_at_a_paused_topic_reach_a_new_channel_in_order(topic, clock):
    topic.pause()
    topic.publish(bodies(0, 3))
    topic.publish(bodies(3, 3))
    assert topic.depth() == 6
    assert [m.body for m in topic.peek(10)] == bodies(0, 6)
    channel = topic.channel("c")
    topic.unpause()
    clock.advance(0)
    assert (topic.depth(), channel.depth()) == (0, 6)
    assert delivered(channel) == bodies(0, 6)


def test_empty_and_pause_act_on_runs_as_on_messages(topic):
    channel = topic.channel("c")
    topic.publish(bodies(0, 4))
    channel.pause()
    consumer = Consumer()
    channel.add_client(consumer)
    channel.deliver()
    assert consumer.got == [] and channel.depth() == 4
    channel.unpause()
    assert len(consumer.got) == 4
    topic.publish(bodies(4, 4))
    consumer.rdy = 0
    topic.publish(bodies(8, 4))
    channel.empty()
    assert (channel.depth(), channel.in_flight_count()) == (0, 0)
    consumer.rdy = 100
    topic.publish(bodies(12, 2))
    assert [m.body for m in consumer.got[-2:]] == bodies(12, 2)


def test_a_channel_over_its_memory_bound_overflows_a_run_in_order(tmp_path, clock):
    options = broker_settings(tmp_path, mem_queue_size=5)
    store = MemoryStore(options)
    topic = Topic("t", clock=clock, options=options, store=store,
                  open_queue=lambda name, eph: OverflowQueue(options.mem_queue_size, store.open_queue(name)),
                  listener=Listener(), deliveries=DeliveryBatch())
    a, b = topic.channel("a"), topic.channel("b")
    topic.publish(bodies(0, 4))
    topic.publish(bodies(4, 4))
    for ch in (a, b):
        assert (ch.depth(), ch.backend_depth()) == (8, 3)
        consumer = Consumer()
        ch.add_client(consumer)
        ch.deliver()
        assert [m.body for m in consumer.got] == bodies(0, 8)
        assert all(len(m.id) == ID_SIZE for m in consumer.got)


class RefusingQueue(MemoryQueue):
    """A memory backend that refuses its next `refusals` puts, as a full disk would."""

    def __init__(self, name: str, refusals: int) -> None:
        super().__init__(name)
        self.refusals = refusals

    def put(self, messages, fresh: bool = False) -> None:
        if self.refusals:
            self.refusals -= 1
            raise BackendError("disk full")
        super().put(messages, fresh)


def test_a_refused_drain_gives_a_runs_messages_back_in_order(tmp_path, clock, monkeypatch):
    monkeypatch.setattr("mqd.nsqd.topic.DRAIN_BATCH", 4)  # a drain step ends inside the second run
    options = broker_settings(tmp_path)
    store = MemoryStore(options)

    def open_queue(name: str, ephemeral: bool) -> OverflowQueue:
        if ":" in name:  # a channel: everything to a backend that refuses its first put
            return OverflowQueue(0, RefusingQueue(name, 1))
        return OverflowQueue(100, store.open_queue(name))

    topic = Topic("t", clock=clock, options=options, store=store, open_queue=open_queue,
                  listener=Listener(), deliveries=DeliveryBatch())
    topic.pause()
    topic.publish(bodies(0, 3))
    topic.publish(bodies(3, 3))
    channel = topic.channel("c")
    topic.unpause()
    assert (topic.depth(), channel.depth()) == (6, 0)
    assert [m.body for m in topic.peek(10)] == bodies(0, 6)
    clock.advance(1.0)  # the retry: both steps go through
    clock.advance(0)
    assert (topic.depth(), channel.depth()) == (0, 6)
    assert delivered(channel) == bodies(0, 6)


def test_a_snapshot_capture_sees_a_runs_messages_as_queued(make_broker):
    broker = make_broker()
    topic = broker.topic("t")
    topic.channel("c")
    topic.channel("d")
    topic.publish(bodies(0, 5))
    c = topic.channels["c"]
    consumer = Consumer(rdy=2)
    c.add_client(consumer)
    c.deliver()
    state, env, txn = capture(broker)
    assert env is None and txn is None
    queued = {q.name: [(m.id, m.body) for m in q.queued] for q in state.queues}
    expected = list(zip(ids_of(topic, "d"), bodies(0, 5), strict=True))
    assert queued["t:d"] == expected
    assert queued["t:c"] == expected[2:]
    assert [q.stats["depth"] for q in state.queues if q.name == "t:c"] == [3]
    assert topic.channels["d"].depth() == 5  # the capture moved nothing


def ids_of(topic: Topic, channel: str) -> list[bytes]:
    return [m.id for m, _, _ in topic.channels[channel].peek("queued", 100)]
