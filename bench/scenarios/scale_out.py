"""``python -m bench scale-out``: N brokers on one host behind mqlookupd, one core each.

A broker runs on one core (one Twisted reactor), so a host is scaled out the
way nsqd is: one broker per core, all registered with a lookup daemon, and
consumers that find them through it. This measures what that gives on this
machine. One ``twistd mqlookupd`` runs for the whole command; for each
``--brokers`` count N, N fresh memory-backend brokers start with
``--lookupd-tcp-address`` pointing at it, broker i pinned with ``taskset -c``
to core i mod (the cores this process may use) unless ``--no-pin``. The
topic and channel are created on every broker, then the consumers discover
the brokers as a lookupd consumer does: ``GET /lookup?topic=...`` on the
lookupd's HTTP port, until it lists exactly the brokers started. Then the
standard ``both`` load runs for ``--duration`` seconds: bench's publisher
processes (MPUB x100 of 200 B bodies) spread round robin over the brokers
(each publisher picks a broker, as behind a load balancer), bench's consumer
processes spread round robin over the producers the lookup listed. The
writer and reader counts are the same for every N, so only the number of
brokers changes.

Each repetition runs every N in turn, in alternating order (1 2, 2 1, ...)
so that drifting machine load does not favour one N; medians are reported
with each broker's CPU (from /proc) and the CPU of the load processes
themselves: on a machine with few cores the publishers and consumers share
the cores with the brokers, and the table shows how much of the host they
took.

```sh
python -m bench scale-out --brokers 1 2 4 --duration 10 --repeat 3
```
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from bench.harness.broker import (
    BenchError,
    Broker,
    BrokerError,
    Sampler,
    broker_command,
    lookupd_command,
    read_proc,
    running,
)
from bench.harness.load import ReaderConfig, WriterConfig
from bench.harness.report import fmt, heading, load_average, median, percent, ratio, save_json
from bench.harness.session import Session, load_line
from bench.harness.wire import create_topic_channel, parse_address
from mqd.client.discovery import LookupdError, producer_addresses

# What nsq's clients send so that a lookupd answers the flat document.
LOOKUP_ACCEPT = "application/vnd.nsq; version=1.0"
DISCOVER_TIMEOUT = 15.0  # seconds for the lookupd to list exactly the brokers started

Address = tuple[str, int]


# -- pure helpers (unit-tested) ------------------------------------------------------------


def available_cores() -> list[int]:
    """The cores this process may run on, in order: what brokers are pinned to."""
    return sorted(os.sched_getaffinity(0))


def assign_cores(n: int, cores: list[int]) -> list[int]:
    """Broker i's core: ``cores[i mod len(cores)]`` (more brokers than cores share them)."""
    if not cores:
        raise ValueError("no cores to pin to")
    return [cores[i % len(cores)] for i in range(n)]


def spread(count: int, targets: list[Address]) -> list[Address]:
    """The target of each of ``count`` load processes: round robin over ``targets``."""
    if not targets:
        raise ValueError("nothing to spread the load over")
    return [targets[i % len(targets)] for i in range(count)]


def lookup_producers(document: Any) -> list[Address]:
    """The ``(broadcast_address, tcp_port)`` of every producer in a ``/lookup`` answer, sorted.

    Read as txnsq reads it (either of nsqlookupd's answer shapes; a row
    without an address or a port is skipped: a consumer has nothing to
    connect to). Raises BenchError for a document that is not a lookup
    answer at all.
    """
    try:
        addresses = producer_addresses(document)
    except LookupdError as e:
        raise BenchError(f"/lookup: {e}") from None
    return sorted(parse_address(address) for address in addresses)


def per_broker_core(rate: float | None, broker_cpu: list[float]) -> float | None:
    """msgs/s per core the brokers actually had: ``rate`` / (their CPU together, in cores).

    Where the load processes share the cores, N brokers get less than N
    cores; this is what each full core gave, so N's figure can be told apart
    from the machine running out of cores.
    """
    cores = sum(broker_cpu) / 100.0
    if rate is None or cores <= 0:
        return None
    return rate / cores


def run_order(counts: list[int], repetition: int) -> list[int]:
    """The broker counts of one repetition: as given, reversed every other time."""
    return list(counts) if repetition % 2 == 0 else list(reversed(counts))


