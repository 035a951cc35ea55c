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

    from mqd.message import Message, Run


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


class IRetainedLog(Interface):
    """A topic's retained log: every message published to it, numbered by offset, kept until retention says.

    Offsets start at 0 with a log's first record and go up by one per
    record, with no gap, and are never reused for the life of the log
    (`epoch`): not after records expire, not across a restart or a crash.
    A log deleted and opened again under the same name is a new life: a
    new random `epoch`, offsets from 0 again. A record is what a
    publish made of the message: its timestamp (ns), id and body; a log
    knows nothing of channels, and nothing a channel does (FIN, REQ)
    touches it.

    Records are readable once the store holds them the way it holds a
    publish: at once in memory and default LMDB, after the commit that
    holds them in a durable store (`latest` counts readable records only).
    """

    name = Attribute("The topic's name.")
    epoch = Attribute("A random 63-bit int naming this life of the log; 0 for a store that keeps nothing.")
    kept = Attribute("False when the store keeps no records at all (the dummy store): every read is empty.")

    def append(records: Sequence[Message] | Run, fresh: bool = False) -> None:
        """Give the records the next offsets, in order, and store them; raise BackendError on failure.

        `records` are a publish's messages, or its run (mqd.message.Run,
        a publish held compactly): only their timestamp and `data` (id and
        body) are read; nothing of them is changed (their key, attempts
        and deferral are the channels'), and a run's list of data may be
        kept as it is, as nothing changes it. `fresh` as IBackendQueue.put: a
        durable store whose commit fails drops these records and gives
        their offsets out again, as nobody could read them.
        """

    def earliest() -> int:
        """The offset of the oldest record kept; `latest()` when none is."""

    def latest() -> int:
        """The offset the next record will get: one past the newest readable record."""

    def retained_bytes() -> int:
        """Bytes the kept records take as the store counts them for `--retention-bytes` (record overhead plus id and body)."""

    def oldest_timestamp() -> int | None:
        """The oldest kept record's publish timestamp (ns since the Unix epoch), or None when none is kept."""

    def offset_for_timestamp(timestamp_ns: int) -> int:
        """The first offset (from earliest) whose record's timestamp is at or after `timestamp_ns`; `latest()` if none."""

    def read(offset: int, max_messages: int, max_bytes: int) -> list[tuple[int, int, bytes]]:
        """Records from `offset` on, oldest first, as (offset, timestamp ns, data = id + body).

        At most `max_messages` records and, past the first record, at most
        `max_bytes` of data (the first is always returned whole, so a read
        always moves on). `offset` below `earliest()` or above `latest()`
        raises OffsetOutOfRange; at `latest()` the answer is empty.
        Bounded work: a caller reads a big range a call at a time.
        """

    def read_frames(offset: int, max_messages: int, max_bytes: int) -> tuple[bytes, int]:
        """`read` as the records' wire framing (mqd.wire.log_frames), and the offset after the last one.

        The same records as `read(offset, max_messages, max_bytes)`, framed
        in one bytes object; a store may build it without decoding each
        record.
        """

    def frames_extent(offset: int, max_messages: int, max_bytes: int) -> tuple[int, int]:
        """What `read_frames(offset, max_messages, max_bytes)` would give, measured: (its length, the offset after).

        For a reader that must know an answer's size before building it
        (`/topic/read`'s Content-Length): a store answers from its records'
        lengths, without building a frame.
        """

    def expire(before_ns: int, max_bytes: int) -> int:
        """Drop the oldest records while one is older than `before_ns` or the log is past `max_bytes`.

        0 for either bound means that bound is off. Only whole records
        from the head go, and only those either bound says must: a record
        at or after `before_ns` is kept while the log is within
        `max_bytes`. Returns how many records went.
        """

    def delete() -> None:
        """Drop every record and forget the log: opened again, it is a new life with a new epoch."""

    def close() -> None:
        """The store writes and closes everything at once: nothing of the log's own to release."""


class OffsetOutOfRange(ValueError):
    """A read of a retained log asked for an offset it does not hold.

    `earliest` and `latest` are the log's bounds when it was asked, so the
    answer can name them.
    """

    def __init__(self, offset: int, earliest: int, latest: int) -> None:
        if offset < earliest:
            text = f"offset {offset} is below the earliest retained offset {earliest}"
        else:
            text = f"offset {offset} is beyond the latest offset {latest}"
        super().__init__(text)
        self.offset = offset
        self.earliest = earliest
        self.latest = latest


class IRetainingStore(Interface):
    """A store that can keep topics' retained logs (every store does; the dummy one keeps nothing)."""

    def open_log(name: str) -> IRetainedLog:
        """The retained log of topic `name`, created (with a new epoch) if new, with what it held before."""

    def log_names() -> list[str]:
        """The topics whose logs the store holds, for the broker to reconcile with its metadata."""
