"""POST /snapshot and `python -m spark_bridge snapshot` against the real broker process.

The broker runs with --mem-queue-size=0 so every message is in LMDB (a
snapshot copies the store, not the memory queues) and the manifest's
counts can be compared with the depths /stats reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from mqd.nsqd.snapshot_format import read_manifest
from tests.support.broker_http import call, create, publish, queue_stats
from tests.support.processes import FAST_SCAN, REPO_ROOT, child_env


def depths(broker) -> dict[str, int]:
    return {name: stats["depth"] for name, stats in queue_stats(broker).items()}


def test_post_snapshot_counts_match_depths(start_broker):
    broker = start_broker(*FAST_SCAN, "--mem-queue-size=0")
    for topic, channels in (("orders", ("billing", "ship")), ("events", ("audit",))):
        for channel in channels:
            create(broker, topic, channel)
    publish(broker, "orders", 300)
    publish(broker, "events", 120)
    assert call(broker, "POST", "/topic/create?topic=idle")[0] == 200

    status, text = call(broker, "POST", "/snapshot")
    assert status == 200, text
    answer = json.loads(text)
    manifest = answer["manifest"]
    counts = {q["name"]: q["count"] for q in manifest["queues"]}
    expected = {k: v for k, v in depths(broker).items() if v}
    assert {k: v for k, v in counts.items() if v} == expected
    assert expected == {"orders:billing": 300, "orders:ship": 300, "events:audit": 120}
    assert answer["path"].startswith(str(broker.data_dir / "snapshots"))
    assert read_manifest(answer["path"]).to_json() == manifest


def test_publishing_keeps_working_during_snapshots(start_broker, tmp_path):
    broker = start_broker(*FAST_SCAN, "--mem-queue-size=0")
    create(broker, "t", "c")
    publish(broker, "t", 2000)
    stop = threading.Event()
    published = [0]
    errors: list[str] = []

    def publisher() -> None:
        i = 0
        while not stop.is_set():
            status, text = call(broker, "POST", "/pub?topic=t", b"live-%d" % i)
            if status != 200:
                errors.append(text.decode())
            i += 1
        published[0] = i

    thread = threading.Thread(target=publisher)
    thread.start()
    try:
        totals = []
        for i in range(5):
            status, text = call(broker, "POST", f"/snapshot?out=s{i}")
            assert status == 200, text
            totals.append(sum(q["count"] for q in json.loads(text)["manifest"]["queues"]))
    finally:
        stop.set()
        thread.join(30)
    assert not errors
    assert published[0] > 0
    assert totals == sorted(totals) and totals[0] >= 2000
    assert depths(broker)["t:c"] == 2000 + published[0]


def test_cli_on_a_stopped_brokers_data(start_broker, tmp_path):
    broker = start_broker(*FAST_SCAN, "--mem-queue-size=0")
    create(broker, "a", "x")
    publish(broker, "a", 50)
    publish(broker, "b", 7)
    broker.stop_cleanly()
    out = tmp_path / "snap"
    result = subprocess.run(
        [sys.executable, "-m", "spark_bridge", "snapshot", f"--data-path={broker.data_dir}",
         f"--out={out}"],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "MB/s" in result.stdout and "a / x: 50" in result.stdout
    counts = {q.name: q.count for q in read_manifest(out).queues}
    assert {k: v for k, v in counts.items() if v} == {"a:x": 50, "b": 7}