# -- measurement ------------------------------------------------------------------------------


@dataclass
class Run:
    """One ``both`` run with N brokers; rates in msgs/s, CPU in % of one core."""

    brokers: int
    msgs_in: int = 0
    rate_in: float | None = None
    msgs_out: int = 0
    rate_out: float | None = None
    broker_cpu: list[float] = field(default_factory=list)  # one per broker, in start order
    broker_rss_mb: list[float] = field(default_factory=list)
    load_cpu: float | None = None  # the writer and reader processes together
    machine_cpu: float | None = None  # every process on the machine (/proc/stat), ours or not
    lat_p50: float | None = None
    lat_p99: float | None = None
    seconds: float = 0.0
    cores: list[int] = field(default_factory=list)  # broker i's core; empty when not pinned
    load_avg: float = 0.0  # 1-minute load average just before the run


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores so far, from /proc/stat: every process, ours or not."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return (total - idle) / tick, total / tick


def busy_percent(before: tuple[float, float], after: tuple[float, float], ncores: int) -> float | None:
    """The machine's busy time between two ``machine_busy`` readings, in % of one core."""
    total = after[1] - before[1]
    if total <= 0:
        return None
    return 100.0 * ncores * (after[0] - before[0]) / total


def _cpu_seconds(pid: int) -> float:
    got = read_proc(pid)
    return got[2] if got is not None else 0.0


class HostSampler:
    """Per-broker CPU and RSS, and the CPU the load processes spent, over one timed window.

    Session._run resets it once every load process is connected and waiting,
    and reads ``window()`` when they have all reported. The load processes'
    CPU is what they had spent when reaped (``children_cpu`` before and after
    the run) less what each had spent when the window began (read from /proc
    at reset), so their start-up is not counted. ``machine`` is every
    process on the host over the window, from /proc/stat: what else ran.
    """

    def __init__(self, samplers: list[Sampler]) -> None:
        self.samplers = samplers
        self.per_broker: list[tuple[float, float]] = []
        self.load_before = 0.0
        self.machine: float | None = None
        self._machine0 = machine_busy()

    def reset(self) -> None:
        for s in self.samplers:
            s.reset()
        self.load_before = sum(_cpu_seconds(p.pid) for p in mp.active_children() if p.pid)
        self._machine0 = machine_busy()

    def window(self) -> tuple[float, float]:
        """(largest broker peak RSS MB, CPU % of all brokers together); per broker in ``per_broker``."""
        self.machine = busy_percent(self._machine0, machine_busy(), os.cpu_count() or 1)
        self.per_broker = [s.window() for s in self.samplers]
        return max(r for r, _ in self.per_broker), sum(c for _, c in self.per_broker)


def children_cpu() -> float:
    """CPU seconds of every reaped child of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class ScaleSession(Session):
    """Session's process plumbing (spawn, release together, collect) over many brokers."""

    def __init__(self, args: argparse.Namespace, brokers: list[Broker], lookupd: Broker,
                 sampler: HostSampler) -> None:
        super().__init__(args, brokers[0].address or ("", 0), None, None)
        self.sampler = sampler  # type: ignore[assignment]  # reset() and window(), as Sampler
        self.brokers = brokers
        self.lookupd = lookupd

    def _check_broker(self) -> None:
        for daemon in (self.lookupd, *self.brokers):
            if not daemon.alive():
                code = daemon.proc.returncode if daemon.proc is not None else None
                raise BrokerError(f"{daemon.describe()} exited with {code}:\n{daemon.log_tail()}")


def broker_argv(args: argparse.Namespace, lookupd_tcp: Address, core: int | None) -> list[str]:
    """One broker's command line: twistd mqd registering with the lookupd, pinned to ``core``."""
    extra = [f"--lookupd-tcp-address={lookupd_tcp[0]}:{lookupd_tcp[1]}",
             "--broadcast-address=127.0.0.1", *args.broker_arg]
    argv = broker_command(args.backend, args.mem_queue_size, "{data}", extra)
    if core is not None:
        argv = ["taskset", "-c", str(core), *argv]
    return argv


