"""Runs one sink task (`TopicWriter.write`) outside Spark, in a process of its own.

`python -m tests.support.sink_direct OPTIONS_JSON ROWS_JSON`: rows are
`[body, topic or null]` pairs. Prints the commit message's
`{"broker", "topics", "deferred"}` as JSON and exits 0, or prints the
error's text on stderr and exits 1.

A process of its own because the sink runs Twisted's reactor on a thread
(reactor_thread.py), while the test process's reactor belongs to
pytest-twisted: one reactor per process, so the two cannot share it.
"""

from __future__ import annotations

import json
import sys

import pyarrow as pa
from pyspark.sql.types import StringType, StructField, StructType

from spark_bridge.sink import TopicWriter


def main(argv: list[str]) -> int:
    options, rows = json.loads(argv[0]), json.loads(argv[1])
    schema = StructType([StructField("body", StringType()), StructField("topic", StringType())])
    batch = pa.record_batch([pa.array([r[0] for r in rows], pa.string()),
                             pa.array([r[1] for r in rows], pa.string())], names=["body", "topic"])
    try:
        done = TopicWriter(options, schema).write(iter([batch]))
    except Exception as e:  # noqa: BLE001 - the test reads the text
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"broker": done.broker, "topics": done.topics, "deferred": done.deferred}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
