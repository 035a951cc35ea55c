"""NSQ's own load generators, ``bench_writer`` and ``bench_reader``, as the load of a Session.

nsqd's published figures come from these two programs, so running them
against mqd too gives figures taken exactly as nsqd's were, beside ours from
bench/harness/load.py. Each program opens one connection per core
(GOMAXPROCS), runs for ``--runfor`` and prints one line,
``duration: 8.0001s - 221.160mb/s - 1159517.399ops/s - 0.862us/op``, on
stderr; the rate is read from it. ``bench_writer`` sends MPUBs of
``--batch-size`` bodies and waits for each ``OK``; ``bench_reader`` sends
``RDY --rdy`` and FINs every message.

With several channels, one ``bench_reader`` per channel runs at once and the
rate out is their sum: the fan-out test (each message is delivered once per
channel). All programs of a run are given the same ``--deadline`` (a whole
UTC second a moment ahead), so they connect first and start together.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from bench.harness import wire
from bench.harness.broker import BenchError, Broker, Sampler
from bench.harness.session import Result, Session

_LINE = re.compile(r"duration: (\S+) - [0-9.]+mb/s - ([0-9.]+)ops/s")
_GO_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?)(h|ms|m|s|µs|us|ns)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
LEAD = 1.5  # seconds the programs get to start and connect before the common deadline
WRITER = "bench_writer"
READER = "bench_reader"


@dataclass(frozen=True)
class ToolRate:
    """What one run of bench_writer or bench_reader reported."""

    seconds: float
    rate: float

    @property
    def messages(self) -> int:
        return round(self.seconds * self.rate)


def go_duration(text: str) -> float:
    """Seconds of a Go ``time.Duration`` string (``8.000512s``, ``1m0.5s``, ``950ms``)."""
    parts = _GO_DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Go duration: {text!r}")
    return sum(float(n) * _UNIT[u] for n, u in parts)


def parse_tool_output(text: str, tool: str = "bench tool") -> ToolRate:
    """The last ``duration: ... ops/s`` line of a bench_writer / bench_reader output."""
    found = _LINE.findall(text)
    if not found:
        tail = "\n".join(text.splitlines()[-10:]) or "(no output)"
        raise BenchError(f"{tool} printed no 'duration: ... ops/s' line:\n{tail}")
    duration, rate = found[-1]
    return ToolRate(go_duration(duration), float(rate))


def deadline_after(lead: float, now: float | None = None) -> tuple[str, float]:
    """A ``--deadline`` value (UTC, whole seconds) at least ``lead`` s ahead, and its epoch time.

    The programs parse it with Go's ``time.Parse``, which reads a time without
    a zone as UTC.
    """
    at = math.ceil((time.time() if now is None else now) + lead)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)), float(at)


def channel_names(channel: str, count: int) -> list[str]:
    """``count`` channels of the bench topic: the usual one, then ``ch1``, ``ch2``, ..."""
    return [channel] + [f"{channel}{i}" for i in range(1, count)]


def writer_argv(
    tool: str, address: tuple[str, int], topic: str, size: int, batch: int, seconds: float,
    deadline: str,
) -> list[str]:
    return [
        tool,
        f"--nsqd-tcp-address={address[0]}:{address[1]}",
        f"--topic={topic}",
        f"--size={size}",
        f"--batch-size={batch}",
        f"--runfor={seconds:g}s",
        f"--deadline={deadline}",
    ]


def reader_argv(
    tool: str, address: tuple[str, int], topic: str, channel: str, size: int, rdy: int,
    seconds: float, deadline: str,
) -> list[str]:
    return [
        tool,
        f"--nsqd-tcp-address={address[0]}:{address[1]}",
        f"--topic={topic}",
        f"--channel={channel}",
        f"--size={size}",
        f"--rdy={rdy}",
        f"--runfor={seconds:g}s",
        f"--deadline={deadline}",
    ]


def run_tools(
    argvs: list[list[str]],
    start_at: float,
    timeout: float,
    on_start: Callable[[], None] = lambda: None,
    check: Callable[[], None] = lambda: None,
) -> tuple[list[ToolRate], float]:
    """Run the programs (all given the deadline ``start_at``) and read their rates.

    ``on_start`` is called at the deadline (the sampler's window starts
    there), ``check`` every 0.2 s (it raises when the broker died). Returns
    the rates in ``argvs`` order and the seconds from the deadline to the
    last exit. A program that fails or prints no rate raises BenchError.
    """
    outputs: list[IO[bytes]] = []
    procs: list[subprocess.Popen] = []
    try:
        for argv in argvs:
            out = tempfile.TemporaryFile()
            outputs.append(out)
            procs.append(
                subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            )
        time.sleep(max(0.0, start_at - time.time()))
        on_start()
        t0 = time.monotonic()
        while any(p.poll() is None for p in procs):
            if time.monotonic() - t0 > timeout:
                raise BenchError(f"{len(procs)} NSQ bench programs still running after {timeout:.0f} s")
            check()
            time.sleep(0.2)
        seconds = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rates = []
    for argv, proc, out in zip(argvs, procs, outputs, strict=True):
        out.seek(0)
        text = out.read().decode(errors="replace")
        out.close()
        name = os.path.basename(argv[0])
        if proc.returncode:
            tail = "\n".join(text.splitlines()[-10:])
            raise BenchError(f"{name} exited with {proc.returncode}:\n{tail}")
        rates.append(parse_tool_output(text, name))
    return rates, seconds


class NsqToolSession(Session):
    """A Session whose writer, reader and both scenarios run bench_writer and bench_reader.

    Every ``writer`` and ``both`` starts from an empty topic: the topic is
    deleted and created again with its channels (``/topic/delete``,
    ``/topic/create``, ``/channel/create``). A broker without HTTP (the probe)
    gets a fresh topic name instead, created by SUB + CLS per channel; the old
    backlog stays in it until the broker is stopped. ``reader`` drains the
    backlog the preceding ``writer`` left, one bench_reader per channel, for
    ``--duration`` (a backlog filled untimed by bench_writer when there is none).
    """

    def __init__(
        self,
        args: argparse.Namespace,
        address: tuple[str, int],
        sampler: Sampler | None,
        broker: Broker | None,
    ) -> None:
        super().__init__(args, address, sampler, broker)
        self.topic = args.topic
        self.channels = channel_names(args.channel, args.channels)
        self.generation = 0
        self.state = "new"  # new: channels not all made; empty; backlog; used (a leftover)

    @property
    def http_address(self) -> str | None:
        return self.broker.http_address if self.broker is not None else None

    def _fresh_topic(self) -> None:
        """An empty bench topic with every channel, as the scenario starts."""
        http = self.http_address
        if http is not None:
            if self.state != "new":
                wire.http_request(http, "/topic/delete", "POST", topic=self.topic)
            wire.http_create(http, self.topic, *self.channels)
        else:
            if self.state != "new":
                self.generation += 1
                self.topic = f"{self.args.topic}_{self.generation}"
            for channel in self.channels:
                wire.create_topic_channel(self.address, self.topic, channel)
        self.state = "empty"
        self.backlog = 0

    def _tools(
        self, writer: bool, readers: bool, seconds: float
    ) -> tuple[ToolRate | None, list[ToolRate], float, float | None, float | None]:
        a = self.args
        deadline, start_at = deadline_after(LEAD)
        argvs = []
        if writer:
            argvs.append(
                writer_argv(a.bench_writer, self.address, self.topic, a.size, a.batch, seconds,
                            deadline)
            )
        if readers:
            argvs += [
                reader_argv(a.bench_reader, self.address, self.topic, ch, a.size, a.rdy, seconds,
                            deadline)
                for ch in self.channels
            ]
        self._check_broker()
        on_start = self.sampler.reset if self.sampler is not None else (lambda: None)
        rates, wall = run_tools(argvs, start_at, a.timeout, on_start, self._check_broker)
        rss, cpu = self.sampler.window() if self.sampler is not None else (None, None)
        wrate = rates.pop(0) if writer else None
        return wrate, rates, wall, rss, cpu

    def _tool_result(
        self, name: str, wrate: ToolRate | None, rrates: list[ToolRate], seconds: float,
        rss: float | None, cpu: float | None,
    ) -> Result:
        return Result(
            scenario=name,
            msgs_in=wrate.messages if wrate else 0,
            rate_in=wrate.rate if wrate else None,
            msgs_out=sum(r.messages for r in rrates),
            rate_out=sum(r.rate for r in rrates) if rrates else None,
            rss_mb=rss,
            cpu_pct=cpu,
            wait_pct=self.sampler.wait_pct if self.sampler is not None else None,
            seconds=seconds,
        )

    def fill(self) -> None:
        """A backlog for a lone ``reader``: bench_writer for ``--duration``, untimed."""
        self._fresh_topic()
        wrate, _, seconds, _, _ = self._tools(True, False, self.args.duration)
        assert wrate is not None
        self.backlog = wrate.messages
        self.state = "backlog"
        print(f"  (fill: {self.backlog:,} msgs in {seconds:.1f} s)", flush=True)

    def writer(self) -> Result:
        if self.state != "empty":
            self._fresh_topic()
        wrate, _, seconds, rss, cpu = self._tools(True, False, self.args.duration)
        res = self._tool_result("writer", wrate, [], seconds, rss, cpu)
        self.backlog = res.msgs_in
        self.state = "backlog"
        return res

    def reader(self) -> Result:
        if self.state != "backlog":
            self.fill()
        _, rrates, seconds, rss, cpu = self._tools(False, True, self.args.duration)
        res = self._tool_result("reader", None, rrates, seconds, rss, cpu)
        drained = [r for r in rrates if r.messages >= 0.98 * self.backlog]
        if self.backlog and drained:
            print(
                f"  warning: {len(drained)} of {len(rrates)} readers emptied the "
                f"{self.backlog:,} message backlog before --duration ended: their rate is "
                "a lower bound",
                flush=True,
            )
        self.state = "used"
        return res

    def both(self) -> Result:
        if self.state != "empty":
            self._fresh_topic()
        wrate, rrates, seconds, rss, cpu = self._tools(True, True, self.args.duration)
        self.state = "used"
        return self._tool_result("both", wrate, rrates, seconds, rss, cpu)

    def drain(self, idle: float = 2.0) -> int:
        """Start over with an empty topic rather than reading what is left."""
        left = self.backlog
        self._fresh_topic()
        return left


def load_line(args: argparse.Namespace) -> str:
    """The load of a ``--load nsq`` run in words."""
    cores = len(os.sched_getaffinity(0))
    n = args.channels
    return (
        f"NSQ's {WRITER} (MPUB x{args.batch}, {args.size} B bodies) and {n} {READER}"
        f"{'s' if n > 1 else ''} (RDY {args.rdy}; one per channel, {n} channel"
        f"{'s' if n > 1 else ''}), {cores} connections each (one per core), "
        f"{args.duration:g} s runs"
    )
