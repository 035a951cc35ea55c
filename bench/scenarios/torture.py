"""``python -m bench torture``: fuzz, kill -9 and abuse figures of a broker, for the docs.

Runs the machinery of the reliability tests (tests/support: abuse.py,
broker_fuzz.py, crash_loop.py) longer than CI does, each part on a fresh twistd broker, and prints:

- fuzz: random V2 streams and HTTP requests over real sockets (plus a sweep
  of snapshot names and config bodies), with the control checks after every
  batch: inputs fuzzed, 500s, unanswered requests, tracebacks in the log;
- kill -9: rounds of mixed load on a ``--durable`` broker killed at a random
  moment and restarted on the same data directory: restarts survived,
  acknowledged messages missing, corrupt, unknown;
- abuse: the broker's RSS before and at its peak under each abuse, and the
  worst PUB round trip a bystander client saw meanwhile.

Needs the test dependencies (it imports the tests' helpers), run from the
checkout: ``python -m bench torture --kill-rounds 20``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.harness.report import heading, save_json
from tests.support.abuse import (
    AbuseResult,
    abuse_auth_pending,
    abuse_deflate_bomb,
    abuse_fin_flood,
    abuse_huge_mpub,
    abuse_never_reading_consumer,
    abuse_slow_consumer,
    silent_server,
)
from tests.support.broker_fuzz import fuzz_broker
from tests.support.control_checks import Control, log_problems
from tests.support.crash_loop import crash_rounds
from tests.support.processes import FAST_SCAN, BrokerProcess

ABUSES = {
    "fin-flood": (abuse_fin_flood, []),
    "never-reading": (abuse_never_reading_consumer, ["--msg-timeout=1s", "--mem-queue-size=100"]),
    "slow-consumer": (abuse_slow_consumer, ["--msg-timeout=5s", "--mem-queue-size=100"]),
    "deflate-bomb": (abuse_deflate_bomb, []),
    "huge-mpub": (abuse_huge_mpub, []),
    "auth-pending": (abuse_auth_pending, []),
}


def say(text: str) -> None:
    print(text, flush=True)


def run_fuzz(workdir: Path, streams: int, seed: int) -> dict:
    broker = BrokerProcess(workdir / "fuzz", FAST_SCAN).start()
    try:
        control = Control(broker)
        control.setup(50)
        report = fuzz_broker(broker, control, streams=streams, http_requests=max(100, streams // 5),
                             seed=seed, progress=say if streams >= 1000 else None)
        control.drain_and_compare()
        problems = log_problems(broker)
        broker.stop()
    finally:
        broker.kill()
    say(f"fuzz: {report.inputs:,} inputs ({report.streams:,} V2 streams, {report.http_requests:,} "
        f"HTTP requests) in {report.seconds:.1f} s; {report.closed_by_broker:,} connections closed "
        f"by the broker; {len(report.http_500)} answers 500, {len(report.http_no_answer)} unanswered, "
        f"{len(problems)} traceback lines; control channel intact")
    for line in [*report.http_500[:5], *report.http_no_answer[:5], *problems[:5]]:
        say(f"  {line}")
    return {"inputs": report.inputs, "streams": report.streams, "http_requests": report.http_requests,
            "http_500": report.http_500, "http_no_answer": report.http_no_answer,
            "log_problems": problems, "seconds": report.seconds}


def run_kill(workdir: Path, rounds: int, seed: int) -> dict:
    broker = BrokerProcess(workdir / "kill", ["--durable", "--msg-timeout=1s", *FAST_SCAN]).start()
    try:
        report = crash_rounds(broker, rounds, seed=seed, progress=say)
        broker.stop_cleanly()
    finally:
        broker.kill()
    say(f"kill -9: {report.restarts} restarts survived in {report.seconds:.0f} s; "
        f"{report.acknowledged:,} acknowledged publishes ({report.commands:,} commands): "
        f"{report.missing} missing, {report.corrupt} corrupt, {report.unknown} unknown, "
        f"{report.duplicates} duplicates; {report.finished_came_back} FINished came back (allowed)")
    for line in report.problems[:10]:
        say(f"  {line}")
    return asdict(report)


def run_abuse(workdir: Path, name: str, seconds: float) -> AbuseResult:
    fn, extra = ABUSES[name]
    args = [*FAST_SCAN, *extra]
    with silent_server() as auth:
        if name == "auth-pending":
            args += [f"--auth-http-address={auth}", "--http-client-request-timeout=600s"]
        broker = BrokerProcess(workdir / name, args).start()
        try:
            time.sleep(0.5)  # let start-up allocations settle before the baseline
            result = fn(broker, seconds)["result"]
            problems = log_problems(broker)
            alive = broker.running
            if alive:
                broker.stop()
        finally:
            broker.kill()
    if not alive:
        result.detail += "; BROKER DIED"
    if problems:
        result.detail += f"; {len(problems)} traceback lines in the log"
    say(f"{name}: RSS {result.baseline_mb:.0f} -> {result.peak_mb:.0f} MB (RssAnon +"
        f"{result.anon_growth_mb:.0f} MB), bystander worst "
        f"{result.worst_latency_ms:.0f} ms ({result.bystander_round_trips} PUBs"
        + (f", errors {result.bystander_errors[:2]}" if result.bystander_errors else "")
        + f"); {result.detail}")
    return result


def table(results: list[AbuseResult]) -> str:
    lines = [
        "| abuse | RSS before (MB) | peak RSS (MB) | growth (MB) | RssAnon growth (MB) "
        "| bystander worst (ms) | what |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(f"| {r.name} | {r.baseline_mb:.0f} | {r.peak_mb:.0f} | {r.growth_mb:.0f} "
                     f"| {r.anon_growth_mb:.0f} | {r.worst_latency_ms:.0f} | {r.detail} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench torture",
        description="Fuzz, kill -9 and abuse a broker, longer than CI does, and report the figures.",
    )
    p.add_argument("--fuzz-streams", type=int, default=3000, help="random V2 streams (0: skip)")
    p.add_argument("--kill-rounds", type=int, default=20, help="kill -9 rounds (0: skip)")
    p.add_argument("--abuse-seconds", type=float, default=10.0, help="seconds per abuse")
    p.add_argument("--abuse", action="append", choices=sorted(ABUSES),
                   help="run only these abuses (repeatable; default: all)")
    p.add_argument("--no-abuse", action="store_true", help="skip the abuses")
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--keep", action="store_true", help="keep the brokers' work directories")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="mqd-torture-"))
    say(heading("mqd torture", f"work dir {workdir}"))
    figures: dict = {}
    results: list[AbuseResult] = []
    failed: list[str] = []

    def part(name: str, run) -> None:
        """One part's failure (a broker that did not start, a check that failed) is reported
        and the other parts still run."""
        try:
            run()
        except (AssertionError, OSError) as exc:
            failed.append(name)
            say(f"{name}: FAILED: {str(exc)[:3000]}")

    def abuses() -> None:
        for name in args.abuse or list(ABUSES):
            part(name, lambda name=name: results.append(run_abuse(workdir, name, args.abuse_seconds)))
        figures["abuse"] = [asdict(r) for r in results]

    try:
        if args.fuzz_streams:
            part("fuzz", lambda: figures.__setitem__(
                "fuzz", run_fuzz(workdir, args.fuzz_streams, args.seed)))
        if args.kill_rounds:
            part("kill -9", lambda: figures.__setitem__(
                "kill", run_kill(workdir, args.kill_rounds, args.seed)))
        if not args.no_abuse:
            abuses()
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    say("")
    if "fuzz" in figures:
        f = figures["fuzz"]
        say(f"- inputs fuzzed: {f['inputs']:,} ({f['streams']:,} V2 streams over real sockets, "
            f"{f['http_requests']:,} HTTP requests): {len(f['http_500'])} 500s, "
            f"{len(f['log_problems'])} traceback lines, nothing lost")
    if "kill" in figures:
        k = figures["kill"]
        say(f"- kill -9 restarts survived: {k['restarts']} of {k['rounds']} "
            f"({k['acknowledged']:,} acknowledged: {k['missing']} missing, {k['corrupt']} corrupt)")
    if results:
        say(f"- abuse, {args.abuse_seconds:g} s each, a fresh broker each:\n")
        say(table(results))
    if failed:
        say(f"\nFAILED: {', '.join(failed)}")
    if args.json:
        save_json(args.json, args, **figures)
    return 1 if failed else 0
