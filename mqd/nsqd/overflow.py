"""OverflowQueue: a topic's or channel's bounded memory queue in front of its backend.

Puts go to memory until `mem-queue-size` is reached, then to the backend;
once anything sits in the backend, new messages go there too, so the queue
stays FIFO across both (nsqd reads memory and disk in random order).

Memory (`MemQueue`) holds `Message` objects and, for fresh publishes held
only in memory, compact runs (mqd.message.Run) that become Messages as
they are taken.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import chain, islice
from typing import TYPE_CHECKING

from backends import BackendError
from backends.interface import IPiecewisePeek
from backends.memory import take
from mqd.logs import get_logger
from mqd.message import Run, run_messages

if TYPE_CHECKING:
    from backends.interface import IBackendQueue
    from mqd.message import Message

__all__ = ["MemQueue", "OverflowQueue"]

log = get_logger(__name__)


class MemQueue:
    """A queue's messages in memory, in order: `Message` objects and runs of fresh publishes.

    A run (mqd.message.Run) is one publish's messages held compactly and
    shared by every queue it was put in; this queue makes their `Message`
    objects as it hands them out (`take`), and only the first run it holds
    can be partly taken (`_pos` of its messages are gone): messages are
    taken from the head, and only Messages are put back there (`untake`).
    Everything that reads the queue (`take`, `peek`, iterating) sees the
    same messages in the same order, whichever way they are held; `peek`
    and iterating make Messages of their own for a run's messages, and the
    run keeps its own.

    `count` is the number of messages (what `len` gives), kept as a slot
    so the delivery path reads it without a call.
    """

    __slots__ = ("count", "_items", "_runs", "_pos")

    def __init__(self) -> None:
        self.count = 0
        self._items: deque[Message | Run] = deque()
        self._runs = 0  # runs among _items: none means _items is a plain deque of Messages
        self._pos = 0  # messages already taken from the first run

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self) -> Iterator[Message]:
        return iter(self.peek(self.count))

    def __repr__(self) -> str:
        return f"<MemQueue {self.count} messages, {self._runs} runs>"

    def extend(self, msgs: list[Message]) -> None:
        """Messages at the tail, in order."""
        self._items.extend(msgs)
        self.count += len(msgs)

    def append(self, msg: Message) -> None:
        self._items.append(msg)
        self.count += 1

    def add(self, msgs: list[Message] | Run) -> None:
        """A list of Messages, or a run, at the tail."""
        if isinstance(msgs, Run):
            self._items.append(msgs)
            self._runs += 1
        else:
            self._items.extend(msgs)
        self.count += len(msgs)

    def untake(self, msgs: list[Message]) -> None:
        """Messages that `take` returned, back at the head in their order."""
        self._items.extendleft(reversed(msgs))
        self.count += len(msgs)

    def take(self, n: int) -> list[Message]:
        """Remove up to `n` messages from the head, runs' messages made into Messages."""
        count = self.count
        if n >= count:
            n = count
        if n <= 0:
            return []
        self.count = count - n
        items = self._items
        if not self._runs:
            return take(items, n)  # type: ignore[arg-type]  # no run among them: Messages only
        out: list[Message] = []
        append = out.append
        popleft = items.popleft
        while n:
            head = items[0]
            if isinstance(head, Run):
                start = self._pos
                stop = start + n
                size = len(head.datas)
                if stop >= size:
                    stop = size
                    popleft()
                    self._runs -= 1
                    self._pos = 0
                else:
                    self._pos = stop
                if out:
                    out += run_messages(head, start, stop)
                else:
                    out = run_messages(head, start, stop)
                    append = out.append
                n -= stop - start
            else:
                popleft()
                append(head)
                n -= 1
        return out

    def peek(self, n: int) -> list[Message]:
        """The first `n` messages, moving none (a run's are made for the caller, the run keeps its own)."""
        if n <= 0:
            return []
        if not self._runs:
            return list(islice(self._items, n))  # type: ignore[arg-type]  # no run: Messages only
        out: list[Message] = []
        pos = self._pos
        for item in self._items:
            if isinstance(item, Run):
                stop = min(len(item.datas), pos + n - len(out))
                out += run_messages(item, pos, stop, keyed=False)
                pos = 0
            else:
                out.append(item)
            if len(out) >= n:
                break
        return out

    def messages(self) -> Iterator[Message]:
        """The Message objects held as such (not a run's messages), for a check of what is already here."""
        for item in self._items:
            if not isinstance(item, Run):
                yield item

    def clear(self) -> None:
        self._items.clear()
        self.count = self._runs = self._pos = 0