def lookup(http_address: str, topic: str, timeout: float = 5.0) -> list[Address]:
    """The producers of ``topic`` that the lookupd lists (a 404 is none yet)."""
    host, port = parse_address(http_address)
    url = f"http://{host}:{port}/lookup?topic={topic}"
    req = urllib.request.Request(url, headers={"Accept": LOOKUP_ACCEPT})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise BenchError(f"/lookup?topic={topic}: not JSON: {body[:200]!r}") from exc
    return lookup_producers(document)


def discover(http_address: str, topic: str, expected: set[Address],
             timeout: float = DISCOVER_TIMEOUT) -> list[Address]:
    """Poll ``/lookup`` until it lists exactly ``expected`` (brokers register, and leave, asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        found = lookup(http_address, topic)
        if set(found) == expected:
            return found
        if time.monotonic() > deadline:
            raise BenchError(f"mqlookupd lists {found} for topic {topic!r} after {timeout:.0f} s, "
                             f"expected {sorted(expected)}")
        time.sleep(0.1)


def measure(args: argparse.Namespace, lookupd: Broker, n: int, cores: list[int] | None) -> Run:
    """Start N brokers, let the readers discover them, run ``both``, stop the brokers."""
    assert lookupd.address is not None and lookupd.http_address is not None
    pins: list[int | None] = list(assign_cores(n, cores)) if cores else [None] * n
    brokers = [Broker(argv=broker_argv(args, lookupd.address, core), startup_timeout=30)
               for core in pins]
    run = Run(n, cores=[c for c in pins if c is not None], load_avg=load_average())
    with contextlib.ExitStack() as stack:
        samplers = [stack.enter_context(running(b, verbose=False)) for b in brokers]
        addresses = [b.address for b in brokers if b.address is not None]
        for address in addresses:
            create_topic_channel(address, args.topic, args.channel)
        producers = discover(lookupd.http_address, args.topic, set(addresses))

        a = args
        writers = [WriterConfig(address=address, topic=a.topic, size=a.size, batch=a.batch,
                                mode="mpub", pipeline=a.pipeline, duration=a.duration)
                   for address in spread(a.writers, addresses)]
        readers = [ReaderConfig(address=address, topic=a.topic, channel=a.channel, rdy=a.rdy,
                                duration=a.duration, sample_every=a.sample_every,
                                client_id=f"bench-{i}")
                   for i, address in enumerate(spread(a.readers, producers))]
        host = HostSampler(samplers)
        session = ScaleSession(args, brokers, lookupd, host)
        cpu0 = children_cpu()
        wres, rres, seconds, _, _ = session.run_load(writers, readers)
        load_cpu = children_cpu() - cpu0 - host.load_before
        res = session.result("both", wres, rres, seconds, None, None)
    run.msgs_in, run.rate_in = res.msgs_in, res.rate_in
    run.msgs_out, run.rate_out = res.msgs_out, res.rate_out
    run.lat_p50, run.lat_p99 = res.lat_p50, res.lat_p99
    run.seconds = seconds
    run.broker_rss_mb = [r for r, _ in host.per_broker]
    run.broker_cpu = [c for _, c in host.per_broker]
    run.load_cpu = 100.0 * load_cpu / seconds if seconds > 0 else None
    run.machine_cpu = host.machine
    return run


# -- report ------------------------------------------------------------------------------------


@dataclass
class Row:
    """The medians of one broker count over its repetitions."""

    brokers: int
    rate_in: float | None
    rate_out: float | None
    broker_cpu: list[float]  # median per broker position
    load_cpu: float | None
    machine_cpu: float | None
    out_per_core: float | None  # msgs/s out per core of broker CPU
    lat_p50: float | None
    lat_p99: float | None
    runs: int


def summarize(runs: list[Run]) -> list[Row]:
    """One row per broker count, in increasing order: each figure's median on its own."""
    rows = []
    for n in sorted({r.brokers for r in runs}):
        mine = [r for r in runs if r.brokers == n]
        per_broker = [statistics.median(r.broker_cpu[i] for r in mine if len(r.broker_cpu) > i)
                      for i in range(min(len(r.broker_cpu) for r in mine))]
        rows.append(Row(
            brokers=n,
            rate_in=median([r.rate_in for r in mine]),
            rate_out=median([r.rate_out for r in mine]),
            broker_cpu=per_broker,
            load_cpu=median([r.load_cpu for r in mine]),
            machine_cpu=median([r.machine_cpu for r in mine]),
            out_per_core=median([per_broker_core(r.rate_out, r.broker_cpu) for r in mine]),
            lat_p50=median([r.lat_p50 for r in mine]),
            lat_p99=median([r.lat_p99 for r in mine]),
            runs=len(mine),
        ))
    return rows


