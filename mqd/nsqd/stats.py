"""What nsqd's GET /stats reports, as JSON and as its text page.

nsqadmin, nsq_stat, nsq_tail and monitoring scripts read `/stats?format=json`
field by field, so the schema is nsqd 1.3.0's exactly (`nsqd/stats.go`,
`nsqd/client_v2.go`, `nsqd/http.go` doStats/printStats), including its
null-versus-[] quirks; the text page is reproduced line by line because
people diff and grep it. /metrics and statsd are built from the same
numbers (`stats_json`), so all three always agree.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from collections import deque
from datetime import datetime
from typing import TYPE_CHECKING, Any

from mqd import NSQ_VERSION, __version__
from mqd.latency import disabled_result, merged_result

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mqd.nsqd.broker import Broker
    from mqd.nsqd.channel import Channel
    from mqd.nsqd.protocol.client import ClientV2
    from mqd.nsqd.protocol.v2 import V2Protocol
    from mqd.nsqd.topic import Topic

__all__ = [
    "go_duration",
    "health_text",
    "memory_stats",
    "nanoseconds_to_human",
    "retention_json",
    "stats_json",
    "stats_text",
]


# -- memory -------------------------------------------------------------------------

# The last 256 GC pauses (ns), like Go's MemStats.PauseNs ring, measured with
# gc.callbacks; the callbacks run once per collection, never per message.
_gc_pauses: deque[int] = deque(maxlen=256)
_gc_started: list[int] = []


def _gc_callback(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter_ns()]
    elif _gc_started:
        _gc_pauses.append(time.perf_counter_ns() - _gc_started.pop())


if _gc_callback not in gc.callbacks:
    gc.callbacks.append(_gc_callback)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes; only the peak is available there.
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return 0


def _percentile(perc: float, ordered: list[int]) -> int:
    """nsqd's statsd.go percentile(): nearest rank, rounded half up."""
    if not ordered:
        return 0
    index = int(perc / 100.0 * len(ordered) + 0.5)
    return ordered[min(index, len(ordered) - 1)]


def memory_stats() -> dict[str, int]:
    """nsqd's memStats keys, filled with what CPython can tell.

    nsqadmin and nsq_stat expect the keys; the Go runtime numbers map as:
    heap_objects = memory blocks allocated by the interpreter,
    heap_in_use_bytes = resident set size, gc_pause_usec_* = percentiles of
    the last 256 collections' pauses, gc_total_runs = collections of every
    generation. CPython has no idle/released heap or byte-based GC target,
    so those stay 0.
    """
    pauses = sorted(_gc_pauses)
    return {
        "heap_objects": sys.getallocatedblocks(),
        "heap_idle_bytes": 0,
        "heap_in_use_bytes": _rss_bytes(),
        "heap_released_bytes": 0,
        "gc_pause_usec_100": _percentile(100.0, pauses) // 1000,
        "gc_pause_usec_99": _percentile(99.0, pauses) // 1000,
        "gc_pause_usec_95": _percentile(95.0, pauses) // 1000,
        "next_gc_bytes": 0,
        "gc_total_runs": sum(generation["collections"] for generation in gc.get_stats()),
    }


# -- JSON ---------------------------------------------------------------------------


def health_text(broker: Broker) -> str:
    """nsqd's GetHealth(): "OK", or "NOK - " and the last storage error."""
    return f"NOK - {broker.health}" if broker.health else "OK"


def _pub_counts(client: ClientV2, topic: str | None) -> list[dict[str, Any]]:
    # nsqd lists only one (map-order first, or the filtered) topic, a known
    # quirk; every topic is listed here, sorted, or just the filtered one.
    counts = client.pub_counts
    if topic:
        return [{"topic": topic, "count": counts[topic]}] if topic in counts else []
    return [{"topic": t, "count": n} for t, n in sorted(counts.items())]


