"""The broker side of nsqd's TCP protocol V2, one instance per connection.

This module is what nsqd's protocol_v2.go is: the parser loop, the command
table and one method per command, publishing and its answer included.
Parsing works on whole buffers: every complete command in a chunk is
handled in one pass, and work that a batch of commands shares (asking the
channel to deliver after many FINs) happens once at the end of the pass.

The rest of a connection (nsqd's client_v2.go) is held by collaborators
the protocol composes, each owning its fields and changing them only
through its own methods:

- client.py: ClientV2, the record /stats reads (state, RDY and the counts,
  the settings IDENTIFY negotiated, what TLS and compression set up); the
  channel changes its counts through the protocol's IConsumer methods;
- output.py: Output, frames, the message buffer, unsent frames, the flush
  timer, the write deadline, frames held behind a durable OK, heartbeats;
- gate.py: InputGate, every reason reading stops (a big MPUB publishing,
  the auth server asked, compressed input waiting, output backed up, a
  half-close) and the decision to pause or resume the transport;
- upgrades.py: Upgrades, TLS and compression after IDENTIFY;
- authorize.py: AuthGate, AUTH's answer and secret and the query due;
- fastpath.py: the scan for a run of plain FINs, a pure function;
- publish.py, identify.py, params.py, truncated.py: nsqd's checks and
  answers as pure functions.

The protocol keeps the parser's own state (input kept for an incomplete
command, the PUBs gathered in a read, where to resume after a pause), the
subscribed channel and whether the connection is closed. It decides when
each collaborator's step happens: the auth server's answer, the store's
commit and the compression's start land here, and a collaborator's own
timer calls back only into the callback it was handed (the output's write
deadline, the TLS handshake's timeout, the next inflate step). Nothing
reaches into another's fields: what one needs of another is a public
method or property. The hot paths bind the collaborators they use to
locals: a PUB, a FIN or a delivered batch costs what it did when the
connection was one object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NoReturn

from twisted.internet.interfaces import IHalfCloseableProtocol, IHandshakeListener, IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.protocols.policies import TimeoutMixin
from zope.interface import implementer

from backends import BackendError
from mqd.logs import get_logger
from mqd.nsqd.batches import (
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
from mqd.nsqd.protocol.authorize import AUTHORIZED, REFUSED, AuthGate
from mqd.nsqd.protocol.client import STATE_CLOSING, STATE_INIT, STATE_SUBSCRIBED, ClientV2
from mqd.nsqd.protocol.fastpath import plain_fins
from mqd.nsqd.protocol.gate import InputGate
from mqd.nsqd.protocol.identify import negotiate, parse_request
from mqd.nsqd.protocol.output import Output
from mqd.nsqd.protocol.params import (
    MAX_LINE,
    NEED_MORE,
    PAUSED,
    base10,
    echo,
    int64,
    ms_duration_ns,
    valid_name,
)
from mqd.nsqd.protocol.publish import mpub_error, mpub_limit, publish_topic
from mqd.nsqd.protocol.truncated import cut_short
from mqd.nsqd.protocol.upgrades import UPGRADE_GAP, Upgrades
from mqd.peers import peer_host, remote_address
from mqd.wire.compression import CompressionError
from mqd.wire.errors import ProtocolError, fatal, go_quote, nonfatal
from mqd.wire.framing import (
    CLOSE_WAIT,
    FRAME_TYPE_ERROR,
    FRAME_TYPE_RESPONSE,
    INT32,
    MAGIC_V2,
    OK,
    frame,
)
from mqd.wire.json_encoding import encode_json

if TYPE_CHECKING:
    from twisted.internet.interfaces import IAddress, IReactorTime
    from twisted.python.failure import Failure

    from mqd.http.auth import AuthState
    from mqd.message import Message
    from mqd.nsqd.broker import Broker
    from mqd.nsqd.channel import Channel
    from mqd.nsqd.tlsconfig import ServerTLS
    from mqd.wire.transport import IStreamTransport

__all__ = ["V2Protocol", "V2Factory", "STATE_INIT", "STATE_SUBSCRIBED", "STATE_CLOSING", "MAX_LINE"]


_unpack_int32: Callable[[bytes, int], tuple[int]] = INT32.unpack_from
_FOREVER = float("inf")

log = get_logger(__name__)


def _client_field(name: str) -> property:
    """A read-only view of the client record's field `name` on the protocol."""
    return property(attrgetter(f"client.{name}"), doc=f"The client record's {name} (read-only).")


def _tls_required(self: V2Protocol, params: Sequence[bytes], data: bytes, start: int) -> NoReturn:
    raise fatal("E_INVALID", f"cannot {echo(params[0])} in current state (TLS required)")


