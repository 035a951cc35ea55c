"""A broker session: the scenarios writer, reader and both, and the figures of one run.

Every scenario starts from a known channel state so repeated runs are
comparable: ``writer`` and ``both`` start with an empty channel (a leftover
backlog is drained first, untimed), ``reader`` starts with the backlog a
``writer`` run left (or fills one, untimed). The parent process only
orchestrates and samples /proc; all load comes from spawned children
(bench/harness/load.py).

The options of ``python -m bench writer|reader|both|all`` are defined here
too (``parse_args``): latency, flame and compare take them all and add their own.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import queue as queue_mod
import shlex
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from bench.harness import wire
from bench.harness.broker import (
    BenchError,
    Broker,
    BrokerError,
    Sampler,
    nsqd_option,
    running,
)
from bench.harness.load import ReaderConfig, WriterConfig, reader_main, writer_main
from bench.harness.report import fmt, median, percent, percentile

SCENARIOS = ("writer", "reader", "both")
DRAIN_IDLE = 2.0  # seconds without messages that end a drain / backlog read


@dataclass
class Result:
    """One scenario run; rates in msgs/s, latencies in ms, RSS in MB, CPU in % of a core.

    `wait_pct` is the time the broker was ready to run but waited for a
    CPU (the scheduler ran the load or another thread), in % of a core.
    """

    scenario: str
    msgs_in: int = 0
    rate_in: float | None = None
    msgs_out: int = 0
    rate_out: float | None = None
    lat_p50: float | None = None
    lat_p99: float | None = None
    ack_p50: float | None = None
    ack_p99: float | None = None
    rss_mb: float | None = None
    cpu_pct: float | None = None
    wait_pct: float | None = None
    seconds: float = 0.0


def median_result(runs: list[Result]) -> Result:
    """Median of each metric on its own, as NSQ's 'median of 3' figures are reported."""
    out = Result(runs[0].scenario)
    for f in fields(Result):
        if f.name == "scenario":
            continue
        value = median(getattr(r, f.name) for r in runs)
        if value is not None:
            setattr(out, f.name, int(value) if f.type in ("int", int) else value)
    return out


def result_line(r: Result, label: str) -> str:
    """The per-run line printed while the bench runs."""
    return (
        f"{label:<14} in {fmt(r.rate_in):>9} msgs/s  out {fmt(r.rate_out):>9} msgs/s  "
        f"lat p50/p99 {fmt(r.lat_p50, '.1f')}/{fmt(r.lat_p99, '.1f')} ms  "
        f"ack p50/p99 {fmt(r.ack_p50, '.2f')}/{fmt(r.ack_p99, '.2f')} ms  "
        f"rss {fmt(r.rss_mb)} MB  cpu {percent(r.cpu_pct)}  waited {percent(r.wait_pct)}  "
        f"({r.msgs_in:,} in / {r.msgs_out:,} out, {r.seconds:.1f} s)"
    )


