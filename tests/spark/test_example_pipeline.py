"""The example pipeline (examples/events_pipeline.py) end to end against a real broker.

The pipeline runs as a user runs it, `python -m examples.events_pipeline` in
a process of its own (its own Spark driver); events go in through nsqd's
HTTP /mpub as examples/publish_events.py sends them, and the windowed counts
are checked where the pipeline writes them: the Parquet directory and the
output topic (/stats for the count, /topic/peek for the bodies, which reads
without consuming).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime

import pyarrow.dataset as ds

from examples.publish_events import (
    expected_counts,
    flush_event,
    parse_time,
    publish,
    synthetic_events,
)
from tests.support.processes import FAST_SCAN, REPO_ROOT, child_env, http_request, wait_for
from tests.support.stream_query import channel_counts

EVENTS = 300
START = datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC)
SPAN = 60.0  # seconds of event time: six 10 s windows


def _utc(moment: datetime) -> datetime:
    """Spark's Parquet timestamps read back naive (INT96, UTC: the session's zone) or aware."""
    moment = moment.to_pydatetime() if hasattr(moment, "to_pydatetime") else moment
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def topic_message_count(broker, topic: str) -> int:
    status, raw = http_request(broker.http_address, "GET", f"/stats?format=json&topic={topic}")
    assert status == 200, raw
    found = [t for t in json.loads(raw).get("topics") or [] if t["topic_name"] == topic]
    return found[0]["message_count"] if found else 0


def test_windowed_counts_per_kind_reach_parquet_and_the_output_topic(start_broker, tmp_path):
    broker = start_broker(*FAST_SCAN)
    parquet = tmp_path / "counts"
    events = synthetic_events(EVENTS, START, SPAN)
    expected = expected_counts(events, 10.0)
    assert len(expected) == 18  # 6 windows x 3 kinds
    publish(broker.http_address, "events", events)
    http_request(broker.http_address, "POST", "/pub?topic=events", b"not json")

    log = tmp_path / "pipeline.log"
    argv = [sys.executable, "-m", "examples.events_pipeline", "--nsqd", broker.tcp_address,
            "--topic", "events", "--out-topic", "event_counts", "--parquet", str(parquet),
            "--checkpoint", str(tmp_path / "checkpoint"), "--trigger", "500ms",
            "--master", "local[2]"]
    with open(log, "wb") as out:
        pipeline = subprocess.Popen(argv, cwd=REPO_ROOT, env=child_env(), stdout=out,
                                    stderr=out, start_new_session=True)

    def read_all() -> bool:
        assert pipeline.poll() is None, log.read_text()[-3000:]
        try:  # FINished only once Spark committed the batch holding them
            return channel_counts(broker.http_address, "events", "event-counts") == (0, 0, 0)
        except OSError:
            return False

    try:
        # Only once the pipeline has read the run does the flush close its windows:
        # in a later micro-batch than the flush, its events would be late.
        wait_for(read_all, timeout=90, what="the events read")
        publish(broker.http_address, "events", [flush_event(events, START)])
        wait_for(lambda: topic_message_count(broker, "event_counts") >= len(expected),
                 timeout=60, what="every window published")
    finally:
        os.killpg(pipeline.pid, signal.SIGTERM)
        pipeline.wait(30)

    table = ds.dataset(str(parquet), format="parquet", partitioning="hive").to_table()
    rows = table.select(["window_start", "window_end", "kind", "count"]).to_pylist()
    got = {(_utc(r["window_start"]), r["kind"]): r["count"] for r in rows}
    assert len(rows) == len(expected)
    assert got == dict(expected)
    assert {(r["window_end"] - r["window_start"]).total_seconds() for r in rows} == {10}

    assert topic_message_count(broker, "event_counts") == len(expected)
    status, raw = http_request(broker.http_address, "GET", "/topic/peek?topic=event_counts&n=100")
    assert status == 200, raw
    bodies = [json.loads(base64.b64decode(m["body"])) for m in json.loads(raw)["messages"]]
    published = {(parse_time(b["window_start"]), b["kind"]): b["count"] for b in bodies}
    assert published == dict(expected)
