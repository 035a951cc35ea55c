"""The broker side of nsqd's TCP protocol V2, one instance per connection.

The protocol holds per-connection state only (state, RDY, in-flight count,
negotiated features) and calls into topics and channels for everything
else. Parsing works on whole buffers: every complete command in a chunk is
handled in one pass, and work that a batch of commands shares (asking the
channel to deliver after many FINs) happens once at the end of the pass.

This module is what nsqd's protocol_v2.go is: the parser loop, the command
table and one method per command. The rest of a connection (nsqd's
client_v2.go) is split by concern into classes V2Protocol inherits, so
every lookup on the hot path stays a plain `self.x` on one instance:

- connection.py: the connection's state, its start and end (ConnectionState);
- output.py: frames, the message buffer, heartbeats, flow control;
- upgrades.py: TLS and compression after IDENTIFY;
- authorize.py: AUTH and the checks of SUB and the publishing commands;
- publish.py: publishing and its answer, big MPUBs over several turns;
- fastpath.py: runs of plain FINs and of a publisher's PUBs in one pass;
- identify.py: IDENTIFY's negotiation, a pure function;
- params.py: command parameters read as nsqd reads them.
"""

from __future__ import annotations

from twisted.internet.interfaces import IHalfCloseableProtocol, IHandshakeListener, IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.protocols.policies import TimeoutMixin
from zope.interface import implementer

from mqd.logs import get_logger
from mqd.nsqd.batches import BatchError, is_big, walk_binary
from mqd.nsqd.channel import ChannelError
from mqd.nsqd.interfaces import IConsumer
from mqd.nsqd.protocol.authorize import AuthorizeMixin
from mqd.nsqd.protocol.connection import (
    STATE_CLOSING,
    STATE_INIT,
    STATE_SUBSCRIBED,
    ConnectionState,
)
from mqd.nsqd.protocol.fastpath import FastPathMixin, plain_fins
from mqd.nsqd.protocol.identify import negotiate, parse_request
from mqd.nsqd.protocol.output import OutputMixin
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
from mqd.nsqd.protocol.publish import PublishMixin, mpub_error, mpub_limit
from mqd.nsqd.protocol.upgrades import UpgradesMixin
from mqd.wire.errors import ProtocolError, fatal, go_quote, nonfatal
from mqd.wire.framing import (
    CLOSE_WAIT,
    FRAME_TYPE_RESPONSE,
    INT32,
    MAGIC_V2,
    OK,
    frame,
)

__all__ = ["V2Protocol", "V2Factory", "STATE_INIT", "STATE_SUBSCRIBED", "STATE_CLOSING", "MAX_LINE"]


_unpack_int32 = INT32.unpack_from
_FOREVER = float("inf")

log = get_logger(__name__)


