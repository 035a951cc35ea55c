"""`python -m spark_bridge snapshot` against a real broker process: --broker, and --data-path on it.

The CLI runs as a child process, as an operator runs it. Flag errors and
an unreachable broker, which need no broker, are in
tests/unit/test_snapshot_cli.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mqd.nsqd.snapshot_format import read_manifest
from tests.support.broker_http import call, create, publish, queue_stats
from tests.support.processes import FAST_SCAN, REPO_ROOT, child_env, wait_for
from tests.support.raw_conn import RawConn, command

# Every test runs `python -m spark_bridge snapshot` as a process, most against a twistd mqd.
pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess:
    env = child_env()
    env["no_proxy"] = "*"  # the broker is on loopback, whatever proxy the environment names
    return subprocess.run([sys.executable, "-m", "spark_bridge", "snapshot", *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_broker_takes_the_snapshot_under_its_data_path(start_broker):
    broker = start_broker(*FAST_SCAN, "--mem-queue-size=0")
    create(broker, "a", "x")
    publish(broker, "a", 50)
    url = f"http://{broker.http_address}"

    result = cli("--broker", url, "--out", "s1")
    assert result.returncode == 0, result.stderr
    path = broker.data_dir / "snapshots" / "s1"
    assert result.stdout.startswith(f"snapshot {path}\n")
    assert "a / x: 50 (50 queued, 0 in flight, 0 deferred)" in result.stdout
    assert {q.name: q.count for q in read_manifest(path).queues}["a:x"] == 50

    # The broker's refusals come back as its status and message.
    again = cli("--broker", url + "/", "--out", "s1", "--timeout", "30")
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr == f"snapshot failed: {url}/snapshot?out=s1: 400 OUT_EXISTS\n"
    hidden = cli("--broker", url, "--out", ".hidden")
    assert hidden.returncode == 1
    assert hidden.stderr == f"snapshot failed: {url}/snapshot?out=.hidden: 400 INVALID_OUT\n"
    # A path is refused before anything is asked.
    slash = cli("--broker", url, "--out", "sub/s2")
    assert slash.returncode == 2 and "no path separator" in slash.stderr
    assert sorted(p.name for p in (broker.data_dir / "snapshots").iterdir()) == ["s1"]


@pytest.mark.parametrize("mode", [(), ("--backend=memory",)], ids=["lmdb", "memory"])
def test_broker_snapshot_holds_memory_in_flight_and_deferred(start_broker, mode):
    # Default mem-queue-size: the whole backlog is in memory, which a copy of
    # the store's files would miss.
    broker = start_broker(*FAST_SCAN, *mode)
    create(broker, "a", "x")
    publish(broker, "a", 30)
    assert call(broker, "POST", "/pub?topic=a&defer=600000", b"later")[0] == 200
    with RawConn(broker) as consumer:
        consumer.send(command("SUB a x") + command("RDY 3"))
        assert consumer.read_frame() == (0, b"OK")
        for _ in range(3):
            consumer.read_message()  # held un-FINished: in flight
        wait_for(lambda: queue_stats(broker)["a:x"]["in_flight_count"] == 3, what="3 in flight")

        result = cli("--broker", f"http://{broker.http_address}", "--out", "whole")
        assert result.returncode == 0, result.stderr
    backend = "memory" if mode else "lmdb"
    assert f"  taken by the broker ({backend} backend): everything it held" in result.stdout
    assert "    a / x: 31 (27 queued, 3 in flight, 1 deferred)" in result.stdout
    assert "stats check: the rows of 2 queues equal /stats at the capture instant" in result.stdout
    assert "BUG" not in result.stdout + result.stderr
    manifest = read_manifest(broker.data_dir / "snapshots" / "whole")
    assert manifest.source == "broker" and manifest.backend == backend
    x = manifest.queue("a:x")
    assert (x.count, x.queued, x.in_flight, x.deferred) == (31, 27, 3, 1)


def test_data_path_of_a_running_broker(start_broker, tmp_path):
    broker = start_broker(*FAST_SCAN, "--mem-queue-size=0")
    create(broker, "a", "x")
    publish(broker, "a", 20)

    refused = cli("--data-path", str(broker.data_dir), "--out", str(tmp_path / "refused"))
    assert refused.returncode == 1 and refused.stdout == ""
    assert f"a broker is running on {broker.data_dir}" in refused.stderr
    assert "--broker http://HOST:PORT" in refused.stderr and "--lmdb-only" in refused.stderr
    assert not (tmp_path / "refused").exists()

    anyway = cli("--data-path", str(broker.data_dir / "mqd.lmdb"), "--out", str(tmp_path / "anyway"),
                 "--lmdb-only")
    assert anyway.returncode == 0, anyway.stderr
    assert "a / x: 20" in anyway.stdout and "--lmdb-only on a running broker" in anyway.stderr
    manifest = read_manifest(tmp_path / "anyway")
    assert manifest.source == "data-path" and manifest.queue("a:x").count == 20
    # The check took nothing from the broker: it serves on.
    publish(broker, "a", 5, start=20)

    broker.stop_cleanly()
    stopped = cli("--data-path", str(broker.data_dir), "--out", str(tmp_path / "stopped"))
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stderr == "" and "a / x: 25" in stopped.stdout
    assert read_manifest(tmp_path / "stopped").queue("a:x").count == 25


def test_broker_and_data_path_together_is_a_usage_error(tmp_path):
    result = cli("--broker", "http://127.0.0.1:4151", "--data-path", str(tmp_path))
    assert result.returncode == 2
    assert "argument --data-path: not allowed with argument --broker" in result.stderr
