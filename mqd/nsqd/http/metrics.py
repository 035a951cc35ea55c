"""GET /metrics: the broker's stats in Prometheus' text exposition format 0.0.4.

nsqd has no /metrics (people run nsq_exporter beside it, scraping
/stats); serving it directly spares that sidecar. The numbers are the
ones /stats reports (`stats_json`), so both always agree. The format is
written by hand from its rules (HELP/TYPE lines, one sample per line,
label values escaped) to avoid a runtime dependency for a few lines of
text; tests read it back with prometheus_client's parser.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from mqd import NSQ_VERSION
from mqd.http.endpoint import Endpoint
from mqd.nsqd.stats import memory_stats, stats_json

if TYPE_CHECKING:
    from twisted.web.server import Request

    from mqd.nsqd.broker import Broker

__all__ = ["CONTENT_TYPE", "Metrics", "metrics_text"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[tuple[str, str], ...]


def escape_label(value: str) -> str:
    """A label value as the format wants it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Family:
    """One metric family: its HELP and TYPE, then its sample lines."""

    __slots__ = ("name", "kind", "help", "lines")

    def __init__(self, name: str, kind: str, help: str) -> None:
        self.name = name
        self.kind = kind
        self.help = help
        self.lines: list[str] = []

    def add(self, value: float, **labels: str) -> None:
        if labels:
            inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{self.name}{{{inner}}} {_number(value)}\n")
        else:
            self.lines.append(f"{self.name} {_number(value)}\n")

    def add_all(self, labels: list[str], values: Iterable[float]) -> None:
        """One sample per pre-rendered label set (`k="v",...`): the per-channel fast path."""
        prefix = self.name + "{"
        # int first: nearly every value is one, and str() of an int is what _number gives.
        self.lines.extend([f"{prefix}{lab}}} {v if type(v) is int else _number(v)}\n"
                           for lab, v in zip(labels, values, strict=True)])

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {_escape_help(self.help)}\n"
        yield f"# TYPE {self.name} {self.kind}\n"
        yield from self.lines


# (stats key, metric suffix, type, help) for the per-topic and per-channel numbers.
_TOPIC_FIELDS = (
    ("depth", "depth", "gauge", "Messages queued at the topic (memory + disk), not yet copied to channels."),
    ("backend_depth", "backend_depth", "gauge", "The disk part of the topic's depth."),
    ("message_count", "messages_total", "counter", "Messages published to the topic since the broker started."),
    ("message_bytes", "message_bytes_total", "counter", "Body bytes published to the topic since the broker started."),
    ("paused", "paused", "gauge", "1 if the topic is paused."),
)
_CHANNEL_FIELDS = (
    ("depth", "depth", "gauge", "Messages queued in the channel (memory + disk), excluding in-flight and deferred."),
    ("backend_depth", "backend_depth", "gauge", "The disk part of the channel's depth."),
    ("in_flight_count", "in_flight", "gauge", "Messages delivered and awaiting FIN, REQ or timeout."),
    ("deferred_count", "deferred", "gauge", "Messages deferred by DPUB or a delayed REQ."),
    ("message_count", "messages_total", "counter", "Messages put into the channel since the broker started."),
    ("requeue_count", "requeues_total", "counter", "REQs (immediate or delayed) on the channel."),
    ("timeout_count", "timeouts_total", "counter", "In-flight messages that timed out."),
    ("client_count", "clients", "gauge", "Subscribed consumers."),
    ("paused", "paused", "gauge", "1 if the channel is paused."),
)

# (/stats "retained" key, metric suffix, help) of a topic's retained log.
_RETAINED_FIELDS = (
    ("earliest", "earliest", "Offset of the oldest record the topic's retained log keeps."),
    ("latest", "latest", "Offset the next record published to the topic will get."),
    ("bytes", "bytes", "Bytes the topic's retained log keeps, as --retention-bytes counts them."),
)


