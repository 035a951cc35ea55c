"""`GET /channel/peek` and `GET /topic/peek`: the first messages of a queue, without consuming them.

An mqd addition (NSQ users have long asked for one; NSQ has no way to
look at messages without taking them): an operator sees what a stuck
consumer is holding, what waits behind it, and what is scheduled, on a
live broker. No NSQ client calls these paths, so nothing can trip over them.

A peek only reads: the memory queue and the backend in delivery order (the
backend's `peek`, which moves no read position), and the live entries of
the in-flight and deferred heaps, so no count, timer, order, attempt or
store position changes, and what consumers get afterwards is exactly what
they would have got.

Arguments are checked as the /channel/* endpoints check theirs (names,
then whether the topic and channel exist: 404, nothing is created), then
`n` (a positive integer, default 20, larger values capped:
`400 INVALID_N` otherwise), `state` (`queued`, `in_flight` or
`deferred`, default `queued`; a topic holds only `queued`:
`400 INVALID_STATE` otherwise) and `max_body` (bytes of each body shown,
a non-negative integer, at most `--peek-max-body-bytes`:
`400 INVALID_MAX_BODY` otherwise). Times are nanoseconds since the epoch,
as message timestamps are. With auth configured, a bearer secret granted
`subscribe` on what is shown comes first (mqd.http.authorization).

An answer is bounded, and so is the work of building it:

* each body is cut at `max_body` bytes (`"truncated": true`, `size` still
  the whole body's), and the answer ends with the last message that fits
  in `--peek-max-bytes` (`"more": true`); the first message always comes,
  cut further if it must;
* it is built a slice at a time (`SLICE_COST`), the reactor serving other
  clients between slices (a Cooperator on the broker's clock); the store's
  part is read a bounded piece at a time (IPiecewisePeek), bodies copied
  only up to the cut. The messages held in memory are those of the
  request's instant (references, taken at once); a stored message read
  away while the answer is built is left out of it;
* the bytes of every answer being built or written are counted
  (`PeekWork`): each reserves `--peek-max-bytes` while it is built, then
  what it holds until written (the writes follow the client's reading, a
  push producer), and a peek that would take the count past
  `PEEK_ANSWERS` times `--peek-max-bytes` is refused,
  `503 {"message":"PEEK_BUSY"}`, rather than queued: an operator asks
  again, a memory peak does not build up behind a slow client.
"""

from __future__ import annotations

import base64
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import Cooperator
from twisted.web.server import Request
from zope.interface import implementer

from mqd.http.args import (
    DEFAULT_PEEK,
    MAX_PEEK,
    count_arg,
    max_body_arg,
    query_of,
    state_arg,
    topic_arg,
    topic_channel_args,
)
from mqd.http.authorization import AuthCache, require_grant
from mqd.http.endpoint import LATER, client_gone, finish_v1
from mqd.http.response import JSON_CONTENT_TYPE, ApiError, dumps, respond_v1
from mqd.logs import get_logger
from mqd.names import QUEUE_STATES as STATES
from mqd.nsqd.http.topics import ChannelEndpoint, TopicEndpoint

if TYPE_CHECKING:
    from mqd.http.auth import AuthState
    from mqd.message import Message
    from mqd.options import Settings

__all__ = [
    "ChannelPeek",
    "DEFAULT_PEEK",
    "MAX_PEEK",
    "PEEK_ANSWERS",
    "PeekWork",
    "STATES",
    "TopicPeek",
    "count_arg",
    "max_body_arg",
    "peek_message",
    "state_arg",
]

log = get_logger(__name__)

# The answers being built or written may hold this many times --peek-max-bytes together.
PEEK_ANSWERS = 4
# Work between two reactor turns: the bytes of JSON encoded, each message
# counting MESSAGE_COST more (about 1-2 ms on a 2-core VM).
SLICE_COST = 512 << 10
MESSAGE_COST = 2048
# Largest write handed to the transport at once.
WRITE_CHUNK = 64 << 10

# (message, size of its whole body, due, timeout, client): one message to answer.
Entry = tuple[Any, int, Any, Any, Any]


def _ns(seconds: float | None) -> int | None:
    """Reactor seconds (unix time) as integer nanoseconds; None for unset (0 or None)."""
    return int(seconds * 1e9) if seconds else None


