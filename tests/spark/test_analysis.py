"""spark_bridge.analysis on a snapshot whose ages, sizes, attempts and deferrals are known.

Messages are published at known offsets before the moment the snapshot is
built; ages are measured from the manifest's time, so every expected age
is exact: (manifest time - publication) to the microsecond. Offsets keep
clear of bucket bounds by more than the few seconds building can take.
Percentiles are nearest-rank (what percentile_approx gives on few values).

`states_result` analyses a snapshot as a live broker takes it (manifest
version 2): a channel whose rows are queued (stored and in memory), in
flight with two clients, and deferred, so the per-state numbers are exact
too.

The last section analyses windows of real brokers' retained logs
(`analyze --topic`): a window by time or by offsets must hold exactly the
records published in it, on one broker or two.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import pyarrow.parquet as pq
import pytest
from pyspark.sql import DataFrame
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from mqd.nsqd.snapshot_format import MANIFEST, STATES, read_manifest
from spark_bridge import analysis as mq
from spark_bridge.__main__ import main
from spark_bridge.report import format_age, render_html, render_text, write_html
from tests.ensure_browser import BROWSER, DRIVER
from tests.support.known_snapshots import Held, build_snapshot, expected_rows, message, micros
from tests.support.processes import (
    FAST_SCAN,
    REPO_ROOT,
    BrokerProcess,
    LookupdProcess,
    child_env,
    http_request,
    wait_for,
)

AGES_S = [15, 25, 35, 45, 55, 65, 75, 85, 95, 105]  # orders:billing, publication = now - age
SIZES = [100 * (i + 1) for i in range(10)]
ATTEMPTS = [0, 0, 1, 1, 2, 3, 6, 7, 0, 9]  # poison (> 5): 6, 7, 9
DEFERRED_IN_S = {2: -5.0, 4: 30.0, 8: 7200.0}  # index -> due relative to now: overdue, < 1 min, 1-24 h
EVENTS = [b'{"type": "a", "n": 1}', b'{"type": "b"}', b'{"type": "a"}', b"not json",
          b'{"type": "a", "x": [1, 2]}', b'{"other": 1}']


def _billing(now_ns):
    out = []
    for i, (age, size, attempts) in enumerate(zip(AGES_S, SIZES, ATTEMPTS, strict=True)):
        deferred = now_ns / 1e9 + DEFERRED_IN_S[i] if i in DEFERRED_IN_S else 0.0
        out.append(message(1000 + i, b"b" * size, timestamp=now_ns - age * 10**9,
                           attempts=attempts, deferred_until=deferred))
    return out


def published(now_ns):
    return {
        "orders": [message(1, b"o" * 50, timestamp=now_ns - 2 * 86400 * 10**9)],  # 2 days old
        "orders:billing": _billing(now_ns),
        "orders:ship": [],
        "events:audit": [message(2000 + i, body, timestamp=now_ns - 3 * 10**9, attempts=1)
                         for i, body in enumerate(EVENTS)],
    }


@pytest.fixture(scope="module")
def now_ns():
    return time.time_ns()


@pytest.fixture(scope="module")
def snap(tmp_path_factory, now_ns):
    # Built right after `now_ns`: the snapshot's time is within milliseconds of it.
    return build_snapshot(tmp_path_factory.mktemp("analysis"), published(now_ns))


@pytest.fixture(scope="module")
def result(spark, snap) -> mq.Analysis:
    steps = []
    analysis = mq.analyze(spark, str(snap), json_field_name="type",
                          progress=lambda *args: steps.append(args))
    analysis.steps = steps  # for the progress test
    return analysis


def nearest_rank(values, p):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p * len(ordered))) - 1]


def queue(result, topic, channel):
    (row,) = [q for q in result.queues if q["topic"] == topic and q["channel"] == channel]
    return row


def exact_ages(snap, timestamps_ns):
    as_of_us = micros(mq.snapshot_time(str(snap)))
    return [(as_of_us - ts // 1000) / 1e6 for ts in timestamps_ns]


def test_backlog_ages_and_sizes_per_queue(result, snap, now_ns):
    queues = published(now_ns)
    billing = queue(result, "orders", "billing")
    ages = exact_ages(snap, [m.timestamp for m in queues["orders:billing"]])
    assert billing["kind"] == "channel"
    assert billing["messages"] == 10
    assert billing["bytes"] == sum(SIZES)
    assert billing["oldest_age_s"] == pytest.approx(max(ages), abs=1e-6)
    assert micros(billing["oldest"]) == (now_ns - 105 * 10**9) // 1000
    for p in mq.PERCENTILES:
        tag = f"p{round(p * 100)}"
        assert billing[f"age_{tag}_s"] == pytest.approx(nearest_rank(ages, p), abs=1e-6)
        assert billing[f"size_{tag}"] == nearest_rank(SIZES, p)
    assert billing["size_max"] == 1000
    assert billing["max_attempts"] == 9
    # Stored records are queued, deferred_until or not: 3 are scheduled.
    assert (billing["queued"], billing["in_flight"], billing["deferred"]) == (10, 0, 0)
    assert billing["scheduled"] == 3
    assert (billing["in_flight_share"], billing["oldest_in_flight_age_s"]) == (0.0, None)
    assert billing["poison"] == 3

    topic = queue(result, "orders", None)
    assert (topic["kind"], topic["messages"], topic["bytes"]) == ("topic", 1, 50)
    assert topic["oldest_age_s"] == pytest.approx(exact_ages(snap, [queues["orders"][0].timestamp])[0],
                                                  abs=1e-6)
    # The empty queue is listed, with nothing in it.
    ship = queue(result, "orders", "ship")
    assert (ship["messages"], ship["bytes"], ship["oldest_age_s"], ship["poison"]) == (0, 0, None, 0)
    assert (ship["queued"], ship["in_flight"], ship["deferred"], ship["scheduled"]) == (0, 0, 0, 0)
    assert (ship["in_flight_share"], ship["oldest_in_flight_age_s"]) == (None, None)
    assert result.total == 17
    assert [(q["topic"], q["channel"]) for q in result.queues] == [
        ("events", "audit"), ("orders", None), ("orders", "billing"), ("orders", "ship")]


def test_age_and_size_histograms(result):
    ages = {(r["topic"], r["channel"], r["bucket"]): r["messages"] for r in result.age_histogram}
    assert ages == {
        ("orders", "billing", "10-60 s"): 5,  # 15..55 s
        ("orders", "billing", "1-10 min"): 5,  # 65..105 s
        ("orders", None, "1-7 d"): 1,
        ("events", "audit", "1-10 s"): 6,
    }
    sizes = {(r["topic"], r["channel"], r["bucket"]): r["messages"] for r in result.size_histogram}
    assert sizes == {
        ("orders", "billing", "100 B-1 KB"): 9,  # 100..900
        ("orders", "billing", "1-10 KB"): 1,  # 1000
        ("orders", None, "< 100 B"): 1,
        ("events", "audit", "< 100 B"): 6,
    }


def test_attempts_histogram_and_poison_messages(result):
    billing = {r["attempts"]: r["messages"] for r in result.attempts_histogram
               if r["channel"] == "billing"}
    assert billing == {0: 3, 1: 2, 2: 1, 3: 1, 6: 1, 7: 1, 9: 1}
    audit = {r["attempts"]: r["messages"] for r in result.attempts_histogram if r["channel"] == "audit"}
    assert audit == {1: 6}
    # Most-tried first, with the ids the test published.
    assert [(p["message_id"], p["attempts"]) for p in result.poison] == [
        (f"{1009:016x}", 9), (f"{1007:016x}", 7), (f"{1006:016x}", 6)]
    assert result.poison_total == 3


def test_deferred_backlog_by_due_time(result, now_ns):
    rows = [(r["topic"], r["channel"], r["bucket"], r["messages"]) for r in result.deferred]
    assert rows == [
        ("orders", "billing", "overdue", 1),
        ("orders", "billing", "< 1 min", 1),
        ("orders", "billing", "1-24 h", 1),
    ]
    due = {r["bucket"]: micros(r["next_due"]) for r in result.deferred}
    assert due["< 1 min"] == round((now_ns / 1e9 + 30.0) * 1e6)


def test_json_field_groups_bodies(result):
    counts = {(r["channel"], r["json_value"]): r["messages"] for r in result.json_counts}
    # Bodies that are not JSON or lack the field form one group (None).
    assert counts == {("audit", "a"): 3, ("audit", "b"): 1, ("audit", None): 2,
                      ("billing", None): 10, (None, None): 1}


def test_progress_is_reported_for_each_step(result):
    steps = result.steps
    labels = [label for _, _, label, seconds in steps if seconds is None]
    assert len(labels) == steps[0][1] and labels[0].startswith("reading 17 messages")
    assert any("JSON field 'type'" in label for label in labels)
    # Every step is announced (all are submitted at once), then each is
    # reported once with its time as it finishes.
    n = len(labels)
    assert [s[:3] for s in steps[:n]] == [(i, n, label) for i, label in enumerate(labels, 1)]
    finished = steps[n:]
    assert sorted((s[0], s[2]) for s in finished) == list(enumerate(labels, 1))
    assert all(s[3] >= 0 for s in finished) and result.seconds == {s[2]: s[3] for s in finished}


def test_a_failing_step_cancels_the_other_jobs_of_analyze_only(spark):
    from pyspark.sql import functions as F

    def sleepy(rows: int, seconds: float) -> DataFrame:
        nap = F.udf(lambda x: time.sleep(seconds) or x, "long")
        return spark.range(0, rows, numPartitions=1).select(nap("id").alias("id"))

    outcome = []

    def long_job():  # ~60 s unless cancelled
        try:
            return sleepy(300, 0.2).collect()
        except Exception as e:
            outcome.append(type(e).__name__)
            raise

    def failing():
        time.sleep(2)  # the long job is running by then
        raise ValueError("boom")

    # A job of someone else's in the same session, started alongside.
    others = []
    bystander = threading.Thread(target=lambda: others.append(sleepy(40, 0.1).collect()))
    bystander.start()
    with pytest.raises(ValueError, match="boom"):
        mq._run_concurrently(spark, [("long", long_job), ("fails", failing)], None)
    bystander.join()
    # Cancelled, not run to its end; the bystander's job was left alone.
    assert outcome and outcome[0] != "ValueError"
    assert [r.id for r in others[0]] == list(range(40))


def test_library_functions_return_dataframes(spark, snap, result):
    df = mq.read_snapshot(spark, str(snap))
    as_of = mq.snapshot_time(str(snap))
    assert as_of == result.as_of
    # analyze() rolls the histograms up from collected bucket counts; the
    # DataFrame functions do it in Spark: same rows, same order.
    assert mq._collect(mq.age_histogram(df, as_of)) == result.age_histogram
    assert mq._collect(mq.size_histogram(df)) == result.size_histogram
    assert mq._collect(mq.attempts_histogram(df)) == result.attempts_histogram
    assert mq._collect(mq.deferred_backlog(df, as_of)) == result.deferred
    assert mq._collect(mq.state_counts(df, as_of)) == result.states
    for frame in (mq.queue_summary(df, as_of), mq.age_histogram(df, as_of), mq.size_histogram(df),
                  mq.attempts_histogram(df), mq.poison_messages(df), mq.deferred_backlog(df, as_of),
                  mq.json_field_counts(df, "type"), mq.bucket_counts(df, as_of),
                  mq.state_counts(df, as_of)):
        assert isinstance(frame, DataFrame)
    # Users compose them: the poison messages of one channel, from the DataFrame.
    ids = [r.message_id for r in mq.poison_messages(df.filter("channel = 'billing'"), 6).collect()]
    assert ids == [f"{1009:016x}", f"{1007:016x}"]
    assert mq.json_field_counts(df, "type").filter("json_value = 'a'").first().messages == 3


def test_text_report(result):
    text = render_text(result)
    assert "17 messages in 4 queues: 17 queued, 0 in flight, 0 deferred" in text
    assert "a copy of a store's files" in text and "left out" not in text
    line = next(x for x in text.splitlines() if x.startswith("orders/billing"))
    assert "10" in line.split() and "1m 45s" in line  # backlog, oldest age ~105 s
    assert f"{1009:016x}" in text
    assert "poison messages (attempts > 5): 3" in text
    assert "overdue" in text and "1-24 h" in text
    assert "JSON field 'type'" in text


CHARTS = ["Backlog per queue by state", "Oldest message age", "Message ages", "Body sizes",
          "Deferred backlog by due time", "Attempts"]  # the report's, in order


def test_html_report_embeds_the_charts(result, tmp_path):
    out = tmp_path / "report.html"
    write_html(result, str(out))
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    titles = [title for title, _ in images]
    assert titles == CHARTS
    for _, data in images:
        png = base64.b64decode(data)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert f"{1009:016x}" in page and "orders/billing" in page
    assert render_html(result) == page


# The report is one file, mailed around and opened from disk: a real
# browser (headless Chromium through Selenium, Debian's packages, installed
# by tests/ensure_browser.py before the suite) must show every chart and
# table with nothing fetched from anywhere.


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_report_shows_its_charts_and_tables_in_a_browser(browser, result, tmp_path):
    page = tmp_path / "report.html"
    write_html(result, str(page))
    browser.get(page.as_uri())
    assert browser.execute_script("return document.readyState") == "complete"
    assert browser.title.startswith("mqd snapshot ")
    images = browser.execute_script(
        "return Array.from(document.images).map("
        "i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight, i.getBoundingClientRect().width])")
    assert [alt for alt, *_ in images] == CHARTS
    for alt, complete, width, height, shown in images:
        assert complete and width > 300 and height > 100 and shown > 0, alt
    # Nothing but the page itself was loaded (the charts are embedded).
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(r => r.name)")
    assert resources == []
    tables = browser.find_elements(By.TAG_NAME, "table")
    assert len(tables) == 5  # queues, queues by state, poison, deferred, JSON field
    assert all(t.is_displayed() for t in tables)
    first_rows = [r.text for r in tables[0].find_elements(By.TAG_NAME, "tr")]
    assert first_rows[0].startswith("queue kind backlog queued in flight deferred in flight %")
    assert any(r.startswith("orders/billing channel 10 10 0 0 0.0% ") for r in first_rows)
    state_rows = [r.text for r in tables[1].find_elements(By.TAG_NAME, "tr")]
    assert any(r.startswith("orders/billing queued 10 ") for r in state_rows)
    assert f"{1009:016x}" in tables[2].text


# -- states: a snapshot as a live broker takes it -----------------------------------------

# Who held the in-flight messages (the manifest's clients; rows name them by index).
CLIENTS = ["10.0.0.7:50412", "10.0.0.8:40100"]
LEFT_OUT = [{"topic": "jobs", "channel": "tmp#ephemeral", "reason": "ephemeral", "depth": 2,
             "in_flight_count": 1, "deferred_count": 0}]
IN_FLIGHT_AGES_S = [600, 300, 120]  # jobs:work's in-flight messages, held since long: stuck


def _s(now_ns, seconds):
    return now_ns + round(seconds * 1e9)


def state_queues(now_ns):
    """(stored, held): what the store held and what the broker held outside it, per queue.

    jobs:work: 4 stored (the oldest 900 s old) + 3 queued in memory + 2
    deferred + 3 in flight (held for long: a stuck consumer) = 12; jobs: a
    stored message and a DPUB waiting at the topic (queued, yet
    scheduled); jobs:idle: empty.
    """
    now_s = now_ns / 1e9
    stored = {
        "jobs": [message(3000, b"j" * 10, timestamp=_s(now_ns, -50))],
        "jobs:work": [message(3100 + i, b"w" * 100, timestamp=_s(now_ns, -(900 - 10 * i)))
                      for i in range(4)],
        "jobs:idle": [],
    }
    held = {
        "jobs": [Held("queued", message(3001, b"d" * 20, timestamp=_s(now_ns, -5),
                                        deferred_until=now_s + 3600))],
        "jobs:work": [
            *[Held("queued", message(3200 + i, b"q" * 200, timestamp=_s(now_ns, -(30 + i))))
              for i in range(3)],
            *[Held("deferred", message(3300 + i, b"r" * 300, timestamp=_s(now_ns, -(40 + i)),
                                       attempts=2, deferred_until=now_s + 60 + 600 * i))
              for i in range(2)],
            *[Held("in_flight", message(3400 + i, b"f" * 400, timestamp=_s(now_ns, -age), attempts=1),
                   timeout_at=now_s + 30 + i, client=i % 2)
              for i, age in enumerate(IN_FLIGHT_AGES_S)],
        ],
    }
    return stored, held


@pytest.fixture(scope="module")
def states_now_ns():
    return time.time_ns()


@pytest.fixture(scope="module")
def states_snap(tmp_path_factory, states_now_ns):
    # Built right after its own `now`: the ages are the offsets to within milliseconds.
    stored, held = state_queues(states_now_ns)
    snap = build_snapshot(tmp_path_factory.mktemp("states"), stored, held=held, clients=CLIENTS)
    # build_snapshot's broker has no ephemeral queue: the manifest says one was left out.
    manifest = json.loads((snap / MANIFEST).read_text())
    manifest["left_out"] = LEFT_OUT
    (snap / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return snap


@pytest.fixture(scope="module")
def states_result(spark, states_snap) -> mq.Analysis:
    return mq.analyze(spark, str(states_snap))


def test_states_per_queue(states_result, states_snap, states_now_ns):
    work = queue(states_result, "jobs", "work")
    assert work["messages"] == 12 and work["bytes"] == 4 * 100 + 3 * 200 + 2 * 300 + 3 * 400
    assert (work["queued"], work["in_flight"], work["deferred"]) == (7, 3, 2)
    assert work["scheduled"] == 2  # the deferred ones
    assert work["in_flight_share"] == 0.25
    in_flight_ages = exact_ages(states_snap, [_s(states_now_ns, -a) for a in IN_FLIGHT_AGES_S])
    assert work["oldest_in_flight_age_s"] == pytest.approx(max(in_flight_ages), abs=1e-6)
    (oldest,) = exact_ages(states_snap, [_s(states_now_ns, -900)])
    assert work["oldest_age_s"] == pytest.approx(oldest, abs=1e-6)
    # The topic's DPUB waits queued at the topic, with its due time set.
    topic = queue(states_result, "jobs", None)
    assert [topic[k] for k in ("messages", "queued", "in_flight", "deferred")] == [2, 2, 0, 0]
    assert [topic[k] for k in ("scheduled", "in_flight_share", "oldest_in_flight_age_s")] == [
        1, 0.0, None]
    idle = queue(states_result, "jobs", "idle")
    assert (idle["messages"], idle["queued"], idle["in_flight"], idle["deferred"]) == (0, 0, 0, 0)
    assert (idle["in_flight_share"], idle["oldest_in_flight_age_s"]) == (None, None)
    # The counts are the manifest's, which are /stats' at the instant.
    for q in states_result.manifest.queues:
        row = queue(states_result, q.topic, q.channel)
        counts = (row["queued"], row["in_flight"], row["deferred"])
        assert counts == (q.queued, q.in_flight, q.deferred)
        assert counts == (q.stats["depth"], q.stats["in_flight_count"], q.stats["deferred_count"])
    assert [states_result.state_total(s) for s in STATES] == [9, 3, 2]
    assert states_result.left_out == LEFT_OUT


def test_state_counts_per_queue_and_state(spark, states_result, states_snap, states_now_ns):
    rows = [(r["topic"], r["channel"], r["state"], r["messages"], r["bytes"])
            for r in states_result.states]
    # Queue order, then STATES' order; no rows for states a queue does not have.
    assert rows == [
        ("jobs", None, "queued", 2, 30),
        ("jobs", "work", "queued", 7, 1000),
        ("jobs", "work", "in_flight", 3, 1200),
        ("jobs", "work", "deferred", 2, 600),
    ]
    oldest = {r["state"]: r["oldest_age_s"] for r in states_result.states if r["channel"] == "work"}
    expected = exact_ages(states_snap, [_s(states_now_ns, -a) for a in (900, 600, 41)])
    assert oldest == {"queued": pytest.approx(expected[0], abs=1e-6),
                      "in_flight": pytest.approx(expected[1], abs=1e-6),
                      "deferred": pytest.approx(expected[2], abs=1e-6)}
    # analyze() rolls them up from the bucket counts: the same as the DataFrame function's.
    df = mq.read_snapshot(spark, str(states_snap), bodies=False)
    assert mq._collect(mq.state_counts(df, states_result.as_of)) == states_result.states
    summary = mq._collect(mq.queue_summary(df, states_result.as_of))
    assert [r for r in summary if r["channel"] == "work"][0]["in_flight_share"] == 0.25


def test_text_report_shows_the_states(states_result):
    text = render_text(states_result)
    assert "14 messages in 3 queues: 9 queued, 3 in flight, 2 deferred" in text
    assert "taken by the broker (lmdb): everything it held" in text
    assert ("left out (ephemeral): jobs/tmp#ephemeral (2 queued, 1 in flight, 0 deferred)"
            in text)
    lines = text.splitlines()
    header = next(x for x in lines if x.startswith("queue "))
    assert header.split()[:10] == ["queue", "kind", "backlog", "queued", "in", "flight", "deferred",
                                   "in", "flight", "%"]
    assert "oldest in flight" in header and "scheduled" in header
    work = next(x for x in lines if x.startswith("jobs/work "))
    cells = work.split()
    assert cells[:7] == ["jobs/work", "channel", "12", "7", "3", "2", "25.0%"]
    work_row = queue(states_result, "jobs", "work")
    assert format_age(work_row["oldest_in_flight_age_s"]) == "10m 0s" and "10m 0s" in work


def test_html_report_shows_the_states(states_result, tmp_path):
    page = render_html(states_result)
    assert "<th>queued</th><th>in flight</th><th>deferred</th><th>in flight %</th>" in page
    assert "<th>oldest in flight</th>" in page
    assert "<h2>Queues by state</h2>" in page
    assert ("<tr><td>jobs/work</td><td>in flight</td><td>3</td><td>1.2 KB</td>" in page)
    assert ('<p class="left-out">left out (ephemeral): jobs/tmp#ephemeral (2 queued, 1 in flight, '
            '0 deferred)</p>') in page
    titles = re.findall(r'<img alt="([^"]+)"', page)
    assert titles[:2] == ["Backlog per queue by state", "Oldest message age"]


def test_report_without_left_out_queues_has_no_such_line(states_result):
    quiet = dataclasses.replace(states_result,
                                manifest=dataclasses.replace(states_result.manifest, left_out=[]))
    assert "left out" not in render_text(quiet) and "left-out" not in render_html(quiet)


def test_the_states_show_in_a_browser(browser, states_result, tmp_path):
    page = tmp_path / "states.html"
    write_html(states_result, str(page))
    browser.get(page.as_uri())
    chart = browser.find_element(By.CSS_SELECTOR, 'img[alt="Backlog per queue by state"]')
    assert chart.is_displayed()
    assert browser.execute_script(
        "const i = arguments[0];"
        "return i.complete && i.naturalWidth > 300 && i.naturalHeight > 100", chart)
    left_out = browser.find_element(By.CLASS_NAME, "left-out")
    assert left_out.is_displayed() and "jobs/tmp#ephemeral" in left_out.text
    tables = browser.find_elements(By.TAG_NAME, "table")
    queues_rows = [r.text for r in tables[0].find_elements(By.TAG_NAME, "tr")]
    assert any(r.startswith("jobs/work channel 12 7 3 2 25.0% ") for r in queues_rows)
    state_rows = [r.text for r in tables[1].find_elements(By.TAG_NAME, "tr")]
    assert tables[1].is_displayed()
    assert [r.split()[:3] for r in state_rows[1:]] == [
        ["jobs", "queued", "2"], ["jobs/work", "queued", "7"], ["jobs/work", "in", "flight"],
        ["jobs/work", "deferred", "2"]]


def test_export_parquet_gives_the_data_source_rows(snap, now_ns, tmp_path, capsys):
    out = tmp_path / "snap.parquet"
    assert main(["export", str(snap), "--out", str(out)]) == 0
    assert "exported 17 messages" in capsys.readouterr().out
    assert pq.read_table(out).to_pylist() == expected_rows(published(now_ns))
    only = tmp_path / "billing.parquet"
    assert main(["export", str(snap), "--out", str(only), "--channel", "billing"]) == 0
    assert pq.read_table(only).num_rows == 10


def test_export_of_empty_snapshot_writes_an_empty_file(tmp_path):
    snap = build_snapshot(tmp_path, {"t": []})
    assert main(["export", str(snap), "--out", str(tmp_path / "e.parquet")]) == 0
    assert pq.read_table(tmp_path / "e.parquet").num_rows == 0


@pytest.mark.slow
def test_analyze_command_end_to_end(snap, tmp_path):
    # A separate process with its own Spark, as an operator runs it.
    # A new cache dir: no JVM class archive yet (hence the hint), and the
    # Python launcher written anew.
    report = tmp_path / "r.html"
    env = child_env()
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    for name in ("MQD_NO_JVM_ARCHIVE", "PYSPARK_PYTHON"):  # the latter set by this process's session
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "spark_bridge", "analyze", str(snap), "--master", "local[1]",
         "--report", str(report), "--json-field", "type", "--poison-attempts", "6"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "poison messages (attempts > 6): 2" in proc.stdout
    assert "analyzed 17 messages" in proc.stdout
    assert re.search(r"^\[1/\d\] reading 17 messages", proc.stderr, re.M)
    assert re.search(r"^Spark ready in [\d.]+ s \(master local\[1\]\)$", proc.stderr, re.M)
    assert report.exists() and report.read_text().count("data:image/png;base64,") == 6
    assert read_manifest(snap).total == 17
    assert "hint: `python -m spark_bridge jvm-archive`" in proc.stderr
    assert [p.name.startswith("python-") for p in (tmp_path / "cache" / "mqd").iterdir()] == [True]


@pytest.mark.slow
def test_analyze_under_spark_submit_keeps_its_master(snap, tmp_path):
    # As README's cluster recipe runs it: spark-submit starts the JVM with
    # its --master, the bridge's session must not replace it.
    import spark_bridge.__main__ as cli

    submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    env = child_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYSPARK_PYTHON"] = sys.executable
    proc = subprocess.run(
        [submit, "--master", "local[1]", cli.__file__, "analyze", str(snap)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # spark-submit passes the driver's stderr on to its stdout.
    output = proc.stdout + proc.stderr
    assert re.search(r"^Spark ready in [\d.]+ s \(master local\[1\]\)$", output, re.M)
    assert "17 messages in 4 queues" in proc.stdout


# -- a window of topics' retained logs (analyze --topic) --------------------------------------------
#
# Real brokers with retention, events published in three runs with a moment
# marked between them: the window between the marks must hold exactly the
# middle run, by time and by offsets alike.
#
# resolve_window finds brokers named by TCP address with an IDENTIFY on
# the reactor thread (reactor_thread.py), and this process's reactor is
# pytest-twisted's: in this process windows are resolved through a lookupd
# (plain HTTP); the nsqd path runs in `python -m spark_bridge` processes.

WINDOW_RUNS = (("a", 100), ("b", 250), ("c", 70))
# Retention on; lookupd lists the broker by the address its TCP listener has (not the host's name).
WINDOW_BROKER = ("--retention-bytes=50MB", "--broadcast-address=127.0.0.1")


@pytest.fixture(scope="module")
def window_lookupd(tmp_path_factory):
    lookupd = LookupdProcess(tmp_path_factory.mktemp("lookupd"))
    try:
        yield lookupd.start()
    finally:
        lookupd.kill()


@pytest.fixture(scope="module")
def retaining(tmp_path_factory, window_lookupd):
    broker = BrokerProcess(tmp_path_factory.mktemp("retaining"),
                           [*FAST_SCAN, *WINDOW_BROKER, f"--lookupd-tcp-address={window_lookupd.tcp_address}"])
    try:
        yield broker.start()
    finally:
        broker.kill()


def event_bodies(kind: str, n: int) -> list[bytes]:
    """JSON events of one run: sizes vary with the number's digits."""
    return [json.dumps({"type": kind, "i": i, "pad": "x" * (i % 37)}).encode() for i in range(n)]


