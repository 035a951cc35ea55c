"""The streaming query the source's tests run: mqd topic -> filter and transform -> Parquet files.

Used in-process on the shared session, and as `python -m tests.support.stream_query`
by the tests that kill a whole Spark driver (JVM and Python) with SIGKILL and
start it again on the same checkpoint. Both of the source's modes: with a
`channel` option the source keeps its own state and is given the
checkpoint too; without one (offset mode) only writeStream is, as Spark's
Kafka guide writes it, and the rows keep their `offset` column.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

SKIP = b"skip"  # bodies starting with it are filtered out by the query


def start_query(spark, *, checkpoint: str, out: str, trigger: str = "200 milliseconds", **options: str):
    """Start source -> (drop bodies starting with `skip`, upper-case the rest) -> Parquet at `out`.

    `trigger`: a processing-time interval, or "availableNow".
    """
    from pyspark.sql import functions as F

    reader = spark.readStream.format("mqd")
    if "channel" in options:
        reader = reader.option("checkpointLocation", checkpoint)
    for key, value in options.items():
        reader = reader.option(key, value)
    source = reader.load()
    kept = [c for c in ("offset",) if c in source.columns]
    rows = (source
            .where(~F.col("body").startswith(F.lit(SKIP)))
            .select(F.upper(F.col("body").cast("string")).alias("body"), "message_id",
                    "attempts", "timestamp", "nsqd", *kept))
    writer = rows.writeStream.format("parquet").option("path", out).option("checkpointLocation", checkpoint)
    if trigger == "availableNow":
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime=trigger).start()


def channel_counts(http_address: str, topic: str, channel: str) -> tuple[int, int, int]:
    """(depth, in_flight_count, deferred_count) of a channel, from the broker's /stats."""
    url = f"http://{http_address}/stats?format=json&topic={topic}&channel={channel}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        stats = json.load(answer)
    for t in stats["topics"]:
        for c in t["channels"]:
            if t["topic_name"] == topic and c["channel_name"] == channel:
                return c["depth"], c["in_flight_count"], c["deferred_count"]
    return -1, -1, -1




def wait_until(condition, timeout: float, what: str, query=None, every: float = 0.3) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` s, or at once if the query failed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if query is not None and query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)

def start_driver(checkpoint, out, log, **options: str) -> subprocess.Popen:
    """This module's query in a driver process of its own session (JVM and Python workers included), logging to `log`."""
    from tests.support.processes import REPO_ROOT, child_env

    argv = [sys.executable, "-m", "tests.support.stream_query", "--checkpoint", str(checkpoint),
            "--out", str(out), *(f"--option={k}={v}" for k, v in options.items())]
    with open(log, "ab") as sink:
        # Its own session: SIGKILL of the group kills the whole driver, JVM and Python workers.
        return subprocess.Popen(argv, cwd=REPO_ROOT, env=child_env(), stdout=sink, stderr=sink,
                                start_new_session=True)


def kill_driver(proc: subprocess.Popen) -> None:
    """SIGKILL of the driver's whole process group, as a crash of its host would end it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--option", action="append", default=[], help="name=value, for the source")
    parser.add_argument("--trigger", default="200 milliseconds", help='an interval, or "availableNow"')
    args = parser.parse_args(argv)
    from spark_bridge.session import build_session

    spark = build_session("local[2]", conf={"spark.ui.enabled": "false"})
    options = dict(o.split("=", 1) for o in args.option)
    query = start_query(spark, checkpoint=args.checkpoint, out=args.out, trigger=args.trigger, **options)
    print("started", flush=True)
    while query.isActive:  # until killed, or the query fails
        time.sleep(0.5)
    print(query.exception(), file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
