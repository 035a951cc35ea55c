"""Memory queues overflowing to the backend, the priority queue, and message ids."""

from __future__ import annotations

import itertools
import random

import pytest

from mqd.message import IdFactory, Message, frame_message
from mqd.nsqd.pqueue import COMPACT_FACTOR, COMPACT_SLACK, PriorityQueue
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


# -- PriorityQueue ------------------------------------------------------------------------------


def msg(i: int) -> Message:
    return Message(b"%016d" % i, b"body", 0)


def test_pq_pop_due_in_priority_order():
    pq = PriorityQueue()
    msgs = [msg(i) for i in range(10)]
    prios = [5, 3, 9, 1, 7, 2, 8, 0, 6, 4]
    for m, p in zip(msgs, prios, strict=True):
        pq.push(m, p)
    assert len(pq) == 10
    assert pq.next_due() == 0
    due = pq.pop_due(4)
    assert [prios[msgs.index(m)] for m in due] == [0, 1, 2, 3, 4]
    assert len(pq) == 5
    assert pq.pop_due(4) == []
    assert [prios[msgs.index(m)] for m in pq.pop_due(100)] == [5, 6, 7, 8, 9]
    assert len(pq) == 0
    assert pq.next_due() is None


def test_pq_equal_priorities_keep_push_order():
    pq = PriorityQueue()
    msgs = [msg(i) for i in range(5)]
    for m in msgs:
        pq.push(m, 1.0)
    assert pq.pop_due(1.0) == msgs


def test_pq_discard():
    pq = PriorityQueue()
    a, b, c = msg(1), msg(2), msg(3)
    pq.push(a, 1)
    pq.push(b, 2)
    pq.push(c, 3)
    pq.discard(b)
    assert len(pq) == 2
    assert b.pq_seq == -1
    pq.discard(a)
    assert pq.next_due() == 3
    assert pq.pop_due(10) == [c]
    assert len(pq) == 0


def test_pq_push_again_replaces_entry():
    pq = PriorityQueue()
    a, b = msg(1), msg(2)
    pq.push(a, 1)
    pq.push(b, 2)
    pq.push(a, 5)  # TOUCH: a new deadline
    assert len(pq) == 2
    assert pq.pop_due(4) == [b]
    assert pq.pop_due(10) == [a]
    assert len(pq) == 0


def test_pq_push_batch():
    pq = PriorityQueue()
    first = [msg(i) for i in range(3)]
    pq.push(msg(99), 0.5)
    pq.push_batch(first, 1.0)
    pq.push_batch([msg(10), msg(11)], 2.0)
    assert len(pq) == 6
    due = pq.pop_due(1.0)
    assert [m.id for m in due] == [b"%016d" % 99] + [m.id for m in first]
    assert len(pq) == 2


def test_pq_drain_returns_live_in_order_and_empties():
    pq = PriorityQueue()
    msgs = [msg(i) for i in range(6)]
    for i, m in enumerate(msgs):
        pq.push(m, 10 - i)
    pq.discard(msgs[2])
    drained = pq.drain()
    assert drained == [msgs[5], msgs[4], msgs[3], msgs[1], msgs[0]]
    assert all(m.pq_seq == -1 for m in drained)
    assert len(pq) == 0
    assert pq.pop_due(100) == []
    assert list(pq) == []


def test_pq_iter_yields_live_only():
    pq = PriorityQueue()
    msgs = [msg(i) for i in range(4)]
    for m in msgs:
        pq.push(m, 1)
    pq.discard(msgs[0])
    pq.push(msgs[1], 2)
    assert sorted(m.id for m in pq) == sorted(m.id for m in msgs[1:])


def test_pq_message_moving_between_queues():
    in_flight, deferred = PriorityQueue(), PriorityQueue()
    m = msg(1)
    in_flight.push(m, 1)
    in_flight.discard(m)  # REQ with delay: out of flight ...
    deferred.push(m, 5)  # ... into deferred
    assert in_flight.pop_due(100) == []
    assert len(in_flight) == 0
    assert deferred.pop_due(100) == [m]


