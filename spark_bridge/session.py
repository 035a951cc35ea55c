"""The SparkSession the bridge's command line and tests use, and how user jobs get the same.

Users with their own session only need `datasource.register(spark)`;
`build_session` adds what the bridge relies on:
- Python filter pushdown on (`spark.sql.python.filterPushdown.enabled`),
  so topic/channel filters skip whole queues;
- timestamps shown in UTC, as the broker stores them;
- on a local master, Python workers run this interpreter (Spark's Python
  data source workers use `PYSPARK_PYTHON`, default `python3` from PATH,
  which may not have lmdb or this package) and a few shuffle partitions
  (the bridge's aggregations produce a few rows per queue; 200 tasks of
  nothing cost more than the work).
On a cluster (`--master spark://...` or spark-submit) nothing about the
executors is assumed: they need this package and its dependencies
installed (or `--py-files`) and the snapshot at the same path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from .datasource import PUSHDOWN_CONF, register

__all__ = ["DEFAULT_MASTER", "build_session"]

DEFAULT_MASTER = "local[*]"


def _is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def build_session(master: str | None = None, *, app_name: str = "mqd-spark-bridge",
                  conf: Mapping[str, str] | None = None, progress: bool = False):
    """A SparkSession with the `mqd` format registered.

    `master`: a Spark master URL; None keeps spark-submit's `--master` when
    run by spark-submit, else `local[*]`. `progress`: Spark's console
    progress bar on stderr, for long jobs run from a terminal.
    """
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.appName(app_name)
               .config(PUSHDOWN_CONF, "true")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.ui.showConsoleProgress", "true" if progress else "false"))
    # spark-submit starts the JVM first and hands the Python driver its port.
    submitted = master is None and "PYSPARK_GATEWAY_PORT" in os.environ
    if not submitted:
        master = master or DEFAULT_MASTER
        builder = builder.master(master)
    if master is not None and _is_local(master):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = builder.config("spark.sql.shuffle.partitions", str(max(2, (os.cpu_count() or 1))))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