class Session:
    """One broker, a sequence of scenarios, and the bookkeeping of its channel backlog."""

    def __init__(
        self,
        args: argparse.Namespace,
        address: tuple[str, int],
        sampler: Sampler | None,
        broker: Broker | None,
    ) -> None:
        self.args = args
        self.address = address
        self.sampler = sampler
        self.broker = broker
        self.ctx = mp.get_context("spawn")  # children never inherit the sampler thread
        self.backlog = 0

    def describe(self) -> str:
        """The broker as a report names it."""
        if self.broker is None:
            return f"external broker at {self.address[0]}:{self.address[1]}"
        return self.broker.describe()

    # -- process plumbing -------------------------------------------------

    def _check_broker(self) -> None:
        if self.broker is not None and not self.broker.alive():
            raise BrokerError(
                f"broker exited with {self.broker.proc.returncode}:\n{self.broker.log_tail()}"
            )

    def run_load(
        self, writers: list[WriterConfig], readers: list[ReaderConfig]
    ) -> tuple[list[dict], list[dict], float, float | None, float | None]:
        """Start all children, release them together, collect their results.

        Returns (writer results, reader results, wall seconds, peak RSS MB, CPU %).
        """
        self._check_broker()
        ctx = self.ctx
        q = ctx.Queue()
        start = ctx.Event()
        progress = ctx.Array("q", max(1, len(readers)), lock=False)
        procs = [
            ctx.Process(target=writer_main, args=(i, cfg, q, start), daemon=True)
            for i, cfg in enumerate(writers)
        ]
        procs += [
            ctx.Process(target=reader_main, args=(i, cfg, q, start, progress), daemon=True)
            for i, cfg in enumerate(readers)
        ]
        for p in procs:
            p.start()
        try:
            self._collect(q, procs, "ready", timeout=30.0)
            if self.sampler is not None:
                self.sampler.reset()
            t0 = time.monotonic()
            start.set()
            got = self._collect(q, procs, "result", timeout=self.args.timeout)
            seconds = time.monotonic() - t0
            rss, cpu = self.sampler.window() if self.sampler is not None else (None, None)
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.terminate()
                    p.join()
        wres = [got[f"w{i}"] for i in range(len(writers))]
        rres = [got[f"r{i}"] for i in range(len(readers))]
        return wres, rres, seconds, rss, cpu

    def _collect(self, q: Any, procs: list, kind: str, timeout: float) -> dict[str, Any]:
        """Wait for one ``kind`` message per child; any child error aborts the run."""
        want = len(procs)
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < want:
            if time.monotonic() > deadline:
                raise BenchError(f"children did not report {kind!r} within {timeout:.0f} s")
            try:
                msg_kind, index, data = q.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise BenchError(f"child process died (exit code {dead[0].exitcode})") from None
                self._check_broker()
                continue
            if msg_kind == "error":
                raise BenchError(data)
            if msg_kind == kind:
                got[index] = data
        return got

    # -- configurations ---------------------------------------------------

    def _writer_cfgs(self, total: int | None) -> list[WriterConfig]:
        a = self.args
        n = a.writers
        counts: list[int | None] = [None] * n
        if total is not None:
            counts = [total // n + (1 if i < total % n else 0) for i in range(n)]
        return [
            WriterConfig(
                address=self.address,
                topic=a.topic,
                size=a.size,
                batch=1 if a.mode == "pub" else a.batch,
                mode=a.mode,
                pipeline=a.pipeline,
                duration=a.duration,
                count=c,
            )
            for c in counts
        ]

    def _reader_cfgs(
        self, duration: float | None, expected: int | None, idle: float | None
    ) -> list[ReaderConfig]:
        a = self.args
        return [
            ReaderConfig(
                address=self.address,
                topic=a.topic,
                channel=a.channel,
                rdy=a.rdy,
                duration=duration,
                expected=expected,
                idle_timeout=idle,
                sample_every=a.sample_every,
                client_id=f"bench-{i}",
            )
            for i in range(a.readers)
        ]

    # -- aggregation -----------------------------------------------------

    @staticmethod
    def _rate(results: list[dict]) -> tuple[int, float | None]:
        msgs = sum(r["messages"] for r in results)
        if not results or not msgs:
            return msgs, None
        span = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
        return msgs, (msgs / span if span > 0 else None)

    @staticmethod
    def _latencies(results: list[dict], key: str, scale: float) -> tuple[float | None, ...]:
        values: list[float] = []
        for r in results:
            arr = array("q" if key == "latency_ns" else "I")
            arr.frombytes(r[key])
            values.extend(v / scale for v in arr)
        values.sort()
        return percentile(values, 0.50), percentile(values, 0.99)

    def result(
        self, name: str, wres: list[dict], rres: list[dict], seconds: float, rss: Any, cpu: Any
    ) -> Result:
        msgs_in, rate_in = self._rate(wres)
        msgs_out, rate_out = self._rate(rres)
        lat50, lat99 = self._latencies(rres, "latency_ns", 1e6)
        ack50, ack99 = self._latencies(wres, "ack_us", 1e3)
        fin_errors = sum(r["fin_errors"] for r in rres)
        if fin_errors:
            print(f"  warning: {fin_errors} E_FIN_FAILED errors", flush=True)
        return Result(
            scenario=name,
            msgs_in=msgs_in,
            rate_in=rate_in,
            msgs_out=msgs_out,
            rate_out=rate_out,
            lat_p50=lat50,
            lat_p99=lat99,
            ack_p50=ack50,
            ack_p99=ack99,
            rss_mb=rss,
            cpu_pct=cpu,
            wait_pct=self.sampler.wait_pct if self.sampler is not None else None,
            seconds=seconds,
        )

    # -- untimed helpers -----------------------------------------------------

    def drain(self, idle: float = DRAIN_IDLE) -> int:
        """Empty the channel so the next scenario starts clean; not part of any figure."""
        expected = self.backlog or None
        t0 = time.monotonic()
        _, rres, _, _, _ = self.run_load([], self._reader_cfgs(None, expected, idle))
        consumed = sum(r["messages"] + r["late"] for r in rres)
        took = time.monotonic() - t0
        print(f"  (drain: {consumed:,} msgs in {took:.1f} s)", flush=True)
        if expected and consumed < expected:
            print(
                f"  warning: expected {expected:,} messages in the channel, "
                f"got {consumed:,} before {idle:.0f} s of silence",
                flush=True,
            )
        self.backlog = 0
        return consumed

    def fill(self) -> None:
        """Give a lone ``reader`` scenario a backlog, the same way ``writer`` would."""
        wres, _, seconds, _, _ = self.run_load(self._writer_cfgs(self.args.count), [])
        msgs = sum(r["messages"] for r in wres)
        self.backlog += msgs
        print(f"  (fill: {msgs:,} msgs in {seconds:.1f} s)", flush=True)

    # -- scenarios ---------------------------------------------------------

    def writer(self) -> Result:
        if self.backlog:
            self.drain()
        wres, rres, seconds, rss, cpu = self.run_load(self._writer_cfgs(self.args.count), [])
        res = self.result("writer", wres, rres, seconds, rss, cpu)
        self.backlog += res.msgs_in
        return res

    def reader(self) -> Result:
        if not self.backlog:
            self.fill()
        duration = None if self.args.count is not None else self.args.duration
        cfgs = self._reader_cfgs(duration, self.backlog, DRAIN_IDLE)
        wres, rres, seconds, rss, cpu = self.run_load([], cfgs)
        res = self.result("reader", wres, rres, seconds, rss, cpu)
        self.backlog = max(0, self.backlog - sum(r["messages"] + r["late"] for r in rres))
        return res

    def both(self) -> Result:
        if self.backlog:
            self.drain()
        a = self.args
        if a.count is not None:
            rcfgs = self._reader_cfgs(None, a.count, DRAIN_IDLE)
        else:
            rcfgs = self._reader_cfgs(a.duration, None, None)
        wres, rres, seconds, rss, cpu = self.run_load(self._writer_cfgs(a.count), rcfgs)
        res = self.result("both", wres, rres, seconds, rss, cpu)
        consumed = sum(r["messages"] + r["late"] for r in rres)
        self.backlog = max(0, self.backlog + res.msgs_in - consumed)
        return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of ``python -m bench writer|reader|both|all`` (first: the scenario)."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Load generator for mqd under NSQ's benchmark conditions.",
        epilog="Broker flags that start with '-' need the '=' form: --broker-arg=--sync-every=1",
    )
    p.add_argument("scenario", nargs="?", default="all", choices=(*SCENARIOS, "all"))
    p.add_argument("--backend", default="memory", help="broker --backend (memory, lmdb, ...)")
    p.add_argument("--mem-queue-size", type=int, default=1_000_000)
    p.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra broker flag, repeatable",
    )
    p.add_argument(
        "--nsqd-address",
        metavar="HOST:PORT",
        help="bench an already running broker instead of starting one",
    )
    p.add_argument(
        "--broker-cmd",
        metavar="CMD",
        help="start this command instead of twistd mqd (e.g. a real nsqd, for reference "
        "figures); it must log 'TCP: listening on HOST:PORT'; {data} becomes a fresh data dir",
    )
    p.add_argument(
        "--nsqd-bin",
        metavar="PATH",
        help="start a real nsqd (its binary, or the directory of NSQ's binaries) instead of "
        "twistd mqd, with --mem-queue-size and --broker-arg: reference figures",
    )
    p.add_argument("--pid", type=int, help="pid of that broker, to measure its RSS and CPU")
    p.add_argument("--size", type=int, default=200, help="message body bytes")
    p.add_argument("--batch", type=int, default=100, help="messages per MPUB")
    p.add_argument("--mode", choices=("mpub", "pub"), default="mpub")
    p.add_argument("--pipeline", type=int, default=1, help="commands each writer keeps outstanding")
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--rdy", type=int, default=2500)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    p.add_argument(
        "--count",
        type=int,
        help="publish exactly this many messages (all writers) instead of timing",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs per scenario; median reported")
    p.add_argument("--topic", default="bench")
    p.add_argument("--channel", default="ch")
    p.add_argument(
        "--sample-every",
        type=int,
        default=100,
        help="readers sample latency from every Nth message",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="abort a run whose children have not finished after this many seconds",
    )
    p.add_argument("--keep-data", action="store_true", help="keep the broker's data dir and log")
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    args = p.parse_args(argv)
    if args.pid and not args.nsqd_address:
        p.error("--pid only makes sense with --nsqd-address")
    if sum(map(bool, (args.broker_cmd, args.nsqd_address, args.nsqd_bin))) > 1:
        p.error("--broker-cmd, --nsqd-bin and --nsqd-address exclude each other")
    if args.nsqd_bin:
        args.broker_cmd = shlex.join(nsqd_option(p, args.nsqd_bin, args.mem_queue_size))
    if args.writers < 1 or args.readers < 1 or args.repeat < 1 or args.pipeline < 1:
        p.error("--writers, --readers, --repeat and --pipeline must be at least 1")
    if args.size < 8:
        p.error("--size must be at least 8: bodies carry an 8-byte timestamp")
    return args


