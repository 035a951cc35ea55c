"""nsqadmin's numbers: brokers' /stats documents turned into its JSON shapes, summed across producers.

Pure functions over plain dicts (no I/O, no clock: `now` is passed in), so
every sum can be checked against canned /stats documents. Field names and
arithmetic are nsqadmin's (`internal/clusterinfo/types.go`, `data.go`,
`internal/quantile/aggregate.go`), because scripts written against
nsqadmin read them:

* a per-node TopicStats / ChannelStats is the broker's own entry plus
  `node` (the broker's `broadcast_address:http_port`), `hostname`,
  `memory_depth` (= depth − backend_depth) and, for a channel, `topic_name`;
  per-node e2e percentiles gain `min` = `max` = `average` = the value and
  `count` = the node's sample count;
* an aggregate has `node` "*", sums every counter, is `paused` when any
  node is, lists its per-node entries in `nodes` (by hostname), and merges
  e2e percentiles per quantile: max of the maxima, sum of the counts, the
  count-weighted mean of the averages;
* a channel's `clients` are every node's clients, each with its `node`.

Where nsqadmin is plainly wrong this follows what it means instead, and
says so: an aggregated percentile's `min` is the minimum of the nodes'
minima (nsqadmin takes the last node's maximum), and a topic's channels are
aggregated as the channel page aggregates them (nsqadmin's topic page sums
the other nodes into the first node's entry, which then drops out of
`nodes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NodeStats",
    "all_channel_stats",
    "channel_stats",
    "client_sort",
    "counter_stats",
    "e2e_aggregate",
    "lookupd_producers",
    "node_channel",
    "node_client",
    "node_id",
    "node_topic",
    "node_topics",
    "nsqd_producer",
    "producer_row",
    "topic_stats",
    "version_key",
    "warning",
]

_TOPIC_COUNTERS = ("depth", "memory_depth", "backend_depth", "message_count")
_CHANNEL_COUNTERS = ("depth", "memory_depth", "backend_depth", "in_flight_count", "deferred_count",
                     "requeue_count", "timeout_count", "message_count", "client_count")
# Reported only by brokers that count them (newer nsqd's topology experiment): passed on, and
# summed, only when non-zero, as newer nsqadmin omits them; nsqadmin 1.3.0 has none of them.
_TOPOLOGY_COUNTERS = ("delivery_msg_count", "zone_local_msg_count", "region_local_msg_count",
                      "global_msg_count")

_CLIENT_FIELDS: tuple[tuple[str, Any], ...] = (
    ("remote_address", ""), ("version", ""), ("client_id", ""), ("hostname", ""), ("user_agent", ""),
    ("connect_ts", 0),
)
_CLIENT_COUNTERS: tuple[tuple[str, Any], ...] = (
    ("in_flight_count", 0), ("ready_count", 0), ("finish_count", 0), ("requeue_count", 0),
    ("message_count", 0), ("sample_rate", 0), ("deflate", False), ("snappy", False), ("authed", False),
    ("auth_identity", ""), ("auth_identity_url", ""),
)
_CLIENT_TOPOLOGY = ("node_topology_region", "node_topology_zone", "topology_region", "topology_zone")
_CLIENT_TLS: tuple[tuple[str, Any], ...] = (
    ("tls", False), ("tls_cipher_suite", ""), ("tls_version", ""), ("tls_negotiated_protocol", ""),
    ("tls_negotiated_protocol_is_mutual", False),
)


@dataclass(frozen=True)
class NodeStats:
    """One broker's /stats?format=json answer and who it is (`node` = broadcast_address:http_port)."""

    node: str
    hostname: str
    stats: Mapping[str, Any]


def warning(errors: Iterable[str]) -> str:
    """nsqadmin's `message`: empty, or `WARNING: ` and the partial failures joined by `; `."""
    errors = list(errors)
    return "WARNING: " + "; ".join(errors) if errors else ""


