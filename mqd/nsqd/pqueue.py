"""A channel's deferred messages by due time, and the heap walk both queues share.

A deferred message (DPUB, REQ with a delay, one brought back deferred
after a restart) waits in a `heapq` heap of ``(due, seq, message)`` and
leaves it only when it is due (`pop_due`) or with every other one
(`drain`, when the channel is emptied or deleted): nothing takes a
deferred message out early, so the heap needs no removal and a message
carries no mark of its place in it. (In-flight messages, which leave one
by one on FIN, REQ and timeout, have a queue of their own:
mqd.nsqd.inflight.)

One sequence counter is shared by every queue of the process: entries
with the same due time keep their order, and no comparison reaches a
message.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

from mqd.message import Message

__all__ = ["DeferredQueue", "best_first", "sequence"]

# Entries' second field: unique, so no comparison ever reaches a message.
sequence = itertools.count()
_heappush = heapq.heappush
_heappop = heapq.heappop


def best_first(heap: list[tuple[Any, ...]]) -> Iterator[int]:
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


class DeferredQueue:
    """The deferred messages of one channel, earliest due first (equal due times in push order)."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Message]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, msg: Message, due: float) -> None:
        """Enter `msg`, due at `due`. A message is pushed once per deferral: it is not in the queue yet."""
        _heappush(self._heap, (due, next(sequence), msg))

    def pop_due(self, now: float) -> list[Message]:
        """Remove and return every message due at or before `now`, earliest first.

        A bad entry (a due time that is not a time, a broken tuple) raises,
        and leaves every message it had taken back in the heap, out of
        order: the caller then calls `repair`. A due time that compares
        neither below nor above `now` (NaN) would hold back every message
        behind it for good, so it raises too.
        """
        heap = self._heap
        due: list[Message] = []
        entry = None
        try:
            while heap and heap[0][0] <= now:
                entry = heap[0]
                _heappop(heap)
                due.append(entry[2])
            if heap and not heap[0][0] > now:
                raise ValueError(f"deferred due time {heap[0][0]!r} is not a time")
        except Exception:
            heap.extend((now, next(sequence), m) for m in due)
            # The entry being taken, unless it was taken whole: a heappop
            # that raises has already dropped it.
            if entry is not None:
                try:
                    taken = bool(due) and due[-1] is entry[2]
                except Exception:
                    taken = False
                if not taken:
                    heap.append(entry)
            raise
        return due

    def repair(self, now: float) -> list[Message]:
        """Rebuild the heap after `pop_due` raised; the messages that are now due at `now`.

        Every well-formed entry keeps its due time; a message whose due time
        is not a time is given `now` (it is delivered at once rather than
        never). Anything that is not a message is dropped, and a message in
        two entries keeps the first. O(n), for a failure only.
        """
        heap: list[tuple[float, int, Message]] = []
        found: set[int] = set()
        seqs: set[int] = set()
        salvaged: list[Message] = []
        for entry in self._heap:
            try:
                due, seq, msg = entry
            except Exception:
                continue
            if not isinstance(msg, Message) or id(msg) in found:
                continue
            found.add(id(msg))
            if due.__class__ in (float, int) and due == due and seq.__class__ is int and seq not in seqs:
                seqs.add(seq)
                heap.append((due, seq, msg))
            else:
                heap.append((now, next(sequence), msg))
                salvaged.append(msg)
        heapq.heapify(heap)
        self._heap = heap
        return salvaged

    def drain(self) -> list[Message]:
        """Remove and return every message, earliest first."""
        heap, self._heap = self._heap, []
        heap.sort()
        return [entry[2] for entry in heap]

    def entries(self) -> list[tuple[float, Message]]:
        """Every message with its due time, in heap (not sorted) order.

        One pass and no sort, for a snapshot's capture on the reactor: the
        caller sorts what it took, in its own thread.
        """
        return [(entry[0], entry[2]) for entry in self._heap]

    def peek(self, count: int) -> list[tuple[float, Message]]:
        """The first `count` messages with their due time, in the order `pop_due` gives them.

        By due time, then by entry (messages pushed with one due time keep
        their order); nothing is popped, so no timer or order changes. The
        cost grows with `count`, not with the queue (`best_first`).
        """
        heap = self._heap
        if count <= 0:
            return []
        return [(heap[i][0], heap[i][2]) for i in itertools.islice(best_first(heap), count)]
