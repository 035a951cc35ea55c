"""`POST /pub` and `POST /mpub`: publishing over HTTP, checked in nsqd's order.

The order of the checks is part of the API (a too-big empty-topic request
answers MSG_TOO_BIG, not MISSING_ARG_TOPIC), so each handler follows
nsqd's `doPUB`/`doMPUB` step by step. The topic is created as soon as its
name is valid, before the rest of the request is checked, as nsqd does.

With `--durable` a publish is answered only once the store has committed
it, the same promise a TCP PUB gets; a 500 then means nothing of it was
stored nor delivered (a failed commit drops the publishes it held).

A big /mpub (more than a chunk of mqd.nsqd.batches) is checked whole and then
published a chunk per reactor turn, answered once the last chunk is in, so
other clients are served meanwhile and its messages never all exist as
Python objects at once.
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from twisted.web.server import Request

from backends import BackendError
from mqd.http.args import go_parse_bool, query_of, topic_arg
from mqd.http.endpoint import LATER, Endpoint, client_gone, finish_v1, read_body
from mqd.http.response import ApiError
from mqd.logs import get_logger
from mqd.nsqd.batches import (
    BODY_TOO_BIG,
    BatchError,
    TopicExiting,
    binary_bodies,
    binary_chunks,
    is_big,
    publish_in_chunks,
    text_bodies,
    text_chunks,
    walk_binary,
)

if TYPE_CHECKING:
    from mqd.nsqd.topic import Topic

__all__ = ["Mpub", "Pub", "parse_binary_mpub", "split_text_mpub"]

log = get_logger(__name__)

_INT32 = struct.Struct(">i")
# strconv.ParseInt(s, 10, 64): an optional sign and decimal digits, nothing else.
_GO_INT = re.compile(r"[+-]?[0-9]+")
_INT64_MAX = (1 << 63) - 1


def _content_length(request: Request) -> int:
    """The declared body size, -1 when not given (chunked), as Go's ContentLength."""
    raw = request.getHeader(b"content-length")
    try:
        return int(raw) if raw is not None else -1
    except ValueError:
        return -1


def _mpub_body(request: Request, limit: int) -> bytes:
    """At most `limit` bytes of the body, without a second copy of a big /mpub body.

    The site keeps a request body in memory (a BytesIO); `getvalue` hands
    out that buffer itself, where reading it copies it. A body that stays
    referenced until its last chunk is published (mqd.nsqd.batches) would
    otherwise exist twice for the whole batch.
    """
    content = request.content
    if isinstance(content, io.BytesIO):
        body = content.getvalue()
        return body if len(body) <= limit else body[:limit]
    return read_body(request, limit)


def _defer_ms(value: str, max_ms: float) -> int:
    """The `defer` parameter in milliseconds, or 400 INVALID_DEFER."""
    # Go's ParseInt fails past int64: certain with over 19 significant digits,
    # checked first so Python's limit on int() of long strings never applies.
    if (not _GO_INT.fullmatch(value) or len(value.lstrip("+-").lstrip("0")) > 19
            or abs(int(value)) > _INT64_MAX):
        raise ApiError(400, "INVALID_DEFER")
    ms = int(value)
    if ms < 0 or ms > max_ms:
        raise ApiError(400, "INVALID_DEFER")
    return ms


def split_text_mpub(body: bytes, read_max: int, max_msg_size: int) -> list[bytes]:
    """Text-mode /mpub: one message per line, empty lines skipped, trailing newline optional.

    `body` holds at most `read_max` (max-body-size + 1) bytes; reaching it
    means the body was too big. Lines are checked in order, so a long line
    before the limit answers MSG_TOO_BIG, as nsqd's line reader does.
    """
    try:
        pieces = list(text_chunks(body, read_max, max_msg_size))
    except BatchError as e:
        raise _text_error(e) from None
    bodies: list[bytes] = []
    for piece in pieces:
        bodies += text_bodies(body, piece)
    return bodies


def _text_error(err: BatchError) -> ApiError:
    return ApiError(413, "BODY_TOO_BIG" if err.reason == BODY_TOO_BIG else "MSG_TOO_BIG")


def _binary_count(body: bytes, max_body_size: int) -> int:
    """The message count a binary /mpub body starts with, or 413 BAD_BODY."""
    if len(body) < 4:
        raise ApiError(413, "BAD_BODY")
    count = _INT32.unpack_from(body, 0)[0]
    if count <= 0 or count > (max_body_size - 4) // 5:
        raise ApiError(413, "BAD_BODY")
    return count


def parse_binary_mpub(body: bytes, max_msg_size: int, max_body_size: int) -> list[bytes]:
    """Binary-mode /mpub: `[count][size][bytes]...` as the TCP MPUB body (nsqd's readMPUB).

    Errors are 413 with the TCP error code minus `E_`. Bytes after the last
    message are ignored, as nsqd stops reading there.
    """
    count = _binary_count(body, max_body_size)
    bodies: list[bytes] = []
    try:
        walk_binary(body, 4, len(body), 0, count, max_msg_size, bodies)
    except BatchError:
        raise ApiError(413, "BAD_MESSAGE") from None
    return bodies