def node_id(producer: Mapping[str, Any]) -> str:
    """A broker's name everywhere in nsqadmin: `broadcast_address:http_port` (IPv6 bracketed)."""
    host = str(producer.get("broadcast_address", ""))
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{producer.get('http_port', 0)}"


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


# -- e2e processing latency --------------------------------------------------------------


def _e2e_node(doc: Mapping[str, Any] | None) -> dict[str, Any]:
    """A broker's e2e percentiles as nsqadmin reads them: each value also its min, max, average, count."""
    doc = doc or {}
    count = doc.get("count", 0) or 0
    percentiles = doc.get("percentiles")
    if percentiles is not None:
        # nsqd's percentiles are Go maps, which encode their keys sorted; nsqadmin adds four.
        percentiles = [
            dict(sorted({**p, "min": p.get("value", 0), "max": p.get("value", 0),
                         "average": p.get("value", 0), "count": count}.items()))
            for p in percentiles
        ]
    return {"count": count, "percentiles": percentiles, "topic": doc.get("topic", ""),
            "channel": doc.get("channel", ""), "host": doc.get("host", "")}


def e2e_aggregate(nodes: Iterable[Mapping[str, Any]], topic: str, channel: str = "") -> dict[str, Any]:
    """Per-node e2e documents (as `_e2e_node` gives them) merged per quantile, first-seen order."""
    total = 0
    merged: list[dict[str, float]] = []
    by_quantile: dict[float, dict[str, float]] = {}
    for e2e in nodes:
        total += e2e.get("count", 0) or 0
        for value in e2e.get("percentiles") or ():
            q = value.get("quantile", 0)
            p = by_quantile.get(q)
            if p is None:
                p = {"quantile": q, "max": value.get("max", 0), "min": value.get("min", 0),
                     "count": 0, "average": 0}
                by_quantile[q] = p
                merged.append(p)
            else:
                p["max"] = max(p["max"], value.get("max", 0))
                p["min"] = min(p["min"], value.get("min", 0))
            p["count"] += value.get("count", 0)
            if p["count"] == 0:
                p["average"] = 0
                continue
            p["average"] += (value.get("average", 0) - p["average"]) * value.get("count", 0) / p["count"]
    for p in merged:
        p["average"] = _num(p["average"])
        # An addition: nsqadmin's merged percentiles have no `value` (its topic page keeps the first
        # node's); here it is the merged estimate its pages show, the count-weighted average.
        p["value"] = p["average"]
    percentiles = [dict(sorted(p.items())) for p in merged] or None
    return {"count": total, "percentiles": percentiles, "topic": topic, "channel": channel, "host": "*"}


# -- per node -----------------------------------------------------------------------------


def node_client(node: str, doc: Mapping[str, Any], now: float) -> dict[str, Any]:
    """A ClientStats row: the broker's client plus its `node` and `connected` (nanoseconds, as Go's Duration)."""
    row: dict[str, Any] = {"node": node}
    for key, default in _CLIENT_FIELDS:
        row[key] = doc.get(key, default)
    row["connected"] = (int(now) - int(row["connect_ts"] or 0)) * 1_000_000_000
    for key, default in _CLIENT_COUNTERS:
        row[key] = doc.get(key, default)
    for key in _CLIENT_TOPOLOGY:
        if doc.get(key):
            row[key] = doc[key]
    for key, default in _CLIENT_TLS:
        row[key] = doc.get(key, default)
    return row


def _clients(node: str, docs: Iterable[Mapping[str, Any]] | None, now: float) -> list[dict[str, Any]] | None:
    if docs is None:
        return None
    return [node_client(node, c, now) for c in docs]


def _topology(row: dict[str, Any], doc: Mapping[str, Any]) -> None:
    for key in _TOPOLOGY_COUNTERS:
        if doc.get(key):
            row[key] = doc[key]