def broker_cpu_text(values: list[float]) -> str:
    """``97%`` for one broker; ``96% (95-97%)``: the mean, then the least and most busy."""
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return percent(mean)
    return f"{percent(mean)} ({min(values):.0f}-{max(values):.0f}%)"


def base_row(rows: list[Row]) -> Row | None:
    """The row the others are divided by: one broker if measured, else the fewest."""
    if not rows:
        return None
    return next((r for r in rows if r.brokers == 1), rows[0])


def ours_cpu(row: Row) -> float | None:
    """Brokers and load processes together, in % of one core."""
    if row.load_cpu is None:
        return None
    return sum(row.broker_cpu) + row.load_cpu


def table(rows: list[Row], args: argparse.Namespace, ncores: int, broker_desc: str,
          load_before: float, load_after: float) -> str:
    """The Markdown report: heading, conditions, one row per broker count."""
    base = base_row(rows)
    base_label = f"÷ {base.brokers} broker{'s' if base and base.brokers != 1 else ''}" if base else "÷"
    pinning = "not pinned" if args.no_pin else "broker i pinned to core i mod the cores available"
    lines = [
        heading("mqd scale-out", f"load average {load_before:.2f} before, {load_after:.2f} after"),
        "",
        f"- brokers: `{broker_desc}`, {pinning}; one `twistd mqlookupd`",
        f"- load: {load_line(args)}; writers spread over the brokers, readers over the "
        f"producers `/lookup` lists; median of {args.repeat}, broker counts in alternating order",
        f"- CPU in % of one core ({ncores} cores: {ncores * 100}% in all); per-broker: the mean "
        "(least-most busy broker); load: the writer and reader processes, which share the cores "
        "with the brokers; machine: every process on the host during the run (/proc/stat); "
        "out per broker core: msgs/s out over the brokers' CPU together, in cores",
        "",
        f"| brokers | in msgs/s | out msgs/s | per-broker CPU | load CPU | brokers + load "
        f"| machine CPU | out per broker core | latency p50 / p99 (ms) | {base_label} (in / out) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        r_in = ratio(base.rate_in, row.rate_in) if base else None
        r_out = ratio(base.rate_out, row.rate_out) if base else None
        lines.append(
            f"| {row.brokers} | {fmt(row.rate_in)} | {fmt(row.rate_out)} "
            f"| {broker_cpu_text(row.broker_cpu)} | {percent(row.load_cpu)} "
            f"| {percent(ours_cpu(row))} | {percent(row.machine_cpu)} | {fmt(row.out_per_core)} "
            f"| {fmt(row.lat_p50, '.1f')} / {fmt(row.lat_p99, '.1f')} "
            f"| {fmt(r_in, '.2f')} / {fmt(r_out, '.2f')} |"
        )
    return "\n".join(lines)


def run_line(run: Run, label: str) -> str:
    """The line printed after each run."""
    cores = f" on cores {','.join(map(str, run.cores))}" if run.cores else ""
    return (
        f"{label:<16} in {fmt(run.rate_in):>9} msgs/s  out {fmt(run.rate_out):>9} msgs/s  "
        f"broker CPU {' '.join(percent(c) for c in run.broker_cpu)}{cores}  "
        f"load CPU {percent(run.load_cpu)}  machine {percent(run.machine_cpu)}  "
        f"lat p50/p99 {fmt(run.lat_p50, '.1f')}/{fmt(run.lat_p99, '.1f')} ms  "
        f"({run.msgs_in:,} in / {run.msgs_out:,} out, {run.seconds:.1f} s, load avg {run.load_avg:.2f})"
    )


# -- command line ------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench scale-out",
        description=__doc__.split("\n\n")[0],
        epilog="Broker flags that start with '-' need the '=' form: --broker-arg=--max-rdy-count=5000",
    )
    p.add_argument("--brokers", type=int, nargs="+", default=[1, 2],
                   help="broker counts, one run each per repetition (default 1 2)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run (default 10)")
    p.add_argument("--repeat", type=int, default=3, help="runs per broker count; median (default 3)")
    p.add_argument("--writers", type=int,
                   help="publisher processes in all, the same for every N (default: the largest N, "
                        "at least 2)")
    p.add_argument("--readers", type=int,
                   help="consumer processes in all, the same for every N (default: the largest N, "
                        "at least 2)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the brokers to cores")
    p.add_argument("--backend", default="memory", help="broker --backend (default memory)")
    p.add_argument("--mem-queue-size", type=int, default=1_000_000)
    p.add_argument("--broker-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for every broker, repeatable")
    p.add_argument("--size", type=int, default=200, help="message body bytes (default 200)")
    p.add_argument("--batch", type=int, default=100, help="messages per MPUB (default 100)")
    p.add_argument("--pipeline", type=int, default=1, help="MPUBs each writer keeps outstanding")
    p.add_argument("--rdy", type=int, default=2500)
    p.add_argument("--topic", default="bench")
    p.add_argument("--channel", default="ch")
    p.add_argument("--sample-every", type=int, default=100,
                   help="readers sample latency from every Nth message")
    p.add_argument("--timeout", type=float,
                   help="abort a run whose load has not finished after this many seconds "
                        "(default: --duration + 60)")
    p.add_argument("--json", metavar="PATH", help="also save every run as JSON")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.brokers):
        p.error("--brokers: every count must be at least 1")
    args.brokers = list(dict.fromkeys(args.brokers))  # once each, in the order given
    most = max(args.brokers)
    args.writers = args.writers if args.writers is not None else max(2, most)
    args.readers = args.readers if args.readers is not None else max(2, most)
    if args.writers < most or args.readers < most:
        p.error(f"--writers and --readers must be at least {most}, the largest --brokers: "
                "every broker needs a publisher and a consumer")
    if args.repeat < 1 or args.pipeline < 1 or args.batch < 1 or args.duration <= 0:
        p.error("--repeat, --pipeline and --batch must be at least 1, --duration above 0")
    if args.size < 8:
        p.error("--size must be at least 8: bodies carry an 8-byte timestamp")
    if not args.no_pin and shutil.which("taskset") is None:
        p.error("taskset (util-linux) is not installed: install it or pass --no-pin")
    if args.timeout is None:
        args.timeout = args.duration + 60.0
    # What load_line and Session read: the standard load is MPUB, timed.
    args.mode = "mpub"
    args.count = None
    return args