class OverflowQueue:
    __slots__ = ("mem", "size", "backend")

    def __init__(self, size: int, backend: IBackendQueue) -> None:
        self.mem = MemQueue()
        self.size = size
        self.backend = backend

    def __len__(self) -> int:
        return self.mem.count + self.backend.depth()

    def __bool__(self) -> bool:
        return self.mem.count > 0 or self.backend.depth() > 0

    def backend_depth(self) -> int:
        return self.backend.depth()

    def put(self, msgs: list[Message] | Run, fresh: bool = False) -> None:
        """Append in order; raises BackendError if the overflow cannot be stored.

        All or nothing: the backend is given its part before memory takes
        the rest, so a refused put leaves the queue as it was and the
        caller can keep every message elsewhere without duplicating any.
        `fresh`: new publishes (IBackendQueue.put). A run that memory
        holds whole stays a run; one the backend gets a part of is made
        into Messages first.
        """
        mem = self.mem
        backend = self.backend
        room = self.size - mem.count
        if room >= len(msgs) and not backend.depth():
            mem.add(msgs)
            return
        if isinstance(msgs, Run):
            msgs = run_messages(msgs, 0, len(msgs))
        if room > 0 and not backend.depth():
            backend.put(msgs[room:], fresh)
            mem.extend(msgs[:room])
            return
        backend.put(msgs, fresh)

    def put_accepted(self, msgs: list[Message]) -> None:
        """Put back messages that were acknowledged long ago (requeues, timeouts).

        Messages a durable store still keeps (they have a key) go straight
        back to memory and have their record rewritten (attempts, deferral);
        the others are put again. A failing backend must not lose them: they
        stay in memory beyond the bound instead.
        """
        kept = [m for m in msgs if m.key is not None]
        if kept:
            self.backend.update(kept)
            self.mem.extend(kept)
            if len(kept) == len(msgs):
                return
            msgs = [m for m in msgs if m.key is None]
        try:
            self.put(msgs)
        except BackendError:
            self.mem.extend(msgs)

    def finish(self, msgs: list[Message]) -> None:
        """Messages done for good: a durable store forgets the ones it keeps."""
        kept = [m for m in msgs if m.key is not None]
        if kept:
            self.backend.finish(kept)

    def hold(self, msgs: list[Message], fresh: bool = False) -> bool:
        """Messages kept outside the queue (deferred): stored where the store is durable.

        True when a durable store gives them back through its `on_stored`
        once committed: until then the owner must not keep them anywhere.
        `fresh`: new publishes (IBackendQueue.put).
        """
        return bool(self.backend.hold(msgs, fresh))

    def refill(self, n: int, now: float) -> list[Message]:
        """Move up to `n` due messages from the backend into memory.

        Returns the ones still deferred (a store gives back deferred
        messages after a restart): the caller holds them until they are due.
        """
        if not self.backend.depth():
            return []
        batch = self.backend.read(n)
        if not any([m.state for m in batch]):  # none deferred (none of them is in flight)
            self.mem.extend(batch)
            return []
        later = []
        mem = self.mem
        for m in batch:
            if m.deferred_until > now:
                later.append(m)
            else:
                m.state = None
                mem.append(m)
        return later

    def untake(self, msgs: list[Message]) -> None:
        """Give back what `take` returned (and nothing was done with) at the head, in order.

        Back into memory even if it came from the backend (beyond the
        bound, for the moment): the next `take` returns them first. A
        durable store still keeps their records, as nothing finished them;
        in default mode, as for the memory queue, they live in RAM only.
        """
        self.mem.untake(msgs)

    def take(self, n: int) -> list[Message]:
        """Remove up to `n` messages from the head, memory first, then the backend.

        From a durable store they stay stored until `finish`.
        """
        if self.mem.count:
            return self.mem.take(n)
        return self.backend.read(n) if self.backend.depth() else []

    def peek(self, count: int) -> list[Message]:
        """The first `count` messages in delivery order (memory, then the backend), moving none.

        `take` empties memory before it reads the backend, so this is the
        order consumers get them in; nothing is read from the backend, so
        its read position and records stay as they are.
        """
        if count <= 0:
            return []
        out = self.mem.peek(count)
        if len(out) < count and self.backend.depth():
            out += self.backend.peek(count - len(out))
        return out

    def peek_pieces(self, count: int, body_limit: int) -> Iterator[list[tuple[Message, int]]]:
        """`peek(count)` as (message, body size) pieces, for an answer built a piece at a time.

        Memory's part, and a backend's that holds its messages in memory,
        is taken now as one piece of references (nothing is copied); a
        store that reads from disk (IPiecewisePeek) is read a piece per
        `next()`, its bodies cut at `body_limit`.
        """
        if count <= 0:
            return iter(())
        first = [(m, m.body_size) for m in self.mem.peek(count)]
        rest = count - len(first)
        backend = self.backend
        if rest <= 0 or not backend.depth():
            return iter([first])
        if IPiecewisePeek.providedBy(backend):
            return chain([first], backend.peek_pieces(rest, body_limit))
        return iter([first + [(m, m.body_size) for m in backend.peek(rest)]])

    def empty(self) -> None:
        self.mem.clear()
        self.backend.empty()

    def delete(self) -> None:
        self.mem.clear()
        self.backend.delete()

    def close(self, also: list[Message] | None = None) -> None:
        """Hand what memory holds (then `also`) to the backend and close it.

        Messages a durable store still keeps only have their record
        rewritten, so they come back in their place with their attempts.
        """
        held = self.mem.take(self.mem.count)
        if also:
            held.extend(also)
        kept = [m for m in held if m.key is not None]
        if kept:
            self.backend.update(kept)
            held = [m for m in held if m.key is None]
        if held:
            try:
                self.backend.put(held)
            except BackendError as e:
                # A failed store at shutdown: these die with the process, as
                # a memory queue's do; the other queues must still close.
                log.error("queue {name}: {n} messages in memory not stored at shutdown: {error}",
                          name=self.backend.name, n=len(held), error=e)
        self.backend.close()