def client_stats(conn: V2Protocol, topic: str | None = None) -> dict[str, Any]:
    """One connection as nsqd's ClientV2Stats (keys in its order, omitempty respected): its client record."""
    client = conn.client
    row: dict[str, Any] = {
        "client_id": client.client_id,
        "hostname": client.hostname,
        "version": "V2",
        "remote_address": client.remote_address,
        "state": client.state,
        "ready_count": client.ready_count,
        "in_flight_count": client.in_flight_count,
        "message_count": client.message_count,
        "finish_count": client.finish_count,
        "requeue_count": client.requeue_count,
        "connect_ts": client.connect_ts,
        "sample_rate": client.sample_rate,
        "deflate": client.deflate,
        "snappy": client.snappy,
        "user_agent": client.user_agent,
    }
    # omitempty in nsqd: only a connection that passed AUTH shows them.
    state = conn.auth_state
    if state is not None and state.grants:
        row["authed"] = True
        if state.identity:
            row["auth_identity"] = state.identity
        if state.identity_url:
            row["auth_identity_url"] = state.identity_url
    pub_counts = _pub_counts(client, topic)
    if pub_counts:
        row["pub_counts"] = pub_counts
    # No ALPN: no negotiated protocol. Go's NegotiatedProtocolIsMutual is
    # deprecated and always true for a TLS connection, so nsqd shows true.
    row.update(
        tls=client.tls,
        tls_cipher_suite=client.tls_cipher_suite,
        tls_version=client.tls_version,
        tls_negotiated_protocol="",
        tls_negotiated_protocol_is_mutual=client.tls,
    )
    # Not in nsqd 1.3.0's answers unless the client's IDENTIFY set them.
    if client.topology_zone:
        row["topology_zone"] = client.topology_zone
    if client.topology_region:
        row["topology_region"] = client.topology_region
    return row


def channel_stats(channel: Channel, include_clients: bool = True, topic: str | None = None) -> dict[str, Any]:
    """One channel as nsqd's ChannelStats; `clients` is null without include_clients."""
    clients = None
    if include_clients:
        clients = [client_stats(c, topic) for c in channel.clients] if channel.clients else []
    window = channel.e2e
    row: dict[str, Any] = {
        "channel_name": channel.name,
        "depth": channel.depth(),
        "backend_depth": channel.backend_depth(),
        "in_flight_count": channel.in_flight_count(),
        "deferred_count": channel.deferred_count(),
        "message_count": channel.message_count,
        "requeue_count": channel.requeue_count,
        "timeout_count": channel.timeout_count,
        "client_count": len(channel.clients),
        "clients": clients,
        "paused": channel.paused,
        "e2e_processing_latency": window.result() if window is not None else disabled_result(),
    }
    # Only while a replay of the topic's retained log runs into the channel (NSQ's clients ignore the key).
    replay = channel.replay
    if replay is not None:
        row["replay"] = replay.stats()
    return row


def topic_stats(topic: Topic, channels: list[dict[str, Any]], percentiles: Sequence[float]) -> dict[str, Any]:
    """One topic as nsqd's TopicStats; its latency merges all its channels' (not just the listed).

    `percentiles` are the broker's e2e-processing-latency-percentile option.
    """
    # merged_result of no window (feature off, or no channel) is nsqd's empty result.
    windows = [c.e2e for c in list(topic.channels.values()) if c.e2e is not None] if percentiles else ()
    row = {
        "topic_name": topic.name,
        "channels": channels,
        "depth": topic.depth(),
        "backend_depth": topic.backend_depth(),
        "message_count": topic.message_count,
        "message_bytes": topic.message_bytes,
        "paused": topic.paused,
        "e2e_processing_latency": merged_result(percentiles, windows),
    }
    retained = topic.log
    if retained is not None:
        # mqd's additions, only for a topic that retains: every other row is nsqd's byte for byte.
        row["retention"] = retention_json(topic)
        oldest = retained.oldest_timestamp()
        row["retained"] = {
            "epoch": retained.epoch,
            "earliest": retained.earliest(),
            "latest": retained.latest(),
            "bytes": retained.retained_bytes(),
            "oldest_timestamp": None if oldest is None else oldest // 1_000_000,
        }
    return row


