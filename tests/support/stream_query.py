"""The streaming query the source's tests run: mqd topic -> filter and transform -> Parquet files.

Used in-process on the shared session, and as `python -m tests.support.stream_query`
by the test that kills a whole Spark driver (JVM and Python) with SIGKILL and
starts it again on the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

SKIP = b"skip"  # bodies starting with it are filtered out by the query


def start_query(spark, *, checkpoint: str, out: str, trigger: str = "200 milliseconds", **options: str):
    """Start source -> (drop bodies starting with `skip`, upper-case the rest) -> Parquet at `out`."""
    from pyspark.sql import functions as F

    reader = spark.readStream.format("mqd").option("checkpointLocation", checkpoint)
    for key, value in options.items():
        reader = reader.option(key, value)
    rows = (reader.load()
            .where(~F.col("body").startswith(F.lit(SKIP)))
            .select(F.upper(F.col("body").cast("string")).alias("body"), "message_id",
                    "attempts", "timestamp", "nsqd"))
    return (rows.writeStream.format("parquet").option("path", out)
            .option("checkpointLocation", checkpoint).trigger(processingTime=trigger).start())


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--option", action="append", default=[], help="name=value, for the source")
    args = parser.parse_args(argv)
    from spark_bridge.session import build_session

    spark = build_session("local[2]", conf={"spark.ui.enabled": "false"})
    options = dict(o.split("=", 1) for o in args.option)
    query = start_query(spark, checkpoint=args.checkpoint, out=args.out, **options)
    print("started", flush=True)
    while query.isActive:  # until killed, or the query fails
        time.sleep(0.5)
    print(query.exception(), file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
