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

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from twisted.internet.defer import Deferred, gatherResults, maybeDeferred
from twisted.web.server import Request

from mqd.admin.actions import ActionEndpoint
from mqd.admin.endpoint import (
    Admin,
    AdminEndpoint,
    ApiError,
    go_lines,
    refusal_status,
    upstream_error,
)
from mqd.clusterinfo.aggregate import NodeStats, node_id
from mqd.clusterinfo.upstream import UpstreamError, error_text, go_line, reason_of
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
        producers, errors = await self.cluster_for(request).topic_producers(topic)
        if producers is None:
            raise upstream_error(errors)
        upstream = self.upstream_for(request)
        query = {"topic": topic, "channel": channel, "timestamp": str(timestamp)}
        results = list(await gatherResults([
            self._one(upstream, node_id(p), query) for p in producers or ()]))
        # Lookupds that did not answer while others did, then each broker that failed.
        problems: list[str] = list(errors)
        go = [getattr(e, "go", e) for e in errors]
        codes = [getattr(e, "code", None) for e in errors]
        for r in results:
            go_text, code = r.pop("_go"), r.pop("_code")
            if not r["ok"]:
                problems.append(f"nsqd {r['address']} {REPLAY_PATH}: {r['error']}")
                go.append(go_text)
                codes.append(code)
        if problems and not any(r["ok"] for r in results):
            log.error("failed to replay channel - {errors}", errors="; ".join(problems))
            raise ApiError(refusal_status(codes) or 502, "UPSTREAM_ERROR: " + go_lines(go))
        if problems:
            log.warn("replay channel: {errors}", errors="; ".join(problems))
        self.notify(request, "replay_channel", topic, channel)
        return {"message": "WARNING: " + go_lines(go) if go else "", "results": results, "timestamp": timestamp}

    def _one(self, upstream: Any, node: str, query: Mapping[str, str]) -> Deferred[dict[str, Any]]:
        """POST one broker's /channel/replay; fires with its result entry, never fails."""
        url = self.admin.cluster.node_url(node) + REPLAY_PATH + "?" + urlencode(query)
        d = maybeDeferred(upstream.post, url)

        def entry(error: str | None = None, go: str | None = None, code: int | None = None,
                  answer: Mapping[str, Any] | None = None) -> dict[str, Any]:
            row: dict[str, Any] = {"target": "nsqd", "address": node, "path": REPLAY_PATH, "ok": error is None,
                                   "error": error, "_go": go if go is not None else error, "_code": code}
            for key in ("epoch", "start", "end"):
                value = _int((answer or {}).get(key))
                if value is not None:
                    row[key] = value
            return row

        def answered(answer: Sequence[Any]) -> dict[str, Any]:
            status, body = answer
            if status != 200:
                return entry(error_text(status, body), UpstreamError(url, "", status, body, "POST").go_text, status)
            try:
                data = unmarshal(body)
            except GoJSONError:
                data = None
            return entry(answer=data if isinstance(data, Mapping) else None)

        def failed(failure: Any) -> dict[str, Any]:
            error = failure.value
            if not failure.check(UpstreamError):
                log.failure("request to {url} failed unexpectedly", failure, url=url)
                return entry(reason_of(error))
            return entry(reason_of(error), go_line(error, "nsqd"), error.code)

        d.addCallbacks(answered, failed)
        return d
