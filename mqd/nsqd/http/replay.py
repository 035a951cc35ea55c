"""`POST /channel/replay` and `DELETE /channel/replay`: a topic's retained log queued again into a channel.

    POST   /channel/replay?topic=T&channel=C&offset=N|earliest|latest
    POST   /channel/replay?topic=T&channel=C&timestamp=MS
    DELETE /channel/replay?topic=T&channel=C

POST answers `{"topic","channel","epoch","start","end"}`: the records
[start, end) of the log's life `epoch` are queued into C (created if new)
as it drains, `end` being the log's latest offset at the request; a replay
already running on C is replaced. `timestamp` (ms since the Unix epoch)
starts at the first record published at or after it. DELETE stops the
running one: `{"stopped": true, "position": P}`, P the next offset it would
have queued. How a replay runs is mqd.nsqd.replay's.

Errors are nsqd's 400 `{"message": ...}`: MISSING_ARG_TOPIC, INVALID_TOPIC,
MISSING_ARG_CHANNEL, INVALID_CHANNEL, INVALID_OFFSET (also when neither
or both of offset and timestamp are given), INVALID_TIMESTAMP,
RETENTION_OFF (the topic keeps no log); 404 TOPIC_NOT_FOUND, 404
REPLAY_NOT_FOUND (DELETE, nothing running on C); an offset below the
earliest or beyond the latest is 416
`{"message":"OFFSET_OUT_OF_RANGE","earliest":E,"latest":L}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from twisted.web.server import Request

from backends.interface import OffsetOutOfRange
from mqd.http.args import Query, query_of, topic_channel_args
from mqd.http.response import ApiError
from mqd.nsqd.http.retained import (
    offset_arg,
    out_of_range,
    retained_log,
    start_offset,
    timestamp_arg,
)
from mqd.nsqd.http.topics import TopicEndpoint
from mqd.nsqd.replay import replay_into

if TYPE_CHECKING:
    from mqd.http.auth import AuthState

__all__ = ["ChannelReplay", "admin_on_replayed_channel", "replay_args"]


def replay_args(query: Query) -> tuple[str, str]:
    """`topic` and `channel`, with the replay's error texts (INVALID_TOPIC, INVALID_CHANNEL)."""
    return topic_channel_args(query, "INVALID_TOPIC", "INVALID_CHANNEL")


def admin_on_replayed_channel(request: Request, state: AuthState) -> bool:
    """The grant `/channel/replay` needs under --http-auth-required: admin on the topic and the channel."""
    topic, channel = replay_args(query_of(request))
    return state.allows_admin(topic, channel)


def _start(query: Query) -> tuple[int | str | None, int | None]:
    """Where a replay starts, as asked: (offset, None) or (None, timestamp ns), by /topic/read's rules.

    Exactly one of `offset` (an integer, `earliest` or `latest`) and
    `timestamp` (ms) is given, else 400 INVALID_OFFSET.
    """
    timestamp_ns = timestamp_arg(query)
    if (query.first("offset") is None) == (timestamp_ns is None):
        raise ApiError(400, "INVALID_OFFSET")
    return (None if timestamp_ns is not None else offset_arg(query)), timestamp_ns


class ChannelReplay(TopicEndpoint):
    """`/channel/replay`: POST starts (or replaces) a channel's replay, DELETE stops it."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        query = query_of(request)
        topic_name, channel_name = replay_args(query)
        offset, timestamp_ns = _start(query)
        topic = self.existing_topic(topic_name)
        log = retained_log(topic)
        if offset is None:
            assert timestamp_ns is not None
            end = log.latest()
            start = log.offset_for_timestamp(timestamp_ns)
        else:
            try:
                start, _, end = start_offset(log, offset)
            except OffsetOutOfRange as e:
                return out_of_range(request, e)
        broker = self.broker
        channel = topic.channel(channel_name)
        replay = replay_into(topic, channel, log, start, end, clock=broker.clock,
                             bound=broker.options.mem_queue_size)
        return {"topic": topic.name, "channel": channel.name, "epoch": replay.epoch,
                "start": start, "end": end}

    def handle_DELETE(self, request: Request, params: Mapping[str, str]) -> dict[str, Any]:
        topic_name, channel_name = replay_args(query_of(request))
        channel = self.existing_topic(topic_name).channels.get(channel_name)
        feed = channel.replay if channel is not None else None
        if feed is None:
            raise ApiError(404, "REPLAY_NOT_FOUND")
        position = feed.stats()["position"]
        feed.stop()
        return {"stopped": True, "position": position}

