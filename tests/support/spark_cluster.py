"""A Spark standalone cluster started from the installed pyspark, and the offset-mode query a driver runs on it.

`StandaloneCluster` starts a master and workers with the installed
package's own `bin/spark-class` (pip's pyspark is a whole Spark: its
directory is SPARK_HOME), each in a session of its own, on 127.0.0.1 with
ephemeral ports, every UI on an ephemeral port too and the master's REST
submission server off (it would take the fixed port 6066). Each worker
has its own work directory; the executors it starts are its child JVMs,
found by their command line (`executors`). `stop` kills every process
the cluster started and their descendants (executors, their Python
workers, a driver's JVM), collected before anything is killed so nothing
is reparented away first; it runs on the way out of `with`, whatever
happened.

Python on a cluster: the data source's driver-side workers and every
executor's Python workers run the interpreter named by PYSPARK_PYTHON in
the driver's environment (`spark.pyspark.python` set on the builder is
too late: pyspark reads the variable when the context starts). It is
this interpreter here, which has the package installed; `driver_env`
sets it.

`python -m tests.support.spark_cluster --master spark://... --checkpoint C
--out O --result R --option topic=... --option nsqd=...` is the driver
the cluster test runs: the offset-mode query (no channel) into Parquet
files with AvailableNow, then the sink read back with Spark, its bodies
written one per line to R.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from types import TracebackType

from tests.support.processes import child_env

__all__ = ["DRIVER_CONF", "SparkProcess", "StandaloneCluster", "alive", "driver_env", "process_tree", "spark_home"]

MASTER_URL = re.compile(r"Starting Spark master at (spark://[\d.]+:\d+)")
WORKER_REGISTERED = "Successfully registered with master"
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"

# What the test's and the bench's drivers set: no driver UI, executors that fit the workers' memory.
DRIVER_CONF = {"spark.ui.enabled": "false", "spark.executor.memory": "512m"}


def spark_home() -> Path:
    """The installed pyspark's directory, which holds bin/spark-class and jars/ (a Spark of its own)."""
    spec = find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise RuntimeError("pyspark is not installed")
    return Path(spec.origin).parent


def cluster_env() -> dict[str, str]:
    """The environment of the master and workers: loopback only, small daemon heaps."""
    env = child_env()
    env["SPARK_LOCAL_IP"] = "127.0.0.1"  # RPC, UIs and the address executors are told
    env["SPARK_DAEMON_MEMORY"] = "256m"  # master and worker JVMs; executors get spark.executor.memory
    env.pop("SPARK_HOME", None)
    return env