def retention_json(topic: Topic) -> dict[str, int]:
    """A topic's retention as /stats, /topic/offsets and /topic/retention show it: milliseconds and bytes."""
    retention = topic.retention
    return {"time_ms": round(retention.time * 1000), "bytes": retention.bytes}


def _collect(broker: Broker, topic: str | None, channel: str | None,
             include_clients: bool) -> tuple[list[dict] | None, list[dict] | None]:
    """nsqd's GetStats: (topics, producers), with its nulls.

    A topic filter naming no topic returns before anything is gathered,
    so topics and producers are both null; a channel filter drops the
    topics that lack the channel. Producers are every connection that has
    published (not filtered), null without include_clients or when none.
    """
    if topic:
        found = broker.topics.get(topic)
        if found is None:
            return None, None
        topics = [found]
    else:
        # Sorting the names (str keys, no key function) is the cheap way at 20k topics.
        by_name = broker.topics
        topics = [by_name[name] for name in sorted(by_name)]
    percentiles = broker.options.e2e_processing_latency_percentile
    rows = []
    for t in topics:
        if channel:
            ch = t.channels.get(channel)
            if ch is None:
                continue
            channels = [ch]
        else:
            of_topic = t.channels
            channels = [of_topic[name] for name in sorted(of_topic)]
        rows.append(topic_stats(t, [channel_stats(c, include_clients, topic) for c in channels], percentiles))
    producers = None
    if include_clients:
        publishing = sorted((c for c in list(broker.clients) if c.client.pub_counts), key=lambda c: c.client.id)
        producers = [client_stats(c, topic) for c in publishing] or None
    return rows, producers


def stats_json(broker: Broker, topic: str | None = None, channel: str | None = None,
               include_clients: bool = True, include_mem: bool = True) -> dict[str, Any]:
    """The body of `GET /stats?format=json`, as a dict ready for json.dumps.

    Empty filters mean no filter, as nsqd reads a missing query parameter.
    """
    topics, producers = _collect(broker, topic or None, channel or None, include_clients)
    body: dict[str, Any] = {
        "version": NSQ_VERSION,
        "health": health_text(broker),
        "start_time": broker.start_time,
        "topics": topics,
    }
    if include_mem:
        body["memory"] = memory_stats()
    body["producers"] = producers
    return body


# -- text -------------------------------------------------------------------------------


def go_duration(ns: int) -> str:
    """Go's time.Duration.String(): 0s, 999ns, 1.5µs, 2.25ms, 3.5s, 1m0s, 2h3m4.5s."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(int(ns))
    if u < 1_000_000_000:
        for unit, suffix in ((1_000_000, "ms"), (1_000, "µs"), (1, "ns")):
            if u >= unit:
                return sign + _decimal(u, unit) + suffix
    seconds, frac = divmod(u, 1_000_000_000)
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    text = f"{secs}" + (f".{frac:09d}".rstrip("0") if frac else "") + "s"
    if hours:
        text = f"{hours}h{minutes}m" + text
    elif minutes:
        text = f"{minutes}m" + text
    return sign + text


def _decimal(value: int, unit: int) -> str:
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}." + f"{frac:0{digits}d}".rstrip("0")


def nanoseconds_to_human(v: float) -> str:
    """nsq's stringy.NanoSecondToHuman, how the text page shows e2e percentiles."""
    if v > 1e9:
        v, suffix = v / 1e9, "s"
    elif v > 1e6:
        v, suffix = v / 1e6, "ms"
    elif v > 1e3:
        v, suffix = v / 1e3, "us"
    else:
        suffix = "ns"
    return f"{v:0.1f}{suffix}"


