"""The offset-mode source on a real Spark standalone cluster: a master, two workers, a driver, all processes.

The cluster is started from the installed pyspark (tests/support/spark_cluster.py);
the driver is a Python process of its own whose executors' Python workers
run this interpreter (PYSPARK_PYTHON). Records are retained on a real
`twistd mqd`; the executors read their ranges straight from it over HTTP.
One executor JVM is killed with SIGKILL while it runs a task of a micro-batch
(reading and writing it): Spark runs the lost task again elsewhere, and the standalone
master gives the worker a new executor. The sink, read back with Spark
(whose file-sink log decides which files count), must hold every record once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.support.processes import http_request
from tests.support.spark_cluster import StandaloneCluster, alive

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds executors in /proc")]

TOPIC = "events"
RECORDS = 60_000
PER_TRIGGER = 6_000  # ten micro-batches of three tasks (minPartitions)

RUNNING = re.compile(r"Running task \S+ in stage \S+ \(TID (\d+)\)")
FINISHED = re.compile(r"Finished task \S+ in stage \S+ \(TID (\d+)\)")


def _publish(http_address: str, bodies: list[bytes]) -> None:
    for at in range(0, len(bodies), 10_000):
        status, answer = http_request(http_address, "POST", f"/mpub?topic={TOPIC}",
                                      b"\n".join(bodies[at:at + 10_000]))
        assert (status, answer) == (200, b"OK"), answer


def _batches(checkpoint: Path, kind: str) -> int:
    """How many micro-batches the query has planned ("offsets") or committed ("commits")."""
    path = checkpoint / kind
    return len([p for p in path.iterdir() if p.name.isdigit()]) if path.exists() else 0


def _unfinished_tasks(executor_log: Path) -> set[str]:
    """The tasks an executor has started and not finished, from its log (INFO, Spark's default)."""
    text = executor_log.read_text("utf-8", "replace") if executor_log.exists() else ""
    return set(RUNNING.findall(text)) - set(FINISHED.findall(text))


def _wait(condition, timeout: float, what: str, driver) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if driver.proc.poll() is not None:
            raise AssertionError(f"the driver exited ({driver.proc.returncode}) while waiting for {what}\n"
                                 f"{driver.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{driver.tail()}")
        time.sleep(0.05)


def test_an_executor_killed_mid_stream_on_a_standalone_cluster_leaves_every_record_once(start_broker,
                                                                                          tmp_path):
    broker = start_broker("--retention-bytes=100MB")
    bodies = [b"event-%d" % n for n in range(RECORDS)]
    _publish(broker.http_address, bodies)
    checkpoint, out, result = tmp_path / "ckpt", tmp_path / "out", tmp_path / "result.txt"
    with StandaloneCluster(tmp_path / "cluster", workers=2).start() as cluster:
        driver = cluster.start_driver([
            "-m", "tests.support.spark_cluster", "--master", cluster.url, "--checkpoint", str(checkpoint),
            "--out", str(out), "--result", str(result), f"--option=topic={TOPIC}",
            f"--option=nsqd={broker.tcp_address}", f"--option=maxOffsetsPerTrigger={PER_TRIGGER}",
            "--option=minPartitions=3"])
        # A batch committed (both executors have read), then one of worker 0's executor's tasks
        # of a later batch under way: that executor dies in the middle of reading and writing it.
        _wait(lambda: _batches(checkpoint, "commits") >= 1 and all(cluster.executors(w) for w in (0, 1)),
              300, "a first committed batch on two executors", driver)
        [victim] = cluster.executors(0)
        victim_log = Path(os.readlink(f"/proc/{victim}/cwd")) / "stderr"
        _wait(lambda: bool(_unfinished_tasks(victim_log)), 120, "a task running on the executor", driver)
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: not alive(victim), 30, "the executor to die", driver)
        assert _unfinished_tasks(victim_log), "the executor finished its task before it died"
        try:
            driver.proc.wait(300)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the driver did not finish\n{driver.tail()}") from None
        assert driver.proc.returncode == 0, driver.tail()
        # The master gave the worker a new executor in place of the killed one.
        assert len(cluster.executor_dirs(0)) >= 2, cluster.executor_dirs(0)
    got = Counter(result.read_text().splitlines())
    duplicates = {body: n for body, n in got.items() if n > 1}
    assert not duplicates, f"{len(duplicates)} records more than once, e.g. {list(duplicates)[:3]}"
    want = {b.decode() for b in bodies}
    assert set(got) == want, f"missing {len(want - set(got))}, unexpected {len(set(got) - want)}"
    assert _batches(checkpoint, "commits") == RECORDS // PER_TRIGGER
