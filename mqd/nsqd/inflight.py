"""A channel's in-flight messages by deadline: one heap entry per delivery, not per message.

A delivery hands a client a batch of messages that share one deadline (now
plus the client's msg_timeout) and one state object (`Message.state`, the
delivery's `(client, delivered_at)`), so the queue keeps one `heapq` entry
per delivery: ``(deadline, seq, state, messages)``. A message is live in an
entry while its state is that entry's state object. A FIN, REQ or timeout
changes the message's state (to None, a due time, or a later delivery's),
which is all it takes to leave the queue: nothing in the heap is touched
per message, and a delivery costs one entry whatever its size. TOUCH gives
the message a new state object, equal to the old one, in an entry of its
own.

Entries whose messages have all moved on die lazily: popped when their
deadline comes, or dropped when the heap is rebuilt because it holds many
more message references than live messages (O(n), amortised O(1) per
message that left), which keeps memory bounded however long msg_timeout
is.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from mqd.message import Message
from mqd.nsqd.pqueue import best_first, sequence

__all__ = ["InFlightQueue"]

_heappush = heapq.heappush
_heappop = heapq.heappop

# Rebuild when the heap holds this many more message references than live
# messages and at least four times as many: rebuilding less often costs
# less per FIN than the memory the dead references hold.
COMPACT_SLACK = 1024
COMPACT_FACTOR = 4


class InFlightQueue:
    """The in-flight messages of one channel, earliest deadline first.

    The queue reads `Message.state` but never writes it: the channel gives
    a message its delivery's state before `push_batch`, and changes it
    before telling the queue (`forget`) that the message left.
    """

    __slots__ = ("_heap", "_live", "_refs", "_top")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, object, list[Message]]] = []
        self._live = 0
        # Message references held by the entries, live or not.
        self._refs = 0
        # No entry's deadline is above this (the highest pushed since the
        # heap was last emptied): entries at or above it may be appended.
        self._top = float("-inf")

    def __len__(self) -> int:
        return self._live

    def _push(self, deadline: float, state: object, msgs: list[Message]) -> None:
        entry = (deadline, next(sequence), state, msgs)
        if deadline >= self._top:
            # A delivery's deadline is normally the latest in the heap (now +
            # a client's fixed timeout): appending it keeps the heap ordered.
            self._top = deadline
            self._heap.append(entry)
        else:
            _heappush(self._heap, entry)
        self._refs += len(msgs)

    def push_batch(self, msgs: list[Message], deadline: float, state: object) -> None:
        """Enter a delivery: `msgs`, whose state is `state`, all due at `deadline`.

        The queue keeps the list itself: the caller must not change it.
        """
        self._push(deadline, state, msgs)
        self._live += len(msgs)

    def renew(self, msg: Message, deadline: float) -> None:
        """A live message's new deadline (TOUCH): its new state is already set, its old entry is dead for it."""
        self._push(deadline, msg.state, [msg])
        self._compact_if_sparse()

    def forget(self, count: int) -> None:
        """`count` live messages left the queue: their state has already changed."""
        self._live -= count
        self._compact_if_sparse()

    def _compact_if_sparse(self) -> None:
        # Counts message references rather than entries: one entry may hold
        # a whole delivery.
        if self._refs > COMPACT_SLACK + COMPACT_FACTOR * self._live:
            heap = []
            for deadline, seq, state, msgs in self._heap:
                live = [m for m in msgs if m.state is state]
                if live:
                    heap.append((deadline, seq, state, live))
            heapq.heapify(heap)
            self._heap = heap
            self._refs = self._live

    def pop_due(self, now: float) -> list[Message]:
        """Remove and return every live message whose deadline is <= `now`, earliest first.

        Their state is still their delivery's: the caller changes it.

        A bad entry (a deadline that is not a time, a broken tuple, something
        other than messages) raises, and leaves every message it had taken
        back in the heap, out of order: the caller then calls `repair`. A
        deadline that compares neither below nor above `now` (NaN) would
        stop every deadline behind it for good, so it raises too.
        """
        heap = self._heap
        due: list[Message] = []
        # The entry being taken: a heappop that raises has already dropped it.
        entry = None
        try:
            while heap and heap[0][0] <= now:
                entry = heap[0]
                _heappop(heap)
                _, _, state, msgs = entry
                self._refs -= len(msgs)
                due += [m for m in msgs if m.state is state]
                entry = None
            if heap and not heap[0][0] > now:
                raise ValueError(f"in-flight deadline {heap[0][0]!r} is not a time")
        except Exception:
            if entry is not None:
                heap.append(entry)
            heap.extend((now, next(sequence), m.state, [m]) for m in due)
            raise
        self._live -= len(due)
        return due

    def repair(self, now: float, held: Iterable[Message]) -> list[Message]:
        """Rebuild the heap from its good entries and `held`; the live messages now due at `now`.

        For a channel whose heap raised in `pop_due` (a bad entry) or whose
        in-flight table (`held`) counts other messages than the heap. Every
        well-formed entry keeps its deadline. The live messages of an entry
        whose deadline is not a time, and the messages of `held` that are
        in flight but live in no entry (theirs was unreadable or lost), are
        given `now` as deadline: they time out at once rather than never.
        Anything that is not a message is dropped, and a message live in
        two entries keeps the first. O(n), for a failure only.
        """
        heap: list[tuple[float, int, object, list[Message]]] = []
        found: set[int] = set()
        seqs: set[int] = set()
        salvaged: list[Message] = []
        for entry in self._heap:
            try:
                deadline, seq, state, msgs = entry
                if state.__class__ is not tuple:
                    continue  # not a delivery: nothing in it is in flight
                live: list[Message] = []
                ids: set[int] = set()
                for m in msgs:
                    if isinstance(m, Message) and m.state is state and id(m) not in found \
                            and id(m) not in ids:
                        ids.add(id(m))
                        live.append(m)
            except Exception:
                continue  # unreadable: its messages, if in flight, are found in `held`
            if not live:
                continue
            found |= ids
            if deadline.__class__ in (float, int) and deadline == deadline and seq.__class__ is int \
                    and seq not in seqs:
                seqs.add(seq)
                heap.append((deadline, seq, state, live))
            else:
                heap.append((now, next(sequence), state, live))
                salvaged += live
        for m in held:
            if m.state.__class__ is tuple and id(m) not in found:
                found.add(id(m))
                heap.append((now, next(sequence), m.state, [m]))
                salvaged.append(m)
        heapq.heapify(heap)
        self._heap = heap
        self._live = self._refs = len(found)
        self._top = max((e[0] for e in heap), default=float("-inf"))
        return salvaged

    def drain(self) -> list[Message]:
        """Remove and return every live message, earliest deadline first."""
        live = [m for _, _, state, msgs in sorted(self._heap) for m in msgs if m.state is state]
        self._heap = []
        self._live = self._refs = 0
        self._top = float("-inf")
        return live

    def entries(self) -> list[tuple[float, Message]]:
        """Every live message with its deadline, in heap (not sorted) order.

        One pass and no sort, for a snapshot's capture on the reactor: the
        caller sorts what it took, in its own thread.
        """
        return [(deadline, m) for deadline, _, state, msgs in self._heap for m in msgs if m.state is state]

    def peek(self, count: int) -> list[tuple[float, Message]]:
        """The first `count` live messages with their deadline, in the order `pop_due` gives them.

        By deadline, then by delivery, then in the delivery's order; nothing
        is popped. The cost grows with `count` and the dead references met
        on the way, not with the queue (`best_first`).
        """
        heap = self._heap
        found: list[tuple[float, Message]] = []
        if count <= 0:
            return found
        for i in best_first(heap):
            deadline, _, state, msgs = heap[i]
            for m in msgs:
                if m.state is state:
                    found.append((deadline, m))
                    if len(found) >= count:
                        return found
        return found