def _text(body: bytes, cut: bool) -> str | None:
    """The body as text if it is UTF-8; of a cut body, a character the cut split is left out."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        if cut and e.reason == "unexpected end of data":
            return body[:e.start].decode("utf-8")
        return None


def peek_message(msg: Message, due: float | None = None, timeout: float | None = None,
                 client=None, *, size: int | None = None, max_body: int | None = None) -> dict[str, Any]:
    """One message as the peek answers it.

    `due` overrides the message's own deferred_until (a deferred message's
    heap time is when it is due); `timeout` and `client` are set for one in
    flight. `size` is the whole body's when `msg` carries only its start
    (read from the store); the body shown is cut at `max_body` bytes.
    """
    body = msg.body
    if size is None:
        size = len(body)
    if max_body is not None and len(body) > max_body:
        body = body[:max_body]
    truncated = len(body) < size
    return {
        "id": msg.id.decode("ascii", "replace"),
        "attempts": msg.attempts,
        "timestamp": msg.timestamp,
        "size": size,
        "body": base64.b64encode(body).decode("ascii"),
        "body_text": _text(body, truncated),
        "deferred_until": _ns(due if due is not None else msg.deferred_until),
        "timeout_at": _ns(timeout),
        "client": client.remote_address if client is not None else None,
        "truncated": truncated,
    }


def _one_step() -> Any:
    """The Cooperator's termination predicate: one slice per reactor turn."""
    return lambda: True


class PeekWork:
    """What every peek answer in progress holds, and the Cooperator that builds them.

    One per broker, held by its HTTP sites (mqd.nsqd.http.state), so the
    bound counts the answers of every site together.
    """

    def __init__(self, clock) -> None:
        self.held = 0
        self.cooperator = Cooperator(terminationPredicateFactory=_one_step,
                                     scheduler=lambda step: clock.callLater(0, step))

    def reserve(self, nbytes: int, limit: int) -> None:
        """Count `nbytes` more, or 503 PEEK_BUSY when that would pass `limit`."""
        if self.held + nbytes > limit:
            log.info("peek refused: answers in progress hold {held} bytes", held=self.held)
            raise ApiError(503, "PEEK_BUSY")
        self.held += nbytes

    def release(self, nbytes: int) -> None:
        self.held -= nbytes


