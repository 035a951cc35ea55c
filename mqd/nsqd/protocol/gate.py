"""A V2 connection's input gate: every reason its socket is not read, and the decision.

Reading stops while a big MPUB is published over several turns, while the
auth server is asked, while compressed input waits to be inflated or
compression was negotiated and has not started, and while the transport's
output is backed up (the connection is its transport's streaming
producer). A TLS handshake in progress is the exception: the TLS layer
holds the connection's output until the handshake is done, and the
handshake takes reading. Each reason is a flag of the gate, set and
cleared by its own methods, so one reason ending never resumes reading
that another still holds; `update` decides, and pauses or resumes the
transport.

After a half-close the gate also says when everything the client sent
is handled, so the connection can close.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mqd.wire.compression import DeflateCodec, SnappyCodec

if TYPE_CHECKING:
    from mqd.wire.transport import IStreamTransport

__all__ = ["InputGate"]


class InputGate:
    """The reasons a V2 connection stops reading, and whether it reads."""

    __slots__ = (
        "reading_paused",
        "output_blocked",
        "_transport",
        "_publishing",
        "_auth_waiting",
        "_codec",
        "_codec_pending",
        "_handshaking",
        "_input_ended",
    )

    def __init__(self) -> None:
        # Whether the transport was told to stop reading (read-only outside).
        self.reading_paused = False
        # The transport's output is over its bound (pauseProducing); read-only outside.
        self.output_blocked = False
        # Set by attach() when the connection is made, before any update().
        self._transport: IStreamTransport = None  # type: ignore[assignment]
        self._publishing = False
        self._auth_waiting = False
        self._codec: SnappyCodec | DeflateCodec | None = None  # the started codec, whose has_more is a reason
        self._codec_pending = False
        self._handshaking = False
        self._input_ended = False

    def attach(self, transport: IStreamTransport) -> None:
        """The transport whose reading this gate pauses and resumes."""
        self._transport = transport

    # -- the reasons -------------------------------------------------------------
    # Setting one decides nothing: the connection calls update() once it has
    # done what must happen first (parse what was kept, write an answer).

    def publishing_started(self) -> None:
        """A big MPUB is published over several turns: its answer comes first."""
        self._publishing = True

    def publishing_done(self) -> None:
        self._publishing = False

    def auth_started(self) -> None:
        """The auth server is asked: what the client streams meanwhile stays in the kernel's buffers."""
        self._auth_waiting = True

    def auth_done(self) -> None:
        self._auth_waiting = False

    def output_paused(self) -> bool:
        """The transport's output went over its bound; False if it already was."""
        if self.output_blocked:
            return False
        self.output_blocked = True
        return True

    def output_resumed(self) -> bool:
        """The transport's output drained; False if it was not blocked."""
        if not self.output_blocked:
            return False
        self.output_blocked = False
        return True

    def compression_negotiated(self) -> None:
        """Compression was negotiated and starts later: its input waits compressed."""
        self._codec_pending = True

    def compression_started(self, codec: SnappyCodec | DeflateCodec) -> None:
        """The codec is on: input it holds (has_more) waits for its next inflate step."""
        self._codec_pending = False
        self._codec = codec

    def handshake_started(self) -> None:
        self._handshaking = True

    def handshake_done(self) -> None:
        self._handshaking = False

    def input_ended(self) -> None:
        """The client half-closed: nothing more will come."""
        self._input_ended = True

    @property
    def holds_parsing(self) -> bool:
        """Input must not be parsed now: output backed up, an auth server asked, a big MPUB publishing."""
        return self.output_blocked or self._auth_waiting or self._publishing

    # -- the decision ------------------------------------------------------------

    def update(self) -> bool:
        """Pause or resume reading as the reasons say; True once a half-closed input is all handled.

        Output backed up during a TLS handshake is the TLS layer holding an
        OK until the handshake is done, which takes reading: that does not
        stop it, nor does a compression waiting for that handshake. The
        caller closes the connection when this returns True, and does not
        call it on a closed connection.
        """
        codec = self._codec
        holding = (self._publishing or self._auth_waiting
                   or (codec is not None and codec.has_more))
        if self._input_ended and not (holding or self._codec_pending):
            return True
        handshaking = self._handshaking
        paused = (holding
                  or (self._codec_pending and not handshaking)
                  or (self.output_blocked and not handshaking))
        if paused != self.reading_paused:
            self.reading_paused = paused
            if paused:
                self._transport.pauseProducing()
            else:
                self._transport.resumeProducing()
        return False
