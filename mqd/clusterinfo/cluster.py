"""Who is in the cluster and what each broker says: nsqadmin's clusterinfo queries over `Upstream`.

Every query fans out to all lookupds (or, with no lookupd configured, to
every `--nsqd-http-address`) at once and answers `(result, errors)`: the
union of what the reachable ones said, and one `ErrorLine` per one that
failed (mqd's text, with nsq's Go wording in `.go`). A broker down is then
a `WARNING: ...` in the page, not an empty page, as nsqadmin does it. When
*every* target failed, `result` is None: nsqadmin answers that `502
UPSTREAM_ERROR`. (No target at all, e.g. a topic no broker produces, is an
empty result without errors.) A lookupd's 404 for a topic it never heard
of is no producer there, unless every lookupd answers so: then the topic
is unknown and, as in nsq, every lookupd failed.

Brokers are named as nsqadmin names them, `broadcast_address:http_port`
(`aggregate.node_id`), and queried there; a broker given by
`--nsqd-http-address` is queried at the address it was given (its
broadcast address may not resolve from here). The lookupd and broker
HTTP APIs are nsqd's and nsqlookupd's own, so real nsqd / nsqlookupd work
the same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast
from urllib.parse import urlencode

from twisted.internet import defer
from twisted.python.failure import Failure

from mqd.clusterinfo.aggregate import (
    NodeStats,
    lookupd_producers,
    node_id,
    nsqd_producer,
    producer_row,
)
from mqd.clusterinfo.answers import (
    LOOKUPD_CHANNELS,
    LOOKUPD_LOOKUP,
    LOOKUPD_LOOKUP_WITH_CHANNELS,
    LOOKUPD_NODES,
    LOOKUPD_TOPICS,
    NSQD_INFO,
    NSQD_STATS,
    NSQD_STATS_TOPICS,
    NSQD_TOPICS,
)
from mqd.clusterinfo.upstream import ErrorLine, UpstreamError, base_url, go_line
from mqd.logs import get_logger
from mqd.wire.go_json import GoJSONError, GoType, check_go, unmarshal

__all__ = ["Cluster"]

log = get_logger(__name__)

_LOOKUPD, _NSQD = "nsqlookupd", "nsqd"


def _error_line(failure, kind: str) -> ErrorLine:
    if failure.check(UpstreamError):
        e = failure.value
        return ErrorLine(str(e), go_line(e, kind), kind, e.code, e.refusal(kind))
    log.failure("unexpected failure of an upstream query", failure)
    return ErrorLine(failure.getErrorMessage() or failure.type.__name__, kind=kind)


@defer.inlineCallbacks
def _fan(items: Iterable[Any], call: Callable[[Any], defer.Deferred], kind: str):
    """`call(item)` for every item at once: `[(item, ok, value or ErrorLine)]` in item order.

    `kind` (`nsqlookupd`, `nsqd`) is what the items are, for the error lines.
    """
    items = list(items)
    results = yield defer.DeferredList([defer.maybeDeferred(call, i) for i in items], consumeErrors=True)
    return [(item, ok, value if ok else _error_line(value, kind))
            for item, (ok, value) in zip(items, results, strict=True)]


def _split(answers) -> tuple[list[tuple[Any, Any]], list[ErrorLine]]:
    good = [(item, value) for item, ok, value in answers if ok]
    errors = [value for _, ok, value in answers if not ok]
    return good, errors


def _none_if_all_failed(result: Any, good: list, errors: Sequence[str]) -> Any:
    return None if errors and not good else result


def _sub_failure(failure: Failure) -> Failure:
    """gatherResults' FirstError as the failure of the call that failed."""
    return cast(defer.FirstError, failure.value).subFailure


def _shaped(document: Any, url: str, shape: GoType) -> Any:
    try:
        return check_go(document, shape)
    except GoJSONError as e:
        raise UpstreamError(url, f"unexpected JSON in response: {e}", 200, json_error=str(e)) from None


def _query(params: Mapping[str, Any]) -> str:
    # A name from a request's path keeps its undecodable bytes as surrogates: sent back as those bytes.
    return urlencode([(k, v) for k, v in params.items() if v is not None], errors="surrogateescape")


