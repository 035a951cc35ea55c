"""The store behind ephemeral topics and channels: overflow is dropped.

nsqd does the same (its dummy backend queue): an ephemeral topic or channel
keeps at most mem-queue-size messages and silently discards the rest, and
nothing of it ever reaches the disk. Its retained logs keep nothing
either (`kept` False): offsets stay at 0 and every read is empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from zope.interface import implementer

from backends.interface import (
    IBackendQueue,
    IBackendStore,
    IRetainedLog,
    IRetainingStore,
    OffsetOutOfRange,
)

if TYPE_CHECKING:
    from mqd.message import Message, Run


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


@implementer(IRetainedLog)
class DummyLog:
    """A retained log that keeps nothing: epoch 0, offsets 0 to 0, appends dropped."""

    __slots__ = ("name",)

    epoch = 0
    kept = False

    def __init__(self, name: str) -> None:
        self.name = name

    def append(self, records: Sequence[Message] | Run, fresh: bool = False) -> None:
        """Accept and drop, as the dummy queue does."""

    def earliest(self) -> int:
        return 0

    def latest(self) -> int:
        return 0

    def retained_bytes(self) -> int:
        return 0

    def oldest_timestamp(self) -> int | None:
        return None

    def offset_for_timestamp(self, timestamp_ns: int) -> int:
        return 0

    def read(self, offset: int, max_messages: int, max_bytes: int) -> list[tuple[int, int, bytes]]:
        if offset != 0:
            raise OffsetOutOfRange(offset, 0, 0)
        return []

    def read_frames(self, offset: int, max_messages: int, max_bytes: int) -> tuple[bytes, int]:
        self.read(offset, max_messages, max_bytes)
        return b"", 0

    def frames_extent(self, offset: int, max_messages: int, max_bytes: int) -> tuple[int, int]:
        self.read(offset, max_messages, max_bytes)
        return 0, 0

    def expire(self, before_ns: int, max_bytes: int) -> int:
        return 0

    def delete(self) -> None:
        pass

    def close(self) -> None:
        pass


@implementer(IBackendStore, IRetainingStore)
class DummyStore:
    durable = False
    # Set by the broker; never called, as nothing is ever written.
    health_listener: Callable[[str | None], Any] | None = None

    def __init__(self, options: Any = None, clock: Any = None) -> None:
        pass

    def open_queue(self, name: str) -> DummyQueue:
        return DummyQueue(name)

    def open_log(self, name: str) -> DummyLog:
        return DummyLog(name)

    def log_names(self) -> list[str]:
        """None kept."""
        return []

    def when_durable(self, callback: Callable[[str | None], Any]) -> None:
        callback(None)

    def begin_close(self) -> None:
        """Nothing to prepare: this store never refuses what it is given."""

    def close(self) -> None:
        pass
