"""The store behind ephemeral topics and channels: overflow is dropped.

nsqd does the same (its dummy backend queue): an ephemeral topic or channel
keeps at most mem-queue-size messages and silently discards the rest, and
nothing of it ever reaches the disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from zope.interface import implementer

from backends.interface import IBackendQueue, IBackendStore

if TYPE_CHECKING:
    from mqd.message import Message


@implementer(IBackendQueue)
class DummyQueue:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def put(self, messages: Sequence[Message], fresh: bool = False) -> None:
        """Accept and drop: publishers still get OK, as from nsqd."""

    def read(self, count: int) -> list[Message]:
        return []

    def peek(self, count: int) -> list[Message]:
        """Nothing is kept, so nothing to see."""
        return []

    def finish(self, messages: Sequence[Message]) -> None:
        """Nothing kept once read."""

    def update(self, messages: Sequence[Message]) -> None:
        """Nothing kept once read."""

    def hold(self, messages: Sequence[Message], fresh: bool = False) -> None:
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
    # Set by the broker; never called, as nothing is ever written.
    health_listener: Callable[[str | None], Any] | None = None

    def __init__(self, options: Any = None, clock: Any = None) -> None:
        pass

    def open_queue(self, name: str) -> DummyQueue:
        return DummyQueue(name)

    def when_durable(self, callback: Callable[[str | None], Any]) -> None:
        callback(None)

    def begin_close(self) -> None:
        """Nothing to prepare: this store never refuses what it is given."""

    def close(self) -> None:
        pass