def _e2e_text(result: dict[str, Any]) -> str:
    percentiles = result["percentiles"]
    if not percentiles:
        return ""
    return ", ".join(nanoseconds_to_human(p["value"]) for p in percentiles)


def _rfc3339(ts: float) -> str:
    """Go's time.Format(time.RFC3339) in local time: 2006-01-02T15:04:05-07:00, or Z for UTC."""
    local = datetime.fromtimestamp(int(ts)).astimezone()
    offset = local.utcoffset()
    text = local.strftime("%Y-%m-%dT%H:%M:%S")
    if not offset:
        return text + "Z"
    minutes = int(offset.total_seconds()) // 60
    sign = "-" if minutes < 0 else "+"
    return f"{text}{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"


def _client_line(row: dict[str, Any], now: float) -> str:
    """ClientV2Stats.String(): a producer line if it published, else a consumer line."""
    connected = go_duration(max(0, int(now - row["connect_ts"])) * 1_000_000_000)
    port = row["remote_address"].rpartition(":")[2]
    ident = f"{row['hostname']}:{port} {row['user_agent']}"
    pub_counts = row.get("pub_counts")
    if pub_counts:
        total = sum(p["count"] for p in pub_counts)
        topics = ",".join(f"{p['topic']}={p['count']}" for p in pub_counts)
        return f"[{row['version']} {ident:<21}] msgs: {total:<8} topics: {topics} connected: {connected}"
    return (
        f"[{row['version']} {ident:<21}] state: {row['state']} inflt: {row['in_flight_count']:<4} "
        f"rdy: {row['ready_count']:<4} fin: {row['finish_count']:<8} re-q: {row['requeue_count']:<8} "
        f"msgs: {row['message_count']:<8} connected: {connected}"
    )


def stats_text(broker: Broker, topic: str | None = None, channel: str | None = None,
               include_clients: bool = True, include_mem: bool = True) -> str:
    """The body of `GET /stats` without format=json: nsqd's printStats, line for line."""
    stats = stats_json(broker, topic, channel, include_clients, include_mem)
    now = broker.clock.seconds()
    python = f"{platform.python_implementation().lower()}{platform.python_version()}"
    out = [
        f"nsqd v{NSQ_VERSION} (built w/mqd{__version__} {python})\n",
        f"start_time {_rfc3339(broker.start_time)}\n",
        f"uptime {go_duration(round((now - broker.start_time) * 1e9))}\n",
        f"\nHealth: {stats['health']}\n",
    ]
    memory = stats.get("memory")
    if memory is not None:
        out.append("\nMemory:\n")
        out.extend(f"   {key:<25}\t{value}\n" for key, value in memory.items())
    topics = stats["topics"]
    out.append("\nTopics:" if topics else "\nTopics: None\n")
    for t in topics or ():
        prefix = "*P " if t["paused"] else "   "
        out.append(
            f"\n{prefix}[{t['topic_name']:<15}] depth: {t['depth']:<5} be-depth: {t['backend_depth']:<5} "
            f"msgs: {t['message_count']:<8} e2e%: {_e2e_text(t['e2e_processing_latency'])}\n"
        )
        for c in t["channels"]:
            prefix = "   *P " if c["paused"] else "      "
            out.append(
                f"{prefix}[{c['channel_name']:<25}] depth: {c['depth']:<5} be-depth: {c['backend_depth']:<5} "
                f"inflt: {c['in_flight_count']:<4} def: {c['deferred_count']:<4} "
                f"re-q: {c['requeue_count']:<5} timeout: {c['timeout_count']:<5} "
                f"msgs: {c['message_count']:<8} e2e%: {_e2e_text(c['e2e_processing_latency'])}\n"
            )
            out.extend(f"        {_client_line(row, now)}\n" for row in c["clients"] or ())
    producers = stats["producers"]
    if not producers:
        out.append("\nProducers: None\n")
    else:
        out.append("\nProducers:\n")
        out.extend(f"   {_client_line(row, now)}\n" for row in producers)
    return "".join(out)
