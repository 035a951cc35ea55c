"""`GET /channel/peek` and `GET /topic/peek`: the first messages of a queue, without consuming them.

An mqd addition (nsq#848 and nsq#1482 ask nsqd for one; NSQ has no way to
look at messages without taking them): an operator sees what a stuck
consumer is holding, what waits behind it, and what is scheduled, on a
live broker. No NSQ client calls these paths, so nothing can trip over them.

A peek only reads: the memory queue and the backend in delivery order (the
backend's `peek`, which moves no read position), and the live entries of
the in-flight and deferred heaps, so no count, timer, order, attempt or
store position changes, and what consumers get afterwards is exactly what
they would have got. At most `MAX_PEEK` messages are answered: the answer
is built in one reactor turn.

Arguments are checked as the /channel/* endpoints check theirs (names,
then whether the topic and channel exist: 404, nothing is created), then
`n` (a positive integer, default 20, larger values capped:
`400 INVALID_N` otherwise) and `state` (`queued`, `in_flight` or
`deferred`, default `queued`; a topic holds only `queued`:
`400 INVALID_STATE` otherwise). Times are nanoseconds since the epoch, as
message timestamps are.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from twisted.web.server import Request

from spark_bridge.snapshot import STATES

from .admin import ChannelEndpoint, TopicEndpoint
from .args import Query, query_of, topic_arg
from .response import ApiError

if TYPE_CHECKING:
    from ..message import Message

__all__ = ["ChannelPeek", "DEFAULT_PEEK", "MAX_PEEK", "STATES", "TopicPeek", "count_arg", "peek_message", "state_arg"]

DEFAULT_PEEK = 20
MAX_PEEK = 1000

_DIGITS = re.compile(r"[0-9]+")


def count_arg(query: Query) -> int:
    """`n`: how many to answer, at most MAX_PEEK; 400 INVALID_N unless a positive integer."""
    raw = query.first("n")
    if raw is None:
        return DEFAULT_PEEK
    if not _DIGITS.fullmatch(raw) or int(raw) <= 0:
        raise ApiError(400, "INVALID_N")
    return min(int(raw), MAX_PEEK)


def state_arg(query: Query, allowed: tuple[str, ...]) -> str:
    state = query.first("state")
    if state is None:
        return "queued"
    if state not in allowed:
        raise ApiError(400, "INVALID_STATE")
    return state


def _ns(seconds: float | None) -> int | None:
    """Reactor seconds (unix time) as integer nanoseconds; None for unset (0 or None)."""
    return int(seconds * 1e9) if seconds else None


def peek_message(msg: Message, due: float | None = None, timeout: float | None = None,
                 client=None) -> dict[str, Any]:
    """One message as the peek answers it.

    `due` overrides the message's own deferred_until (a deferred message's
    heap time is when it is due); `timeout` and `client` are set for one in
    flight.
    """
    body = msg.body
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {
        "id": msg.id.decode("ascii", "replace"),
        "attempts": msg.attempts,
        "timestamp": msg.timestamp,
        "size": len(body),
        "body": base64.b64encode(body).decode("ascii"),
        "body_text": text,
        "deferred_until": _ns(due if due is not None else msg.deferred_until),
        "timeout_at": _ns(timeout),
        "client": client.remote_address if client is not None else None,
    }


class ChannelPeek(ChannelEndpoint):
    """`GET /channel/peek?topic=T&channel=C[&n=N][&state=S]`: a channel's first messages in one state."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> dict[str, Any]:
        channel = self.existing_channel(request)
        query = query_of(request)
        count = count_arg(query)
        state = state_arg(query, STATES)
        rows = channel.peek(state, count)
        if state == "queued":
            total = channel.depth()
            messages = [peek_message(msg) for msg, _, _ in rows]
        elif state == "deferred":
            total = channel.deferred_count()
            messages = [peek_message(msg, due=due) for msg, due, _ in rows]
        else:
            total = channel.in_flight_count()
            messages = [peek_message(msg, timeout=timeout, client=client) for msg, timeout, client in rows]
        return {"topic": channel.topic.name, "channel": channel.name, "state": state,
                "total": total, "messages": messages}


class TopicPeek(TopicEndpoint):
    """`GET /topic/peek?topic=T[&n=N]`: what waits at the topic for its channels (only `queued`)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> dict[str, Any]:
        query = query_of(request)
        topic = self.existing_topic(topic_arg(query, "INVALID_ARG_TOPIC"))
        count = count_arg(query)
        state = state_arg(query, ("queued",))
        return {"topic": topic.name, "channel": None, "state": state, "total": topic.depth(),
                "messages": [peek_message(msg) for msg in topic.peek(count)]}