class Cluster:
    """The queries mqadmin's pages and actions are built on; see the module docstring."""

    def __init__(self, upstream: Any, lookupd_addresses: Iterable[str], nsqd_addresses: Iterable[str]) -> None:
        self.upstream = upstream
        self.lookupds = list(lookupd_addresses or ())
        self.nsqds = list(nsqd_addresses or ())
        # node → base URL, for brokers reached at a configured address rather than their node name.
        self._urls: dict[str, str] = {}
        # Every broker ever listed, so one that left the lookupds shows as down, not as gone.
        self.seen: dict[str, dict[str, Any]] = {}

    # -- addressing ----------------------------------------------------------------------------

    def using(self, upstream: Any) -> Cluster:
        """This cluster queried through another client (one sending a user's secret), its state shared.

        What the cluster learns (the brokers seen, their configured
        addresses) is kept in the same dicts, so a page asked with a user's
        secret adds to what the others see; only the requests differ.
        """
        view = copy.copy(self)
        view.upstream = upstream
        return view

    def node_url(self, node: str) -> str:
        """Base URL of a broker named `broadcast_address:http_port`."""
        return self._urls.get(node) or base_url(node)

    def _lookupd(self, address: str, path: str, shape: GoType, **params: Any) -> defer.Deferred:
        return self._get(base_url(address) + path, shape, params)

    def _nsqd(self, base: str, path: str, shape: GoType, **params: Any) -> defer.Deferred:
        return self._get(base + path, shape, params)

    def _get(self, url: str, shape: GoType, params: Mapping[str, Any]) -> defer.Deferred:
        """The answer at `url` read as nsqadmin reads it into `shape` (clusterinfo.answers).

        One that does not fit is the UpstreamError nsqadmin reports for it,
        so nothing below reads a document of the wrong shape.
        """
        query = _query(params)
        url += "?" + query if query else ""
        return self.upstream.get_json(url).addCallback(_shaped, url, shape)

    def _remember(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self.seen[node_id(row)] = row

    # -- producers -----------------------------------------------------------------------------

    @defer.inlineCallbacks
    def producers(self):
        """Every broker (`/api/nodes` rows): from the lookupds' `/nodes`, else each broker's /info + /stats."""
        if self.lookupds:
            answers = yield _fan(self.lookupds, lambda a: self._lookupd(a, "/nodes", LOOKUPD_NODES), _LOOKUPD)
            good, errors = _split(answers)
            rows = lookupd_producers(good)
        else:
            answers = yield _fan(self.nsqds, self._nsqd_producer, _NSQD)
            good, errors = _split(answers)
            rows = [row for _, row in good]
        self._remember(rows)
        return _none_if_all_failed(rows, good, errors), errors

    @defer.inlineCallbacks
    def _nsqd_producer(self, address: str, topic: str | None = None):
        """A configured broker's producer row (None when `topic` is given and it has no such topic).

        Asked in nsqadmin's order, so a broker down is quoted at the same
        path: /info first for the list of nodes, /stats first for a topic's.
        """
        base = base_url(address)
        info = None if topic is not None else (yield self._nsqd(base, "/info", NSQD_INFO))
        stats = yield self._nsqd(base, "/stats", NSQD_STATS_TOPICS, format="json", topic=topic, include_clients="false",
                                 include_mem="false")
        names = [t.get("topic_name", "") for t in stats.get("topics") or ()]
        if topic is not None and topic not in names:
            return None
        if info is None:
            info = yield self._nsqd(base, "/info", NSQD_INFO)
        row = nsqd_producer(info, names, address.split("://", 1)[-1].rstrip("/"))
        self._urls[node_id(row)] = base
        return row

    @defer.inlineCallbacks
    def topic_producers(self, topic: str):
        """The brokers producing `topic`: the union of the lookupds' `/lookup`, else the brokers that have it."""
        if self.lookupds:
            answers = yield _fan(self.lookupds, lambda a: self._lookupd(a, "/lookup", LOOKUPD_LOOKUP, topic=topic),
                                 _LOOKUPD)
            good, errors = _split(answers)
            if good:
                # A lookupd that never heard of the topic has no producer of it; when no lookupd
                # knows it, every answer is quoted, the 404s too, as nsqadmin reports it.
                errors = [e for e in errors if e.code != 404]
            rows: dict[str, dict[str, Any]] = {}
            for _, doc in good:
                for peer in doc.get("producers") or ():
                    row = producer_row(peer)
                    rows.setdefault(node_id(row), row)
            result = list(rows.values())
        else:
            answers = yield _fan(self.nsqds, lambda a: self._nsqd_producer(a, topic), _NSQD)
            good, errors = _split(answers)
            result = [row for _, row in good if row is not None]
        self._remember(result)
        return _none_if_all_failed(result, good, errors), errors

    @defer.inlineCallbacks
    def _lookup(self, address: str, topic: str):
        """A lookupd's `/lookup?topic=`; one that never heard of the topic is no producer, not an error."""
        try:
            doc = yield self._lookupd(address, "/lookup", LOOKUPD_LOOKUP_WITH_CHANNELS, topic=topic)
        except UpstreamError as e:
            if e.code == 404:
                return {"channels": [], "producers": []}
            raise
        return doc

    # -- topics and channels ---------------------------------------------------------------------

    @defer.inlineCallbacks
    def topics(self):
        """Every topic name, sorted: the lookupds' `/topics` union, else every broker's /stats."""
        if self.lookupds:
            answers = yield _fan(self.lookupds, lambda a: self._lookupd(a, "/topics", LOOKUPD_TOPICS), _LOOKUPD)
            good, errors = _split(answers)
            names = {t for _, doc in good for t in doc.get("topics") or ()}
        else:
            answers = yield _fan(self.nsqds, lambda a: self._nsqd(
                base_url(a), "/stats", NSQD_TOPICS, format="json", include_clients="false", include_mem="false"), _NSQD)
            good, errors = _split(answers)
            names = {t.get("topic_name", "") for _, doc in good for t in doc.get("topics") or ()}
        return _none_if_all_failed(sorted(names), good, errors), errors

    @defer.inlineCallbacks
    def topic_channels(self, topic: str):
        """The channels the lookupds know for `topic` (including ones no broker has), sorted."""
        answers = yield _fan(self.lookupds, lambda a: self._lookupd(a, "/channels", LOOKUPD_CHANNELS, topic=topic),
                             _LOOKUPD)
        good, errors = _split(answers)
        names = {c for _, doc in good for c in doc.get("channels") or ()}
        return _none_if_all_failed(sorted(names), good, errors), errors

    @defer.inlineCallbacks
    def inactive_topics(self):
        """`/api/topics?inactive=true`: `{topic: [channels]}` for topics no broker produces (lookupds only).

        The topics are asked for first in either mode, as nsqadmin asks: a
        broker or lookupd down is its warning (or the 502) here too.
        """
        names, errors = yield self.topics()
        if names is None:
            return None, errors
        found: dict[str, list[str]] = {}
        if not self.lookupds:
            return found, errors
        for name in names:
            # As nsqadmin: failures of these per-topic queries are not reported.
            producers, _ = yield self.topic_producers(name)
            if not producers:
                channels, _ = yield self.topic_channels(name)
                found[name] = channels or []
        return found, errors

    @defer.inlineCallbacks
    def lookupd_data(self):
        """What each lookupd holds (`/api/lookup`): its topics with their channels and producers, its nodes.

        Per lookupd, in configured order: `{"address", "up", "error",
        "topics": [{"topic", "channels", "producers": [node]}], "nodes":
        [producer rows]}`; channels declared with no producer are listed.
        """
        answers = yield _fan(self.lookupds, self._one_lookupd, _LOOKUPD)
        result = []
        errors = []
        for address, ok, value in answers:
            if ok:
                result.append(value)
            else:
                errors.append(value)
                result.append({"address": address, "up": False, "error": value, "topics": [], "nodes": []})
        return result, errors

    @defer.inlineCallbacks
    def _one_lookupd(self, address: str):
        topics_doc, nodes_doc = yield defer.gatherResults(
            [self._lookupd(address, "/topics", LOOKUPD_TOPICS), self._lookupd(address, "/nodes", LOOKUPD_NODES)],
            consumeErrors=True,
        ).addErrback(_sub_failure)
        names = sorted(topics_doc.get("topics") or ())
        lookups = yield defer.gatherResults([self._lookup(address, t) for t in names], consumeErrors=True
                                            ).addErrback(_sub_failure)
        topics = []
        for name, doc in zip(names, lookups, strict=True):
            topics.append({
                "topic": name,
                "channels": sorted(doc.get("channels") or ()),
                "producers": sorted(node_id(p) for p in doc.get("producers") or ()),
            })
        return {"address": address, "up": True, "error": None, "topics": topics,
                "nodes": lookupd_producers([(address, nodes_doc)])}

    # -- stats and health ------------------------------------------------------------------------

    @defer.inlineCallbacks
    def stats(self, producers: Iterable[Mapping[str, Any]], topic: str | None = None,
              channel: str | None = None, include_clients: bool = True):
        """Each producer's `/stats?format=json` (filtered as asked) as `aggregate.NodeStats`."""
        producers = list(producers or ())
        params: dict[str, Any] = {"format": "json", "topic": topic or None,
                                  "channel": channel if topic and channel else None,
                                  "include_clients": None if include_clients else "false",
                                  "include_mem": "false"}

        @defer.inlineCallbacks
        def one(producer):
            node = node_id(producer)
            doc = yield self._nsqd(self.node_url(node), "/stats", NSQD_STATS, **params)
            return NodeStats(node, producer.get("hostname", ""), doc)

        answers = yield _fan(producers, one, _NSQD)
        good, errors = _split(answers)
        return _none_if_all_failed([ns for _, ns in good], good, errors), errors

    @defer.inlineCallbacks
    def health(self, producer: Mapping[str, Any] | str):
        """One broker's liveness and store: `/ping`, /info's version, `/config/durable` and `/config/backend`.

        mqd answers the two /config options; nsqd has neither (400
        INVALID_OPTION), which gives `durable`/`backend` null. A broker that
        does not answer is `up: false` with its error line.
        """
        node = producer if isinstance(producer, str) else node_id(producer)
        known = self.seen.get(node, {}) if isinstance(producer, str) else producer
        base = self.node_url(node)
        row: dict[str, Any] = {"node": node, "address": base, "hostname": known.get("hostname", ""),
                               "up": False, "healthy": False, "ping": None, "durable": None,
                               "backend": None, "version": known.get("version") or None,
                               "start_time": None, "error": None}
        answers = yield _fan(["/ping", "/info", "/config/durable", "/config/backend"],
                             lambda path: self.upstream.get(base + path), _NSQD)
        results = {path: (ok, value) for path, ok, value in answers}
        ok, ping = results["/ping"]
        if not ok:
            row["error"] = ping
            return row, [ping]
        code, body = ping
        text = body.decode("utf-8", "replace").strip()
        row.update(up=True, healthy=code == 200 and text == "OK", ping=text)
        ok, info = results["/info"]
        if ok and info[0] == 200:
            doc = _json_or_none(info[1])
            if isinstance(doc, dict):
                row["version"] = doc.get("version") or row["version"]
                row["start_time"] = doc.get("start_time")
                row["hostname"] = doc.get("hostname") or row["hostname"]
        ok, durable = results["/config/durable"]
        if ok and durable[0] == 200:
            value = _json_or_none(durable[1])
            row["durable"] = value if isinstance(value, bool) else None
        ok, backend = results["/config/backend"]
        if ok and backend[0] == 200:
            # nsqd's V1 answer sends a string option unquoted; accept it quoted too.
            text = backend[1].decode("utf-8", "replace").strip()
            value = _json_or_none(backend[1])
            row["backend"] = value if isinstance(value, str) else text
        return row, []

    @defer.inlineCallbacks
    def health_all(self):
        """`/api/health`: every broker listed now, seen before or configured, with `health`; `registered` if listed now."""
        producers, errors = yield self.producers()
        listed = {node_id(p): p for p in producers or ()}
        nodes = sorted(set(listed) | set(self.seen))
        if not self.lookupds:
            # A configured broker never reached yet is still one to show as down.
            reached = {self.node_url(n) for n in nodes}
            nodes += [a for a in self.nsqds if base_url(a) not in reached]
        answers = yield _fan(nodes, lambda n: self.health(listed.get(n) or n), _NSQD)
        rows = []
        for node, ok, value in answers:
            if not ok:
                errors.append(value)
                continue
            row, errs = value
            row["registered"] = node in listed
            rows.append(row)
            errors.extend(errs)
        if producers is None and not rows:
            return None, errors
        return rows, errors


def _json_or_none(body: bytes) -> Any:
    try:
        return unmarshal(body)
    except GoJSONError:
        return None
