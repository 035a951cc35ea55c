"""`POST /topic/*` and `POST /channel/*`: create, delete, empty, pause, unpause.

Each answers an empty 200 on success. The argument checks differ between
endpoints exactly as nsqd's do (which validate the name, which only look
it up, `INVALID_TOPIC` vs `INVALID_ARG_TOPIC`), because tools and tests
compare the error texts.

Pausing changes what is delivered, so the paused flag is written to
nsqd.dat before the call is answered: a crash right after an operator
paused a topic must not bring it back unpaused (nsqd does the same).
Creating and deleting are answered once written too, so what an operator
was told is done is what a restart brings back (nsqd writes those in the
background). The write runs in a thread; only the answer waits for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from twisted.web.server import Request

from backends import BackendError
from mqd.http.args import query_of, topic_arg, topic_channel_args
from mqd.http.endpoint import LATER, Endpoint, finish_v1
from mqd.http.response import ApiError
from mqd.logs import get_logger

if TYPE_CHECKING:
    from mqd.nsqd.channel import Channel
    from mqd.nsqd.topic import Topic

__all__ = [
    "ChannelCreate",
    "ChannelDelete",
    "ChannelEmpty",
    "ChannelEndpoint",
    "ChannelPause",
    "TopicCreate",
    "TopicDelete",
    "TopicEmpty",
    "TopicEndpoint",
    "TopicPause",
    "answer_once_persisted",
]

log = get_logger(__name__)


def answer_once_persisted(broker: Any, request: Request, topic: str, answer: Any = None) -> object:
    """The 200 with `answer` (empty by default), once nsqd.dat holds the change to `topic` (written in a thread).

    A failed write is logged and the answer is still 200, as nsqd ignores
    PersistMetadata's error (the change stands).
    """

    def failed(failure) -> None:
        log.error("failed to persist metadata: {error}", error=failure.value)

    d = broker.metadata.written(topic)
    d.addErrback(failed)
    if d.called:  # written inline (a test clock has no threads)
        return answer
    d.addCallback(lambda _: finish_v1(request, 200, answer))
    return LATER


def _empty(queue_owner: Topic | Channel) -> None:
    """Empty a topic or channel; a store that cannot is nsqd's 500 INTERNAL_ERROR."""
    try:
        queue_owner.empty()
    except BackendError:
        raise ApiError(500, "INTERNAL_ERROR") from None


# -- topics ---------------------------------------------------------------------------


class TopicEndpoint(Endpoint):
    """An endpoint about an existing topic (404 TOPIC_NOT_FOUND otherwise): /topic/* and /topic/peek."""

    def existing_topic(self, name: str) -> Topic:
        topic = self.broker.topics.get(name)
        if topic is None:
            raise ApiError(404, "TOPIC_NOT_FOUND")
        return topic


class TopicCreate(TopicEndpoint):
    """`/topic/create?topic=<t>`: create it if new (idempotent)."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        name = topic_arg(query_of(request))
        self.broker.topic(name)
        return answer_once_persisted(self.broker, request, name)


class TopicDelete(TopicEndpoint):
    """`/topic/delete?topic=<t>`: the topic, its channels (consumers disconnected) and their data."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        # nsqd does not check the name here: an invalid one is just not found.
        name = topic_arg(query_of(request), invalid=None)
        if not self.broker.delete_topic(name):
            raise ApiError(404, "TOPIC_NOT_FOUND")
        return answer_once_persisted(self.broker, request, name)


class TopicEmpty(TopicEndpoint):
    """`/topic/empty?topic=<t>`: drop what waits at the topic; its channels keep theirs."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> None:
        _empty(self.existing_topic(topic_arg(query_of(request))))


class TopicPause(TopicEndpoint):
    """`/topic/pause` and `/topic/unpause`: stop or resume the topic → channel flow."""

    def __init__(self, broker, paused: bool) -> None:
        super().__init__(broker)
        self.paused = paused

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        topic = self.existing_topic(topic_arg(query_of(request), invalid=None))
        if self.paused:
            topic.pause()
        else:
            topic.unpause()
        return answer_once_persisted(self.broker, request, topic.name)


# -- channels -------------------------------------------------------------------------


class ChannelEndpoint(Endpoint):
    """An endpoint about a topic's channel, named as nsqd's GetTopicChannelArgs reads it: /channel/*."""

    def topic_and_name(self, request: Request) -> tuple[Topic, str]:
        """The existing topic and the channel name (which may not exist yet)."""
        topic_name, channel_name = topic_channel_args(query_of(request))
        topic = self.broker.topics.get(topic_name)
        if topic is None:
            raise ApiError(404, "TOPIC_NOT_FOUND")
        return topic, channel_name

    def existing_channel(self, request: Request) -> Channel:
        topic, name = self.topic_and_name(request)
        channel = topic.channels.get(name)
        if channel is None:
            raise ApiError(404, "CHANNEL_NOT_FOUND")
        return channel


class ChannelCreate(ChannelEndpoint):
    """`/channel/create?topic=<t>&channel=<c>`: on an existing topic only (it is not created)."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        topic, name = self.topic_and_name(request)
        topic.channel(name)
        return answer_once_persisted(self.broker, request, topic.name)


class ChannelDelete(ChannelEndpoint):
    """`/channel/delete`: the channel, its messages and data; its consumers are disconnected."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        topic, name = self.topic_and_name(request)
        if name not in topic.channels:
            raise ApiError(404, "CHANNEL_NOT_FOUND")
        topic.delete_channel(name)
        return answer_once_persisted(self.broker, request, topic.name)


class ChannelEmpty(ChannelEndpoint):
    """`/channel/empty`: drop queued, in-flight and deferred messages; consumers stay."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> None:
        _empty(self.existing_channel(request))


class ChannelPause(ChannelEndpoint):
    """`/channel/pause` and `/channel/unpause`: stop or resume channel → consumer delivery."""

    def __init__(self, broker, paused: bool) -> None:
        super().__init__(broker)
        self.paused = paused

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        channel = self.existing_channel(request)
        if self.paused:
            channel.pause()
        else:
            channel.unpause()
        return answer_once_persisted(self.broker, request, channel.topic_name)
