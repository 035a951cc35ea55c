"""A topic's retained log read straight from a broker over HTTP, as Arrow batches: the offset mode's fetcher.

Spark's executors read the ranges of offsets the driver planned
(`log_offsets` says what a broker's log holds, `read_batches` reads
`[start, end)` of it), so this is plain blocking code (http.client): it
runs in Spark's Python workers and in the driver's source process, where
no reactor runs. One `read_batches` keeps one HTTP connection alive and
asks `GET /topic/read` again from each answer's `X-Mqd-Next-Offset`
until `end`; each answer (binary record frames, mqd.wire.log_frames) is
turned into one Arrow batch by `frames_to_batch`, with numpy over the
answer's bytes rather than a Python loop per record: the only per-record
Python is finding where each frame starts.

Rows are the streaming source's (stream_source.ARROW_STREAM_SCHEMA:
topic, channel (null: no channel is involved), message_id, timestamp
(the publish time), attempts (0), body, nsqd (the broker's TCP address))
plus `offset`. A range is read exactly or not at all: every record of it
in offset order, checked to be the one asked for (consecutive offsets,
the answer's epoch), or an error. The errors are LogFetchError's
subclasses, one line each naming the broker and the topic, so that the
Spark source can tell a log that moved on (OffsetOutOfRange,
EpochChanged) from a broker that refused (Refused) or could not answer
(Unreachable).

Each request carries the secret as `Authorization: Bearer <secret>` (as
mq-tail and the streaming source send it). With `tls` the broker's HTTPS
listener (`--https-address`) is asked, verified against
`tls_root_ca_file` unless `tls_insecure_skip_verify`.
"""

from __future__ import annotations

import functools
import gc
import http.client
import json
import socket
import ssl
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from types import ModuleType
from typing import Any
from urllib.parse import urlencode

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mqd.wire.go_json import error_message
from mqd.wire.log_frames import FRAME_OVERHEAD
from spark_bridge.stream_schema import OFFSET_ARROW_SCHEMA, OFFSET_SCHEMA_DDL

__all__ = [
    "OFFSET_ARROW_SCHEMA",
    "OFFSET_SCHEMA_DDL",
    "BrokerLog",
    "EpochChanged",
    "LogFetchError",
    "LogOffsets",
    "OffsetOutOfRange",
    "Refused",
    "RetentionOff",
    "TopicMissing",
    "Unreachable",
    "frames_to_batch",
    "freeze_worker_heap",
    "log_offsets",
    "read_batches",
]

# How a refusal's line says where the secret goes (the Spark source's option).
SECRET_OPTION = "option auth_secret"
# The broker's own bounds of one answer (larger values are answered with these).
_MAX_MESSAGES = 1_000_000
_MAX_BYTES = 100 << 20
# An answer's frames become one batch of binary (int32 offsets): never 2 GiB or more.
_MAX_ANSWER = (1 << 31) - 1
# Bytes of an error answer read (its {"message": ...}); the rest is dropped with the connection.
_ERROR_BODY = 64 << 10
_FRAMES_TYPE = "application/vnd.mqd.log-frames"
_ACCEPT = "application/vnd.nsq; version=1.0"

_SIZE = struct.Struct(">I")
_ID = 16
# A frame's head: size, offset, timestamp, attempts and id; its body follows.
_HEAD = FRAME_OVERHEAD + _ID
_AT_OFFSET, _AT_TIMESTAMP, _AT_ATTEMPTS, _AT_ID = 4, 12, 20, FRAME_OVERHEAD
_TIMESTAMP_US = pa.timestamp("us", tz="UTC")


# -- errors ---------------------------------------------------------------------------------------


class LogFetchError(RuntimeError):
    """A broker's retained log could not be read as asked: one line naming the broker and the topic."""


class OffsetOutOfRange(LogFetchError):
    """An offset outside the log's [earliest, latest]: records expired, or never written (the broker's 416)."""

    def __init__(self, message: str, offset: int, earliest: int, latest: int) -> None:
        super().__init__(message)
        self.offset = offset
        self.earliest = earliest
        self.latest = latest

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.offset, self.earliest, self.latest)


class EpochChanged(LogFetchError):
    """The log is another life of the topic than the one planned (deleted and created again, retention cycled)."""

    def __init__(self, message: str, expected: int, found: int) -> None:
        super().__init__(message)
        self.expected = expected
        self.found = found

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.expected, self.found)


