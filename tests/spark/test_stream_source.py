"""`spark.readStream.format("mqd")` against real brokers: exactly once, through crashes of either side.

Every test runs a real query (source -> filter/transform -> Parquet file
sink) on local Spark and checks the sink's committed output, read back by
Spark (the file sink's own log decides which files count), and the
broker's /stats: at the end nothing is left queued or in flight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.client_e2e import free_port
from tests.support.processes import FAST_SCAN, http_request
from tests.support.stream_query import (
    SKIP,
    channel_counts,
    kill_driver,
    start_driver,
    start_query,
    wait_until,
)

TOPIC = "events"
CHANNEL = "spark"


def publish(http_address: str, bodies: list[bytes], topic: str = TOPIC) -> None:
    """Publish through /mpub in chunks; each chunk must be answered OK (acknowledged)."""
    for at in range(0, len(bodies), 5000):
        status, answer = http_request(http_address, "POST", f"/mpub?topic={topic}",
                                      b"\n".join(bodies[at:at + 5000]))
        assert (status, answer) == (200, b"OK"), answer


def drained(http_address: str, topic: str = TOPIC, channel: str = CHANNEL) -> bool:
    """The channel exists and holds nothing: queued, in flight or deferred."""
    try:
        return channel_counts(http_address, topic, channel) == (0, 0, 0)
    except OSError:  # a broker being restarted
        return False


def sink_rows(spark, out: Path) -> list:
    return spark.read.parquet(str(out)).select("body", "message_id", "nsqd").collect()


def assert_exactly_once(rows: list, expected_bodies: set[bytes]) -> None:
    bodies = [r.body for r in rows]
    duplicates = len(bodies) - len(set(bodies))
    assert duplicates == 0, f"{duplicates} messages arrived more than once"
    want = {b.upper().decode() for b in expected_bodies if not b.startswith(SKIP)}
    got = set(bodies)
    assert got == want, f"missing {len(want - got)}, unexpected {len(got - want)}"
    assert len({r.message_id for r in rows}) == len(rows)


def test_a_query_gets_every_message_exactly_once(spark, start_broker, tmp_path):
    broker = start_broker(*FAST_SCAN)
    bodies = [(b"skip-%d" if n % 20 == 0 else b"event-%d") % n for n in range(100_000)]
    publish(broker.http_address, bodies)
    query = start_query(spark, checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "out"),
                        topic=TOPIC, channel=CHANNEL, nsqd=broker.tcp_address,
                        maxMessagesPerTrigger="25000")
    try:
        wait_until(lambda: drained(broker.http_address), 180, "the channel to drain", query)
    finally:
        query.stop()
    rows = sink_rows(spark, tmp_path / "out")
    assert_exactly_once(rows, set(bodies))
    assert {r.nsqd for r in rows} == {broker.tcp_address}
    # Committed batches are removed from the write-ahead log once their FINs are read.
    assert (tmp_path / "ckpt" / "mqd-source" / "source.json").exists()


def _committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    return len([p for p in commits.iterdir() if p.name.isdigit()]) if commits.exists() else 0


def test_a_driver_killed_with_sigkill_resumes_exactly_once(spark, start_broker, tmp_path):
    broker = start_broker(*FAST_SCAN)
    bodies = [b"event-%d" % n for n in range(20_000)]
    publish(broker.http_address, bodies)
    checkpoint, out, log = tmp_path / "ckpt", tmp_path / "out", tmp_path / "driver.log"
    options = {"topic": TOPIC, "channel": CHANNEL, "nsqd": broker.tcp_address,
               "maxMessagesPerTrigger": "3000", "msgTimeout": "4000"}
    driver = start_driver(checkpoint, out, log, **options)
    try:
        wait_until(lambda: _committed_batches(checkpoint) >= 2 or driver.poll() is not None,
                   120, "two committed batches")
        assert driver.poll() is None, log.read_text()[-3000:]
        depth, in_flight, _ = channel_counts(broker.http_address, TOPIC, CHANNEL)
        assert depth + in_flight > 0, "the stream should still be running when the driver dies"
        kill_driver(driver)
        driver = start_driver(checkpoint, out, log, **options)
        wait_until(lambda: drained(broker.http_address) or driver.poll() is not None, 180,
                   "the channel to drain after the restart")
        assert driver.poll() is None, log.read_text()[-3000:]
    finally:
        kill_driver(driver)
    assert_exactly_once(sink_rows(spark, out), set(bodies))
    assert channel_counts(broker.http_address, TOPIC, CHANNEL) == (0, 0, 0)


def test_a_durable_broker_killed_mid_stream_loses_nothing_acknowledged(spark, start_broker, tmp_path):
    tcp, http = free_port(), free_port()
    broker = start_broker(*FAST_SCAN, "--durable", f"--tcp-address=127.0.0.1:{tcp}",
                          f"--http-address=127.0.0.1:{http}", addresses=False)
    bodies = [b"event-%d" % n for n in range(12_000)]
    publish(broker.http_address, bodies)
    query = start_query(spark, checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "out"),
                        topic=TOPIC, channel=CHANNEL, nsqd=broker.tcp_address,
                        maxMessagesPerTrigger="1500", msgTimeout="4000")
    try:
        wait_until(lambda: (query.lastProgress or {}).get("batchId", 0) >= 3, 120,
                   "three batches", query)
        depth, in_flight, _ = channel_counts(broker.http_address, TOPIC, CHANNEL)
        assert depth + in_flight > 0, "the stream should still be running when the broker dies"
        broker.crash()
        broker.start()
        wait_until(lambda: drained(broker.http_address), 180,
                   "the channel to drain after the broker's restart", query)
    finally:
        query.stop()
    assert_exactly_once(sink_rows(spark, tmp_path / "out"), set(bodies))


def test_lookupd_discovery_drains_every_broker_with_the_topic(spark, start_broker, start_lookupd,
                                                              tmp_path):
    """Both brokers found through mqlookupd are drained, over snappy-compressed connections."""
    lookupd = start_lookupd()
    flags = (*FAST_SCAN, "--broadcast-address=127.0.0.1",
             f"--lookupd-tcp-address={lookupd.tcp_address}")
    brokers = [start_broker(*flags) for _ in range(2)]
    bodies = []
    for i, broker in enumerate(brokers):
        mine = [b"broker%d-%d" % (i, n) for n in range(5_000)]
        publish(broker.http_address, mine)
        bodies += mine
    query = start_query(spark, checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "out"),
                        topic=TOPIC, channel=CHANNEL, lookupd=lookupd.http_address,
                        maxMessagesPerTrigger="4000", snappy="true")  # client options pass through
    try:
        wait_until(lambda: all(drained(b.http_address) for b in brokers), 120,
                   "both brokers to drain", query)
        for broker in brokers:
            _, stats = http_request(broker.http_address, "GET", f"/stats?format=json&topic={TOPIC}")
            clients = [c for t in json.loads(stats)["topics"] for ch in t["channels"]
                       for c in ch["clients"]]
            assert clients and all(c["snappy"] for c in clients), clients
    finally:
        query.stop()
    rows = sink_rows(spark, tmp_path / "out")
    assert_exactly_once(rows, set(bodies))
    assert {r.nsqd for r in rows} == {f"127.0.0.1:{b.tcp_port}" for b in brokers}


@pytest.mark.parametrize(("options", "message"), [
    ({"nsqd": "127.0.0.1:{closed}"}, "mqd: no broker reachable: 127.0.0.1:{closed}"),
    ({"nsqd": "127.0.0.1:{closed}", "topic": "no spaces!"}, "is not a valid NSQ name"),
    ({"lookupd": "127.0.0.1:{closed}"}, "mqd: no lookupd reachable: 127.0.0.1:{closed}"),
    ({"nsqd": "127.0.0.1:{closed}", "checkpointLocation": None}, "option checkpointLocation is required"),
], ids=["no-broker", "bad-topic", "no-lookupd", "no-checkpoint"])
def test_a_source_that_cannot_start_fails_the_query_with_one_clear_line(spark, tmp_path, options,
                                                                        message):
    closed = free_port()
    settings = {"topic": TOPIC, "channel": CHANNEL, "checkpointLocation": str(tmp_path / "ckpt")}
    settings.update({k: v.format(closed=closed) if v else v for k, v in options.items()})
    reader = spark.readStream.format("mqd")
    for key, value in settings.items():
        if value is not None:
            reader = reader.option(key, value)
    with pytest.raises(Exception) as failure:  # noqa: PT011 - Spark wraps the source's error
        query = reader.load().writeStream.format("noop").start()
        try:
            query.awaitTermination(60)
        finally:
            query.stop()
    assert message.format(closed=closed) in str(failure.value)


def test_a_checkpoint_of_another_topic_or_channel_is_refused(spark, start_broker, tmp_path):
    broker = start_broker(*FAST_SCAN)
    publish(broker.http_address, [b"one"])
    checkpoint = str(tmp_path / "ckpt")
    first = start_query(spark, checkpoint=checkpoint, out=str(tmp_path / "out"), topic=TOPIC,
                        channel=CHANNEL, nsqd=broker.tcp_address)
    try:
        wait_until(lambda: drained(broker.http_address), 60, "the first query to drain", first)
    finally:
        first.stop()
    other = start_query(spark, checkpoint=checkpoint, out=str(tmp_path / "out"), topic=TOPIC,
                        channel="other", nsqd=broker.tcp_address)
    try:
        with pytest.raises(Exception) as failure:  # noqa: PT011 - Spark wraps the source's error
            other.awaitTermination(60)
    finally:
        other.stop()
    assert f"belongs to topic '{TOPIC}' channel '{CHANNEL}', not topic '{TOPIC}' channel 'other'" \
        in str(failure.value)


def test_large_messages_are_batched_by_bytes_as_well_as_by_count(spark, start_broker, tmp_path):
    """maxBytesPerTrigger cuts batches (and pauses the consumers) by body size."""
    broker = start_broker(*FAST_SCAN)
    bodies = [b"%03d" % n + b"x" * 600_000 for n in range(24)]
    for body in bodies:
        assert http_request(broker.http_address, "POST", f"/pub?topic={TOPIC}", body) == (200, b"OK")
    query = start_query(spark, checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "out"),
                        topic=TOPIC, channel=CHANNEL, nsqd=broker.tcp_address,
                        maxBytesPerTrigger="2000000")
    try:
        wait_until(lambda: drained(broker.http_address), 120, "the channel to drain", query)
        sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    finally:
        query.stop()
    assert sizes and max(sizes) <= 3 and sum(sizes) == len(bodies), sizes
    assert_exactly_once(sink_rows(spark, tmp_path / "out"), set(bodies))
