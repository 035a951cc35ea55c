"""spark_bridge.analysis on a snapshot whose ages, sizes, attempts and deferrals are known.

Messages are published at known offsets before the moment the snapshot is
built; ages are measured from the manifest's time, so every expected age
is exact: (manifest time - publication) to the microsecond. Offsets keep
clear of bucket bounds by more than the few seconds building can take.
Percentiles are nearest-rank (what percentile_approx gives on few values).
"""

from __future__ import annotations

import base64
import math
import os
import re
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest
from pyspark.sql import DataFrame
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from spark_bridge import analysis as mq
from spark_bridge.__main__ import main
from spark_bridge.report import render_html, render_text, write_html
from spark_bridge.snapshot import read_manifest
from tests.ensure_browser import BROWSER, DRIVER
from tests.integration._support import REPO_ROOT, child_env

from ._snapshots import build_snapshot, expected_rows, message, micros

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
    assert billing["deferred"] == 3
    assert billing["poison"] == 3

    topic = queue(result, "orders", None)
    assert (topic["kind"], topic["messages"], topic["bytes"]) == ("topic", 1, 50)
    assert topic["oldest_age_s"] == pytest.approx(exact_ages(snap, [queues["orders"][0].timestamp])[0],
                                                  abs=1e-6)
    # The empty queue is listed, with nothing in it.
    ship = queue(result, "orders", "ship")
    assert (ship["messages"], ship["bytes"], ship["oldest_age_s"], ship["poison"]) == (0, 0, None, 0)
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
    for frame in (mq.queue_summary(df, as_of), mq.age_histogram(df, as_of), mq.size_histogram(df),
                  mq.attempts_histogram(df), mq.poison_messages(df), mq.deferred_backlog(df, as_of),
                  mq.json_field_counts(df, "type"), mq.bucket_counts(df, as_of)):
        assert isinstance(frame, DataFrame)
    # Users compose them: the poison messages of one channel, from the DataFrame.
    ids = [r.message_id for r in mq.poison_messages(df.filter("channel = 'billing'"), 6).collect()]
    assert ids == [f"{1009:016x}", f"{1007:016x}"]
    assert mq.json_field_counts(df, "type").filter("json_value = 'a'").first().messages == 3


def test_text_report(result):
    text = render_text(result)
    assert "17 messages in 4 queues" in text
    line = next(x for x in text.splitlines() if x.startswith("orders/billing"))
    assert "10" in line.split() and "1m 45s" in line  # backlog, oldest age ~105 s
    assert f"{1009:016x}" in text
    assert "poison messages (attempts > 5): 3" in text
    assert "overdue" in text and "1-24 h" in text
    assert "JSON field 'type'" in text


CHARTS = ["Backlog per queue", "Oldest message age", "Message ages", "Body sizes",
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
    assert len(tables) == 4  # queues, poison, deferred, JSON field
    first_rows = [r.text for r in tables[0].find_elements(By.TAG_NAME, "tr")]
    assert any(r.startswith("orders/billing channel 10 ") for r in first_rows)
    assert f"{1009:016x}" in tables[1].text


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
