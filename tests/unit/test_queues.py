"""Memory queues overflowing to the backend, the deferred queue, and message ids."""

from __future__ import annotations

import itertools
import random

import pytest

from mqd.message import IdFactory, Message, frame_message
from mqd.nsqd.pqueue import DeferredQueue
from tests.support.v2_client import Client
from tests.support.v2_frames import Msg, mpub, ok, parse_frames, pub

# -- memory queue overflow --------------------------------------------------------------


def test_channel_overflow_keeps_fifo_and_depth(make_broker):
    broker = make_broker(mem_queue_size=3)
    c = Client(broker)
    c.sub()  # RDY 0: everything queues at the channel
    p = Client(broker)
    for i in range(6):
        assert p.request(pub("t", b"%d" % i)) == [ok()]
    assert p.request(mpub("t", [b"%d" % i for i in range(6, 10)])) == [ok()]
    channel = broker.topics["t"].channels["c"]
    assert (channel.depth(), channel.backend_depth()) == (10, 7)
    assert broker.topics["t"].depth() == 0
    c.send(b"RDY 4\n")
    got = c.messages()
    assert [m.body for m in got] == [b"0", b"1", b"2", b"3"]
    assert channel.depth() == 6
    # Requeued messages go to the tail, behind what waits in the backend.
    c.send(b"REQ " + got[0].id + b" 0\n")
    c.send(b"RDY 100\n")
    assert [m.body for m in c.messages()] == [b"4", b"5", b"6", b"7", b"8", b"9", b"0"]
    assert (channel.depth(), channel.backend_depth()) == (0, 0)


def test_topic_overflow_keeps_fifo_and_depth(make_broker, clock):
    broker = make_broker(mem_queue_size=3)
    p = Client(broker)
    for i in range(5):
        p.send(pub("t", b"%d" % i))
    p.send(mpub("t", [b"%d" % i for i in range(5, 10)]))
    assert p.read() == [ok()] * 6
    topic = broker.topics["t"]
    assert (topic.depth(), topic.backend_depth()) == (10, 7)
    c = Client(broker)
    c.sub(rdy=100)
    clock.advance(0)  # let any scheduled drain step run
    assert [m.body for m in c.messages()] == [b"%d" % i for i in range(10)]
    assert (topic.depth(), topic.backend_depth()) == (0, 0)


def test_zero_mem_queue_goes_straight_to_backend(make_broker):
    broker = make_broker(mem_queue_size=0)
    c = Client(broker)
    c.sub()
    Client(broker).send(mpub("t", [b"a", b"b", b"c"]))
    channel = broker.topics["t"].channels["c"]
    assert (channel.depth(), channel.backend_depth()) == (3, 3)
    c.send(b"RDY 2\n")
    assert [m.body for m in c.messages()] == [b"a", b"b"]


def test_large_topic_backlog_drains_over_reactor_turns(make_broker, clock):
    broker = make_broker(mem_queue_size=100)
    p = Client(broker)
    n = 20000
    p.send(mpub("t", [b"%d" % i for i in range(n)]))
    clock.advance(0)  # a big MPUB is published a chunk per reactor turn
    assert p.read() == [ok()]
    topic = broker.topics["t"]
    assert (topic.depth(), topic.backend_depth()) == (n, n - 100)
    c = Client(broker)
    c.sub(rdy=2500)
    channel = topic.channels["c"]
    clock.advance(0)
    clock.advance(0)
    clock.advance(0)
    assert topic.depth() == 0
    assert channel.depth() + channel.in_flight_count() == n
    got = c.messages()
    assert [m.body for m in got] == [b"%d" % i for i in range(2500)]


# -- the deferred queue -------------------------------------------------------------------------


def msg(i: int) -> Message:
    return Message(b"%016d" % i, b"body", 0)


def test_pq_pop_due_in_priority_order():
    pq = DeferredQueue()
    msgs = [msg(i) for i in range(10)]
    prios = [5, 3, 9, 1, 7, 2, 8, 0, 6, 4]
    for m, p in zip(msgs, prios, strict=True):
        pq.push(m, p)
    assert len(pq) == 10
    assert pq.peek(1) == [(0, msgs[7])]
    due = pq.pop_due(4)
    assert [prios[msgs.index(m)] for m in due] == [0, 1, 2, 3, 4]
    assert len(pq) == 5
    assert pq.pop_due(4) == []
    assert [prios[msgs.index(m)] for m in pq.pop_due(100)] == [5, 6, 7, 8, 9]
    assert len(pq) == 0
    assert pq.peek(1) == []


def test_pq_equal_priorities_keep_push_order():
    pq = DeferredQueue()
    msgs = [msg(i) for i in range(5)]
    for m in msgs:
        pq.push(m, 1.0)
    assert pq.pop_due(1.0) == msgs


