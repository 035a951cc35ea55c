"""mqadmin's chart history: rates from successive /stats samples, sums across nodes, restarts, the window, the API.

Every round is driven by a task.Clock and a fake `sample` that answers
canned /stats documents, so rates are checked with exact arithmetic.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.web.test.requesthelper import DummyRequest

from mqd.admin.endpoint import Admin
from mqd.admin.history import History, NodeSample, routes, sampler
from mqd.clusterinfo.cluster import Cluster
from mqd.clusterinfo.upstream import UpstreamError
from tests.support.inprocess_broker import START_TIME

A, B = "10.0.0.1:4151", "10.0.0.2:4151"
BOOT = 1_699_999_000


def channel(name, count=0, depth=0, in_flight=0):
    return {"channel_name": name, "message_count": count, "depth": depth, "backend_depth": 0,
            "in_flight_count": in_flight, "deferred_count": 0, "requeue_count": 0,
            "timeout_count": 0, "client_count": 0, "clients": [], "paused": False}


def topic(name, count=0, depth=0, channels=()):
    return {"topic_name": name, "message_count": count, "depth": depth, "backend_depth": 0,
            "message_bytes": 0, "paused": False, "channels": list(channels),
            "e2e_processing_latency": {"count": 0, "percentiles": None}}


def stats(*topics, start_time=BOOT):
    return {"version": "1.3.0", "health": "OK", "start_time": start_time,
            "topics": list(topics), "producers": None}


class FakeCluster:
    """The `sample` callable: answers what the test put in `rounds[node]` for the next round."""

    def __init__(self) -> None:
        self.now: dict[str, dict | None] = {}
        self.calls = 0
        self.pending: Deferred | None = None
        self.hold = False

    def __call__(self) -> Deferred:
        self.calls += 1
        samples = [NodeSample(node, None, doc) for node, doc in self.now.items()]
        if self.hold:
            self.pending = Deferred()
            self.pending.addCallback(lambda _: samples)
            return self.pending
        return succeed(samples)


@pytest.fixture
def cluster():
    return FakeCluster()


@pytest.fixture
def history(clock, cluster):
    h = History(clock, 5, 60, cluster)
    yield h
    if h.running:
        h.stopService()


def rates(points):
    return [p[1] for p in points]


def step(clock, seconds=5):
    clock.advance(seconds)


# -- rates -----------------------------------------------------------------------------


def test_rate_from_successive_samples_of_one_node(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 100, depth=3, channels=[channel("c", 90, depth=7, in_flight=2)]))}
    history.startService()  # first round at once: a baseline, no rate yet
    cluster.now = {A: stats(topic("t", 150, depth=4, channels=[channel("c", 130, depth=5, in_flight=1)]))}
    step(clock)
    cluster.now = {A: stats(topic("t", 150, channels=[channel("c", 150)]))}
    step(clock)

    # topic: depth = its own queue + its channels' (3 + 7, then 4 + 5)
    assert history.points("t") == [
        (START_TIME, 0.0, 10, 2),
        (START_TIME + 5, 10.0, 9, 1),
        (START_TIME + 10, 0.0, 0, 0),
    ]
    assert history.points("t", "c") == [
        (START_TIME, 0.0, 7, 2),
        (START_TIME + 5, 8.0, 5, 1),
        (START_TIME + 10, 4.0, 0, 0),
    ]
    # cluster: rate = topic rates, depth = topic + channel depths, in_flight = channels'
    assert history.points() == [
        (START_TIME, 0.0, 10, 2),
        (START_TIME + 5, 10.0, 9, 1),
        (START_TIME + 10, 0.0, 0, 0),
    ]


def test_sums_across_two_nodes(history, clock, cluster):
    cluster.now = {
        A: stats(topic("t", 10, depth=1, channels=[channel("c", 10, depth=2, in_flight=3)])),
        B: stats(topic("t", 1000, depth=10, channels=[channel("c", 500, depth=20, in_flight=30)]),
                 topic("u", 7)),
    }
    history.startService()
    cluster.now = {
        A: stats(topic("t", 20, depth=1, channels=[channel("c", 15, depth=2, in_flight=3)])),
        B: stats(topic("t", 1040, depth=10, channels=[channel("c", 520, depth=20, in_flight=30)]),
                 topic("u", 12)),
    }
    step(clock)

    assert history.points("t")[-1] == (START_TIME + 5, (10 + 40) / 5, 11 + 22, 33)
    assert history.points("t", "c")[-1] == (START_TIME + 5, (5 + 20) / 5, 22, 33)
    assert history.points("u")[-1] == (START_TIME + 5, 1.0, 0, 0)
    assert history.points()[-1] == (START_TIME + 5, 11.0, 11 + 22, 33)


def test_nodes_sampled_at_different_intervals_use_their_own_dt(clock, cluster):
    """A node back after a missed round: Δcount over ITS Δt (10 s), the average, not a spike."""
    history = History(clock, 5, 60, cluster)
    cluster.now = {A: stats(topic("t", 0)), B: stats(topic("t", 0))}
    history.startService()
    cluster.now = {A: stats(topic("t", 50)), B: None}  # B unreachable: adds nothing
    step(clock)
    assert history.points("t")[-1] == (START_TIME + 5, 10.0, 0, 0)
    cluster.now = {A: stats(topic("t", 100)), B: stats(topic("t", 100))}
    step(clock)
    # A: 50 in 5 s; B: 100 over the 10 s since its last good sample
    assert history.points("t")[-1] == (START_TIME + 10, 10.0 + 10.0, 0, 0)
    history.stopService()


def test_node_down_for_one_round_adds_nothing_then_no_spike(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 100, depth=5)), B: stats(topic("t", 100, depth=5))}
    history.startService()
    cluster.now = {A: stats(topic("t", 110, depth=5)), B: None}
    step(clock)
    assert history.points("t")[-1] == (START_TIME + 5, 2.0, 5, 0)
    cluster.now = {A: stats(topic("t", 120, depth=5)), B: stats(topic("t", 120, depth=5))}
    step(clock)
    assert history.points("t")[-1] == (START_TIME + 10, 2.0 + 2.0, 10, 0)


def test_node_missing_from_the_round_is_the_same_as_down(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 0)), B: stats(topic("t", 0))}
    history.startService()
    cluster.now = {A: stats(topic("t", 5))}
    step(clock)
    cluster.now = {A: stats(topic("t", 10)), B: stats(topic("t", 30))}
    step(clock)
    assert rates(history.points("t")) == [0.0, 1.0, 1.0 + 3.0]


def test_counter_reset_without_start_time_change_gives_zero_then_counts_from_new_value(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 1000, channels=[channel("c", 900)]))}
    history.startService()
    cluster.now = {A: stats(topic("t", 30, channels=[channel("c", 20)]))}  # deleted and recreated
    step(clock)
    cluster.now = {A: stats(topic("t", 80, channels=[channel("c", 45)]))}
    step(clock)
    assert rates(history.points("t")) == [0.0, 0.0, 10.0]
    assert rates(history.points("t", "c")) == [0.0, 0.0, 5.0]
    assert min(rates(history.points())) >= 0


def test_broker_restart_start_time_change_gives_no_spike(history, clock, cluster):
    """A restarted broker whose counters already passed the old values: a new start_time, still no spike."""
    cluster.now = {A: stats(topic("t", 100), start_time=BOOT), B: stats(topic("t", 0))}
    history.startService()
    cluster.now = {A: stats(topic("t", 5000), start_time=BOOT + 50), B: stats(topic("t", 25))}
    step(clock)
    assert history.points("t")[-1][1] == 5.0  # only B's step
    cluster.now = {A: stats(topic("t", 5100), start_time=BOOT + 50), B: stats(topic("t", 25))}
    step(clock)
    assert history.points("t")[-1][1] == 20.0


def test_start_time_from_the_sample_wins_over_the_document(clock):
    docs = iter([
        [NodeSample(A, BOOT, stats(topic("t", 100), start_time=0))],
        [NodeSample(A, BOOT + 1, stats(topic("t", 200), start_time=0))],  # /info says: restarted
        [NodeSample(A, BOOT + 1, stats(topic("t", 250), start_time=0))],
    ])
    history = History(clock, 5, 60, lambda: succeed(next(docs)))
    history.startService()
    step(clock)
    step(clock)
    assert rates(history.points("t")) == [0.0, 0.0, 10.0]
    history.stopService()


def test_topic_created_between_samples_counts_from_zero(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 0))}
    history.startService()
    cluster.now = {A: stats(topic("t", 0), topic("new", 25, channels=[channel("c", 10)]))}
    step(clock)
    assert history.points("new") == [(START_TIME + 5, 5.0, 0, 0)]
    assert history.points("new", "c") == [(START_TIME + 5, 2.0, 0, 0)]


def test_first_sight_of_a_node_contributes_no_rate(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 0))}
    history.startService()
    cluster.now = {A: stats(topic("t", 50)), B: stats(topic("t", 1_000_000))}  # B just joined
    step(clock)
    assert history.points("t")[-1][1] == 10.0


# -- series: window, creation, removal -------------------------------------------------


def test_window_bounds_the_points(clock, cluster):
    history = History(clock, 5, 20, cluster)
    assert history.max_points == 4
    cluster.now = {A: stats(topic("t", 0))}
    history.startService()
    for i in range(1, 10):
        cluster.now = {A: stats(topic("t", 5 * i))}
        step(clock)
    points = history.points("t")
    assert [p[0] for p in points] == [START_TIME + 5 * i for i in range(6, 10)]
    assert rates(points) == [1.0] * 4
    assert len(history.points()) == 4
    history.stopService()


def test_points_older_than_the_window_go_when_rounds_were_skipped(clock, cluster):
    """A round slower than the interval skips rounds: the window is in seconds, not only in points."""
    history = History(clock, 5, 20, cluster)
    cluster.now = {A: stats(topic("t", 0))}
    history.startService()
    cluster.now = {A: stats(topic("t", 10))}
    step(clock)
    step(clock, 17)  # LoopingCall: one late round at +22 (skipping the missed ones)
    assert [p[0] for p in history.points("t")] == [START_TIME + 5, START_TIME + 22]
    history.stopService()


def test_topic_and_channel_series_created_and_removed(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 0, channels=[channel("c"), channel("d")]), topic("gone", 0))}
    history.startService()
    assert history.points("gone") is not None
    assert history.points("t", "d") is not None
    cluster.now = {A: stats(topic("t", 0, channels=[channel("c")]))}
    step(clock)
    # no new points, the old ones stay visible until the window passes
    assert [p[0] for p in history.points("gone")] == [START_TIME]
    assert [p[0] for p in history.points("t", "d")] == [START_TIME]
    for _ in range(11):  # last point at START_TIME; now START_TIME + 60: out of a 60 s window
        step(clock)
    assert history.points("gone") is None
    assert history.points("t", "d") is None
    assert history.points("t", "c") is not None
    assert len(history.points("t")) == 12


def test_no_reachable_node_gives_no_point(history, clock, cluster):
    cluster.now = {A: None}
    history.startService()
    assert history.points() == []
    assert history.points("t") is None
    cluster.now = {A: stats(topic("t", 5))}
    step(clock)
    assert history.points() == [(START_TIME + 5, 0.0, 0, 0)]


def test_empty_cluster_has_zero_points(history, clock, cluster):
    cluster.now = {A: stats()}
    history.startService()
    assert history.points() == [(START_TIME, 0.0, 0, 0)]


def test_failing_sample_is_logged_and_the_loop_goes_on(clock):
    calls = []

    def sample():
        calls.append(clock.seconds())
        if len(calls) == 2:
            raise RuntimeError("boom")
        if len(calls) == 3:
            d = Deferred()
            d.errback(RuntimeError("upstream"))
            return d
        return succeed([NodeSample(A, None, stats(topic("t", 5 * len(calls))))])

    history = History(clock, 5, 60, sample)
    history.startService()
    for _ in range(3):
        step(clock)
    assert len(calls) == 4
    assert [p[0] for p in history.points("t")] == [START_TIME, START_TIME + 15]
    assert rates(history.points("t")) == [0.0, 1.0]
    history.stopService()


# -- life cycle ------------------------------------------------------------------------


def test_start_samples_every_interval_and_stop_ends_it(history, clock, cluster):
    cluster.now = {A: stats()}
    history.startService()
    assert cluster.calls == 1
    step(clock, 4.9)
    assert cluster.calls == 1
    step(clock, 0.1)
    assert cluster.calls == 2
    stopped = history.stopService()
    assert stopped.called
    step(clock, 60)
    assert cluster.calls == 2
    assert clock.getDelayedCalls() == []


def test_stop_waits_for_the_round_in_flight(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 0))}
    history.startService()
    cluster.hold = True
    cluster.now = {A: stats(topic("t", 50))}
    step(clock)
    assert cluster.calls == 2 and cluster.pending is not None
    step(clock, 20)  # the LoopingCall waits: rounds never overlap
    assert cluster.calls == 2
    stopped = history.stopService()
    assert not stopped.called
    cluster.pending.callback(None)
    assert stopped.called
    assert history.points("t")[-1] == (START_TIME + 5, 10.0, 0, 0)
    step(clock, 60)
    assert cluster.calls == 2
    assert clock.getDelayedCalls() == []


def test_stop_before_start_is_harmless(clock, cluster):
    history = History(clock, 5, 60, cluster)
    assert history.stopService() is None
    assert cluster.calls == 0


# -- GET /api/history ------------------------------------------------------------------


def get(history, query=""):
    endpoint = routes(Admin(settings=None, reactor=None, history=history))["/api/history"]
    request = DummyRequest([b"api", b"history"])
    request.uri = b"/api/history" + (b"?" + query.encode() if query else b"")
    body = endpoint.render(request, {})
    return request.responseCode or 200, json.loads(body)


def test_api_history_json(history, clock, cluster):
    cluster.now = {A: stats(topic("t", 0, depth=1, channels=[channel("c", 0, depth=2, in_flight=3)]))}
    history.startService()
    cluster.now = {A: stats(topic("t", 10, depth=1, channels=[channel("c", 5, depth=2, in_flight=3)]))}
    step(clock)

    code, cluster_doc = get(history)
    assert code == 200
    assert cluster_doc == {
        "interval": 5.0,
        "window": 60.0,
        "points": [
            {"t": START_TIME, "rate": 0.0, "depth": 3, "in_flight": 3},
            {"t": START_TIME + 5, "rate": 2.0, "depth": 3, "in_flight": 3},
        ],
        "message": "",
    }
    code, doc = get(history, "topic=t")
    assert code == 200
    assert doc["points"][-1] == {"t": START_TIME + 5, "rate": 2.0, "depth": 1 + 2, "in_flight": 3}
    code, doc = get(history, "topic=t&channel=c")
    assert code == 200
    assert doc["points"][-1] == {"t": START_TIME + 5, "rate": 1.0, "depth": 2, "in_flight": 3}


def test_api_history_before_any_round_is_empty(history):
    assert get(history) == (200, {"interval": 5.0, "window": 60.0, "points": [], "message": ""})


def test_api_history_404s_and_400s(history, cluster):
    cluster.now = {A: stats(topic("t", 0, channels=[channel("c")]))}
    history.startService()
    assert get(history, "topic=nope") == (404, {"message": "TOPIC_NOT_FOUND"})
    assert get(history, "topic=nope&channel=c") == (404, {"message": "TOPIC_NOT_FOUND"})
    assert get(history, "topic=t&channel=nope") == (404, {"message": "CHANNEL_NOT_FOUND"})
    assert get(history, "channel=c") == (400, {"message": "MISSING_ARG_TOPIC"})
    assert get(history, "topic=%zz") == (400, {"message": "INVALID_REQUEST"})


# -- sampler over mqd.clusterinfo.cluster.Cluster ---------------------------------------------


class FakeUpstream:
    """URL → canned JSON document; a URL in `down` (or unknown) fails as an unreachable broker."""

    def __init__(self, docs: dict[str, dict]) -> None:
        self.docs = docs
        self.down: set[str] = set()
        self.urls: list[str] = []

    def get_json(self, url: str) -> Deferred:
        self.urls.append(url)
        base = url.split("?", 1)[0]
        if base in self.down or base not in self.docs:
            return fail(UpstreamError(url, "connection refused"))
        return succeed(self.docs[base])


def peer(address, http_port):
    return {"broadcast_address": address, "hostname": address, "tcp_port": http_port - 1,
            "http_port": http_port, "version": "1.3.0", "remote_address": address + ":1234"}


def test_sampler_over_lookupd_producers(clock):
    upstream = FakeUpstream({
        "http://lookupd:4161/nodes": {"producers": [peer("10.0.0.1", 4151), peer("10.0.0.2", 4151)]},
        "http://10.0.0.1:4151/stats": stats(topic("t", 10)),
        "http://10.0.0.2:4151/stats": stats(topic("t", 20)),
    })
    sample = sampler(Cluster(upstream, ["lookupd:4161"], []))

    got = []
    sample().addCallback(got.append)
    assert sorted(got[0], key=lambda s: s.node) == [
        NodeSample(A, None, stats(topic("t", 10))),
        NodeSample(B, None, stats(topic("t", 20))),
    ]
    stats_urls = [u for u in upstream.urls if "/stats" in u]
    assert stats_urls and all("include_clients=false" in u and "format=json" in u for u in stats_urls)

    # one broker down: listed, without stats; the History then counts only the other
    upstream.down.add("http://10.0.0.2:4151/stats")
    got.clear()
    sample().addCallback(got.append)
    assert sorted(got[0], key=lambda s: s.node) == [
        NodeSample(A, None, stats(topic("t", 10))),
        NodeSample(B, None, None),
    ]


def test_sampler_every_lookupd_down_gives_an_empty_round(clock):
    sample = sampler(Cluster(FakeUpstream({}), ["lookupd:4161"], []))
    got = []
    sample().addCallback(got.append)
    assert got == [[]]


def test_history_over_nsqd_addresses(clock):
    """--nsqd-http-address, no lookupd: the brokers' /info + /stats, rates across rounds."""
    docs = {
        "http://10.0.0.1:4151/info": {"version": "1.3.0", "broadcast_address": "10.0.0.1",
                                      "hostname": "a", "http_port": 4151, "tcp_port": 4150,
                                      "start_time": BOOT},
        "http://10.0.0.1:4151/stats": stats(topic("t", 100, channels=[channel("c", 100, in_flight=4)])),
    }
    upstream = FakeUpstream(docs)
    history = History(clock, 5, 60, sampler(Cluster(upstream, [], ["10.0.0.1:4151"])))
    history.startService()
    docs["http://10.0.0.1:4151/stats"] = stats(topic("t", 125, channels=[channel("c", 110, in_flight=2)]))
    step(clock)
    assert history.points("t") == [(START_TIME, 0.0, 0, 4), (START_TIME + 5, 5.0, 0, 2)]
    assert history.points("t", "c")[-1] == (START_TIME + 5, 2.0, 0, 2)
    history.stopService()
