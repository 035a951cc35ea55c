"""A message as the client receives it, and the response it owes nsqd (FIN, REQ or TOUCH).

The message knows its connection (its delegate) so that a handler can
answer it without holding the connection: `msg.finish()`,
`msg.requeue(delay)`, `msg.touch()`. Responding twice is a no-op, as in
go-nsq, so the consumer's automatic FIN after a handler that already
responded costs nothing and sends nothing.
"""

from __future__ import annotations

import struct

__all__ = ["Message", "decode_message", "MESSAGE_HEADER_SIZE"]

# A message frame's payload: [timestamp ns int64][attempts uint16][16-byte id][body]
# (mqd/message.py's FRAME_HEAD without the frame's size and type, then the id).
_PAYLOAD_HEADER = struct.Struct(">qH16s")
MESSAGE_HEADER_SIZE = _PAYLOAD_HEADER.size
_unpack_header = _PAYLOAD_HEADER.unpack_from


class Message:
    """One delivery of a message over one connection."""

    __slots__ = ("id", "body", "timestamp", "attempts", "nsqd_address",
                 "delegate", "_responded", "_auto_response_disabled")

    def __init__(self, id: bytes, body: bytes, timestamp: int, attempts: int,
                 nsqd_address: str = "", delegate=None) -> None:
        self.id = id
        self.body = body
        self.timestamp = timestamp
        self.attempts = attempts
        self.nsqd_address = nsqd_address
        # The connection that delivered it: finish_message, requeue_message, touch_message.
        self.delegate = delegate
        self._responded = False
        self._auto_response_disabled = False

    def finish(self) -> None:
        """FIN: the message is done and nsqd forgets it."""
        if self._responded:
            return
        self._responded = True
        self.delegate.finish_message(self)

    def requeue(self, delay: float | None = None, backoff: bool = True) -> None:
        """REQ: nsqd delivers it again after `delay` seconds.

        None lets the consumer compute default_requeue_delay × attempts
        (capped by max_requeue_delay); `backoff` says whether this counts
        as a failure for the consumer's backoff.
        """
        if self._responded:
            return
        self._responded = True
        self.delegate.requeue_message(self, delay, backoff)

    def touch(self) -> None:
        """TOUCH: reset the message's server-side timeout (the handler needs longer)."""
        if self._responded:
            return
        self.delegate.touch_message(self)

    def disable_auto_response(self) -> None:
        """The handler answers this message itself, later: the consumer will not FIN/REQ it."""
        self._auto_response_disabled = True

    def is_auto_response_disabled(self) -> bool:
        return self._auto_response_disabled

    def claim_response(self) -> bool:
        """Mark the message answered by its owner; False if it already was.

        For a connection that answers many messages in one write
        (finish_messages): each is sent once, however often it is named.
        """
        if self._responded:
            return False
        self._responded = True
        return True

    def has_responded(self) -> bool:
        return self._responded

    def __repr__(self) -> str:
        body = self.body
        return (f"Message(id={self.id!r}, attempts={self.attempts}, "
                f"body={body[:32]!r}{'...' if len(body) > 32 else ''})")


def decode_message(payload: bytes, address: str, delegate=None) -> Message:
    """A message frame's payload (after its size and type) as a Message; ValueError if too short."""
    if len(payload) < MESSAGE_HEADER_SIZE:
        raise ValueError(f"message frame of {len(payload)} bytes is shorter than its header")
    timestamp, attempts, msg_id = _unpack_header(payload)
    return Message(msg_id, bytes(payload[MESSAGE_HEADER_SIZE:]), timestamp, attempts, address, delegate)
