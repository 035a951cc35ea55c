"""``python -m bench spark-cluster``: the offset-mode source on a Spark standalone cluster, one worker vs two.

One mqd (``--backend``, lmdb by default, ``--retention-bytes=100GB``)
gets ``--messages`` records of ``--size`` bytes published by TCP MPUB
(bench/harness/load.py) into a topic without channels: its retained log.
Then, for each ``--setups`` entry, a standalone cluster of its own is
started from the installed pyspark (tests/support/spark_cluster.py): a
master and N workers of ``--cores`` core(s) each (``local`` instead: one
``local[2]`` driver, no cluster), and one driver process on it that
stays up for the whole bench. Each run is one query, on a fresh
checkpoint: ``readStream.format("mqd")`` by offset (topic, no channel,
``startingOffsets`` earliest, ``minPartitions`` ``--min-partitions``) ->
``foreachBatch`` counting the batch, ``trigger(availableNow=True)``.
Rate = N / (``start()`` -> ``awaitTermination()`` returned), the query's
whole life; *trigger* is the sum of the batches' ``triggerExecution``.
The count must be N, else the run fails.

Every setup first runs ``--warmup`` times untimed (executors and their
Python workers start, the JVMs compile), then ``--runs`` timed runs per
setup, alternating (1, 2; then 2, 1; ...): the medians are reported.
The machine may be shared with other work, and the broker, the drivers
and the executors all share its cores: each run carries the load average
at its start and *others*, the CPU (in cores) that processes other than
the bench's own (the broker, the clusters, the drivers and everything
they started) used during it: the machine's busy time (/proc/stat) less
the bench's processes' (/proc/PID/stat), so it sees work the load
average hides, in other PID namespaces too. ``--quiet C`` runs a timed
run again (at most ``--retries`` times) while others used more than C
cores: on a shared machine, medians of quiet runs only.

Usage::

    python -m bench spark-cluster [--messages 1000000] [--size 200] [--runs 5] [--warmup 2]
        [--setups 1,2] [--min-partitions 2] [--quiet 0.1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench.harness.broker import Broker, BrokerError
from bench.harness.load import fill
from bench.harness.report import fmt, heading, load_average, median, save_json
from tests.support.spark_cluster import (
    DRIVER_CONF,
    SparkProcess,
    StandaloneCluster,
    driver_env,
    process_tree,
)

TOPIC = "offsets"
RESULT = re.compile(r"^result (\d+) (\{.*\})$", re.MULTILINE)
now = time.perf_counter


# -- the driver: a process of its own per setup, told by stdin when to run a query ------------


def run_query(spark, nsqd: str, min_partitions: int, checkpoint: str) -> dict:
    """One AvailableNow query over the whole retained log, counting rows in foreachBatch."""
    counts: list[int] = []

    def each(batch, _batch_id: int) -> None:
        counts.append(batch.count())

    reader = (spark.readStream.format("mqd").option("topic", TOPIC).option("nsqd", nsqd)
              .option("startingOffsets", "earliest"))
    if min_partitions:
        reader = reader.option("minPartitions", str(min_partitions))
    started = now()
    query = (reader.load().writeStream.foreachBatch(each).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    wall = now() - started
    progress = query.recentProgress
    return {"records": sum(counts), "seconds": wall, "batches": len(counts),
            "trigger_ms": sum(p["durationMs"].get("triggerExecution", 0) for p in progress)}


def driver_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.spark_cluster --driver")
    p.add_argument("--driver", action="store_true")
    p.add_argument("--master", required=True)
    p.add_argument("--nsqd", required=True)
    p.add_argument("--min-partitions", type=int, default=0)
    p.add_argument("--workdir", required=True)
    args = p.parse_args(argv)
    from spark_bridge.session import build_session

    spark = build_session(args.master, app_name="mqd-bench-spark-cluster", conf=DRIVER_CONF)
    print("ready", flush=True)
    for n, line in enumerate(sys.stdin):
        if line.strip() != "run":
            break
        checkpoint = tempfile.mkdtemp(prefix="ckpt-", dir=args.workdir)
        result = run_query(spark, args.nsqd, args.min_partitions, checkpoint)
        shutil.rmtree(checkpoint, ignore_errors=True)
        print(f"result {n} {json.dumps(result)}", flush=True)
    spark.stop()
    return 0


# -- the bench ---------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (all but idle and iowait), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is in user already)
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def tree_seconds(roots: list[int]) -> float:
    """CPU seconds used by `roots`, everything they started and still run, and what they reaped."""
    total = 0
    for pid in {p for root in roots for p in process_tree(root)}:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return total / TICK



class Setup:
    """A driver on a cluster of `workers` workers (0: local[2]), and how many runs it was asked for."""

    def __init__(self, name: str, driver: SparkProcess, roots: list[int]) -> None:
        self.name = name
        self.driver = driver
        self.roots = roots  # the processes whose trees are the setup's
        self.asked = 0

    def run(self, timeout: float) -> dict:
        stdin = self.driver.proc.stdin
        assert stdin is not None
        stdin.write(b"run\n")
        stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            found = {int(m.group(1)): m.group(2) for m in RESULT.finditer(self.driver.log())}
            if self.asked in found:
                self.asked += 1
                return json.loads(found[self.asked - 1])
            if self.driver.proc.poll() is not None or time.monotonic() > deadline:
                raise BrokerError(f"the {self.name} driver gave no result\n{self.driver.tail()}")
            time.sleep(0.1)


def timed_run(setup: Setup, mine: list[int], args: argparse.Namespace) -> dict:
    """One timed query; again (up to --retries times) while others used more than --quiet cores."""
    for attempt in range(args.retries + 1):
        load = load_average()
        busy, own = busy_seconds(), tree_seconds(mine)
        result = setup.run(args.timeout)
        others = max(0.0, (busy_seconds() - busy - (tree_seconds(mine) - own)) / result["seconds"])
        if result["records"] != args.messages:
            raise BrokerError(f"{label(setup.name)}: counted {result['records']:,} of {args.messages:,}")
        result.update(load=load, others=others)
        busy_run = bool(args.quiet) and others > args.quiet
        print(f"  {label(setup.name)}: {result['seconds']:.2f} s, {args.messages / result['seconds']:,.0f} rec/s, "
              f"{result['batches']} batch(es), trigger {result['trigger_ms']:,} ms, load {load:.2f}, "
              f"others {others:.2f} cores{' (again)' if busy_run and attempt < args.retries else ''}", flush=True)
        if not busy_run:
            break
    return result


def start_setup(name: str, stack: ExitStack, workdir: Path, nsqd: str, args: argparse.Namespace) -> Setup:
    driver_args = ["-m", "bench.scenarios.spark_cluster", "--driver", "--nsqd", nsqd,
                   "--min-partitions", str(args.min_partitions)]
    if name == "local":
        where = workdir / "local"
        where.mkdir()
        env = driver_env()
        del env["PYSPARK_PYTHON"]  # build_session's own choice on a local master
        driver = SparkProcess("driver", [sys.executable, *driver_args, "--master", "local[2]",
                                         "--workdir", str(where)],
                              where / "driver.log", env, where, stdin=subprocess.PIPE)
        stack.callback(driver.kill)
        roots = [driver.pid]
    else:
        cluster = stack.enter_context(StandaloneCluster(workdir / f"workers-{name}", int(name),
                                                        cores=args.cores, memory=args.worker_memory))
        cluster.start()
        driver = cluster.start_driver([*driver_args, "--master", cluster.url, "--workdir",
                                       str(cluster.workdir)], stdin=subprocess.PIPE)
        roots = [driver.pid, *(p.pid for p in [*cluster.workers, *([cluster.master] if cluster.master else [])])]
    driver.wait_for("ready", 300)
    return Setup(name, driver, roots)


def label(name: str) -> str:
    return "local[2]" if name == "local" else f"{name} worker{'s' if name != '1' else ''}"


def main(argv: list[str]) -> int:
    if "--driver" in argv:
        return driver_main(argv)
    p = argparse.ArgumentParser(prog="python -m bench spark-cluster", description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--size", type=int, default=200, help="bytes per record")
    p.add_argument("--runs", type=int, default=5, help="timed runs per setup")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per setup first")
    p.add_argument("--setups", default="1,2", help="comma-separated worker counts; 'local' for local[2]")
    p.add_argument("--cores", type=int, default=1, help="cores of each worker")
    p.add_argument("--worker-memory", default="1g")
    p.add_argument("--min-partitions", type=int, default=2, help="the source's minPartitions (0: its default)")
    p.add_argument("--backend", default="lmdb", help="the broker's --backend")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--quiet", type=float, default=0.0,
                   help="run again when other processes used more than this many cores (0: never)")
    p.add_argument("--retries", type=int, default=10, help="at most this many runs again per timed run")
    p.add_argument("--json", help="write the runs as JSON here")
    args = p.parse_args(argv)
    setups = args.setups.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="mqd-bench-cluster-"))
    print(heading("spark-cluster", f"{args.messages:,} x {args.size} B", f"backend {args.backend}",
                  f"minPartitions {args.min_partitions or 'default'}"), flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    try:
        with ExitStack() as stack:
            broker = stack.enter_context(Broker(args.backend, 10_000, ["--retention-bytes=100GB"]))
            assert broker.address is not None
            started = now()
            fill(broker.address, TOPIC, args.messages, size=args.size)
            print(f"filled {args.messages:,} records in {now() - started:.1f} s", flush=True)
            nsqd = f"{broker.address[0]}:{broker.address[1]}"
            started_setups = {name: start_setup(name, stack, workdir, nsqd, args) for name in setups}
            mine = [os.getpid(), broker.pid, *(p for setup in started_setups.values() for p in setup.roots)]
            for name, setup in started_setups.items():
                for _ in range(args.warmup):
                    warm = setup.run(args.timeout)
                    print(f"  {label(name)}: warm-up {warm['seconds']:.2f} s", flush=True)
            for rep in range(args.runs):
                for name in (setups if rep % 2 == 0 else setups[::-1]):
                    runs[name].append(timed_run(started_setups[name], mine, args))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print("| setup | median s | median rec/s | median triggerExecution ms | load average | others, cores |")
    print("|---|---:|---:|---:|---|---|")
    for name in setups:
        seconds = median(r["seconds"] for r in runs[name])
        loads = [r["load"] for r in runs[name]] or [0.0]
        others = [r["others"] for r in runs[name]] or [0.0]
        print(f"| {label(name)} | {fmt(seconds, '.2f')} | {fmt(args.messages / seconds if seconds else None)} "
              f"| {fmt(median(r['trigger_ms'] for r in runs[name]))} | {min(loads):.1f}-{max(loads):.1f} "
              f"| {min(others):.2f}-{max(others):.2f} |")
    if args.json:
        save_json(args.json, args, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