def load_line(args: argparse.Namespace) -> str:
    """The load of a run in words: writers, readers, sizes, how long."""
    return (
        f"{args.writers} writers ({args.mode.upper()}"
        + (f" x{args.batch}" if args.mode == "mpub" else "")
        + f", {args.size} B bodies, pipeline {args.pipeline}), "
        f"{args.readers} readers (RDY {args.rdy}), "
        + (f"{args.count:,} msgs" if args.count is not None else f"{args.duration:g} s runs")
    )


@contextlib.contextmanager
def open_session(
    args: argparse.Namespace,
    cls: type[Session] = Session,
    argv: list[str] | None = None,
    verbose: bool = True,
) -> Iterator[Session]:
    """A Session on the broker ``args`` name, with the bench topic and channel created.

    ``--nsqd-address`` (and ``--pid`` to sample it) uses a running broker,
    drained of unknown leftovers first; otherwise the broker is started here
    (``argv``, else ``--broker-cmd``, else twistd mqd with ``--backend`` and
    ``--broker-arg``) and stopped when the block ends.
    """
    if getattr(args, "nsqd_address", None):
        address = wire.parse_address(args.nsqd_address)
        sampler = Sampler(args.pid).start() if args.pid else None
        try:
            wire.create_topic_channel(address, args.topic, args.channel)
            session = cls(args, address, sampler, None)
            session.drain(idle=1.0)
            yield session
        finally:
            if sampler is not None:
                sampler.stop()
        return
    if argv is None and args.broker_cmd:
        argv = shlex.split(args.broker_cmd) + args.broker_arg
    broker = Broker(
        args.backend, args.mem_queue_size, args.broker_arg, argv=argv, keep=args.keep_data
    )
    with running(broker, verbose) as sampler:
        assert broker.address is not None
        wire.create_topic_channel(broker.address, args.topic, args.channel)
        yield cls(args, broker.address, sampler, broker)
