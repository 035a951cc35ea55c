"""mqadmin's sums: canned /stats of two brokers turned into nsqadmin's TopicStats, ChannelStats, counters.

Broker A (host-a, 10.0.0.1:4151) and B (host-b, 10.0.0.2:4151) both have
topic `orders` and its channel `billing`; `audit` is only on A, `ship` and
topic `events` only on B; B's `orders` and `billing` are paused. Every
expected figure below is worked out by hand from the two documents.
"""

from __future__ import annotations

import copy
import json
import pathlib

import pytest

from mqd.clusterinfo.aggregate import (
    NodeStats,
    all_channel_stats,
    channel_stats,
    counter_stats,
    e2e_aggregate,
    lookupd_producers,
    node_id,
    node_topics,
    nsqd_producer,
    topic_stats,
    version_key,
    warning,
)
from tests.support.admin_fakes import COUNTER_ROWS

FIXTURES = pathlib.Path(__file__).parent / "admin_fixtures"
NOW = 1_700_001_000
A, B = "10.0.0.1:4151", "10.0.0.2:4151"


def fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture
def nodes() -> list[NodeStats]:
    # B first: the aggregates order nodes by hostname whatever order the answers came in.
    return [NodeStats(B, "host-b", fixture("stats_b.json")), NodeStats(A, "host-a", fixture("stats_a.json"))]


def test_topic_sums_across_producers(nodes):
    t = topic_stats(nodes, "orders", NOW)
    assert (t["node"], t["hostname"], t["topic_name"]) == ("*", "", "orders")
    assert t["depth"] == 5 + 8
    assert t["backend_depth"] == 2 + 1
    assert t["memory_depth"] == (5 - 2) + (8 - 1)
    assert t["message_count"] == 107 + 51
    assert t["paused"] is True  # B's is paused
    assert [n["node"] for n in t["nodes"]] == [A, B]
    a = t["nodes"][0]
    assert (a["hostname"], a["depth"], a["memory_depth"], a["backend_depth"], a["message_count"], a["paused"]) == (
        "host-a", 5, 3, 2, 107, False)
    assert a["nodes"] is None
    assert [c["channel_name"] for c in a["channels"]] == ["audit", "billing"]


def test_topic_channels_are_aggregated_in_first_seen_order(nodes):
    t = topic_stats(nodes, "orders", NOW)
    assert [c["channel_name"] for c in t["channels"]] == ["audit", "billing", "ship"]
    audit, billing, ship = t["channels"]
    assert [n["node"] for n in audit["nodes"]] == [A]
    assert [n["node"] for n in ship["nodes"]] == [B]
    assert [n["node"] for n in billing["nodes"]] == [A, B]
    assert billing["depth"] == 30 and billing["memory_depth"] == 21 and billing["backend_depth"] == 9


def test_channel_sums_across_producers(nodes):
    c = channel_stats(nodes, "orders", "billing", NOW)
    assert (c["node"], c["hostname"], c["topic_name"], c["channel_name"]) == ("*", "", "orders", "billing")
    assert c["depth"] == 10 + 20
    assert c["backend_depth"] == 4 + 5
    assert c["memory_depth"] == 6 + 15
    assert c["in_flight_count"] == 2 + 3
    assert c["deferred_count"] == 1 + 2
    assert c["requeue_count"] == 3 + 1
    assert c["timeout_count"] == 1 + 0
    assert c["message_count"] == 100 + 50
    assert c["client_count"] == 1 + 2
    assert c["paused"] is True
    per_node = {n["node"]: n for n in c["nodes"]}
    assert per_node[A]["paused"] is False and per_node[B]["paused"] is True
    assert per_node[B]["memory_depth"] == 15 and per_node[B]["hostname"] == "host-b"
    assert per_node[B]["topic_name"] == "orders"