def driver_env() -> dict[str, str]:
    """The environment of a driver process: the cluster's, plus the Python every Python worker runs."""
    env = cluster_env()
    env["PYSPARK_PYTHON"] = sys.executable
    return env


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields after it are what count.
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants alive now (Linux: from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    tree = [pid]
    for p in tree:
        tree.extend(children.get(p, ()))
    return tree


def _command_line(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] != b"Z"


class SparkProcess:
    """One process of the cluster (a master, a worker, a driver) in a session of its own, logging to a file."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: dict[str, str], cwd: Path, *,
                 stdin: int = subprocess.DEVNULL) -> None:
        self.name = name
        self.log_path = log
        with open(log, "wb") as out:  # a fresh log: what is waited for must be from this run
            self.proc = subprocess.Popen(list(argv), stdin=stdin, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} log ---\n{self.log()[-chars:]}"

    def wait_for(self, pattern: re.Pattern[str] | str, timeout: float) -> re.Match[str] | str:
        """The first match of `pattern` in the log, waiting for it; fails if the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            found = pattern.search(text) if isinstance(pattern, re.Pattern) else (pattern if pattern in text
                                                                                   else None)
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {pattern!r} within {timeout:g}s\n{self.tail()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the process, everything it started and its session; harmless if already gone."""
        victims = process_tree(self.pid) if self.proc.poll() is None else []
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # whatever of its session was not a descendant
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # pragma: no cover - nothing more to do
            pass


class StandaloneCluster:
    """A master and `workers` workers (each `cores` cores, `memory` for executors) on 127.0.0.1.

    Use as a context manager: `with StandaloneCluster(path, 2).start() as cluster:`.
    """

    def __init__(self, workdir: Path, workers: int = 2, *, cores: int = 1, memory: str = "1g") -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.worker_count = workers
        self.cores = cores
        self.memory = memory
        self.url = ""
        self.master: SparkProcess | None = None
        self.workers: list[SparkProcess] = []
        self.drivers: list[SparkProcess] = []
        self.work_dirs: list[Path] = []

    def _spark_class(self, name: str, main_class: str, *args: str) -> SparkProcess:
        properties = self.workdir / "spark-defaults.conf"
        if not properties.exists():
            # The master's REST submission server would bind the fixed port 6066.
            properties.write_text("spark.master.rest.enabled false\n")
        argv = [str(spark_home() / "bin" / "spark-class"), main_class, "--properties-file", str(properties),
                *args]
        return SparkProcess(name, argv, self.workdir / f"{name}.log", cluster_env(), self.workdir)

    def start(self, timeout: float = 120.0) -> StandaloneCluster:
        """Start the master, then the workers, and wait until every worker has registered."""
        try:
            self.master = self._spark_class("master", "org.apache.spark.deploy.master.Master",
                                            "--host", "127.0.0.1", "--port", "0", "--webui-port", "0")
            found = self.master.wait_for(MASTER_URL, timeout)
            assert isinstance(found, re.Match)
            self.url = found.group(1)
            for n in range(self.worker_count):
                work = self.workdir / f"worker{n}"
                work.mkdir(exist_ok=True)
                self.work_dirs.append(work)
                self.workers.append(self._spark_class(
                    f"worker{n}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                    "--port", "0", "--webui-port", "0", "--cores", str(self.cores), "--memory", self.memory,
                    "--work-dir", str(work), self.url))
            for worker in self.workers:
                worker.wait_for(WORKER_REGISTERED, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_driver(self, argv: Sequence[str], name: str = "driver", *,
                     stdin: int = subprocess.DEVNULL) -> SparkProcess:
        """A Python driver process (argv after the interpreter) with driver_env(), stopped with the cluster."""
        driver = SparkProcess(name, [sys.executable, *argv], self.workdir / f"{name}.log", driver_env(),
                              self.workdir, stdin=stdin)
        self.drivers.append(driver)
        return driver

    def executors(self, worker: int) -> list[int]:
        """The pids of the executor JVMs worker `worker` runs now (its children of that class)."""
        pids = process_tree(self.workers[worker].pid)[1:]
        return [p for p in pids if EXECUTOR_CLASS in _command_line(p) and alive(p)]

    def executor_dirs(self, worker: int) -> list[Path]:
        """The work directories of every executor the worker started (one per executor, per application)."""
        return sorted(p for p in self.work_dirs[worker].glob("app-*/*") if p.is_dir())

    def stop(self) -> None:
        """Kill drivers, workers (and their executors), then the master: nothing is left running."""
        for process in [*self.drivers, *self.workers, *([self.master] if self.master else [])]:
            process.kill()

    def __enter__(self) -> StandaloneCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# -- the driver of the cluster test ------------------------------------------------------------


def run_offset_query(spark, *, checkpoint: str, out: str, options: dict[str, str]):
    """readStream.format("mqd") by offset (topic, no channel) -> Parquet at `out`, AvailableNow."""
    reader = spark.readStream.format("mqd").option("startingOffsets", "earliest")
    for key, value in options.items():
        reader = reader.option(key, value)
    rows = reader.load().selectExpr("CAST(body AS STRING) AS body", "offset", "nsqd")
    return (rows.writeStream.format("parquet").option("path", out)
            .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True, help="the sink's bodies, one per line, read back by Spark")
    parser.add_argument("--option", action="append", default=[], help="name=value, for the source")
    args = parser.parse_args(argv)
    from spark_bridge.session import build_session

    spark = build_session(args.master, app_name="mqd-cluster-test", conf=DRIVER_CONF)
    query = run_offset_query(spark, checkpoint=args.checkpoint, out=args.out,
                             options=dict(o.split("=", 1) for o in args.option))
    print("started", flush=True)
    query.awaitTermination()
    bodies = [r.body for r in spark.read.parquet(args.out).select("body").collect()]
    partial = Path(f"{args.result}.tmp")
    partial.write_text("".join(f"{b}\n" for b in sorted(bodies)))
    partial.replace(args.result)
    print(f"read back {len(bodies)} rows", flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
