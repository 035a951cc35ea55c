"""Publishing from a V2 connection: PUB, DPUB and MPUB bodies, the publish, and its OK.

The checks nsqd makes of a topic name and a body, with its error texts;
the publish itself and its answer (an OK at once, or held until the store
has the messages durable); and a big MPUB checked and published over
several turns of the reactor (mqd.nsqd.batches) while the connection
stops reading, so its answer stays in command order.

A mixin of V2Protocol: it uses the connection's state set up there.
"""

from __future__ import annotations

from backends import BackendError
from mqd.nsqd.batches import (
    BAD_SIZE,
    NO_SIZE,
    TOO_BIG,
    TRAILING,
    BatchError,
    TopicExiting,
    binary_bodies,
    binary_chunks,
    publish_in_chunks,
)
from mqd.nsqd.protocol.params import PAUSED, valid_name
from mqd.wire.errors import ProtocolError, fatal, go_quote
from mqd.wire.framing import OK

__all__ = ["PublishMixin", "mpub_error", "mpub_limit"]


class PublishMixin:
    """Body checks, publishing and big MPUBs for V2Protocol."""

    def _publish_topic(self, verb: str, params, min_params: int, code_prefix: str = "") -> str:
        if len(params) < min_params:
            raise fatal("E_INVALID", f"{verb} insufficient number of parameters")
        topic_name = valid_name(params[1])
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
        return PAUSED

    def _mpub_done(self, topic_name: str, count: int, size: int, max_msg: int, error) -> None:
        """A chunked MPUB is over: answer it as a one-go MPUB would be, then read on."""
        self._publishing = False
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
        counts = self.pub_counts
        counts[topic_name] = counts.get(topic_name, 0) + count
        if self.broker.store.durable:
            self._ok_when_durable("MPUB")
        else:
            self._write_frame(OK)
        self._resume()  # the input kept meanwhile, then reading again


def mpub_limit(max_body_size: int, count: int) -> int:
    """The most bytes an MPUB body of `count` messages may take after its declared size.

    nsqd reads up to count x (4 + max-msg-size) bytes whatever the declared
    size; mqd keeps a pending MPUB in memory, so it bounds the messages'
    own bytes by max-body-size: the count, the sizes, and max-body-size.
    That takes both forms clients send (declared = the whole body, or the
    messages' bytes only) up to max-body-size.
    """
    return 4 + 4 * count + max_body_size


def mpub_error(err: BatchError, max_msg: int, size: int) -> ProtocolError:
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

