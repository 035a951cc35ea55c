"""Unbounded overflow kept in RAM: fast, and gone when the process ends."""

from __future__ import annotations

from collections import deque
from itertools import islice

from zope.interface import implementer

from backends.interface import IBackendQueue, IBackendStore


def take(items: deque, n: int) -> list:
    """Pop up to `n` items from the left of a deque, as a list.

    Here because the memory backend is a deque; the broker's own memory
    queues (mqd.nsqd.overflow, mqd.nsqd.channel) take from theirs the same way.
    """
    if n >= len(items):
        batch = list(items)
        items.clear()
        return batch
    pop = items.popleft
    return [pop() for _ in range(n)]


@implementer(IBackendQueue)
class MemoryQueue:
    __slots__ = ("name", "_items", "_store")

    def __init__(self, name: str, store: MemoryStore | None = None) -> None:
        self.name = name
        self._items: deque = deque()
        self._store = store

    def put(self, messages) -> None:
        self._items.extend(messages)

    def read(self, count: int) -> list:
        return take(self._items, count)

    def peek(self, count: int) -> list:
        return list(islice(self._items, max(count, 0)))

    def finish(self, messages) -> None:
        """Nothing kept once read."""

    def update(self, messages) -> None:
        """Nothing kept once read."""

    def hold(self, messages) -> None:
        """Not durable: held messages live in the channel only."""

    def depth(self) -> int:
        return len(self._items)

    def empty(self) -> None:
        self._items.clear()

    def delete(self) -> None:
        """Drop the messages and make the store forget the queue, or every deleted queue would stay."""
        self._items.clear()
        if self._store is not None:
            self._store.forget(self)

    def close(self) -> None:
        """Nothing to release; what the queue holds dies with the process."""

    def sync(self) -> None:
        """RAM has nothing to sync."""


@implementer(IBackendStore)
class MemoryStore:
    durable = False

    def __init__(self, options=None, clock=None) -> None:
        self._queues: dict[str, MemoryQueue] = {}

    def open_queue(self, name: str) -> MemoryQueue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = MemoryQueue(name, self)
        return queue

    def forget(self, queue: MemoryQueue) -> None:
        """A deleted queue goes; a newer queue opened under its name stays."""
        if self._queues.get(queue.name) is queue:
            del self._queues[queue.name]

    def when_durable(self, callback) -> None:
        callback(None)

    def close(self) -> None:
        self._queues.clear()