class RetentionOff(LogFetchError):
    """The topic keeps no retained log (400 RETENTION_OFF)."""


class TopicMissing(LogFetchError):
    """The broker has no such topic (404 TOPIC_NOT_FOUND)."""


class Refused(LogFetchError):
    """The broker refused the secret (401 or 403)."""


class Unreachable(LogFetchError):
    """No answer: connection refused, reset or timed out, or the broker failed (5xx)."""


# -- what is asked, and what it says ----------------------------------------------------------------


@dataclass(frozen=True)
class BrokerLog:
    """One broker whose retained logs are read, and how to reach its HTTP API (picklable: sent to executors).

    `nsqd` is the broker's name as rows show it (its TCP address);
    `http` the `host:port` asked, its HTTPS listener when `tls`.
    """

    nsqd: str
    http: str
    tls: bool = False
    tls_root_ca_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_insecure_skip_verify: bool = False
    secret: str | None = None
    timeout: float = 60.0

    def where(self, topic: str) -> str:
        """`topic T on nsqd HOST:4150 (http HOST:4151)`, for error lines."""
        return f"topic {topic} on nsqd {self.nsqd} ({'https' if self.tls else 'http'} {self.http})"


@dataclass(frozen=True)
class LogOffsets:
    """A `/topic/offsets` answer: the log's life (epoch), bounds, size and the offset a time asked for.

    `latest` is the offset the next record gets; `offset_for_timestamp`
    the first record published at or after the time asked (`latest` if
    none; None when no time was asked); `oldest_timestamp` is in ms.
    """

    epoch: int
    earliest: int
    latest: int
    offset_for_timestamp: int | None
    retained_bytes: int
    oldest_timestamp: int | None


def log_offsets(broker: BrokerLog, topic: str, timestamp_ms: int | None = None) -> LogOffsets:
    """What `topic`'s retained log on `broker` holds now; with `timestamp_ms`, where that time starts in it."""
    query: dict[str, Any] = {"topic": topic}
    if timestamp_ms is not None:
        if timestamp_ms < 0:
            raise ValueError(f"timestamp_ms must be >= 0 (ms since the Unix epoch), got {timestamp_ms}")
        query["timestamp"] = timestamp_ms
    with _Connection(broker, topic) as conn:
        reply = conn.get("/topic/offsets", query)
    if reply.status != 200:
        raise conn.refusal("/topic/offsets", reply)
    try:
        data = json.loads(reply.body)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("kept") is False:
            raise LogFetchError(f"mqd: {broker.where(topic)} keeps no retained log: its store keeps no "
                                "messages (--backend dummy)")
        oldest = data.get("oldest_timestamp")
        return LogOffsets(
            epoch=_count(data, "epoch"),
            earliest=_count(data, "earliest"),
            latest=_count(data, "latest"),
            offset_for_timestamp=None if timestamp_ms is None else _count(data, "offset_for_timestamp"),
            retained_bytes=_count(data, "retained_bytes"),
            oldest_timestamp=None if oldest is None else _int(oldest, "oldest_timestamp"),
        )
    except ValueError as e:
        raise LogFetchError(f"mqd: {broker.where(topic)} answered /topic/offsets with something else: "
                            f"{e}") from None


def _int(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} is not an integer: {value!r:.60}")
    return value


def _count(data: Mapping[str, Any], key: str) -> int:
    value = _int(data.get(key), key)
    if value < 0:
        raise ValueError(f"{key} is negative: {value}")
    return value


# -- reading ------------------------------------------------------------------------------------------


