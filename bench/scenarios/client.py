"""``python -m bench client``: txnsq (mqd.client) side by side with pynsq against one mqd.

The target is at least pynsq's throughput. Both libraries run the same three
scenarios against the same broker in the same run, alternating which goes
first in each repetition so machine noise hits both:

- ``pub``: publish ``--count`` bodies one ``PUB`` each, ``--window`` outstanding;
- ``mpub``: the same bodies as ``MPUB`` batches of ``--batch``, ``--mpub-window`` outstanding;
- ``consume``: drain a backlog of ``--count`` messages (filled untimed by the raw
  bench writer) with ``max_in_flight`` ``--max-in-flight``, the handler returning
  success so every message is FINed.

Each library run is a child process (client_libs.py); this side prepares the
broker between runs (untimed), times the child's ``go`` to ``done`` window
with the broker's CPU, checks what the broker holds afterwards, and can attach
py-spy to the child for its timed part (``--profile DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import IO, Any

from bench.harness import wire
from bench.harness.broker import REPO, Broker, BrokerError, Sampler, checkout_env, running
from bench.harness.load import fill
from bench.harness.pyspy import start_pyspy, stop_pyspy, top_frames
from bench.harness.report import fmt, heading, median, percent, ratio, save_json
from bench.scenarios.client_libs import (
    CHANNEL,
    LIBS,
    MARK,
    PUB_TOPIC,
    SCENARIOS,
    SUB_TOPIC,
    ChildConfig,
    ChildError,
)


class Harness:
    """One broker, the untimed set-up between runs, and the child processes."""

    def __init__(self, args: argparse.Namespace, broker: Broker, sampler: Sampler) -> None:
        self.args = args
        self.broker = broker
        self.sampler = sampler
        assert broker.address is not None
        self.address = broker.address

    def _http(self, path: str, method: str = "GET", **query: str) -> bytes:
        assert self.broker.http_address is not None
        return wire.http_request(self.broker.http_address, path, method, **query)

    def counts(self, topic: str, channel: str) -> tuple[int, int] | None:
        assert self.broker.http_address is not None
        return wire.stats_counts(self.broker.http_address, topic, channel)

    def prepare(self, scenario: str) -> None:
        """Untimed: a fresh publish topic with one channel, or a backlog of --count to drain."""
        if scenario == "consume":
            left = self.counts(SUB_TOPIC, CHANNEL)
            if left and (left[0] or left[1]):
                self._http("/channel/empty", "POST", topic=SUB_TOPIC, channel=CHANNEL)
            wire.create_topic_channel(self.address, SUB_TOPIC, CHANNEL)
            try:
                fill(self.address, SUB_TOPIC, self.args.count, self.args.size, 100, pipeline=20)
            except wire.ProtocolError as exc:
                raise ChildError(f"fill: {exc}") from None
        else:
            wire.create_topic_channel(self.address, PUB_TOPIC, CHANNEL)

    def check(self, scenario: str, result: dict) -> str | None:
        """Untimed: what the broker holds must match what the library reported."""
        if scenario == "consume":
            deadline = time.monotonic() + 5
            while True:
                got = self.counts(SUB_TOPIC, CHANNEL)
                if got == (0, 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if got is None:
                return f"channel {SUB_TOPIC}/{CHANNEL} missing from /stats after the run"
            if got != (0, 0):
                self._http("/channel/empty", "POST", topic=SUB_TOPIC, channel=CHANNEL)
                return f"channel not empty after the run: depth {got[0]:,}, in flight {got[1]:,}"
            return None
        got = self.counts(PUB_TOPIC, CHANNEL)
        self._http("/topic/delete", "POST", topic=PUB_TOPIC)
        if got is None or got[0] != result["messages"]:
            return f"broker holds {got} (depth, in flight), library acked {result['messages']:,}"
        return None

    def run(self, lib: str, scenario: str, profile: str | None = None) -> dict:
        a = self.args
        cfg = ChildConfig(
            lib=lib,
            scenario=scenario,
            host=self.address[0],
            port=self.address[1],
            count=a.mpub_count if scenario == "mpub" else a.count,
            size=a.size,
            window=a.window if scenario == "pub" else a.mpub_window,
            batch=a.batch,
            max_in_flight=a.max_in_flight,
            idle_timeout=a.idle_timeout,
            topic=SUB_TOPIC if scenario == "consume" else PUB_TOPIC,
        )
        self.prepare(scenario)
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.scenarios.client_libs", json.dumps(asdict(cfg))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=checkout_env(),
        )
        killer = threading.Timer(a.timeout, proc.kill)
        killer.start()
        result: dict | None = None
        error: str | None = None
        rss = cpu = None
        spy: subprocess.Popen | None = None
        try:
            assert proc.stdin is not None and proc.stdout is not None
            for kind, data in _messages(proc.stdout):
                if kind == "ready":
                    if profile:  # the timed part only: imports and warm-up stay out of it
                        spy = start_pyspy(proc.pid, profile, rate=250, nonblocking=True)
                    self.sampler.reset()
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                elif kind == "done":
                    rss, cpu = self.sampler.window()
                    if spy is not None:
                        stop_pyspy(spy, timeout=30)
                        spy = None
                elif kind == "result":
                    result = data
                elif kind == "error":
                    error = data["error"]
                    if a.verbose:
                        print(data["trace"], file=sys.stderr)
            proc.wait()
        finally:
            killer.cancel()
            if spy is not None:
                stop_pyspy(spy, timeout=30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if result is None:
            raise ChildError(error or f"child exited with {proc.returncode} without a result")
        result["broker_cpu"] = cpu
        result["broker_rss"] = rss
        problem = self.check(scenario, result)
        if problem:
            result["error"] = "; ".join(filter(None, [result.get("error"), problem]))
        return result


def _messages(stream: IO[str]) -> Any:
    """(kind, data) for each line of the child starting with MARK; other output is echoed."""
    for line in stream:
        if not line.startswith(MARK):
            sys.stdout.write("  | " + line)
            continue
        kind, _, rest = line[len(MARK) :].strip().partition(" ")
        yield kind, (json.loads(rest) if rest else None)


def run_line(rep: int, args: argparse.Namespace, r: dict) -> str:
    return (
        f"{r['scenario']:<8} {r['lib']:<6} {rep + 1}/{args.repeat}  "
        f"{fmt(r['rate']):>9} msgs/s  "
        f"ack p50/p99 {fmt(r.get('ack_p50'), '.2f')}/{fmt(r.get('ack_p99'), '.2f')} ms  "
        f"client cpu {percent(r.get('client_cpu'))} ({fmt(r.get('client_us'), '.2f')} us/msg)  "
        f"broker cpu {percent(r.get('broker_cpu'))}  "
        f"({r['messages']:,} msgs, {r['seconds']:.2f} s)"
        + (f"  ERROR: {r['error']}" if r.get("error") else "")
    )


def medians(runs: list[dict]) -> dict[str, float | None]:
    """Median of each figure over the successful runs of one library and scenario."""
    ok = [r for r in runs if not r.get("error")]
    out: dict[str, float | None] = {"runs": len(ok)}
    for key in ("rate", "ack_p50", "ack_p99", "client_cpu", "client_us", "broker_cpu"):
        out[key] = median(r.get(key) for r in ok)
    return out


def versions() -> dict[str, str]:
    """Library versions for the report, read without importing Twisted or Tornado here."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("pynsq", "tornado", "twisted", "mqd"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "?"
    return out


