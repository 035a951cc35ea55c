"""Big publish batches (TCP MPUB, HTTP /mpub): checked whole, then published a chunk per reactor turn.

An MPUB may carry a million messages (max-body-size). Checked and published
in one call, it held the reactor for seconds, and every message existed as
Python objects (body, id, Message, store entry) at the same time. A batch
larger than one chunk is instead

- checked whole first, a block of messages per reactor turn: nsqd's
  all-or-nothing is about validation, so one bad size anywhere publishes
  nothing;
- then published a chunk per reactor turn. Bodies and messages exist only
  for the chunk being published: an overflowing queue hands them to its
  backend, whose commit (the next turn) lets them go, so a big batch costs
  its own bytes plus about one chunk of objects.

Ordering: a batch reaches its topic in order, and its connection reads
nothing more until the batch is answered, so one publisher's messages keep
its order. Another publisher's messages may land between two chunks of the
batch: nsqd lets concurrent publishers interleave the same way
(PutMessages holds the topic's read lock only, and the messages enter the
memory channel one by one), and it is what lets the broker keep serving
them while a big batch goes in.

Failure mid-way: when the store refuses a chunk, the earlier chunks stay
published and the batch is answered with the error, as nsqd's PutMessages
leaves the messages before a failed put published. Not with `--durable`,
where an error answer means "nothing stored": there each chunk waits for
the commit holding it; a failure before any chunk is stored answers the
error (the store dropped the chunk), one after that waits for room (the
store retries every second) and goes on with the chunk it dropped, and
the batch is answered `OK` once all of it is stored.

Batches run on a `twisted.internet.task.Cooperator` per reactor that does
one unit of work per turn, so several big publishers take turns and a turn
costs at most one chunk whatever their number.
"""

from __future__ import annotations

import gc
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar, cast
from weakref import WeakKeyDictionary, ref

from twisted.internet.defer import Deferred
from twisted.internet.task import Cooperator, deferLater

from backends import BackendError
from mqd.logs import get_logger

if TYPE_CHECKING:
    from twisted.internet.interfaces import IReactorTime

    from mqd.nsqd.topic import Topic

__all__ = [
    "BatchError",
    "TopicExiting",
    "CHUNK_BYTES",
    "CHUNK_MESSAGES",
    "publish_in_chunks",
    "is_big",
    "walk_binary",
    "binary_chunks",
    "binary_bodies",
    "text_chunks",
    "text_bodies",
]

log = get_logger(__name__)

# A published chunk: at most this many messages, or this many bytes past its
# first message. With the default LMDB store a turn (a chunk of one-byte
# messages, then the store's commit of it) measured 8-15 ms on 2 cores
# (bench/scenarios/big_batch.py); a chunk is ~2.5 us a message.
CHUNK_MESSAGES = 2048
CHUNK_BYTES = 1 << 20
# Checking costs ~10x less a message than publishing: a turn checks this
# many chunks.
CHECK_CHUNKS = 16
# How long a durable batch that has stored chunks already waits before it
# tries again when the store refuses the next one (a full disk): the store
# retries its own commit as often.
ROOM_RETRY = 1.0
# Text /mpub is cut at line ends into pieces of this many bytes and the rest
# of the line they end in: about CHUNK_MESSAGES non-empty lines at most
# (each is two bytes at least).
TEXT_PIECE = 2 * CHUNK_MESSAGES

_unpack_int32 = struct.Struct(">i").unpack_from

# Why a batch was refused (BatchError.reason), in nsqd's order of checks.
NO_SIZE = "no size"  # the batch ends where a message's size should be
BAD_SIZE = "bad size"  # a size <= 0
TOO_BIG = "too big"  # a size over max-msg-size
NO_BODY = "no body"  # the batch ends inside a message
TRAILING = "trailing"  # bytes left after the last message (TCP only)
BODY_TOO_BIG = "body too big"  # text: the body reached max-body-size + 1


