"""mqadmin's retained-log fields and replay control, end to end in headless Chromium.

A cluster of its own (tests/support/admin.Cluster: one mqlookupd, two mqd
run with `--retention-bytes`, mqadmin over the lookupd): the topic page's
retained-log table is checked against each broker's /stats, and a replay
started from the channel page against what a consumer would see, the
channel's depth on each broker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.support.admin import Cluster, Page
from tests.support.processes import http_request, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("admin-retained"), broker_args=["--retention-bytes=10MB"])
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture
def page(browser, cluster, tmp_path) -> Page:
    return Page(browser, cluster.admin, tmp_path)


def _post(broker, path: str) -> None:
    status, answer = http_request(broker.http_address, "POST", path, b"")
    assert status == 200, (path, status, answer)


def test_topic_page_shows_each_brokers_retained_log(cluster, page):
    b1, b2 = cluster.brokers
    topic, plain = "remembered", "forgetful"
    cluster.publish(b1, topic, [b"a%d" % i for i in range(5)])
    cluster.publish(b2, topic, [b"b%d" % i for i in range(3)])
    for broker in (b1, b2):
        cluster.publish(broker, plain, [b"x"])
        _post(broker, f"/topic/retention?topic={plain}&time=0&bytes=0")
    cluster.wait_registered(topic, [b1, b2])
    cluster.wait_registered(plain, [b1, b2])

    page.open(f"topics/{topic}", "topic")
    rows = page.until(lambda: (t := page.table("retained-table")) and len(t) == 2 and t, 10, "both brokers' logs")
    assert page.find("retained-panel").is_displayed()
    for broker, count in ((b1, 5), (b2, 3)):
        kept = cluster.topic_stats(broker, topic)["retained"]
        row = rows[cluster.node(broker)]
        assert row["epoch"] == str(kept["epoch"])
        assert (row["earliest"], row["latest"], row["records"]) == (kept["earliest"], kept["latest"], count)
        assert row["bytes"] == kept["bytes"] > 0
        assert 0 <= row["oldest_age"] < 120
        assert row["retention"] == "10.0 MB"
    page.screenshot("retained")

    # A topic whose retention is off on every broker: no retained-log section at all.
    page.open(f"topics/{plain}", "topic")
    assert not page.find("retained-panel").is_displayed()
    assert page.table("retained-table") == {}


# The datetime-local field set to a moment given in ms, in the browser's own time zone.
_SET_WHEN = """
var el = document.querySelector('[data-test="replay-from"]');
var d = new Date(arguments[0]);
function p(n) { return (n < 10 ? '0' : '') + n; }
el.value = d.getFullYear() + '-' + p(d.getMonth() + 1) + '-' + p(d.getDate()) + 'T' +
  p(d.getHours()) + ':' + p(d.getMinutes()) + ':' + p(d.getSeconds());
"""


def test_replay_from_the_channel_page_queues_the_retained_messages_again(cluster, page):
    b1, b2 = cluster.brokers
    topic, channel = "replayed", "workers"
    for broker in (b1, b2):
        cluster.create_channel(broker, topic, channel)
    cluster.wait_registered(topic, [b1, b2], [channel])
    before_ms = int(time.time() * 1000) - 2000
    cluster.publish(b1, topic, [b"r1-%d" % i for i in range(4)])
    cluster.publish(b2, topic, [b"r2-%d" % i for i in range(6)])
    # What the consumers had is gone: the channel emptied on both brokers.
    for broker in (b1, b2):
        _post(broker, f"/channel/empty?topic={topic}&channel={channel}")
        assert cluster.channel_stats(broker, topic, channel)["depth"] == 0

    page.open(f"topics/{topic}/{channel}", "channel")
    page.until(lambda: page.find("replay-panel").is_displayed(), 10, "the replay control")
    page.driver.execute_script(_SET_WHEN, before_ms)
    result = page.confirm("replay-start", expect="published at or after")
    assert result["state"] == "done", result
    assert sorted((r["address"], r["ok"]) for r in result["results"]) == sorted(
        (cluster.node(b), True) for b in (b1, b2))

    # The consumer-visible effect: each channel holds again what its broker retained.
    for broker, count in ((b1, 4), (b2, 6)):
        wait_for(lambda b=broker, n=count: cluster.channel_stats(b, topic, channel)["depth"] == n, 10,
                 f"the replay into {channel} on {cluster.node(broker)}")
    total = page.until(lambda: (t := page.table("producers-table")) and t.get("total", {}).get("depth") == 10 and t,
                       15, "the page to show the replayed depth")
    assert total["total"]["depth"] == 10
    page.screenshot("replay")
