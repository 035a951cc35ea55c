"""The broker side of nsqd's TCP protocol V2, one instance per connection.

The protocol holds per-connection state only (state, RDY, in-flight count,
negotiated features) and calls into topics and channels for everything
else. Parsing works on whole buffers: every complete command in a chunk is
handled in one pass, and work that a batch of commands shares (asking the
channel to deliver after many FINs) happens once at the end of the pass.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from twisted.internet.interfaces import IHandshakeListener, IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import LoopingCall
from twisted.protocols.policies import TimeoutMixin
from zope.interface import implementer

from backends import BackendError
from mqd import NSQ_VERSION
from mqd.logs import get_logger
from mqd.message import MESSAGE_HEADER
from mqd.names import is_valid_name
from mqd.nsqd.batches import (
    BAD_SIZE,
    NO_SIZE,
    TOO_BIG,
    TRAILING,
    BatchError,
    TopicExiting,
    binary_bodies,
    binary_chunks,
    is_big,
    publish_in_chunks,
    walk_binary,
)
from mqd.nsqd.channel import ChannelError
from mqd.nsqd.interfaces import IConsumer
from mqd.wire.compression import (
    CompressedTransport,
    CompressionError,
    DeflateCodec,
    SnappyCodec,
)
from mqd.wire.errors import GoStruct, ProtocolError, fatal, go_quote, nonfatal
from mqd.wire.framing import (
    CLOSE_WAIT,
    FRAME_TYPE_ERROR,
    FRAME_TYPE_RESPONSE,
    HEARTBEAT,
    INT32,
    MAGIC_V2,
    OK,
    frame,
)

__all__ = ["V2Protocol", "V2Factory", "STATE_INIT", "STATE_SUBSCRIBED", "STATE_CLOSING"]


# nsqd's numeric client states, as /stats reports them.
STATE_INIT = 0
STATE_SUBSCRIBED = 3
STATE_CLOSING = 4

# nsqd's fixed client timeout (not a flag): heartbeats default to half of it.
CLIENT_TIMEOUT = 60.0
DEFAULT_OUTPUT_BUFFER_SIZE = 16 * 1024
# A line longer than this without a newline is not a command; nsqd's reader
# gives up at its buffer size the same way (it closes without a frame).
MAX_LINE = 64 * 1024
# The most compressed input is inflated in one step before it is parsed;
# the rest waits for the next turn of the reactor, so a stream that inflates
# to gigabytes costs bounded memory and other connections are served between
# steps. 64 KiB is what Twisted reads from a socket at a time: a turn of a
# compressed connection costs what a turn of a plain one does.
INFLATE_STEP = 64 * 1024
# Frames held while the transport is backed up are handed to it this much at
# a time (Twisted's TCP transport pauses its producer past 64 KiB unsent):
# its buffer holds at most about two steps, the rest waits in the protocol
# where it is known to be unsent, and the write deadline runs per handful of
# steps, as nsqd's does per write.
WRITE_STEP = 64 * 1024
# How long after the IDENTIFY answer the compressed stream starts. nsqd's
# gap is microseconds, and clients that switch their decoder at the end of
# the read holding the answer (asyncnsq 2 with snappy) then fail whenever
# they read late; 5 ms took asyncnsq 2.0.1 from 0 of 6 connections to 6 of 6
# here, at the cost of 5 ms once per compressed connection.
UPGRADE_GAP = 0.005

_MSG_HEADER_PACK = MESSAGE_HEADER.pack
_MSG_OVERHEAD = MESSAGE_HEADER.size - 4
_MSG_FRAME = MESSAGE_HEADER.size
_unpack_int32 = INT32.unpack_from
_NEED_MORE = -1
# A handler's answer that parsing must stop until an auth server answers
# (see _check_auth, _cmd_auth); -2 so it is never an offset.
_PAUSED = -2
_FOREVER = float("inf")

log = get_logger(__name__)


_UINT64 = (1 << 64) - 1
# nsqd's identifyDataV2 (a field the client leaves out has its zero value).
# (topology_region/zone are only type-checked: mqd has no topology-aware delivery.)
_IDENTIFY_DATA = GoStruct({
    "client_id": "string", "hostname": "string", "user_agent": "string",
    "topology_region": "string", "topology_zone": "string",
    "heartbeat_interval": "int", "output_buffer_size": "int", "output_buffer_timeout": "int",
    "deflate_level": "int", "sample_rate": "int32", "msg_timeout": "int",
    "feature_negotiation": "bool", "tls_v1": "bool", "snappy": "bool", "deflate": "bool",
})


def _base10(raw: bytes) -> int | None:
    """nsqd's ByteToBase10: decimal digits only, no sign; empty is 0.

    Go adds the digits up in a uint64 that wraps, so any number of digits
    parses. 10**64 is a multiple of 2**64: the last 64 digits give the
    same value, and never hit Python's limit on int() of long strings.
    """
    if raw and not raw.isdigit():
        return None
    return int(raw[-64:]) & _UINT64 if raw else 0


def _echo(raw: bytes) -> str:
    """Wire bytes for an error text, given back byte for byte as nsqd's %s does (see ProtocolError.payload)."""
    return raw.decode("utf-8", "surrogateescape")


def _int64(value: int) -> int:
    """Go's int64 of a uint64 (or of a product that overflowed): two's complement wrap."""
    value &= _UINT64
    return value - (1 << 64) if value >> 63 else value


def _ms_duration_ns(ms: int) -> int:
    """nsqd's time.Duration(ms) * time.Millisecond, overflow and all."""
    return _int64(ms * 1_000_000)


