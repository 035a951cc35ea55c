"""What a channel needs from a subscribed client.

Declared as an interface so a channel can be driven in tests by a plain
object, without a socket, and so the protocol class stays the only thing
that knows about frames.
"""

from __future__ import annotations

from zope.interface import Attribute, Interface


class IConsumer(Interface):
    msg_timeout = Attribute("Seconds a delivered message may stay in flight before it is requeued.")
    sample_rate = Attribute("0 for every message, else 1-99: the share of messages kept (nsqd's sampling).")
    in_flight_count = Attribute("Messages delivered to this client and not yet FIN/REQ/timed out.")
    message_count = Attribute("Messages delivered to this client, for /stats.")
    finish_count = Attribute("Messages this client FINished, for /stats.")
    requeue_count = Attribute("Messages this client REQueued, for /stats.")

    def ready():
        """How many more messages the client can take now (0 when not ready)."""

    def send_messages(messages):
        """Write these messages to the client; they are already in flight."""

    def channel_gone():
        """The channel was deleted: the client is disconnected, as nsqd does."""
