"""Topics and channels work from what they are given when built, without a broker.

A topic gets its clock, options, store, queue opener, delivery batch and a
lifecycle listener (the broker, in a running nsqd); a channel gets the
delivery batch and its topic as listener. These tests build both with a
plain listener and a task.Clock and check that the listener hears every
channel come and go, and that nothing reaches for a broker.
"""

from __future__ import annotations

import pytest
from zope.interface import implementer
from zope.interface.verify import verifyObject

from backends.memory import MemoryStore
from mqd.nsqd.delivery import DeliveryBatch
from mqd.nsqd.interfaces import IChannelLifecycle, IConsumer, ITopicLifecycle
from mqd.nsqd.overflow import OverflowQueue
from mqd.nsqd.topic import Topic
from tests.support.inprocess_broker import settings


@implementer(ITopicLifecycle)
class Listener:
    """Records what a topic tells its owner, as (event, topic name, channel name)."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, str, str | None]] = []

    def channel_created(self, topic, channel) -> None:
        self.heard.append(("created", topic.name, channel.name))

    def channel_deleted(self, topic, channel) -> None:
        self.heard.append(("deleted", topic.name, channel.name))

    def topic_abandoned(self, topic) -> None:
        self.heard.append(("abandoned", topic.name, None))


@implementer(IConsumer)
class Consumer:
    """A subscribed client with a fixed RDY, keeping what it is sent."""

    msg_timeout = 60.0
    sample_rate = 0

    def __init__(self, rdy: int = 100) -> None:
        self.rdy = rdy
        self.in_flight_count = self.message_count = self.finish_count = self.requeue_count = 0
        self.got: list[bytes] = []
        self.gone = False

    def ready(self) -> int:
        return self.rdy - self.in_flight_count

    def sending_messages(self, count) -> None:
        self.in_flight_count += count
        self.message_count += count

    def send_messages(self, messages) -> None:
        self.got += [m.body for m in messages]

    def finished_messages(self, count) -> None:
        self.in_flight_count -= count
        self.finish_count += count

    def requeued_message(self) -> None:
        self.in_flight_count -= 1
        self.requeue_count += 1

    def timed_out_messages(self, count) -> None:
        self.in_flight_count -= count

    def in_flight_cleared(self) -> None:
        self.in_flight_count = 0

    def channel_gone(self) -> None:
        self.gone = True


class Parts:
    """What a topic is built with, kept for the assertions."""

    def __init__(self, tmp_path, clock) -> None:
        self.clock = clock
        self.options = settings(tmp_path)
        self.store = MemoryStore(self.options)
        self.listener = Listener()
        self.deliveries = DeliveryBatch()
        self.opened: list[tuple[str, bool]] = []

    def open_queue(self, name: str, ephemeral: bool) -> OverflowQueue:
        self.opened.append((name, ephemeral))
        return OverflowQueue(self.options.mem_queue_size, self.store.open_queue(name))

    def topic(self, name: str = "t") -> Topic:
        return Topic(name, clock=self.clock, options=self.options, store=self.store,
                     open_queue=self.open_queue, listener=self.listener, deliveries=self.deliveries)


@pytest.fixture
def parts(tmp_path, clock) -> Parts:
    return Parts(tmp_path, clock)


def test_the_broker_is_the_topics_lifecycle_listener(inproc_broker):
    assert verifyObject(ITopicLifecycle, inproc_broker)
    topic = inproc_broker.topic("t")
    assert verifyObject(IChannelLifecycle, topic)


def test_the_fakes_provide_the_interfaces(parts):
    assert verifyObject(ITopicLifecycle, parts.listener)
    assert verifyObject(IConsumer, Consumer())


def test_neither_topic_nor_channel_holds_a_broker(parts):
    topic = parts.topic()
    channel = topic.channel("c")
    assert not hasattr(topic, "broker")
    assert not hasattr(channel, "broker")
    assert not hasattr(channel, "topic")
    assert channel.topic_name == "t"
    assert repr(channel) == "<Channel t:c>"


def test_queues_are_opened_through_the_given_opener(parts):
    topic = parts.topic("t#ephemeral")
    topic.channel("c")
    assert parts.opened == [("t#ephemeral", True), ("t#ephemeral:c", True)]


def test_the_listener_hears_channels_created_and_deleted(parts):
    topic = parts.topic()
    first = topic.channel("a")
    assert topic.channel("a") is first  # an existing channel is not announced again
    topic.channel("b")
    topic.delete_channel("a")
    topic.delete_channel("nope")  # an unknown channel: nothing to tell
    assert parts.listener.heard == [("created", "t", "a"), ("created", "t", "b"), ("deleted", "t", "a")]
    assert list(topic.channels) == ["b"]


def test_deleting_a_topic_announces_each_channel_deleted(parts):
    topic = parts.topic()
    topic.channel("a")
    topic.channel("b")
    parts.listener.heard.clear()
    topic.delete()
    assert sorted(parts.listener.heard) == [("deleted", "t", "a"), ("deleted", "t", "b")]


def test_an_ephemeral_topic_without_channels_is_handed_back_to_its_owner(parts):
    topic = parts.topic("t#ephemeral")
    topic.channel("c")
    topic.delete_channel("c")
    assert parts.listener.heard[-2:] == [("deleted", "t#ephemeral", "c"), ("abandoned", "t#ephemeral", None)]


def test_a_durable_topic_without_channels_stays(parts):
    topic = parts.topic()
    topic.channel("c")
    topic.delete_channel("c")
    assert ("abandoned", "t", None) not in parts.listener.heard


def test_an_ephemeral_channel_goes_with_its_last_client(parts):
    topic = parts.topic()
    channel = topic.channel("c#ephemeral")
    a, b = Consumer(), Consumer()
    channel.add_client(a)
    channel.add_client(b)
    channel.remove_client(a)
    assert "c#ephemeral" in topic.channels
    channel.remove_client(b)
    assert "c#ephemeral" not in topic.channels
    assert parts.listener.heard[-1] == ("deleted", "t", "c#ephemeral")


def test_a_publish_is_delivered_at_once_outside_a_read(parts):
    topic = parts.topic()
    consumer = Consumer()
    topic.channel("c").add_client(consumer)
    topic.publish([b"one", b"two"])
    assert consumer.got == [b"one", b"two"]


def test_a_publish_during_a_read_waits_for_the_delivery_batch(parts):
    topic = parts.topic()
    consumer = Consumer()
    channel = topic.channel("c")
    channel.add_client(consumer)
    parts.deliveries.pending = set()
    topic.publish([b"one"])
    assert consumer.got == []
    assert parts.deliveries.pending == {channel}
    pending, parts.deliveries.pending = parts.deliveries.pending, None
    for ch in pending:
        ch.deliver()
    assert consumer.got == [b"one"]


def test_publish_stamps_messages_with_the_given_clock_and_node(parts):
    topic = parts.topic()
    topic.publish([b"x"], defer=5.0)
    [msg] = topic.peek(1)
    assert msg.timestamp == int(parts.clock.seconds() * 1e9)
    assert msg.deferred_until == parts.clock.seconds() + 5.0


def test_a_channel_created_without_draining_leaves_messages_at_the_topic(parts):
    topic = parts.topic()
    topic.publish([b"early"])
    channel = topic.channel("c", drain=False)
    assert topic.depth() == 1 and channel.depth() == 0
    topic.drain_waiting()
    assert topic.depth() == 0 and channel.depth() == 1


def test_a_new_channel_gets_what_waited_at_the_topic(parts):
    topic = parts.topic()
    topic.publish([b"early"])
    channel = topic.channel("c")
    assert topic.depth() == 0 and channel.depth() == 1


def test_channels_are_built_with_the_topics_current_options(parts):
    topic = parts.topic()
    assert topic.channel("a").e2e is None
    topic.options = topic.options.replace(e2e_processing_latency_percentile=[0.99])
    assert topic.channel("b").e2e is not None


def test_the_broker_gives_new_options_to_its_topics(inproc_broker):
    topic = inproc_broker.topic("t")
    inproc_broker.update_options(e2e_processing_latency_percentile=[0.5])
    assert topic.options is inproc_broker.options
    assert topic.channel("c").e2e is not None
