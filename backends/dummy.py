"""The store behind ephemeral topics and channels: overflow is dropped.

nsqd does the same (its dummy backend queue): an ephemeral topic or channel
keeps at most mem-queue-size messages and silently discards the rest, and
nothing of it ever reaches the disk.
"""

from __future__ import annotations

from zope.interface import implementer

from backends.interface import IBackendQueue, IBackendStore


@implementer(IBackendQueue)
class DummyQueue:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def put(self, messages) -> None:
        """Accept and drop: publishers still get OK, as from nsqd."""

    def read(self, count: int) -> list:
        return []

    def peek(self, count: int) -> list:
        """Nothing is kept, so nothing to see."""
        return []

    def finish(self, messages) -> None:
        """Nothing kept once read."""

    def update(self, messages) -> None:
        """Nothing kept once read."""

    def hold(self, messages) -> None:
        """Not durable: held messages live in the channel only."""

    def depth(self) -> int:
        return 0

    def empty(self) -> None:
        pass

    def delete(self) -> None:
        pass

    def close(self) -> None:
        pass

    def sync(self) -> None:
        pass


@implementer(IBackendStore)
class DummyStore:
    durable = False

    def __init__(self, options=None, clock=None) -> None:
        pass

    def open_queue(self, name: str) -> DummyQueue:
        return DummyQueue(name)

    def when_durable(self, callback) -> None:
        callback(None)

    def close(self) -> None:
        pass
