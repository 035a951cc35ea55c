"""mqadmin's writes: nsqadmin's actions fanned out to lookupds and brokers, and /config/:opt.

The actions are nsqadmin's (`nsqadmin/http.go`, `internal/clusterinfo/data.go`),
with the same paths, bodies, error texts and fan-out:

* `POST /api/topics {"topic", "channel"?}`: `/topic/create` on every lookupd,
  then `/channel/create` on every lookupd and on every broker producing the
  topic. nsqadmin only declares on lookupds, which does nothing in a cluster
  without one; there mqadmin creates the topic (and channel) on every
  `--nsqd-http-address` instead.
* `POST /api/topics/:topic[/:channel] {"action": pause|unpause|empty}`: the
  broker endpoint on every producer of the topic.
* `DELETE /api/topics/:topic[/:channel]`: the producers are found *first*
  (once lookupds forget the topic they can no longer say who has it), then
  every lookupd forgets it, then every producer deletes it. Lookupds go first
  so a broker does not re-register it in between (as nsqadmin orders it).
* `DELETE /api/nodes/:node {"topic"}`: tombstone on every lookupd, then
  `/topic/delete` on that broker. Only a node of the cluster: one no
  lookupd (or configured broker) reports is `404 NODE_NOT_FOUND` and
  nothing is asked of anyone (nsqadmin asks whatever address it is given
  for `/info` and deletes the topic there).

A target that fails does not stop the others: every answer carries
nsqadmin's `"message"` (empty, or `WARNING: ...` naming each failure) and,
an mqd addition, `"results"`: one `{"target", "address", "path", "ok",
"error"}` per request made, so one broker down does not hide that the
others did what was asked. Only when nothing succeeded and something failed
is the answer `502 UPSTREAM_ERROR: ...`, as nsqadmin answers a total failure
(401 or 403 when a target refused the secret, each refusal naming its node).

Every request to a broker or lookupd carries the request's own
`Authorization: Bearer` header when it has one (a reverse proxy's, for
its user), else mqadmin's `--http-client-auth-secret`, if any
(endpoint.AdminEndpoint.upstream_for).

Writes are privileged as nsqadmin's: with any `--admin-user` set, the user
a reverse proxy names in `--acl-http-header` must be one of them, else
`403 FORBIDDEN`. Each action done is POSTed as nsqadmin's JSON event to
`--notification-http-endpoint` (mqd.admin.notify), in order, never holding up or
failing the action.

mqd additions: `GET /api/peek/:topic/:channel` (every producer's
`/channel/peek`, per node; reads nothing away) and `POST /api/snapshot/:node`
(the broker's `/snapshot`, whose answer or error is passed on). Both
reach the brokers with that secret, which they ask about when they have
auth configured (mqd.http.authorization), and hand a broker's 401
or 403 back.
`GET/PUT /config/:opt` are nsqadmin's, for clients in
`--allow-config-from-cidr` only (mqd.admin.config).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from twisted.internet.defer import Deferred, gatherResults, maybeDeferred
from twisted.web.server import Request

from mqd.admin.config import AdminConfig
from mqd.admin.endpoint import (
    Admin,
    AdminEndpoint,
    ApiError,
    go_lines,
    refusal_status,
    upstream_error,
)
from mqd.clusterinfo.aggregate import node_id
from mqd.clusterinfo.upstream import UpstreamError, base_url, error_text, go_line, reason_of
from mqd.http.args import count_arg, max_body_arg, query_of, state_arg
from mqd.http.endpoint import read_body
from mqd.logs import get_logger
from mqd.names import QUEUE_STATES, is_valid_name
from mqd.wire.go_json import GoJSONError, decode_go_object, unmarshal

__all__ = ["ACTIONS", "PEEK_ANSWER_MAX", "SNAPSHOT_TIMEOUT", "ActionEndpoint", "ActionRun", "post_all", "routes"]

log = get_logger(__name__)

ACTIONS = ("pause", "unpause", "empty")

# How long a snapshot proxy waits for the broker (its own CLI's default):
# the copy of a store of many GB takes far longer than an admin action.
SNAPSHOT_TIMEOUT = 600.0
# The most of one broker's peek answer mqadmin reads (4 times a broker's default
# --peek-max-bytes); a longer one is that node's error.
PEEK_ANSWER_MAX = 16 << 20


def routes(admin: Admin) -> dict[str, AdminEndpoint]:
    """The write routes, merged with api.py's reads on the same patterns by web.merge_routes."""
    return {
        "/api/topics": CreateTopicChannel(admin),
        "/api/topics/:topic": TopicActions(admin),
        "/api/topics/:topic/:channel": ChannelActions(admin),
        "/api/nodes/:node": TombstoneNode(admin),
        "/api/peek/:topic/:channel": Peek(admin),
        "/api/snapshot/:node": SnapshotNode(admin),
        "/config/:opt": AdminConfig(admin),
    }


