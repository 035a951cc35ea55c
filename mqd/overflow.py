"""OverflowQueue: a topic's or channel's bounded memory queue in front of its backend.

Puts go to memory until `mem-queue-size` is reached, then to the backend;
once anything sits in the backend, new messages go there too, so the queue
stays FIFO across both (nsqd reads memory and disk in random order).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from backends import BackendError

if TYPE_CHECKING:
    from .message import Message

__all__ = ["OverflowQueue", "take"]


def take(items: deque, n: int) -> list:
    """Pop up to `n` items from the left of a deque, as a list."""
    if n >= len(items):
        batch = list(items)
        items.clear()
        return batch
    pop = items.popleft
    return [pop() for _ in range(n)]


class OverflowQueue:
    __slots__ = ("mem", "size", "backend")

    def __init__(self, size: int, backend) -> None:
        self.mem: deque[Message] = deque()
        self.size = size
        self.backend = backend

    def __len__(self) -> int:
        return len(self.mem) + self.backend.depth()

    def __bool__(self) -> bool:
        return bool(self.mem) or bool(self.backend.depth())

    def backend_depth(self) -> int:
        return self.backend.depth()

    def put(self, msgs: list[Message]) -> None:
        """Append in order; raises BackendError if the overflow cannot be stored."""
        mem = self.mem
        backend = self.backend
        room = self.size - len(mem)
        if room >= len(msgs) and not backend.depth():
            mem.extend(msgs)
            return
        if room > 0 and not backend.depth():
            mem.extend(msgs[:room])
            msgs = msgs[room:]
        backend.put(msgs)

    def put_accepted(self, msgs: list[Message]) -> None:
        """Put messages that were acknowledged long ago (requeues, timeouts).

        A failing backend must not lose them: they stay in memory beyond
        the bound instead.
        """
        try:
            self.put(msgs)
        except BackendError:
            self.mem.extend(msgs)

    def refill(self, n: int) -> int:
        """Move up to `n` messages from the backend into memory; how many moved."""
        if not self.backend.depth():
            return 0
        batch = self.backend.read(n)
        self.mem.extend(batch)
        return len(batch)

    def take(self, n: int) -> list[Message]:
        """Remove up to `n` messages from the head, memory first, then the backend."""
        if self.mem:
            return take(self.mem, n)
        return self.backend.read(n) if self.backend.depth() else []

    def empty(self) -> None:
        self.mem.clear()
        self.backend.empty()

    def delete(self) -> None:
        self.mem.clear()
        self.backend.delete()

    def close(self, also: list[Message] | None = None) -> None:
        """Hand what memory holds (then `also`) to the backend and close it."""
        held = list(self.mem)
        self.mem.clear()
        if also:
            held.extend(also)
        if held:
            self.backend.put(held)
        self.backend.close()