def defer_param(query, options) -> float:
    """The `defer` query parameter in seconds (0 without one), limited by --max-defer-timeout."""
    raw = query.first("defer")
    if raw is None:
        return 0.0
    return _defer_ms(raw, options.max_defer_timeout * 1000) / 1000


class _Publisher(Endpoint):
    def publish(self, request: Request, topic: Topic, bodies: list[bytes],
                defer: float = 0.0) -> object:
        """Hand the bodies to the topic and answer `OK`, now or once they are durable.

        A topic shutting down answers 503 EXITING (nsqd's PutMessage
        failing); a store that refuses the messages answers 500 and marks
        the broker unhealthy, so /ping shows why.
        """
        if topic.exiting:
            raise ApiError(503, "EXITING")
        if not bodies:
            return "OK"
        try:
            topic.publish(bodies, defer)
        except BackendError as e:
            self.broker.set_health(str(e))
            raise ApiError(500, "INTERNAL_ERROR") from None
        return self._answer_stored(request, topic)

    def publish_in_chunks(self, request: Request, topic: Topic, chunks: Iterator,
                          bodies_of: Callable[[Any], list[bytes]], binary: bool,
                          defer: float = 0.0) -> object:
        """A big /mpub, checked and published over several reactor turns (mqd.nsqd.batches).

        Answered as `publish` would answer the whole batch at once; a
        check failing is the 413 the one-go parsers raise. The client may
        be gone by then: the checked batch is published all the same.
        """
        if topic.exiting:
            raise ApiError(503, "EXITING")

        def done(error) -> None:
            if error is None:
                if self._answer_stored(request, topic) is not LATER:
                    finish_v1(request, 200, "OK")
            elif isinstance(error, BatchError):
                finish_v1(request, 413, "BAD_MESSAGE" if binary else _text_error(error).message)
            elif isinstance(error, TopicExiting):
                finish_v1(request, 503, "EXITING")
            else:
                self.broker.set_health(str(error))
                finish_v1(request, 500, "INTERNAL_ERROR")

        publish_in_chunks(self.broker.clock, topic, chunks, bodies_of, done, defer)
        return LATER

    def _answer_stored(self, request: Request, topic: Topic) -> object:
        """`OK` for published messages, or LATER: answered once the store has committed them."""
        store = self.broker.store
        if not store.durable:
            return "OK"

        def committed(error: str | None) -> None:
            if client_gone(request):
                return
            if error is None:
                finish_v1(request, 200, "OK")
            else:
                log.error("HTTP publish to {topic} failed: {error}", topic=topic.name, error=error)
                finish_v1(request, 500, "INTERNAL_ERROR")

        store.when_durable(committed)
        return LATER


class Pub(_Publisher):
    """`POST /pub?topic=<t>[&defer=<ms>]`: the body is one message."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        opts = self.broker.options
        max_size = opts.max_msg_size
        if _content_length(request) > max_size:
            raise ApiError(413, "MSG_TOO_BIG")
        body = read_body(request, max_size + 1)
        if len(body) > max_size:
            raise ApiError(413, "MSG_TOO_BIG")
        if not body:
            raise ApiError(400, "MSG_EMPTY")
        query = query_of(request)
        topic = self.broker.topic(topic_arg(query))
        return self.publish(request, topic, [body], defer_param(query, opts))


class Mpub(_Publisher):
    """`POST /mpub?topic=<t>[&binary=true][&defer=<ms>]`: many messages, by line or length-prefixed.

    `defer` is checked as /pub's, right after the topic (nsq.io documents
    it for /mpub with --max-defer-timeout; nsqd's code does not take it yet).
    """

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        opts = self.broker.options
        if _content_length(request) > opts.max_body_size:
            raise ApiError(413, "BODY_TOO_BIG")
        query = query_of(request)
        topic = self.broker.topic(topic_arg(query))
        defer = defer_param(query, opts)
        binary = False
        raw_binary = query.first("binary")
        if raw_binary is not None:
            parsed = go_parse_bool(raw_binary)
            if parsed is None:
                # nsqd's rule: an unrecognised value means binary (pre-1.0 clients sent others).
                log.warn("deprecated value {value!r} used for /mpub binary param", value=raw_binary)
                parsed = True
            binary = parsed
        read_max = opts.max_body_size + 1
        body = _mpub_body(request, read_max)
        max_msg = opts.max_msg_size
        end = len(body)
        if binary:
            if end == read_max:
                raise ApiError(413, "BODY_TOO_BIG")
            count = _binary_count(body, opts.max_body_size)
            if is_big(count, end):
                return self.publish_in_chunks(
                    request, topic, binary_chunks(body, 4, end, count, max_msg, exact=False),
                    lambda chunk: binary_bodies(body, end, chunk), binary, defer)
            bodies = parse_binary_mpub(body, max_msg, opts.max_body_size)
        else:
            if is_big(body.count(b"\n") + 1, end):
                return self.publish_in_chunks(
                    request, topic, text_chunks(body, read_max, max_msg),
                    lambda chunk: text_bodies(body, chunk), binary, defer)
            bodies = split_text_mpub(body, read_max, max_msg)
        return self.publish(request, topic, bodies, defer)