def node_channel(node: str, hostname: str, topic: str, doc: Mapping[str, Any], now: float) -> dict[str, Any]:
    """One broker's ChannelStats as nsqadmin shows it in a `nodes` list."""
    depth, backend = doc.get("depth", 0), doc.get("backend_depth", 0)
    row: dict[str, Any] = {
        "node": node, "hostname": hostname, "topic_name": topic, "channel_name": doc.get("channel_name", ""),
        "depth": depth, "memory_depth": depth - backend, "backend_depth": backend,
        "in_flight_count": doc.get("in_flight_count", 0), "deferred_count": doc.get("deferred_count", 0),
        "requeue_count": doc.get("requeue_count", 0), "timeout_count": doc.get("timeout_count", 0),
        "message_count": doc.get("message_count", 0),
    }
    _topology(row, doc)
    clients = doc.get("clients")
    row["client_count"] = doc.get("client_count", len(clients) if clients else 0)
    row["nodes"] = None
    row["clients"] = _clients(node, clients, now)
    row["paused"] = bool(doc.get("paused", False))
    row["e2e_processing_latency"] = _e2e_node(doc.get("e2e_processing_latency"))
    return row


def node_topic(node: str, hostname: str, doc: Mapping[str, Any], now: float) -> dict[str, Any]:
    """One broker's TopicStats as nsqadmin shows it (its channels per node too)."""
    name = doc.get("topic_name", "")
    depth, backend = doc.get("depth", 0), doc.get("backend_depth", 0)
    row: dict[str, Any] = {
        "node": node, "hostname": hostname, "topic_name": name,
        "depth": depth, "memory_depth": depth - backend, "backend_depth": backend,
        "message_count": doc.get("message_count", 0),
    }
    _topology(row, doc)
    row["nodes"] = None
    row["channels"] = [node_channel(node, hostname, name, c, now) for c in doc.get("channels") or ()]
    row["paused"] = bool(doc.get("paused", False))
    row["e2e_processing_latency"] = _e2e_node(doc.get("e2e_processing_latency"))
    return row


