"""The interfaces between the broker's layers.

IConsumer is what a channel needs from a subscribed client: declared so a
channel can be driven in tests by a plain object, without a socket, and so
the protocol class stays the only thing that knows about frames.

IChannelLifecycle and ITopicLifecycle are what a channel tells its topic
and a topic tells its broker: a topic and a channel are given their owner
as such a listener when built, and call nothing else above them.

IChannelFeed is what a channel tells whatever feeds it from elsewhere than
its topic (a replay of the topic's retained log, mqd.nsqd.replay): the
channel holds it, and knows nothing else of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zope.interface import Attribute, Interface

if TYPE_CHECKING:
    from mqd.message import Message

__all__ = ["IChannelFeed", "IChannelLifecycle", "IConsumer", "ITopicLifecycle"]


class IConsumer(Interface):
    """A subscribed client, as its channel sees it.

    The channel reads the attributes and never sets them: the counts change
    through the methods below, which the channel calls once per delivered
    batch, FIN run, REQ, timeout pass or emptying (nsqd's SendingMessage,
    FinishedMessage, RequeuedMessage, TimedOutMessage and Empty).
    """

    msg_timeout = Attribute("Seconds a delivered message may stay in flight before it is requeued.")
    sample_rate = Attribute("0 for every message, else 1-99: the share of messages kept (nsqd's sampling).")
    in_flight_count = Attribute("Messages delivered to this client and not yet FIN/REQ/timed out.")
    message_count = Attribute("Messages delivered to this client, for /stats.")
    finish_count = Attribute("Messages this client FINished, for /stats.")
    requeue_count = Attribute("Messages this client REQueued, for /stats.")

    def ready():
        """How many more messages the client can take now (0 when not ready)."""

    def sending_messages(count):
        """`count` more messages are in flight to the client (sent next, by send_messages)."""

    def send_messages(messages):
        """Write these messages to the client; they are already in flight."""

    def finished_messages(count):
        """The client FINished `count` of its in-flight messages."""

    def requeued_message():
        """The client REQueued one of its in-flight messages."""

    def timed_out_messages(count):
        """`count` of the client's in-flight messages went back to the channel unanswered."""

    def in_flight_cleared():
        """The channel dropped everything: none of the client's messages is in flight any more."""

    def channel_gone():
        """The channel was deleted: the client is disconnected, as nsqd does."""


class IChannelLifecycle(Interface):
    """What a channel tells its owner (the topic): the one event a channel cannot handle alone."""

    def channel_abandoned(channel):
        """An ephemeral channel's last client left: the owner deletes the channel, as nsqd does."""


class ITopicLifecycle(Interface):
    """What a topic tells its owner (the broker) about its channels and itself.

    The owner announces the changes (logs, lookupd peers, the metadata
    file); the topic never reaches above itself for that.
    """

    def channel_created(topic, channel):
        """A new channel was added to `topic`."""

    def channel_deleted(topic, channel):
        """`channel` was deleted from `topic` (its messages and storage are gone)."""

    def topic_abandoned(topic):
        """An ephemeral topic's last channel was deleted: the owner deletes the topic, as nsqd does."""


class IChannelFeed(Interface):
    """What puts messages into a channel as it drains, besides its topic.

    The channel tells it when messages leave its queue and when it is
    emptied or deleted; /stats shows what it says of itself.
    """

    def delivered(messages: list[Message]) -> None:
        """The channel handed `messages` to a client: its queue went down by as many."""

    def stop() -> None:
        """The channel is being emptied or deleted: the feed ends and lets go of it (its `replay` is None again)."""

    def stats() -> dict[str, int]:
        """What /stats shows of the feed in the channel's entry."""
