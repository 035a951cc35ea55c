"""Unbounded overflow kept in RAM: fast, and gone when the process ends."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeVar

from zope.interface import implementer

from backends.interface import IBackendQueue, IBackendStore, IRetainingStore
from backends.memory_log import MemoryLog

if TYPE_CHECKING:
    from mqd.message import Message

_T = TypeVar("_T")


def take(items: deque[_T], n: int) -> list[_T]:
    """Pop up to `n` items from the left of a deque, as a list.

    Here because the memory backend is a deque; the broker's own memory
    queues (mqd.nsqd.overflow.MemQueue) take from theirs the same way while
    they hold no run of a publish.
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
        self._items: deque[Message] = deque()
        self._store = store

    def put(self, messages: Sequence[Message], fresh: bool = False) -> None:
        self._items.extend(messages)

    def read(self, count: int) -> list[Message]:
        return take(self._items, count)

    def peek(self, count: int) -> list[Message]:
        return list(islice(self._items, max(count, 0)))

    def finish(self, messages: Sequence[Message]) -> None:
        """Nothing kept once read."""

    def update(self, messages: Sequence[Message]) -> None:
        """Nothing kept once read."""

    def hold(self, messages: Sequence[Message], fresh: bool = False) -> None:
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


@implementer(IBackendStore, IRetainingStore)
class MemoryStore:
    durable = False
    # Set by the broker; never called, as RAM never fails a write.
    health_listener: Callable[[str | None], Any] | None = None

    def __init__(self, options: Any = None, clock: Any = None) -> None:
        self._queues: dict[str, MemoryQueue] = {}
        # The topics' retained logs (backends.memory_log).
        self._logs: dict[str, MemoryLog] = {}

    def open_queue(self, name: str) -> MemoryQueue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = MemoryQueue(name, self)
        return queue

    def forget(self, queue: MemoryQueue) -> None:
        """A deleted queue goes; a newer queue opened under its name stays."""
        if self._queues.get(queue.name) is queue:
            del self._queues[queue.name]

    def when_durable(self, callback: Callable[[str | None], Any]) -> None:
        callback(None)

    def open_log(self, name: str) -> MemoryLog:
        """Topic `name`'s retained log in RAM, new (with a new epoch) unless open already."""
        found = self._logs.get(name)
        if found is None:
            found = self._logs[name] = MemoryLog(name, self._forget_log)
        return found

    def log_names(self) -> list[str]:
        """The topics with a retained log in RAM."""
        return sorted(self._logs)

    def _forget_log(self, retained: MemoryLog) -> None:
        """A deleted log goes; the next open_log makes a new one."""
        if self._logs.get(retained.name) is retained:
            del self._logs[retained.name]

    def begin_close(self) -> None:
        """Nothing to prepare: this store never refuses what it is given."""

    def close(self) -> None:
        self._queues.clear()
