"""`/topic/retention`, `/topic/offsets`, `/topic/read`: a topic's retained log over HTTP (mqd's own).

A topic that retains (`--retention-time` / `--retention-bytes`, or its own
override) keeps every message published to it in a log numbered by
offset, whatever its channels did with the message (IRetainedLog). These
endpoints set a topic's retention, say what its log holds, and read it.
Times are milliseconds since the Unix epoch, except a record's own
timestamp, which is nanoseconds as in every message frame and peek.

* `GET /topic/retention?topic=T` and `POST /topic/retention?topic=T[&time=D][&bytes=B]`
  (`default=true` instead: back to the broker's options): the topic's
  retention, `{"topic","time","bytes","time_ms","overridden"}`. Both
  bounds 0 turn retention off for the topic and delete its log; the
  answer comes once nsqd.dat holds the change.
* `GET /topic/offsets?topic=T[&timestamp=MS]`: the log's epoch and bounds.
* `GET /topic/read?topic=T&offset=N|earliest|latest[&max_messages=M][&max_bytes=B][&format=json]`:
  records from N on, as binary frames (mqd.wire.log_frames) or as JSON
  shaped like a peek's messages.

A binary read is measured first, then written. Its extent (the records
up to `max_messages`, `max_bytes` of ids and bodies, and the log's latest
offset at the request) is found a chunk of at most CHUNK_BYTES per reactor
turn, from the records' lengths (`frames_extent`: no frame is built to be
thrown away), so the headers (`X-Mqd-Next-Offset`, `Content-Length`) are
exact before a byte of the body is sent; then the body is written by a
pull producer that reads one chunk per `resumeProducing`, as the client
takes them. So a 100 MiB read holds one chunk at a time, never the answer, and
a publish waits at most one chunk's read. An answer of one chunk is
written at once from its measuring read. Should the log lose records the
answer still needed (expired meanwhile, the topic deleted, its retention
turned off), the connection is closed short of its Content-Length.

With auth configured, offsets and reads need a `subscribe` grant on some
channel of the topic, as `/topic/peek` (mqd.http.authorization); setting
or reading the retention is an admin's (GRANTS in mqd.nsqd.http.site,
under `--http-auth-required`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IPullProducer
from twisted.web.server import Request
from zope.interface import implementer

from backends import BackendError
from backends.interface import OffsetOutOfRange
from mqd.http.args import Query, go_parse_bool, max_body_arg, positive_arg, query_of, topic_arg
from mqd.http.authorization import AuthCache, require_grant
from mqd.http.endpoint import LATER, client_gone
from mqd.http.response import JSON_CONTENT_TYPE, ApiError, dumps, respond_v1
from mqd.logs import get_logger
from mqd.message import Message
from mqd.nsqd.http.peek import PEEK_ANSWERS, PeekWork, peek_message
from mqd.nsqd.http.topics import TopicEndpoint, answer_once_persisted
from mqd.nsqd.stats import go_duration, retention_json
from mqd.options import parse_duration, parse_size
from mqd.wire.log_frames import FRAME_OVERHEAD

if TYPE_CHECKING:
    from backends.interface import IRetainedLog
    from mqd.http.auth import AuthState
    from mqd.nsqd.topic import Topic

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_MESSAGES",
    "FRAMES_CONTENT_TYPE",
    "MAX_BYTES",
    "MAX_MESSAGES",
    "TopicOffsets",
    "TopicRead",
    "TopicRetention",
    "retained_log",
    "retention_answer",
    "start_offset",
]

log = get_logger(__name__)

FRAMES_CONTENT_TYPE = b"application/vnd.mqd.log-frames"
# Largest read of the log between two reactor turns (measuring) or writes (writing).
CHUNK_BYTES = 256 << 10
DEFAULT_MAX_MESSAGES = 1000
MAX_MESSAGES = 1_000_000
DEFAULT_MAX_BYTES = 1 << 20
MAX_BYTES = 100 << 20
# Go's time.Duration and the logs' integers are int64.
_INT64 = (1 << 63) - 1


# -- arguments ------------------------------------------------------------------------------


def _digits(raw: str | None) -> int | None:
    """A string of ASCII digits as an int (at most 19 of them past leading zeros), else None."""
    if raw is None or not raw.isascii() or not raw.isdigit():
        return None
    digits = raw.lstrip("0") or "0"
    return int(digits) if len(digits) <= 19 else None


def offset_arg(query: Query) -> int | str:
    """`offset`: an integer >= 0, `earliest` or `latest`; 400 INVALID_OFFSET otherwise (and when absent)."""
    raw = query.first("offset")
    if raw in ("earliest", "latest"):
        return raw
    value = _digits(raw)
    if value is None or value > _INT64:
        raise ApiError(400, "INVALID_OFFSET")
    return value


def timestamp_arg(query: Query) -> int | None:
    """`timestamp`: milliseconds since the Unix epoch, as ns; None when absent; 400 INVALID_TIMESTAMP otherwise."""
    raw = query.first("timestamp")
    if raw is None:
        return None
    value = _digits(raw)
    if value is None:
        raise ApiError(400, "INVALID_TIMESTAMP")
    return min(value * 1_000_000, _INT64)


def _time_arg(query: Query) -> float | None:
    raw = query.first("time")
    if raw is None:
        return None
    try:
        seconds = parse_duration(raw)
    except ValueError:
        raise ApiError(400, "INVALID_TIME") from None
    if not math.isfinite(seconds) or not 0 <= seconds * 1e9 <= _INT64:
        raise ApiError(400, "INVALID_TIME")
    return seconds


def _bytes_arg(query: Query) -> int | None:
    raw = query.first("bytes")
    if raw is None:
        return None
    try:
        value = parse_size(raw)
    except ValueError:
        raise ApiError(400, "INVALID_BYTES") from None
    if value > _INT64:
        raise ApiError(400, "INVALID_BYTES")
    return value


def _answer(request: Request, code: int, payload: dict[str, Any] | bytes) -> object:
    """A V1 JSON answer (a dict, or its encoding) with a status of its own (416 names the log's bounds); LATER."""
    if client_gone(request):
        return LATER
    request.setHeader(b"Content-Type", JSON_CONTENT_TYPE)
    body = respond_v1(request, 200, payload)
    request.setResponseCode(code)
    request.setHeader(b"Content-Length", b"%d" % len(body))
    request.write(body)
    request.finish()
    return LATER


def out_of_range(request: Request, e: OffsetOutOfRange) -> object:
    """The 416 answer, which names the log's bounds besides the message; written here (LATER)."""
    return _answer(request, 416, {"message": "OFFSET_OUT_OF_RANGE", "earliest": e.earliest, "latest": e.latest})


# -- /topic/retention ---------------------------------------------------------------------------


def retention_answer(topic: Topic) -> dict[str, Any]:
    """`{"topic","time","bytes","time_ms","overridden"}`: `time` as Go prints a duration (`24h0m0s`)."""
    retention = topic.retention
    shown = retention_json(topic)
    return {"topic": topic.name, "time": go_duration(round(retention.time * 1e9)), "bytes": shown["bytes"],
            "time_ms": shown["time_ms"], "overridden": retention.overridden}


class TopicRetention(TopicEndpoint):
    """`GET` and `POST /topic/retention?topic=T`: a topic's retention, read or set (see the module doc)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        return retention_answer(self.existing_topic(topic_arg(query_of(request))))

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> Any:
        query = query_of(request)
        topic = self.existing_topic(topic_arg(query))
        time, nbytes = _time_arg(query), _bytes_arg(query)
        default = False
        raw = query.first("default")
        if raw is not None:
            parsed = go_parse_bool(raw)
            if parsed is None or (parsed and (time is not None or nbytes is not None)):
                raise ApiError(400, "INVALID_DEFAULT")
            default = parsed
        if topic.ephemeral:
            raise ApiError(400, "INVALID_TOPIC")  # an #ephemeral topic never retains
        if not default and time is None and nbytes is None:
            return retention_answer(topic)
        broker = self.broker
        try:
            broker.set_retention(topic, time, nbytes, default)
        except ValueError:
            # A retention the store cannot keep: none at all on the dummy
            # store, time alone on the memory store (a size is needed).
            raise ApiError(400, "RETENTION_UNSUPPORTED" if broker.options.backend == "dummy"
                           else "INVALID_BYTES") from None
        except BackendError:
            raise ApiError(500, "INTERNAL_ERROR") from None
        return answer_once_persisted(broker, request, topic.name, retention_answer(topic))


# -- the log's readers --------------------------------------------------------------------------


class _LogEndpoint(TopicEndpoint):
    """An endpoint reading a topic's retained log: checks the secret's grant first, as peek does."""

    def __init__(self, broker: Any, auth: AuthCache, work: PeekWork) -> None:
        super().__init__(broker)
        self.auth = auth
        self.work = work

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> object:
        return self.auth.guard(request, lambda auth: self.answer(request, auth))

    def answer(self, request: Request, auth: AuthState | None) -> object:
        raise NotImplementedError

    def retaining_topic(self, request: Request, auth: AuthState | None) -> tuple[Any, Topic]:
        """The query and the existing topic it names (subscribe grant checked); its log is checked later."""
        query = query_of(request)
        name = topic_arg(query)
        if auth is not None:
            require_grant(auth.allows_topic(name))
        return query, self.existing_topic(name)


def retained_log(topic: Topic) -> IRetainedLog:
    """The topic's retained log, or 400 RETENTION_OFF."""
    retained = topic.log
    if retained is None:
        raise ApiError(400, "RETENTION_OFF")
    return retained


def start_offset(retained: IRetainedLog, asked: int | str) -> tuple[int, int, int]:
    """(offset, earliest, latest): where `asked` (offset_arg's answer) starts in the log, and its bounds now.

    OffsetOutOfRange for an offset outside [earliest, latest].
    """
    earliest, latest = retained.earliest(), retained.latest()
    if asked == "earliest":
        return earliest, earliest, latest
    if asked == "latest":
        return latest, earliest, latest
    offset = int(asked)
    if not earliest <= offset <= latest:
        raise OffsetOutOfRange(offset, earliest, latest)
    return offset, earliest, latest


class TopicOffsets(_LogEndpoint):
    """`GET /topic/offsets?topic=T[&timestamp=MS]`: the log's epoch, bounds and size."""

    def answer(self, request: Request, auth: AuthState | None) -> object:
        query, topic = self.retaining_topic(request, auth)
        timestamp = timestamp_arg(query)
        retained = retained_log(topic)
        oldest = retained.oldest_timestamp()
        body: dict[str, Any] = {
            "topic": topic.name,
            "epoch": retained.epoch,
            "earliest": retained.earliest(),
            "latest": retained.latest(),
            "retained_bytes": retained.retained_bytes(),
            "oldest_timestamp": None if oldest is None else oldest // 1_000_000,
        }
        if timestamp is not None:
            body["offset_for_timestamp"] = retained.offset_for_timestamp(timestamp)
        body["kept"] = bool(retained.kept)
        body["retention"] = retention_json(topic)
        return body


class TopicRead(_LogEndpoint):
    """`GET /topic/read?topic=T&offset=N`: records from N on, binary frames or (`format=json`) JSON."""

    def answer(self, request: Request, auth: AuthState | None) -> object:
        query, topic = self.retaining_topic(request, auth)
        asked = offset_arg(query)
        max_messages = positive_arg(query, "max_messages", DEFAULT_MAX_MESSAGES, MAX_MESSAGES,
                                    "INVALID_MAX_MESSAGES")
        max_bytes = positive_arg(query, "max_bytes", DEFAULT_MAX_BYTES, MAX_BYTES, "INVALID_MAX_BYTES")
        as_json = query.first("format") == "json"
        max_body = max_body_arg(query, self.broker.options.peek_max_body_bytes) if as_json else 0
        retained = retained_log(topic)
        try:
            offset, earliest, latest = start_offset(retained, asked)
        except OffsetOutOfRange as e:
            return out_of_range(request, e)
        try:
            if as_json:
                return self._json(request, topic, retained, offset, latest, max_messages, max_bytes, max_body)
            return _Read(request, self.work, topic, retained, (offset, earliest, latest),
                         max_messages, max_bytes).start()
        except OffsetOutOfRange as e:
            return out_of_range(request, e)
        except BackendError:
            raise ApiError(500, "INTERNAL_ERROR") from None

    def _json(self, request: Request, topic: Topic, retained: IRetainedLog, offset: int, latest: int,
              max_messages: int, max_bytes: int, max_body: int) -> object:
        """The records as peek shows messages, within --peek-max-bytes (and peek's bound on answers being built).

        The log is read a chunk at a time until the answer is full; its
        first record always comes, each body cut at `max_body` as peek's.
        """
        budget = self.broker.options.peek_max_bytes
        work = self.work
        work.reserve(budget, PEEK_ANSWERS * budget)
        try:
            head = dumps({"topic": topic.name, "epoch": retained.epoch})[:-1] + b',"messages":['
            room = budget - len(head) - len(b'],"next_offset":%d}' % _INT64)
            parts: list[bytes] = []
            pos, left_msgs, left_bytes = offset, max_messages, max_bytes
            full = False
            while not full and left_msgs > 0 and left_bytes > 0 and pos < latest:
                records = retained.read(pos, min(left_msgs, latest - pos), min(CHUNK_BYTES, left_bytes))
                if not records:
                    break
                for at, timestamp, data in records:
                    first = not parts
                    if not first and len(data) > left_bytes:
                        full = True
                        break
                    shown = peek_message(Message.of(data, timestamp), max_body=max_body)
                    entry = dumps({"offset": at, "id": shown["id"], "timestamp": shown["timestamp"],
                                   "attempts": 0, "size": shown["size"], "body": shown["body"],
                                   "body_text": shown["body_text"]})
                    if not first and len(entry) + 1 > room:
                        full = True
                        break
                    parts.append(entry)
                    room -= len(entry) + (0 if first else 1)
                    pos = at + 1
                    left_msgs -= 1
                    left_bytes -= len(data)
            body = b"".join((head, b",".join(parts), b'],"next_offset":%d}' % pos))
            return _answer(request, 200, body)
        finally:
            # Built and handed to the transport: what it holds is its own from here.
            work.release(budget)


# -- binary reads ------------------------------------------------------------------------------------


@implementer(IPullProducer)
class _Read:
    """One binary read: measured a chunk per reactor turn, then written by a pull producer (see the module doc).

    `bounds` are the offset asked for and the log's earliest and latest
    offsets at the request: records published since are not in the answer.
    """

    def __init__(self, request: Request, work: PeekWork, topic: Topic, retained: IRetainedLog,
                 bounds: tuple[int, int, int], max_messages: int, max_bytes: int) -> None:
        self.request = request
        self.work = work
        self.topic = topic
        self.retained = retained
        self.offset, self.earliest, self.latest = bounds
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        # Measured: the offset after the answer's last record, the answer's size,
        # the first chunk's frames and the offset after them.
        self.end = self.offset
        self.size = 0
        self.first = b""
        self.first_end = self.offset
        # Writing: the next offset to read and the bytes left to write.
        self.pos = self.offset
        self.left = 0
        self.done = False

    def start(self) -> object:
        """Measure (the first chunk at once, so that its error is still an answer), then write; LATER."""
        steps = self._measure()
        if next(steps, True) is True:
            self._write()
            return LATER
        task = self.work.cooperator.cooperate(steps)
        task.whenDone().addCallbacks(lambda _: self._write(), self._failed)
        return LATER

    def _measure(self) -> Iterator[None]:
        """Find the answer's extent, one chunk per step; the first chunk's frames are kept to write.

        Only the first chunk is read as frames: the others are measured
        (`frames_extent`, the records' lengths summed), as they are read
        again, a chunk at a time, once the headers are out.
        """
        retained = self.retained
        pos, left_msgs, left_bytes = self.offset, self.max_messages, self.max_bytes
        while left_msgs > 0 and left_bytes > 0 and pos < self.latest:
            first = pos == self.offset
            asked = (pos, min(left_msgs, self.latest - pos), min(CHUNK_BYTES, left_bytes))
            if first:
                frames, after = retained.read_frames(*asked)
                size = len(frames)
            else:
                yield None
                if client_gone(self.request):
                    self.done = True
                    return
                self._check_log()
                size, after = retained.frames_extent(*asked)
            count = after - pos
            if count <= 0:
                break
            data = size - FRAME_OVERHEAD * count
            # A store goes past `max_bytes` only with a chunk's first record, alone:
            # the answer's first record comes whatever its size, a later one only if it fits.
            cut = data > left_bytes
            if cut and not first:
                break
            pos += count
            if first:
                self.first, self.first_end = frames, pos
            self.size += size
            left_msgs -= count
            left_bytes -= data
            self.end = pos
            if cut:
                break

    def _check_log(self) -> None:
        """BackendError unless the topic still reads from this log (not deleted, retention not turned off)."""
        if self.topic.log is not self.retained:
            raise BackendError(f"TOPIC({self.topic.name}): its retained log is gone")

    def _failed(self, failure) -> None:
        request = self.request
        if client_gone(request):
            return
        if failure.check(OffsetOutOfRange):
            out_of_range(request, failure.value)
            return
        if failure.check(BackendError):
            log.warn("{uri}: {error}", uri=request.uri, error=failure.value)
        else:
            log.failure("{method} {uri} failed", failure, method=request.method, uri=request.uri)
        _answer(request, 500, {"message": "INTERNAL_ERROR"})

    def _write(self) -> None:
        """The headers, exact now, and the first chunk; the pull producer reads and writes the rest."""
        request = self.request
        if self.done or client_gone(request):
            return
        request.setHeader(b"Content-Type", FRAMES_CONTENT_TYPE)
        respond_v1(request, 200, b"")
        request.setHeader(b"X-Mqd-Epoch", b"%d" % self.retained.epoch)
        request.setHeader(b"X-Mqd-Next-Offset", b"%d" % self.end)
        request.setHeader(b"X-Mqd-Earliest", b"%d" % self.earliest)
        request.setHeader(b"X-Mqd-Latest", b"%d" % self.latest)
        request.setHeader(b"Content-Length", b"%d" % self.size)
        first, self.first = self.first, b""
        self.pos = self.first_end
        self.left = self.size - len(first)
        if first:
            request.write(first)
        if self.pos >= self.end:
            self.done = True
            request.finish()
            return
        request.registerProducer(self, False)

    # -- IPullProducer -------------------------------------------------------------------------------

    def resumeProducing(self) -> None:
        """One chunk read and written: the transport asks again once it wants more."""
        if self.done:
            return
        request = self.request
        if client_gone(request):
            self.done = True
            return
        try:
            self._check_log()
            frames, after = self.retained.read_frames(self.pos, self.end - self.pos, CHUNK_BYTES)
            if not self.pos < after <= self.end or len(frames) > self.left:
                raise BackendError(f"TOPIC({self.topic.name}): its retained log changed under a read")
        except (BackendError, OffsetOutOfRange) as e:
            # The headers are out: the answer can only be cut short.
            log.warn("{uri}: read stopped at offset {pos} of {end}: {error}", uri=request.uri, pos=self.pos,
                     end=self.end, error=e)
            self.done = True
            request.unregisterProducer()
            request.loseConnection()
            return
        self.pos = after
        self.left -= len(frames)
        request.write(frames)
        if self.pos >= self.end:
            self.done = True
            request.unregisterProducer()
            request.finish()

    def stopProducing(self) -> None:
        self.done = True