def test_pq_compaction_bounds_heap():
    pq = PriorityQueue()
    msgs = [msg(i) for i in range(20000)]
    pq.push_batch(msgs, 1000.0)
    for m in msgs[:-10]:
        pq.discard(m)
        assert len(pq._heap) <= COMPACT_SLACK + COMPACT_FACTOR * len(pq) + 1
    assert len(pq) == 10
    assert len(pq._heap) <= COMPACT_SLACK + 21
    assert pq.pop_due(1000.0) == msgs[-10:]


def test_pq_compaction_under_repeated_touch():
    pq = PriorityQueue()
    msgs = [msg(i) for i in range(10)]
    for m in msgs:
        pq.push(m, 1)
    for r in range(2000):
        for m in msgs:
            pq.push(m, 2 + r)  # every TOUCH leaves a dead entry behind
    assert len(pq) == 10
    # Every re-push (TOUCH) leaves a dead entry; compaction keeps them bounded.
    assert len(pq._heap) <= COMPACT_SLACK + COMPACT_FACTOR * len(pq) + 1
    assert sorted(m.id for m in pq.pop_due(10**6)) == sorted(m.id for m in msgs)


def test_pq_random_operations_match_model():
    rng = random.Random(42)
    pq = PriorityQueue()
    live: dict[int, float] = {}
    pool = [msg(i) for i in range(300)]
    now = 0.0
    for _ in range(5000):
        i = rng.randrange(len(pool))
        op = rng.random()
        if op < 0.5:
            prio = now + rng.random() * 10
            pq.push(pool[i], prio)
            live[i] = prio
        elif op < 0.8 and i in live:
            pq.discard(pool[i])
            del live[i]
        else:
            now += rng.random()
            due = pq.pop_due(now)
            expected = sorted((p, i) for i, p in live.items() if p <= now)
            # Random float priorities: no ties, so the order is fully determined.
            assert [m.id for m in due] == [pool[i].id for _, i in expected]
            for _, i in expected:
                del live[i]
        assert len(pq) == len(live)
    rest = pq.drain()
    assert sorted(m.id for m in rest) == sorted(pool[i].id for i in live)
    assert [live[pool.index(m)] for m in rest] == sorted(live.values())


def test_pq_push_batch_appended_or_pushed_matches_model():
    """push_batch appends when its priority is the highest and pushes otherwise:
    either way the heap stays a heap and pops in (priority, push order)."""
    rng = random.Random(7)
    pq = PriorityQueue()
    live: dict[int, tuple[float, int]] = {}
    pool = [msg(i) for i in range(400)]
    order = itertools.count()
    now = 0.0
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            free = [i for i in range(len(pool)) if i not in live]
            batch = rng.sample(free, min(len(free), rng.randrange(1, 20)))
            # Mostly the latest deadline (a delivery), sometimes an earlier one.
            prio = now + (10 + rng.random() if rng.random() < 0.8 else rng.random() * 10)
            pq.push_batch([pool[i] for i in batch], prio)
            live.update((i, (prio, next(order))) for i in batch)
        elif op < 0.55 and live:
            i = rng.choice(list(live))
            prio = now + rng.random() * 20
            pq.push(pool[i], prio)
            live[i] = (prio, next(order))
        elif op < 0.8 and live:
            i = rng.choice(list(live))
            pq.discard(pool[i])
            del live[i]
        else:
            now += rng.random() * 3
            due = pq.pop_due(now)
            expected = sorted((key, i) for i, key in live.items() if key[0] <= now)
            assert [m.id for m in due] == [pool[i].id for _, i in expected]
            for _, i in expected:
                del live[i]
        heap = pq._heap
        assert all(heap[(k - 1) // 2][:2] <= heap[k][:2] for k in range(1, len(heap)))
        assert len(pq) == len(live)


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
    assert c.client is None and c.pq_seq == -1


def test_frame_message_layout():
    m = Message(b"0123456789abcdef", b"hello", 1_700_000_000_123_456_789, attempts=3)
    data = frame_message(m)
    assert data[:8] == (4 + 26 + 5).to_bytes(4, "big") + (2).to_bytes(4, "big")
    assert parse_frames(data) == [Msg(1_700_000_000_123_456_789, 3, b"0123456789abcdef", b"hello")]
