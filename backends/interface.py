"""What a topic or channel needs from the storage behind its memory queue.

A store is opened once per broker (an LMDB environment, say) and hands out
one queue per topic and per channel; the broker never knows which kind it
holds. Everything moves in batches because the disk store commits once per
batch, not once per message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from zope.interface import Attribute, Interface

if TYPE_CHECKING:
    from twisted.internet.defer import Deferred

    from mqd.message import Message


class BackendError(Exception):
    """A queue could not store what it was given (a full disk, a closed store).

    The publisher gets E_PUB_FAILED (or HTTP 500) and the message is not
    acknowledged, so nothing accepted is lost.
    """


class StoreOpenError(Exception):
    """The data directory cannot be used; start-up stops with this text."""


class IBackendQueue(Interface):
    """The overflow queue of one topic or channel, FIFO."""

    name = Attribute("The queue's name: the topic, or 'topic:channel' as nsqd names it.")

    def put(messages: Sequence[Message], fresh: bool = False) -> None:
        """Append a batch of `mqd.message.Message` in order; raise BackendError on failure.

        `fresh`: they are new publishes, whose publishers are answered once
        the store has them (a durable store's commit). A durable store whose
        commit fails drops them, never to be stored nor delivered, as their
        publishers get its error; what is put without it (messages moved
        from a topic to its channels, put back at shutdown) was
        acknowledged before, and is kept and retried. Other stores ignore it.
        """

    def read(count: int) -> list[Message]:
        """Remove and return up to `count` messages from the head, oldest first.

        A durable store keeps what it hands out (the messages carry their
        `key`) until `finish`, so a crash redelivers anything not FINished.
        """

    def peek(count: int) -> list[Message]:
        """The first `count` messages `read` would return now, in order, changing nothing.

        For inspecting a live queue (`GET /channel/peek`): no read
        position, depth, record or cache moves, so peeking can never change
        what consumers get, nor in which order. The messages may be the
        queue's own objects: callers only look at them.
        """

    def finish(messages: Sequence[Message]) -> None:
        """These messages (from `read`) are done for good; a durable store drops them."""

    def update(messages: Sequence[Message]) -> None:
        """These messages (from `read` or `hold`) changed attempts or deferral; a durable store rewrites them.

        A held message stays hidden from `read` until it is finished: it
        still lives outside the queue (due, requeued or in flight).
        """

    def hold(messages: Sequence[Message], fresh: bool = False) -> bool | None:
        """Keep messages the channel holds outside the queue (deferred), if the store is durable.

        They are not returned by `read` while this process runs; after a
        crash they come back with their deferral. `fresh` as for `put`.
        True when the store gives them back (its queue's `on_stored`) once
        committed; a store that keeps nothing returns False or None.
        """

    def depth() -> int:
        """How many messages the queue holds."""

    def empty() -> None:
        """Drop every message; the queue stays usable."""

    def delete() -> None:
        """Drop every message and the queue's storage; the queue is unusable afterwards."""

    def close() -> None:
        """Release the queue, keeping what it holds for the next start."""

    def sync() -> None:
        """Make what was put durable, where the store can."""


class IPiecewisePeek(Interface):
    """A queue whose `peek` reads records from disk: it can also be peeked a bounded piece at a time.

    `GET /channel/peek` reads a store's part this way, so one peek never
    decodes a thousand large bodies in one reactor turn; queues that hold
    their messages in memory (whose `peek` hands references) need not.
    """

    def peek_pieces(count: int, body_limit: int) -> Iterator[list[tuple[Message, int]]]:
        """An iterator of lists of `(message, body size)`: the first `count` messages `peek` would give.

        Each `next()` reads one bounded piece from where the last one
        ended, so a message read away in between is not in a later piece
        and none comes twice. A message read from disk carries at most
        `body_limit` bytes of its body; its size is the whole body's.
        Nothing moves, as for `peek`.
        """


class IBackendStore(Interface):
    """One kind of storage for a whole broker."""

    durable = Attribute("True when a publish is acknowledged only once it is on disk.")
    health_listener = Attribute(
        "None, or what the broker sets: called with the failure's text when the store starts "
        "failing (a full disk), with None once it works again. A store that cannot fail never calls it.")

    def when_durable(callback: Callable[[str | None], Any]) -> None:
        """Call `callback(error)` once everything stored so far is durable (error None) or failed.

        Only a durable store defers; others call back at once.
        """

    def open_queue(name: str) -> IBackendQueue:
        """The IBackendQueue called `name`, created if new, with what it held before."""

    def begin_close() -> None:
        """Shutdown has begun: the topics and channels hand over what memory holds next.

        A store that refuses messages while it is failing takes them from
        now on, for close() to write what fits and keep the rest.
        """

    def close() -> Deferred[None] | None:
        """Close every queue and the store itself.

        A store that cannot write what it holds yet (a full disk) may return
        a Deferred that fires once it has and is closed; shutdown waits for it.
        """