def publish_runs(brokers, topic: str, runs=(WINDOW_RUNS,)) -> tuple[list[float], list[dict[str, list[bytes]]]]:
    """Publish run i of each broker's runs with /mpub, the brokers in turn; the moments between runs.

    `runs[b]` are broker b's (kind, count) runs; returns the moments
    (time.time()) marked between runs and each broker's bodies per kind.
    """
    marks: list[float] = []
    bodies: list[dict[str, list[bytes]]] = [{} for _ in brokers]
    for i in range(len(runs[0])):
        if i:
            time.sleep(0.05)
            marks.append(time.time())
            time.sleep(0.05)
        for b, broker in enumerate(brokers):
            kind, n = runs[b][i]
            bodies[b][kind] = event_bodies(kind, n)
            status, answer = http_request(broker.http_address, "POST", f"/mpub?topic={topic}",
                                          b"\n".join(bodies[b][kind]))
            assert status == 200, answer
    return marks, bodies


def registered(lookupd, topic: str, brokers: int = 1) -> None:
    def listed() -> bool:
        status, raw = http_request(lookupd.http_address, "GET", f"/lookup?topic={topic}")
        return status == 200 and len(json.loads(raw)["producers"]) == brokers

    wait_for(listed, timeout=15, what=f"topic {topic} on {brokers} broker(s) in lookupd")


