"""End-to-end processing latency: the options, the rolling window, what /stats shows."""

from __future__ import annotations

import random

import pytest
from twisted.internet.task import Clock

from mqd.http.response import dumps
from mqd.latency import RESERVOIR_SIZE, LatencyWindow, merged_result, parse_percentiles
from mqd.nsqd.stats import stats_json, stats_text
from mqd.options import MQD_OPTIONS, ConfigError, resolve
from tests.support.inprocess_broker import scan
from tests.support.v2_client import Client, mpublish
from tests.support.v2_frames import cmd

NO_E2E = {"count": 0, "percentiles": None}


def approx_ns(value: float):
    # Message timestamps are float seconds × 1e9 at ~1.7e18 ns: a few hundred ns of rounding.
    return pytest.approx(value, abs=2_000)


# -- the options ---------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "stored"), [
    ("0.99", [0.99]),
    ("0.5,0.99,1", [1.0, 0.99, 0.5]),
    (["0.5", "0.99,0.95"], [0.99, 0.95, 0.5]),      # repeated flag, each maybe comma-separated
    ([0.5, 0.99], [0.99, 0.5]),                      # a YAML list of numbers
    ("0.9, 0.9", [0.9]),
    ([], []),
    (None, []),
])
def test_parse_percentiles(given, stored):
    assert parse_percentiles(given) == stored


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1", "abc", "nan", "inf", [True], ["0.5", "2"]])
def test_parse_percentiles_rejects(bad):
    with pytest.raises(ValueError):
        parse_percentiles(bad)


def test_bad_percentile_is_a_startup_error(tmp_path):
    with pytest.raises(ConfigError, match="--e2e-processing-latency-percentile: .*got '1.1'"):
        resolve(MQD_OPTIONS, {"e2e-processing-latency-percentile": ["0.5,1.1"]})
    path = tmp_path / "mqd.yaml"
    path.write_text("e2e_processing_latency_percentiles: [0.99, 0]\n")
    with pytest.raises(ConfigError, match="e2e_processing_latency_percentiles"):
        resolve(MQD_OPTIONS, {}, str(path))


def test_percentile_options_from_yaml_alias(tmp_path):
    path = tmp_path / "mqd.yaml"
    path.write_text("e2e_processing_latency_percentiles: [0.5, 0.99]\n"
                    "e2e-processing-latency-window-time: 30s\n")
    s = resolve(MQD_OPTIONS, {}, str(path))
    assert s.e2e_processing_latency_percentile == [0.99, 0.5]
    assert s.e2e_processing_latency_window_time == 30.0


def test_defaults():
    s = resolve(MQD_OPTIONS, {})
    assert s.e2e_processing_latency_percentile == []
    assert s.e2e_processing_latency_window_time == 600.0
    with pytest.raises(ConfigError):
        resolve(MQD_OPTIONS, {"e2e-processing-latency-window-time": "0s"})


def test_tap_repeatable_flag():
    from mqd.nsqd.tap import Options

    o = Options()
    o.parseOptions(["--e2e-processing-latency-percentile=0.5,0.99",
                    "-e2e-processing-latency-percentile=1"])
    assert resolve(MQD_OPTIONS, o.flag_values()).e2e_processing_latency_percentile == [1.0, 0.99, 0.5]


# -- through the broker ----------------------------------------------------------------------


@pytest.fixture
def e2e_broker(make_broker):
    return make_broker(e2e_processing_latency_percentile="1.0,0.9,0.5",
                       e2e_processing_latency_window_time="10m")


def publish(broker, topic, n):
    mpublish(broker, topic, [b"%d" % i for i in range(n)])


def test_disabled_by_default(inproc_broker, connect):
    c = connect()
    c.sub(rdy=1)
    publish(inproc_broker, "t", 1)
    [m] = c.messages()
    c.fin(m)
    channel = inproc_broker.topics["t"].channels["c"]
    assert channel.e2e is None          # FIN's only cost: this test for None
    s = stats_json(inproc_broker)
    assert s["topics"][0]["e2e_processing_latency"] == NO_E2E
    assert s["topics"][0]["channels"][0]["e2e_processing_latency"] == NO_E2E


def test_known_latencies(e2e_broker, clock):
    c = Client(e2e_broker)
    c.sub(rdy=10)
    publish(e2e_broker, "t", 10)
    msgs = c.messages()
    for m in msgs:                       # FIN the i-th message i seconds after publishing
        clock.advance(1)
        c.fin(m)
    s = stats_json(e2e_broker)
    for row in (s["topics"][0], s["topics"][0]["channels"][0]):
        result = row["e2e_processing_latency"]
        assert result["count"] == 10
        assert [p["quantile"] for p in result["percentiles"]] == [1.0, 0.9, 0.5]
        assert [p["value"] for p in result["percentiles"]] == [
            approx_ns(10e9), approx_ns(9e9), approx_ns(5e9)]
    assert "e2e%: 10.0s, 9.0s, 5.0s\n" in stats_text(e2e_broker, include_mem=False)
    # Go writes the float64 quantile 1.0 as 1.
    assert b'"percentiles":[{"quantile":1,"value":' in dumps(s["topics"][0]["e2e_processing_latency"])