def test_channel_clients_from_every_node_sorted_by_node(nodes):
    c = channel_stats(nodes, "orders", "billing", NOW)
    assert [(x["node"], x["client_id"]) for x in c["clients"]] == [
        (A, "worker-1"), (B, "worker-0"), (B, "worker-2")]
    w1 = c["clients"][0]
    assert w1["connected"] == (NOW - 1_700_000_100) * 1_000_000_000
    assert (w1["hostname"], w1["user_agent"], w1["remote_address"]) == (
        "worker-1.example", "go-nsq/1.1.0", "10.0.1.1:50001")
    assert (w1["ready_count"], w1["in_flight_count"], w1["finish_count"], w1["requeue_count"],
            w1["message_count"]) == (5, 2, 55, 3, 60)
    assert (w1["tls"], w1["tls_version"], w1["snappy"], w1["deflate"]) == (True, "TLS1.3", True, False)
    assert (w1["authed"], w1["auth_identity"], w1["auth_identity_url"]) == (True, "svc-billing", "")
    assert c["clients"][1]["deflate"] is True or c["clients"][2]["deflate"] is True


def test_channel_missing_everywhere_is_none(nodes):
    assert channel_stats(nodes, "orders", "nope", NOW) is None
    assert channel_stats(nodes, "nope", "billing", NOW) is None


def test_clients_left_out_are_null(nodes):
    for ns in nodes:
        for t in ns.stats["topics"]:
            for c in t["channels"]:
                c["clients"] = None  # /stats?include_clients=false
    c = channel_stats(nodes, "orders", "billing", NOW)
    assert c["clients"] is None
    assert c["client_count"] == 3


def test_e2e_percentiles_aggregated_per_quantile(nodes):
    e2e = topic_stats(nodes, "orders", NOW)["e2e_processing_latency"]
    # A: 20 samples p99 4000 p50 1000; B: 60 samples p99 2000 p50 500.
    assert e2e == {
        "count": 80,
        "percentiles": [
            {"average": 2500, "count": 80, "max": 4000, "min": 2000, "quantile": 0.99, "value": 2500},
            {"average": 625, "count": 80, "max": 1000, "min": 500, "quantile": 0.5, "value": 625},
        ],
        "topic": "orders", "channel": "", "host": "*",
    }
    c = channel_stats(nodes, "orders", "billing", NOW)["e2e_processing_latency"]
    assert (c["topic"], c["channel"], c["count"]) == ("orders", "billing", 80)
    node_a = topic_stats(nodes, "orders", NOW)["nodes"][0]["e2e_processing_latency"]
    assert node_a["percentiles"][0] == {"quantile": 0.99, "value": 4000, "min": 4000, "max": 4000,
                                        "average": 4000, "count": 20}


def test_e2e_disabled_everywhere_is_null_percentiles(nodes):
    e2e = channel_stats(nodes, "orders", "audit", NOW)["e2e_processing_latency"]
    assert e2e == {"count": 0, "percentiles": None, "topic": "orders", "channel": "audit", "host": "*"}
    node = topic_stats(nodes, "events", NOW)["nodes"][0]["e2e_processing_latency"]
    assert node["percentiles"] is None


def test_e2e_weighted_average_with_a_new_quantile():
    a = {"count": 10, "percentiles": [{"quantile": 0.5, "min": 10, "max": 10, "average": 10, "count": 10}]}
    b = {"count": 30, "percentiles": [{"quantile": 0.5, "min": 30, "max": 30, "average": 30, "count": 30},
                                      {"quantile": 0.9, "min": 90, "max": 90, "average": 90, "count": 30}]}
    merged = e2e_aggregate([a, b], "t", "c")["percentiles"]
    assert merged == [{"average": 25, "count": 40, "max": 30, "min": 10, "quantile": 0.5, "value": 25},
                      {"average": 90, "count": 30, "max": 90, "min": 90, "quantile": 0.9, "value": 90}]


def test_topic_on_one_node_only(nodes):
    t = topic_stats(nodes, "events", NOW)
    assert [n["node"] for n in t["nodes"]] == [B]
    # No channel: null, as nsqadmin.
    assert (t["depth"], t["message_count"], t["channels"], t["paused"]) == (3, 3, None, False)