def test_pq_drain_returns_all_in_order_and_empties():
    pq = DeferredQueue()
    msgs = [msg(i) for i in range(6)]
    for i, m in enumerate(msgs):
        pq.push(m, 10 - i)
    pq.push(msg(99), 7)  # the same due time as msgs[3]: after it
    drained = pq.drain()
    assert [m.id for m in drained] == [msgs[5].id, msgs[4].id, msgs[3].id, b"%016d" % 99,
                                       msgs[2].id, msgs[1].id, msgs[0].id]
    assert len(pq) == 0
    assert pq.pop_due(100) == []
    assert pq.entries() == []


def test_pq_entries_are_every_message_with_its_due_time():
    pq = DeferredQueue()
    msgs = [msg(i) for i in range(50)]
    for i, m in enumerate(msgs):
        pq.push(m, float(i % 7))
    assert sorted((due, m.id) for due, m in pq.entries()) == sorted((float(i % 7), m.id) for i, m in enumerate(msgs))
    assert len(pq) == 50  # reading them takes nothing out


def test_pq_random_operations_match_model():
    rng = random.Random(42)
    pq = DeferredQueue()
    live: dict[int, tuple[float, int]] = {}
    order = itertools.count()
    pool = [msg(i) for i in range(300)]
    now = 0.0
    for _ in range(5000):
        if rng.random() < 0.6:
            free = [i for i in range(len(pool)) if i not in live]
            if not free:
                continue
            i = rng.choice(free)
            # Often a due time already used, to check the push order of ties.
            prio = float(int(now + rng.random() * 10))
            pq.push(pool[i], prio)
            live[i] = (prio, next(order))
        else:
            now += rng.random()
            due = pq.pop_due(now)
            expected = sorted((key, i) for i, key in live.items() if key[0] <= now)
            assert [m.id for m in due] == [pool[i].id for _, i in expected]
            for _, i in expected:
                del live[i]
        assert len(pq) == len(live)
        heap = pq._heap
        assert all(heap[(k - 1) // 2][:2] <= heap[k][:2] for k in range(1, len(heap)))
    rest = pq.drain()
    assert [m.id for m in rest] == [pool[i].id for _, i in sorted((key, i) for i, key in live.items())]

# -- ids and frames ----------------------------------------------------------------------------------


def _check_ids(ids: list[bytes]) -> None:
    assert all(len(i) == 16 for i in ids)
    assert all(i == i.lower() and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == len(ids)
    values = [int(i, 16) for i in ids]
    assert values == sorted(values)
    assert ids == sorted(ids)  # fixed width: byte order is numeric order


def test_ids_unique_and_increasing_beyond_4096_in_one_call():
    f = IdFactory(5)
    now = 1_700_000_000 * 10**9
    ids = f.new_ids(10000, now)
    assert len(ids) == 10000
    _check_ids(ids)
    more = f.new_ids(5000, now)  # same instant again
    _check_ids(ids + more)


def test_ids_carry_node_id():
    f = IdFactory(1023)
    for i in f.new_ids(5000, 1_700_000_000 * 10**9):
        assert (int(i, 16) >> 12) & 1023 == 1023


def test_ids_increase_even_if_clock_goes_back():
    f = IdFactory(1)
    now = 1_700_000_000 * 10**9
    a = f.new_ids(3, now)
    b = f.new_ids(3, now - 10**9)
    c = f.new_ids(3, now + 10**9)
    _check_ids(a + b + c)


def test_ids_timestamp_part():
    f = IdFactory(0)
    now = 1_700_000_000 * 10**9
    [i] = f.new_ids(1, now)
    assert int(i, 16) >> 22 == (now >> 20) - 1288834974657


@pytest.mark.parametrize("node", [-1, 1024])
def test_bad_node_id(node):
    with pytest.raises(ValueError):
        IdFactory(node)


def test_message_copy_is_independent():
    m = Message(b"0" * 16, b"body", 123, attempts=2, deferred_until=5.0)
    c = m.copy()
    assert (c.id, c.body, c.timestamp, c.attempts, c.deferred_until) == (m.id, m.body, 123, 2, 5.0)
    c.attempts += 1
    assert m.attempts == 2
    assert c.client is None and c.key is None  # no delivery, no record of its own yet


def test_frame_message_layout():
    m = Message(b"0123456789abcdef", b"hello", 1_700_000_000_123_456_789, attempts=3)
    data = frame_message(m)
    assert data[:8] == (4 + 26 + 5).to_bytes(4, "big") + (2).to_bytes(4, "big")
    assert parse_frames(data) == [Msg(1_700_000_000_123_456_789, 3, b"0123456789abcdef", b"hello")]
