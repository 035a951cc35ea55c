"""A channel's in-flight queue against a plain model: deliveries, FIN, TOUCH, timeouts, peeks, drains."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mqd.message import Message
from mqd.nsqd import inflight
from mqd.nsqd.inflight import InFlightQueue


class InFlightModel(RuleBasedStateMachine):
    """The queue and a dict of live message -> (deadline, entry order, place in the delivery)."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = InFlightQueue()
        self.live: dict[Message, tuple[float, int, int]] = {}
        self.order = 0
        self.made = 0
        self.now = 0.0

    def _sorted(self) -> list[Message]:
        return sorted(self.live, key=self.live.__getitem__)

    @rule(count=st.integers(1, 40), timeout=st.floats(0.0, 20.0))
    def deliver(self, count, timeout):
        msgs = [Message(b"%016d" % (self.made + i), b"", 0) for i in range(count)]
        self.made += count
        state = (object(), self.now)
        for m in msgs:
            m.state = state
        deadline = self.now + timeout
        self.queue.push_batch(msgs, deadline, state)
        self.order += 1
        for i, m in enumerate(msgs):
            self.live[m] = (deadline, self.order, i)

    @precondition(lambda self: self.live)
    @rule(picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=60), requeue=st.booleans())
    def finish(self, picks, requeue):
        """FIN (state None) or REQ with a delay (state a due time) of some live messages."""
        order = self._sorted()
        gone = {order[p % len(order)] for p in picks}
        for m in gone:
            m.state = self.now + 5.0 if requeue else None
            del self.live[m]
        self.queue.forget(len(gone))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6), timeout=st.floats(0.0, 20.0))
    def touch(self, pick, timeout):
        order = self._sorted()
        m = order[pick % len(order)]
        m.state = (m.state[0], m.state[1])
        deadline = self.now + timeout
        self.queue.renew(m, deadline)
        self.order += 1
        self.live[m] = (deadline, self.order, 0)

    @rule(step=st.floats(0.0, 10.0))
    def time_passes(self, step):
        self.now += step
        expected = [m for m in self._sorted() if self.live[m][0] <= self.now]
        assert self.queue.pop_due(self.now) == expected
        for m in expected:
            m.state = None
            del self.live[m]

    @rule(count=st.integers(0, 100))
    def peek(self, count):
        expected = [(self.live[m][0], m) for m in self._sorted()[:count]]
        assert self.queue.peek(count) == expected

    @rule()
    def drain_sometimes(self):
        if len(self.live) > 150:
            assert self.queue.drain() == self._sorted()
            for m in self.live:
                m.state = None
            self.live.clear()

    @invariant()
    def holds_what_is_live(self):
        assert len(self.queue) == len(self.live)
        assert sorted(self.queue.entries(), key=lambda e: self.live[e[1]]) == [
            (self.live[m][0], m) for m in self._sorted()]

    @invariant()
    def holds_few_references_to_messages_that_left(self):
        held = sum(len(entry[3]) for entry in self.queue._heap)
        assert held == self.queue._refs
        assert held <= inflight.COMPACT_SLACK + inflight.COMPACT_FACTOR * len(self.live) + 40


TestInFlightQueue = InFlightModel.TestCase


def test_the_model_holds_with_the_heap_rebuilt_often(monkeypatch):
    monkeypatch.setattr(inflight, "COMPACT_SLACK", 4)
    monkeypatch.setattr(inflight, "COMPACT_FACTOR", 1)
    run_state_machine_as_test(InFlightModel)


def test_messages_that_left_are_not_held_for_their_deadline():
    """FINished messages of deliveries whose deadline is far away do not pile up in the heap."""
    queue = InFlightQueue()
    for n in range(200):
        msgs = [Message(b"%016d" % (n * 100 + i), b"", 0) for i in range(100)]
        state = (object(), 0.0)
        for m in msgs:
            m.state = state
        queue.push_batch(msgs, 3600.0, state)
        for m in msgs[:-1]:
            m.state = None
        queue.forget(99)
    assert len(queue) == 200
    assert sum(len(entry[3]) for entry in queue._heap) <= 1024 + 4 * 200 + 100
    assert len(queue.drain()) == 200
