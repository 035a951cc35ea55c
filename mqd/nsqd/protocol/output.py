"""A V2 connection's output: frames, the message buffer, heartbeats, the write deadline.

What nsqd's client_v2.go does for a connection's writing side. Message
frames wait in an output buffer (nsqd's bufio.Writer) that is flushed when
full, when the client stops being ready, before any other frame, or after
output_buffer_timeout. Responses stay in command order, also behind a
durable publish whose OK waits for its commit. Frames the transport cannot
take while it is backed up wait here, known to be unsent, and a write
deadline closes a client that takes nothing for a heartbeat interval.

`Output` owns all of that. It reads the client record's settings and
counts (buffer size and timeout, RDY and in flight, heartbeat interval)
and the input gate's `output_blocked`; it calls nothing of the protocol
but the write deadline's callback.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from twisted.internet.task import LoopingCall

from mqd.message import FRAME_HEAD
from mqd.wire.compression import CompressedTransport
from mqd.wire.errors import fatal
from mqd.wire.framing import FRAME_TYPE_ERROR, HEARTBEAT, OK, frame

if TYPE_CHECKING:
    from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime

    from mqd.message import Message
    from mqd.nsqd.protocol.client import ClientV2
    from mqd.nsqd.protocol.gate import InputGate
    from mqd.wire.compression import DeflateCodec, SnappyCodec
    from mqd.wire.transport import IStreamTransport

__all__ = ["Output", "WRITE_STEP"]

# Frames held while the transport is backed up are handed to it this much at
# a time (Twisted's TCP transport pauses its producer past 64 KiB unsent):
# its buffer holds at most about two steps, the rest waits here where it is
# known to be unsent, and the write deadline runs per handful of steps, as
# nsqd's does per write.
WRITE_STEP = 64 * 1024

_MSG_HEADER_PACK = FRAME_HEAD.pack
_MSG_OVERHEAD = FRAME_HEAD.size - 4
_MSG_FRAME = FRAME_HEAD.size


class Output:
    """A V2 connection's writing side."""

    __slots__ = (
        "_clock",
        "_client",
        "_gate",
        "_transport",
        "_producing",
        "_closed",
        "_obuf",
        "_obuf_len",
        "_flush_call",
        "_unsent",
        "_write_deadline",
        "_on_write_timeout",
        "_held",
        "_close_after_release",
        "_heartbeat",
    )

    def __init__(self, clock: IReactorTime, client: ClientV2, gate: InputGate,
                 on_write_timeout: Callable[[], None]) -> None:
        """The output of the connection whose record is `client` and input gate `gate`.

        `on_write_timeout()` runs when the write deadline passes (the
        connection decides: wait for a TLS handshake, or close).
        """
        self._clock = clock
        self._client = client
        self._gate = gate
        # Set by attach() when the connection is made, before any write.
        self._transport: IStreamTransport = None  # type: ignore[assignment]
        # Registered as the transport's streaming producer (until the connection closes).
        self._producing = False
        self._closed = False
        # Output buffer of message frames (nsqd's bufio.Writer, see send_messages).
        self._obuf: list[bytes] = []
        self._obuf_len = 0
        self._flush_call: IDelayedCall | None = None
        # Frames flushed while the transport was backed up, not handed to it
        # yet (see _drain), and nsqd's write deadline: armed while a write
        # waits on a backed-up transport, or while a close waits to flush.
        self._unsent: deque[bytes] = deque()
        self._write_deadline: IDelayedCall | None = None
        self._on_write_timeout: Callable[[], None] | None = on_write_timeout
        # Frames waiting behind a durable publish's OK, and (verb, count) entries
        # for the publishes they wait for; None when nothing waits.
        self._held: list[bytes | tuple[str, int]] | None = None
        self._close_after_release = False
        self._heartbeat: LoopingCall | None = None

    def attach(self, transport: IStreamTransport, producer: IPushProducer) -> None:
        """Write to `transport`, with `producer` (the connection) its streaming producer.

        The transport pauses the producer while its unsent output is over
        its bufferSize and resumes it once that is all handed to the
        kernel. The TLS layer, once started, takes the registration over
        and passes the calls through.
        """
        self._transport = transport
        transport.registerProducer(producer, True)
        self._producing = True

    def compress_with(self, codec: SnappyCodec | DeflateCodec) -> None:
        """Every write from now on goes through `codec` (compression is on)."""
        # The wrapper passes everything but the writes through to the transport.
        self._transport = cast("IStreamTransport", CompressedTransport(self._transport, codec))

    # -- heartbeats ----------------------------------------------------------------

    def start_heartbeats(self, interval: float) -> None:
        """A heartbeat frame every `interval` seconds (none if it is not positive)."""
        self.stop_heartbeats()
        if interval > 0:
            self._heartbeat = LoopingCall(self.send_heartbeat)
            self._heartbeat.clock = self._clock
            self._heartbeat.start(interval, now=False)

    def stop_heartbeats(self) -> None:
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()
        self._heartbeat = None

    def send_heartbeat(self) -> None:
        self.write_frame(HEARTBEAT)

    def heartbeat_due(self) -> bool:
        """The next heartbeat is due about now (within a hundredth of its interval)."""
        heartbeat = self._heartbeat
        if heartbeat is None or heartbeat.call is None:
            return False
        return heartbeat.call.getTime() - self._clock.seconds() <= (heartbeat.interval or 0) / 100

    # -- what the connection asks ------------------------------------------------

    @property
    def has_unsent(self) -> bool:
        """Frames wait here for the transport to drain."""
        return bool(self._unsent)

    @property
    def has_buffered(self) -> bool:
        """Message frames wait in the output buffer."""
        return bool(self._obuf)

    @property
    def holding(self) -> bool:
        """Frames wait behind a durable publish's OK."""
        return self._held is not None

    def pending_bytes(self) -> int:
        """Bytes of frames this output holds: buffered messages and unsent frames."""
        return self._obuf_len + sum(map(len, self._unsent))

    # -- the write deadline ------------------------------------------------------------

    def arm_write_deadline(self) -> None:
        """nsqd's SetWriteDeadline(now + heartbeat interval) before each write (none if heartbeats are off).

        Armed when a write finds the transport backed up, cancelled when it
        drains: one timer per connection, nothing per message. A client that
        takes each step of its output within the interval (a slow reader)
        keeps its connection; one that takes nothing for that long is closed.
        None once the connection is gone: there is nothing left to close.
        """
        interval = self._client.heartbeat_interval
        if self._write_deadline is None and interval > 0 and self._on_write_timeout is not None:
            self._write_deadline = self._clock.callLater(interval, self._write_deadline_passed)

    def _cancel_write_deadline(self) -> None:
        deadline, self._write_deadline = self._write_deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _write_deadline_passed(self) -> None:
        self._write_deadline = None
        on_timeout = self._on_write_timeout
        assert on_timeout is not None  # lost() cancels the deadline before it lets go of this
        on_timeout()

    def drained(self) -> None:
        """The transport took its output: the deadline is off, and what waits here is handed on."""
        self._cancel_write_deadline()
        if self._unsent:
            self._drain()

    # -- closing -------------------------------------------------------------------

    def close(self) -> None:
        """Close once the output is written.

        The producer is unregistered first: Twisted keeps a connection whose
        producer is registered open (TLS never sends its close, a paused TCP
        transport resumes instead of closing), so `transport.loseConnection()`
        alone is not enough.
        """
        self._closed = True
        transport = self._transport
        if self._producing:
            self._producing = False
            transport.unregisterProducer()
        if self._unsent:
            transport.writeSequence(self._unsent)
            self._unsent.clear()
        # The last write has its deadline too: a client that does not read
        # must not keep a closing connection, and its output, forever.
        self.arm_write_deadline()
        transport.loseConnection()

    def close_after_release(self) -> None:
        """Close once the held publishes are answered (see release)."""
        self._closed = True
        self._close_after_release = True

    def abort(self) -> None:
        """Drop the connection now, and the output waiting for it."""
        self._closed = True
        self._unsent.clear()
        self._transport.abortConnection()

    def lost(self) -> None:
        """The connection is gone: drop what waits, stop every timer."""
        self._closed = True
        self._producing = False  # the transport drops its producer itself
        self.stop_heartbeats()
        self._obuf = []
        self._obuf_len = 0
        self._unsent.clear()
        self._cancel_write_deadline()
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        # Its callback is the connection's: let go of it (no reference cycle
        # outlives the connection).
        self._on_write_timeout = None

    # -- frames --------------------------------------------------------------------

    def write_frame(self, data: bytes) -> None:
        """Write a response or error frame, behind any publish still waiting for its commit.

        Responses must come back in command order (go-nsq pairs them with
        its publishes), so while a durable publish waits for its OK every
        later frame of the connection waits behind it. Buffered message
        frames go out first, as nsqd flushes before any other frame.
        """
        if self._obuf:
            self.flush()
        if self._held is not None:
            self._held.append(data)
        elif self._unsent:
            self._unsent.append(data)
        else:
            self._transport.write(data)

    def hold_ok(self, verb: str, replies: int = 1) -> bool:
        """Hold the OK of `replies` publishes (`verb`: PUB, MPUB, DPUB) until release; True if nothing was held yet.

        Held as one (verb, count) entry, not an entry per publish: a
        pipelining publisher's read holds many, answered together. When
        this returns True the caller has the store call `release` once the
        commit holding them is synced.
        """
        held = self._held
        if held is None:
            self._held = held = []
            first = True
        else:
            first = False
        held.append((verb, replies))
        return first

    def release(self, error: str | None) -> bool:
        """The commit holding the held publishes is synced (or failed); True if the connection must close now.

        Synced: each held publish gets its OK, in order with the frames
        held behind them, in one write. Failed: the first held publish gets
        the error, and the connection closes after it (as nsqd's does).
        """
        held, self._held = self._held or [], None
        if self._obuf:
            self.flush()
        out: list[bytes] = []
        failed = False
        for item in held:
            if item.__class__ is tuple:
                verb, count = item
                if error is None:
                    out.append(OK * count)
                    continue
                out.append(frame(FRAME_TYPE_ERROR, fatal(f"E_{verb}_FAILED", f"{verb} failed {error}").payload))
                failed = True
                break
            out.append(item)  # type: ignore[arg-type]  # not a (verb, count) entry: a frame
        if out:
            data = b"".join(out)
            if self._unsent:
                self._unsent.append(data)
            else:
                self._transport.write(data)
        return failed or self._close_after_release

    # -- message frames --------------------------------------------------------------

    def send_messages(self, messages: list[Message]) -> None:
        """Buffer the message frames; write them once the buffer is full or the client is not ready.

        nsqd's output buffer (a bufio.Writer per client): frames wait until
        the buffer reaches output_buffer_size, the client stops being ready
        (its RDY window is used up, so nothing more can come to join them),
        a non-message frame is written, or output_buffer_timeout passes. A
        consumer with a large RDY thus gets few, large writes; a low-rate
        stream waits at most output_buffer_timeout. One lazily armed timer
        per connection, nothing per message.
        """
        out = self._obuf
        append = out.append
        pack = _MSG_HEADER_PACK
        size = self._obuf_len + _MSG_FRAME * len(messages)
        for msg in messages:
            data = msg.data
            append(pack(len(data) + _MSG_OVERHEAD, 2, msg.timestamp, msg.attempts))
            append(data)
            size += len(data)
        self._obuf_len = size
        client = self._client
        if size >= client.output_buffer_size or client.in_flight_count >= client.ready_count:
            self.flush()
            return
        if self._flush_call is None and client.output_buffer_timeout > 0:
            self._flush_call = self._clock.callLater(client.output_buffer_timeout, self._flush_timer)

    def _flush_timer(self) -> None:
        # Not cancelled when the buffer is flushed otherwise: firing on an
        # empty buffer is cheaper than cancelling and re-arming per flush.
        self._flush_call = None
        if self._obuf and not self._closed:
            self.flush()

    def flush(self) -> None:
        """Write the buffered message frames now.

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
        gate = self._gate
        if self._unsent or gate.output_blocked:
            # Held frames wait only while the transport is backed up (or the
            # connection closes): drained() hands these on after them.
            self._unsent.extend(out)
            return
        # One joined buffer per write, not writeSequence: Twisted's
        # writeSequence walks the pieces twice in Python (a type check, a
        # length sum), two pieces per message; the join is one C call and
        # the copy it makes is one the transport would make anyway.
        write = self._transport.write
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
            if gate.output_blocked:
                self._unsent.extend(out[i + per_step:])
                return

    def _drain(self) -> None:
        """Hand held frames to the transport a WRITE_STEP at a time until it is backed up again.

        What stays held is known to be unsent: the connection is handed no
        messages meanwhile (its ready() is 0 while the transport is backed
        up), so a message that timed out is never written to it again while
        its earlier copy waits here or in the transport's buffer above its
        mark.
        """
        unsent = self._unsent
        popleft = unsent.popleft
        write = self._transport.write
        gate = self._gate
        while unsent and not gate.output_blocked and not self._closed:
            step: list[bytes] = []
            size = 0
            while unsent and size < WRITE_STEP:
                piece = popleft()
                step.append(piece)
                size += len(piece)
            write(b"".join(step))