class _Answer:
    """One peek answer: built a slice at a time within its budget, then written as the client reads."""

    def __init__(self, request: Request, work: PeekWork, head: dict[str, Any], pieces: Iterator[list[Entry]],
                 max_body: int, budget: int) -> None:
        self.request = request
        self.work = work
        self.pieces = pieces
        self.max_body = max_body
        self.budget = budget
        self.held = budget
        self.more = False
        self.chunks: list[bytes] = [dumps(head)[:-1] + b',"messages":[']
        self.size = len(self.chunks[0])
        self._tail = b'],"more":%s,"max_body":%d}'
        # Room for the messages: the budget less the head and the longest tail.
        self.room = budget - self.size - len(self._tail % (b"false", max_body))

    def start(self) -> object:
        """Build (the first slice at once), then write; returns LATER for the endpoint."""
        steps = self._steps()
        try:
            next(steps)
        except StopIteration:
            self._write()
            return LATER
        except BaseException:
            self._give_back(self.held)
            raise
        task = self.work.cooperator.cooperate(steps)
        task.whenDone().addCallbacks(lambda _: self._write(), self._failed)
        return LATER

    def _steps(self) -> Iterator[None]:
        cost = 0
        first = True
        for piece in self.pieces:
            for msg, size, due, timeout, client in piece:
                data = dumps(peek_message(msg, due, timeout, client, size=size, max_body=self.max_body))
                need = len(data) + (0 if first else 1)
                if need > self.room:
                    if not first:
                        self.more = True
                        return
                    data = self._fitted(msg, size, due, timeout, client)
                    need = len(data)
                if not first:
                    self.chunks.append(b",")
                self.chunks.append(data)
                self.room -= need
                self.size += need
                first = False
                cost += len(data) + MESSAGE_COST
                if cost >= SLICE_COST:
                    yield None
                    cost = 0
                    if client_gone(self.request):
                        return

    def _fitted(self, msg, size: int, due, timeout, client) -> bytes:
        """The first message with its body cut until it fits in the answer (or shown without one)."""
        cut = min(self.max_body, size)
        while True:
            data = dumps(peek_message(msg, due, timeout, client, size=size, max_body=cut))
            if len(data) <= self.room or cut == 0:
                return data
            cut = max(0, min(cut - 1, cut * self.room // len(data) - 16))

    def _failed(self, failure) -> None:
        self._give_back(self.held)
        if failure.check(ApiError):
            finish_v1(self.request, failure.value.code, failure.value.message)
            return
        if client_gone(self.request):
            return
        log.failure("{method} {uri} failed", failure, method=self.request.method, uri=self.request.uri)
        finish_v1(self.request, 500, "INTERNAL_ERROR")

    def _give_back(self, nbytes: int) -> None:
        self.held -= nbytes
        self.work.release(nbytes)

    def _write(self) -> None:
        request = self.request
        self.chunks.append(self._tail % (b"true" if self.more else b"false", self.max_body))
        self.size += len(self.chunks[-1])
        self.pieces = iter(())
        if client_gone(request):
            self._give_back(self.held)
            return
        # From the budget reserved while building, keep what the answer holds.
        self._give_back(self.held - self.size)
        request.setHeader(b"Content-Type", JSON_CONTENT_TYPE)
        respond_v1(request, 200, b"")
        request.setHeader(b"Content-Length", b"%d" % self.size)
        _Writer(request, self.chunks, self._give_back)
        self.chunks = []


@implementer(IPushProducer)
class _Writer:
    """Writes an answer's chunks as the transport takes them; what is written is given back at once."""

    def __init__(self, request: Request, chunks: list[bytes], give_back) -> None:
        self.request = request
        self.chunks = deque(chunks)
        self.left = sum(len(c) for c in chunks)
        self.give_back = give_back
        self.paused = False
        self.done = False
        request.registerProducer(self, True)
        request.notifyFinish().addBoth(self._ended)
        self.resumeProducing()

    def resumeProducing(self) -> None:
        self.paused = False
        while self.chunks and not self.paused and not self.done:
            data = self._next()
            self.left -= len(data)
            self.give_back(len(data))
            self.request.write(data)
        if not self.chunks and not self.done:
            self.done = True
            self.request.unregisterProducer()
            self.request.finish()

    def _next(self) -> bytes:
        """Up to WRITE_CHUNK bytes: small chunks joined, a large one split."""
        chunks = self.chunks
        first = chunks.popleft()
        if len(first) > WRITE_CHUNK:
            chunks.appendleft(first[WRITE_CHUNK:])
            return first[:WRITE_CHUNK]
        out = [first]
        size = len(first)
        while chunks and size + len(chunks[0]) <= WRITE_CHUNK:
            size += len(chunks[0])
            out.append(chunks.popleft())
        return b"".join(out)

    def pauseProducing(self) -> None:
        self.paused = True

    def stopProducing(self) -> None:
        self._ended(None)

    def _ended(self, result: Any) -> None:
        """The request finished or its client went: nothing is left to write."""
        self.done = True
        self.chunks.clear()
        if self.left:
            self.give_back(self.left)
            self.left = 0


def _start(work: PeekWork, opts: Settings, request: Request, head: dict[str, Any],
           pieces: Iterator[list[Entry]], max_body: int) -> object:
    """Reserve the answer's budget (503 PEEK_BUSY past the bound) and build it."""
    budget = opts.peek_max_bytes
    work.reserve(budget, PEEK_ANSWERS * budget)
    return _Answer(request, work, head, pieces, max_body, budget).start()


def _queued(pieces: Iterator[list[tuple[Message, int]]]) -> Iterator[list[Entry]]:
    return ([(msg, size, None, None, None) for msg, size in piece] for piece in pieces)


class ChannelPeek(ChannelEndpoint):
    """`GET /channel/peek?topic=T&channel=C[&n=N][&state=S][&max_body=B]`: a channel's first messages in one state.

    `auth` checks bearer secrets when auth is configured; `work` counts
    what the answers in progress hold (both shared by the broker's sites).
    """

    def __init__(self, broker: Any, auth: AuthCache, work: PeekWork) -> None:
        super().__init__(broker)
        self.auth = auth
        self.work = work

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> object:
        return self.auth.guard(request, lambda auth: self.peek(request, auth))

    def peek(self, request: Request, auth: AuthState | None) -> object:
        query = query_of(request)
        if auth is not None:
            require_grant(auth.allows(*topic_channel_args(query)))
        channel = self.existing_channel(request)
        count = count_arg(query)
        state = state_arg(query, STATES)
        max_body = max_body_arg(query, self.broker.options.peek_max_body_bytes)
        if state == "queued":
            total = channel.depth()
            pieces = _queued(channel.peek_queued(count, max_body))
        elif state == "deferred":
            total = channel.deferred_count()
            pieces = iter([[(msg, len(msg.body), due, None, None) for msg, due, _ in channel.peek(state, count)]])
        else:
            total = channel.in_flight_count()
            pieces = iter([[(msg, len(msg.body), None, timeout, client)
                            for msg, timeout, client in channel.peek(state, count)]])
        head = {"topic": channel.topic_name, "channel": channel.name, "state": state, "total": total}
        return _start(self.work, self.broker.options, request, head, pieces, max_body)


class TopicPeek(TopicEndpoint):
    """`GET /topic/peek?topic=T[&n=N][&max_body=B]`: what waits at the topic for its channels (only `queued`).

    `auth` and `work` as for ChannelPeek.
    """

    def __init__(self, broker: Any, auth: AuthCache, work: PeekWork) -> None:
        super().__init__(broker)
        self.auth = auth
        self.work = work

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> object:
        return self.auth.guard(request, lambda auth: self.peek(request, auth))

    def peek(self, request: Request, auth: AuthState | None) -> object:
        query = query_of(request)
        name = topic_arg(query, "INVALID_ARG_TOPIC")
        if auth is not None:
            require_grant(auth.allows_topic(name))
        topic = self.existing_topic(name)
        count = count_arg(query)
        state = state_arg(query, ("queued",))
        max_body = max_body_arg(query, self.broker.options.peek_max_body_bytes)
        head = {"topic": topic.name, "channel": None, "state": state, "total": topic.depth()}
        return _start(self.work, self.broker.options, request, head,
                      _queued(topic.peek_queued(count, max_body)), max_body)
