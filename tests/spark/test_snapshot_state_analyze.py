"""Snapshots as a new user meets them: a default broker's 10,000-message backlog, snapshotted and analyzed.

With nsqd's default --mem-queue-size (10,000) the whole backlog sits in
the channel's memory queue and none of it in LMDB: a copy of the store
alone showed 0 messages. A snapshot asked of the broker
(`python -m spark_bridge snapshot --broker`) holds them all, and
`python -m spark_bridge analyze` (its own process and Spark, as an
operator runs it) must report 10,000 queued messages, state by state, in
the terminal and in the HTML report.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from mqd.nsqd.snapshot_format import read_manifest
from tests.support.broker_http import call, create, queue_stats
from tests.support.processes import FAST_SCAN, REPO_ROOT, child_env

BACKLOG = 10_000


def columns(line: str) -> list[str]:
    """A row of the terminal's tables: cells are at least two spaces apart, never within one."""
    return re.split(r"\s{2,}", line.strip())


def test_analyze_a_default_brokers_memory_backlog(start_broker, tmp_path):
    broker = start_broker(*FAST_SCAN)  # --mem-queue-size: nsqd's default, 10,000
    create(broker, "spk", "c")
    body = b"\n".join(json.dumps({"type": f"kind{i % 3}", "n": i}).encode() for i in range(BACKLOG))
    status, text = call(broker, "POST", "/mpub?topic=spk", body)
    assert status == 200, text
    assert queue_stats(broker)["spk:c"]["depth"] == BACKLOG

    env = child_env()
    env.pop("PYSPARK_PYTHON", None)  # set by an in-process Spark session of the same run
    snap = subprocess.run(
        [sys.executable, "-m", "spark_bridge", "snapshot", "--broker", f"http://{broker.http_address}",
         "--out", "backlog"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=env)
    assert snap.returncode == 0, snap.stdout + snap.stderr
    path = broker.data_dir / "snapshots" / "backlog"
    manifest = read_manifest(path)
    c = manifest.queue("spk:c")
    # All of it held in memory: nothing in the store, everything in the snapshot.
    assert (c.count, c.stored, c.held, c.queued, c.in_flight, c.deferred) == (
        BACKLOG, 0, BACKLOG, BACKLOG, 0, 0)
    assert c.stats == {"depth": BACKLOG, "in_flight_count": 0, "deferred_count": 0}
    assert manifest.total == BACKLOG

    report = tmp_path / "r.html"
    proc = subprocess.run(
        [sys.executable, "-m", "spark_bridge", "analyze", str(path), "--master", "local[1]",
         "--report", str(report)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "analyzed 10,000 messages" in out, out
    assert re.search(r"^  10,000 messages in 2 queues: 10,000 queued, 0 in flight, 0 deferred$", out, re.M), out
    # The summary table has a column per state; spk/c's backlog is all queued.
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("queue ") and "backlog" in line)
    header = columns(lines[start])
    assert {"backlog", "queued", "in flight", "deferred"} <= set(header), header
    table = lines[start + 2:lines.index("", start)]  # after the header's dashes, to the blank line
    rows = {cells[0]: dict(zip(header, cells, strict=True)) for cells in map(columns, table)}
    assert set(rows) == {"spk", "spk/c"}, table
    assert {k: rows["spk/c"][k] for k in ("backlog", "queued", "in flight", "deferred")} == {
        "backlog": "10,000", "queued": "10,000", "in flight": "0", "deferred": "0"}, rows
    assert rows["spk"]["backlog"] == "0", rows

    html = report.read_text()
    assert "10,000 messages in 2 queues (10,000 queued, 0 in flight, 0 deferred)" in html
    assert "<td>spk/c</td><td>queued</td><td>10,000</td>" in html
    assert "Backlog per queue by state" in html