@implementer(IConsumer, IHalfCloseableProtocol, IHandshakeListener, IPushProducer)
class V2Protocol(FastPathMixin, PublishMixin, AuthorizeMixin, UpgradesMixin, OutputMixin,
                 ConnectionState, Protocol, TimeoutMixin):
    """One client connection speaking V2."""

    def __init__(self, broker) -> None:
        super().__init__(broker)
        if self._tls_config is not None and self._tls_config.tcp_required:
            self._HANDLERS = _TLS_REQUIRED_HANDLERS

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
                    raise fatal("E_INVALID", f"invalid command {echo(params[0])}")
                if handler is _FIN and self.state == STATE_SUBSCRIBED:
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
                if nxt == NEED_MORE:
                    self._keep(data[pos:], self._need - pos)
                    break
                if nxt == PAUSED:
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

    def _keep(self, rest: bytes, need: int) -> None:
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

    # -- commands ----------------------------------------------------------------
    # In the order nsqd's TCP protocol documentation lists them. Each takes
    # (params, data, body_start) and returns where the next command starts,
    # NEED_MORE once it has set self._need to the index it waits for, or
    # PAUSED when parsing must wait (see mqd.nsqd.protocol.params).

    def _cmd_identify(self, params, data, start):
        if self.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot IDENTIFY in current state")
        got = self._command_body("IDENTIFY", data, start)
        if got is None:
            return NEED_MORE
        raw, end = got
        settled = negotiate(
            self.broker.options, parse_request(raw),
            heartbeat_interval=self.heartbeat_interval,
            output_buffer_size=self.output_buffer_size,
            output_buffer_timeout=self.output_buffer_timeout,
            msg_timeout=self.msg_timeout,
            tls_available=self._tls_config is not None,
            auth_required=self._auth_on,
        )
        self._identify(settled)
        if settled.refused is not None:
            raise settled.refused
        self._write_frame(frame(FRAME_TYPE_RESPONSE, settled.answer()))
        if not settled.upgrades:
            return end
        self._upgrade(settled.tls_v1, settled.deflate, settled.snappy)
        # Whatever followed IDENTIFY in this read was sent for the new
        # layers (TLS records, compressed bytes): dataReceived hands it to
        # them once this pass is over, instead of parsing it as commands
        # (compressed bytes wait in _codec_input until the codec is on).
        self._upgrade_leftover = data[end:]
        return len(data)

    def _cmd_sub(self, params, data, start):
        if self.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot SUB in current state")
        if self.heartbeat_interval <= 0:
            raise fatal("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(params) < 3:
            raise fatal("E_INVALID", "SUB insufficient number of parameters")
        topic_name = valid_name(params[1])
        if topic_name is None:
            raise fatal("E_BAD_TOPIC", f"SUB topic name {go_quote(params[1])} is not valid")
        channel_name = valid_name(params[2])
        if channel_name is None:
            raise fatal("E_BAD_CHANNEL", f"SUB channel name {go_quote(params[2])} is not valid")
        if self._auth_on and self._check_auth("SUB", topic_name, channel_name) is not None:
            return PAUSED
        channel = self.broker.topic(topic_name).channel(channel_name)
        try:
            channel.add_client(self)
        except ChannelError as e:
            raise fatal("E_SUB_FAILED", f"SUB failed {e}") from None
        self.state = STATE_SUBSCRIBED
        self.channel = channel
        self._write_frame(OK)
        return start

    def _cmd_pub(self, params, data, start):
        topic_name = self._publish_topic("PUB", params, 2)
        got = self._single_body("PUB", data, start)
        if got is None:
            return NEED_MORE
        if self._auth_on and self._check_auth("PUB", topic_name, "") is not None:
            return PAUSED
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

    def _cmd_mpub(self, params, data, start):
        topic_name = self._publish_topic("MPUB", params, 2, code_prefix="E_BAD_TOPIC ")
        if self._auth_on and self._check_auth("MPUB", topic_name, "") is not None:
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
        bodies = [] if walked is None and not is_big(count, size) else None
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

    def _cmd_dpub(self, params, data, start):
        topic_name = self._publish_topic("DPUB", params, 3)
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
        if self._auth_on and self._check_auth("DPUB", topic_name, "") is not None:
            return PAUSED
        body, end = got
        self._publish("DPUB", topic_name, [body], defer_ns / 1e9)
        return end

    def _cmd_rdy(self, params, data, start):
        state = self.state
        if state == STATE_CLOSING:
            return start
        if state != STATE_SUBSCRIBED:
            raise fatal("E_INVALID", "cannot RDY in current state")
        count = 1
        if len(params) > 1:
            count = base10(params[1])
            if count is None:
                raise fatal("E_INVALID", f"RDY could not parse count {echo(params[1])}")
            count = int64(count)  # nsqd's int64(b10): huge counts wrap, some negative
        max_rdy = self.broker.options.max_rdy_count
        if count > max_rdy or count < 0:
            raise fatal("E_INVALID", f"RDY count {count} out of range 0-{max_rdy}")
        self.ready_count = count
        if self._obuf and count <= self.in_flight_count:
            self.flush_output()  # no longer ready: nsqd flushes
        self._deliver_soon()
        return start

    def _cmd_fin(self, params, data, start):
        msg_id = params[1] if len(params) > 1 else b""
        if len(msg_id) != 16 or self.state != STATE_SUBSCRIBED:
            msg_id = self._message_id("FIN", params)
        try:
            self.channel.finish(self, msg_id)
        except ChannelError as e:
            raise nonfatal("E_FIN_FAILED", f"FIN {echo(msg_id)} failed {e}") from None
        self._deliver_soon()
        return start

    def _cmd_req(self, params, data, start):
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
                     remote=self.remote_address, timeout=timeout_ns, max=max_ns, delay=delay_ns)
        try:
            self.channel.requeue(self, msg_id, delay_ns / 1e9)
        except ChannelError as e:
            raise nonfatal("E_REQ_FAILED", f"REQ {echo(msg_id)} failed {e}") from None
        self._deliver_soon()
        return start

    def _cmd_touch(self, params, data, start):
        msg_id = self._message_id("TOUCH", params)
        try:
            self.channel.touch(self, msg_id)
        except ChannelError as e:
            raise nonfatal("E_TOUCH_FAILED", f"TOUCH {echo(msg_id)} failed {e}") from None
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

    def _cmd_cls(self, params, data, start):
        if self.state != STATE_SUBSCRIBED:
            raise fatal("E_INVALID", "cannot CLS in current state")
        self.ready_count = 0
        self.state = STATE_CLOSING
        self._write_frame(CLOSE_WAIT)
        return start

    def _cmd_nop(self, params, data, start):
        return start

    def _cmd_auth(self, params, data, start):
        if self.state != STATE_INIT:
            raise fatal("E_INVALID", "cannot AUTH in current state")
        if len(params) != 1:
            raise fatal("E_INVALID", "AUTH invalid number of parameters")
        got = self._command_body("AUTH", data, start)
        if got is None:
            return NEED_MORE
        secret, end = got
        if self.auth_state is not None and self.auth_state.grants:
            raise fatal("E_INVALID", "AUTH already set")
        if not self._auth_on:
            raise fatal("E_AUTH_DISABLED", "AUTH disabled")
        self._auth_secret = secret.decode("utf-8", "replace")
        self._resume_at = end
        self._after_auth = self._authed
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


_PUB = V2Protocol._cmd_pub
_FIN = V2Protocol._cmd_fin


def _tls_required(self, params, data, start):
    raise fatal("E_INVALID", f"cannot {echo(params[0])} in current state (TLS required)")


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


class V2Factory(Factory):
    """Builds a V2Protocol per connection, all sharing one broker."""

    noisy = False

    def __init__(self, broker) -> None:
        self.broker = broker

    def buildProtocol(self, addr) -> V2Protocol:
        proto = V2Protocol(self.broker)
        proto.factory = self
        return proto