def _topics_of(stats: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(stats.get("topics") or ())


def _by_host(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # nsqadmin sorts by hostname alone; the node breaks ties so two brokers on one host keep an order.
    return sorted(rows, key=lambda r: (r.get("hostname", ""), r.get("node", "")))


# -- aggregates ------------------------------------------------------------------------------


def _sum_into(total: dict[str, Any], row: Mapping[str, Any], counters: Iterable[str]) -> None:
    for key in counters:
        if key in row:
            total[key] = total.get(key, 0) + row[key]


def _aggregate_channel(topic: str, channel: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"node": "*", "hostname": "", "topic_name": topic, "channel_name": channel}
    for key in _CHANNEL_COUNTERS:
        total[key] = 0
    for row in rows:
        _sum_into(total, row, _CHANNEL_COUNTERS + _TOPOLOGY_COUNTERS)
    # Keep nsqadmin's key order: client_count, nodes, clients, paused, e2e last.
    client_count = total.pop("client_count")
    total["client_count"] = client_count
    nodes = _by_host(rows)
    total["nodes"] = nodes
    # As nsqadmin appends them: null, not [], when no node has a client (or clients were not asked).
    clients = [c for r in nodes if r["clients"] is not None for c in r["clients"]]
    total["clients"] = sorted(clients, key=lambda c: c.get("hostname", "")) or None
    total["paused"] = any(r["paused"] for r in rows)
    total["e2e_processing_latency"] = e2e_aggregate(
        (r["e2e_processing_latency"] for r in nodes), topic, channel)
    return total


def all_channel_stats(per_node: Iterable[NodeStats], now: float,
                      topic: str | None = None) -> dict[str, dict[str, Any]]:
    """Every channel aggregated across brokers, keyed `topic:channel` (nsqadmin's GetNSQDStats map).

    With `topic`, only that topic's channels, keyed by channel name alone.
    """
    rows: dict[str, list[dict[str, Any]]] = {}
    names: dict[str, tuple[str, str]] = {}
    for ns in per_node:
        for t in _topics_of(ns.stats):
            tname = t.get("topic_name", "")
            if topic is not None and tname != topic:
                continue
            for c in t.get("channels") or ():
                cname = c.get("channel_name", "")
                key = cname if topic is not None else f"{tname}:{cname}"
                rows.setdefault(key, []).append(node_channel(ns.node, ns.hostname, tname, c, now))
                names[key] = (tname, cname)
    return {key: _aggregate_channel(*names[key], r) for key, r in rows.items()}


def channel_stats(per_node: Iterable[NodeStats], topic: str, channel: str, now: float) -> dict[str, Any] | None:
    """`/api/topics/:topic/:channel`: the channel across brokers, clients sorted by node; None if none has it."""
    found = all_channel_stats(per_node, now, topic).get(channel)
    if found is not None and found["clients"] is not None:
        found["clients"] = client_sort(found["clients"])
    return found


def client_sort(clients: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """nsqadmin's channel page order: by node, then clients in the node's zone and region first."""

    def key(c: Mapping[str, Any]) -> tuple[Any, ...]:
        region, zone = c.get("node_topology_region", ""), c.get("node_topology_zone", "")
        c_region, c_zone = c.get("topology_region", ""), c.get("topology_zone", "")
        exact = c_region == region and c_zone == zone
        return (c.get("node", ""), not exact, c_region != region, c_region, c_zone)

    return sorted(clients, key=key)


def topic_stats(per_node: Iterable[NodeStats], topic: str, now: float) -> dict[str, Any]:
    """`/api/topics/:topic`: the topic summed over its brokers, with `nodes` and aggregated `channels`.

    No broker with the topic gives nsqadmin's empty TopicStats (zeros,
    `nodes`/`channels`/`e2e_processing_latency` null).
    """
    per_node = list(per_node)
    rows = [node_topic(ns.node, ns.hostname, t, now)
            for ns in per_node for t in _topics_of(ns.stats) if t.get("topic_name") == topic]
    total: dict[str, Any] = {"node": "", "hostname": "", "topic_name": topic}
    for key in _TOPIC_COUNTERS:
        total[key] = 0
    if not rows:
        total.update({"nodes": None, "channels": None, "paused": False, "e2e_processing_latency": None})
        return total
    total["node"] = "*"
    for row in rows:
        _sum_into(total, row, _TOPIC_COUNTERS + _TOPOLOGY_COUNTERS)
    nodes = _by_host(rows)
    total["nodes"] = nodes
    channels = all_channel_stats(per_node, now, topic)
    # The order nsqadmin builds them in: first seen over the hostname-sorted nodes.
    order: list[str] = []
    for row in nodes:
        for c in row["channels"]:
            if c["channel_name"] not in order:
                order.append(c["channel_name"])
    for name in order:
        # nsqadmin's topic page leaves a channel's e2e unnamed.
        channels[name]["e2e_processing_latency"].update(topic="", channel="")
    total["channels"] = [channels[name] for name in order] or None
    total["paused"] = any(r["paused"] for r in rows)
    total["e2e_processing_latency"] = e2e_aggregate((r["e2e_processing_latency"] for r in nodes), topic)
    return total


def node_topics(node: NodeStats, now: float) -> dict[str, Any]:
    """`/api/nodes/:node`'s body (without `message`): the broker's topics, its message and client totals."""
    topics = [node_topic(node.node, node.hostname, t, now) for t in _topics_of(node.stats)]
    total_clients = sum(len(c["clients"] or ()) for t in topics for c in t["channels"])
    total_messages = sum(t["message_count"] for t in topics)
    return {"node": node.node, "topics": topics, "total_messages": total_messages,
            "total_clients": total_clients}


def counter_stats(per_node: Iterable[NodeStats], now: float) -> dict[str, dict[str, Any]]:
    """`/api/counter`'s `stats`: messages per channel per broker, keyed `topic:channel:node`."""
    rows: dict[str, dict[str, Any]] = {}
    for channel in all_channel_stats(per_node, now).values():
        for node in channel["nodes"]:
            key = f"{channel['topic_name']}:{channel['channel_name']}:{node['node']}"
            row = rows.setdefault(key, {"node": node["node"], "topic_name": channel["topic_name"],
                                        "channel_name": channel["channel_name"], "message_count": 0})
            row["message_count"] += node["message_count"]
    # nsqadmin marshals a Go map: its keys come out in byte order.
    return dict(sorted(rows.items()))


# -- producers ------------------------------------------------------------------------------


def version_key(version: str) -> tuple[Any, ...]:
    """Semver order of `1.3.0`, `1.2.1-alpha` (pre-releases first); unparsable is 0.0.0 as nsqadmin has it."""
    core, _, pre = str(version).partition("+")[0].partition("-")
    parts = core.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return (0, 0, 0, 1, ())
    ids = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")) if pre else ()
    return (*(int(p) for p in parts), 0 if pre else 1, ids)


def producer_row(peer: Mapping[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "remote_addresses": None,
        "remote_address": peer.get("remote_address", ""),
        "hostname": peer.get("hostname", ""),
        "broadcast_address": peer.get("broadcast_address", ""),
        "tcp_port": peer.get("tcp_port", 0),
        "http_port": peer.get("http_port", 0),
        "version": peer.get("version", ""),
    }
    for key in ("topology_zone", "topology_region"):
        if peer.get(key):
            row[key] = peer[key]
    topics = peer.get("topics")
    if topics:
        tombstones = (list(peer.get("tombstones") or ()) + [False] * len(topics))[:len(topics)]
        row["topics"] = sorted(({"topic": t, "tombstoned": bool(ts)} for t, ts in zip(topics, tombstones, strict=True)),
                               key=lambda pt: pt["topic"])
    else:
        row["topics"] = None
    row["out_of_date"] = False
    return row


def lookupd_producers(answers: Iterable[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """`/api/nodes` from lookupds: each lookupd's `/nodes` producers, one row per broker.

    A broker is keyed by `broadcast_address:tcp_port`; the first lookupd to
    list it gives the row and every lookupd adds `lookupd/remote_address` to
    `remote_addresses` (fewer than the lookupds: it is not registered with
    all of them). `out_of_date` marks brokers older than the newest one.
    Rows sorted by hostname.
    """
    rows: dict[str, dict[str, Any]] = {}
    for lookupd, doc in answers:
        for peer in doc.get("producers") or ():
            key = f"{peer.get('broadcast_address', '')}:{peer.get('tcp_port', 0)}"
            row = rows.get(key)
            if row is None:
                row = rows[key] = producer_row(peer)
                row["remote_addresses"] = []
            row["remote_addresses"].append(f"{lookupd}/{peer.get('remote_address') or 'N/A'}")
    newest = max((version_key(r["version"]) for r in rows.values()), default=())  # (): no rows
    for row in rows.values():
        row["out_of_date"] = version_key(row["version"]) < newest
    return sorted(rows.values(), key=lambda r: r["hostname"])


def nsqd_producer(info: Mapping[str, Any], topics: Iterable[str] | None = None,
                  address: str = "") -> dict[str, Any]:
    """`/api/nodes` row for a broker given by --nsqd-http-address: its /info and the topics of its /stats.

    A broker too old to say its broadcast address or hostname is named by
    the address it was reached at, as nsqadmin does.
    """
    peer = dict(info)
    if not peer.get("broadcast_address") and address:
        host, _, port = address.rpartition(":")
        peer["broadcast_address"] = host.strip("[]")
        peer["http_port"] = int(port) if port.isdigit() else 0
    if not peer.get("hostname") and address:
        peer["hostname"] = address.rpartition(":")[0].strip("[]")
    peer["topics"] = list(topics or ())
    row = producer_row(peer)
    return row
