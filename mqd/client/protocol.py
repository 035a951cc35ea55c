"""One NSQ V2 client connection: handshake, pipelined commands, messages, heartbeats.

The handshake is go-nsq's (conn.go): magic, IDENTIFY with feature
negotiation, then the upgrades the server agreed to in nsqd's order (TLS,
whose OK comes encrypted; then snappy or deflate, whose OK comes
compressed), then AUTH when the server requires it. `ready` fires once
all of that is done.

After it, commands that get an answer (PUB, MPUB, DPUB, SUB, CLS) return
a Deferred and may be pipelined: nsqd answers in order, so answers are
matched first-in first-out, as go-nsq's producer does. The exceptions are
the heartbeat (answered with NOP, pops nothing) and the non-fatal errors
about fire-and-forget FIN/REQ/TOUCH (reported to the delegate, pop
nothing). RDY, FIN, REQ, TOUCH and NOP are plain writes of bytes.

Frames are parsed in one loop over the bytes read with `unpack_from`, no
per-frame allocation beyond the payload; a frame split across reads is
kept as chunks until its size has arrived (not re-joined per read).
Compressed input is decoded in bounded steps with the broker's codecs
(mqd/wire/compression.py), each step parsed before the next.

A broken or hostile server gets a clean close, never an exception out of
`dataReceived`: a frame declaring more than `max_msg_size` (plus a
message's header) is refused before a byte of it is buffered, a handshake
answer must be the JSON object go-nsq decodes (nesting too deep for
Python's decoder, a non-object or a field of the wrong type fails the
handshake), and a frame that stays incomplete, or a handshake that is not
done, within `read_timeout` times out: a slow drip of bytes does not keep
a connection (or a command's Deferred) waiting forever. Each such end is
one `ServerProtocolError`, `HeartbeatTimeout` or NSQError, given to
`ready`, to the commands and to the delegate's `connection_closed`, which
is where it is logged, once (the default delegate logs it). An end before
the handshake is done that a retry cannot mend is also a
`HandshakeRefusedError` (an `UnusableAnswerError`, `IdentifyRefusedError`
or `AuthRefusedError`), carrying go-nsq's wording for the tools.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from collections.abc import Iterable
from typing import Any, cast

from twisted.internet import defer, protocol
from twisted.internet.error import ConnectionDone
from twisted.protocols.policies import TimeoutMixin
from twisted.python.failure import Failure

from mqd.client.config import Config
from mqd.client.errors import (
    AuthRequiredError,
    ConnectionClosed,
    HeartbeatTimeout,
    NSQError,
    ServerProtocolError,
    UnusableAnswerError,
    auth_refused,
    error_from_frame,
    identify_refused,
)
from mqd.client.message import Message
from mqd.endpoints import client_endpoint as _endpoint
from mqd.logs import get_logger
from mqd.wire.compression import (
    CompressedTransport,
    CompressionError,
    DeflateCodec,
    SnappyCodec,
)
from mqd.wire.framing import FRAME_TYPE_ERROR, FRAME_TYPE_MESSAGE, FRAME_TYPE_RESPONSE, MAGIC_V2
from mqd.wire.go_json import BOOL, INT64, STRING, GoJSONError, GoType, check_go, unmarshal
from mqd.wire.transport import IStreamTransport

__all__ = [
    "MAGIC_V2",
    "ConnectionDelegate",
    "NSQClientProtocol",
    "ConnectionFactory",
    "client_endpoint",
    "connect",
]

log = get_logger("mqd.client")

DEFAULT_MAX_RDY_COUNT = 2500
# Compressed input is inflated at most this much at a time, each step
# parsed before the next, so a small input that inflates to gigabytes does
# not become one buffer (the broker's INFLATE_STEP, for the same reason).
INFLATE_STEP = 64 * 1024

# The size field is an int32; 0 (no max_msg_size) allows all of it.
MAX_FRAME_SIZE = 2**31 - 1
# nsqd's answer is read as a frame: "HTTP" as a size means an HTTP port was dialed (go-nsq's check).
_HTTP_SIZE = int.from_bytes(b"HTTP", "big")

_HEADER = struct.Struct(">ii")
_unpack_header = _HEADER.unpack_from
_MSG = struct.Struct(">qH16s")
_unpack_msg = _MSG.unpack_from
_MSG_BODY = 8 + _MSG.size  # a message frame's body offset from its size field
_MSG_OVERHEAD = _MSG_BODY - 4  # what a message frame's size counts besides the body
_pack_size = struct.Struct(">I").pack
_HEARTBEAT = b"_heartbeat_"
_OK = b"OK"

# Handshake steps: the answer each waits for.
_IDENTIFY = "identify"
_TLS = "tls"
_COMPRESSION = "compression"
_AUTH = "auth"


class ConnectionDelegate:
    """What a connection tells its owner (the producer or consumer); every method optional."""

    def message_received(self, conn: NSQClientProtocol, msg: Message) -> None:
        """A message arrived; the owner hands it to its handler."""

    def message_finished(self, conn: NSQClientProtocol, msg: Message) -> None:
        """FIN was sent for `msg` (the owner's success count for backoff)."""

    def messages_finished(self, conn: NSQClientProtocol, count: int) -> None:
        """FIN was sent for `count` messages at once (`finish_messages`)."""

    def message_requeued(self, conn: NSQClientProtocol, msg: Message, backoff: bool) -> None:
        """REQ was sent for `msg`; `backoff` says whether it counts as a failure."""

    def connection_ready(self, conn: NSQClientProtocol) -> None:
        """The handshake is done: commands may be sent."""

    def connection_error(self, conn: NSQClientProtocol, err: NSQError) -> None:
        """An error frame that answers no command (FIN/REQ/TOUCH failed, or a fatal one unasked)."""

    def heartbeat(self, conn: NSQClientProtocol) -> None:
        """nsqd sent a heartbeat (already answered with NOP)."""

    def connection_closed(self, conn: NSQClientProtocol, reason: Failure) -> None:
        """The connection is gone: the fatal NSQError, HeartbeatTimeout, or the transport's reason."""


class _LoggingDelegate(ConnectionDelegate):
    """The delegate of a connection made without one (`connect`): it logs the end, once."""

    def connection_closed(self, conn: NSQClientProtocol, reason: Failure) -> None:
        error = getattr(reason, "value", reason)
        if conn.close_reason is None and isinstance(error, ConnectionDone):
            log.info("{address}: connection closed", address=conn.address)
        else:
            log.warn("{address}: connection closed: {error}", address=conn.address, error=error)


_NO_DELEGATE = _LoggingDelegate()


class NSQClientProtocol(protocol.Protocol, TimeoutMixin):
    """One connection to one nsqd, speaking V2 (see the module docstring)."""

    transport: IStreamTransport

    def __init__(self, config: Config, delegate: ConnectionDelegate | None, address: str,
                 clock=None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.config = config
        self.delegate = delegate if delegate is not None else _NO_DELEGATE
        self.address = address
        self.clock = clock
        # TimeoutMixin's timer on our clock (its documented hook, replaced per instance).
        self.callLater = clock.callLater  # type: ignore[method-assign]
        self.ready: defer.Deferred = defer.Deferred()
        self.server: dict[str, Any] = {}
        self.auth: dict[str, Any] | None = None
        # State the consumer reads.
        self.rdy_count = 0
        self.last_rdy_count = 0
        self.last_rdy_at = 0.0
        self.last_message_at = 0.0
        self.in_flight = 0
        self.max_rdy_count = DEFAULT_MAX_RDY_COUNT
        # The largest size field accepted: a message of max_msg_size bytes and its header.
        limit = config.max_msg_size
        self.max_frame_size = min(limit + _MSG_OVERHEAD, MAX_FRAME_SIZE) if limit else MAX_FRAME_SIZE
        self.closing = False
        self.connected = False
        self.tls = False
        self.compression: str | None = None
        # Internals.
        self._step: str | None = _IDENTIFY
        self._waiting: deque[defer.Deferred] = deque()  # commands' answers, in order
        self._held: list[bytes] = []  # commands written before the handshake ended
        self._chunks: list[bytes] = []  # an incomplete frame, as read
        self._chunks_len = 0
        self._need = 0
        self._codec: SnappyCodec | DeflateCodec | None = None
        self._closed = False  # lost, or we are closing it: nothing more is parsed or sent
        self._error: BaseException | None = None  # why it closed, when we know better than the transport
        self._closed_error: ConnectionClosed | None = None  # what commands fail with once it is lost

    def __repr__(self) -> str:
        return f"<NSQClientProtocol {self.address}>"

    @property
    def close_reason(self) -> BaseException | None:
        """Why the client closed this connection (bad frame, timeout, failed handshake), if it did."""
        return self._error

    @property
    def handshake_done(self) -> bool:
        """IDENTIFY (and TLS, compression, AUTH) succeeded; stays true once the connection ends."""
        return self._step is None

    # -- connection ----------------------------------------------------------

    def connectionMade(self) -> None:
        # BaseProtocol.makeConnection set it to 1; here it means "handshake done".
        self.connected = False
        self.setTimeout(self.config.read_timeout)
        body = self.config.identify_body()
        self.transport.write(MAGIC_V2 + b"IDENTIFY\n" + _pack_size(len(body)) + body)

    def timeoutConnection(self) -> None:
        """read_timeout passed with no complete frame (or, before `ready`, since connecting)."""
        if self._step is not None:
            error = HeartbeatTimeout(message="handshake not done within read_timeout")
        elif self._chunks:
            error = HeartbeatTimeout(message="a frame still incomplete after read_timeout")
        else:
            error = HeartbeatTimeout()
        self._abort(error, hard=True)

    def close(self) -> None:
        """Close the connection now (the consumer uses CLS first to drain in-flight messages)."""
        self.connected = False
        if not self._closed:
            self._closed = True
            self.transport.loseConnection()

    def _abort(self, error: BaseException, hard: bool = False) -> None:
        """Close for a reason of ours (bad frame, timeout, failed handshake): it becomes the report.

        `hard` (a silent peer) aborts: a clean close would wait for unsent
        bytes to drain, which a dead peer never lets happen.
        """
        if self._error is None:
            if (self._step is not None and isinstance(error, ServerProtocolError)
                    and not isinstance(error, UnusableAnswerError)):
                error = self._unusable(error.what)
            self._error = error
            log.debug("{address}: closing: {error}", address=self.address, error=str(error))
        self.connected = False
        if not self.ready.called:
            self.ready.errback(Failure(error))
        if not self._closed:
            self._closed = True
            if hard:
                self.transport.abortConnection()
            else:
                self.transport.loseConnection()

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        """Fail `ready` (if the handshake had not ended), tell the delegate, then fail the commands.

        The delegate hears first, so that the commands' errbacks (a
        producer's, say) already see the connection as gone and do not
        send anything more on it.
        """
        self.setTimeout(None)
        self._closed = True
        self.connected = False
        self._chunks = []
        error = self._error
        if error is None:
            report = reason
            closed = ConnectionClosed(reason)
        else:
            report = Failure(error)
            closed = error if isinstance(error, ConnectionClosed) else ConnectionClosed(error)
        self._closed_error = closed
        waiting, self._waiting = self._waiting, deque()
        self._held = []
        if not self.ready.called:
            self.ready.errback(Failure(error if error is not None else closed))
        self.delegate.connection_closed(self, report)
        for d in waiting:
            d.errback(Failure(closed))

    # -- reading -------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._closed:
            return
        if self._codec is not None:
            self._inflate(data)
        else:
            self._parse(data, False)

    def _inflate(self, data: bytes) -> None:
        """Decode compressed input a bounded step at a time, parsing each step."""
        # Called only once compression is on.
        codec = cast("SnappyCodec | DeflateCodec", self._codec)
        try:
            out = codec.decompress(data, INFLATE_STEP)
            while True:
                if out:
                    self._parse(out, True)
                if self._closed or not codec.has_more:
                    return
                out = codec.decompress(b"", INFLATE_STEP)
        except CompressionError as e:
            self._abort(ServerProtocolError(f"bad compressed data ({e})"))

    def _parse(self, data: bytes, compressed: bool) -> None:
        """Handle every complete frame in `data`, keeping an incomplete one for the next read.

        Only progress (a frame completed, or a new one begun) restarts the
        read timeout, and not before the handshake is done: bytes dripped
        into one frame, or into a handshake, do not keep the connection.
        """
        if self._chunks:
            self._chunks.append(data)
            self._chunks_len += len(data)
            if self._chunks_len < self._need:
                return
            data = b"".join(self._chunks)
            self._chunks = []
        if self._step is None:
            self.resetTimeout()
        pos = 0
        end = len(data)
        max_frame = self.max_frame_size
        while pos < end:
            if end - pos < 8:
                self._keep(data[pos:], 8)
                return
            size, frame_type = _unpack_header(data, pos)
            frame_end = pos + 4 + size
            if size < 4 or size > max_frame:
                self._bad_size(size)
                return
            if frame_end > end:
                self._keep(data[pos:], frame_end - pos)
                return
            if frame_type == FRAME_TYPE_MESSAGE:
                if size < _MSG_BODY - 4:
                    self._bad_frame(f"message frame of {size} bytes")
                    return
                if self._step is not None:
                    self._bad_frame("message before the handshake ended")
                    return
                timestamp, attempts, msg_id = _unpack_msg(data, pos + 8)
                msg = Message(msg_id, data[pos + _MSG_BODY:frame_end], timestamp, attempts,
                              self.address, self)
                self.in_flight += 1
                self.last_message_at = self.clock.seconds()
                self.delegate.message_received(self, msg)
            elif frame_type == FRAME_TYPE_RESPONSE:
                payload = data[pos + 8:frame_end]
                if payload == _HEARTBEAT:
                    self.nop()
                    self.delegate.heartbeat(self)
                elif self._step is not None:
                    self._handshake_answer(payload)
                    if self._codec is not None and not compressed:
                        # The rest of this read is the compressed stream.
                        rest = data[frame_end:]
                        if rest and not self._closed:
                            self._inflate(rest)
                        return
                elif self._waiting:
                    self._waiting.popleft().callback(payload)
                else:
                    log.warn("{address}: unexpected response {payload!r}", address=self.address,
                             payload=payload[:64])
            elif frame_type == FRAME_TYPE_ERROR:
                self._error_frame(error_from_frame(data[pos + 8:frame_end]))
            else:
                self._bad_frame(f"frame type {frame_type}")
                return
            if self._closed:
                return
            pos = frame_end

    def _keep(self, rest: bytes, need: int) -> None:
        self._chunks = [rest]
        self._chunks_len = len(rest)
        self._need = need

    def _bad_frame(self, what: str) -> None:
        self._abort(ServerProtocolError(f"bad {what}"))

    def _bad_size(self, size: int) -> None:
        if size == _HTTP_SIZE:
            self._abort(ServerProtocolError("unexpected HTTP response, a nsqd TCP endpoint is required"))
        elif size < 4:
            self._bad_frame(f"frame size {size}")
        else:
            self._abort(ServerProtocolError(
                f"frame of {size} bytes is over the limit of {self.max_frame_size} "
                f"(max_msg_size {self.config.max_msg_size})"))

    def _error_frame(self, err: NSQError) -> None:
        """Non-fatal: about an earlier FIN/REQ/TOUCH, no command waits for it. Fatal: the
        head command's answer, and nsqd closes the connection.

        During the handshake any error frame ends it (no FIN was sent yet,
        so none is about one); one answering AUTH is an AuthRefusedError,
        any other an IdentifyRefusedError.
        """
        if self._step is not None:
            self._fail_handshake(auth_refused(err) if self._step == _AUTH else identify_refused(err))
            return
        if not err.fatal:
            log.debug("{address}: {error}", address=self.address, error=str(err))
            self.delegate.connection_error(self, err)
            return
        if self._waiting:
            self._waiting.popleft().errback(Failure(err))
        else:
            self.delegate.connection_error(self, err)
        self._abort(err)

    # -- handshake -----------------------------------------------------------

    def _handshake_answer(self, payload: bytes) -> None:
        step = self._step
        if step == _IDENTIFY:
            if payload == _OK:
                # A server without feature negotiation: no upgrades, no auth.
                self.server = {}
            else:
                server = _json_object(payload, _IDENTIFY_FIELDS)
                if isinstance(server, str):
                    self._fail_handshake(self._unusable(f"IDENTIFY answer {server}",
                                                        _go_error(payload, _IDENTIFY_RESPONSE)))
                    return
                self.server = server
                max_rdy = server.get("max_rdy_count")
                if isinstance(max_rdy, int) and max_rdy > 0:
                    self.max_rdy_count = max_rdy
            if self.config.tls_v1 and not self.server.get("tls_v1"):
                # go-nsq goes on in plaintext; a client that asked for TLS should not.
                self._fail_handshake(self._unusable("server did not agree to tls_v1"))
                return
            self._upgrade_tls()
        elif payload != _OK and step != _AUTH:
            # go-nsq's words for it: "invalid response from TLS upgrade" (Snappy, Deflate).
            upgrade = "TLS" if step == _TLS else (self.compression or "").capitalize()
            self._fail_handshake(self._unusable(f"unexpected {step} answer {payload[:64]!r}",
                                                f"invalid response from {upgrade} upgrade"))
        elif step == _TLS:
            self._upgrade_compression()
        elif step == _COMPRESSION:
            self._authenticate()
        else:
            auth = _json_object(payload, _AUTH_FIELDS)
            if isinstance(auth, str):
                self._fail_handshake(self._unusable(f"AUTH answer {auth}",
                                                    _go_error(payload, _AUTH_RESPONSE)))
                return
            self.auth = auth
            log.info("{address}: authenticated as {identity!r} ({count} permissions)",
                     address=self.address, identity=auth.get("identity", ""),
                     count=auth.get("permission_count", 0))
            self._handshake_done()

    def _upgrade_tls(self) -> None:
        if not self.server.get("tls_v1"):
            self._upgrade_compression()
            return
        start_tls = getattr(self.transport, "startTLS", None)
        if start_tls is None:
            self._fail_handshake(ServerProtocolError("transport cannot start TLS"))
            return
        host = self.address.rpartition(":")[0] or self.address
        try:
            creator = self.config.tls_creator(host)
        except Exception as e:  # noqa: BLE001 - a bad file, reported as the handshake's failure
            self._fail_handshake(e)
            return
        start_tls(creator)
        self.tls = True
        self._step = _TLS  # nsqd's OK comes over TLS

    def _upgrade_compression(self) -> None:
        server = self.server
        codec: SnappyCodec | DeflateCodec
        if server.get("snappy"):
            codec = SnappyCodec()
            self.compression = "snappy"
        elif server.get("deflate"):
            level = server.get("deflate_level")
            if not isinstance(level, int) or not 1 <= level <= 9:
                level = self.config.deflate_level
            codec = DeflateCodec(level)
            self.compression = "deflate"
        else:
            self._authenticate()
            return
        # The wrapper hands every other call to the transport it wraps.
        self.transport = cast(IStreamTransport, CompressedTransport(self.transport, codec))
        self._codec = codec  # _parse hands the rest of this read to it
        self._step = _COMPRESSION  # nsqd's OK comes compressed

    def _authenticate(self) -> None:
        if not self.server.get("auth_required"):
            self._handshake_done()
            return
        secret = self.config.auth_secret
        if not secret:
            self._fail_handshake(AuthRequiredError())
            return
        body = secret.encode()
        self._step = _AUTH
        self.transport.write(b"AUTH\n" + _pack_size(len(body)) + body)

    def _handshake_done(self) -> None:
        self._step = None
        self.connected = True
        self.resetTimeout()  # from now on the read timeout counts from the last complete frame
        held, self._held = self._held, []
        if held:
            self.transport.writeSequence(held)
        self.delegate.connection_ready(self)
        if not self.ready.called:
            self.ready.callback(self)

    def _fail_handshake(self, error: BaseException) -> None:
        self._abort(error)

    def _unusable(self, what: str, go_reason: str | None = None) -> UnusableAnswerError:
        """A handshake answer the client cannot use, with go-nsq's wording of it for the tools.

        go-nsq reports what goes wrong while it identifies as `failed to
        IDENTIFY - <reason>`, and a bad AUTH answer as the bare reason;
        `go_reason` is Go's text where it has one, else the client's `what`.
        """
        reason = go_reason or what
        return UnusableAnswerError(what, reason if self._step == _AUTH else f"failed to IDENTIFY - {reason}")

    # -- commands with an answer ------------------------------------------------

    def command(self, line: bytes, body: bytes | None = None) -> defer.Deferred:
        """Send a command whose answer comes back (PUB, MPUB, DPUB, SUB, CLS, ...).

        `line` ends with a newline; `body`, when given, is sent with its
        size. The Deferred fires with the response payload (b"OK"), or
        fails with the NSQError of the error frame, or ConnectionClosed.
        Before the handshake ends the bytes wait and go out after it.
        """
        if self._closed:
            closed = self._closed_error
            if closed is None:  # closing: the server has not closed yet
                closed = ConnectionClosed(self._error, "connection closing")
            return defer.fail(closed)
        d: defer.Deferred[bytes] = defer.Deferred()
        self._waiting.append(d)
        if body is None:
            data = line
        else:
            data = b"".join((line, _pack_size(len(body)), body))
        if self._step is None:
            self.transport.write(data)
        else:
            self._held.append(data)
        return d

    def pub(self, topic: str, body: bytes) -> defer.Deferred:
        return self.command(b"PUB %s\n" % topic.encode(), body)

    def mpub(self, topic: str, bodies) -> defer.Deferred:
        parts = [_pack_size(len(bodies))]
        for body in bodies:
            parts.append(_pack_size(len(body)))
            parts.append(body)
        return self.command(b"MPUB %s\n" % topic.encode(), b"".join(parts))

    def dpub(self, topic: str, delay_ms: int, body: bytes) -> defer.Deferred:
        return self.command(b"DPUB %s %d\n" % (topic.encode(), delay_ms), body)

    def sub(self, topic: str, channel: str) -> defer.Deferred:
        return self.command(b"SUB %s %s\n" % (topic.encode(), channel.encode()))

    def cls(self) -> defer.Deferred:
        """CLS: nsqd stops sending and answers CLOSE_WAIT; in-flight messages may still be answered."""
        self.closing = True
        return self.command(b"CLS\n")

    # -- fire and forget -----------------------------------------------------

    def rdy(self, count: int) -> None:
        self.transport.write(b"RDY %d\n" % count)
        self.rdy_count = count
        self.last_rdy_count = count
        if count > 0:
            self.last_rdy_at = self.clock.seconds()

    def fin(self, msg_id: bytes) -> None:
        self.transport.write(b"FIN " + msg_id + b"\n")

    def req(self, msg_id: bytes, delay_ms: int) -> None:
        self.transport.write(b"REQ %s %d\n" % (msg_id, delay_ms))

    def touch(self, msg_id: bytes) -> None:
        self.transport.write(b"TOUCH " + msg_id + b"\n")

    def nop(self) -> None:
        self.transport.write(b"NOP\n")

    # -- a message's responses (Message's delegate) -------------------------------

    def finish_message(self, msg: Message) -> None:
        self.transport.write(b"FIN " + msg.id + b"\n")
        self.in_flight -= 1
        self.delegate.message_finished(self, msg)

    def finish_messages(self, messages: Iterable[Message]) -> None:
        """FIN every one of `messages` not yet answered, in one write and one report to the owner.

        For an owner that settles many messages of this connection at once
        (the Spark source FINishes a whole micro-batch when Spark commits it):
        per message, the FIN line is all that is left of the work.
        """
        ids = []
        for msg in messages:
            if msg.claim_response():
                ids.append(msg.id)
        if ids:
            self.transport.write(b"".join([b"FIN %s\n" % msg_id for msg_id in ids]))
            self.in_flight -= len(ids)
            self.delegate.messages_finished(self, len(ids))

    def requeue_message(self, msg: Message, delay: float | None, backoff: bool) -> None:
        """REQ; without a delay, default_requeue_delay × attempts capped by max_requeue_delay (go-nsq)."""
        config = self.config
        if delay is None or delay < 0:
            delay = min(config.default_requeue_delay * msg.attempts, config.max_requeue_delay)
        self.transport.write(b"REQ %s %d\n" % (msg.id, int(delay * 1000)))
        self.in_flight -= 1
        self.delegate.message_requeued(self, msg, backoff)

    def touch_message(self, msg: Message) -> None:
        self.transport.write(b"TOUCH " + msg.id + b"\n")


# go-nsq's IdentifyResponse and AuthResponse: json.Unmarshal fails on a field of another
# JSON type, and so does the handshake (a bool given as "yes" is not quietly true).
_IDENTIFY_FIELDS = {"max_rdy_count": int, "tls_v1": bool, "deflate": bool, "snappy": bool,
                    "auth_required": bool}
_AUTH_FIELDS = {"identity": str, "identity_url": str, "permission_count": int}
_INT64 = range(-(2**63), 2**63)
# The same structs as Go types, for go-nsq's wording of what is wrong with an answer (`_go_error`).
_IDENTIFY_RESPONSE = GoType("struct", fields=(
    ("max_rdy_count", "MaxRdyCount", INT64), ("tls_v1", "TLSv1", BOOL), ("deflate", "Deflate", BOOL),
    ("snappy", "Snappy", BOOL), ("auth_required", "AuthRequired", BOOL)),
    name="IdentifyResponse", package="nsq")
_AUTH_RESPONSE = GoType("struct", fields=(
    ("identity", "Identity", STRING), ("identity_url", "IdentityURL", STRING),
    ("permission_count", "PermissionCount", INT64)),
    name="AuthResponse", package="nsq")
_KIND_NAMES = {int: "an integer", bool: "a boolean", str: "a string"}


def _json_object(payload: bytes, fields: dict[str, type]) -> dict[str, Any] | str:
    """A handshake answer as its JSON object, or what is wrong with it (a str).

    Nesting too deep for Python's decoder (RecursionError, where Go's
    decoder would give up at 10000 levels) is a bad answer like any other.
    A field that is null or absent is left alone, as json.Unmarshal does.
    """
    try:
        value = json.loads(payload)
    except RecursionError:
        return "is nested too deep"
    except ValueError:
        return f"is not JSON: {payload[:64]!r}"
    if not isinstance(value, dict):
        return f"is not a JSON object: {payload[:64]!r}"
    for name, kind in fields.items():
        field = value.get(name)
        if field is None:
            continue
        if kind is int:
            ok = type(field) is int and field in _INT64
        else:
            ok = isinstance(field, kind)
        if not ok:
            return f"field {name} is not {_KIND_NAMES[kind]}: {field!r:.64}"
    return value


def _go_error(payload: bytes, shape: GoType) -> str | None:
    """Go's json.Unmarshal error for `payload` read into `shape`, or None if Go would take it.

    `json: cannot unmarshal number 1000000000000000000000000000000 into Go
    struct field IdentifyResponse.max_rdy_count of type int64`: what
    nsq_tail prints for the same answer.
    """
    try:
        check_go(unmarshal(payload), shape)
    except GoJSONError as e:
        return str(e)
    except (RecursionError, ValueError):  # past what the reader follows: the client's own words
        return None
    return None


class ConnectionFactory(protocol.Factory):
    """Builds the one NSQClientProtocol of a connection attempt."""

    noisy = False

    def __init__(self, config: Config, delegate: ConnectionDelegate | None, address: str,
                 clock=None) -> None:
        self.config = config
        self.delegate = delegate
        self.address = address
        self.clock = clock

    def buildProtocol(self, addr) -> NSQClientProtocol:
        proto = NSQClientProtocol(self.config, self.delegate, self.address, self.clock)
        proto.factory = self
        return proto


def _bind_address(local_addr: str | None):
    """config.local_addr ("host", "host:port", "[v6]:port") as an endpoint's bindAddress."""
    if not local_addr:
        return None
    host, sep, port = local_addr.rpartition(":")
    if sep and port.isdigit() and (not host.count(":") or host.startswith("[")):
        return (host.strip("[]"), int(port))
    return (local_addr.strip("[]"), 0)


def client_endpoint(reactor, address: str, timeout: float, local_addr: str | None = None):
    """`host:port` or `[v6]:port` of an nsqd as a client endpoint; ValueError if malformed."""
    try:
        return _endpoint(reactor, address, timeout=timeout, bind_address=_bind_address(local_addr))
    except ValueError:
        raise ValueError(f"bad nsqd address {address!r}") from None


def connect(reactor, address: str, config: Config,
            delegate: ConnectionDelegate | None = None) -> defer.Deferred:
    """Connect to the nsqd at `address`: fires with the protocol once its handshake is done."""
    endpoint = client_endpoint(reactor, address, config.dial_timeout, config.local_addr)
    d = endpoint.connect(ConnectionFactory(config, delegate, address, clock=reactor))
    d.addCallback(lambda proto: proto.ready)
    return d