def test_topic_on_no_node_is_nsqadmins_empty_topic(nodes):
    t = topic_stats(nodes, "ghost", NOW)
    assert t["depth"] == 0 and t["message_count"] == 0
    assert t["nodes"] is None and t["channels"] is None and t["e2e_processing_latency"] is None


def test_all_channels_keyed_topic_colon_channel(nodes):
    assert sorted(all_channel_stats(nodes, NOW)) == ["orders:audit", "orders:billing", "orders:ship"]
    assert sorted(all_channel_stats(nodes, NOW, "orders")) == ["audit", "billing", "ship"]


def test_counter_rows_per_topic_channel_node(nodes):
    assert counter_stats(nodes, NOW) == COUNTER_ROWS


def test_counter_rows_in_the_byte_order_of_a_go_maps_keys():
    """nsqadmin writes `alpha:eph#ephemeral:...` before `alpha:eph:...` ('#' is below ':')."""
    channel = copy.deepcopy(fixture("stats_a.json")["topics"][0]["channels"][0])
    channels = [dict(channel, channel_name=name) for name in ("eph", "eph#ephemeral", "a")]
    doc = {"topics": [{"topic_name": "alpha", "channels": channels}]}
    keys = list(counter_stats([NodeStats(A, "host-a", doc)], NOW))
    assert keys == [f"alpha:a:{A}", f"alpha:eph#ephemeral:{A}", f"alpha:eph:{A}"]


def test_node_topics_totals(nodes):
    body = node_topics(nodes[0], NOW)
    assert body["node"] == B
    assert [t["topic_name"] for t in body["topics"]] == ["events", "orders"]
    assert body["total_messages"] == 3 + 51
    assert body["total_clients"] == 2
    assert all(t["node"] == B and t["hostname"] == "host-b" for t in body["topics"])
    billing = body["topics"][1]["channels"][0]
    assert [c["node"] for c in billing["clients"]] == [B, B]


def test_lookupd_producers_one_row_per_broker():
    rows = lookupd_producers([("lk1:4161", fixture("lookupd_nodes_1.json")),
                              ("lk2:4161", fixture("lookupd_nodes_2.json"))])
    assert [r["hostname"] for r in rows] == ["host-a", "host-b"]
    a, b = rows
    assert a["remote_addresses"] == ["lk1:4161/10.0.0.1:40001", "lk2:4161/10.0.0.1:40011"]
    assert b["remote_addresses"] == ["lk1:4161/10.0.0.2:40002"]
    assert (a["out_of_date"], b["out_of_date"]) == (False, True)  # 1.2.1 < 1.3.0
    assert b["topics"] == [{"topic": "events", "tombstoned": True}, {"topic": "orders", "tombstoned": False}]
    assert (a["broadcast_address"], a["tcp_port"], a["http_port"], a["version"]) == ("10.0.0.1", 4150, 4151,
                                                                                      "1.3.0")
    assert node_id(a) == A


def test_nsqd_producer_from_info():
    info = {"version": "1.3.0", "broadcast_address": "10.0.0.9", "hostname": "h9", "http_port": 4151,
            "tcp_port": 4150, "start_time": 1}
    row = nsqd_producer(info, ["b", "a"])
    assert row["remote_addresses"] is None and row["remote_address"] == ""
    assert row["topics"] == [{"topic": "a", "tombstoned": False}, {"topic": "b", "tombstoned": False}]
    assert node_id(row) == "10.0.0.9:4151"
    old = nsqd_producer({"version": "0.3.0"}, [], "10.1.1.1:4999")
    assert (old["broadcast_address"], old["http_port"], old["hostname"], old["topics"]) == (
        "10.1.1.1", 4999, "10.1.1.1", None)


def test_version_order():
    assert version_key("1.2.1") < version_key("1.3.0-alpha") < version_key("1.3.0") < version_key("1.10.0")
    assert version_key("garbage") == version_key("0.0.0")


def test_warning_message():
    assert warning([]) == ""
    assert warning(["a: down", "b: down"]) == "WARNING: a: down; b: down"
