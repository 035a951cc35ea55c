"""``python -m bench latency``: publish-to-deliver latency at fractions of the maximum throughput.

A latency taken at full speed mostly measures queueing in front of a saturated
broker; what a user sees is the latency at the load they actually run. So the
harness first measures the maximum of the ``both`` scenario (writers and readers
at once, as fast as acks come), then runs the same load paced by the writers at
50% and 90% of it (``WriterConfig.rate``) and reports the latency percentiles of
each run next to the rates it really achieved.

The maximum is the lower of the in and out rates of that run: a load above the
rate the readers are served at only grows a backlog, and the latency with it.

``--output-buffer-timeout MS`` sends ``output_buffer_timeout`` in the readers'
IDENTIFY (NSQ's meaning: -1 turns the broker's per-client output buffering
off, 0 keeps its default, a positive value must lie within the broker's
``--min/max-output-buffer-timeout``, 25 ms to 30 s by default in nsqd 1.3.0 and
mqd). Without it the field is not sent and the broker's default applies; the
timeout the broker settled on is reported either way.
"""

from __future__ import annotations

import argparse
from array import array
from dataclasses import dataclass, field
from typing import Any

from bench.harness.load import ReaderConfig, WriterConfig
from bench.harness.report import fmt, heading, percent, percentile, save_json
from bench.harness.session import (
    BenchError,
    Result,
    Session,
    open_session,
    parse_args,
    result_line,
)

QUANTILES = (0.50, 0.99, 0.999)


def latency_summary(latencies_ns: list[int]) -> dict[str, float | None]:
    """p50/p99/p99.9 in ms of publish-to-deliver samples (nearest rank)."""
    values = sorted(latencies_ns)
    out: dict[str, float | None] = {"samples": float(len(values))}
    for q in QUANTILES:
        v = percentile(values, q)
        out[f"p{q * 100:g}"] = None if v is None else v / 1e6
    return out


def split_rate(total: float, writers: int) -> list[float]:
    """Per-writer paced rates (msgs/s) that add up to ``total``."""
    return [total / writers] * writers


class PacedSession(Session):
    """The bench Session whose writers, while ``rate`` is set, publish at that total rate."""

    rate: float | None = None
    paced_pipeline: int = 4
    output_buffer_timeout: int | None = None  # readers' IDENTIFY field (ms); None: not sent
    _last_latencies: list[int] = []  # noqa: RUF012 -- replaced, never mutated
    _last_buffer_timeouts: list[int | None] = []  # noqa: RUF012 -- replaced, never mutated

    def _writer_cfgs(self, total: int | None) -> list[WriterConfig]:
        cfgs = super()._writer_cfgs(total)
        if self.rate:
            for cfg, r in zip(cfgs, split_rate(self.rate, len(cfgs)), strict=True):
                cfg.rate = r
                cfg.pipeline = max(cfg.pipeline, self.paced_pipeline)
        return cfgs

    def _reader_cfgs(
        self, duration: float | None, expected: int | None, idle: float | None
    ) -> list[ReaderConfig]:
        cfgs = super()._reader_cfgs(duration, expected, idle)
        for cfg in cfgs:
            cfg.output_buffer_timeout = self.output_buffer_timeout
        return cfgs

    def buffer_timeouts(self) -> list[int | None]:
        """The output_buffer_timeout (ms) each reader of the last run was granted, as IDENTIFY said."""
        return self._last_buffer_timeouts

    def latencies(self) -> list[int]:
        """Every latency sample of the last run (kept by ``_result``)."""
        return self._last_latencies

    def result(
        self, name: str, wres: list[dict], rres: list[dict], seconds: float, rss: Any, cpu: Any
    ) -> Result:
        values: list[int] = []
        for r in rres:
            arr = array("q")
            arr.frombytes(r["latency_ns"])
            values.extend(arr)
        self._last_latencies = values
        self._last_buffer_timeouts = [r.get("output_buffer_timeout") for r in rres]
        return super().result(name, wres, rres, seconds, rss, cpu)


@dataclass
class PacedRun:
    """One run: target (None for the unpaced maximum), achieved rates, latency percentiles."""

    label: str
    target: float | None
    rate_in: float | None
    rate_out: float | None
    p50: float | None
    p99: float | None
    p999: float | None
    samples: int
    cpu_pct: float | None
    buffer_timeouts: list[int | None] = field(default_factory=list)  # granted, per reader (ms)


def buffer_note(asked: int | None, granted: list[int | None]) -> str:
    """The readers' output buffering in words: what IDENTIFY asked for and what the broker granted."""
    values = sorted({g for g in granted if g is not None})
    if not values:
        got = "the broker did not say what it granted"
    else:
        got = "granted " + ", ".join(f"{v} ms" for v in values)
        if values == [0]:
            got += ": output buffering off"
    if asked is None:
        return f"no output_buffer_timeout in the readers' IDENTIFY (broker default; {got})"
    return f"readers' IDENTIFY output_buffer_timeout={asked} ({got})"


