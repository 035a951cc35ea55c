"""Topics that remember, in mqadmin: each broker's retained log on the topic page, replay on the channel page.

Additions to nsqadmin's JSON, made only when a broker reports them (so an
nsqd's, or a topic's without retention, answers are as before):

* `GET /api/topics/:topic`: each `nodes` row gains the broker's per-topic
  `/stats` fields `retention` (`{"time_ms", "bytes"}`) and `retained`
  (`{"epoch", "earliest", "latest", "bytes", "oldest_timestamp"}`, the
  timestamp in ms), the latter with `oldest_age_ms`, how old the oldest
  kept record is by mqadmin's clock (null when none is kept), and
  `epoch_text`, the epoch as a decimal string (a 63-bit number is more
  than a JavaScript number holds exactly).
* `GET /api/topics/:topic/:channel`: each `nodes` row gains the topic's
  `retention` on that broker and, while a replay into the channel runs
  there, the channel's `replay` (`{"position", "end", "epoch", "skipped"}`).

And one action, an mqd addition: `POST /api/replay/:topic/:channel` with
`{"timestamp": MS}` (ms since the Unix epoch) asks every producer of the
topic for `POST /channel/replay?topic=&channel=&timestamp=MS`, which
queues the channel again with every message of the topic's retained log
published at or after that time. Like nsqadmin's actions it is for admin
users only (403 FORBIDDEN otherwise), goes out with the request's bearer
secret (or mqadmin's), reports each broker in `results` (with its
`start` and `end` offsets when it answered), is `502 UPSTREAM_ERROR`
(401/403 for a refused secret) only when no broker did it, and is
notified as `replay_channel`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.server import Request

from mqd.admin.actions import ActionEndpoint, ActionRun, post_all
from mqd.admin.endpoint import Admin, AdminEndpoint, ApiError
from mqd.clusterinfo.aggregate import NodeStats
from mqd.http.endpoint import read_body
from mqd.logs import get_logger
from mqd.names import is_valid_name
from mqd.wire.go_json import GoJSONError, unmarshal

__all__ = ["REPLAY_PATH", "Replay", "add_channel_fields", "add_topic_fields", "routes"]

log = get_logger(__name__)

REPLAY_PATH = "/channel/replay"
_RETAINED_KEYS = ("epoch", "earliest", "latest", "bytes", "oldest_timestamp")


def routes(admin: Admin) -> dict[str, AdminEndpoint]:
    """The replay route, merged into the site's table by web.default_routes."""
    return {"/api/replay/:topic/:channel": Replay(admin)}


# -- the pages' fields ----------------------------------------------------------------------------


def _topic_docs(per_node: Iterable[NodeStats], topic: str) -> dict[str, Mapping[str, Any]]:
    """Each broker's /stats entry of `topic`, by node."""
    found: dict[str, Mapping[str, Any]] = {}
    for ns in per_node:
        for doc in ns.stats.get("topics") or ():
            if isinstance(doc, Mapping) and doc.get("topic_name") == topic:
                found[ns.node] = doc
    return found


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _retention(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    value = doc.get("retention")
    if not isinstance(value, Mapping):
        return None
    return {"time_ms": _int(value.get("time_ms")), "bytes": _int(value.get("bytes"))}


def _retained(doc: Mapping[str, Any], now: float) -> dict[str, Any] | None:
    value = doc.get("retained")
    if not isinstance(value, Mapping):
        return None
    row: dict[str, Any] = {key: _int(value.get(key)) for key in _RETAINED_KEYS}
    # A 63-bit epoch is more than a JavaScript number holds exactly: the pages show this.
    row["epoch_text"] = None if row["epoch"] is None else str(row["epoch"])
    oldest = row["oldest_timestamp"]
    row["oldest_age_ms"] = None if oldest is None else max(0, int(now * 1000) - oldest)
    return row


def _rows_with_retention(body: dict[str, Any], per_node: Iterable[NodeStats],
                         topic: str) -> Iterator[tuple[dict[str, Any], Mapping[str, Any]]]:
    """Each node row of `body` with its broker's /stats topic, the row given the topic's `retention` if any."""
    docs = _topic_docs(per_node, topic)
    for row in body.get("nodes") or ():
        doc = docs.get(row.get("node", ""))
        if doc is None:
            continue
        retention = _retention(doc)
        if retention is not None:
            row["retention"] = retention
        yield row, doc


def add_topic_fields(body: dict[str, Any], per_node: Iterable[NodeStats], topic: str, now: float) -> None:
    """`/api/topics/:topic`'s additions: `retention` and `retained` on each node row that has them."""
    for row, doc in _rows_with_retention(body, per_node, topic):
        retained = _retained(doc, now)
        if retained is not None:
            row["retained"] = retained


def add_channel_fields(body: dict[str, Any], per_node: Iterable[NodeStats], topic: str, channel: str) -> None:
    """`/api/topics/:topic/:channel`'s additions: the topic's `retention` and the channel's `replay` per node."""
    for row, doc in _rows_with_retention(body, per_node, topic):
        for c in doc.get("channels") or ():
            if isinstance(c, Mapping) and c.get("channel_name") == channel and isinstance(c.get("replay"), Mapping):
                replay = c["replay"]
                row["replay"] = {key: _int(replay.get(key)) for key in ("position", "end", "epoch", "skipped")}


# -- replay ---------------------------------------------------------------------------------------


def _timestamp(raw: bytes) -> int:
    """The body's `timestamp` (ms since the Unix epoch, a number or a string of digits); 400 otherwise."""
    try:
        data = unmarshal(raw)
    except GoJSONError as e:
        raise ApiError(400, str(e)) from None
    value = data.get("timestamp") if isinstance(data, dict) else None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ApiError(400, "INVALID_TIMESTAMP")
    return value


class Replay(ActionEndpoint):
    """`POST /api/replay/:topic/:channel {"timestamp": MS}`: replay the channel on every producer (module doc)."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> Deferred:
        self.authorize(request)
        topic, channel = params["topic"], params["channel"]
        if not is_valid_name(topic):
            raise ApiError(400, "INVALID_TOPIC")
        if not is_valid_name(channel):
            raise ApiError(400, "INVALID_CHANNEL")
        timestamp = _timestamp(read_body(request))
        return Deferred.fromCoroutine(self.replay(request, topic, channel, timestamp))

    async def replay(self, request: Request, topic: str, channel: str, timestamp: int) -> dict[str, Any]:
        run = ActionRun("replay channel")
        producers = await self.producers_of(request, run, topic)
        query = {"topic": topic, "channel": channel, "timestamp": str(timestamp)}
        run.add(await post_all(self.upstream_for(request), "nsqd", producers, REPLAY_PATH, query, _replayed))
        answer = run.answer()
        self.notify(request, "replay_channel", topic, channel)
        answer["timestamp"] = timestamp
        return answer


def _replayed(body: bytes) -> dict[str, int]:
    """What a broker's 200 answer to /channel/replay reports: the replay's `epoch`, `start` and `end` offsets."""
    try:
        data = unmarshal(body)
    except GoJSONError:
        data = None
    answer = data if isinstance(data, Mapping) else {}
    found = {key: _int(answer.get(key)) for key in ("epoch", "start", "end")}
    return {key: value for key, value in found.items() if value is not None}
