"""The SparkSession the bridge's command line and tests use, and how user jobs get the same.

Users with their own session only need `datasource.register(spark)`;
`build_session` adds what the bridge relies on:
- Python filter pushdown on (`spark.sql.python.filterPushdown.enabled`),
  so topic/channel filters skip whole queues;
- timestamps shown in UTC, as the broker stores them;
- on a local master, Python workers run this interpreter (Spark's Python
  data source workers use `PYSPARK_PYTHON`, default `python3` from PATH,
  which may not have lmdb or this package), through python_launcher.py's
  script so they import the installed pyspark, not Spark's zip of it
  (~0.7 s less per Python process Spark starts), and a few shuffle partitions
  (the bridge's aggregations produce a few rows per queue; 200 tasks of
  nothing cost more than the work).
- on a local master, the JVM class archive of jvm_archive.py when built
  (SparkSession start ~8 s -> 4-5 s here).
On a cluster (`--master spark://...` or spark-submit) nothing about the
executors is assumed: they need this package and its dependencies
installed (or `--py-files`) and the snapshot at the same path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

from spark_bridge.datasource import PUSHDOWN_CONF, register
from spark_bridge.jvm_archive import java_options
from spark_bridge.python_launcher import launcher_path

__all__ = ["DEFAULT_MASTER", "build_session", "launched_jvm", "session_conf"]

DEFAULT_MASTER = "local[*]"
JAVA_OPTIONS = "spark.driver.extraJavaOptions"


def _is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def session_conf(master: str | None, conf: Mapping[str, str] | None = None,
                 progress: bool = False) -> tuple[str | None, dict[str, str]]:
    """The master to set (None: spark-submit's stands) and the settings build_session uses."""
    out = {
        PUSHDOWN_CONF: "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "true" if progress else "false",
    }
    # spark-submit starts the JVM first and hands the Python driver its port.
    if master is None and "PYSPARK_GATEWAY_PORT" in os.environ:
        out.update(conf or {})
        return None, out
    master = master or DEFAULT_MASTER
    if _is_local(master):
        out["spark.sql.shuffle.partitions"] = str(max(2, os.cpu_count() or 1))
        # The driver JVM maps Spark's classes from the archive `python -m
        # spark_bridge jvm-archive` built, if there is one (jvm_archive.py).
        options = None if os.environ.get("MQD_NO_JVM_ARCHIVE") else java_options()
        if options and JAVA_OPTIONS not in (conf or {}):
            out[JAVA_OPTIONS] = options
    out.update(conf or {})
    return master, out


# The JVMs this process launched, by the id of their SparkContext (see launched_jvm).
_LAUNCHED: dict[int, subprocess.Popen] = {}


def _start_context(master: str, app_name: str, settings: Mapping[str, str]) -> subprocess.Popen | None:
    """Start the SparkContext with a JVM launched here, and return that JVM's process.

    What SparkSession.builder would do, but with the gateway in hand: its
    process is the one to close at shutdown (launched_jvm). The builder
    then finds this context active and builds its session on it.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    conf = SparkConf().setMaster(master).setAppName(app_name)
    for key, value in settings.items():
        conf.set(key, value)
    gateway = launch_gateway(conf)
    SparkContext(conf=conf, gateway=gateway)
    return getattr(gateway, "proc", None)


def launched_jvm(spark) -> subprocess.Popen | None:
    """The JVM process this Python process launched for `spark`'s context, if it launched one.

    None under spark-submit, where the JVM started first and is this
    process's parent, and for a session made elsewhere.
    """
    return _LAUNCHED.get(id(spark.sparkContext))


def build_session(master: str | None = None, *, app_name: str = "mqd-spark-bridge",
                  conf: Mapping[str, str] | None = None, progress: bool = False):
    """A SparkSession with the `mqd` format registered.

    `master`: a Spark master URL; None keeps spark-submit's `--master` when
    run by spark-submit, else `local[*]`. `progress`: Spark's console
    progress bar on stderr, for long jobs run from a terminal.
    """
    from pyspark.sql import SparkSession

    master, settings = session_conf(master, conf, progress)
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
        if _is_local(master) and "PYSPARK_PYTHON" not in os.environ:
            launcher = None if os.environ.get("MQD_NO_PYTHON_LAUNCHER") else launcher_path()
            os.environ["PYSPARK_PYTHON"] = launcher or sys.executable
    for key, value in settings.items():
        builder = builder.config(key, value)
    jvm = None
    if master is not None and SparkSession.getActiveSession() is None:
        jvm = _start_context(master, app_name, settings)
    spark = builder.getOrCreate()
    if jvm is not None:
        _LAUNCHED[id(spark.sparkContext)] = jvm
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
