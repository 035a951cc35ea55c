"""The example pipeline (examples/events_pipeline.py) end to end against a real broker.

The pipeline runs as a user runs it, `python -m examples.events_pipeline` in
a process of its own (its own Spark driver); events go in through nsqd's
HTTP /mpub as examples/publish_events.py sends them, and the windowed counts
are checked where the pipeline writes them: the Parquet directory and the
output topic (/stats for the count, /topic/peek for the bodies, which reads
without consuming). In offset mode with `--available-now`, against a broker
with retention, each run must end by itself after reading what the log
held, and a second run on the same checkpoint only the records since.
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
import pytest

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


def run_pipeline(broker, tmp_path, parquet, *extra: str, timeout: float = 400) -> str:
    """One run of the offset-mode pipeline with Trigger.AvailableNow, which must end by itself; its log."""
    argv = [sys.executable, "-m", "examples.events_pipeline", "--mode", "offset", "--available-now",
            "--nsqd", broker.tcp_address, "--topic", "events", "--out-topic", "event_counts",
            "--parquet", str(parquet), "--checkpoint", str(tmp_path / "checkpoint"),
            "--max-per-trigger", "120", "--master", "local[2]", *extra]
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def parquet_counts(parquet) -> dict:
    table = ds.dataset(str(parquet), format="parquet", partitioning="hive").to_table()
    rows = table.select(["window_start", "kind", "count"]).to_pylist()
    got = {(_utc(r["window_start"]), r["kind"]): r["count"] for r in rows}
    assert len(got) == len(rows), "a window written twice"
    return got


def test_offset_mode_with_available_now_counts_what_the_log_holds_then_stops(start_broker, tmp_path):
    # The nightly run: the topic's retained log, no channel; each run reads on
    # from where the checkpoint says and stops once it has read what the log
    # held when it started.
    broker = start_broker(*FAST_SCAN, "--retention-bytes=50MB")
    parquet = tmp_path / "counts"
    first = synthetic_events(EVENTS, START, SPAN)
    publish(broker.http_address, "events", first)
    http_request(broker.http_address, "POST", "/pub?topic=events", b"not json")
    publish(broker.http_address, "events", [flush_event(first, START)])

    log = run_pipeline(broker, tmp_path, parquet)
    expected = dict(expected_counts(first, 10.0))
    assert parquet_counts(parquet) == expected
    assert topic_message_count(broker, "event_counts") == len(expected)
    # 302 records in batches of at most 120 (maxOffsetsPerTrigger): 3 with data.
    assert "done: 302 messages in " in log and log.count(" messages, watermark ") == 3, log[-3000:]
    # Nothing consumed: the log is read over HTTP, the topic has no channel.
    status, raw = http_request(broker.http_address, "GET", "/stats?format=json&topic=events")
    assert status == 200 and [t["channels"] for t in json.loads(raw)["topics"]] == [[]]

    # The next night: only the new events are read, and only their windows written.
    later = START.replace(hour=14)
    second = synthetic_events(EVENTS, later, SPAN, seed=2)
    publish(broker.http_address, "events", second)
    publish(broker.http_address, "events", [flush_event(second, later)])
    log = run_pipeline(broker, tmp_path, parquet)
    assert "done: 301 messages in " in log, log[-3000:]
    expected.update(expected_counts(second, 10.0))
    assert len(expected) == 36 and parquet_counts(parquet) == expected
    assert topic_message_count(broker, "event_counts") == 36
    status, raw = http_request(broker.http_address, "GET", "/topic/peek?topic=event_counts&n=100")
    bodies = [json.loads(base64.b64decode(m["body"])) for m in json.loads(raw)["messages"]]
    assert {(parse_time(b["window_start"]), b["kind"]): b["count"] for b in bodies} == expected


def test_offset_mode_flags_that_do_not_go_together_are_one_line(tmp_path, capsys):
    from examples.events_pipeline import main

    base = ["--nsqd", "127.0.0.1:4150", "--parquet", str(tmp_path / "p"), "--checkpoint", str(tmp_path / "c")]
    for extra, line in (
        (["--available-now"], "--available-now goes with --mode offset"),
        (["--mode", "offset", "--channel", "c"], "--channel goes with --mode channel"),
        (["--mode", "offset", "--since", "2x"], "--since '2x': want a duration back from now"),
        (["--mode", "offset", "--since", "2h", "--starting-offsets", "earliest"],
         "use --since or --starting-offsets not both"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(base + extra)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"error: {line}" in err.splitlines()[-1], err
