"""``python -m bench writer|reader|both|all``: NSQ's bench conditions against one broker.

``writer`` publishes (``--writers`` processes, MPUB or PUB), ``reader`` drains
the backlog a writer left, ``both`` runs writers and readers at once from an
empty channel, ``all`` the three in order; ``--repeat`` times, medians
reported. The broker is twistd mqd unless ``--broker-cmd``, ``--nsqd-bin``
or ``--nsqd-address`` names another.
"""

from __future__ import annotations

import argparse

from bench.harness.report import fmt, heading, percent, save_json
from bench.harness.session import (
    SCENARIOS,
    Result,
    load_line,
    median_result,
    open_session,
    parse_args,
    result_line,
)


def markdown(medians: list[Result], args: argparse.Namespace, broker_desc: str) -> str:
    """A table ready to paste into the docs, with date, machine and flags."""
    lines = [
        heading("mqd bench"),
        "",
        f"- broker: `{broker_desc}`",
        f"- load: {load_line(args)}, median of {args.repeat}",
        "",
        (
            "| run | msgs/s in | msgs/s out | latency p50 / p99 (ms) | ack p50 / p99 (ms) "
            "| broker peak RSS (MB) | broker CPU |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in medians:
        lines.append(
            f"| {r.scenario} | {fmt(r.rate_in)} | {fmt(r.rate_out)} "
            f"| {fmt(r.lat_p50, '.1f')} / {fmt(r.lat_p99, '.1f')} "
            f"| {fmt(r.ack_p50, '.2f')} / {fmt(r.ack_p99, '.2f')} "
            f"| {fmt(r.rss_mb)} | {percent(r.cpu_pct)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios; returns the process exit status."""
    args = parse_args(argv)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    runs: dict[str, list[Result]] = {s: [] for s in scenarios}
    with open_session(args) as session:
        broker_desc = session.describe()
        for rep in range(args.repeat):
            for name in scenarios:
                res = getattr(session, name)()
                runs[name].append(res)
                print(result_line(res, f"{name} {rep + 1}/{args.repeat}"), flush=True)
    hwm = session.sampler.lifetime_peak_mb() if session.sampler is not None else None
    medians = [median_result(runs[s]) for s in scenarios if runs[s]]
    print()
    for r in medians:
        print(result_line(r, f"{r.scenario} median"))
    if hwm is not None:
        print(f"broker lifetime peak RSS (VmHWM): {hwm:,.0f} MB")
    print()
    print(markdown(medians, args, broker_desc))
    if args.json:
        save_json(args.json, args, broker=broker_desc, runs=runs, median=medians, peak_rss_mb=hwm)
    return 0


def writer(argv: list[str]) -> int:
    return main(["writer", *argv])


def reader(argv: list[str]) -> int:
    return main(["reader", *argv])


def both(argv: list[str]) -> int:
    return main(["both", *argv])


def all_scenarios(argv: list[str]) -> int:
    return main(["all", *argv])