def rfc3339(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def test_a_window_by_time_holds_exactly_the_records_published_in_it(spark, retaining, window_lookupd, name):
    topic = name("events")
    (t1, t2), (bodies,) = publish_runs([retaining], topic)
    registered(window_lookupd, topic)
    window = mq.resolve_window({"topic": topic, "lookupd": window_lookupd.http_address,
                                "startingTimestamp": str(int(t1 * 1000)),
                                "endingTimestamp": str(int(t2 * 1000))})
    assert [(r.nsqd, r.start, r.end) for r in window.ranges] == [(retaining.tcp_address, 100, 350)]
    assert window.records == 250 and window.since is not None and window.until is not None
    assert window.as_of == window.until
    assert window.options["nsqd"] == retaining.tcp_address and "lookupd" not in window.options

    rows = mq.read_window(spark, window).select("offset", "body", "attempts", "channel", "nsqd").collect()
    assert sorted(r["offset"] for r in rows) == list(range(100, 350))
    assert sorted(bytes(r["body"]) for r in rows) == sorted(bodies["b"])
    assert {(r["attempts"], r["channel"], r["nsqd"]) for r in rows} == {(0, None, retaining.tcp_address)}

    steps = []
    result = mq.analyze_window(spark, window, json_field_name="type", progress=lambda *a: steps.append(a))
    assert result.total == 250 and result.manifest is None and result.window is window
    (summary,) = result.queues
    assert (summary["topic"], summary["channel"], summary["kind"]) == (topic, None, "topic")
    sizes = [len(b) for b in bodies["b"]]
    assert summary["bytes"] == sum(sizes) and summary["size_max"] == max(sizes)
    assert summary["size_p50"] == nearest_rank(sizes, 0.5)
    assert t1 <= summary["oldest"].timestamp() <= summary["newest"].timestamp() < t2
    assert summary["max_attempts"] == 0 and summary["poison"] == 0
    assert sum(h["messages"] for h in result.age_histogram) == 250
    assert sum(h["messages"] for h in result.size_histogram) == 250
    assert (result.attempts_histogram, result.poison, result.deferred, result.states) == ([], [], [], [])
    assert [(j["json_value"], j["messages"]) for j in result.json_counts] == [("b", 250)]
    (broker,) = result.brokers
    assert (broker["start"], broker["end"], broker["records"], broker["messages"]) == (100, 350, 250, 250)
    assert (broker["first_offset"], broker["last_offset"]) == (100, 349)
    assert [s[2] for s in steps[:3]] == ["reading 250 records, per broker", "messages, ages and sizes per topic",
                                         "ages and sizes"]

    text = render_text(result)
    assert f"retained log of topic {topic}, published from {rfc3339(t1)} until {rfc3339(t2)}" in text
    assert f"250 messages in topic {topic}" in text and "no queue states" in text
    assert f"nsqd {retaining.tcp_address} {topic}: offsets 100-349 (250 records, epoch " in text
    assert "attempts (messages per number of attempts)" not in text and "deferred backlog" not in text
    page = render_html(result)
    assert re.findall(r'<img alt="([^"]+)"', page) == ["Oldest message age", "Message ages", "Body sizes"]


def test_a_window_by_offsets_is_the_same_records(spark, retaining, window_lookupd, name):
    topic = name("events")
    publish_runs([retaining], topic)
    registered(window_lookupd, topic)
    where = {"topic": topic, "lookupd": window_lookupd.http_address}
    window = mq.resolve_window({
        **where, "startingOffsets": json.dumps({topic: {retaining.tcp_address: 100}}),
        "endingOffsets": json.dumps({topic: {retaining.tcp_address: 350}})})
    result = mq.analyze_window(spark, window, json_field_name="type")
    assert result.total == 250
    assert [(j["json_value"], j["messages"]) for j in result.json_counts] == [("b", 250)]
    # The offsets it prints read the same records again, epoch checked.
    again = mq.resolve_window({**where, "startingOffsets": window.offsets_json(end=False),
                               "endingOffsets": window.offsets_json(end=True)})
    assert again.ranges == window.ranges
    # No bounds: every record the log keeps.
    whole = mq.resolve_window(where)
    assert (whole.starting, whole.ending, whole.records) == ("earliest", "latest", 420)
    assert mq.read_window(spark, whole).count() == 420


def test_a_window_over_two_brokers_counts_each_ones_range(spark, retaining, window_lookupd, start_broker, name):
    topic = name("events")
    other = start_broker(*FAST_SCAN, *WINDOW_BROKER, f"--lookupd-tcp-address={window_lookupd.tcp_address}")
    (t1, t2), _ = publish_runs([retaining, other], topic, runs=(WINDOW_RUNS, (("a", 30), ("b", 120), ("c", 10))))
    registered(window_lookupd, topic, brokers=2)
    window = mq.resolve_window({"topic": topic, "lookupd": window_lookupd.http_address,
                                "startingTimestamp": str(int(t1 * 1000)), "endingTimestamp": str(int(t2 * 1000))})
    result = mq.analyze_window(spark, window)
    assert result.total == 370
    assert sorted((b["nsqd"], b["start"], b["end"], b["messages"]) for b in result.brokers) == sorted(
        [(retaining.tcp_address, 100, 350, 250), (other.tcp_address, 30, 150, 120)])


def test_an_empty_window_gives_a_zero_row(spark, retaining, window_lookupd, name):
    topic = name("events")
    publish_runs([retaining], topic, runs=((("a", 10),),))
    registered(window_lookupd, topic)
    window = mq.resolve_window({"topic": topic, "lookupd": window_lookupd.http_address,
                                "startingOffsets": json.dumps({topic: {retaining.tcp_address: 10}})})
    result = mq.analyze_window(spark, window)
    assert result.total == 0 and [q["messages"] for q in result.queues] == [0]
    assert result.brokers[0]["records"] == 0
    assert f"nsqd {retaining.tcp_address} {topic}: no records (offset 10, epoch " in render_text(result)
    write_html(result, os.devnull)


@pytest.fixture(scope="module")
def not_retaining(tmp_path_factory):
    broker = BrokerProcess(tmp_path_factory.mktemp("plain"), []).start()
    try:
        assert http_request(broker.http_address, "POST", "/pub?topic=events", b"x")[0] == 200
        yield broker
    finally:
        broker.kill()


# (argv after `analyze`, with {retaining}/{plain}/{topic}...; exit status; the line after "analyze failed: ").
# Checked before any broker is asked: run in this process.
WINDOW_BAD_FLAGS = [
    ([], 2, "give a snapshot directory, or --topic with --nsqd-tcp-address or --lookupd-http-address for "
            "a window of its retained log"),
    (["--topic", "t"], 2, "--nsqd-tcp-address or --lookupd-http-address required"),
    (["--nsqd-tcp-address", "h:1"], 2, "--topic required (or a snapshot directory)"),
    (["SNAP", "--topic", "t"], 2, "give a snapshot directory or --topic, not both"),
    (["SNAP", "--since", "2h"], 2, "--since goes with --topic (a window of retained logs), not with a snapshot"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--lookupd-http-address", "h:2"], 2,
     "use --nsqd-tcp-address or --lookupd-http-address not both"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--since", "6x"], 2,
     "--since '6x': want a duration back from now (2h) or an RFC 3339 time (2006-01-02T15:04:05Z or with "
     "a +07:00 offset)"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--since", "1h", "--until", "2h"], 2,
     "--until '2h' is before --since '1h'"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--since", "1h", "--start-offsets", "earliest"], 2,
     "use --since or --start-offsets not both"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--start-offsets", "{bad"], 2,
     "--start-offsets: malformed JSON (Expecting property name enclosed in double quotes at character 1)"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--end-offsets", "12"], 2,
     "--end-offsets: '12' is not latest or offsets JSON"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--start-offsets", "latest"], 2,
     "--start-offsets: 'latest' is not earliest or offsets JSON"),
    (["--topic", "a b", "--nsqd-tcp-address", "h:1"], 2, "--topic: 'a b' is not a valid NSQ name"),
    (["--topic", "t", "--nsqd-tcp-address", "nohost"], 2, "--nsqd-tcp-address: 'nohost' is not host:port"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--consumer-opt", "nosuch=1"], 2,
     "--consumer-opt 'nosuch=1': unknown option 'nosuch'"),
    (["--topic", "t", "--nsqd-tcp-address", "h:1", "--poison-attempts", "3"], 2,
     "--poison-attempts goes with a snapshot: records of the retained log carry no attempts"),
]


@pytest.mark.parametrize(("argv", "status", "line"), WINDOW_BAD_FLAGS)
def test_window_flags_that_cannot_be_used_are_one_line(argv, status, line, capsys):
    assert main(["analyze", *argv]) == status
    err = capsys.readouterr().err
    said = [x for x in err.splitlines() if not x.startswith("resolving the window")]
    assert len(said) == 1 and said[0].startswith("analyze failed: " + line), err


# What the brokers say: `python -m spark_bridge` processes (the nsqd path IDENTIFYs on a reactor thread).
WINDOW_BAD_BROKERS = [
    (["--topic", "{topic}", "--nsqd-tcp-address", "{retaining}", "--end-offsets",
      '{{"{topic}": {{"{retaining}": 9}}}}'],
     "--end-offsets: offset 9 is out of range for topic {topic} on nsqd {retaining}: earliest 0, latest 1"),
    (["--topic", "{topic}", "--nsqd-tcp-address", "{retaining}", "--start-offsets",
      '{{"{topic}": {{"{retaining}": {{"offset": 0, "epoch": 7}}}}}}'],
     "--start-offsets: the log of topic {topic} on nsqd {retaining} is epoch "),
    (["--topic", "{topic}", "--nsqd-tcp-address", "{retaining}", "--start-offsets", '{{"{topic}": {{"h:1": 0}}}}'],
     "--start-offsets names nsqd h:1 for topic '{topic}', which is not one of its brokers ({retaining})"),
    (["--topic", "nosuch", "--nsqd-tcp-address", "{retaining}"], "topic 'nosuch' does not exist on nsqd {retaining}"),
    (["--topic", "events", "--nsqd-tcp-address", "{plain}"],
     "topic events on nsqd {plain} (http {plain_http}) keeps no retained log: retention is off for it"),
    (["--topic", "nosuch", "--lookupd-http-address", "{lookupd}"],
     "topic 'nosuch' does not exist on the brokers lookupd {lookupd} lists"),
    (["--topic", "{topic}", "--nsqd-tcp-address", "{retaining}", "--nsqd-tcp-address", "127.0.0.1:1"],
     "nsqd 127.0.0.1:1: cannot connect ("),
]


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "line"), WINDOW_BAD_BROKERS,
                         ids=["offset-out-of-range", "other-epoch", "unknown-broker", "no-topic", "no-retention",
                              "no-topic-in-lookupd", "a-broker-away"])
