"""nsqadmin's GET API (`/api/topics`, `/api/nodes`, `/api/counter`, ...) plus mqd's `/api/health` and `/api/lookup`.

Same paths, field names and conventions as nsqadmin (`nsqadmin/http.go`),
so scripts written against it work here: every answer carries `message`,
empty or `WARNING: <what failed>` when some lookupd or broker did not
answer (the rest still count), and `502 UPSTREAM_ERROR: failed to query
any nsqlookupd: ...` (or `nsqd`) when none did, each failure in the words
of nsq's Go client (`got response 404 Not Found "..."`; a broker or lookupd
that refused the secret is named: `nsqd HOST:PORT: got response 401
Unauthorized "..."`, and when none answered the status is its 401 or 403,
not 502). Every query is made with the request's user's secret, or
mqadmin's own (endpoint.AdminEndpoint.cluster_for). An unknown topic
is that 502, as in nsqadmin: every lookupd answered 404 (without lookupd,
no broker has it: `failed to query any nsqd: `). `/api/graphite` answers
as nsqadmin with no graphite server reachable (mqadmin reads none). The
numbers come from `aggregate`, the queries from `cluster`; a broker's
retained log and a channel's replay are added to the topic's and the
channel's node rows by `mqd.admin.retained`.

Where nsqadmin answers oddly this answers plainly: a topic declared on
the lookupds that no broker has yet is a page of zeros (nsqadmin: 502
"failed to query any nsqd: "), so is a channel the lookupds list that no
producing broker has, a channel nobody lists is `404 CHANNEL_NOT_FOUND`
(nsqadmin: `{"message": ""}`), and a lookupd's 404 for a topic another
lookupd knows is "no producer there", not a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.internet import defer
from twisted.web.server import Request

from mqd.admin.endpoint import Admin, AdminEndpoint, ApiError, go_lines, upstream_error
from mqd.admin.retained import add_channel_fields, add_topic_fields
from mqd.clusterinfo.aggregate import (
    channel_stats,
    counter_stats,
    node_id,
    node_topics,
    topic_stats,
    warning,
)
from mqd.http.args import query_of

__all__ = ["routes"]

# nsqadmin's answer when a topic has no producer to ask for its stats.
_NO_NSQD = "UPSTREAM_ERROR: failed to query any nsqd: "


def _check(result: Any, errors: list[str], messages: list[str]) -> Any:
    """nsqadmin's handling of a clusterinfo answer: total failure → 502 (a refused secret's 401/403), partial → one warning entry."""
    if result is None:
        raise upstream_error(errors)
    if errors:
        messages.append(go_lines(errors))
    return result


class _Endpoint(AdminEndpoint):
    def now(self) -> float:
        return self.admin.reactor.seconds()


class Topics(_Endpoint):
    """`GET /api/topics`: `{"topics": [names]}` (null for none); `?inactive=true`: `{"topics": {topic: [channels]}}`
    of unproduced topics."""

    @defer.inlineCallbacks
    def handle_GET(self, request: Request, params: Mapping[str, str]):
        cluster = self.cluster_for(request)
        messages: list[str] = []
        inactive = query_of(request).first("inactive") == "true"
        if inactive:
            found, errors = yield cluster.inactive_topics()
            return {"topics": _check(found, errors, messages), "message": warning(messages)}
        names, errors = yield cluster.topics()
        # No topic is null, as nsqadmin's Go slice that nothing was added to.
        return {"topics": _check(names, errors, messages) or None, "message": warning(messages)}


class Topic(_Endpoint):
    """`GET /api/topics/:topic`: the topic summed across its producers (nsqadmin's TopicStats)."""

    @defer.inlineCallbacks
    def handle_GET(self, request: Request, params: Mapping[str, str]):
        cluster = self.cluster_for(request)
        topic = params["topic"]
        messages: list[str] = []
        producers, errors = yield cluster.topic_producers(topic)
        producers = _check(producers, errors, messages)
        per_node, errors = yield cluster.stats(producers, topic, include_clients=False)
        per_node = _check(per_node, errors, messages)
        if not producers:
            yield self._known_or_502(cluster, topic)
        body = topic_stats(per_node, topic, self.now())
        add_topic_fields(body, per_node, topic, self.now())
        body["message"] = warning(messages)
        return body

    @defer.inlineCallbacks
    def _known_or_502(self, cluster, topic: str):
        """No broker has the topic: still a page when a lookupd knows it (created, not yet produced)."""
        names = None
        if cluster.lookupds:
            names, _ = yield cluster.topics()
        if names is None or topic not in names:
            raise ApiError(502, _NO_NSQD)


class Channel(_Endpoint):
    """`GET /api/topics/:topic/:channel`: the channel summed across producers, with every client."""

    @defer.inlineCallbacks
    def handle_GET(self, request: Request, params: Mapping[str, str]):
        cluster = self.cluster_for(request)
        topic, channel = params["topic"], params["channel"]
        messages: list[str] = []
        producers, errors = yield cluster.topic_producers(topic)
        producers = _check(producers, errors, messages)
        per_node, errors = yield cluster.stats(producers, topic, channel, include_clients=True)
        per_node = _check(per_node, errors, messages)
        body = channel_stats(per_node, topic, channel, self.now())
        if body is not None:
            add_channel_fields(body, per_node, topic, channel)
        if body is None:
            declared = []
            if cluster.lookupds:
                declared, _ = yield cluster.topic_channels(topic)
            if channel not in (declared or ()):
                if not producers:
                    raise ApiError(502, _NO_NSQD)
                raise ApiError(404, "CHANNEL_NOT_FOUND")
            body = _empty_channel(topic, channel)
        body["message"] = warning(messages)
        return body


def _empty_channel(topic: str, channel: str) -> dict[str, Any]:
    """A channel declared on the lookupds that no broker has yet: all zeros."""
    return {"node": "*", "hostname": "", "topic_name": topic, "channel_name": channel, "depth": 0,
            "memory_depth": 0, "backend_depth": 0, "in_flight_count": 0, "deferred_count": 0,
            "requeue_count": 0, "timeout_count": 0, "message_count": 0, "client_count": 0,
            "nodes": [], "clients": None, "paused": False, "e2e_processing_latency": None}


class Nodes(_Endpoint):
    """`GET /api/nodes`: `{"nodes": [Producer]}` (null for none)."""

    @defer.inlineCallbacks
    def handle_GET(self, request: Request, params: Mapping[str, str]):
        cluster = self.cluster_for(request)
        messages: list[str] = []
        producers, errors = yield cluster.producers()
        return {"nodes": _check(producers, errors, messages) or None, "message": warning(messages)}  # none: null


class Node(_Endpoint):
    """`GET /api/nodes/:node`: one broker's topics (per node), total messages and clients."""

    @defer.inlineCallbacks
    def handle_GET(self, request: Request, params: Mapping[str, str]):
        cluster = self.cluster_for(request)
        node = params["node"]
        messages: list[str] = []
        producers, errors = yield cluster.producers()
        producers = _check(producers, errors, messages)
        producer = next((p for p in producers if node_id(p) == node), None)
        if producer is None:
            raise ApiError(404, "NODE_NOT_FOUND")
        per_node, errors = yield cluster.stats([producer], include_clients=True)
        if per_node is None:
            # nsqadmin: the one broker asked failing is not partial.
            raise upstream_error(errors)
        body = node_topics(per_node[0], self.now())
        body["message"] = warning(messages)
        return body


class Counter(_Endpoint):
    """`GET /api/counter`: `{"stats": {"topic:channel:node": {node, topic_name, channel_name, message_count}}}`."""

    @defer.inlineCallbacks
    def handle_GET(self, request: Request, params: Mapping[str, str]):
        cluster = self.cluster_for(request)
        messages: list[str] = []
        producers, errors = yield cluster.producers()
        producers = _check(producers, errors, messages)
        per_node, errors = yield cluster.stats(producers, include_clients=False)
        per_node = _check(per_node, errors, messages)
        return {"stats": counter_stats(per_node, self.now()), "message": warning(messages)}


class Graphite(_Endpoint):
    """`GET /api/graphite?metric=rate&target=T`: nsqadmin's answers with no graphite server to ask.

    mqadmin reads no graphite (its charts poll the brokers), so a valid
    request is nsqadmin's failed graphite query, `500 INTERNAL_ERROR`; bad
    arguments are its `400 INVALID_ARG_METRIC` / `INVALID_ARG_TARGET`.
    """

    def handle_GET(self, request: Request, params: Mapping[str, str]):
        query = query_of(request)
        if query.first("metric") != "rate":
            raise ApiError(400, "INVALID_ARG_METRIC")
        if query.first("target") is None:
            raise ApiError(400, "INVALID_ARG_TARGET")
        raise ApiError(500, "INTERNAL_ERROR")


class Health(_Endpoint):
    """`GET /api/health` (mqd): per broker up/down, /ping text, durable mode, backend, version."""

    @defer.inlineCallbacks
    def handle_GET(self, request: Request, params: Mapping[str, str]):
        cluster = self.cluster_for(request)
        messages: list[str] = []
        rows, errors = yield cluster.health_all()
        return {"nodes": _check(rows, errors, messages), "message": warning(messages)}


class Lookup(_Endpoint):
    """`GET /api/lookup` (mqd): what each lookupd holds, channels with no producer included."""

    @defer.inlineCallbacks
    def handle_GET(self, request: Request, params: Mapping[str, str]):
        cluster = self.cluster_for(request)
        messages: list[str] = []
        rows, errors = yield cluster.lookupd_data()
        if rows and not any(r["up"] for r in rows):
            raise upstream_error(errors)
        messages.extend(errors)
        return {"lookupds": rows, "message": warning(messages)}


def routes(admin: Admin) -> dict[str, AdminEndpoint]:
    """The GET API's route table (web.py merges it with the actions' and the history's)."""
    return {
        "/api/topics": Topics(admin),
        "/api/topics/:topic": Topic(admin),
        "/api/topics/:topic/:channel": Channel(admin),
        "/api/nodes": Nodes(admin),
        "/api/nodes/:node": Node(admin),
        "/api/counter": Counter(admin),
        "/api/graphite": Graphite(admin),
        "/api/health": Health(admin),
        "/api/lookup": Lookup(admin),
    }
