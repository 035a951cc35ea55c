"""The example pipeline (examples/events_pipeline.py) end to end against a real broker.

The query runs in this process on the shared session; events go in through
nsqd's HTTP /mpub as examples/publish_events.py sends them, and the
windowed counts are checked where the pipeline writes them: the Parquet
directory and the output topic (/stats for the count, /topic/peek for the
bodies, which reads without consuming).
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

from examples.events_pipeline import PipelineConfig, start_pipeline
from examples.publish_events import (
    expected_counts,
    flush_event,
    parse_time,
    publish,
    synthetic_events,
)
from tests.integration._support import FAST_SCAN, http_request, wait_for

EVENTS = 300
START = datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC)
SPAN = 60.0  # seconds of event time: six 10 s windows


def topic_message_count(broker, topic: str) -> int:
    status, raw = http_request(broker.http_address, "GET", f"/stats?format=json&topic={topic}")
    assert status == 200, raw
    found = [t for t in json.loads(raw).get("topics") or [] if t["topic_name"] == topic]
    return found[0]["message_count"] if found else 0


def input_rows(query) -> int:
    return sum(p["numInputRows"] for p in query.recentProgress)


def test_windowed_counts_per_kind_reach_parquet_and_the_output_topic(start_broker, spark, tmp_path):
    broker = start_broker(*FAST_SCAN)
    config = PipelineConfig(
        topic="events", out_topic="event_counts", parquet=str(tmp_path / "counts"),
        checkpoint=str(tmp_path / "checkpoint"), nsqd=broker.tcp_address, trigger="500ms")
    events = synthetic_events(EVENTS, START, SPAN)
    expected = expected_counts(events, 10.0)
    assert len(expected) == 18  # 6 windows x 3 kinds

    query = start_pipeline(spark, config)
    try:
        publish(broker.http_address, config.topic, events)
        http_request(broker.http_address, "POST", f"/pub?topic={config.topic}", b"not json")
        # Only once the pipeline has read the run does the flush close its windows:
        # in a later micro-batch than the flush, its events would be late.
        wait_for(lambda: input_rows(query) >= EVENTS + 1, timeout=45, what="the events read")
        publish(broker.http_address, config.topic, [flush_event(events, START)])
        wait_for(lambda: topic_message_count(broker, config.out_topic) >= len(expected),
                 timeout=45, what="every window published")
    finally:
        query.stop()
    assert query.exception() is None

    # Epoch seconds: collect() would turn timestamps into the local time zone's datetimes.
    rows = spark.read.parquet(config.parquet).selectExpr(
        "cast(window_start as long) as start", "cast(window_end as long) as end", "kind",
        "count").collect()
    parquet = {(datetime.fromtimestamp(r.start, UTC), r.kind): r["count"] for r in rows}
    assert len(rows) == len(expected)
    assert parquet == dict(expected)
    assert {r.end - r.start for r in rows} == {10}

    assert topic_message_count(broker, config.out_topic) == len(expected)
    status, raw = http_request(broker.http_address, "GET",
                               f"/topic/peek?topic={config.out_topic}&n=100")
    assert status == 200, raw
    bodies = [json.loads(base64.b64decode(m["body"])) for m in json.loads(raw)["messages"]]
    published = {(parse_time(b["window_start"]), b["kind"]): b["count"] for b in bodies}
    assert published == dict(expected)