class BatchError(Exception):
    """A batch refused while checking it: `reason` (see above) for message `index` of size `size`."""

    def __init__(self, reason: str, index: int = 0, size: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.index = index
        self.size = size


class TopicExiting(BackendError):
    """The topic was deleted or shut down before the batch was all in: nsqd's "exiting"."""

    def __init__(self) -> None:
        super().__init__("exiting")


def is_big(count: int, size: int) -> bool:
    """Whether a batch of `count` messages in `size` bytes is published over several turns."""
    return count > CHUNK_MESSAGES or size > CHUNK_BYTES


# -- binary batches: [count][size][body][size][body]... ----------------------------------


def walk_binary(data: bytes, pos: int, end: int, first: int, count: int, max_msg: int,
                out: list[bytes] | None = None, stop_after: int = -1,
                partial: bool = False) -> tuple[int, int]:
    """Check up to `count` [4-byte size][body] messages from `pos`; (where they stop, how many).

    None may reach past `end`. `first` is the index of the first one (for
    errors). The walk also stops after the message that crosses
    `stop_after` (when >= 0). Bodies are appended to `out` when given.
    Raises BatchError. `partial`: `end` is only where the input read so far
    ends (TCP MPUB, read from the stream as nsqd does), so a message it cuts
    stops the walk before that message instead of failing it.
    """
    if stop_after < 0:
        stop_after = end + 1
    if out is not None and count > 1 and pos + 4 <= end:
        # Batches of equal-sized messages (fixed-format records, a bench's
        # bodies) are checked with four strided compares of the size fields
        # and sliced in one comprehension; anything else takes the walk below.
        size = _unpack_int32(data, pos)[0]
        stride = size + 4
        last = pos + stride * count
        if 0 < size <= max_msg and last <= end and last <= stop_after:
            head = data[pos:pos + 4]
            if all(data[pos + j:last:stride] == head[j:j + 1] * count for j in range(4)):
                out.extend([data[p:p + size] for p in range(pos + 4, last, stride)])
                return last, count
    append = out.append if out is not None else None
    for i in range(first, first + count):
        if pos + 4 > end:
            if partial:
                return pos, i - first
            raise BatchError(NO_SIZE, i)
        size = _unpack_int32(data, pos)[0]
        if size <= 0:
            raise BatchError(BAD_SIZE, i, size)
        if size > max_msg:
            raise BatchError(TOO_BIG, i, size)
        nxt = pos + 4 + size
        if nxt > end:
            if partial:
                return pos, i - first
            raise BatchError(NO_BODY, i, size)
        pos += 4
        if append is not None:
            append(data[pos:nxt])
        pos = nxt
        if pos >= stop_after:
            return pos, i + 1 - first
    return pos, count


def binary_chunks(data: bytes, pos: int, end: int, count: int, max_msg: int,
                  exact: bool) -> Iterator[tuple[int, int]]:
    """Check a binary batch a chunk at a time, yielding each chunk as (start, messages).

    `exact`: the messages must end at `end` (TCP MPUB: where reading them
    from the stream found their end), else BatchError(TRAILING); HTTP
    ignores what follows them, as nsqd.
    """
    done = 0
    while done < count:
        start = pos
        pos, n = walk_binary(data, pos, end, done, min(CHUNK_MESSAGES, count - done), max_msg,
                             None, pos + CHUNK_BYTES)
        done += n
        yield start, n
    if exact and pos != end:
        raise BatchError(TRAILING)


def binary_bodies(data: bytes, end: int, chunk: tuple[int, int]) -> list[bytes]:
    """The bodies of a chunk that binary_chunks has checked."""
    start, n = chunk
    bodies: list[bytes] = []
    walk_binary(data, start, end, 0, n, end, bodies)
    return bodies


# -- text batches: one message per line ------------------------------------------------------


def text_chunks(body: bytes, read_max: int, max_msg: int) -> Iterator[tuple[int, int]]:
    """Check a text /mpub body a piece at a time, yielding each piece as (start, stop).

    Pieces end at a line end (or the body's end). Empty lines are skipped;
    a line over `max_msg` is TOO_BIG. A body of `read_max` bytes (max-body-size
    + 1, so too big) is BODY_TOO_BIG once the lines before its last are
    checked, as nsqd's line reader finds it.
    """
    end = len(body)
    too_big = end >= read_max
    pos = 0
    while pos < end:
        stop = end
        if pos + TEXT_PIECE < end:
            nl = body.find(b"\n", pos + TEXT_PIECE - 1)
            if nl >= 0:
                stop = nl + 1
        lines = body[pos:stop].split(b"\n")
        if stop == end and too_big:
            # The line holding the body's last byte is where the limit is
            # reached: it is not checked itself.
            del lines[-2 if body.endswith(b"\n") else -1:]
            if lines and max(map(len, lines)) > max_msg:
                raise BatchError(TOO_BIG)
            raise BatchError(BODY_TOO_BIG)
        if max(map(len, lines)) > max_msg:
            raise BatchError(TOO_BIG)
        yield pos, stop
        pos = stop


def text_bodies(body: bytes, chunk: tuple[int, int]) -> list[bytes]:
    """The non-empty lines of a piece that text_chunks has checked."""
    start, stop = chunk
    return list(filter(None, body[start:stop].split(b"\n")))


# -- running a batch over reactor turns ---------------------------------------------------------

_cooperators: WeakKeyDictionary = WeakKeyDictionary()


def _one_unit() -> Callable[[], bool]:
    return _stop


def _stop() -> bool:
    return True


def _cooperator(clock: IReactorTime) -> Cooperator:
    """The reactor's (or a test clock's) cooperator: one unit of one batch per turn.

    Shared by every batch on that reactor, so a turn costs one chunk
    however many big batches are going in. It holds its clock weakly: it is
    kept in a dictionary keyed by the clock, which must stay collectable.
    """
    coop = _cooperators.get(clock)
    if coop is None:
        # Dead only once the clock is collected, and its cooperator with it.
        clock_ref = cast("Callable[[], IReactorTime]", ref(clock))
        coop = Cooperator(terminationPredicateFactory=_one_unit,
                          scheduler=lambda tick: clock_ref().callLater(0, tick))
        _cooperators[clock] = coop
    return coop


_Chunk = TypeVar("_Chunk")


def publish_in_chunks(clock: IReactorTime, topic: Topic, chunks: Iterator[_Chunk],
                      bodies_of: Callable[[_Chunk], list[bytes]],
                      done: Callable[[BatchError | BackendError | None], None],
                      defer: float = 0.0) -> None:
    """Check every chunk of `chunks`, then publish them in order, a turn each; then `done(error)`.

    `defer` (seconds) holds every message as Topic.publish does (a deferred /mpub).

    `done` gets None once the last chunk is published, the BatchError
    that refused the batch (nothing published), or the BackendError that
    stopped it mid-way (earlier chunks published; with a durable store only
    before the first chunk is stored, so nothing is). A topic deleted or
    shut down meanwhile is TopicExiting, nsqd's PutMessages error.
    """
    _cooperator(clock).cooperate(_run(topic, chunks, bodies_of, done, defer))


def _run(topic: Topic, chunks: Iterator, bodies_of, done, defer: float) -> Iterator[None]:
    try:
        error = yield from _steps(topic, chunks, bodies_of, defer)
    except Exception as e:  # noqa: BLE001 - a bug must still answer the publisher
        log.failure("publishing a batch to {topic} failed", topic=topic.name)
        error = BackendError(str(e))
    try:
        done(error)
    except Exception:  # noqa: BLE001 - a Cooperator drops a task's error without a word
        log.failure("answering a batch published to {topic} failed", topic=topic.name)


def _steps(topic: Topic, chunks: Iterator, bodies_of, defer: float):
    """The batch's turns; returns what `done` is told."""
    checked = []
    try:
        for chunk in chunks:
            checked.append(chunk)
            if len(checked) % CHECK_CHUNKS == 0:
                yield None
    except BatchError as e:
        return e
    store = topic.store
    if store.durable:
        return (yield from _durable_steps(topic, checked, bodies_of, defer, store))
    last = len(checked) - 1
    for i, chunk in enumerate(checked):
        if topic.exiting:
            return TopicExiting()
        try:
            _publish_chunk(topic, bodies_of(chunk), defer)
        except BackendError as e:
            return e
        if i < last:
            yield None
    return None


def _durable_steps(topic: Topic, checked: list, bodies_of, defer: float, store):
    """Each chunk published, then its commit waited for; an error only while nothing is stored.

    A failed commit drops the chunk it held (the store's rule for new
    publishes): before any chunk is stored that is the batch's error
    answer, with nothing of it stored. Once a chunk is, an error answer
    would be a lie: the batch waits for room and publishes the dropped
    chunk again.
    """
    clock = topic.clock
    stored_any = False
    for chunk in checked:
        bodies = bodies_of(chunk)
        while True:
            if topic.exiting:
                return TopicExiting()
            try:
                _publish_chunk(topic, bodies, defer)
            except BackendError as e:
                if not stored_any:
                    return e
                yield deferLater(clock, ROOM_RETRY, _nothing)
                continue
            outcome: list[str | None] = []
            yield _commit_of(store, outcome)
            if outcome[0] is None:
                stored_any = True
                break
            if not stored_any:
                return BackendError(outcome[0])
    return None


def _nothing() -> None:
    return None


def _commit_of(store, outcome: list) -> Deferred:
    """A Deferred firing once the store's next commit is over; its error (or None) goes into `outcome`."""
    done: Deferred = Deferred()

    def fired(error: str | None) -> None:
        outcome.append(error)
        done.callback(None)

    store.when_durable(fired)
    return done


def _publish_chunk(topic: Topic, bodies: list[bytes], defer: float) -> None:
    """topic.publish with the cyclic garbage collector paused.

    A chunk makes a few tracked objects per message (Message, its store
    entry) that all live until the store's commit in the next turn. Left
    running, the collector makes a dozen young collections per chunk and
    promotes those objects, so full collections (a walk of the whole heap,
    tens of ms) come every few chunks: the worst turns of a big batch. The
    objects cannot form cycles; one young collection after the chunk is
    all they need.
    """
    if not gc.isenabled():
        topic.publish(bodies, defer)
        return
    gc.disable()
    try:
        topic.publish(bodies, defer)
    finally:
        gc.enable()
