"""End-to-end processing latency: how long messages take from publish to FIN.

nsqd's `--e2e-processing-latency-percentile` feature.
Each channel records, on every FIN, now − the message's publish timestamp
into a rolling window covering the last `--e2e-processing-latency-window-time`;
a topic reports the merge of its channels' windows.

nsqd keeps two biased-quantile sketches per channel, each covering half the
window, and rotates them by time. mqd keeps the same two half-window buckets
but fills each with a bounded uniform reservoir sample: the memory per
channel is fixed whatever the message rate, recording is an append (or one
random index) on the FIN path, and the quantiles are exact while a half
window saw no more than `RESERVOIR_SIZE` messages.

Nothing here runs when the feature is off: channels then hold no window
and their FIN path only tests an attribute for None.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from twisted.internet.interfaces import IReactorTime

__all__ = ["LatencyWindow", "RESERVOIR_SIZE", "disabled_result", "merged_result", "parse_percentiles"]

# Samples kept per half-window bucket. 4096 ints per bucket is ~100 KiB per
# channel at most; the error of a quantile read from a uniform sample of
# this size is well under a percentile point.
RESERVOIR_SIZE = 4096


def parse_percentiles(value: Any) -> list[float]:
    """nsqd's percentile flag: repeatable and/or comma-separated floats in (0, 1].

    Returned sorted highest first, as nsqd stores them (its /stats lists
    the percentiles in that order), without duplicates (each would be the
    same series twice in /metrics and statsd).
    """
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else [value]
    found: list[float] = []
    for item in items:
        if isinstance(item, bool):
            raise ValueError(f"expected numbers in (0, 1], got {item!r}")
        parts = item.split(",") if isinstance(item, str) else [item]
        for part in parts:
            if isinstance(part, str):
                part = part.strip()
                if not part:
                    continue
            try:
                number = float(part)
            except (TypeError, ValueError):
                raise ValueError(f"expected numbers in (0, 1], got {part!r}") from None
            if not 0.0 < number <= 1.0:
                raise ValueError(f"percentile must be in (0, 1], got {part!r}")
            found.append(number)
    return sorted(set(found), reverse=True)


def disabled_result() -> dict[str, Any]:
    """What nsqd reports where nothing is tracked (feature off, or a topic with no channel)."""
    return {"count": 0, "percentiles": None}


class _Reservoir:
    """A uniform sample of at most RESERVOIR_SIZE values, and how many were offered."""

    __slots__ = ("count", "samples")

    def __init__(self) -> None:
        self.count = 0
        self.samples: list[int] = []

    def add(self, value: int) -> None:
        self.count += 1
        samples = self.samples
        if len(samples) < RESERVOIR_SIZE:
            samples.append(value)
        else:
            # Algorithm R: every value seen so far stays with equal probability.
            j = random.randrange(self.count)
            if j < RESERVOIR_SIZE:
                samples[j] = value

    def clear(self) -> None:
        self.count = 0
        self.samples = []

    def weighted(self) -> Iterable[tuple[int, float]]:
        """(value, how many recorded values it stands for)."""
        if not self.samples:
            return ()
        weight = self.count / len(self.samples)
        return ((v, weight) for v in self.samples)


class LatencyWindow:
    """One channel's latencies over the last `window` seconds, in two rotating halves.

    As nsqd's quantile.Quantile: recording goes to the current half; once
    half a window has passed since the last rotation the other half is
    cleared and becomes current, so a query covers between half a window
    and a whole one.
    """

    __slots__ = ("percentiles", "half", "_clock", "_buckets", "_index", "_rotate_at")

    def __init__(self, percentiles: Sequence[float], window: float, clock: IReactorTime) -> None:
        self.percentiles = list(percentiles)
        self.half = window / 2
        self._clock = clock
        self._buckets = (_Reservoir(), _Reservoir())
        self._index = 0
        self._rotate_at = clock.seconds() + self.half

    def record(self, timestamp_ns: int) -> None:
        """A FIN of a message published at `timestamp_ns` (ns since the epoch)."""
        now = self._clock.seconds()
        if now > self._rotate_at:
            self._rotate(now)
        self._buckets[self._index].add(int(now * 1e9) - timestamp_ns)

    def _rotate(self, now: float) -> None:
        half = self.half
        for _ in range(2):
            self._index ^= 1
            self._buckets[self._index].clear()
            self._rotate_at += half
            if now <= self._rotate_at:
                return
        # Both halves are empty now: skip the half-windows in which nothing happened.
        self._rotate_at += (math.floor((now - self._rotate_at) / half) + 1) * half

    def current(self) -> tuple[int, list[tuple[int, float]]]:
        """(count, weighted samples) of the window as of now."""
        now = self._clock.seconds()
        if now > self._rotate_at:
            self._rotate(now)
        count = 0
        samples: list[tuple[int, float]] = []
        for bucket in self._buckets:
            count += bucket.count
            samples.extend(bucket.weighted())
        return count, samples

    def result(self) -> dict[str, Any]:
        """nsqd's quantile.Result for this channel."""
        return merged_result(self.percentiles, [self])


def _query(samples: list[tuple[int, float]], total: float, quantile: float) -> int:
    """The smallest recorded value with at least `quantile` of the weight at or below it."""
    if not samples:
        return 0
    target = quantile * total
    running = 0.0
    for value, weight in samples:
        running += weight
        # A little slack so float rounding of the weights cannot skip to the next value.
        if running >= target - 1e-9 * total:
            return value
    return samples[-1][0]


def merged_result(percentiles: Sequence[float], windows: Iterable[LatencyWindow]) -> dict[str, Any]:
    """The quantile.Result over several windows: a channel's own, or a topic's channels'.

    `{"count": n, "percentiles": [{"quantile": q, "value": ns}, ...]}`;
    with no window at all, nsqd's empty result (count 0, percentiles null).
    """
    count = 0
    samples: list[tuple[int, float]] = []
    seen = False
    for window in windows:
        seen = True
        c, s = window.current()
        count += c
        samples.extend(s)
    if not seen:
        return disabled_result()
    samples.sort(key=lambda item: item[0])
    total = sum(weight for _, weight in samples)
    return {
        "count": count,
        "percentiles": [{"quantile": _go_float(q), "value": _query(samples, total, q)} for q in percentiles],
    }


def _go_float(q: float) -> float | int:
    """A quantile as Go's JSON writes a float64: 1.0 as `1`, not Python's `1.0`."""
    return int(q) if q.is_integer() else q