@implementer(IConsumer, IHalfCloseableProtocol, IHandshakeListener, IPushProducer)
class V2Protocol(Protocol, TimeoutMixin):
    """One client connection speaking V2."""

    transport: IStreamTransport

    def __init__(self, broker: Broker, tls: ServerTLS | None = None) -> None:
        """A connection to `broker`; `tls` is the TLS context it may start (None: the broker has no TLS)."""
        self.broker = broker
        options = broker.options
        self.clock: IReactorTime = broker.clock
        self.callLater = broker.clock.callLater  # type: ignore[method-assign]  # TimeoutMixin schedules with this
        self.channel: Any = None  # the Channel once subscribed
        client = self.client = ClientV2(broker.next_client_id(), options.msg_timeout,
                                        options.output_buffer_timeout)
        gate = self._gate = InputGate()
        output = self._output = Output(self.clock, client, gate, self._write_timed_out)
        upgrades = self._upgrades = Upgrades(self.clock, client, output, gate, tls)
        self._auth = AuthGate(broker.auth)
        self._auth_on = broker.auth.enabled
        self._closed = False
        # The parser: the command table (IDENTIFY only until TLS starts,
        # under --tls-required), the magic, input kept for a command that
        # is incomplete (or while parsing waits), and how much it needs.
        self._handlers = self._TLS_REQUIRED_HANDLERS if upgrades.tls_required else self._HANDLERS
        self._magic_ok = False
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._need: float = 0
        # Input a paused parse may keep: the biggest command (line, size, body);
        # an MPUB's body is bounded by mpub_limit, not by its declared size.
        max_mpub = mpub_limit(options.max_body_size, (options.max_body_size - 4) // 5)
        self._max_pending = MAX_LINE + 4 + max(max_mpub, options.max_msg_size)
        # Where parsing resumes after a command that returned PAUSED: past it
        # (AUTH, a big MPUB), or -1 for the command itself (an expired auth
        # answer asked again, after which the command runs).
        self._resume_at = -1
        # PUBs of the current read not published yet, all to _pub_topic ("" while none).
        self._pub_bodies: list[bytes] = []
        self._pub_topic = ""
        # An MPUB waiting for more input: (offset of its walk from the body
        # size, messages checked so far), so each read walks only new bytes.
        self._mpub_walk: tuple[int, int] | None = None
        # What followed an IDENTIFY that upgraded, for the new layers.
        self._upgrade_leftover: bytes | None = None

    # What the channel (IConsumer's attributes), /stats' neighbours and
    # tests read of a connection: its client record's fields, read-only.
    id = _client_field("id")
    state = _client_field("state")
    client_id = _client_field("client_id")
    hostname = _client_field("hostname")
    user_agent = _client_field("user_agent")
    remote_address = _client_field("remote_address")
    heartbeat_interval = _client_field("heartbeat_interval")
    msg_timeout = _client_field("msg_timeout")
    sample_rate = _client_field("sample_rate")
    deflate = _client_field("deflate")
    snappy = _client_field("snappy")
    tls = _client_field("tls")
    tls_version = _client_field("tls_version")
    tls_cipher_suite = _client_field("tls_cipher_suite")
    ready_count = _client_field("ready_count")
    in_flight_count = _client_field("in_flight_count")
    message_count = _client_field("message_count")
    finish_count = _client_field("finish_count")
    requeue_count = _client_field("requeue_count")
    pub_counts = _client_field("pub_counts")

    @property
    def auth_state(self) -> AuthState | None:
        """The auth server's last answer (mqd.http.auth.AuthState), None before AUTH."""
        return self._auth.state

    # -- connection lifecycle -------------------------------------------------

    def connectionMade(self) -> None:
        transport = self.transport
        # Go sets TCP_NODELAY on every connection, so nsqd's clients never see
        # Nagle hold a small frame back (a late durable OK, a lone message).
        if hasattr(transport, "setTcpNoDelay"):
            transport.setTcpNoDelay(True)
        peer = transport.getPeer()
        host = peer_host(peer)
        self.client.connected(remote_address(peer), host, host if hasattr(peer, "port") else "",
                              self.clock.seconds())
        self.broker.client_connected(self)
        self._gate.attach(transport)
        self._upgrades.attach(transport)
        self._start_heartbeats()
        # A streaming producer of its transport, which pauses it while its
        # unsent output is over its bufferSize and resumes it once that is
        # all handed to the kernel (see pauseProducing).
        self._output.attach(transport, self)

    def readConnectionLost(self) -> None:
        """IHalfCloseableProtocol: the client sent its last byte (`nc -N`, a shutdown(SHUT_WR)).

        nsqd answers every command it read before it closes, so a script
        that writes its PUBs and half-closes still reads their OKs. Twisted
        would otherwise drop the connection, and the answers not written
        yet with it. What the client sent is parsed by now unless something
        holds the input (the input gate, which says when it is let go).
        """
        self._gate.input_ended()
        self._update_reading()

    def writeConnectionLost(self) -> None:
        """IHalfCloseableProtocol: mqd never half-closes its side; nothing to do."""

    def _input_done(self) -> None:
        """Close after the half-close, once every answer is written (a durable OK once synced).

        A command whose body the input ended inside is answered with the
        error nsqd's reader gives it (mqd.nsqd.protocol.truncated).
        """
        if self._closed:
            return
        if self._pending and self._magic_ok:
            error = cut_short(b"".join(self._pending), self._mpub_walk)
            if error is not None:
                self._fail(error)
                return
        self._output.flush()
        self._pending = []
        self._close_when_answered()

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._closed = True
        self._output.lost()
        self.setTimeout(None)  # type: ignore[no-untyped-call]  # Twisted's TimeoutMixin is unannotated
        if self._upgrades.lost():
            log.info("client {remote}: TLS handshake failed: {reason}", remote=self.client.remote_address,
                     reason=reason.getErrorMessage() if reason is not None else "connection lost")
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.remove_client(self)
        self.broker.client_disconnected(self)

    def lose_connection(self) -> None:
        """Close once the output is written; every graceful close of a V2 connection goes through here."""
        self._closed = True
        self._output.close()

    def _abort(self) -> None:
        """Drop the connection now, with what it had not written yet."""
        self._closed = True
        self._output.abort()

    def _close_when_answered(self) -> None:
        """Close once every answer is written: now, or once the publishes held for their commit are answered."""
        output = self._output
        if output.holding:
            self._closed = True
            output.close_after_release()
        else:
            self.lose_connection()

    def _fail(self, err: ProtocolError) -> None:
        log.info("client {remote}: {error}", remote=self.client.remote_address, error=str(err))
        self._closed = True
        self._pending = []
        self._output.write_frame(frame(FRAME_TYPE_ERROR, err.payload))
        self._close_when_answered()

    # -- heartbeats and timeouts ---------------------------------------------------

    def _start_heartbeats(self) -> None:
        self._stop_heartbeats()
        interval = self.client.heartbeat_interval
        if interval > 0:
            self._output.start_heartbeats(interval)
            # Two heartbeats without a word back and the client is gone.
            self.setTimeout(interval * 2)  # type: ignore[no-untyped-call]

    def _stop_heartbeats(self) -> None:
        self._output.stop_heartbeats()
        self.setTimeout(None)  # type: ignore[no-untyped-call]

    def timeoutConnection(self) -> None:
        """Two heartbeat intervals without a word: close, as nsqd's read deadline does.

        nsqd's heartbeat falls due with that deadline when the client has
        been silent since the heartbeats started, and is written first; then
        the connection closes as any other (the output flushed, a FIN), so
        the client reads an end of stream, not a reset. A client that does
        not read its output either is dropped at once.
        """
        log.info("client {remote} missed two heartbeats; closing", remote=self.client.remote_address)
        output = self._output
        reading = not (self._gate.output_blocked or output.has_unsent)
        if reading and output.heartbeat_due():
            output.send_heartbeat()
        self._stop_heartbeats()
        if reading:
            self.lose_connection()
        else:
            # It does not read either: its output would never drain, so the
            # connection is dropped now, as nsqd's close drops what its
            # buffer still held for it.
            self._abort()

    def _write_timed_out(self) -> None:
        """The output did not drain within the heartbeat interval (the output's write deadline): close now.

        Aborted, not closed gracefully: a graceful close waits for the
        output to be written, which is what did not happen. connectionLost
        then gives the in-flight messages back to the channel.
        """
        if self._upgrades.handshaking:
            # The TLS layer holds output until the handshake is done, which
            # has its own timer: the deadline counts once it is.
            self._output.arm_write_deadline()
            return
        log.info("client {remote}: output not drained within {interval}s; closing",
                 remote=self.client.remote_address, interval=self.client.heartbeat_interval)
        self._abort()

    # -- IConsumer ---------------------------------------------------------------

    def ready(self) -> int:
        client = self.client
        if client.state != STATE_SUBSCRIBED or self._closed or self._gate.output_blocked:
            # A connection failed or timed out is not fed while it closes;
            # one whose output is backed up (a client not reading) holds at
            # most what it was sent until then.
            return 0
        return client.ready_count - client.in_flight_count

    def send_messages(self, messages: list[Message]) -> None:
        """Write the message frames through the output buffer (Output.send_messages)."""
        self._output.send_messages(messages)

    def sending_messages(self, count: int) -> None:
        self.client.sending_messages(count)

    def finished_messages(self, count: int) -> None:
        self.client.finished_messages(count)

    def requeued_message(self) -> None:
        self.client.requeued_message()

    def timed_out_messages(self, count: int) -> None:
        self.client.timed_out_messages(count)

    def in_flight_cleared(self) -> None:
        self.client.in_flight_cleared()

    def channel_gone(self) -> None:
        self._output.flush()
        self.channel = None
        self.lose_connection()

    def flush_output(self) -> None:
        """Write the buffered message frames now (what the flush timer does; tests read with it)."""
        self._output.flush()

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
        is closed (nsqd's write deadline, see Output.arm_write_deadline).
        """
        if self._gate.output_paused():
            self._output.arm_write_deadline()
            self._update_reading()

    def resumeProducing(self) -> None:
        """The output drained: hand on what waits, then read on, deliver again, inflate the rest of the input."""
        gate = self._gate
        if not gate.output_resumed():
            return
        self._output.drained()
        self._continue_input()
        if not self._closed and not gate.output_blocked:
            self._deliver_soon()

    def stopProducing(self) -> None:
        """The transport is gone; connectionLost does the cleaning up."""

    def _update_reading(self) -> None:
        """Read the socket only while nothing holds it (the input gate decides); close a half-closed input once let go."""
        if not self._closed and self._gate.update():
            self._input_done()

    def _continue_input(self) -> None:
        """A reason to wait may have ended: the next inflate step if input waits, then reading."""
        if self._closed:
            return
        if not self._gate.holds_parsing:
            self._upgrades.inflate_later(self._inflate_next)
        self._update_reading()

    # -- reading commands ------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._closed:
            return
        self.resetTimeout()  # type: ignore[no-untyped-call]
        upgrades = self._upgrades
        if upgrades.codec is not None:
            self._inflate(data)
        elif upgrades.compression_pending:
            upgrades.keep_input(data)
        else:
            self._parse(data)

    def _inflate(self, data: bytes) -> None:
        """Inflate one bounded step of the compressed input, and parse it.

        While parsing is held (output backed up, an auth server asked, a
        chunked MPUB) or a step is already due, `data` is only kept. What a
        step leaves waits for the next turn of the reactor with reading
        stopped (the input gate), so a few bytes that inflate to gigabytes
        cost INFLATE_STEP at a time and other connections are served in
        between. A corrupt stream closes this connection only.
        """
        upgrades = self._upgrades
        if upgrades.inflate_due or self._gate.holds_parsing:
            upgrades.keep_compressed(data)
            self._update_reading()
            return
        try:
            out = upgrades.inflate(data)
        except CompressionError as e:
            log.info("client {remote}: bad compressed data ({error}); closing",
                     remote=self.client.remote_address, error=str(e))
            self._pending = []
            self.lose_connection()
            return
        if out:
            self._parse(out)
        self._continue_input()

    def _inflate_next(self) -> None:
        if not self._closed:
            self._inflate(b"")

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
                             remote=self.client.remote_address, max=self._max_pending)
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
        handlers = self._handlers
        fin_cmd, pub_cmd = self._RUN_HANDLERS
        batchable = self._BATCHABLE
        client = self.client
        auth_on = self._auth_on
        # Channels that commands in this read gave work are delivered once,
        # at the end of it: a pipeline of PUBs or FINs makes one delivery pass.
        batch = self.broker.deliveries
        pending = batch.pending
        outermost = pending is None
        if pending is None:
            batch.pending = pending = set()
        try:
            while pos < end:
                eol = data.find(b"\n", pos)
                if eol < 0:
                    if end - pos > MAX_LINE:
                        log.warn("client {remote} sent a line over {max} bytes; closing",
                                 remote=client.remote_address, max=MAX_LINE)
                        self.lose_connection()
                        return
                    self._keep(data[pos:], end - pos + 1)
                    break
                line_end = eol - 1 if eol > pos and data[eol - 1] == 13 else eol
                params = data[pos:line_end].split(b" ")
                handler = handlers.get(params[0])
                if handler is None:
                    if handlers is self._TLS_REQUIRED_HANDLERS:
                        _tls_required(self, params, data, eol + 1)
                    raise fatal("E_INVALID", f"invalid command {echo(params[0])}")
                if handler is fin_cmd and client.state == STATE_SUBSCRIBED:
                    # A run of well-formed FINs (a reader acks every message)
                    # is gathered and finished as one (Channel.finish_run);
                    # each id that fails gets _cmd_fin's error in its place.
                    # A malformed FIN ends the run and is read again below.
                    ids: list[bytes] = []
                    while len(params) == 2 and len(params[1]) == 16:
                        ids.append(params[1])
                        pos = plain_fins(data, eol + 1, end, ids)
                        eol = data.find(b"\n", pos)
                        if eol < 0 or data[pos:pos + 4] != b"FIN ":
                            break
                        line_end = eol - 1 if eol > pos and data[eol - 1] == 13 else eol
                        params = data[pos:line_end].split(b" ")
                    if ids:
                        self._finish_run(ids, pending)
                        continue
                elif handler is pub_cmd and client.state == STATE_INIT and not auth_on:
                    nxt = self._pub_run(data, pos, eol, params)
                    if nxt != pos:
                        pos = nxt
                        continue
                if self._pub_bodies and handler is not pub_cmd:
                    self._flush_pubs()
                if pending and handler not in batchable and self.channel in pending:
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
                if nxt == NEED_MORE:
                    self._keep(data[pos:], self._need - pos)
                    break
                if nxt == PAUSED:
                    # Everything after this point waits (for the auth server, a big MPUB).
                    resume = self._resume_at
                    if resume < 0:
                        resume = pos
                    else:
                        self._resume_at = -1
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
            try:
                self._fail(failure)
            finally:
                # The error's traceback holds this frame, which would hold
                # the error: a cycle the collector frees only much later.
                del failure
            return
        finally:
            if outermost:
                batch.pending = None
                for channel in pending:
                    channel.deliver()
        if self._auth.query_due:
            # Asked only now, with the input kept, so an answer that comes
            # at once (a cached or fake fetch) resumes a consistent state.
            self._ask_auth()
        leftover = self._upgrade_leftover
        if leftover is not None:
            self._upgrade_leftover = None
            if leftover:
                self._feed_upgraded(leftover)

    def _keep(self, rest: bytes, need: float) -> None:
        """Hold an incomplete command until `need` bytes of it have arrived."""
        self._pending = [rest]
        self._pending_len = len(rest)
        self._need = need

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

    def _read_body_size(self, data: bytes, start: int) -> int | None:
        """The 4-byte size at `start`, or None (with `_need` set) if not here yet."""
        if start + 4 > len(data):
            self._need = start + 4
            return None
        return _unpack_int32(data, start)[0]

    def _command_body(self, verb: str, data: bytes, start: int) -> tuple[bytes, int] | None:
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

    def _single_body(self, verb: str, data: bytes, start: int) -> tuple[bytes, int] | None:
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

    # -- upgrades: the steps the connection times --------------------------------

    def _start_compression(self) -> None:
        """UPGRADE_GAP after the IDENTIFY answer (or the TLS handshake): compression on, then the input kept for it."""
        if self._closed:
            return
        kept = self._upgrades.start_compression()
        if kept is None:
            return
        self._update_reading()
        if kept:
            self.dataReceived(kept)

    def handshakeCompleted(self) -> None:
        """IHandshakeListener: the TLS upgrade is done (Upgrades notes what /stats shows of it).

        A compression negotiated with TLS starts once the TLS layer has
        sent the OK it held for the handshake.
        """
        if self._upgrades.handshake_completed():
            self.clock.callLater(UPGRADE_GAP, self._start_compression)
            self._update_reading()

    def _handshake_timed_out(self) -> None:
        self._abort()

    def _feed_upgraded(self, data: bytes) -> None:
        """Bytes read past IDENTIFY, given to the innermost new layer (TLS, else the decoder)."""
        if self._closed:
            return
        layer = self._upgrades.handshake_layer
        if layer is not None:
            layer.dataReceived(data)
        else:
            self.dataReceived(data)

    # -- AUTH: asking the auth server ----------------------------------------------

    def _ask_auth(self) -> None:
        """Ask the auth server the due query without blocking; the commands that wait run with its answer."""
        # Parsing waits for the answer, and so does reading (nsqd's read loop
        # is blocked in the query): what the client streams meanwhile stays
        # in the kernel's buffers, not ours. tls_common_name is set by
        # handshakeCompleted, which runs before any byte read over TLS
        # reaches dataReceived.
        self._gate.auth_started()
        client = self.client
        d = self._auth.query(client.remote_ip, bool(client.tls), client.tls_common_name)
        d.addCallbacks(self._auth_answered, self._auth_failed)
        d.addErrback(lambda f: log.failure("AUTH answer handling failed", f))
        self._update_reading()  # unless answered already

    def _auth_answered(self, state: AuthState) -> None:
        self._gate.auth_done()
        if self._closed:
            return
        outcome = self._auth.answered(state)
        if outcome is REFUSED:
            self._fail(fatal("E_UNAUTHORIZED", "AUTH no authorizations found"))
            return
        if outcome is AUTHORIZED:
            self._output.write_frame(frame(FRAME_TYPE_RESPONSE, encode_json(self._auth.identity())))
        self._resume()  # reads on (or the connection closes)

    def _auth_failed(self, failure: Failure) -> None:
        self._gate.auth_done()
        if self._closed:
            return
        # The reason stays in the log: nsqd never tells untrusted clients
        # what went wrong with the auth server.
        log.warn("client {remote}: AUTH failed - {error}", remote=self.client.remote_address,
                 error=failure.getErrorMessage())
        self._fail(fatal("E_AUTH_FAILED", "AUTH failed"))

    # -- publishing ----------------------------------------------------------------

    def _publish(self, verb: str, topic_name: str, bodies: list[bytes], defer: float = 0.0,
                 replies: int = 1) -> None:
        broker = self.broker
        try:
            broker.topic(topic_name).publish(bodies, defer)
        except BackendError as e:
            broker.set_health(str(e))
            raise fatal(f"E_{verb}_FAILED", f"{verb} failed {e}") from None
        self.client.published(topic_name, len(bodies))
        self._answer_published(verb, replies)

    def _answer_published(self, verb: str, replies: int = 1) -> None:
        """OK `replies` publishes: now, or once the store has their messages durable."""
        store = self.broker.store
        assert store is not None  # connections are served only by an open broker
        if store.durable:
            if self._output.hold_ok(verb, replies):
                store.when_durable(self._released)
        else:
            self._output.write_frame(OK * replies)

    def _released(self, error: str | None) -> None:
        """The commit holding this connection's publishes is synced (or failed): answer them."""
        if self._output.release(error):
            self.lose_connection()

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
            name = valid_name(params[1])
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
        topic_name, self._pub_topic = self._pub_topic, ""
        self._publish("PUB", topic_name, bodies, replies=len(bodies))

    def _mpub_in_chunks(self, topic_name: str, data: bytes, pos: int, end: int, count: int,
                        size: int) -> int:
        """A big MPUB, checked and published over several turns (mqd.nsqd.batches); OK once done.

        The connection stops reading meanwhile and keeps what followed the
        MPUB in this read, so the commands after it run, and are answered,
        after it: its responses stay in command order and its messages in
        its order.
        """
        max_msg = self.broker.options.max_msg_size
        chunks = binary_chunks(data, pos, end, count, max_msg, exact=True)

        def bodies_of(chunk: tuple[int, int]) -> list[bytes]:
            return binary_bodies(data, end, chunk)

        def done(error: BatchError | BackendError | None) -> None:
            self._mpub_done(topic_name, count, size, max_msg, error)

        self._gate.publishing_started()
        self._update_reading()
        publish_in_chunks(self.clock, self.broker.topic(topic_name), chunks, bodies_of, done)
        self._resume_at = end
        return PAUSED

    def _mpub_done(self, topic_name: str, count: int, size: int, max_msg: int,
                   error: BatchError | BackendError | None) -> None:
        """A chunked MPUB is over: answer it as a one-go MPUB would be, then read on."""
        self._gate.publishing_done()
        if self._closed:
            # The messages were read whole and checked: they are published
            # even though nobody is left to tell, as nsqd would.
            return
        if isinstance(error, BatchError):
            self._fail(mpub_error(error, max_msg, size))
            return
        if error is not None:
            if not isinstance(error, TopicExiting):
                self.broker.set_health(str(error))
            self._fail(fatal("E_MPUB_FAILED", f"MPUB failed {error}"))
            return
        self.client.published(topic_name, count)
        self._answer_published("MPUB")
        self._resume()  # the input kept meanwhile, then reading again

    # -- delivery ------------------------------------------------------------------

    def _finish_run(self, ids: list[bytes], pending: set[Channel]) -> None:
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

    def _answer_error(self, err: ProtocolError, pending: set[Channel]) -> None:
        """A non-fatal error's frame, after the deliveries this connection's commands made so far."""
        if pending and self.channel in pending:
            self._flush_delivery(pending)
        self._output.write_frame(frame(FRAME_TYPE_ERROR, err.payload))

    def _flush_delivery(self, pending: set[Channel]) -> None:
        pending.discard(self.channel)
        self.channel.deliver()

    def _deliver_soon(self) -> None:
        """This connection's channel may deliver again (RDY, FIN, REQ freed a slot)."""
        if self.channel is not None:
            self.channel.deliver_soon()

    # -- commands ----------------------------------------------------------------
    # In the order nsqd's TCP protocol documentation lists them. Each takes
    # (params, data, body_start) and returns where the next command starts,
    # NEED_MORE once it has set self._need to the index it waits for, or
    # PAUSED when parsing must wait (see mqd.nsqd.protocol.params).

    def _cmd_identify(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        client = self.client
        if client.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot IDENTIFY in current state")
        got = self._command_body("IDENTIFY", data, start)
        if got is None:
            return NEED_MORE
        raw, end = got
        upgrades = self._upgrades
        settled = negotiate(
            self.broker.options, parse_request(raw),
            heartbeat_interval=client.heartbeat_interval,
            output_buffer_size=client.output_buffer_size,
            output_buffer_timeout=client.output_buffer_timeout,
            msg_timeout=client.msg_timeout,
            tls_available=upgrades.tls_available,
            auth_required=self._auth_on,
            http_port=self.broker.http_port,
            https_port=self.broker.https_port,
        )
        client.identified(settled)
        self._start_heartbeats()  # at the new interval
        if settled.refused is not None:
            raise settled.refused
        self._output.write_frame(frame(FRAME_TYPE_RESPONSE, settled.answer()))
        if not settled.upgrades:
            return end
        upgrades.upgrade(settled.tls_v1, settled.deflate, settled.snappy, self._handshake_timed_out)
        if settled.tls_v1:
            self._handlers = self._HANDLERS  # the TLS-required policy is satisfied
        if settled.snappy or settled.deflate:
            # Compression starts once what precedes it is on the wire: the
            # reactor hands a turn's writes to the socket in its I/O phase,
            # after the turn's timed calls, so a delay of UPGRADE_GAP has
            # them out first and leaves a client's read loop time to take
            # them alone. With TLS, after the handshake (handshakeCompleted).
            if not settled.tls_v1:
                self.clock.callLater(UPGRADE_GAP, self._start_compression)
            self._update_reading()
        # Whatever followed IDENTIFY in this read was sent for the new
        # layers (TLS records, compressed bytes): dataReceived hands it to
        # them once this pass is over, instead of parsing it as commands
        # (compressed bytes wait in the upgrades until the codec is on).
        self._upgrade_leftover = data[end:]
        return len(data)

    def _cmd_sub(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        client = self.client
        if client.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot SUB in current state")
        if client.heartbeat_interval <= 0:
            raise fatal("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(params) < 3:
            raise fatal("E_INVALID", "SUB insufficient number of parameters")
        topic_name = valid_name(params[1])
        if topic_name is None:
            raise fatal("E_BAD_TOPIC", f"SUB topic name {go_quote(params[1])} is not valid")
        channel_name = valid_name(params[2])
        if channel_name is None:
            raise fatal("E_BAD_CHANNEL", f"SUB channel name {go_quote(params[2])} is not valid")
        if self._auth_on and self._auth.check("SUB", topic_name, channel_name, self.clock.seconds()) is not None:
            return PAUSED
        channel = self.broker.topic(topic_name).channel(channel_name)
        try:
            channel.add_client(self)
        except ChannelError as e:
            raise fatal("E_SUB_FAILED", f"SUB failed {e}") from None
        client.subscribed()
        self.channel = channel
        self._output.write_frame(OK)
        return start

    def _cmd_pub(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        topic_name = publish_topic("PUB", params, 2)
        got = self._single_body("PUB", data, start)
        if got is None:
            return NEED_MORE
        if self._auth_on and self._auth.check("PUB", topic_name, "", self.clock.seconds()) is not None:
            return PAUSED
        body, end = got
        if self.client.state == STATE_INIT:
            # A pure publisher: consecutive PUBs to one topic in this read
            # are published together (see _flush_pubs).
            if self._pub_topic != topic_name:
                self._flush_pubs()
                self._pub_topic = topic_name
            self._pub_bodies.append(body)
        else:
            self._publish("PUB", topic_name, [body])
        return end

    def _cmd_mpub(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        topic_name = publish_topic("MPUB", params, 2, code_prefix="E_BAD_TOPIC ")
        if self._auth_on and self._auth.check("MPUB", topic_name, "", self.clock.seconds()) is not None:
            return PAUSED
        self.broker.topic(topic_name)  # nsqd creates the topic before reading the body
        size = self._read_body_size(data, start)
        if size is None:
            return NEED_MORE
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
            return NEED_MORE
        count = _unpack_int32(data, pos)[0]
        if count <= 0 or count > (opts.max_body_size - 4) // 5:
            raise fatal("E_BAD_BODY", f"MPUB invalid message count {count}")
        first = pos = pos + 4
        limit = mpub_limit(opts.max_body_size, count)
        walked, self._mpub_walk = self._mpub_walk, None
        done = 0
        if walked is not None:
            pos = start + walked[0]
            done = walked[1]
        max_msg = opts.max_msg_size
        bodies: list[bytes] | None = [] if walked is None and not is_big(count, size) else None
        try:
            pos, n = walk_binary(data, pos, avail, done, count - done, max_msg, bodies, -1, True)
        except BatchError as e:
            if is_big(count, avail - start - 4):
                # Refused over turns, as any big batch's bad message is.
                return self._mpub_in_chunks(topic_name, data, first, avail, count, size)
            raise mpub_error(e, max_msg, size) from None
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
            return NEED_MORE
        if pos - start - 4 > limit:
            raise fatal("E_BAD_BODY", f"MPUB body too big {pos - start - 4} > {limit}")
        if is_big(count, pos - start - 4):
            return self._mpub_in_chunks(topic_name, data, first, pos, count, size)
        if bodies is None:
            bodies = []
            walk_binary(data, first, pos, 0, count, max_msg, bodies)
        self._publish("MPUB", topic_name, bodies)
        return pos

    def _cmd_dpub(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        topic_name = publish_topic("DPUB", params, 3)
        timeout_ms = base10(params[2])
        if timeout_ms is None:
            raise fatal("E_INVALID", f"DPUB could not parse timeout {echo(params[2])}")
        # nsqd checks the Duration (which may overflow) and prints the uint64 milliseconds.
        defer_ns = ms_duration_ns(timeout_ms)
        max_ns = round(self.broker.options.max_defer_timeout * 1e9)
        if defer_ns < 0 or defer_ns > max_ns:
            raise fatal("E_INVALID", f"DPUB timeout {timeout_ms} out of range 0-{max_ns // 1_000_000}")
        got = self._single_body("DPUB", data, start)
        if got is None:
            return NEED_MORE
        if self._auth_on and self._auth.check("DPUB", topic_name, "", self.clock.seconds()) is not None:
            return PAUSED
        body, end = got
        self._publish("DPUB", topic_name, [body], defer_ns / 1e9)
        return end

    def _cmd_rdy(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        client = self.client
        state = client.state
        if state == STATE_CLOSING:
            return start
        if state != STATE_SUBSCRIBED:
            raise fatal("E_INVALID", "cannot RDY in current state")
        count = 1
        if len(params) > 1:
            parsed = base10(params[1])
            if parsed is None:
                raise fatal("E_INVALID", f"RDY could not parse count {echo(params[1])}")
            count = int64(parsed)  # nsqd's int64(b10): huge counts wrap, some negative
        max_rdy = self.broker.options.max_rdy_count
        if count > max_rdy or count < 0:
            raise fatal("E_INVALID", f"RDY count {count} out of range 0-{max_rdy}")
        client.set_ready(count)
        output = self._output
        if output.has_buffered and count <= client.in_flight_count:
            output.flush()  # no longer ready: nsqd flushes
        self._deliver_soon()
        return start

    def _cmd_fin(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        msg_id = params[1] if len(params) > 1 else b""
        if len(msg_id) != 16 or self.client.state != STATE_SUBSCRIBED:
            msg_id = self._message_id("FIN", params)
        try:
            self.channel.finish(self, msg_id)
        except ChannelError as e:
            raise nonfatal("E_FIN_FAILED", f"FIN {echo(msg_id)} failed {e}") from None
        self._deliver_soon()
        return start

    def _cmd_req(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        msg_id = self._message_id("REQ", params)
        timeout_ms = base10(params[2])
        if timeout_ms is None:
            raise fatal("E_INVALID", f"REQ could not parse timeout {echo(params[2])}")
        # As nsqd: the timeout as a Duration (which may overflow), clamped.
        timeout_ns = ms_duration_ns(timeout_ms)
        max_ns = round(self.broker.options.max_req_timeout * 1e9)
        delay_ns = min(max(timeout_ns, 0), max_ns)
        if delay_ns != timeout_ns:
            log.info("client {remote} REQ timeout {timeout}ns out of range 0-{max}ns; set to {delay}ns",
                     remote=self.client.remote_address, timeout=timeout_ns, max=max_ns, delay=delay_ns)
        try:
            self.channel.requeue(self, msg_id, delay_ns / 1e9)
        except ChannelError as e:
            raise nonfatal("E_REQ_FAILED", f"REQ {echo(msg_id)} failed {e}") from None
        self._deliver_soon()
        return start

    def _cmd_touch(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        msg_id = self._message_id("TOUCH", params)
        try:
            self.channel.touch(self, msg_id)
        except ChannelError as e:
            raise nonfatal("E_TOUCH_FAILED", f"TOUCH {echo(msg_id)} failed {e}") from None
        return start

    def _message_id(self, verb: str, params: Sequence[bytes]) -> bytes:
        state = self.client.state
        if state != STATE_SUBSCRIBED and state != STATE_CLOSING:
            raise fatal("E_INVALID", f"cannot {verb} in current state")
        if len(params) < (3 if verb == "REQ" else 2):
            raise fatal("E_INVALID", f"{verb} insufficient number of params")
        msg_id = params[1]
        if len(msg_id) != 16:
            raise fatal("E_INVALID", "invalid message ID")
        return msg_id

    def _cmd_cls(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        client = self.client
        if client.state != STATE_SUBSCRIBED:
            raise fatal("E_INVALID", "cannot CLS in current state")
        client.closing()
        self._output.write_frame(CLOSE_WAIT)
        return start

    def _cmd_nop(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        return start

    def _cmd_auth(self, params: Sequence[bytes], data: bytes, start: int) -> int:
        if self.client.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot AUTH in current state")
        if len(params) != 1:
            raise fatal("E_INVALID", "AUTH invalid number of parameters")
        got = self._command_body("AUTH", data, start)
        if got is None:
            return NEED_MORE
        secret, end = got
        auth = self._auth
        if auth.has_grants:
            raise fatal("E_INVALID", "AUTH already set")
        if not self._auth_on:
            raise fatal("E_AUTH_DISABLED", "AUTH disabled")
        auth.authenticate(secret.decode("utf-8", "replace"))
        self._resume_at = end
        return PAUSED

    # The commands, as nsqd's protocol_v2.go Exec dispatches them.
    _HANDLERS = {
        b"IDENTIFY": _cmd_identify,
        b"SUB": _cmd_sub,
        b"PUB": _cmd_pub,
        b"MPUB": _cmd_mpub,
        b"DPUB": _cmd_dpub,
        b"RDY": _cmd_rdy,
        b"FIN": _cmd_fin,
        b"REQ": _cmd_req,
        b"TOUCH": _cmd_touch,
        b"CLS": _cmd_cls,
        b"NOP": _cmd_nop,
        b"AUTH": _cmd_auth,
    }

    # The handler table of a connection that must upgrade to TLS first
    # (--tls-required): IDENTIFY only; swapped for _HANDLERS on upgrade, so
    # the policy costs nothing per command.
    _TLS_REQUIRED_HANDLERS = {
        verb: handler if verb == b"IDENTIFY" else _tls_required
        for verb, handler in _HANDLERS.items()
    }

    # The commands whose runs the parser takes in one pass (FIN, PUB).
    _RUN_HANDLERS = (_cmd_fin, _cmd_pub)

    # Commands whose follow-up delivery can wait for the end of the read: they
    # write nothing on success and only ever free in-flight slots.
    _BATCHABLE = frozenset((_cmd_nop, _cmd_fin, _cmd_req, _cmd_touch))


class V2Factory(Factory):
    """Builds a V2Protocol per connection, all sharing one broker and its TLS context."""

    noisy = False

    def __init__(self, broker: Broker, tls: ServerTLS | None = None) -> None:
        """`tls`: the TLS context factory IDENTIFY's tls_v1 starts (mqd.nsqd.tlsconfig.ServerTLS), None without TLS."""
        self.broker = broker
        self.tls = tls

    def buildProtocol(self, addr: IAddress | None) -> V2Protocol:
        proto = V2Protocol(self.broker, self.tls)
        proto.factory = self
        return proto
