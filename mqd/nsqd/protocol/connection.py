"""A V2 connection's state, from connect to close: what nsqd's clientV2 holds.

Everything a connection keeps is set up here, in one place, and read by
V2Protocol and its mixins as plain attributes: the state, RDY and counts
/stats shows, the settings IDENTIFY negotiates, and the bookkeeping of the
parser, the output, the upgrades and AUTH. Also what a channel asks of a
subscribed client (ready()), and the connection's start and end.
"""

from __future__ import annotations

from collections import deque

from twisted.internet.task import LoopingCall

from mqd.logs import get_logger
from mqd.nsqd.protocol.identify import Negotiated
from mqd.nsqd.protocol.params import MAX_LINE
from mqd.nsqd.protocol.publish import mpub_limit
from mqd.nsqd.protocol.truncated import cut_short
from mqd.peers import peer_host, remote_address

__all__ = ["ConnectionState", "STATE_INIT", "STATE_SUBSCRIBED", "STATE_CLOSING"]

# nsqd's numeric client states, as /stats reports them.
STATE_INIT = 0
STATE_SUBSCRIBED = 3
STATE_CLOSING = 4

# nsqd's fixed client timeout (not a flag): heartbeats default to half of it.
CLIENT_TIMEOUT = 60.0
DEFAULT_OUTPUT_BUFFER_SIZE = 16 * 1024

# The V2 protocol logs under one namespace, whichever module a line comes from.
log = get_logger("mqd.nsqd.protocol.v2")


class ConnectionState:
    """A V2 connection's state and its start and end; the base of V2Protocol."""

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
        # Output buffer of message frames (nsqd's bufio.Writer, see send_messages).
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
        self._codec = None
        self._inflate_call = None  # the next step of compressed input, when one is due
        # Flow control (see _update_reading): the transport's write buffer is
        # over its bound; an auth server is being asked; this protocol is the
        # transport's registered producer (until the connection closes).
        self._output_blocked = False
        self._auth_waiting = False
        self._producing = False
        # The client half-closed (readConnectionLost): close once what it
        # sent is answered.
        self._input_ended = False
        # Input a paused parse may keep: the biggest command (line, size, body);
        # an MPUB's body is bounded by mpub_limit, not by its declared size.
        max_mpub = mpub_limit(options.max_body_size, (options.max_body_size - 4) // 5)
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
        host = peer_host(peer)
        self.remote_address = remote_address(peer)
        if hasattr(peer, "port"):
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

    def readConnectionLost(self) -> None:
        """IHalfCloseableProtocol: the client sent its last byte (`nc -N`, a shutdown(SHUT_WR)).

        nsqd answers every command it read before it closes, so a script
        that writes its PUBs and half-closes still reads their OKs. Twisted
        would otherwise drop the connection, and the answers not written
        yet with it. What the client sent is parsed by now unless something
        holds the input (see _update_reading, which closes once it is let go).
        """
        self._input_ended = True
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
        self.flush_output()
        self._pending = []
        if self._held is None:
            self.lose_connection()
        else:
            self._closed = True
            self._close_after_release = True

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

    # -- IConsumer ---------------------------------------------------------------

    def ready(self) -> int:
        if self.state != STATE_SUBSCRIBED or self._closed or self._output_blocked:
            # A connection failed or timed out is not fed while it closes;
            # one whose output is backed up (a client not reading) holds at
            # most what it was sent until then.
            return 0
        return self.ready_count - self.in_flight_count

    # -- IDENTIFY ------------------------------------------------------------------

    def _identify(self, settled: Negotiated) -> None:
        """Take the settings IDENTIFY negotiated; heartbeats restart at the new interval."""
        self.client_id = settled.client_id
        self.hostname = settled.hostname
        self.user_agent = settled.user_agent
        self.topology_region = settled.topology_region
        self.topology_zone = settled.topology_zone
        self.heartbeat_interval = settled.heartbeat_interval
        self.output_buffer_size = settled.output_buffer_size
        self.output_buffer_timeout = settled.output_buffer_timeout
        self.sample_rate = settled.sample_rate
        self.msg_timeout = settled.msg_timeout
        self._identified = True
        self._start_heartbeats()
        if settled.deflate_level is not None:
            self.deflate_level = settled.deflate_level