def metrics_text(broker: Broker) -> str:
    """The whole /metrics page for `broker`."""
    stats = stats_json(broker, include_clients=False, include_mem=False)
    topics: list[dict[str, Any]] = stats["topics"] or []
    families: list[_Family] = []

    def family(name: str, kind: str, help: str) -> _Family:
        f = _Family(name, kind, help)
        families.append(f)
        return f

    family("nsq_up", "gauge", "1 when the broker is healthy (/ping answers OK), 0 after a storage failure.").add(
        1 if stats["health"] == "OK" else 0)
    family("nsq_info", "gauge", "Always 1; the nsqd version mqd reproduces is a label.").add(
        1, version=NSQ_VERSION)
    family("process_start_time_seconds", "gauge", "Start time of the broker, seconds since the epoch.").add(
        stats["start_time"])
    family("process_resident_memory_bytes", "gauge", "Resident memory of the broker process.").add(
        memory_stats()["heap_in_use_bytes"])
    family("nsq_topics", "gauge", "Topics on the broker.").add(len(topics))
    family("nsq_channels", "gauge", "Channels on the broker, all topics together.").add(
        sum(len(t["channels"]) for t in topics))
    clients = list(broker.clients)
    family("nsq_clients", "gauge", "Connected TCP clients (consumers and producers).").add(len(clients))
    family("nsq_producers", "gauge", "Connected TCP clients that have published.").add(
        sum(1 for c in clients if c.pub_counts))

    # Label sets escaped once per topic and channel, not once per sample.
    topic_labels = [f'topic="{escape_label(t["topic_name"])}"' for t in topics]
    channel_rows = [c for t in topics for c in t["channels"]]
    channel_labels = [f'{tl},channel="{escape_label(c["channel_name"])}"'
                      for t, tl in zip(topics, topic_labels, strict=True) for c in t["channels"]]
    for key, suffix, kind, help in _TOPIC_FIELDS:
        family(f"nsq_topic_{suffix}", kind, help).add_all(topic_labels, [t[key] for t in topics])
    for key, suffix, kind, help in _CHANNEL_FIELDS:
        family(f"nsq_channel_{suffix}", kind, help).add_all(channel_labels, [c[key] for c in channel_rows])

    # The retained logs (mqd's own): only the topics that retain have samples.
    retaining = [(t["retained"], tl) for t, tl in zip(topics, topic_labels, strict=True) if "retained" in t]
    if retaining:
        labels = [tl for _, tl in retaining]
        now_ms = broker.clock.seconds() * 1000
        for key, suffix, help in _RETAINED_FIELDS:
            family(f"mqd_topic_retained_{suffix}", "gauge", help).add_all(labels, [r[key] for r, _ in retaining])
        family("mqd_topic_retained_oldest_age_seconds", "gauge",
               "Age of the oldest record the topic's retained log keeps (0 when it keeps none).").add_all(
            labels, [0.0 if r["oldest_timestamp"] is None else max(0.0, (now_ms - r["oldest_timestamp"]) / 1000)
                     for r, _ in retaining])

    # End-to-end latency (only with --e2e-processing-latency-percentile): a
    # rolling window, so gauges with a quantile label rather than a summary
    # (a summary's _count must only grow; the window's count does not).
    if broker.options.e2e_processing_latency_percentile:
        t_lat = family("nsq_topic_e2e_processing_latency_seconds", "gauge",
                       "Publish-to-FIN latency percentiles over the window, all the topic's channels together.")
        t_cnt = family("nsq_topic_e2e_processing_latency_samples", "gauge",
                       "FINs the topic's latency window holds.")
        c_lat = family("nsq_channel_e2e_processing_latency_seconds", "gauge",
                       "Publish-to-FIN latency percentiles of the channel over the window.")
        c_cnt = family("nsq_channel_e2e_processing_latency_samples", "gauge",
                       "FINs the channel's latency window holds.")
        for t in topics:
            name = t["topic_name"]
            result = t["e2e_processing_latency"]
            for p in result["percentiles"] or ():
                t_lat.add(p["value"] / 1e9, topic=name, quantile=_number(float(p["quantile"])))
            t_cnt.add(result["count"], topic=name)
            for c in t["channels"]:
                result = c["e2e_processing_latency"]
                for p in result["percentiles"] or ():
                    c_lat.add(p["value"] / 1e9, topic=name, channel=c["channel_name"],
                              quantile=_number(float(p["quantile"])))
                c_cnt.add(result["count"], topic=name, channel=c["channel_name"])

    return "".join([line for f in families for line in f.render()])


class Metrics(Endpoint):
    """`GET /metrics`, a route of the API root like nsqd's own endpoints.

    The router answers other methods with nsqd's 405; the body is the
    exposition text under Prometheus' content type rather than nsqd's
    sniffed text/plain, so scrapers parse it as format 0.0.4.
    """

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> str:
        request.setHeader(b"Content-Type", CONTENT_TYPE.encode())
        return metrics_text(self.broker)
