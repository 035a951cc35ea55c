"""A priority queue of messages: a channel's deferred ones, by due time.

A `heapq` heap of ``(priority, seq, message)`` with lazy removal: replacing
or removing a message does not search the heap, it only changes the
message's ``pq_seq`` so the old entry no longer matches and is skipped
when it surfaces. Removal is O(1), push and pop O(log n); when dead
entries outnumber live ones the heap is rebuilt (O(n), so amortised O(1)
per removal), which keeps memory bounded however long the timeouts are.
(In-flight messages, which come and go a delivery at a time, have a queue
of their own: mqd.nsqd.inflight.)

One sequence counter is shared by every queue of the process, so a message
moving from one queue to another can never make a stale entry look live
again.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from mqd.message import Message

__all__ = ["COMPACT_FACTOR", "COMPACT_SLACK", "PriorityQueue", "best_first", "sequence"]

# Entries' second field: unique, so no comparison ever reaches a message.
sequence = itertools.count()
_heappush = heapq.heappush
_heappop = heapq.heappop

# Rebuild when the heap holds this many more entries than live messages and
# at least four times as many: rebuilding less often costs less per FIN than
# the memory the dead entries hold.
COMPACT_SLACK = 1024
COMPACT_FACTOR = 4


def best_first(heap: list[tuple]) -> Iterator[int]:
    """The indices of a heap's entries in the order popping would give them, popping nothing.

    Walked from the root through a second, small heap of the entries
    reached (by their first two fields), so taking the first k costs
    O(k log k), not a pass over the heap: a peek at the first 20 of a
    million entries does not scan the million.
    """
    if not heap:
        return
    size = len(heap)
    frontier = [(heap[0][0], heap[0][1], 0)]
    while frontier:
        i = _heappop(frontier)[2]
        yield i
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                entry = heap[child]
                _heappush(frontier, (entry[0], entry[1], child))


class PriorityQueue:
    __slots__ = ("_heap", "_live", "_top")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Message]] = []
        self._live = 0
        # No entry's priority is above this (the highest pushed since the
        # heap was last emptied): entries at or above it may be appended.
        self._top = float("-inf")

    def __len__(self) -> int:
        return self._live

    def push(self, msg: Message, priority: float) -> None:
        """Enter `msg` due at `priority`, replacing any entry it already has here."""
        seq = next(sequence)
        replacing = msg.pq_seq >= 0
        if not replacing:
            self._live += 1
        msg.pq_seq = seq
        if priority > self._top:
            self._top = priority
        _heappush(self._heap, (priority, seq, msg))
        if replacing:
            self._compact_if_sparse()

    def push_batch(self, msgs: list[Message], priority: float) -> None:
        """Enter messages that are not in this queue yet, all due at `priority`.

        The delivery path's form of `push`: one call per batch handed to a
        client, not one per message. A delivery's deadline is normally the
        latest in the heap (now + a client's fixed timeout), and entries no
        smaller than every other keep the heap ordered when appended, so
        the batch is appended in one C call instead of pushed one by one.
        """
        n = len(msgs)
        seqs = list(itertools.islice(sequence, n))
        for msg, seq in zip(msgs, seqs, strict=True):
            msg.pq_seq = seq
        entries = zip(itertools.repeat(priority, n), seqs, msgs, strict=True)
        heap = self._heap
        if priority >= self._top:
            self._top = priority
            heap.extend(entries)
        else:
            for entry in entries:
                _heappush(heap, entry)
        self._live += n

    def discard(self, msg: Message) -> None:
        """Forget `msg` (which must be in this queue); its heap entry dies lazily."""
        msg.pq_seq = -1
        self._live -= 1
        self._compact_if_sparse()

    def discard_many(self, msgs: list[Message]) -> None:
        """`discard` for a run of FINs: the sparseness test once, not per message."""
        for msg in msgs:
            msg.pq_seq = -1
        self._live -= len(msgs)
        self._compact_if_sparse()

    def _compact_if_sparse(self) -> None:
        heap = self._heap
        if len(heap) > COMPACT_SLACK + COMPACT_FACTOR * self._live:
            self._heap = [entry for entry in heap if entry[2].pq_seq == entry[1]]
            heapq.heapify(self._heap)

    def pop_due(self, now: float) -> list[Message]:
        """Remove and return every live message whose priority is <= `now`, earliest first."""
        heap = self._heap
        due: list[Message] = []
        while heap and heap[0][0] <= now:
            _, seq, msg = _heappop(heap)
            if msg.pq_seq == seq:
                msg.pq_seq = -1
                due.append(msg)
        self._live -= len(due)
        return due

    def next_due(self) -> float | None:
        """The earliest live priority, or None when empty."""
        heap = self._heap
        while heap and heap[0][2].pq_seq != heap[0][1]:
            _heappop(heap)
        return heap[0][0] if heap else None

    def drain(self) -> list[Message]:
        """Remove and return every live message, earliest first."""
        live = sorted(entry for entry in self._heap if entry[2].pq_seq == entry[1])
        for _, _, msg in live:
            msg.pq_seq = -1
        self._heap = []
        self._live = 0
        self._top = float("-inf")
        return [msg for _, _, msg in live]

    def entries(self) -> list[tuple[float, Message]]:
        """Every live message with its priority, in heap (not sorted) order.

        One pass and no sort, for a snapshot's capture on the reactor: the
        caller sorts what it took, in its own thread.
        """
        return [(entry[0], entry[2]) for entry in self._heap if entry[2].pq_seq == entry[1]]

    def peek(self, count: int) -> list[tuple[float, Message]]:
        """The first `count` live messages with their priority, in the order `pop_due` gives them.

        By priority, then by entry (messages pushed with one priority keep
        their order); nothing is popped, so no timer or order changes.
        The cost grows with `count` and the dead entries met on the way, not
        with the queue (`best_first`).
        """
        heap = self._heap
        found: list[tuple[float, Message]] = []
        if count <= 0:
            return found
        for i in best_first(heap):
            priority, seq, msg = heap[i]
            if msg.pq_seq == seq:
                found.append((priority, msg))
                if len(found) >= count:
                    break
        return found

    def __iter__(self) -> Iterator[Message]:
        return (entry[2] for entry in self._heap if entry[2].pq_seq == entry[1])