def read_batches(broker: BrokerLog, topic: str, start: int, end: int, *, epoch: int | None = None,
                 max_bytes: int = 16 << 20, max_rows: int = 65536) -> Iterator[pa.RecordBatch]:
    """Every record of offsets [start, end) as Arrow batches of OFFSET_ARROW_SCHEMA, in offset order.

    Each batch has at most `max_rows` rows; each answer at most
    `max_bytes` of ids and bodies (its first record whole whatever its
    size). The answers come on one kept-alive connection, each asked
    from the previous one's `X-Mqd-Next-Offset` for the records left, so
    no record at or past `end` is ever read. Raises EpochChanged when an
    answer's epoch is not `epoch` (when given; else the first answer's),
    OffsetOutOfRange when the next offset to read is no longer kept (416:
    it expired) or the log ends before `end` (a range /topic/offsets
    promised must exist: a store that lost what it had not synced), the
    records before that having been yielded; its `offset` is that next
    offset, so a caller that keeps the offset after its last row sees
    which case it is (`earliest` above it: expired). A
    connection the broker closed while idle, or an answer cut short (the
    log lost records under it), is asked again once on a new connection:
    what it answers then (416, most likely) is what is raised.
    """
    if not 0 <= start <= end:
        raise ValueError(f"want 0 <= start <= end, got [{start}, {end})")
    if max_bytes <= 0 or max_rows <= 0:
        raise ValueError("max_bytes and max_rows must be positive")
    if start == end:
        return
    with _Connection(broker, topic) as conn:
        pos = start
        while pos < end:
            reply = conn.get("/topic/read", {"topic": topic, "offset": pos,
                                             "max_messages": min(end - pos, _MAX_MESSAGES),
                                             "max_bytes": min(max_bytes, _MAX_BYTES)}, frames=True)
            if reply.status != 200:
                raise conn.refusal("/topic/read", reply, pos)
            found, after, earliest, latest = conn.read_headers(reply)
            if epoch is None:
                epoch = found
            elif found != epoch:
                raise EpochChanged(
                    f"mqd: {broker.where(topic)}: the retained log is another one than planned (epoch {found}, "
                    f"not {epoch}): the topic was deleted and created again, or its retention turned off and on",
                    epoch, found)
            try:
                batch = frames_to_batch(reply.body, topic, broker.nsqd)
            except LogFetchError as e:
                raise LogFetchError(f"{e} (http {broker.http}, /topic/read from offset {pos})") from None
            n = batch.num_rows
            if n == 0 and after == pos and latest <= pos:
                raise OffsetOutOfRange(
                    f"mqd: offsets {pos} to {end - 1} of {broker.where(topic)} are not in its retained log: "
                    f"it ends before them (earliest {earliest}, latest {latest}), though it was planned to "
                    f"reach offset {end}", pos, earliest, latest)
            if not 0 < n <= end - pos or after != pos + n or not _consecutive(batch, pos):
                raise LogFetchError(
                    f"mqd: {broker.where(topic)} answered /topic/read from offset {pos} with other records "
                    f"than asked ({n} records, next offset {after}, asked up to {end})")
            pos = after
            del reply
            if n <= max_rows:
                yield batch
            else:
                for at in range(0, n, max_rows):
                    yield batch.slice(at, max_rows)


_heap_frozen = False


def freeze_worker_heap() -> None:
    """Move what this process holds now out of the cyclic collector's reach, once (Spark's executors call it).

    A Spark Python worker runs `gc.collect()` after every task it is
    reused for, over everything alive: pyspark, pyarrow, pandas and this
    package's imports, some 100,000 objects, measured at 50 ms a task.
    Frozen at the first read (gc.freeze), those are never scanned again;
    each collection then sees only what later tasks made.
    """
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.freeze()


def _consecutive(batch: pa.RecordBatch, first: int) -> bool:
    """Whether the batch's offsets are first, first + 1, ...: the records asked for, none missing."""
    offsets = batch.column(len(OFFSET_ARROW_SCHEMA) - 1).to_numpy()
    return bool((offsets == np.arange(first, first + len(offsets), dtype=np.int64)).all())


# -- frames -> Arrow ------------------------------------------------------------------------------


def frames_to_batch(data: bytes | bytearray | memoryview, topic: str, nsqd: str) -> pa.RecordBatch:
    """One `/topic/read` answer's frames as one batch of OFFSET_ARROW_SCHEMA (bytes that are not whole frames: LogFetchError).

    Where each frame starts is the one sequential pass (none when every
    frame has the first one's length, as when bodies have one size).
    The fields are then gathered by numpy through views of the answer
    with a stride of one byte (element k of such a view is the field's
    bytes from byte k, so indexing it by the frame starts gathers that
    field of every frame), and the bodies cut out of the frames by
    Arrow's `binary_slice` over a binary array whose values are the
    frames themselves. The batch holds copies: nothing of `data` is kept,
    so its buffer may be reused once this returns.
    """
    u8 = np.frombuffer(data, dtype=np.uint8)
    end = len(u8)
    if end == 0:
        return _empty()
    try:
        if end > _MAX_ANSWER:
            raise _Malformed("an answer of 2 GiB or more")
        stride = _uniform_stride(data, u8, end)
        starts = np.arange(0, end, stride, dtype=np.int64) if stride else _frame_starts(data, end)
        ids, offsets, stamps = _fields(u8, starts, end)
    except _Malformed as e:
        raise LogFetchError(f"mqd: nsqd {nsqd} sent bytes that are not record frames for topic {topic}: "
                            f"{e}") from None
    n = len(starts)
    frames = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(np.append(starts, end).astype(np.int32)),
                                                    pa.py_buffer(u8)])
    return pa.RecordBatch.from_arrays([
        pa.repeat(pa.scalar(topic, pa.string()), n),
        pa.nulls(n, pa.string()),
        pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(np.arange(0, _ID * (n + 1), _ID, dtype=np.int32)),
                                               pa.py_buffer(ids)]),
        pa.Array.from_buffers(_TIMESTAMP_US, n, [None, pa.py_buffer(stamps)]),
        pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(np.zeros(n, dtype=np.int32))]),
        pc.binary_slice(frames, _HEAD, _MAX_ANSWER),
        pa.repeat(pa.scalar(nsqd, pa.string()), n),
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(offsets)]),
    ], schema=OFFSET_ARROW_SCHEMA)