# -- addresses, requests -------------------------------------------------------------------


# A target of a fan-out: its name in the answer (a lookupd's address, a broker's
# node name) and the base URL it is reached at.
Target = tuple[str, str]


def _url(base: str, path: str, params: Mapping[str, str] | None = None) -> str:
    """`BASE/path?query`, the query escaped as Go's QueryEscape does.

    A name from a request's path keeps its undecodable bytes as surrogates
    (mqd.nsqd.http.site decodes paths so): they are sent as those bytes.
    """
    return base + path + ("?" + urlencode(params, errors="surrogateescape") if params else "")


def _failure_text(failure, url: str) -> str:
    """A failed request's line; anything but an UpstreamError is a bug here, logged in full."""
    if not failure.check(UpstreamError):
        log.failure("request to {url} failed unexpectedly", failure, url=url)
    return reason_of(failure.value)


def _result(target: str, address: str, path: str, error: str | None, go: str | None = None,
            code: int | None = None) -> dict[str, Any]:
    """One request's entry of `results`; `_go` and `_code` (taken out before answering) are nsq's
    wording of its error and the status of the answer that was one."""
    return {"target": target, "address": address, "path": path, "ok": error is None, "error": error,
            "_go": go if go is not None else error, "_code": code}


def _failed_result(failure, target: str, address: str, path: str, url: str) -> dict[str, Any]:
    text = _failure_text(failure, url)
    if not failure.check(UpstreamError):
        return _result(target, address, path, text)
    error = failure.value
    # A refusal names its node as every page does: `nsqlookupd HOST:PORT` (the result's target says `lookupd`).
    kind = "nsqlookupd" if target == "lookupd" else target
    return _result(target, address, path, text, go_line(error, kind), error.code)


def _post_one(upstream: Any, target: str, address: str, base: str, path: str,
              params: Mapping[str, str],
              fields: Callable[[bytes], Mapping[str, Any]] | None = None) -> Deferred[dict[str, Any]]:
    """POST one admin endpoint; fires with its result, never fails.

    `fields(body)`, when given, adds what a 200 answer reports to the result
    (a replay's offsets).
    """
    url = _url(base, path, params)
    log.debug("querying {target} {url}", target=target, url=url)
    d = maybeDeferred(upstream.post, url)

    def answered(answer: tuple[int, bytes]) -> dict[str, Any]:
        status, body = answer
        if status == 200:
            result = _result(target, address, path, None)
            if fields is not None:
                result.update(fields(body))
            return result
        return _result(target, address, path, error_text(status, body),
                       UpstreamError(url, "", status, body, "POST").go_text, status)

    d.addCallbacks(answered, _failed_result, errbackArgs=(target, address, path, url))
    return d


