"""A V2 connection's output: frames, the message buffer, heartbeats, flow control.

What nsqd's client_v2.go does for a connection's writing side. Message
frames wait in an output buffer (nsqd's bufio.Writer) that is flushed when
full, when the client stops being ready, before any other frame, or after
output_buffer_timeout. Responses stay in command order, also behind a
durable publish whose OK waits for its commit. The connection is its
transport's streaming producer: a transport backed up with unsent output
pauses reading and delivery, and a write deadline closes a client that
takes nothing for a heartbeat interval.

A mixin of V2Protocol: it uses the connection's state set up there.
"""

from __future__ import annotations

from twisted.internet.task import LoopingCall

from mqd.logs import get_logger
from mqd.message import FRAME_HEAD
from mqd.wire.errors import ProtocolError, fatal
from mqd.wire.framing import FRAME_TYPE_ERROR, HEARTBEAT, OK, frame

__all__ = ["OutputMixin", "WRITE_STEP"]

# Frames held while the transport is backed up are handed to it this much at
# a time (Twisted's TCP transport pauses its producer past 64 KiB unsent):
# its buffer holds at most about two steps, the rest waits in the protocol
# where it is known to be unsent, and the write deadline runs per handful of
# steps, as nsqd's does per write.
WRITE_STEP = 64 * 1024

_MSG_HEADER_PACK = FRAME_HEAD.pack
_MSG_OVERHEAD = FRAME_HEAD.size - 4
_MSG_FRAME = FRAME_HEAD.size

# The V2 protocol logs under one namespace, whichever module a line comes from.
log = get_logger("mqd.nsqd.protocol.v2")


class OutputMixin:
    """Writing frames, buffering messages, heartbeats and flow control for V2Protocol."""

    # -- heartbeats ----------------------------------------------------------------

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
        """Two heartbeat intervals without a word: close, as nsqd's read deadline does.

        nsqd's heartbeat falls due with that deadline when the client has
        been silent since the heartbeats started, and is written first; then
        the connection closes as any other (the output flushed, a FIN), so
        the client reads an end of stream, not a reset. A client that does
        not read its output either is dropped at once.
        """
        log.info("client {remote} missed two heartbeats; closing", remote=self.remote_address)
        reading = not (self._output_blocked or self._unsent)
        heartbeat = self._heartbeat
        if reading and heartbeat is not None and heartbeat.call is not None:
            if heartbeat.call.getTime() - self.clock.seconds() <= heartbeat.interval / 100:
                self._send_heartbeat()
        self._stop_heartbeats()
        if reading:
            self.lose_connection()
        else:
            # It does not read either: its output would never drain, so the
            # connection is dropped now, as nsqd's close drops what its
            # buffer still held for it.
            self._closed = True
            self.transport.abortConnection()

    # -- delivery ------------------------------------------------------------------

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

    def _update_reading(self) -> None:
        """Read the socket only while nothing holds it.

        Reasons: a chunked MPUB in progress (_publishing), an auth server
        being asked, compressed input not inflated yet, compression
        negotiated but not started, output over its bound (pauseProducing).
        Every reason is a flag checked here, so one reason ending does not
        resume reading that another still holds. Output backed up during a
        TLS handshake is the TLS layer holding our OK until the handshake is
        done, which takes reading: that one does not stop it, nor does a
        compression waiting for that handshake. After a half-close the
        first call that finds the input let go closes the connection.
        """
        codec = self._codec
        holding = (self._publishing or self._auth_waiting
                   or (codec is not None and codec.has_more))
        if self._input_ended and not (holding or self._codec_pending is not None):
            # The client half-closed and everything it sent is handled.
            self._input_done()
            return
        paused = (holding
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
        """Answer `replies` publishes (`verb`: PUB, MPUB, DPUB) once the commit holding them is synced.

        Held as one (verb, count) entry, not an entry per publish: a
        pipelining publisher's read holds many, answered together.
        """
        if self._held is None:
            self._held = []
            self.broker.store.when_durable(self._release)
        self._held.append((verb, replies))

    def _release(self, error: str | None) -> None:
        """The commit holding this connection's publishes is synced (or failed).

        Synced: each held publish gets its OK, in order with the frames
        held behind them, in one write. Failed: the first held publish gets
        the error, and the connection closes after it (as nsqd's does).
        """
        held, self._held = self._held or [], None
        if self._obuf:
            self.flush_output()
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
            out.append(item)
        if out:
            data = b"".join(out)
            if self._unsent:
                self._unsent.append(data)
            else:
                self.transport.write(data)
        if failed or self._close_after_release:
            self.lose_connection()

    # -- IConsumer: message frames -------------------------------------------------

    def send_messages(self, messages: list) -> None:
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