def test_a_window_the_brokers_cannot_give_is_one_line(argv, line, retaining, not_retaining, window_lookupd, name):
    topic = name("events")
    assert http_request(retaining.http_address, "POST", f"/pub?topic={topic}", b"x")[0] == 200
    fill = {"retaining": retaining.tcp_address, "plain": not_retaining.tcp_address,
            "plain_http": not_retaining.http_address, "topic": topic, "lookupd": window_lookupd.http_address}
    proc = subprocess.run([sys.executable, "-m", "spark_bridge", "analyze", *[a.format(**fill) for a in argv]],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=child_env())
    said = [x for x in proc.stderr.splitlines() if not x.startswith("resolving the window")]
    assert proc.returncode == 1 and len(said) == 1, proc.stderr
    assert said[0].startswith("analyze failed: " + line.format(**fill)), proc.stderr


@pytest.mark.slow
def test_analyze_command_reads_a_window_of_brokers_named_by_tcp_address(retaining, tmp_path, name):
    # As an operator runs it: its own process and Spark, the report written.
    topic = name("events")
    (t1, t2), _ = publish_runs([retaining], topic)
    report = tmp_path / "window.html"
    proc = subprocess.run(
        [sys.executable, "-m", "spark_bridge", "analyze", "--topic", topic, "--nsqd-tcp-address",
         retaining.tcp_address, "--since", rfc3339(t1), "--until", rfc3339(t2), "--json-field", "type",
         "--report", str(report), "--master", "local[2]"],
        capture_output=True, text=True, timeout=400, cwd=REPO_ROOT, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"250 messages in topic {topic}" in out and "analyzed 250 messages" in out
    assert f"nsqd {retaining.tcp_address} {topic}: offsets 100-349 (250 records, epoch " in out
    assert re.search(rf"^{re.escape(topic)}\s+b\s+250\s", out, re.M)  # the JSON field's table
    assert re.search(r"^window: 250 records of .* on 1 broker\(s\), published from ", proc.stderr, re.M)
    page = report.read_text()
    assert re.findall(r'<img alt="([^"]+)"', page) == ["Oldest message age", "Message ages", "Body sizes"]
    assert f"<title>mqd retained log of topic {topic}</title>" in page and "<h2>Brokers</h2>" in page


@pytest.mark.slow
def test_a_window_gone_before_spark_reads_it_is_one_line(retaining, name):
    # The window is resolved before Spark starts; the topic deleted meanwhile
    # fails the read inside Spark, and its error comes out as the one line.
    topic = name("events")
    publish_runs([retaining], topic, runs=((("a", 10),),))
    proc = subprocess.Popen(
        [sys.executable, "-m", "spark_bridge", "analyze", "--topic", topic, "--nsqd-tcp-address",
         retaining.tcp_address, "--master", "local[1]"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=child_env())
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("window: 10 records"):
                break
        assert http_request(retaining.http_address, "POST", f"/topic/delete?topic={topic}")[0] == 200, seen
        _out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    assert err.splitlines()[-1] == (f"analyze failed: topic {topic!r} does not exist on nsqd "
                                    f"{retaining.tcp_address}"), err[-3000:]
