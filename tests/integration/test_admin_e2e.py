"""mqadmin end to end: real mqlookupd, two mqd and mqadmin processes, its pages in headless Chromium.

One cluster serves the whole module (starting it costs a few seconds);
each test uses topics of its own, so what one does cannot change another's
numbers, and the test that takes a broker down runs last. Every number a
page shows is checked against the brokers' own /stats (summed across the
two producers as nsqadmin sums them), every action against each broker's
/stats and the lookupd's /lookup, /topics, /channels, /nodes.

With MQD_SCREENSHOTS=1 the pages are also saved into docs/mqadmin/ (the
README's screenshots); otherwise into the test's temporary directory.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from tests.support.admin import Cluster, NotificationSink, Page, RecordedNsqd
from tests.support.processes import http_request, wait_for
from tests.support.raw_conn import RawConn, command

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def notifications() -> Iterator[NotificationSink]:
    sink = NotificationSink()
    try:
        yield sink
    finally:
        sink.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, notifications) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("admin-cluster"),
                admin_args=[f"--notification-http-endpoint={notifications.url}"])
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("admin-screenshots")


@pytest.fixture
def page(browser, cluster, shots) -> Page:
    return Page(browser, cluster.admin, shots)


def _sum(rows, field):
    return sum(r[field] for r in rows)


def _consumer(broker, topic: str, channel: str, user_agent: str, rdy: int, **identify: str) -> RawConn:
    """A raw client: IDENTIFY with a user agent (and `identify`), SUB, RDY `rdy`; its messages stay in flight."""
    conn = RawConn(broker, timeout=10)
    conn.send(command("IDENTIFY", json.dumps({"user_agent": user_agent, **identify}).encode()))
    assert conn.read_frame() == (0, b"OK")
    conn.send(command(f"SUB {topic} {channel}"))
    assert conn.read_frame() == (0, b"OK")
    conn.send(command(f"RDY {rdy}"))
    conn.received = [conn.read_message()[2] for _ in range(rdy)]
    return conn


# -- every page, its numbers equal to the brokers' /stats ---------------------------------------


def test_every_page_shows_the_brokers_numbers_summed_across_producers(cluster, page):
    b1, b2 = cluster.brokers
    n1, n2 = cluster.node(b1), cluster.node(b2)
    topic, channel, other = "orders", "billing", "audit"
    for broker in (b1, b2):
        cluster.create_channel(broker, topic, channel)
    cluster.create_channel(b1, topic, other)
    cluster.publish(b1, topic, [b"o1-%d" % i for i in range(3)])
    cluster.publish(b2, topic, [b"o2-%d" % i for i in range(5)])
    cluster.wait_registered(topic, [b1, b2], [channel, other])
    status, _ = http_request(b2.http_address, "POST", f"/pub?topic={topic}&defer=600000", b"later")
    assert status == 200
    # b1's audit consumed and finished (end-to-end latencies to show), one message in flight
    # on b1's billing, held by a client with a user agent.
    with _consumer(b1, topic, other, "e2e-auditor/1.0", rdy=3) as auditor:
        for message_id in auditor.received:
            auditor.send(command(b"FIN " + message_id))
        wait_for(lambda: cluster.channel_stats(b1, topic, other)["depth"] == 0 and
                 cluster.channel_stats(b1, topic, other)["in_flight_count"] == 0, 5, "audit's FINs")
    consumer = _consumer(b1, topic, channel, "e2e-consumer/1.0", rdy=1,
                         client_id="billing-7", hostname="worker.example.com")
    try:
        wait_for(lambda: cluster.channel_stats(b1, topic, channel)["in_flight_count"] == 1, 5,
                 "the message in flight")
        s1, s2 = cluster.topic_stats(b1, topic), cluster.topic_stats(b2, topic)
        per_node = {n1: s1, n2: s2}
        c1 = {c["channel_name"]: c for c in s1["channels"]}
        c2 = {c["channel_name"]: c for c in s2["channels"]}
        billing = [c1[channel], c2[channel]]
        all_channels = [*s1["channels"], *s2["channels"]]
        assert billing[1]["deferred_count"] == 1 and billing[0]["in_flight_count"] == 1

        # streams
        page.open("", "streams")
        row = page.until(lambda: (page.table("topics-table") or {}).get(topic), 10, "the topic's row")
        assert row["depth"] == s1["depth"] + s2["depth"]
        assert row["message_count"] == s1["message_count"] + s2["message_count"] == 9
        assert row["channel_depth"] == _sum(all_channels, "depth")
        assert row["in_flight_count"] == _sum(all_channels, "in_flight_count") == 1
        assert row["deferred_count"] == _sum(all_channels, "deferred_count") == 1
        assert row["channels"] == 2

        # topic: per producer and the total, then the channels summed across producers
        page.open(f"topics/{topic}", "topic")
        producers = page.table("producers-table")
        for node, stats in per_node.items():
            got = producers[node]
            assert got["depth"] == stats["depth"]
            assert got["backend_depth"] == stats["backend_depth"]
            assert got["memory_depth"] == stats["depth"] - stats["backend_depth"]
            assert got["message_count"] == stats["message_count"]
            assert got["channels"] == len(stats["channels"])
        total = producers["total"]
        assert total["message_count"] == 9 and total["depth"] == s1["depth"] + s2["depth"]
        channels = page.table("channels-table")
        assert set(channels) == {channel, other}
        for field in ("depth", "memory_depth", "backend_depth", "in_flight_count", "deferred_count",
                      "requeue_count", "timeout_count", "message_count"):
            assert channels[channel][field] == sum(
                c.get(field, c["depth"] - c["backend_depth"] if field == "memory_depth" else 0)
                for c in billing), field
        assert channels[channel]["connections"] == _sum(billing, "client_count") == 1
        assert channels[other]["message_count"] == c1[other]["message_count"] == 3
        # End-to-end percentiles: b1's audit alone has samples, so the aggregate is its value.
        latencies = {p["quantile"]: p["value"] for p in c1[other]["e2e_processing_latency"]["percentiles"]}
        assert set(latencies) == {0.5, 0.99}
        assert channels[other]["e2e-p50"] == latencies[0.5]
        assert channels[other]["e2e-p99"] == latencies[0.99]
        # billing has no samples yet (its one message is still in flight): nothing, not "0ns".
        assert channels[channel]["e2e-p50"] == channels[channel]["e2e-p99"] == ""
        topic_latencies = {p["quantile"]: p["value"]
                           for p in s1["e2e_processing_latency"]["percentiles"] or ()}
        assert producers[n1]["e2e-p99"] == topic_latencies[0.99]  # nsqd's topic figure: its channels'
        assert producers["total"]["e2e-p99"] == topic_latencies[0.99]
        # A topic that is not paused has no "paused" badge.
        badge_shown = page.find("paused-badge").is_displayed()

        # channel: per producer, and every client with its attributes
        page.open(f"topics/{topic}/{channel}", "channel")
        producers = page.table("producers-table")
        for node, c in ((n1, billing[0]), (n2, billing[1])):
            for field in ("depth", "in_flight_count", "deferred_count", "requeue_count",
                          "timeout_count", "message_count"):
                assert producers[node][field] == c[field], (node, field)
            assert producers[node]["connections"] == c["client_count"]
        assert producers["total"]["message_count"] == _sum(billing, "message_count") == 9
        assert producers["total"]["depth"] == _sum(billing, "depth")
        clients = page.table("clients-table")
        host, port = consumer.sock.getsockname()[:2]
        address = f"{host}:{port}"
        assert list(clients) == [address]
        client = clients[address]
        assert client["user_agent"] == "e2e-consumer/1.0"
        # Named as nsqadmin names it, its details on hover (title) and on expansion.
        details = _client_details(page, address)
        assert details["name"] == f"worker.example.com:{port} (billing-7)"
        assert details["client_id"] == "billing-7" and details["remote_address"] == address
        assert details["user_agent"] == "e2e-consumer/1.0" and details["version"] == "V2"
        assert (details["tls"], details["compression"]) == ("no", "none")
        assert "User-Agent: e2e-consumer/1.0" in details["title"]
        assert client["ready_count"] == 1 and client["in_flight_count"] == 1
        assert client["node"].endswith(n1) or n1 in client["node"]

        # nodes: both brokers, their ports, version, topics, health
        page.open("nodes", "nodes")
        nodes = page.until(lambda: (t := page.table("nodes-table")) and len(t) == 2 and
                           all(r["health"] for r in t.values()) and t, 10, "both nodes")
        for broker in (b1, b2):
            got = nodes[cluster.node(broker)]
            info = broker.get("/info")[1]
            assert got["tcp_port"] == broker.tcp_port and got["http_port"] == broker.http_port
            assert got["broadcast_address"] == "127.0.0.1"
            assert got["version"] == info["version"]
            assert got["topics"] == len(cluster.stats(broker)["topics"])
            assert got["@up"] == "true" and got["health"] == "up" and got["ping"] == "OK"

        # node: that broker's topics and channels, its totals
        page.open(f"nodes/{n2}", "node")
        topics = page.table("node-topics-table")
        assert topics[topic]["depth"] == s2["depth"]
        assert topics[topic]["message_count"] == s2["message_count"] == 6
        node_channels = page.table("node-channels-table")
        assert node_channels[f"{topic}/{channel}"]["deferred_count"] == 1
        assert f"{topic}/{other}" not in node_channels
        all_b2 = cluster.stats(b2)["topics"]
        assert int(page.find("total_messages").get_attribute("data-value")) == _sum(all_b2, "message_count")

        # counter: per channel across producers, and the cluster's total
        page.open("counter", "counter")
        counter = page.table("counter-table")
        assert counter[f"{topic}/{channel}"]["message_count"] == 9
        assert counter[f"{topic}/{other}"]["message_count"] == 3
        everything = [c for b in (b1, b2) for t in cluster.stats(b)["topics"] for c in t["channels"]]
        assert int(float(page.find("counter-total").get_attribute("data-value"))) == _sum(
            everything, "message_count")

        # lookup: what the lookupd holds, a channel declared with no producer included
        for path in ("/topic/create?topic=signups", "/channel/create?topic=signups&channel=welcome"):
            assert cluster.lookupd.post(path) == 200
        page.open("lookup", "lookup")
        section = f"lookupd-{cluster.lookupd.http_address}"
        assert page.attr(f'[data-test="{section}"]', "data-up") == "true"
        held = page.table("lookup-table", section)
        assert set(held[topic]["channels"].replace(",", " ").split()) == {channel, other}
        assert n1 in held[topic]["producers"] and n2 in held[topic]["producers"]
        assert held["signups"]["channels"] == "welcome"
        assert "127.0.0.1" not in held["signups"]["producers"]
        page.screenshot("lookup")
    finally:
        consumer.close()
    assert not badge_shown, "the paused badge shows on a topic that is not paused"


def _client_details(page: Page, key: str, table: str = "clients-table") -> dict[str, str]:
    """A client row's name, its tooltip, and its details as shown once expanded."""
    row = page.driver.find_element(By.CSS_SELECTOR, f'[data-test="{table}"] [data-test="row-{key}"]')
    name = page.find("client-name", row)
    page.find("client-details", row).find_element(By.TAG_NAME, "summary").click()
    shown = {dd.get_attribute("data-test")[len("detail-"):]: dd.text
             for dd in row.find_elements(By.CSS_SELECTOR, '[data-test^="detail-"]')}
    return {"name": name.text, "title": name.get_attribute("title"), **shown}


