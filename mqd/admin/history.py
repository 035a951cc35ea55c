"""Live charts without graphite: mqadmin polls the brokers' /stats itself and keeps a bounded history.

nsqadmin draws no chart unless a graphite server collects nsqd's statsd
pushes. mqadmin already talks to every broker, so a LoopingCall samples
each producer's `/stats?format=json` every `stats-interval` and keeps, in
memory, `stats-history / stats-interval` points for the cluster, each topic
and each channel: the message rate, the depth and the in-flight count.

Rates come from successive samples of the SAME node (Δ message_count / Δt
of that node, summed across nodes): sums across nodes would jump whenever a
node is missed or comes back. A node that could not be reached adds nothing
to its round and keeps its last good sample as the baseline, so its next
good sample yields the average over the gap, not a spike. A counter that
went down, or a changed start_time, means the broker restarted (or the
topic/channel was deleted and recreated): that step contributes 0 and the
new value is the baseline, so no rate is ever negative or inflated by a
whole lifetime's count. A topic a node did not have in its previous good
sample counts from 0 (it was created between the two).

What each series means:
  * topic: depth = every message of the topic still queued: its own depth
    (not yet copied to its channels) plus its channels' depths, what an
    operator means by a topic's backlog (the topic's own queue alone stays
    at 0 while channels pile up); in_flight = its channels' in-flight,
    rate = from the topic's message_count (what producers published);
  * channel: its depth, in_flight and rate from its message_count;
  * cluster: rate = sum of topic rates, depth = every queued message
    (topics' and channels' depths), in_flight = every channel's in-flight.

A topic or channel no reachable node reports gets no point that round; its
series disappears once its last point is older than the window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from math import ceil
from typing import Any, cast

from twisted.application import service
from twisted.internet.defer import Deferred, inlineCallbacks, maybeDeferred
from twisted.internet.task import LoopingCall
from twisted.web.server import Request

from mqd.admin.endpoint import Admin, AdminEndpoint, ApiError
from mqd.clusterinfo.aggregate import node_id
from mqd.http.args import query_of
from mqd.logs import get_logger

__all__ = ["CLUSTER", "History", "HistoryEndpoint", "NodeSample", "Point", "routes", "sampler"]

log = get_logger(__name__)

# Series keys: () the cluster, (topic,) a topic, (topic, channel) a channel.
SeriesKey = tuple[str, ...]
CLUSTER: SeriesKey = ()
# (t: clock seconds, rate: messages/s, depth, in_flight); tuples keep 180 points × every channel small.
Point = tuple[float, float, int, int]


@dataclass(frozen=True, slots=True)
class NodeSample:
    """One producer's answer in one round.

    `node` is "broadcast_address:http_port" (nsqadmin's node id);
    `start_time` comes from /info or /stats (None: take the document's);
    `stats` is its /stats?format=json document, None when it could not be
    reached (the node then adds nothing to this round).
    """

    node: str
    start_time: int | None
    stats: Mapping[str, Any] | None


class _NodeState:
    """A node's last good sample: when, which incarnation, and its counters per series key."""

    __slots__ = ("t", "start_time", "counts")

    def __init__(self, t: float, start_time: Any, counts: dict[SeriesKey, int]) -> None:
        self.t = t
        self.start_time = start_time
        self.counts = counts


class History(service.Service):
    """Samples the cluster every `interval` seconds and keeps `window` seconds of points per series."""

    name = "history"

    def __init__(
        self,
        clock,
        interval: float,
        window: float,
        sample: Callable[[], Deferred[list[NodeSample]]],
    ) -> None:
        if interval <= 0:
            raise ValueError("stats interval must be > 0")
        self.clock = clock
        self.interval = float(interval)
        self.window = float(window)
        self.sample = sample
        self.max_points = max(1, ceil(self.window / self.interval))
        self._series: dict[SeriesKey, deque[Point]] = {}
        self._nodes: dict[str, _NodeState] = {}
        self._loop: LoopingCall | None = None
        self._stopped: Deferred | None = None

    # -- life cycle --------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.poll)
        self._loop.clock = self.clock
        # The first round at once: rates need two samples, so the first rate comes one interval after start.
        self._stopped = self._loop.start(self.interval, now=True)
        self._stopped.addErrback(lambda f: log.failure("history: sampling loop stopped", f))

    def stopService(self) -> Deferred | None:
        """Stop sampling; the Deferred fires once a round in flight has been recorded."""
        super().stopService()
        loop, stopped = self._loop, self._stopped
        self._loop = self._stopped = None
        if loop is None:
            return None
        if loop.running:
            loop.stop()
        return stopped

    # -- sampling ----------------------------------------------------------------------

    def poll(self) -> Deferred:
        """One round; the LoopingCall waits for it, so rounds never overlap.

        Failures are logged, never raised: a failing round must not end the loop.
        """
        t = self.clock.seconds()
        d = maybeDeferred(self.sample)
        d.addCallback(lambda samples: self.record(t, samples))
        d.addErrback(lambda f: log.failure("history: sampling the cluster failed", f))
        return d

    def record(self, t: float, samples: Iterable[NodeSample]) -> None:
        """Add the points of a round sampled at `t` (clock seconds)."""
        totals: dict[SeriesKey, list] = {}
        for s in samples:
            if s.stats is not None:
                self._add_node(t, s, totals)
        for key, (rate, depth, in_flight) in totals.items():
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = deque(maxlen=self.max_points)
            series.append((t, rate, depth, in_flight))
        self._expire(t)

    def _add_node(self, t: float, s: NodeSample, totals: dict[SeriesKey, list]) -> None:
        doc = cast("Mapping[str, Any]", s.stats)  # record() adds the nodes that have stats
        start_time = s.start_time if s.start_time is not None else doc.get("start_time")
        prev = self._nodes.get(s.node)
        # No baseline (first sight, or a restart): this node's step adds 0 to every rate.
        dt = t - prev.t if prev is not None and prev.start_time == start_time else 0.0
        before = prev.counts if prev is not None and dt > 0 else None
        counts: dict[SeriesKey, int] = {}

        def rate(key: SeriesKey, count: int) -> float:
            counts[key] = count
            if before is None:
                return 0.0
            last = before.get(key, 0)
            return (count - last) / dt if count >= last else 0.0

        cluster = totals.setdefault(CLUSTER, [0.0, 0, 0])
        for topic in doc.get("topics") or ():
            name = topic["topic_name"]
            key = (name,)
            topic_rate = rate(key, topic.get("message_count", 0))
            topic_depth = topic.get("depth", 0)
            row = totals.setdefault(key, [0.0, 0, 0])
            row[0] += topic_rate
            row[1] += topic_depth
            cluster[0] += topic_rate
            cluster[1] += topic_depth
            for channel in topic.get("channels") or ():
                ckey = (name, channel["channel_name"])
                depth = channel.get("depth", 0)
                in_flight = channel.get("in_flight_count", 0)
                crow = totals.setdefault(ckey, [0.0, 0, 0])
                crow[0] += rate(ckey, channel.get("message_count", 0))
                crow[1] += depth
                crow[2] += in_flight
                row[1] += depth
                row[2] += in_flight
                cluster[1] += depth
                cluster[2] += in_flight
        self._nodes[s.node] = _NodeState(t, start_time, counts)

    def _expire(self, now: float) -> None:
        """Drop points, series and node baselines older than the window."""
        oldest = now - self.window
        for key in list(self._series):
            series = self._series[key]
            while series and series[0][0] <= oldest:
                series.popleft()
            if not series:
                del self._series[key]
        for node in [n for n, state in self._nodes.items() if state.t <= oldest]:
            del self._nodes[node]

    # -- reading -----------------------------------------------------------------------

    def points(self, topic: str | None = None, channel: str | None = None) -> list[Point] | None:
        """A series' points within the window, oldest first; None if it does not exist.

        The cluster's series always exists (empty before the first good round).
        """
        key: SeriesKey = CLUSTER if topic is None else (topic,) if channel is None else (topic, channel)
        series = self._series.get(key)
        if series is None:
            return [] if key == CLUSTER else None
        oldest = self.clock.seconds() - self.window
        return [p for p in series if p[0] > oldest]

    def has_topic(self, topic: str) -> bool:
        return (topic,) in self._series


# -- the API ---------------------------------------------------------------------------


class HistoryEndpoint(AdminEndpoint):
    """GET /api/history[?topic=T[&channel=C]]: the chart data (an mqd addition to nsqadmin's API)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> dict[str, Any]:
        query = query_of(request)
        topic = query.first("topic") or None
        channel = query.first("channel") or None
        if channel is not None and topic is None:
            raise ApiError(400, "MISSING_ARG_TOPIC")
        history: History = self.admin.history
        points = history.points(topic, channel)
        if points is None:
            if channel is None or topic is None or not history.has_topic(topic):
                raise ApiError(404, "TOPIC_NOT_FOUND")
            raise ApiError(404, "CHANNEL_NOT_FOUND")
        return {
            "interval": history.interval,
            "window": history.window,
            "points": [
                {"t": t, "rate": rate, "depth": depth, "in_flight": in_flight}
                for t, rate, depth, in_flight in points
            ],
            "message": "",
        }


def routes(admin: Admin) -> dict[str, AdminEndpoint]:
    return {"/api/history": HistoryEndpoint(admin)}


# -- wiring to the cluster -------------------------------------------------------------


def sampler(cluster) -> Callable[[], Deferred[list[NodeSample]]]:
    """The `sample` callable for History over a `cluster.Cluster`: every producer's /stats, without clients.

    A producer listed but not answering becomes a sample without stats
    (down this round); failures are logged at debug level only, since the
    pages already report them and a round every few seconds would flood the log.
    """

    @inlineCallbacks
    def sample():
        producers, errors = yield cluster.producers()
        if not producers:
            _log_errors(errors)
            return []
        answers, more = yield cluster.stats(producers, include_clients=False)
        _log_errors(errors + more)
        good = {ns.node: ns.stats for ns in answers or ()}
        nodes = dict.fromkeys([node_id(p) for p in producers] + list(good))
        return [NodeSample(node, None, good.get(node)) for node in nodes]

    return sample


def _log_errors(errors: list[str]) -> None:
    for error in errors:
        log.debug("history: {error}", error=error)