def uneven(args: argparse.Namespace) -> list[str]:
    """Warnings for broker counts the writers or readers do not divide evenly."""
    out = []
    for n in args.brokers:
        for what, count in (("writers", args.writers), ("readers", args.readers)):
            if count % n:
                out.append(f"note: {count} {what} over {n} brokers: "
                           f"{math.ceil(count / n)} on some, {count // n} on others")
    return out


def main(argv: list[str]) -> int:
    args = parse(argv)
    cores = None if args.no_pin else available_cores()
    ncores = len(available_cores())
    for note in uneven(args):
        print(note, flush=True)
    load_before = load_average()
    print(f"load average {load_before:.2f} on {ncores} cores", flush=True)
    runs: list[Run] = []
    lookupd = Broker(argv=lookupd_command(), startup_timeout=30)
    with running(lookupd, verbose=False):
        if lookupd.http_address is None:
            raise BrokerError(f"mqlookupd logged no HTTP address:\n{lookupd.log_tail()}")
        assert lookupd.address is not None
        print(f"mqlookupd pid {lookupd.pid}: TCP {lookupd.address[0]}:{lookupd.address[1]}, "
              f"HTTP {lookupd.http_address}", flush=True)
        for rep in range(args.repeat):
            for n in run_order(args.brokers, rep):
                run = measure(args, lookupd, n, cores)
                runs.append(run)
                print(run_line(run, f"{n} broker{'s' if n != 1 else ''} {rep + 1}/{args.repeat}"),
                      flush=True)
    load_after = load_average()
    rows = summarize(runs)
    desc = " ".join(a for a in broker_argv(args, ("127.0.0.1", 0), None)[4:]
                    if not a.startswith(("--tcp-address", "--http-address", "--data-path",
                                         "--lookupd-tcp-address")))
    print()
    print(table(rows, args, ncores, f"twistd -n mqd {desc}", load_before, load_after))
    if args.json:
        save_json(args.json, args, runs=runs, medians=rows)
    return 0
