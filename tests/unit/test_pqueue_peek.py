"""The deferred queue's peek walks the heap best first: the same answer as sorting every entry."""

from __future__ import annotations

import heapq
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from mqd.message import Message
from mqd.nsqd.pqueue import DeferredQueue

_ids = itertools.count()

# Operations on a queue: push a new message at a due time, pop what is due by a time.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 50)),
        st.tuples(st.just("pop"), st.integers(0, 50)),
    ),
    max_size=120,
)


def _message() -> Message:
    return Message(b"%016d" % next(_ids), b"x", 0)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, count=st.integers(0, 40))
def test_peek_is_the_first_entries_by_due_time_then_entry(ops, count):
    pq = DeferredQueue()
    live: list[Message] = []
    for op, value in ops:
        if op == "push":
            msg = _message()
            pq.push(msg, float(value))
            live.append(msg)
        else:
            for msg in pq.pop_due(float(value)):
                live.remove(msg)
    expected = heapq.nsmallest(count, pq._heap, key=lambda e: (e[0], e[1]))
    assert pq.peek(count) == [(e[0], e[2]) for e in expected]
    assert len(pq) == len(live)
    # What peek shows first is what pop_due gives first.
    if expected:
        assert pq.pop_due(expected[-1][0])[:len(expected)] == [e[2] for e in expected]


def test_peek_reads_few_entries_of_a_large_heap():
    """Peeking the first 20 of 100,000 touches about 20 heap nodes, not 100,000."""
    pq = DeferredQueue()
    for i in range(100_000):
        pq.push(_message(), float(i % 997))

    class Counting(list):
        reads = 0

        def __getitem__(self, i):
            Counting.reads += 1
            return super().__getitem__(i)

        def __iter__(self):
            Counting.reads += len(self)
            return super().__iter__()

    pq._heap = Counting(pq._heap)
    first = pq.peek(20)
    assert [p for p, _ in first] == [0.0] * 20
    assert Counting.reads < 200