def paced_run(session: PacedSession, label: str, rate: float | None) -> PacedRun:
    session.rate = rate
    res = session.both()
    print(result_line(res, label), flush=True)
    s = latency_summary(session.latencies())
    return PacedRun(
        label, rate, res.rate_in, res.rate_out, s["p50"], s["p99"], s["p99.9"],
        int(s["samples"] or 0), res.cpu_pct, list(session.buffer_timeouts()),
    )


def markdown(
    runs: list[PacedRun], args: argparse.Namespace, extra: argparse.Namespace, broker_desc: str
) -> str:
    granted = [g for r in runs for g in r.buffer_timeouts]
    lines = [
        heading("mqd publish-to-deliver latency"),
        "",
        f"- broker: `{broker_desc}`",
        f"- load: {args.writers} writers MPUB x{args.batch} of {args.size} B, "
        f"{args.readers} readers RDY {args.rdy}, {args.duration:g} s per run; paced runs keep up to "
        f"{max(args.pipeline, extra.paced_pipeline)} MPUBs outstanding per writer; latency sampled "
        f"every {args.sample_every}th message",
        f"- output buffering: {buffer_note(extra.output_buffer_timeout, granted)}",
        "",
        "| load | target msgs/s | achieved in | achieved out | p50 (ms) | p99 (ms) | p99.9 (ms) "
        "| samples | broker CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.label} | {fmt(r.target, ',.0f')} | {fmt(r.rate_in, ',.0f')} "
            f"| {fmt(r.rate_out, ',.0f')} | {fmt(r.p50, '.2f')} | {fmt(r.p99, '.2f')} "
            f"| {fmt(r.p999, '.2f')} | {r.samples:,} | {percent(r.cpu_pct)} |"
        )
    return "\n".join(lines)


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """Own options, then every ``python -m bench`` option for the rest (as for ``both``)."""
    p = argparse.ArgumentParser(
        prog="python -m bench latency",
        description="p50/p99/p99.9 publish-to-deliver latency at fractions of max throughput; "
        "any other option is python -m bench's (--duration, --writers, --backend, ...)",
    )
    p.add_argument("--fractions", default="0.5,0.9", help="of the maximum, comma separated")
    p.add_argument(
        "--max-rate", type=float, help="use this maximum (msgs/s) instead of measuring it"
    )
    p.add_argument(
        "--paced-pipeline",
        type=int,
        default=4,
        help="MPUBs a paced writer may keep outstanding (so acks do not set the pace)",
    )
    p.add_argument(
        "--output-buffer-timeout",
        type=int,
        metavar="MS",
        help="send output_buffer_timeout in the readers' IDENTIFY: -1 turns the broker's output "
        "buffering off, 0 keeps its default, else MS within the broker's "
        "--min-output-buffer-timeout (25 ms by default; lower it with "
        "--broker-arg=--min-output-buffer-timeout=1ms) and --max-output-buffer-timeout "
        "(default: the field is not sent)",
    )
    own, rest = p.parse_known_args(argv)
    if own.output_buffer_timeout is not None and own.output_buffer_timeout < -1:
        p.error("--output-buffer-timeout: -1 (off), 0 (the broker's default) or milliseconds")
    try:
        own.fractions = [float(x) for x in own.fractions.split(",") if x]
    except ValueError:
        p.error("--fractions: comma-separated numbers")
    if not own.fractions or not all(0 < f <= 1.5 for f in own.fractions):
        p.error("--fractions must lie in (0, 1.5]")
    args = parse_args(["both", "--sample-every", "10", *rest])
    if args.count is not None:
        p.error("--count does not apply: paced runs last --duration")
    return own, args


def main(argv: list[str]) -> int:
    own, args = parse(argv)
    runs: list[PacedRun] = []
    with open_session(args, PacedSession) as session:
        assert isinstance(session, PacedSession)
        broker_desc = session.describe()
        session.paced_pipeline = own.paced_pipeline
        session.output_buffer_timeout = own.output_buffer_timeout
        if own.max_rate:
            top = own.max_rate
            print(f"maximum given: {top:,.0f} msgs/s", flush=True)
        else:
            m = paced_run(session, "max (both)", None)
            runs.append(m)
            rates = [r for r in (m.rate_in, m.rate_out) if r]
            if not rates:
                raise BenchError("the maximum run moved no messages")
            top = min(rates)
            print(f"maximum: {top:,.0f} msgs/s (the lower of in and out)", flush=True)
        for f in own.fractions:
            runs.append(paced_run(session, f"{f:.0%} of max", f * top))
    print()
    print(markdown(runs, args, own, broker_desc))
    if args.json:
        save_json(args.json, args, runs=runs, latency_options=vars(own))
    return 0