def test_requeue_and_timeout_record_nothing(make_broker, clock):
    broker = make_broker(e2e_processing_latency_percentile="0.5", msg_timeout="2s")
    c = Client(broker)
    c.sub(rdy=2)
    publish(broker, "t", 2)
    m1, _ = c.messages()
    c.req(m1)
    c.send(cmd("RDY", 0))
    clock.advance(2)
    scan(broker)
    result = stats_json(broker)["topics"][0]["channels"][0]["e2e_processing_latency"]
    # Enabled but nothing finished: nsqd reports count 0 and each percentile at 0.
    assert result == {"count": 0, "percentiles": [{"quantile": 0.5, "value": 0}]}


def test_topic_merges_its_channels(e2e_broker, clock):
    fast = Client(e2e_broker, port=1)
    fast.sub("t", "fast", rdy=10)
    slow = Client(e2e_broker, port=2)
    slow.sub("t", "slow", rdy=10)
    publish(e2e_broker, "t", 3)
    clock.advance(1)
    for m in fast.messages():
        fast.fin(m)
    clock.advance(9)
    for m in slow.messages():
        slow.fin(m)
    s = stats_json(e2e_broker)
    [t] = s["topics"]
    assert t["e2e_processing_latency"]["count"] == 6
    values = {p["quantile"]: p["value"] for p in t["e2e_processing_latency"]["percentiles"]}
    assert values == {1.0: approx_ns(10e9), 0.9: approx_ns(10e9), 0.5: approx_ns(1e9)}
    by_channel = {c["channel_name"]: c["e2e_processing_latency"] for c in t["channels"]}
    assert [p["value"] for p in by_channel["fast"]["percentiles"]] == [approx_ns(1e9)] * 3
    assert [p["value"] for p in by_channel["slow"]["percentiles"]] == [approx_ns(10e9)] * 3
    # A channel filter does not narrow the topic's merge (as nsqd).
    filtered = stats_json(e2e_broker, channel="fast")["topics"][0]["e2e_processing_latency"]
    assert filtered["count"] == 6


def test_topic_without_channels(e2e_broker):
    publish(e2e_broker, "t", 1)
    assert stats_json(e2e_broker)["topics"][0]["e2e_processing_latency"] == NO_E2E


# -- the window --------------------------------------------------------------------------------


def window(clock, seconds=10.0, percentiles=(0.5,)):
    return LatencyWindow(list(percentiles), seconds, clock)


def at(clock: Clock, delay: float) -> int:
    """A publish timestamp `delay` seconds before now."""
    return int((clock.seconds() - delay) * 1e9)


def test_window_rotates_by_halves(clock):
    w = window(clock)                     # halves of 5s
    clock.advance(1)
    w.record(at(clock, 0.5))
    assert w.result()["count"] == 1
    clock.advance(4)                      # t=5: not yet past the first half (strictly after)
    assert w.result()["count"] == 1
    clock.advance(1)                      # t=6: rotated once, the old half is still counted
    w.record(at(clock, 0.25))
    assert w.result()["count"] == 2
    clock.advance(5)                      # t=11: rotated again, the t=1 sample is gone
    result = w.result()
    assert result["count"] == 1
    assert result["percentiles"][0]["value"] == approx_ns(0.25e9)
    clock.advance(5)                      # t=16: everything older than a half window is gone
    assert w.result() == {"count": 0, "percentiles": [{"quantile": 0.5, "value": 0}]}


def test_window_after_a_long_silence(clock):
    w = window(clock)
    w.record(at(clock, 1))
    clock.advance(10_000)
    w.record(at(clock, 2))
    assert w.result()["count"] == 1
    clock.advance(4.9)                    # still within the same half window
    assert w.result()["count"] == 1
    clock.advance(5.2)
    assert w.result()["count"] == 0


def test_reservoir_bounds_memory_and_keeps_quantiles(clock):
    random.seed(4)
    w = window(clock, seconds=600, percentiles=(0.99, 0.5, 0.1))
    n = 20 * RESERVOIR_SIZE
    for i in range(n):
        w.record(int(clock.seconds() * 1e9) - i * 1000)    # latencies 0 .. n µs, uniform
    assert all(len(b.samples) <= RESERVOIR_SIZE for b in w._buckets)
    result = w.result()
    assert result["count"] == n
    # A quantile read from 4096 uniform samples is off by ~0.5 percentile
    # point (one standard error); allow four.
    for p in result["percentiles"]:
        assert p["value"] == pytest.approx(p["quantile"] * n * 1000, abs=0.02 * n * 1000)


def test_merge_weights_buckets_by_their_counts(clock):
    """A sampled bucket stands for all it saw: one bucket of 10x values outweighs a small one."""
    random.seed(1)
    big, small = window(clock), window(clock)
    for _ in range(10 * RESERVOIR_SIZE):
        big.record(at(clock, 2))
    for _ in range(RESERVOIR_SIZE):
        small.record(at(clock, 1))
    result = merged_result([0.5, 0.05], [big, small])
    assert result["count"] == 11 * RESERVOIR_SIZE
    assert [p["value"] for p in result["percentiles"]] == [approx_ns(2e9), approx_ns(1e9)]