async def post_all(upstream: Any, target: str, targets: Iterable[Target], path: str,
                    params: Mapping[str, str],
                    fields: Callable[[bytes], Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """POST `path` to every target at once (through `upstream`); their results in the targets' order."""
    return list(await gatherResults([_post_one(upstream, target, name, base, path, params, fields)
                                     for name, base in targets]))


def _warning(problems: Sequence[str]) -> str:
    """nsqadmin's `message`: empty, or every failure after `WARNING: `."""
    return "WARNING: " + "; ".join(problems) if problems else ""


def _broker_refusal(request: Request, code: int, message: str) -> ApiError:
    """A broker's own error answer as mqadmin's; a 401 asks for a bearer secret as the broker did."""
    if code == 401:
        request.setHeader(b"WWW-Authenticate", b"Bearer")
    return ApiError(code, message)


class ActionRun:
    """One action's outcome: every request's result, and the failures to report.

    `problems` are mqd's lines (for the log: which target, which path);
    the answer's `message` words them as nsqadmin does, nsq's client error
    for each (`got response 404 Not Found "..."`), one per line.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.results: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.go: list[str] = []
        self.codes: list[int | None] = []

    def note(self, errors: Iterable[str]) -> None:
        """Failures met while finding the targets (a lookupd that did not answer)."""
        for e in errors:
            self.problems.append(e)
            self.go.append(getattr(e, "go", e))
            self.codes.append(getattr(e, "code", None))

    def add(self, results: Iterable[dict[str, Any]]) -> None:
        for r in results:
            go = r.pop("_go")
            code = r.pop("_code")
            self.results.append(r)
            if not r["ok"]:
                self.problems.append(f"{r['target']} {r['address']} {r['path']}: {r['error']}")
                self.go.append(go)
                self.codes.append(code)

    def answer(self) -> dict[str, Any]:
        """The JSON answer; 502 when something failed and nothing succeeded (401/403 when a secret was refused)."""
        if self.problems and not any(r["ok"] for r in self.results):
            log.error("failed to {what} - {errors}", what=self.what, errors="; ".join(self.problems))
            raise ApiError(refusal_status(self.codes) or 502, "UPSTREAM_ERROR: " + go_lines(self.go))
        if self.problems:
            log.warn("{what}: {errors}", what=self.what, errors="; ".join(self.problems))
        return {"message": "WARNING: " + go_lines(self.go) if self.go else "", "results": self.results}


# -- the endpoints -------------------------------------------------------------------------


class ActionEndpoint(AdminEndpoint):
    """An endpoint that changes the cluster: admin users only, and each action notified."""

    def authorize(self, request: Request) -> None:
        """nsqadmin's isAuthorizedAdminRequest: 403 FORBIDDEN unless the proxy's user is an admin user."""
        settings = self.admin.settings
        users = settings.admin_user
        if not users:
            return
        values = request.requestHeaders.getRawHeaders(settings.acl_http_header) or [""]
        if values[0] not in users:
            log.info("{method} {uri} refused: user {user!r} is not an admin user",
                     method=request.method.decode("ascii", "replace"),
                     uri=request.uri.decode("ascii", "replace"), user=values[0])
            raise ApiError(403, "FORBIDDEN")

    def notify(self, request: Request, action: str, topic: str, channel: str = "", node: str = "") -> None:
        notifier = self.admin.notifier
        if notifier is not None:
            notifier.notify(request, action, topic, channel, node)

    def lookupds(self) -> list[Target]:
        return [(a, base_url(a)) for a in self.admin.settings.lookupd_http_address]

    def node(self, node: str) -> Target:
        """A broker by node name, reached where the cluster reaches it (its configured address, if any)."""
        return node, self.admin.cluster.node_url(node)

    async def known_node(self, request: Request, node: str) -> None:
        """404 NODE_NOT_FOUND unless `node` is a broker the cluster reports; 502 when none could be asked.

        The same check for every action on one node, so a request cannot make
        mqadmin POST to an address of its choosing.
        """
        producers, errors = await self.cluster_for(request).producers()
        if node not in {node_id(p) for p in producers or ()}:
            if errors and not producers:
                raise upstream_error(errors)
            raise ApiError(404, "NODE_NOT_FOUND")

    async def producers_of(self, request: Request, run: ActionRun, topic: str) -> list[Target]:
        """The topic's producers (lookupds' /lookup, or each broker's /stats); 502 when none could say.

        As nsqadmin: when no lookupd answered (or every one said 404, an
        unknown topic) nothing is done and the answer is its 502.
        """
        producers, errors = await self.cluster_for(request).topic_producers(topic)
        if producers is None:
            raise upstream_error(errors)
        run.note(errors)
        return [self.node(node_id(p)) for p in producers or ()]


class CreateTopicChannel(ActionEndpoint):
    """`POST /api/topics {"topic", "channel"?}`: declare on every lookupd (see the module doc)."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> Deferred:
        self.authorize(request)
        try:
            body = decode_go_object(read_body(request), ("topic", "channel"))
        except GoJSONError as e:
            raise ApiError(400, str(e)) from None
        topic, channel = body["topic"], body["channel"]
        if not is_valid_name(topic):
            raise ApiError(400, "INVALID_TOPIC")
        if channel and not is_valid_name(channel):
            raise ApiError(400, "INVALID_CHANNEL")
        return Deferred.fromCoroutine(self.create(request, topic, channel))

    async def create(self, request: Request, topic: str, channel: str) -> dict[str, Any]:
        run = ActionRun("create topic/channel")
        upstream = self.upstream_for(request)
        lookupds = self.lookupds()
        both = {"topic": topic, "channel": channel}
        if lookupds:
            run.add(await post_all(upstream, "lookupd", lookupds, "/topic/create", {"topic": topic}))
            if channel:
                run.add(await post_all(upstream, "lookupd", lookupds, "/channel/create", both))
                producers = await self.producers_of(request, run, topic)
                run.add(await post_all(upstream, "nsqd", producers, "/channel/create", both))
        else:
            brokers = [(a, base_url(a)) for a in self.admin.settings.nsqd_http_address]
            run.add(await post_all(upstream, "nsqd", brokers, "/topic/create", {"topic": topic}))
            if channel:
                run.add(await post_all(upstream, "nsqd", brokers, "/channel/create", both))
        answer = run.answer()
        self.notify(request, "create_topic", topic)
        if channel:
            self.notify(request, "create_channel", topic, channel)
        return answer


class _TopicChannelActions(ActionEndpoint):
    """POST {"action"} and DELETE on a topic or one of its channels."""

    def names(self, params: Mapping[str, str]) -> tuple[str, str]:
        return params["topic"], params.get("channel", "")

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> Deferred:
        self.authorize(request)
        try:
            action = decode_go_object(read_body(request), ("action",))["action"]
        except GoJSONError as e:
            raise ApiError(400, str(e)) from None
        if action not in ACTIONS:
            raise ApiError(400, "INVALID_ACTION")
        return Deferred.fromCoroutine(self.act(request, action, *self.names(params)))

    def handle_DELETE(self, request: Request, params: Mapping[str, str]) -> Deferred:
        self.authorize(request)
        return Deferred.fromCoroutine(self.delete(request, *self.names(params)))

    async def act(self, request: Request, action: str, topic: str, channel: str) -> dict[str, Any]:
        kind = "channel" if channel else "topic"
        run = ActionRun(f"{action} {kind}")
        upstream = self.upstream_for(request)
        producers = await self.producers_of(request, run, topic)
        query = {"topic": topic, "channel": channel} if channel else {"topic": topic}
        run.add(await post_all(upstream, "nsqd", producers, f"/{kind}/{action}", query))
        answer = run.answer()
        self.notify(request, f"{action}_{kind}", topic, channel)
        return answer

    async def delete(self, request: Request, topic: str, channel: str) -> dict[str, Any]:
        kind = "channel" if channel else "topic"
        run = ActionRun(f"delete {kind}")
        upstream = self.upstream_for(request)
        # Found before the lookupds forget the topic, after which they could not say.
        producers = await self.producers_of(request, run, topic)
        query = {"topic": topic, "channel": channel} if channel else {"topic": topic}
        run.add(await post_all(upstream, "lookupd", self.lookupds(), f"/{kind}/delete", query))
        run.add(await post_all(upstream, "nsqd", producers, f"/{kind}/delete", query))
        answer = run.answer()
        self.notify(request, f"delete_{kind}", topic, channel)
        return answer


class TopicActions(_TopicChannelActions):
    """`POST /api/topics/:topic {"action"}` and `DELETE /api/topics/:topic`."""


class ChannelActions(_TopicChannelActions):
    """`POST /api/topics/:topic/:channel {"action"}` and `DELETE /api/topics/:topic/:channel`."""


class TombstoneNode(ActionEndpoint):
    """`DELETE /api/nodes/:node {"topic"}`: tombstone the node's topic on every lookupd, then delete it there."""

    def handle_DELETE(self, request: Request, params: Mapping[str, str]) -> Deferred:
        self.authorize(request)
        try:
            topic = decode_go_object(read_body(request), ("topic",))["topic"]
        except GoJSONError:
            raise ApiError(400, "INVALID_BODY") from None
        if not is_valid_name(topic):
            raise ApiError(400, "INVALID_TOPIC")
        return Deferred.fromCoroutine(self.tombstone(request, topic, params["node"]))

    async def tombstone(self, request: Request, topic: str, node: str) -> dict[str, Any]:
        await self.known_node(request, node)
        run = ActionRun("tombstone node for topic")
        upstream = self.upstream_for(request)
        run.add(await post_all(upstream, "lookupd", self.lookupds(), "/topic/tombstone",
                                {"topic": topic, "node": node}))
        run.add(await post_all(upstream, "nsqd", [self.node(node)], "/topic/delete", {"topic": topic}))
        answer = run.answer()
        self.notify(request, "tombstone_topic_producer", topic, node=node)
        return answer


class Peek(AdminEndpoint):
    """`GET /api/peek/:topic/:channel[?state=S][&n=N][&max_body=B]`: each producer's first messages.

    Nothing is consumed. The names, `state`, `n` and `max_body` are checked
    as the brokers check them (400 INVALID_ARG_TOPIC, INVALID_ARG_CHANNEL,
    INVALID_STATE, INVALID_N, INVALID_MAX_BODY) and
    passed on, with the request's bearer secret (or mqadmin's); each node answers its own
    `total`, `messages` and `more` (mqd's /channel/peek, bounded by the
    broker's --peek-max-bytes; mqadmin reads at most PEEK_ANSWER_MAX of
    it), or an `error` (a broker that is down, or a real nsqd, which has no
    peek: `404 NOT_FOUND`). When no node answered and one refused the
    secret, its 401 or 403 is the answer.
    """

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Deferred:
        # The names as the brokers check them: a name no broker could hold is not asked about.
        if not is_valid_name(params["topic"]):
            raise ApiError(400, "INVALID_ARG_TOPIC")
        if not is_valid_name(params["channel"]):
            raise ApiError(400, "INVALID_ARG_CHANNEL")
        query = query_of(request)
        wanted = {"state": state_arg(query, QUEUE_STATES), "n": str(count_arg(query))}
        max_body = max_body_arg(query, None)
        if max_body is not None:
            wanted["max_body"] = str(max_body)
        return Deferred.fromCoroutine(self.peek(request, params["topic"], params["channel"], wanted))

    async def peek(self, request: Request, topic: str, channel: str, wanted: dict[str, str]) -> dict[str, Any]:
        producers, errors = await self.cluster_for(request).topic_producers(topic)
        problems = list(errors)
        if not producers and problems:
            # As every page words it: a lookupd that refused the secret named, its 401/403 the status.
            raise upstream_error(errors)
        nodes = [node_id(p) for p in producers or ()]
        query = {"topic": topic, "channel": channel, **wanted}
        upstream = self.upstream_for(request)
        answers = await gatherResults([self._peek_one(upstream, node, query) for node in nodes])
        for entry, _ in answers:
            if entry["error"] is not None:
                problems.append(f"nsqd {entry['node']}: {entry['error']}")
        if answers and all(entry["error"] is not None for entry, _ in answers):
            refusals = sorted((code, entry["error"]) for entry, code in answers if code in (401, 403))
            if refusals:
                code, text = refusals[0]
                raise _broker_refusal(request, code, text.partition(" ")[2])
            raise ApiError(502, "UPSTREAM_ERROR: " + "; ".join(problems))
        return {"topic": topic, "channel": channel, "state": wanted["state"],
                "nodes": [entry for entry, _ in answers], "message": _warning(problems)}

    def _peek_one(self, upstream: Any, node: str,
                  query: Mapping[str, str]) -> Deferred[tuple[dict[str, Any], int | None]]:
        """One node's entry, and the status of its error answer (None if it answered or gave none)."""
        url = _url(self.admin.cluster.node_url(node), "/channel/peek", query)
        d = maybeDeferred(upstream.get_json, url, max_bytes=PEEK_ANSWER_MAX)

        def entry(total: Any = None, messages: list | None = None, more: Any = None,
                  error: str | None = None) -> dict[str, Any]:
            return {"node": node, "total": total, "messages": messages or [], "more": more, "error": error}

        def answered(data: Any) -> tuple[dict[str, Any], None]:
            if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
                return entry(error="not a peek answer"), None
            return entry(data.get("total"), data["messages"], data.get("more")), None

        def failed(failure) -> tuple[dict[str, Any], int | None]:
            return entry(error=_failure_text(failure, url)), getattr(failure.value, "code", None)

        d.addCallbacks(answered, failed)
        return d


class SnapshotNode(ActionEndpoint):
    """`POST /api/snapshot/:node`: the broker's POST /snapshot; its path and manifest, or its error.

    Only a node of the cluster (404 NODE_NOT_FOUND otherwise, as
    /api/nodes/:node), so the route cannot be used to make mqadmin POST
    to any address. The broker's own error (507 SNAPSHOT_LIMIT, 503
    STORE_FAILED, 404 NOT_FOUND from a real nsqd, 401/403 from a broker
    with auth configured) is answered as it is.
    """

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> Deferred:
        self.authorize(request)
        return Deferred.fromCoroutine(self.snapshot(request, params["node"]))

    async def snapshot(self, request: Request, node: str) -> dict[str, Any]:
        await self.known_node(request, node)
        url = _url(self.admin.cluster.node_url(node), "/snapshot")
        try:
            status, body = await maybeDeferred(self.upstream_for(request).post, url, timeout=SNAPSHOT_TIMEOUT)
        except Exception as e:
            code = getattr(e, "code", None)
            if code is not None and code >= 400:
                # The broker's own refusal (507 SNAPSHOT_LIMIT, 503 STORE_FAILED, 401/403), passed on as it is.
                message = reason_of(e).partition(" ")[2]
                log.warn("snapshot of {node} refused: {code} {message}", node=node, code=code, message=message)
                raise _broker_refusal(request, code, message) from None
            log.error("snapshot of {node} failed: {error}", node=node, error=reason_of(e))
            raise ApiError(502, f"UPSTREAM_ERROR: {reason_of(e)}") from None
        if status != 200:
            raise ApiError(502, f"UPSTREAM_ERROR: {error_text(status, body)}")
        try:
            data = unmarshal(body)
            answer = {"node": node, "path": data["path"], "manifest": data["manifest"]}
        except (GoJSONError, TypeError, KeyError):
            raise ApiError(502, "UPSTREAM_ERROR: not a snapshot answer") from None
        self.notify(request, "create_snapshot", "", node=node)
        return answer
