"""A V2 connection's upgrades after IDENTIFY: TLS, then snappy or deflate compression.

nsqd's order: the IDENTIFY answer goes out plain, then TLS starts and its
OK goes out encrypted, then compression starts and its OK goes out through
every layer. Compression starts only once what precedes it is on the wire
(UPGRADE_GAP after the answer, after the TLS handshake when there is one),
and compressed input is inflated a bounded step per turn of the reactor.

`Upgrades` owns the TLS context the connection may start, the handshake
and its timer, the codec (pending, then on), the compressed input kept
until it starts, and the next inflate step. The protocol decides when
each step happens (it knows whether the connection is still open and
what the parser holds); the upgrades tell the client record what /stats
shows, the input gate what holds or frees reading, the output what
compresses its writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mqd.logs import get_logger
from mqd.nsqd.tls_names import iana_cipher_name, tls_version_name
from mqd.wire.compression import DeflateCodec, SnappyCodec
from mqd.wire.errors import fatal
from mqd.wire.framing import OK

if TYPE_CHECKING:
    from OpenSSL.SSL import Connection
    from twisted.internet.interfaces import IDelayedCall, IProtocol, IReactorTime

    from mqd.nsqd.protocol.client import ClientV2
    from mqd.nsqd.protocol.gate import InputGate
    from mqd.nsqd.protocol.output import Output
    from mqd.nsqd.tlsconfig import ServerTLS
    from mqd.wire.transport import IStreamTransport

__all__ = ["Upgrades", "INFLATE_STEP", "UPGRADE_GAP", "HANDSHAKE_TIMEOUT"]

# The most compressed input is inflated in one step before it is parsed;
# the rest waits for the next turn of the reactor, so a stream that inflates
# to gigabytes costs bounded memory and other connections are served between
# steps. 64 KiB is what Twisted reads from a socket at a time: a turn of a
# compressed connection costs what a turn of a plain one does.
INFLATE_STEP = 64 * 1024
# How long after the IDENTIFY answer the compressed stream starts. nsqd's
# gap is microseconds, and clients that switch their decoder at the end of
# the read holding the answer (asyncnsq 2 with snappy) then fail whenever
# they read late; 5 ms took asyncnsq 2.0.1 from 0 of 6 connections to 6 of 6
# here, at the cost of 5 ms once per compressed connection.
UPGRADE_GAP = 0.005
# nsqd gives a TLS handshake 5 s.
HANDSHAKE_TIMEOUT = 5.0

# The V2 protocol logs under one namespace, whichever module a line comes from.
log = get_logger("mqd.nsqd.protocol.v2")


class Upgrades:
    """TLS and compression of one V2 connection."""

    __slots__ = (
        "codec",
        "_clock",
        "_client",
        "_output",
        "_gate",
        "_tls_config",
        "_transport",
        "_tls_layer",
        "_handshaking",
        "_handshake_timer",
        "_codec_pending",
        "_codec_input",
        "_inflate_call",
    )

    def __init__(self, clock: IReactorTime, client: ClientV2, output: Output, gate: InputGate,
                 tls_config: ServerTLS | None) -> None:
        """The upgrades of the connection with record `client`, its output and its input gate.

        `tls_config` is the broker's TLS context factory (mqd.nsqd.tlsconfig.ServerTLS),
        None when the broker has no TLS.
        """
        # The codec once compression is on (read-only outside): the only
        # thing a read checks, None unless compression was negotiated.
        self.codec: SnappyCodec | DeflateCodec | None = None
        self._clock = clock
        self._client = client
        self._output = output
        self._gate = gate
        self._tls_config = tls_config
        # Set by attach() when the connection is made, before any IDENTIFY.
        self._transport: IStreamTransport = None  # type: ignore[assignment]
        self._tls_layer: IProtocol | None = None
        self._handshaking = False
        self._handshake_timer: IDelayedCall | None = None
        # Compression negotiated but not started yet (see upgrade), and the
        # input that came for it meanwhile, compressed already.
        self._codec_pending: SnappyCodec | DeflateCodec | None = None
        self._codec_input: list[bytes] = []
        self._inflate_call: IDelayedCall | None = None  # the next step of compressed input, when one is due

    def attach(self, transport: IStreamTransport) -> None:
        """The transport TLS starts on."""
        self._transport = transport

    # -- what the connection asks ------------------------------------------------

    @property
    def tls_available(self) -> bool:
        """The broker has TLS: IDENTIFY may ask for it."""
        return self._tls_config is not None

    @property
    def tls_required(self) -> bool:
        """The broker requires TLS on TCP connections (--tls-required): IDENTIFY only until it starts."""
        return self._tls_config is not None and self._tls_config.tcp_required

    @property
    def handshaking(self) -> bool:
        """TLS started and its handshake is not done."""
        return self._handshaking

    @property
    def handshake_layer(self) -> IProtocol | None:
        """The TLS layer while its handshake runs (bytes read past IDENTIFY go to it), else None."""
        return self._tls_layer if self._handshaking else None

    @property
    def compression_pending(self) -> bool:
        """Compression was negotiated and has not started."""
        return self._codec_pending is not None

    # -- IDENTIFY's upgrades --------------------------------------------------------

    def upgrade(self, tls_v1: bool, deflate: bool, snappy: bool,
                on_handshake_timeout: Callable[[], None]) -> None:
        """nsqd's upgrade order: (JSON already sent) TLS + OK, then compression negotiated.

        Each OK goes out through the layers enabled so far: the first one
        encrypted (queued by the TLS layer until the handshake is done),
        the second also compressed. nsqd flushes each of these frames in a
        write of its own, and clients rely on it: some read the plain
        frame and switch their decoder at that read's end, which fails if
        compressed bytes came in the same read. So compression only waits
        here: the connection starts it (start_compression) once what
        precedes it is on the wire, after the TLS handshake when there is
        one. `on_handshake_timeout()` runs if the handshake takes over
        HANDSHAKE_TIMEOUT.
        """
        output = self._output
        if tls_v1:
            if self._client.tls:
                raise fatal("E_IDENTIFY_FAILED", "IDENTIFY failed TLS already enabled")
            start_tls = getattr(self._transport, "startTLS", None)
            if start_tls is None or output.holding:
                raise fatal("E_IDENTIFY_FAILED", "IDENTIFY failed cannot start TLS on this connection")
            start_tls(self._tls_config)
            self._client.tls_started()
            self._handshaking = True
            self._gate.handshake_started()
            self._tls_layer = getattr(self._transport, "protocol", None)
            self._handshake_timer = self._clock.callLater(
                HANDSHAKE_TIMEOUT, self._handshake_timed_out, on_handshake_timeout)
            output.write_frame(OK)
        if snappy or deflate:
            if self.codec is not None:
                raise fatal("E_IDENTIFY_FAILED", "IDENTIFY failed compression already enabled")
            if output.holding:
                raise fatal("E_IDENTIFY_FAILED", "IDENTIFY failed cannot compress this connection")
            self._codec_pending = SnappyCodec() if snappy else DeflateCodec(self._client.deflate_level)
            self._gate.compression_negotiated()

    def keep_input(self, data: bytes) -> None:
        """Input read while compression waits to start: compressed already, decoded once it starts."""
        self._codec_input.append(data)

    def start_compression(self) -> bytes | None:
        """Put the negotiated codec on and send its OK; the input kept for it, or None if none was pending."""
        codec, self._codec_pending = self._codec_pending, None
        kept, self._codec_input = self._codec_input, []
        if codec is None:
            return None
        output = self._output
        output.compress_with(codec)
        self.codec = codec
        self._client.compressed(isinstance(codec, SnappyCodec))
        self._gate.compression_started(codec)
        output.write_frame(OK)
        return b"".join(kept)

    # -- TLS -------------------------------------------------------------------------

    def handshake_completed(self) -> bool:
        """The TLS handshake is done: note what /stats shows of it; True if a compression waits for it.

        The version and cipher suite are named as nsqd names them
        (`TLS1.2`, `TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256`; see tls_names).
        """
        self._cancel_handshake_timer()
        version = cipher_suite = common_name = ""
        try:
            # Once TLS started, the transport's handle is its OpenSSL connection.
            transport: Any = self._transport
            handle: Connection = transport.getHandle()
            version = tls_version_name(handle.get_protocol_version_name() or "TLS")
            cipher_suite = iana_cipher_name(handle.get_cipher_name() or "")
            cert = handle.get_peer_certificate()
            if cert is not None:
                common_name = cert.get_subject().CN or ""
        except Exception as e:  # noqa: BLE001 - details for stats only, never fatal
            log.debug("client {remote}: TLS details unavailable: {error}",
                      remote=self._client.remote_address, error=str(e))
            version = version or "TLS"
        self._client.tls_established(version, cipher_suite, common_name)
        self._handshaking = False
        self._gate.handshake_done()
        return self._codec_pending is not None

    def _handshake_timed_out(self, on_timeout: Callable[[], None]) -> None:
        self._handshake_timer = None
        log.info("client {remote}: TLS handshake timed out; closing", remote=self._client.remote_address)
        on_timeout()

    def _cancel_handshake_timer(self) -> None:
        timer, self._handshake_timer = self._handshake_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    # -- compressed input --------------------------------------------------------------

    @property
    def inflate_due(self) -> bool:
        """A step of the compressed input is scheduled: new input waits behind it."""
        return self._inflate_call is not None

    def keep_compressed(self, data: bytes) -> None:
        """Compressed input that waits (parsing is held, or a step is due)."""
        codec = self.codec
        assert codec is not None  # the protocol inflates only once compression is on
        codec.feed(data)

    def inflate(self, data: bytes) -> bytes:
        """One step of the compressed input (at most INFLATE_STEP bytes); CompressionError if corrupt."""
        codec = self.codec
        assert codec is not None  # the protocol inflates only once compression is on
        return codec.decompress(data, INFLATE_STEP)

    def inflate_later(self, on_due: Callable[[], None]) -> None:
        """If compressed input waits, `on_due()` on the next turn of the reactor (once)."""
        codec = self.codec
        if codec is not None and codec.has_more and self._inflate_call is None:
            self._inflate_call = self._clock.callLater(0, self._inflate_now, on_due)

    def _inflate_now(self, on_due: Callable[[], None]) -> None:
        self._inflate_call = None
        on_due()

    def lost(self) -> bool:
        """The connection is gone: stop the timers; True if it went during its TLS handshake."""
        if self._inflate_call is not None and self._inflate_call.active():
            self._inflate_call.cancel()
        self._inflate_call = None
        if self._handshaking:
            self._cancel_handshake_timer()
            return True
        return False