def _columns(page: Page, table: str) -> list[str]:
    """A table's cells in column order, by data-test, from its first row."""
    return page.driver.execute_script(
        "var tr = document.querySelector('table[data-test=\"' + arguments[0] + '\"] tbody tr');"
        "return tr ? Array.from(tr.children).map(function (td) { return td.getAttribute('data-test'); }) : [];",
        table)


# -- charts ------------------------------------------------------------------------------------


class _Publisher(threading.Thread):
    """Publishes to a topic on both brokers, a few messages every 100 ms, until stopped."""

    def __init__(self, cluster: Cluster, topic: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.topic = cluster, topic
        self.sent = 0
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                for broker in self.cluster.brokers:
                    self.cluster.publish(broker, self.topic, [b"c"] * 3)
                    self.sent += 3
                self.halt.wait(0.1)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def stop(self) -> int:
        self.halt.set()
        self.join(10)
        assert self.error is None, self.error
        return self.sent


def test_charts_draw_points_that_move_as_messages_flow(cluster, page):
    b1, b2 = cluster.brokers
    topic, channel = "clicks", "counter"
    for broker in (b1, b2):
        cluster.create_channel(broker, topic, channel)
    cluster.wait_registered(topic, [b1, b2], [channel])
    page.open("", "streams")
    chart = page.find("chart-cluster")
    # Time ticks in whole seconds from the start, even over the first few points.
    page.until(lambda: chart.get_attribute("data-x-ticks"), 10, "the cluster chart's time axis")
    assert all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", t) for t in chart.get_attribute("data-x-ticks").split("|")), \
        chart.get_attribute("data-x-ticks")
    page.until(lambda: int(chart.get_attribute("data-points")) > 0, 10, "the cluster chart's first points")
    points, last = int(chart.get_attribute("data-points")), float(chart.get_attribute("data-last"))
    publisher = _Publisher(cluster, topic)
    publisher.start()
    # Three messages held in flight while hundreds queue: in flight must still read as 3.
    holder = _consumer(b1, topic, channel, "chart-holder/1.0", rdy=3)
    try:
        # A few stats intervals (1 s) later the cluster chart has more points, newer ones,
        # and the topic's row shows its rate.
        page.until(lambda: float(chart.get_attribute("data-last") or 0) >= last + 3, 15,
                   "the cluster chart to move on")
        assert int(chart.get_attribute("data-points")) > points
        page.until(lambda: ((page.table("topics-table") or {}).get(topic, {}).get("rate") or 0) > 0, 15,
                   "the topic's rate")
        page.screenshot("streams")

        page.open(f"topics/{topic}", "topic")
        topic_chart = page.find("chart-topic")
        page.until(lambda: int(topic_chart.get_attribute("data-points") or 0) >= 3, 15, "the topic chart")
        assert topic_chart.find_elements(By.TAG_NAME, "canvas"), "uPlot drew nothing"
        # Its depth is the topic's backlog: the topic's own queue and its channels', and says so.
        assert "depth (topic + channels)" in page.driver.find_element(
            By.XPATH, '//*[@data-test="chart-topic"]/ancestor::figure').text
        page.until(lambda: (p := cluster.admin.api(f"api/history?topic={topic}")["points"]) and p[-1]["depth"] > 0,
                   10, "the topic's depth to count its channel's backlog")
        page.until(lambda: all(t and "." not in t for t in [topic_chart.get_attribute("data-x-ticks")]), 10,
                   "whole-second ticks")
        page.screenshot("topic")

        page.open(f"topics/{topic}/{channel}", "channel")
        channel_chart = page.find("chart-channel")
        page.until(lambda: int(channel_chart.get_attribute("data-points") or 0) >= 2, 15, "the channel chart")
        drawn = int(channel_chart.get_attribute("data-points"))
        page.until(lambda: int(channel_chart.get_attribute("data-points")) > drawn, 15,
                   "the channel chart to grow")
        # Rates and counts from zero; in flight (3) on its own scale, not the depth's (hundreds).
        page.until(lambda: json.loads(channel_chart.get_attribute("data-scales") or "{}")
                   .get("depth", [0, 0])[1] > 30, 15, "the depth to climb")
        scales = json.loads(channel_chart.get_attribute("data-scales"))
        assert scales["rate"][0] == scales["depth"][0] == scales["in_flight"][0] == 0, scales
        assert 3 <= scales["in_flight"][1] <= 10, scales

        # The counter page measures the rate itself, between its refreshes.
        page.open("counter", "counter")
        total = page.find("counter-total")
        first = float(total.get_attribute("data-value"))
        page.until(lambda: float(page.find("counter-rate").get_attribute("data-value") or 0) > 0, 15,
                   "the counter's rate")
        assert float(total.get_attribute("data-value")) > first
        page.until(lambda: int(page.find("chart-counter").get_attribute("data-points") or 0) >= 3, 15,
                   "the counter's chart")
        page.screenshot("counter")
    finally:
        sent = publisher.stop()
        holder.close()
    # Every message sent sits in the channel (the holder's three come back): its depth climbs to it.
    path = f"api/history?topic={topic}&channel={channel}"
    wait_for(lambda: cluster.admin.api(path)["points"][-1]["depth"] == sent, 5,
             "the channel's depth to reach what was sent")
    series = cluster.admin.api(path)["points"]
    assert max(p["rate"] for p in series) > 0
    assert series[0]["depth"] < sent
    assert max(p["rate"] for p in cluster.admin.api(f"api/history?topic={topic}")["points"]) > 0
    assert max(p["rate"] for p in cluster.admin.api("api/history")["points"] if p["t"] > last) > 0


# -- peek ---------------------------------------------------------------------------------------


def test_peek_shows_exactly_the_queued_messages_and_changes_no_count(cluster, page):
    b1, b2 = cluster.brokers
    n1, n2 = cluster.node(b1), cluster.node(b2)
    topic, channel = "payments", "ledger"
    for broker in (b1, b2):
        cluster.create_channel(broker, topic, channel)
    published = {n1: [b"pay-1-a", b"pay-1-b", b"\x00\x01binary\xff"], n2: [b"pay-2-a", b"pay-2-b"]}
    cluster.publish(b1, topic, published[n1])
    cluster.publish(b2, topic, published[n2])
    cluster.wait_registered(topic, [b1, b2], [channel])

    def counts():
        return [cluster.topic_stats(b, topic) for b in (b1, b2)]

    before = counts()
    page.open(f"topics/{topic}/{channel}", "channel")
    # Shown once the page knows a broker producing the channel is an mqd.
    panel = page.until(lambda: (p := page.find("peek-panel")).is_displayed() and p, 10, "the peek panel")
    Select(page.find("peek-state")).select_by_value("queued")
    page.click("peek-load")
    page.until(lambda: panel.get_attribute("data-loaded") == "true", 10, "the peek answer")
    nodes = {li.get_attribute("data-test")[len("peek-node-"):]: li.get_attribute("data-total")
             for li in page.driver.find_elements(By.CSS_SELECTOR, '[data-test^="peek-node-"]')}
    assert nodes == {n1: "3", n2: "2"}
    rows = page.table("peek-table")
    assert len(rows) == 5
    text_bodies = {(r["@node"], r["body"]) for r in rows.values()}
    assert {(n, b.decode()) for n, bodies in published.items() for b in bodies
            if b.startswith(b"pay-")} <= text_bodies
    assert all(r["attempts"] == 0 for r in rows.values())
    # Hex shows every byte, the binary one included, without asking the brokers again.
    Select(page.find("peek-format")).select_by_value("hex")
    page.until(lambda: any("00 01" in r["body"] or "0001" in r["body"].replace(" ", "")
                           for r in page.table("peek-table").values()), 5, "the hex bodies")
    hex_bodies = Counter((r["@node"], r["body"].replace(" ", "").lower()) for r in page.table("peek-table").values())
    assert hex_bodies == Counter((n, b.hex()) for n, bodies in published.items() for b in bodies)
    Select(page.find("peek-format")).select_by_value("text")
    page.until(lambda: int(page.find("chart-channel").get_attribute("data-points") or 0) >= 2, 15,
               "the channel chart")
    page.screenshot("channel")
    # Peeking consumed nothing and counted nothing.
    after = counts()
    for b, a in zip(before, after, strict=True):
        assert a["message_count"] == b["message_count"]
        assert a["channels"][0]["depth"] == b["channels"][0]["depth"]
        assert a["channels"][0]["message_count"] == b["channels"][0]["message_count"]
        assert a["channels"][0]["in_flight_count"] == 0
        assert a["channels"][0]["requeue_count"] == 0
    # The JSON API says the same: every message, ids and bodies as the brokers hold them.
    answer = cluster.admin.api(f"api/peek/{topic}/{channel}?state=queued&n=10")
    got = {n["node"]: [base64.b64decode(m["body"]) for m in n["messages"]] for n in answer["nodes"]}
    assert got == published
    assert counts() == after


# -- the JSON API -------------------------------------------------------------------------------


def test_the_json_api_answers_with_nsqadmin_field_names(cluster):
    b1, b2 = cluster.brokers
    n1, n2 = cluster.node(b1), cluster.node(b2)
    topic, channel = "api_topic", "api_channel"
    for broker in (b1, b2):
        cluster.create_channel(broker, topic, channel)
    cluster.publish(b1, topic, [b"a"] * 2)
    cluster.publish(b2, topic, [b"b"] * 3)
    cluster.wait_registered(topic, [b1, b2], [channel])
    admin = cluster.admin

    assert topic in admin.api("api/topics")["topics"]
    t = admin.api(f"api/topics/{topic}")
    for field in ("node", "hostname", "topic_name", "depth", "memory_depth", "backend_depth",
                  "message_count", "nodes", "channels", "paused", "e2e_processing_latency", "message"):
        assert field in t, field
    assert t["node"] == "*" and t["topic_name"] == topic and t["message_count"] == 5 and t["message"] == ""
    assert sorted(n["node"] for n in t["nodes"]) == sorted([n1, n2])
    assert [c["channel_name"] for c in t["channels"]] == [channel]
    assert t["channels"][0]["depth"] == 5

    c = admin.api(f"api/topics/{topic}/{channel}")
    for field in ("node", "topic_name", "channel_name", "depth", "memory_depth", "backend_depth",
                  "in_flight_count", "deferred_count", "requeue_count", "timeout_count",
                  "message_count", "nodes", "clients", "paused", "e2e_processing_latency"):
        assert field in c, field
    assert c["depth"] == 5 and {n["node"]: n["depth"] for n in c["nodes"]} == {n1: 2, n2: 3}

    nodes = admin.api("api/nodes")
    assert nodes["message"] == ""
    by_node = {f"{n['broadcast_address']}:{n['http_port']}": n for n in nodes["nodes"]}
    assert set(by_node) == {n1, n2}
    for broker in (b1, b2):
        node = by_node[cluster.node(broker)]
        for field in ("remote_address", "hostname", "broadcast_address", "tcp_port", "http_port",
                      "version", "topics"):
            assert field in node, field
        assert node["tcp_port"] == broker.tcp_port
        assert {"topic": topic, "tombstoned": False} in node["topics"]

    node = admin.api(f"api/nodes/{n2}")
    assert node["node"] == n2 and "topics" in node and "total_messages" in node
    mine = next(x for x in node["topics"] if x["topic_name"] == topic)
    assert mine["message_count"] == 3

    counter = admin.api("api/counter")["stats"]
    rows = [r for r in counter.values() if r["topic_name"] == topic]
    assert sorted((r["node"], r["message_count"]) for r in rows) == sorted([(n1, 2), (n2, 3)])

    health = {h["node"]: h for h in admin.api("api/health")["nodes"]}
    for broker in (b1, b2):
        h = health[cluster.node(broker)]
        assert h["up"] is True and h["ping"] == "OK" and h["registered"] is True
        assert h["durable"] == broker.get("/config/durable")[1]
        assert h["version"] == broker.get("/info")[1]["version"]
    lookup = admin.api("api/lookup")["lookupds"]
    assert lookup[0]["up"] is True

    assert admin.request("GET", "api/topics/no_such_topic")[0] == 502  # nsqadmin's UPSTREAM_ERROR
    assert admin.request("GET", "api/nodes/127.0.0.1:1") == (404, {"message": "NODE_NOT_FOUND"})
    assert admin.request("PATCH", "api/topics")[0] == 405


# -- actions ---------------------------------------------------------------------------------------


def _result_targets(answer):
    return {(r["target"], r["address"]): r["ok"] for r in answer["results"]}


def test_every_action_takes_effect_on_every_broker_and_lookupd(cluster, page, notifications):
    b1, b2 = cluster.brokers
    seen = len(notifications.events)
    n1, n2 = cluster.node(b1), cluster.node(b2)
    lookupd = cluster.lookupd.http_address
    topic, channel = "inventory", "restock"

    # Create the topic, then a channel, from the lookup page's form.
    page.open("lookup", "lookup")
    page.find("create-topic").send_keys(topic)
    answer = page.confirm("action-create", expect=topic)
    assert answer["state"] == "done", answer
    assert _result_targets(answer) == {("lookupd", lookupd): True}
    assert topic in cluster.lookupd_get("/topics")["topics"]

    cluster.publish(b1, topic, [b"i"] * 2)
    cluster.publish(b2, topic, [b"i"] * 2)
    cluster.wait_registered(topic, [b1, b2])

    def topic_on(broker):
        return cluster.topic_stats(broker, topic)

    # Pause, unpause, empty the topic from its page: every producer. Only the button that
    # applies shows: Pause while it runs, Unpause once paused.
    page.open(f"topics/{topic}", "topic")
    assert page.find("action-pause").is_displayed() and not page.find("action-unpause").is_displayed()
    answer = page.confirm("action-pause")
    assert answer["state"] == "done" and _result_targets(answer) == {("nsqd", n1): True, ("nsqd", n2): True}
    assert topic_on(b1)["paused"] and topic_on(b2)["paused"]
    page.until(lambda: [r["paused"] for r in page.table("producers-table").values()] == ["paused"] * 3,
               10, "the page to show the topic paused on both producers")
    assert page.find("paused-badge").is_displayed()
    assert page.find("action-unpause").is_displayed() and not page.find("action-pause").is_displayed()
    answer = page.confirm("action-unpause")
    assert answer["state"] == "done"
    assert not topic_on(b1)["paused"] and not topic_on(b2)["paused"]
    page.until(lambda: [r["paused"] for r in page.table("producers-table").values()] == [""] * 3,
               10, "the page to show the topic unpaused")
    assert topic_on(b1)["depth"] == 2 and topic_on(b2)["depth"] == 2
    answer = page.confirm("action-empty")
    assert answer["state"] == "done" and _result_targets(answer) == {("nsqd", n1): True, ("nsqd", n2): True}
    assert topic_on(b1)["depth"] == 0 and topic_on(b2)["depth"] == 0

    # A channel: declared on the lookupd and created on both producers.
    page.open("lookup", "lookup")
    page.find("create-topic").send_keys(topic)
    page.find("create-channel").send_keys(channel)
    answer = page.confirm("action-create", expect=channel)
    assert answer["state"] == "done", answer
    assert all(answer_ok for answer_ok in _result_targets(answer).values())
    assert ("lookupd", lookupd) in _result_targets(answer)
    assert channel in cluster.lookupd_get(f"/channels?topic={topic}")["channels"]
    for broker in (b1, b2):
        assert cluster.channel_stats(broker, topic, channel) is not None, cluster.node(broker)
    cluster.publish(b1, topic, [b"r"] * 3)
    cluster.publish(b2, topic, [b"r"] * 4)

    def channel_on(broker):
        return cluster.channel_stats(broker, topic, channel)

    page.open(f"topics/{topic}/{channel}", "channel")
    answer = page.confirm("action-pause")
    assert answer["state"] == "done" and _result_targets(answer) == {("nsqd", n1): True, ("nsqd", n2): True}
    assert channel_on(b1)["paused"] and channel_on(b2)["paused"]
    answer = page.confirm("action-unpause")
    assert not channel_on(b1)["paused"] and not channel_on(b2)["paused"]
    assert (channel_on(b1)["depth"], channel_on(b2)["depth"]) == (3, 4)
    answer = page.confirm("action-empty")
    assert answer["state"] == "done"
    assert (channel_on(b1)["depth"], channel_on(b2)["depth"]) == (0, 0)
    answer = page.confirm("action-delete", expect=channel)
    assert answer["state"] == "done", answer
    targets = _result_targets(answer)
    assert targets[("lookupd", lookupd)] and targets[("nsqd", n1)] and targets[("nsqd", n2)]
    assert channel_on(b1) is None and channel_on(b2) is None
    assert channel not in cluster.lookupd_get(f"/channels?topic={topic}")["channels"]

    # Tombstone the topic on b1 from its node page: the lookupd stops handing it out, b1 drops it.
    page.open(f"nodes/{n1}", "node")
    row = page.until(lambda: page.driver.find_elements(
        By.CSS_SELECTOR, f'[data-test="node-topics-table"] [data-test="row-{topic}"]'), 10, "the topic row")[0]
    answer = page.confirm(row.find_element(By.CSS_SELECTOR, '[data-test="action-tombstone"]'), expect=topic)
    assert answer["state"] == "done", answer
    targets = _result_targets(answer)
    assert targets[("lookupd", lookupd)] and targets[("nsqd", n1)]
    # (b1's delete unregisters the topic, which ends the tombstoned registration on the lookupd too.)
    producers = cluster.lookupd_get(f"/lookup?topic={topic}")["producers"]
    assert [p["http_port"] for p in producers] == [b2.http_port]
    assert topic_on(b1) is None and topic_on(b2) is not None

    # Delete the topic: the lookupd first, then the producers.
    page.open(f"topics/{topic}", "topic")
    answer = page.confirm("action-delete", expect=topic)
    assert answer["state"] == "done", answer
    targets = _result_targets(answer)
    assert targets[("lookupd", lookupd)] and targets[("nsqd", n2)]
    assert [r["target"] for r in answer["results"]][0] == "lookupd"
    assert topic not in cluster.lookupd_get("/topics")["topics"]
    assert topic_on(b2) is None and topic_on(b1) is None

    # Each action was POSTed to --notification-http-endpoint as nsqadmin's event, in order.
    expected = [("create_topic", topic), ("pause_topic", topic), ("unpause_topic", topic),
                ("empty_topic", topic), ("create_topic", topic), ("create_channel", topic, channel),
                ("pause_channel", topic, channel), ("unpause_channel", topic, channel),
                ("empty_channel", topic, channel), ("delete_channel", topic, channel),
                ("tombstone_topic_producer", topic), ("delete_topic", topic)]
    wait_for(lambda: len(notifications.events) >= seen + len(expected), 5, "the notifications")
    assert notifications.actions()[seen:] == expected
    tombstone = notifications.events[seen + 10]
    assert tombstone["node"] == n1
    for event in notifications.events[seen:]:
        assert event["url"].startswith(cluster.admin.url("api/"))
        assert event["remote_ip"].startswith("127.0.0.1:")  # Go's RemoteAddr, as nsqadmin sends it
        assert "Chrome" in event["user_agent"]
        assert isinstance(event["timestamp"], int) and event["via"]


def test_a_snapshot_is_taken_from_the_nodes_page(cluster, page):
    b1 = cluster.brokers[0]
    n1 = cluster.node(b1)
    cluster.create_channel(b1, "snap_topic", "snap_channel")
    cluster.publish(b1, "snap_topic", [b"s"] * 4)
    cluster.wait_registered("snap_topic", [b1], ["snap_channel"])
    page.open("nodes", "nodes")
    row = page.until(lambda: page.driver.find_elements(
        By.CSS_SELECTOR, f'[data-test="nodes-table"] [data-test="row-{n1}"]'), 10, "the node row")[0]
    page.until(lambda: row.find_elements(By.CSS_SELECTOR, '[data-test="action-snapshot"]'), 10, "the button")
    page.confirm(row.find_element(By.CSS_SELECTOR, '[data-test="action-snapshot"]'))
    result = page.until(lambda: page.find("snapshot-result").is_displayed() and page.find("snapshot-result"),
                        15, "the snapshot's answer")
    assert result.get_attribute("data-node") == n1
    path = page.find("snapshot-path").text
    assert path.startswith(str(b1.data_dir)), path
    queues = page.table("snapshot-queues")
    assert queues["snap_topic:snap_channel"]["count"] == queues["snap_topic:snap_channel"]["queued"] == 4
    assert queues["snap_topic"]["count"] == 0
    assert int(page.find("snapshot-total").get_attribute("data-value")) == sum(q["count"] for q in queues.values())
    # The broker wrote it where the page says.
    assert (Path(path) / "manifest.json").is_file()


# -- an nsqd beside an mqd ------------------------------------------------------------------------


def test_an_nsqd_gets_nsqadmins_view_and_none_of_mqds_own_controls(cluster, browser, shots):
    """mqadmin over an mqd and a (recorded) nsqd 1.3.0: the nsqd's clients named and detailed as
    nsqadmin shows them, its percentiles in order, and no Durable, Snapshot or Peek for it."""
    nsqd = RecordedNsqd()
    b1 = cluster.brokers[0]
    n1, legacy = cluster.node(b1), nsqd.http_address
    admin = cluster.start_admin(nsqds=[b1.http_address, legacy])
    try:
        page = Page(browser, admin, shots)
        page.open("nodes", "nodes")
        nodes = page.until(lambda: (t := page.table("nodes-table")) and len(t) == 2 and
                           all(r["health"] == "up" for r in t.values()) and t, 15, "both brokers up")
        assert nodes[legacy]["durable"] == "" and nodes[legacy]["backend"] == ""
        assert nodes[n1]["durable"] in ("yes", "no") and nodes[n1]["backend"]
        row = {key: page.driver.find_element(By.CSS_SELECTOR, f'[data-test="nodes-table"] [data-test="row-{key}"]')
               for key in (n1, legacy)}
        assert row[n1].find_elements(By.CSS_SELECTOR, '[data-test="action-snapshot"]')
        assert not row[legacy].find_elements(By.CSS_SELECTOR, '[data-test="action-snapshot"]')

        # The topic: p50 before p99 in both tables (the nsqd lists 0.99 first); no samples, no figure.
        recorded = {c["channel_name"]: c for c in nsqd.stats["topics"][0]["channels"]}
        page.open("topics/legacy", "topic")
        for table in ("producers-table", "channels-table"):
            columns = _columns(page, table)
            assert columns.index("e2e-p50") < columns.index("e2e-p99"), (table, columns)
        channels = page.table("channels-table")
        assert recorded["unread"]["e2e_processing_latency"]["count"] == 0
        assert channels["unread"]["e2e-p50"] == channels["unread"]["e2e-p99"] == ""
        idle_p99 = next(p["value"] for p in recorded["idle"]["e2e_processing_latency"]["percentiles"]
                        if p["quantile"] == 0.99)
        assert channels["idle"]["e2e-p99"] == idle_p99

        # The channel: every client as nsqadmin names it (" (client_id)" unless it is the
        # hostname), with what it negotiated; no peek, which nsqd cannot answer.
        page.open("topics/legacy/idle", "channel")
        clients = page.table("clients-table")
        by_id = {c["client_id"]: c for c in recorded["idle"]["clients"]}
        assert set(clients) == {c["remote_address"] for c in by_id.values()}
        shown = {}
        for client_id, c in by_id.items():
            shown[client_id] = _client_details(page, c["remote_address"])
            assert shown[client_id]["user_agent"] == c["user_agent"]
            assert shown[client_id]["client_id"] == client_id
        port = {i: c["remote_address"].rsplit(":", 1)[1] for i, c in by_id.items()}
        assert shown["worker-7"]["name"] == f"worker.example.com:{port['worker-7']} (worker-7)"
        assert shown["vm"]["name"] == f"vm:{port['vm']}"
        assert shown["secure-1"]["name"] == f"vm:{port['secure-1']} (secure-1)"
        assert (shown["worker-7"]["compression"], shown["worker-7"]["sample_rate"]) == ("snappy", "50%")
        assert shown["vm"]["compression"] == "deflate"
        assert shown["secure-1"]["tls"] == "TLS1.2 TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"
        assert "Sampled 50%" in clients[by_id["worker-7"]["remote_address"]]["attributes"]
        assert "Snappy" in clients[by_id["worker-7"]["remote_address"]]["attributes"]
        assert "TLS" in clients[by_id["secure-1"]["remote_address"]]["attributes"]
        page.wait_refresh()
        assert not page.find("peek-panel").is_displayed()
        page.screenshot("clients")
    finally:
        admin.stop()
        nsqd.close()


# -- base path and ACL -------------------------------------------------------------------------


def test_base_path_and_the_admin_user_acl(cluster, browser, shots, notifications):
    admin = cluster.start_admin("--admin-user=alice", base_path="/admin/")
    assert admin.base == "/admin/"
    b1 = cluster.brokers[0]
    cluster.publish(b1, "acl_topic", [b"x"])
    cluster.wait_registered("acl_topic", [b1])
    # The API and the pages under the base path; nothing at the root.
    assert "acl_topic" in admin.api("api/topics")["topics"]
    status, _ = http_request(admin.http_address, "GET", "/api/topics")
    assert status == 404
    page = Page(browser, admin, shots)
    page.open("", "streams")
    assert "acl_topic" in page.table("topics-table")
    page.driver.find_element(By.CSS_SELECTOR, '[data-test="row-acl_topic"] a').click()
    page.wait_loaded("topic")
    assert page.driver.current_url == admin.url("topics/acl_topic")

    # Writes: only alice, as named by the proxy's header.
    body = {"topic": "acl_created"}
    assert admin.request("POST", "api/topics", body) == (403, {"message": "FORBIDDEN"})
    assert admin.request("POST", "api/topics", body, {"X-Forwarded-User": "mallory"})[0] == 403
    assert "acl_created" not in cluster.lookupd_get("/topics")["topics"]
    status, answer = admin.request("POST", "api/topics", body, {"X-Forwarded-User": "alice"})
    assert status == 200, answer
    assert "acl_created" in cluster.lookupd_get("/topics")["topics"]
    event = wait_for(lambda: next((e for e in notifications.events if e["topic"] == "acl_created"), None),
                     5, "the create_topic notification")
    assert event["action"] == "create_topic" and event["user"] == "alice"
    assert event["url"] == admin.url("api/topics")
    # The page (no proxy in front of it here) shows the refusal.
    answer = page.confirm("action-pause")
    assert answer["state"] == "failed" and "FORBIDDEN" in answer["message"], answer
    assert not cluster.topic_stats(b1, "acl_topic")["paused"]
    admin.stop()


# -- a broker down (last: it takes one away) ---------------------------------------------------------


def test_a_broker_down_shows_as_down_while_the_other_keeps_working(cluster, page):
    b1, b2 = cluster.brokers
    n1, n2 = cluster.node(b1), cluster.node(b2)
    topic = "shipments"
    cluster.publish(b1, topic, [b"s"] * 2)
    cluster.publish(b2, topic, [b"s"] * 3)
    cluster.wait_registered(topic, [b1, b2])
    # Frozen, b2 stays registered with the lookupd (its connection is open) but answers
    # nothing: an action on the topic still targets it, and shows it failed.
    b2.proc.send_signal(signal.SIGSTOP)
    try:
        page.open(f"topics/{topic}", "topic")
        page.until(lambda: n2 in page.text("warning"), 15, "the warning naming the frozen broker")
        assert page.table("producers-table")[n1]["message_count"] == 2
        answer = page.confirm("action-pause")
        assert answer["state"] == "partial", answer
        assert _result_targets(answer) == {("nsqd", n1): True, ("nsqd", n2): False}
        failed = next(r for r in answer["results"] if not r["ok"])
        assert failed["text"], "the failure is shown"
        page.wait_refresh()
        assert page.table("producers-table")[n1]["paused"], "b1's topic shows as paused"
        page.screenshot("actions")
        assert cluster.topic_stats(b1, topic)["paused"]
    finally:
        b2.proc.send_signal(signal.SIGCONT)

    # Terminated, b2 leaves the lookupd; the nodes page still lists it, as down.
    b2.stop_cleanly()
    wait_for(lambda: len(cluster.lookupd_get("/nodes")["producers"]) == 1, 10, "b2 to unregister")
    page.open("nodes", "nodes")
    nodes = page.until(lambda: (t := page.table("nodes-table")) and t.get(n2, {}).get("@up") == "false"
                       and t, 15, "the stopped broker to show as down")
    assert nodes[n2]["health"] == "down"
    assert nodes[n1]["@up"] == "true" and nodes[n1]["health"] == "up"
    assert str(b2.http_port) in page.text("warning")
    page.screenshot("nodes")
    health = {h["node"]: h for h in cluster.admin.api("api/health")["nodes"]}
    assert health[n2]["up"] is False and health[n2]["registered"] is False and health[n2]["error"]
    assert health[n1]["up"] is True

    # The rest works with b1 alone.
    page.open(f"topics/{topic}", "topic")
    assert not page.find("warning").is_displayed()
    assert page.table("producers-table")["total"]["message_count"] == 2
    answer = page.confirm("action-unpause")
    assert answer["state"] == "done" and _result_targets(answer) == {("nsqd", n1): True}
    assert not cluster.topic_stats(b1, topic)["paused"]
    status, body = cluster.admin.request("GET", f"api/topics/{quote(topic)}")
    assert status == 200 and body["message"] == "" and body["message_count"] == 2