@implementer(IConsumer, IHandshakeListener, IPushProducer)
class V2Protocol(Protocol, TimeoutMixin):
    """One client connection speaking V2."""

    def __init__(self, broker) -> None:
        self.broker = broker
        options = broker.options
        self.clock = broker.clock
        self.callLater = broker.clock.callLater  # TimeoutMixin schedules with this
        self.id = broker.next_client_id()
        self.state = STATE_INIT
        self.channel = None
        self.client_id = ""
        self.hostname = ""
        self.user_agent = ""
        self.topology_region = ""  # IDENTIFY's, shown by /stats when set
        self.topology_zone = ""
        self.remote_address = ""
        self._remote_ip = ""  # what the auth server is told; "" for a unix socket peer
        self.connect_ts = 0
        self.heartbeat_interval = CLIENT_TIMEOUT / 2
        self.msg_timeout = options.msg_timeout
        self.output_buffer_size = DEFAULT_OUTPUT_BUFFER_SIZE
        self.output_buffer_timeout = options.output_buffer_timeout
        self.sample_rate = 0
        self.deflate = False
        self.deflate_level = 0
        self.snappy = False
        self.tls = False
        self.tls_version = ""
        self.tls_cipher_suite = ""
        self.tls_common_name = ""
        self.authorized = False
        # AUTH: the auth server's last answer (mqd.nsqd.auth.AuthState) and the
        # secret to ask again with once it expires.
        self._auth_on = broker.auth.enabled
        self.auth_state = None
        self._auth_secret = ""
        # Set by a handler that needs the auth server: what to run with its
        # answer (_authed or _resume). The query starts after the read is
        # parsed, with the rest of the input kept (from _resume_at, or from
        # the command itself when -1) until the answer comes.
        self._after_auth = None
        self._resume_at = -1
        # Output buffer of message frames (nsqd's bufio.Writer; spec section 8).
        self._obuf: list[bytes] = []
        self._obuf_len = 0
        self._flush_call = None
        # Frames flushed while the transport was backed up, not handed to it
        # yet (see _drain), and nsqd's write deadline: armed while a write
        # waits on a backed-up transport, or while a close waits to flush.
        self._unsent: deque[bytes] = deque()
        self._write_deadline = None
        self.ready_count = 0
        self.in_flight_count = 0
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.pub_counts: dict[str, int] = {}
        self._identified = False
        self._magic_ok = False
        self._closed = False
        self._heartbeat: LoopingCall | None = None
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._need = 0
        # PUBs of the current read not published yet, all to _pub_topic.
        self._pub_bodies: list[bytes] = []
        self._pub_topic: str | None = None
        # A big MPUB being published over several turns (mqd.nsqd.batches):
        # reading stops until it is answered.
        self._publishing = False
        # An MPUB waiting for more input: (offset of its walk from the body
        # size, messages checked so far), so each read walks only new bytes.
        self._mpub_walk: tuple[int, int] | None = None
        self._reading_paused = False
        # Frames waiting behind a durable publish's OK; None when nothing waits.
        self._held: list | None = None
        self._close_after_release = False
        # TLS and compression (IDENTIFY's upgrades). _codec is the only
        # thing a read checks: None unless compression was negotiated.
        self._tls_config = broker.tls
        if self._tls_config is not None and self._tls_config.tcp_required:
            self._HANDLERS = _TLS_REQUIRED_HANDLERS
        self._codec = None
        self._inflate_call = None  # the next step of compressed input, when one is due
        # Flow control (see _update_reading): the transport's write buffer is
        # over its bound; an auth server is being asked; this protocol is the
        # transport's registered producer (until the connection closes).
        self._output_blocked = False
        self._auth_waiting = False
        self._producing = False
        # Input a paused parse may keep: the biggest command (line, size, body);
        # an MPUB's body is bounded by _mpub_limit, not by its declared size.
        max_mpub = _mpub_limit(options.max_body_size, (options.max_body_size - 4) // 5)
        self._max_pending = MAX_LINE + 4 + max(max_mpub, options.max_msg_size)
        self._upgrade_leftover: bytes | None = None
        self._tls_layer = None
        self._handshake_timer = None
        # Compression negotiated but not started yet (see _upgrade), and the
        # input that came for it meanwhile, compressed already.
        self._codec_pending = None
        self._codec_input: list[bytes] = []

    # -- connection lifecycle -------------------------------------------------

    def connectionMade(self) -> None:
        # Go sets TCP_NODELAY on every connection, so nsqd's clients never see
        # Nagle hold a small frame back (a late durable OK, a lone message).
        if hasattr(self.transport, "setTcpNoDelay"):
            self.transport.setTcpNoDelay(True)
        peer = self.transport.getPeer()
        host = getattr(peer, "host", None) or str(getattr(peer, "name", "") or "")
        port = getattr(peer, "port", None)
        self.remote_address = f"{host}:{port}" if port is not None else host
        if port is not None:
            self._remote_ip = host
        self.client_id = self.hostname = host
        self.connect_ts = int(self.clock.seconds())
        self.broker.client_connected(self)
        self._start_heartbeats()
        # A streaming producer of its transport, which pauses it while its
        # unsent output is over its bufferSize and resumes it once that is
        # all handed to the kernel (see pauseProducing). The TLS layer, once
        # started, takes the registration over and passes the calls through.
        self.transport.registerProducer(self, True)
        self._producing = True

    def connectionLost(self, reason=None) -> None:
        self._closed = True
        self._producing = False  # the transport drops its producer itself
        self._stop_heartbeats()
        self._obuf = []
        self._unsent.clear()
        self._cancel_write_deadline()
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        if self._inflate_call is not None and self._inflate_call.active():
            self._inflate_call.cancel()
        self._inflate_call = None
        if self.tls and not self.tls_version:
            self._cancel_handshake_timer()
            log.info("client {remote}: TLS handshake failed: {reason}", remote=self.remote_address,
                     reason=reason.getErrorMessage() if reason is not None else "connection lost")
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.remove_client(self)
        self.broker.client_disconnected(self)

    def _start_heartbeats(self) -> None:
        self._stop_heartbeats()
        interval = self.heartbeat_interval
        if interval > 0:
            self._heartbeat = LoopingCall(self._send_heartbeat)
            self._heartbeat.clock = self.clock
            self._heartbeat.start(interval, now=False)
            # Two heartbeats without a word back and the client is gone.
            self.setTimeout(interval * 2)
        else:
            self.setTimeout(None)

    def _stop_heartbeats(self) -> None:
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()
        self._heartbeat = None
        self.setTimeout(None)

    def _send_heartbeat(self) -> None:
        self._write_frame(HEARTBEAT)

    def timeoutConnection(self) -> None:
        log.info("client {remote} missed two heartbeats; closing", remote=self.remote_address)
        self._closed = True
        self.transport.abortConnection()

    # -- reading commands ------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._closed:
            return
        self.resetTimeout()
        if self._codec is not None:
            self._inflate(data)
        elif self._codec_pending is not None:
            self._codec_input.append(data)
        else:
            self._parse(data)

    def _parse(self, data: bytes) -> None:
        """Handle every complete command in `data` (plaintext) and keep an incomplete one."""
        if self._pending:
            self._pending.append(data)
            self._pending_len += len(data)
            if self._pending_len < self._need:
                if self._pending_len > self._max_pending:
                    # Only input kept while parsing waits (auth, a chunked
                    # MPUB) has no command to bound it; reading stops then,
                    # so this is a peer sending past what any command needs.
                    log.warn("client {remote} sent over {max} bytes while its input waited; closing",
                             remote=self.remote_address, max=self._max_pending)
                    self._pending = []
                    self.lose_connection()
                return
            data = b"".join(self._pending)
            self._pending = []
        pos = 0
        if not self._magic_ok:
            if len(data) < 4:
                self._keep(data, 4)
                return
            if data[:4] != MAGIC_V2:
                self._fail(fatal("E_BAD_PROTOCOL"))
                return
            self._magic_ok = True
            pos = 4
        end = len(data)
        handlers = self._HANDLERS
        # Channels that commands in this read gave work are delivered once,
        # at the end of it: a pipeline of PUBs or FINs makes one delivery pass.
        batch = self.broker.deliveries
        outermost = batch.pending is None
        if outermost:
            batch.pending = pending = set()
        else:
            pending = batch.pending
        try:
            while pos < end:
                eol = data.find(b"\n", pos)
                if eol < 0:
                    if end - pos > MAX_LINE:
                        log.warn("client {remote} sent a line over {max} bytes; closing",
                                 remote=self.remote_address, max=MAX_LINE)
                        self.lose_connection()
                        return
                    self._keep(data[pos:], end - pos + 1)
                    break
                line_end = eol - 1 if eol > pos and data[eol - 1] == 13 else eol
                params = data[pos:line_end].split(b" ")
                handler = handlers.get(params[0])
                if handler is None:
                    if handlers is _TLS_REQUIRED_HANDLERS:
                        _tls_required(self, params, data, eol + 1)
                    raise fatal("E_INVALID", f"invalid command {_echo(params[0])}")
                if handler is _FIN and self.state == STATE_SUBSCRIBED:
                    # A run of well-formed FINs (a reader acks every message)
                    # is gathered and finished as one (Channel.finish_run);
                    # each id that fails gets _cmd_fin's error in its place.
                    # A malformed FIN ends the run and is read again below.
                    ids: list[bytes] = []
                    while len(params) == 2 and len(params[1]) == 16:
                        ids.append(params[1])
                        pos = _plain_fins(data, eol + 1, end, ids)
                        eol = data.find(b"\n", pos)
                        if eol < 0 or data[pos:pos + 4] != b"FIN ":
                            break
                        line_end = eol - 1 if eol > pos and data[eol - 1] == 13 else eol
                        params = data[pos:line_end].split(b" ")
                    if ids:
                        self._finish_run(ids, pending)
                        continue
                elif handler is _PUB and self.state == STATE_INIT and not self._auth_on:
                    nxt = self._pub_run(data, pos, eol, params)
                    if nxt != pos:
                        pos = nxt
                        continue
                if self._pub_bodies and handler is not _PUB:
                    self._flush_pubs()
                if pending and handler not in _BATCHABLE and self.channel in pending:
                    # Deliver this connection's own channel before a command
                    # that writes a frame or changes readiness, so its output
                    # does not depend on how reads were split.
                    self._flush_delivery(pending)
                try:
                    nxt = handler(self, params, data, eol + 1)
                except ProtocolError as err:
                    if err.fatal:
                        raise
                    self._answer_error(err, pending)
                    nxt = eol + 1
                if nxt == _NEED_MORE:
                    self._keep(data[pos:], self._need - pos)
                    break
                if nxt == _PAUSED:
                    # Everything after this point waits for the auth server.
                    resume = self._resume_at if self._resume_at >= 0 else pos
                    self._keep(data[resume:], _FOREVER)
                    break
                pos = nxt
                if self._closed:
                    return
            self._flush_pubs()
        except ProtocolError as err:
            # PUBs gathered before the failing command still get their OK
            # first (or fail first themselves).
            failure = err
            try:
                self._flush_pubs()
            except ProtocolError as publish_err:
                failure = publish_err
            self._fail(failure)
            return
        finally:
            if outermost:
                batch.pending = None
                for channel in pending:
                    channel.deliver()
        then = self._after_auth
        if then is not None:
            # Asked only now, with the input kept, so an answer that comes
            # at once (a cached or fake fetch) resumes a consistent state.
            self._after_auth = None
            self._query_auth(then)
        leftover = self._upgrade_leftover
        if leftover is not None:
            self._upgrade_leftover = None
            if leftover:
                self._feed_upgraded(leftover)

    def _pub_run(self, data: bytes, pos: int, eol: int, params: list[bytes]) -> int:
        """Gather a publisher's run of whole, valid PUBs from `pos`; where the first other command starts.

        What _cmd_pub does for each (go-nsq pipelines PUBs, many per read),
        without its calls and lookups per message. A PUB this cannot take
        (a bad name or size, a body still arriving, another command) ends
        the run and is parsed again by the caller, through _cmd_pub when
        it is a PUB, for its error or to wait for more.
        """
        end = len(data)
        max_msg = self.broker.options.max_msg_size
        bodies = self._pub_bodies
        topic_name = self._pub_topic
        while len(params) >= 2:
            name = _name(params[1])
            if name is None:
                break
            # The same command line again (a publisher pipelining to one
            # topic) needs no find, split or name check: only its body's.
            line = data[pos:eol + 1]
            line_len = len(line)
            while True:
                start = pos + line_len
                if start + 4 > end:
                    return pos
                size = _unpack_int32(data, start)[0]
                body_end = start + 4 + size
                if size <= 0 or size > max_msg or body_end > end:
                    return pos
                if name != topic_name:
                    self._flush_pubs()
                    self._pub_topic = topic_name = name
                    bodies = self._pub_bodies
                bodies.append(data[start + 4:body_end])
                pos = body_end
                if not data.startswith(line, pos):
                    break
            if data[pos:pos + 4] != b"PUB ":
                break
            eol = data.find(b"\n", pos)
            if eol < 0:
                break
            line_end = eol - 1 if data[eol - 1] == 13 else eol
            params = data[pos:line_end].split(b" ")
        return pos

    def _finish_run(self, ids: list[bytes], pending: set) -> None:
        """FIN the gathered ids in order, as many _cmd_fin calls would, in one pass per failure."""
        channel = self.channel
        count = len(ids)
        done = 0
        while done < count:
            n = channel.finish_run(self, ids, done)
            if n:
                channel.deliver_soon()
                done += n
            if done < count:
                try:
                    self._cmd_fin((b"FIN", ids[done]), b"", 0)
                except ProtocolError as err:
                    self._answer_error(err, pending)
                done += 1

    def _answer_error(self, err: ProtocolError, pending: set) -> None:
        """A non-fatal error's frame, after the deliveries this connection's commands made so far."""
        if pending and self.channel in pending:
            self._flush_delivery(pending)
        self._write_frame(frame(FRAME_TYPE_ERROR, err.payload))

    def _flush_delivery(self, pending: set) -> None:
        pending.discard(self.channel)
        self.channel.deliver()

    def _deliver_soon(self) -> None:
        """This connection's channel may deliver again (RDY, FIN, REQ freed a slot)."""
        if self.channel is not None:
            self.channel.deliver_soon()

    def _keep(self, rest: bytes, need: int) -> None:
        """Hold an incomplete command until `need` bytes of it have arrived."""
        self._pending = [rest]
        self._pending_len = len(rest)
        self._need = need

    def _update_reading(self) -> None:
        """Read the socket only while nothing holds it.

        Reasons: a chunked MPUB in progress (_publishing), an auth server
        being asked, compressed input not inflated yet, compression
        negotiated but not started, output over its bound (pauseProducing).
        Every reason is a flag checked here, so one reason ending does not
        resume reading that another still holds. Output backed up during a
        TLS handshake is the TLS layer holding our OK until the handshake is
        done, which takes reading: that one does not stop it, nor does a
        compression waiting for that handshake.
        """
        codec = self._codec
        paused = (self._publishing or self._auth_waiting
                  or (codec is not None and codec.has_more)
                  or (self._codec_pending is not None and not (self.tls and not self.tls_version))
                  or (self._output_blocked and not (self.tls and not self.tls_version)))
        if paused == self._reading_paused or self._closed:
            return
        self._reading_paused = paused
        if paused:
            self.transport.pauseProducing()
        else:
            self.transport.resumeProducing()

    # -- flow control: IPushProducer, called by the transport --------------------

    def pauseProducing(self) -> None:
        """The transport's unsent output is over its bound: stop reading, and feeding messages.

        The bound is Twisted's: a TCP transport's bufferSize (64 KiB, also
        its read size) on top of the kernel's socket buffers, which take up
        to a few MiB (tcp_wmem) before writes stay in user space. That is
        what nsqd holds for a client that does not read too: its writes
        block once the socket buffer is full, and so does that client's read
        loop. A healthy consumer may be paused for a moment after a large
        delivery pass, until the next write hands it to the kernel. If the
        output does not drain within the heartbeat interval the connection
        is closed (nsqd's write deadline, see _arm_write_deadline).
        """
        if not self._output_blocked:
            self._output_blocked = True
            self._arm_write_deadline()
            self._update_reading()

    def resumeProducing(self) -> None:
        """The output drained: hand on what waits, then read on, deliver again, inflate the rest of the input."""
        if not self._output_blocked:
            return
        self._output_blocked = False
        self._cancel_write_deadline()
        if self._unsent:
            self._drain()
        self._continue_input()
        if not self._closed and not self._output_blocked:
            self._deliver_soon()

    def _arm_write_deadline(self) -> None:
        """nsqd's SetWriteDeadline(now + heartbeat interval) before each write (none if heartbeats are off).

        Armed when a write finds the transport backed up, cancelled when it
        drains: one timer per connection, nothing per message. A client that
        takes each step of its output within the interval (a slow reader)
        keeps its connection; one that takes nothing for that long is closed.
        """
        interval = self.heartbeat_interval
        if self._write_deadline is None and interval > 0:
            self._write_deadline = self.clock.callLater(interval, self._write_timed_out)

    def _cancel_write_deadline(self) -> None:
        deadline, self._write_deadline = self._write_deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _write_timed_out(self) -> None:
        """The output did not drain within the heartbeat interval: close now, dropping it.

        Aborted, not closed gracefully: a graceful close waits for the
        output to be written, which is what did not happen. connectionLost
        then gives the in-flight messages back to the channel.
        """
        self._write_deadline = None
        if self.tls and not self.tls_version:
            # The TLS layer holds output until the handshake is done, which
            # has its own timer: the deadline counts once it is.
            self._arm_write_deadline()
            return
        log.info("client {remote}: output not drained within {interval}s; closing",
                 remote=self.remote_address, interval=self.heartbeat_interval)
        self._closed = True
        self._unsent.clear()
        self.transport.abortConnection()

    def stopProducing(self) -> None:
        """The transport is gone; connectionLost does the cleaning up."""

    def lose_connection(self) -> None:
        """Close once the output is written; every close of a V2 connection goes through here.

        The producer is unregistered first: Twisted keeps a connection whose
        producer is registered open (TLS never sends its close, a paused TCP
        transport resumes instead of closing), so `transport.loseConnection()`
        alone is not enough.
        """
        self._closed = True
        if self._producing:
            self._producing = False
            self.transport.unregisterProducer()
        if self._unsent:
            self.transport.writeSequence(self._unsent)
            self._unsent.clear()
        # The last write has its deadline too: a client that does not read
        # must not keep a closing connection, and its output, forever.
        self._arm_write_deadline()
        self.transport.loseConnection()

    def _fail(self, err: ProtocolError) -> None:
        log.info("client {remote}: {error}", remote=self.remote_address, error=str(err))
        self._closed = True
        self._pending = []
        self._write_frame(frame(FRAME_TYPE_ERROR, err.payload))
        if self._held is None:
            self.lose_connection()
        else:
            self._close_after_release = True

    def _write_frame(self, data: bytes) -> None:
        """Write a response or error frame, behind any publish still waiting for its commit.

        Responses must come back in command order (go-nsq pairs them with
        its publishes), so while a durable publish waits for its OK every
        later frame of the connection waits behind it. Buffered message
        frames go out first, as nsqd flushes before any other frame.
        """
        if self._obuf:
            self.flush_output()
        if self._held is not None:
            self._held.append(data)
        elif self._unsent:
            self._unsent.append(data)
        else:
            self.transport.write(data)

    def _ok_when_durable(self, verb: str, replies: int = 1) -> None:
        if self._held is None:
            self._held = []
            self.broker.store.when_durable(self._release)
        self._held.extend([verb] * replies)

    def _release(self, error: str | None) -> None:
        """The commit holding this connection's publishes is synced (or failed)."""
        held, self._held = self._held or [], None
        if self._obuf:
            self.flush_output()
        out: list[bytes] = []
        failed = False
        for item in held:
            if isinstance(item, str):
                if error is None:
                    out.append(OK)
                    continue
                out.append(frame(FRAME_TYPE_ERROR, fatal(f"E_{item}_FAILED", f"{item} failed {error}").payload))
                failed = True
                break
            out.append(item)
        if self._unsent:
            self._unsent.extend(out)
        else:
            self.transport.writeSequence(out)
        if failed or self._close_after_release:
            self.lose_connection()

    def _read_body_size(self, data: bytes, start: int) -> int | None:
        """The 4-byte size at `start`, or None (with `_need` set) if not here yet."""
        if start + 4 > len(data):
            self._need = start + 4
            return None
        return _unpack_int32(data, start)[0]

    def _command_body(self, verb: str, data: bytes, start: int):
        """IDENTIFY/AUTH's body, bounded by max-body-size: (body, end), or None while it arrives."""
        size = self._read_body_size(data, start)
        if size is None:
            return None
        max_body = self.broker.options.max_body_size
        if size > max_body:
            raise fatal("E_BAD_BODY", f"{verb} body too big {size} > {max_body}")
        if size <= 0:
            raise fatal("E_BAD_BODY", f"{verb} invalid body size {size}")
        end = start + 4 + size
        if end > len(data):
            self._need = end
            return None
        return data[start + 4:end], end

    # -- IConsumer ---------------------------------------------------------------

    def ready(self) -> int:
        if self.state != STATE_SUBSCRIBED or self._closed or self._output_blocked:
            # A connection failed or timed out is not fed while it closes;
            # one whose output is backed up (a client not reading) holds at
            # most what it was sent until then.
            return 0
        return self.ready_count - self.in_flight_count

    def send_messages(self, messages: list) -> None:
        """Buffer the message frames; write them once the buffer is full or the client is not ready.

        nsqd's output buffer (spec section 8): frames wait until the buffer
        reaches output_buffer_size, the client stops being ready (its RDY
        window is used up, so nothing more can come to join them), a
        non-message frame is written, or output_buffer_timeout passes. A
        consumer with a large RDY thus gets few, large writes; a low-rate
        stream waits at most output_buffer_timeout. One lazily armed timer
        per connection, nothing per message.
        """
        out = self._obuf
        append = out.append
        pack = _MSG_HEADER_PACK
        size = self._obuf_len + _MSG_FRAME * len(messages)
        for msg in messages:
            body = msg.body
            append(pack(len(body) + _MSG_OVERHEAD, 2, msg.timestamp, msg.attempts, msg.id))
            append(body)
            size += len(body)
        self._obuf_len = size
        if size >= self.output_buffer_size or self.in_flight_count >= self.ready_count:
            self.flush_output()
            return
        if self._flush_call is None and self.output_buffer_timeout > 0:
            self._flush_call = self.callLater(self.output_buffer_timeout, self._flush_timer)

    def _flush_timer(self) -> None:
        # Not cancelled when the buffer is flushed otherwise: firing on an
        # empty buffer is cheaper than cancelling and re-arming per flush.
        self._flush_call = None
        if self._obuf and not self._closed:
            self.flush_output()

    def flush_output(self) -> None:
        """Write the buffered message frames now (what the flush timer does; tests read with it).

        Frames the transport cannot take now (it is backed up, or the batch
        is larger than one WRITE_STEP) are held in `_unsent` and handed on a
        step at a time as it drains (_drain).
        """
        out = self._obuf
        if not out:
            return
        self._obuf = []
        size = self._obuf_len
        self._obuf_len = 0
        if self._unsent or self._output_blocked:
            # Held frames wait only while the transport is backed up (or the
            # connection closes): resumeProducing hands these on after them.
            self._unsent.extend(out)
            return
        # One joined buffer per write, not writeSequence: Twisted's
        # writeSequence walks the pieces twice in Python (a type check, a
        # length sum), two pieces per message; the join is one C call and
        # the copy it makes is one the transport would make anyway.
        write = self.transport.write
        join = b"".join
        if size <= WRITE_STEP:
            write(join(out))
            return
        # Steps of about WRITE_STEP by piece count (a step may cut a frame:
        # the output is one stream), as long as the transport takes them.
        count = len(out)
        per_step = max(1, WRITE_STEP * count // size)
        for i in range(0, count, per_step):
            write(join(out[i:i + per_step]))
            if self._output_blocked:
                self._unsent.extend(out[i + per_step:])
                return

    def _drain(self) -> None:
        """Hand held frames to the transport a WRITE_STEP at a time until it is backed up again.

        What stays held is known to be unsent: the connection is handed no
        messages meanwhile (ready() is 0 while the transport is backed up),
        so a message that timed out is never written to it again while its
        earlier copy waits here or in the transport's buffer above its mark.
        """
        unsent = self._unsent
        popleft = unsent.popleft
        write = self.transport.write
        while unsent and not self._output_blocked and not self._closed:
            step: list[bytes] = []
            size = 0
            while unsent and size < WRITE_STEP:
                piece = popleft()
                step.append(piece)
                size += len(piece)
            write(b"".join(step))

    def channel_gone(self) -> None:
        self.flush_output()
        self.channel = None
        self.lose_connection()

    # -- commands ----------------------------------------------------------------
    # Each takes (params, data, body_start) and returns where the next command
    # starts, or _NEED_MORE once it has set self._need to the index it waits for.

    def _cmd_nop(self, params, data, start):
        return start

    def _cmd_identify(self, params, data, start):
        if self.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot IDENTIFY in current state")
        got = self._command_body("IDENTIFY", data, start)
        if got is None:
            return _NEED_MORE
        raw, end = got
        try:
            body = _IDENTIFY_DATA.unmarshal(raw)
        except ValueError:
            raise fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None
        response, upgrades = self._identify(body)
        self._write_frame(frame(FRAME_TYPE_RESPONSE, response))
        if not any(upgrades):
            return end
        self._upgrade(*upgrades)
        # Whatever followed IDENTIFY in this read was sent for the new
        # layers (TLS records, compressed bytes): dataReceived hands it to
        # them once this pass is over, instead of parsing it as commands
        # (compressed bytes wait in _codec_input until the codec is on).
        self._upgrade_leftover = data[end:]
        return len(data)

    def _upgrade(self, tls_v1: bool, deflate: bool, snappy: bool) -> None:
        """nsqd's upgrade order: (JSON already sent) TLS + OK, then compression + OK.

        Each OK goes out through the layers enabled so far: the first one
        encrypted (queued by the TLS layer until the handshake is done),
        the second also compressed. nsqd flushes each of these frames in a
        write of its own, and clients rely on it: some read the plain
        frame and switch their decoder at that read's end, which fails if
        compressed bytes came in the same read. So compression starts only
        once what precedes it is on the wire (_start_compression), after
        the TLS handshake when there is one.
        """
        if tls_v1:
            if self.tls:
                raise fatal("E_IDENTIFY_FAILED", "IDENTIFY failed TLS already enabled")
            start_tls = getattr(self.transport, "startTLS", None)
            if start_tls is None or self._held is not None:
                raise fatal("E_IDENTIFY_FAILED", "IDENTIFY failed cannot start TLS on this connection")
            start_tls(self._tls_config)
            self.tls = True
            self._tls_layer = getattr(self.transport, "protocol", None)
            # nsqd gives a handshake 5 s.
            self._handshake_timer = self.clock.callLater(5.0, self._handshake_timed_out)
            self.__dict__.pop("_HANDLERS", None)  # TLS-required policy satisfied
            self._write_frame(OK)
        if snappy or deflate:
            if self._codec is not None:
                raise fatal("E_IDENTIFY_FAILED", "IDENTIFY failed compression already enabled")
            if self._held is not None:
                raise fatal("E_IDENTIFY_FAILED", "IDENTIFY failed cannot compress this connection")
            self._codec_pending = SnappyCodec() if snappy else DeflateCodec(self.deflate_level)
            if not tls_v1:
                self._after_flush(self._start_compression)
            self._update_reading()

    def _after_flush(self, step) -> None:
        """Run `step` once this turn's writes are on the wire and the client had time to read them.

        The reactor hands a turn's writes to the socket in its I/O phase,
        after the turn's timed calls: a delay of UPGRADE_GAP has them out
        first, and leaves a client's read loop time to take them alone.
        """
        self.clock.callLater(UPGRADE_GAP, step)

    def _start_compression(self) -> None:
        """Put the negotiated codec on, send its OK, then decode the input kept for it."""
        codec, self._codec_pending = self._codec_pending, None
        kept, self._codec_input = self._codec_input, []
        if self._closed or codec is None:
            return
        self.transport = CompressedTransport(self.transport, codec)
        self._codec = codec
        self.snappy = isinstance(codec, SnappyCodec)
        self.deflate = not self.snappy
        self._write_frame(OK)
        self._update_reading()
        if kept:
            self.dataReceived(b"".join(kept))

    def _feed_upgraded(self, data: bytes) -> None:
        """Bytes read past IDENTIFY, given to the innermost new layer (TLS, else the decoder)."""
        if self._closed:
            return
        if self._tls_layer is not None and not self.tls_version:
            self._tls_layer.dataReceived(data)
        else:
            self.dataReceived(data)

    def _inflate(self, data: bytes) -> None:
        """Inflate one bounded step of the compressed input, and parse it.

        While parsing is held (output backed up, an auth server asked, a
        chunked MPUB) or a step is already due, `data` is only kept. What a
        step leaves waits for the next turn of the reactor with reading
        stopped (_update_reading), so a few bytes that inflate to gigabytes
        cost INFLATE_STEP at a time and other connections are served in
        between. A corrupt stream closes this connection only.
        """
        codec = self._codec
        if self._inflate_call is not None or self._input_held():
            codec.feed(data)
            self._update_reading()
            return
        try:
            out = codec.decompress(data, INFLATE_STEP)
        except CompressionError as e:
            log.info("client {remote}: bad compressed data ({error}); closing",
                     remote=self.remote_address, error=str(e))
            self._pending = []
            self.lose_connection()
            return
        if out:
            self._parse(out)
        self._continue_input()

    def _inflate_next(self) -> None:
        self._inflate_call = None
        if not self._closed:
            self._inflate(b"")

    def _input_held(self) -> bool:
        """Parsing must wait: output backed up, an auth server asked, a chunked MPUB publishing."""
        return self._output_blocked or self._auth_waiting or self._publishing

    def _continue_input(self) -> None:
        """A reason to wait may have ended: the next inflate step if input waits, then reading."""
        if self._closed:
            return
        codec = self._codec
        if (codec is not None and codec.has_more and self._inflate_call is None
                and not self._input_held()):
            self._inflate_call = self.clock.callLater(0, self._inflate_next)
        self._update_reading()

    def handshakeCompleted(self) -> None:
        """IHandshakeListener: the TLS upgrade is done; note what /stats shows of it.

        A compression negotiated with TLS starts once the TLS layer has
        sent the OK it held for the handshake (see _upgrade).
        """
        self._cancel_handshake_timer()
        try:
            handle = self.transport.getHandle()
            self.tls_version = (handle.get_protocol_version_name() or "TLS").replace("TLSv", "TLS")
            self.tls_cipher_suite = handle.get_cipher_name() or ""
            cert = handle.get_peer_certificate()
            if cert is not None:
                self.tls_common_name = cert.get_subject().CN or ""
        except Exception as e:  # noqa: BLE001 - details for stats only, never fatal
            log.debug("client {remote}: TLS details unavailable: {error}",
                      remote=self.remote_address, error=str(e))
            self.tls_version = self.tls_version or "TLS"
        if self._codec_pending is not None:
            self._after_flush(self._start_compression)
            self._update_reading()

    def _handshake_timed_out(self) -> None:
        self._handshake_timer = None
        log.info("client {remote}: TLS handshake timed out; closing", remote=self.remote_address)
        self._closed = True
        self.transport.abortConnection()

    def _cancel_handshake_timer(self) -> None:
        timer, self._handshake_timer = self._handshake_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _identify(self, body: dict[str, Any]) -> tuple[bytes, tuple[bool, bool, bool]]:
        """Validate and apply IDENTIFY; nsqd's checks, order and texts.

        `body` is identifyDataV2 as _IDENTIFY_DATA decoded it. Returns the
        response and the upgrades to make: (tls_v1, deflate, snappy).
        """
        opts = self.broker.options

        heartbeat = body["heartbeat_interval"]
        if heartbeat == -1:
            heartbeat_interval = 0.0
        elif heartbeat == 0:
            heartbeat_interval = self.heartbeat_interval
        elif 1000 <= heartbeat <= opts.max_heartbeat_interval * 1000:
            heartbeat_interval = heartbeat / 1000
        else:
            raise fatal("E_BAD_BODY", f"IDENTIFY heartbeat interval ({heartbeat}) is invalid")

        buf_timeout = body["output_buffer_timeout"]
        output_buffer_timeout = self.output_buffer_timeout
        if buf_timeout == -1:
            output_buffer_timeout = 0.0
        elif buf_timeout == 0:
            pass
        elif (int(opts.min_output_buffer_timeout * 1000) <= buf_timeout
              <= int(opts.max_output_buffer_timeout * 1000)):
            output_buffer_timeout = buf_timeout / 1000
        else:
            raise fatal("E_BAD_BODY", f"IDENTIFY output buffer timeout ({buf_timeout}) is invalid")
        buf_size = body["output_buffer_size"]
        output_buffer_size = self.output_buffer_size
        if buf_size == -1:
            output_buffer_size = 1
            output_buffer_timeout = 0.0
        elif buf_size == 0:
            pass
        elif 64 <= buf_size <= opts.max_output_buffer_size:
            output_buffer_size = buf_size
        else:
            raise fatal("E_BAD_BODY", f"IDENTIFY output buffer size ({buf_size}) is invalid")

        sample_rate = body["sample_rate"]
        if not 0 <= sample_rate <= 99:
            raise fatal("E_BAD_BODY", f"IDENTIFY sample rate ({sample_rate}) is invalid")

        msg_timeout = body["msg_timeout"]
        if msg_timeout == 0:
            client_msg_timeout = opts.msg_timeout
        elif 1000 <= msg_timeout <= opts.max_msg_timeout * 1000:
            client_msg_timeout = msg_timeout / 1000
        else:
            raise fatal("E_BAD_BODY", f"IDENTIFY msg timeout ({msg_timeout}) is invalid")

        self.client_id = body["client_id"]
        self.hostname = body["hostname"]
        self.user_agent = body["user_agent"]
        self.topology_region = body["topology_region"]
        self.topology_zone = body["topology_zone"]
        self.heartbeat_interval = heartbeat_interval
        self.output_buffer_size = output_buffer_size
        self.output_buffer_timeout = output_buffer_timeout
        self.sample_rate = sample_rate
        self.msg_timeout = client_msg_timeout
        self._identified = True
        self._start_heartbeats()

        tls_v1 = self._tls_config is not None and body["tls_v1"]
        deflate = opts.deflate and body["deflate"]
        snappy = opts.snappy and body["snappy"]
        if deflate and snappy:
            raise fatal("E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression")
        if not body["feature_negotiation"]:
            # As nsqd: without feature negotiation nothing is upgraded.
            return b"OK", (False, False, False)
        deflate_level = body["deflate_level"] if body["deflate_level"] > 0 else 6
        deflate_level = min(deflate_level, opts.max_deflate_level)
        self.deflate_level = deflate_level
        response = {
            "max_rdy_count": opts.max_rdy_count,
            "version": NSQ_VERSION,
            "max_msg_timeout": int(opts.max_msg_timeout * 1000),
            "msg_timeout": int(self.msg_timeout * 1000),
            "tls_v1": tls_v1,
            "deflate": deflate,
            "deflate_level": deflate_level,
            "max_deflate_level": opts.max_deflate_level,
            "snappy": snappy,
            "sample_rate": self.sample_rate,
            "auth_required": self._auth_on,
            "output_buffer_size": self.output_buffer_size,
            "output_buffer_timeout": int(self.output_buffer_timeout * 1000),
            "topology_region": "",
            "topology_zone": "",
        }
        return json.dumps(response, separators=(",", ":")).encode(), (tls_v1, deflate, snappy)

    def _cmd_auth(self, params, data, start):
        if self.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot AUTH in current state")
        if len(params) != 1:
            raise fatal("E_INVALID", "AUTH invalid number of parameters")
        got = self._command_body("AUTH", data, start)
        if got is None:
            return _NEED_MORE
        secret, end = got
        if self.auth_state is not None and self.auth_state.grants:
            raise fatal("E_INVALID", "AUTH already set")
        if not self._auth_on:
            raise fatal("E_AUTH_DISABLED", "AUTH disabled")
        self._auth_secret = secret.decode("utf-8", "replace")
        self._resume_at = end
        self._after_auth = self._authed
        return _PAUSED

    # -- auth ---------------------------------------------------------------------

    def _check_auth(self, verb: str, topic: str, channel: str):
        """nsqd's CheckAuth: None when allowed, _PAUSED while an expired answer is fetched again.

        Raises the fatal errors nsqd sends. A re-query pauses parsing and
        runs this same command again once the new answer is in.
        """
        state = self.auth_state
        if state is None or not self.authorized:
            raise fatal("E_AUTH_FIRST", f"AUTH required before {verb}")
        if self.clock.seconds() >= state.expires:
            self._resume_at = -1
            self._after_auth = self._resume
            return _PAUSED
        if not state.allows(topic, channel):
            raise fatal("E_UNAUTHORIZED", f'AUTH failed for {verb} on "{topic}" "{channel}"')
        return None

    def _query_auth(self, then) -> None:
        """Ask the auth server(s) without blocking; `then()` runs once auth_state holds the answer."""
        # tls_common_name is set by handshakeCompleted, which runs before
        # any byte read over TLS reaches dataReceived.
        # Parsing waits for the answer, and so does reading (nsqd's read loop
        # is blocked in the query): what the client streams meanwhile stays
        # in the kernel's buffers, not ours.
        self._auth_waiting = True
        d = self.broker.auth.query(self._remote_ip, bool(self.tls),
                                   self._auth_secret, self.tls_common_name)
        d.addCallbacks(self._auth_answer, self._auth_failed, callbackArgs=(then,))
        d.addErrback(lambda f: log.failure("AUTH answer handling failed", f))
        self._update_reading()  # unless answered already

    def _auth_answer(self, state, then) -> None:
        self._auth_waiting = False
        if self._closed:
            return
        self.auth_state = state
        then()  # _authed or _resume: both end in _resume, which reads on (or the connection closes)

    def _auth_failed(self, failure) -> None:
        self._auth_waiting = False
        if self._closed:
            return
        # The reason stays in the log: nsqd never tells untrusted clients
        # what went wrong with the auth server.
        log.warn("client {remote}: AUTH failed - {error}", remote=self.remote_address,
                 error=failure.getErrorMessage())
        self._fail(fatal("E_AUTH_FAILED", "AUTH failed"))

    def _authed(self) -> None:
        state = self.auth_state
        if not state.grants:
            self._fail(fatal("E_UNAUTHORIZED", "AUTH no authorizations found"))
            return
        self.authorized = True
        body = {"identity": state.identity, "identity_url": state.identity_url,
                "permission_count": state.permission_count}
        self._write_frame(frame(FRAME_TYPE_RESPONSE, json.dumps(body, separators=(",", ":")).encode()))
        self._resume()

    def _resume(self) -> None:
        """Parse what arrived while the auth server was asked (or a chunked MPUB published).

        The kept input is plaintext already (inflated, decrypted): it goes
        to the parser, not through the codec again.
        """
        rest = b"".join(self._pending)
        self._pending = []
        self._pending_len = 0
        self._need = 0
        if rest and not self._closed:
            self._parse(rest)
        self._continue_input()

    def _cmd_sub(self, params, data, start):
        if self.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot SUB in current state")
        if self.heartbeat_interval <= 0:
            raise fatal("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(params) < 3:
            raise fatal("E_INVALID", "SUB insufficient number of parameters")
        topic_name = _name(params[1])
        if topic_name is None:
            raise fatal("E_BAD_TOPIC", f"SUB topic name {go_quote(params[1])} is not valid")
        channel_name = _name(params[2])
        if channel_name is None:
            raise fatal("E_BAD_CHANNEL", f"SUB channel name {go_quote(params[2])} is not valid")
        if self._auth_on and self._check_auth("SUB", topic_name, channel_name) is not None:
            return _PAUSED
        channel = self.broker.topic(topic_name).channel(channel_name)
        try:
            channel.add_client(self)
        except ChannelError as e:
            raise fatal("E_SUB_FAILED", f"SUB failed {e}") from None
        self.state = STATE_SUBSCRIBED
        self.channel = channel
        self._write_frame(OK)
        return start

    def _cmd_rdy(self, params, data, start):
        state = self.state
        if state == STATE_CLOSING:
            return start
        if state != STATE_SUBSCRIBED:
            raise fatal("E_INVALID", "cannot RDY in current state")
        count = 1
        if len(params) > 1:
            count = _base10(params[1])
            if count is None:
                raise fatal("E_INVALID", f"RDY could not parse count {_echo(params[1])}")
            count = _int64(count)  # nsqd's int64(b10): huge counts wrap, some negative
        max_rdy = self.broker.options.max_rdy_count
        if count > max_rdy or count < 0:
            raise fatal("E_INVALID", f"RDY count {count} out of range 0-{max_rdy}")
        self.ready_count = count
        if self._obuf and count <= self.in_flight_count:
            self.flush_output()  # no longer ready: nsqd flushes
        self._deliver_soon()
        return start

    def _message_id(self, verb: str, params) -> bytes:
        state = self.state
        if state != STATE_SUBSCRIBED and state != STATE_CLOSING:
            raise fatal("E_INVALID", f"cannot {verb} in current state")
        if len(params) < (3 if verb == "REQ" else 2):
            raise fatal("E_INVALID", f"{verb} insufficient number of params")
        msg_id = params[1]
        if len(msg_id) != 16:
            raise fatal("E_INVALID", "invalid message ID")
        return msg_id

    def _cmd_fin(self, params, data, start):
        msg_id = params[1] if len(params) > 1 else b""
        if len(msg_id) != 16 or self.state != STATE_SUBSCRIBED:
            msg_id = self._message_id("FIN", params)
        try:
            self.channel.finish(self, msg_id)
        except ChannelError as e:
            raise nonfatal("E_FIN_FAILED", f"FIN {_echo(msg_id)} failed {e}") from None
        self._deliver_soon()
        return start

    def _cmd_req(self, params, data, start):
        msg_id = self._message_id("REQ", params)
        timeout_ms = _base10(params[2])
        if timeout_ms is None:
            raise fatal("E_INVALID", f"REQ could not parse timeout {_echo(params[2])}")
        # As nsqd: the timeout as a Duration (which may overflow), clamped.
        timeout_ns = _ms_duration_ns(timeout_ms)
        max_ns = round(self.broker.options.max_req_timeout * 1e9)
        delay_ns = min(max(timeout_ns, 0), max_ns)
        if delay_ns != timeout_ns:
            log.info("client {remote} REQ timeout {timeout}ns out of range 0-{max}ns; set to {delay}ns",
                     remote=self.remote_address, timeout=timeout_ns, max=max_ns, delay=delay_ns)
        try:
            self.channel.requeue(self, msg_id, delay_ns / 1e9)
        except ChannelError as e:
            raise nonfatal("E_REQ_FAILED", f"REQ {_echo(msg_id)} failed {e}") from None
        self._deliver_soon()
        return start

    def _cmd_touch(self, params, data, start):
        msg_id = self._message_id("TOUCH", params)
        try:
            self.channel.touch(self, msg_id)
        except ChannelError as e:
            raise nonfatal("E_TOUCH_FAILED", f"TOUCH {_echo(msg_id)} failed {e}") from None
        return start

    def _cmd_cls(self, params, data, start):
        if self.state != STATE_SUBSCRIBED:
            raise fatal("E_INVALID", "cannot CLS in current state")
        self.ready_count = 0
        self.state = STATE_CLOSING
        self._write_frame(CLOSE_WAIT)
        return start

    def _publish_topic(self, verb: str, params, min_params: int, code_prefix: str = "") -> str:
        if len(params) < min_params:
            raise fatal("E_INVALID", f"{verb} insufficient number of parameters")
        topic_name = _name(params[1])
        if topic_name is None:
            raise fatal("E_BAD_TOPIC", f"{code_prefix}{verb} topic name {go_quote(params[1])} is not valid")
        return topic_name

    def _single_body(self, verb: str, data: bytes, start: int):
        """PUB/DPUB's body: (body, end), or None while it is still arriving."""
        size = self._read_body_size(data, start)
        if size is None:
            return None
        if size <= 0:
            raise fatal("E_BAD_MESSAGE", f"{verb} invalid message body size {size}")
        max_msg = self.broker.options.max_msg_size
        if size > max_msg:
            raise fatal("E_BAD_MESSAGE", f"{verb} message too big {size} > {max_msg}")
        end = start + 4 + size
        if end > len(data):
            self._need = end
            return None
        return data[start + 4:end], end

    def _publish(self, verb: str, topic_name: str, bodies: list[bytes], defer: float = 0.0,
                 replies: int = 1) -> None:
        try:
            self.broker.topic(topic_name).publish(bodies, defer)
        except BackendError as e:
            self.broker.set_health(str(e))
            raise fatal(f"E_{verb}_FAILED", f"{verb} failed {e}") from None
        counts = self.pub_counts
        counts[topic_name] = counts.get(topic_name, 0) + len(bodies)
        if self.broker.store.durable:
            self._ok_when_durable(verb, replies)
        else:
            self._write_frame(OK * replies)

    def _cmd_pub(self, params, data, start):
        topic_name = self._publish_topic("PUB", params, 2)
        got = self._single_body("PUB", data, start)
        if got is None:
            return _NEED_MORE
        if self._auth_on and self._check_auth("PUB", topic_name, "") is not None:
            return _PAUSED
        body, end = got
        if self.state == STATE_INIT:
            # A pure publisher: consecutive PUBs to one topic in this read
            # are published together (see _flush_pubs).
            if self._pub_topic != topic_name:
                self._flush_pubs()
                self._pub_topic = topic_name
            self._pub_bodies.append(body)
        else:
            self._publish("PUB", topic_name, [body])
        return end

    def _flush_pubs(self) -> None:
        """Publish the PUBs gathered from this read as one batch, then one OK each, in order.

        One pass through topic, channels and store instead of one per
        message. Only a connection that is not subscribed gathers, so a
        consumer that also publishes sees the same frames however its
        reads are split.
        """
        bodies = self._pub_bodies
        if not bodies:
            return
        self._pub_bodies = []
        topic_name, self._pub_topic = self._pub_topic, None
        self._publish("PUB", topic_name, bodies, replies=len(bodies))

    def _cmd_dpub(self, params, data, start):
        topic_name = self._publish_topic("DPUB", params, 3)
        timeout_ms = _base10(params[2])
        if timeout_ms is None:
            raise fatal("E_INVALID", f"DPUB could not parse timeout {_echo(params[2])}")
        # nsqd checks the Duration (which may overflow) and prints the uint64 milliseconds.
        defer_ns = _ms_duration_ns(timeout_ms)
        max_ns = round(self.broker.options.max_defer_timeout * 1e9)
        if defer_ns < 0 or defer_ns > max_ns:
            raise fatal("E_INVALID", f"DPUB timeout {timeout_ms} out of range 0-{max_ns // 1_000_000}")
        got = self._single_body("DPUB", data, start)
        if got is None:
            return _NEED_MORE
        if self._auth_on and self._check_auth("DPUB", topic_name, "") is not None:
            return _PAUSED
        body, end = got
        self._publish("DPUB", topic_name, [body], defer_ns / 1e9)
        return end

    def _cmd_mpub(self, params, data, start):
        topic_name = self._publish_topic("MPUB", params, 2, code_prefix="E_BAD_TOPIC ")
        if self._auth_on and self._check_auth("MPUB", topic_name, "") is not None:
            return _PAUSED
        self.broker.topic(topic_name)  # nsqd creates the topic before reading the body
        size = self._read_body_size(data, start)
        if size is None:
            return _NEED_MORE
        opts = self.broker.options
        if size <= 0:
            raise fatal("E_BAD_BODY", f"MPUB invalid body size {size}")
        if size > opts.max_body_size:
            raise fatal("E_BAD_BODY", f"MPUB body too big {size} > {opts.max_body_size}")
        # As nsqd, the declared size is only range-checked: the count and the
        # messages are read from the stream, however many bytes they take
        # (clients declare either the whole body or the messages' bytes).
        pos = start + 4
        avail = len(data)
        if pos + 4 > avail:
            self._need = pos + 4
            return _NEED_MORE
        count = _unpack_int32(data, pos)[0]
        if count <= 0 or count > (opts.max_body_size - 4) // 5:
            raise fatal("E_BAD_BODY", f"MPUB invalid message count {count}")
        first = pos = pos + 4
        limit = _mpub_limit(opts.max_body_size, count)
        walked, self._mpub_walk = self._mpub_walk, None
        done = 0
        if walked is not None:
            pos = start + walked[0]
            done = walked[1]
        max_msg = opts.max_msg_size
        bodies = [] if walked is None and not is_big(count, size) else None
        try:
            pos, n = walk_binary(data, pos, avail, done, count - done, max_msg, bodies, -1, True)
        except BatchError as e:
            if is_big(count, avail - start - 4):
                # Refused over turns, as any big batch's bad message is.
                return self._mpub_in_chunks(topic_name, data, first, avail, count, size)
            raise _mpub_error(e, max_msg, size) from None
        done += n
        if done < count:
            # Parse again once the next thing nsqd would read is here: the
            # size of the next message, or the body begun and the size after
            # it, so a bad size is answered as soon as it arrives.
            if pos + 4 > avail:
                need = pos + 4
            else:
                need = pos + 4 + _unpack_int32(data, pos)[0] + (4 if count - done > 1 else 0)
            if need - start - 4 > limit:
                raise fatal("E_BAD_BODY", f"MPUB body too big {need - start - 4} > {limit}")
            self._mpub_walk = (pos - start, done)
            self._need = need
            return _NEED_MORE
        if pos - start - 4 > limit:
            raise fatal("E_BAD_BODY", f"MPUB body too big {pos - start - 4} > {limit}")
        if is_big(count, pos - start - 4):
            return self._mpub_in_chunks(topic_name, data, first, pos, count, size)
        if bodies is None:
            bodies = []
            walk_binary(data, first, pos, 0, count, max_msg, bodies)
        self._publish("MPUB", topic_name, bodies)
        return pos

    def _mpub_in_chunks(self, topic_name: str, data: bytes, pos: int, end: int, count: int, size: int):
        """A big MPUB, checked and published over several turns (mqd.nsqd.batches); OK once done.

        The connection stops reading meanwhile and keeps what followed the
        MPUB in this read, so the commands after it run, and are answered,
        after it: its responses stay in command order and its messages in
        its order.
        """
        max_msg = self.broker.options.max_msg_size
        chunks = binary_chunks(data, pos, end, count, max_msg, exact=True)

        def bodies_of(chunk):
            return binary_bodies(data, end, chunk)

        def done(error):
            self._mpub_done(topic_name, count, size, max_msg, error)

        self._publishing = True
        self._update_reading()
        publish_in_chunks(self.clock, self.broker.topic(topic_name), chunks, bodies_of, done)
        self._resume_at = end
        return _PAUSED

    def _mpub_done(self, topic_name: str, count: int, size: int, max_msg: int, error) -> None:
        """A chunked MPUB is over: answer it as a one-go MPUB would be, then read on."""
        self._publishing = False
        if self._closed:
            # The messages were read whole and checked: they are published
            # even though nobody is left to tell, as nsqd would.
            return
        if isinstance(error, BatchError):
            self._fail(_mpub_error(error, max_msg, size))
            return
        if error is not None:
            if not isinstance(error, TopicExiting):
                self.broker.set_health(str(error))
            self._fail(fatal("E_MPUB_FAILED", f"MPUB failed {error}"))
            return
        counts = self.pub_counts
        counts[topic_name] = counts.get(topic_name, 0) + count
        if self.broker.store.durable:
            self._ok_when_durable("MPUB")
        else:
            self._write_frame(OK)
        self._resume()  # the input kept meanwhile, then reading again

    _HANDLERS = {
        b"NOP": _cmd_nop,
        b"IDENTIFY": _cmd_identify,
        b"AUTH": _cmd_auth,
        b"SUB": _cmd_sub,
        b"RDY": _cmd_rdy,
        b"FIN": _cmd_fin,
        b"REQ": _cmd_req,
        b"TOUCH": _cmd_touch,
        b"CLS": _cmd_cls,
        b"PUB": _cmd_pub,
        b"MPUB": _cmd_mpub,
        b"DPUB": _cmd_dpub,
    }


_PUB = V2Protocol._cmd_pub
_FIN = V2Protocol._cmd_fin


def _tls_required(self, params, data, start):
    raise fatal("E_INVALID", f"cannot {_echo(params[0])} in current state (TLS required)")


def _mpub_limit(max_body_size: int, count: int) -> int:
    """The most bytes an MPUB body of `count` messages may take after its declared size.

    nsqd reads up to count x (4 + max-msg-size) bytes whatever the declared
    size; mqd keeps a pending MPUB in memory, so it bounds the messages'
    own bytes by max-body-size: the count, the sizes, and max-body-size.
    That takes both forms clients send (declared = the whole body, or the
    messages' bytes only) up to max-body-size.
    """
    return 4 + 4 * count + max_body_size


def _mpub_error(err: BatchError, max_msg: int, size: int) -> ProtocolError:
    """nsqd's error for an MPUB body that failed a check (mqd.nsqd.batches's reasons)."""
    reason = err.reason
    if reason == NO_SIZE:
        return fatal("E_BAD_MESSAGE", f"MPUB failed to read message({err.index}) body size")
    if reason == BAD_SIZE:
        return fatal("E_BAD_MESSAGE", f"MPUB invalid message({err.index}) body size {err.size}")
    if reason == TOO_BIG:
        return fatal("E_BAD_MESSAGE", f"MPUB message too big {err.size} > {max_msg}")
    if reason == TRAILING:
        return fatal("E_BAD_BODY", f"MPUB invalid body size {size}")
    return fatal("E_BAD_MESSAGE", "MPUB failed to read message body")


# The handler table of a connection that must upgrade to TLS first
# (--tls-required): IDENTIFY only; swapped for the class's on upgrade, so
# the policy costs nothing per command.
_TLS_REQUIRED_HANDLERS = {
    verb: handler if verb == b"IDENTIFY" else _tls_required
    for verb, handler in V2Protocol._HANDLERS.items()
}

# Commands whose follow-up delivery can wait for the end of the read: they
# write nothing on success and only ever free in-flight slots.
_BATCHABLE = frozenset(
    (V2Protocol._cmd_nop, V2Protocol._cmd_fin, V2Protocol._cmd_req, V2Protocol._cmd_touch)
)


_valid_names: dict[bytes, str] = {}


_FIN_LINE = 21  # b"FIN " + a 16-byte id + b"\n"
# What each line of a run of plain FINs has at these offsets.
_FIN_MARKS = ((0, b"F"), (1, b"I"), (2, b"N"), (3, b" "), (20, b"\n"))


def _plain_fins(data: bytes, pos: int, end: int, ids: list[bytes]) -> int:
    """Append the ids of the plain FIN lines starting at `pos` to `ids`; where they stop.

    A reader acks every message, so a read is mostly lines of exactly
    b"FIN <16-byte id>\n": their ids are found with a few strided compares
    and sliced in one comprehension instead of a find and a split each.
    A line the general loop would read differently (a space or a newline
    inside the id, CRLF) ends the run here, and the caller reads it.
    """
    n = (end - pos) // _FIN_LINE
    if n < 2:
        return pos
    last = pos + n * _FIN_LINE
    for offset, mark in _FIN_MARKS:
        marks = data[pos + offset:last:_FIN_LINE]
        run = n - len(marks.lstrip(mark))
        if run < n:
            n = run
            last = pos + n * _FIN_LINE
    cr = data.find(b"\r", pos + 19, last)
    if cr >= 0:
        n = (cr - pos) // _FIN_LINE
        last = pos + n * _FIN_LINE
    if n < 1 or data.count(b" ", pos, last) != n or data.count(b"\n", pos, last) != n:
        return pos
    ids += [data[p:p + 16] for p in range(pos + 4, last, _FIN_LINE)]
    return last


def _name(raw: bytes) -> str | None:
    """A topic/channel name from the wire if it is valid, else None.

    Valid names are remembered (a bounded cache): a publisher names the same
    topic in every PUB, and the regex would otherwise run every time.
    """
    name = _valid_names.get(raw)
    if name is not None:
        return name
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not is_valid_name(name):
        return None
    if len(_valid_names) >= 4096:
        _valid_names.clear()
    _valid_names[raw] = name
    return name


class V2Factory(Factory):
    """Builds a V2Protocol per connection, all sharing one broker."""

    noisy = False

    def __init__(self, broker) -> None:
        self.broker = broker

    def buildProtocol(self, addr) -> V2Protocol:
        proto = V2Protocol(self.broker)
        proto.factory = self
        return proto