def markdown(table: dict[str, dict[str, dict]], args: argparse.Namespace, broker_desc: str) -> str:
    v = versions()
    lines = [
        heading(
            f"txnsq (mqd.client, mqd {v['mqd']}, Twisted {v['twisted']}) vs pynsq {v['pynsq']} "
            f"(Tornado {v['tornado']})"
        ),
        "",
        f"- broker: `{broker_desc}`",
        (
            f"- load: {args.size} B bodies; pub: {args.count:,} messages, one PUB each, "
            f"{args.window} outstanding; mpub: {args.mpub_count:,} messages in MPUB "
            f"x{args.batch}, {args.mpub_window} outstanding; "
            f"consume: backlog of {args.count:,}, max_in_flight {args.max_in_flight}, handler "
            f"returns success (FIN); one process per library run, order alternated, "
            f"median of {args.repeat}"
        ),
        "",
        (
            "| scenario | pynsq msgs/s | txnsq msgs/s | txnsq / pynsq "
            "| ack p50 / p99 ms (pynsq) | ack p50 / p99 ms (txnsq) "
            "| client CPU pynsq / txnsq | client CPU us/msg pynsq / txnsq "
            "| broker CPU pynsq / txnsq |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario, per_lib in table.items():
        p = per_lib.get("pynsq", {})
        t = per_lib.get("txnsq", {})
        r = ratio(p.get("rate"), t.get("rate"))
        lines.append(
            f"| {scenario} | {fmt(p.get('rate'))} | {fmt(t.get('rate'))} "
            f"| {'-' if r is None else f'{r:.2f}x'} "
            f"| {fmt(p.get('ack_p50'), '.2f')} / {fmt(p.get('ack_p99'), '.2f')} "
            f"| {fmt(t.get('ack_p50'), '.2f')} / {fmt(t.get('ack_p99'), '.2f')} "
            f"| {percent(p.get('client_cpu'))} / {percent(t.get('client_cpu'))} "
            f"| {fmt(p.get('client_us'), '.2f')} / {fmt(t.get('client_us'), '.2f')} "
            f"| {percent(p.get('broker_cpu'))} / {percent(t.get('broker_cpu'))} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench client",
        description="txnsq (mqd.client) and pynsq throughput against one mqd, side by side.",
    )
    p.add_argument("--count", type=int, default=200_000, help="messages per run")
    p.add_argument("--size", type=int, default=200, help="message body bytes")
    p.add_argument("--window", type=int, default=1000, help="outstanding PUBs (pub)")
    p.add_argument("--batch", type=int, default=100, help="messages per MPUB (mpub)")
    p.add_argument(
        "--mpub-count",
        type=int,
        help="messages per mpub run (default 5 x --count: batches make it 10x faster, "
        "and a run of a few tenths of a second is mostly noise)",
    )
    p.add_argument("--mpub-window", type=int, default=20, help="outstanding MPUBs (mpub)")
    p.add_argument("--max-in-flight", type=int, default=2500, help="consumer max_in_flight")
    p.add_argument("--repeat", type=int, default=3, help="runs per library and scenario; median")
    p.add_argument(
        "--libs", default=",".join(LIBS), help=f"comma-separated subset of {','.join(LIBS)}"
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    p.add_argument("--backend", default="memory")
    p.add_argument("--mem-queue-size", type=int, default=10_000_000)
    p.add_argument("--broker-arg", action="append", default=[], metavar="ARG")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="attach py-spy to each child for its timed part (raw collapsed stacks in DIR) "
        "and print its hottest functions; profiled runs are slower, so not figures",
    )
    p.add_argument("--idle-timeout", type=float, default=10.0, help="fail a run stalled this long")
    p.add_argument("--timeout", type=float, default=300.0, help="kill a child after this long")
    p.add_argument("--json", metavar="PATH", help="also write every run as JSON")
    p.add_argument("--keep-data", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="children's tracebacks")
    args = p.parse_args(argv)
    args.libs = [x for x in args.libs.split(",") if x]
    args.scenarios = [x for x in args.scenarios.split(",") if x]
    if bad := set(args.libs) - set(LIBS):
        p.error(f"unknown library {sorted(bad)}; known: {', '.join(LIBS)}")
    if bad := set(args.scenarios) - set(SCENARIOS):
        p.error(f"unknown scenario {sorted(bad)}; known: {', '.join(SCENARIOS)}")
    if args.mpub_count is None:
        args.mpub_count = 5 * args.count
    if (
        min(
            args.count,
            args.mpub_count,
            args.size,
            args.window,
            args.batch,
            args.mpub_window,
            args.repeat,
        )
        < 1
    ):
        p.error("--count, --size, --window, --batch, --mpub-window, --repeat must be >= 1")
    return args


def main(argv: list[str]) -> int:
    """Run every library through every scenario ``--repeat`` times; print the comparison."""
    args = parse_args(argv)
    broker = Broker(args.backend, args.mem_queue_size, args.broker_arg, keep=args.keep_data)
    broker_desc = broker.describe()
    runs: dict[str, dict[str, list[dict]]] = {
        s: {lib: [] for lib in args.libs} for s in args.scenarios
    }
    profiles: list[tuple[str, str]] = []
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    with running(broker) as sampler:
        harness = Harness(args, broker, sampler)
        for rep in range(args.repeat):
            for scenario in args.scenarios:
                order = args.libs if rep % 2 == 0 else args.libs[::-1]
                for lib in order:
                    profile = None
                    if args.profile:
                        profile = os.path.join(args.profile, f"{lib}-{scenario}-{rep + 1}.txt")
                    try:
                        res = harness.run(lib, scenario, profile)
                    except ChildError as exc:
                        res = {"lib": lib, "scenario": scenario, "messages": 0,
                               "seconds": 0.0, "rate": None, "error": str(exc)}
                    runs[scenario][lib].append(res)
                    print(run_line(rep, args, res), flush=True)
                    if profile and os.path.exists(profile):
                        profiles.append((f"{lib} {scenario} {rep + 1}", profile))
                    if not broker.alive():
                        raise BrokerError(f"broker died:\n{broker.log_tail()}")
    table = {s: {lib: medians(rs) for lib, rs in per.items()} for s, per in runs.items()}
    print()
    for name, path in profiles:
        with open(path) as f:
            top = top_frames(f.read(), 12)
        print(f"profile {name} ({path}), hottest functions (self %, total %):")
        for frame, _, own, total in top:
            print(f"  {own:5.1f}% {total:5.1f}%  {frame}")
    print()
    print(markdown(table, args, broker_desc))
    if args.json:
        save_json(args.json, args, broker=broker_desc, versions=versions(), runs=runs, median=table)
    return 0