def _empty() -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in OFFSET_ARROW_SCHEMA],
                                      schema=OFFSET_ARROW_SCHEMA)


class _Malformed(Exception):
    """Bytes that are not a whole sequence of record frames (why, for the error line)."""


def _uniform_stride(data: bytes | bytearray | memoryview, u8: np.ndarray, end: int) -> int:
    """The frames' length when they all have the first one's (bodies of one size: no pass needed); else 0."""
    if end < 4:
        raise _Malformed(f"a frame cut short at byte 0 ({end} bytes left)")
    stride = _SIZE.unpack_from(data, 0)[0] + 4
    if stride < _HEAD or end % stride:
        return 0
    sizes = np.ndarray((end // stride,), dtype=">u4", buffer=u8, strides=(stride,))
    return stride if bool((sizes == stride - 4).all()) else 0


def _frame_starts(data: bytes | bytearray | memoryview, end: int) -> np.ndarray:
    """Where each frame starts: the one sequential pass, each size read where the previous frame ends."""
    unpack = _SIZE.unpack_from
    starts: list[int] = []
    append = starts.append
    pos = 0
    try:
        while pos < end:
            append(pos)
            pos += unpack(data, pos)[0] + 4
    except struct.error:
        raise _Malformed(f"a frame cut short at byte {starts[-1]} ({end - starts[-1]} bytes left)") from None
    if pos != end:
        raise _Malformed(f"the frame at byte {starts[-1]} is {pos - starts[-1]} bytes long, "
                         f"{end - starts[-1]} are left")
    return np.array(starts, dtype=np.int64)


def _fields(u8: np.ndarray, starts: np.ndarray, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, offsets, timestamps in us) of the frames at `starts`, checked as every record frame is.

    Every frame has attempts 0, an offset an int64 holds and an id of 16
    hex characters: bytes out of step with the frames fail one of these.
    """
    lengths = np.diff(starts, append=end)
    if int(lengths.min()) < _HEAD:
        at = int(starts[int(np.argmin(lengths))])
        raise _Malformed(f"the frame at byte {at} is shorter than a frame's head ({_HEAD} bytes)")

    def field(offset: int, dtype: str, size: int) -> np.ndarray:
        # Element k is the `size` bytes from byte k: indexed by the frame starts, each frame's field.
        return np.ndarray((end - size + 1,), dtype=dtype, buffer=u8, strides=(1,))[starts + offset]

    if field(_AT_ATTEMPTS, ">u2", 2).any():
        raise _Malformed("a frame with attempts other than 0 (frames out of step)")
    offsets = field(_AT_OFFSET, ">i8", 8).astype(np.int64)
    if int(offsets.min()) < 0:
        raise _Malformed("a frame whose offset is past 2**63 (frames out of step)")
    ids = field(_AT_ID, f"S{_ID}", _ID)
    chars = ids.view(np.uint8)
    lower = chars | 0x20
    if not (((chars >= 0x30) & (chars <= 0x39)) | ((lower >= 0x61) & (lower <= 0x66))).all():
        raise _Malformed("a frame whose message id is not 16 hex characters (frames out of step)")
    return ids, offsets, field(_AT_TIMESTAMP, ">i8", 8).astype(np.int64) // 1000


# -- HTTP --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def message(self) -> str:
        """The `{"message": ...}` of an error answer, or ""."""
        return error_message(self.body)


def _bearer() -> ModuleType:
    """mqd.clusterinfo.bearer, imported when a secret is sent or refused: it brings Twisted in, which
    a read without a secret never needs (nor the driver's source process, started with every query)."""
    from mqd.clusterinfo import bearer

    return bearer


@functools.lru_cache(maxsize=32)
def _ssl_context(broker: BrokerLog) -> ssl.SSLContext:
    """The TLS settings of `broker`'s HTTPS requests (made once per process and broker)."""
    context = ssl.create_default_context(cafile=broker.tls_root_ca_file)
    if broker.tls_insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if broker.tls_cert or broker.tls_key:
        context.load_cert_chain(broker.tls_cert or "", broker.tls_key or None)
    return context


class _Connection:
    """One kept-alive connection to a broker's HTTP API for the requests of one call, closed with it."""

    __slots__ = ("broker", "topic", "_conn", "_used", "_headers")

    def __init__(self, broker: BrokerLog, topic: str) -> None:
        self.broker = broker
        self.topic = topic
        self._conn: http.client.HTTPConnection | None = None
        self._used = False
        self._headers = {"Accept": _ACCEPT}
        if broker.secret:
            try:
                secret = _bearer().check_secret(broker.secret, "secret")
            except ValueError as e:
                raise LogFetchError(f"mqd: {broker.where(topic)}: {e}") from None
            self._headers["Authorization"] = f"Bearer {secret}"

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _open(self) -> http.client.HTTPConnection:
        broker = self.broker
        host, _, port = broker.http.rpartition(":")
        if not host or not port.isdigit():
            raise LogFetchError(f"mqd: {broker.where(self.topic)}: bad HTTP address {broker.http!r}: "
                                "want host:port or [v6]:port")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if broker.tls:
            try:
                context = _ssl_context(broker)
            except (OSError, ssl.SSLError) as e:
                files = ", ".join(f"{key} {value}" for key, value in (
                    ("tls_root_ca_file", broker.tls_root_ca_file), ("tls_cert", broker.tls_cert),
                    ("tls_key", broker.tls_key)) if value)
                raise LogFetchError(f"mqd: {broker.where(self.topic)}: cannot load the TLS files "
                                    f"({files or 'the system CAs'}): {e}") from None
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, int(port), timeout=broker.timeout, context=context)
        else:
            conn = http.client.HTTPConnection(host, int(port), timeout=broker.timeout)
        self._used = False
        return conn

    def get(self, path: str, query: Mapping[str, Any], frames: bool = False) -> _Reply:
        """The answer to one GET, its body whole (a 200 of frames) or its first bytes (anything else).

        A connection the broker closed while it was idle, and an answer
        cut short, are asked once more on a new connection.
        """
        url = f"{path}?{urlencode(query)}"
        for again in (False, True):
            if self._conn is None:
                self._conn = self._open()
            conn, reused = self._conn, self._used
            self._used = True
            try:
                conn.request("GET", url, headers=self._headers)
                response = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self.close()
                if reused and not again:
                    continue  # a kept-alive connection the broker closed while it was idle
                raise self._failed(path, e) from None
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise self._failed(path, e) from None
            try:
                body = self._body(response, path, frames)
            except http.client.IncompleteRead as e:
                self.close()
                if not again:
                    continue  # cut short: the log lost records under it; what does it say now?
                raise self._failed(path, e) from None
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise self._failed(path, e) from None
            if response.will_close:
                self.close()
            return _Reply(response.status, response.headers, body)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _body(self, response: http.client.HTTPResponse, path: str, frames: bool) -> bytes:
        if response.status != 200 or not frames:
            body = response.read(_ERROR_BODY)
            if not response.isclosed():
                self.close()  # the rest is not wanted: this connection cannot be asked again
            return body
        kind = response.getheader("Content-Type", "")
        if not kind.startswith(_FRAMES_TYPE):
            self.close()
            raise self._not_a_log(path, f"200 with Content-Type {kind or 'none'}")
        if response.length is None or response.length > _MAX_ANSWER:
            self.close()
            raise LogFetchError(f"mqd: {self.broker.where(self.topic)} answered {path} with "
                                f"{'no Content-Length' if response.length is None else 'an answer of 2 GiB or more'}")
        return response.read()

    def read_headers(self, reply: _Reply) -> tuple[int, int, int, int]:
        """(epoch, next offset, earliest, latest) of a binary read's answer."""
        headers = reply.headers
        try:
            return (int(headers["X-Mqd-Epoch"]), int(headers["X-Mqd-Next-Offset"]),
                    int(headers["X-Mqd-Earliest"]), int(headers["X-Mqd-Latest"]))
        except (KeyError, TypeError, ValueError):
            raise self._not_a_log("/topic/read", "an answer without its X-Mqd-Epoch, X-Mqd-Next-Offset, "
                                                 "X-Mqd-Earliest and X-Mqd-Latest headers") from None

    def _failed(self, path: str, error: BaseException) -> LogFetchError:
        """A request that got no answer: Unreachable, unless TLS refused it (asking again would not help)."""
        where = self.broker.where(self.topic)
        if isinstance(error, ssl.SSLCertVerificationError):
            return LogFetchError(f"mqd: {where}: TLS: the broker's certificate is refused "
                                 f"({error.verify_message or error.reason}): check tls_root_ca_file")
        if isinstance(error, ssl.SSLError) and not isinstance(error, ssl.SSLEOFError | ssl.SSLZeroReturnError
                                                              | ssl.SSLSyscallError):
            hint = (": the broker requires a client certificate it accepts (tls_cert, tls_key)"
                    if "CERTIFICATE" in str(error.reason) else "")
            return LogFetchError(f"mqd: {where}: TLS failed ({error.reason or type(error).__name__}){hint}")
        if isinstance(error, socket.timeout | TimeoutError):
            reason = f"no answer within {self.broker.timeout:g}s"
        else:
            reason = (str(error) or type(error).__name__).splitlines()[0][:300]
        return Unreachable(f"mqd: {where}: {path}: {reason}")

    def _not_a_log(self, path: str, what: str) -> LogFetchError:
        return LogFetchError(f"mqd: nsqd {self.broker.nsqd} ({'https' if self.broker.tls else 'http'} "
                             f"{self.broker.http}) answered {path} for topic {self.topic} with {what}: it does "
                             "not keep retained logs (it is not an mqd, or one without them)")

    def refusal(self, path: str, reply: _Reply, offset: int | None = None) -> LogFetchError:
        """The error of an answer other than 200, by its status and message."""
        where = self.broker.where(self.topic)
        code, message = reply.status, reply.message()
        if code in (401, 403):
            return Refused(f"mqd: {where}: {path} answered {code} {HTTPStatus(code).phrase}"
                           + (f" ({message})" if message else "")
                           + f": {_bearer().refusal_hint(code, reply.body, SECRET_OPTION)}")
        if code == 416:
            bounds = _bounds(reply)
            asked = -1 if offset is None else offset
            return OffsetOutOfRange(
                f"mqd: offset {asked} is out of range for {where}: earliest {bounds[0]}, latest {bounds[1]}"
                " (its records expired, or the log is shorter than planned)", asked, *bounds)
        if code == 400 and message == "RETENTION_OFF":
            return RetentionOff(f"mqd: {where} keeps no retained log: retention is off for it (turn it on with "
                                "the broker's --retention-time / --retention-bytes, or POST /topic/retention)")
        if code == 404 and message == "TOPIC_NOT_FOUND":
            return TopicMissing(f"mqd: {where}: no such topic (404 TOPIC_NOT_FOUND)")
        if code in (404, 405):
            return self._not_a_log(path, f"{code} {message or HTTPStatus(code).phrase}")
        if code >= 500:
            return Unreachable(f"mqd: {where}: {path} answered {code}" + (f" {message}" if message else ""))
        return LogFetchError(f"mqd: {where}: {path} answered {code}" + (f" {message}" if message else ""))


def _bounds(reply: _Reply) -> tuple[int, int]:
    """(earliest, latest) of a 416: its X-Mqd-Earliest / X-Mqd-Latest headers, else its JSON body (-1 unknown)."""
    found: list[int] = []
    try:
        data = json.loads(reply.body)
    except ValueError:
        data = None
    for header, key in (("X-Mqd-Earliest", "earliest"), ("X-Mqd-Latest", "latest")):
        raw = reply.headers.get(header)
        value = data.get(key) if isinstance(data, dict) else None
        if raw is not None and raw.isdigit():
            found.append(int(raw))
        elif isinstance(value, int) and not isinstance(value, bool):
            found.append(value)
        else:
            found.append(-1)
    return found[0], found[1]
