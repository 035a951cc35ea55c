"""A V2 connection's upgrades after IDENTIFY: TLS, then snappy or deflate compression.

nsqd's order: the IDENTIFY answer goes out plain, then TLS starts and its
OK goes out encrypted, then compression starts and its OK goes out through
every layer. Compression starts only once what precedes it is on the wire
(UPGRADE_GAP after the answer, after the TLS handshake when there is one),
and compressed input is inflated a bounded step per turn of the reactor.

A mixin of V2Protocol: it uses the connection's state set up there.
"""

from __future__ import annotations

from mqd.logs import get_logger
from mqd.nsqd.tls_names import iana_cipher_name, tls_version_name
from mqd.wire.compression import (
    CompressedTransport,
    CompressionError,
    DeflateCodec,
    SnappyCodec,
)
from mqd.wire.errors import fatal
from mqd.wire.framing import OK

__all__ = ["UpgradesMixin", "INFLATE_STEP", "UPGRADE_GAP"]

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

# The V2 protocol logs under one namespace, whichever module a line comes from.
log = get_logger("mqd.nsqd.protocol.v2")


class UpgradesMixin:
    """TLS and compression switch-over, and compressed input, for V2Protocol."""

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

        The version and cipher suite are named as nsqd names them
        (`TLS1.2`, `TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256`; see tls_names).

        A compression negotiated with TLS starts once the TLS layer has
        sent the OK it held for the handshake (see _upgrade).
        """
        self._cancel_handshake_timer()
        try:
            handle = self.transport.getHandle()
            self.tls_version = tls_version_name(handle.get_protocol_version_name() or "TLS")
            self.tls_cipher_suite = iana_cipher_name(handle.get_cipher_name() or "")
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
