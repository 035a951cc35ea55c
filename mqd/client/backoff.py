"""Consumer backoff: go-nsq's strategies and its backoff level counter.

A strategy maps a backoff level (go-nsq's "attempt", 1 for the first
failure) to seconds. The counter mirrors go-nsq's
`startStopContinueBackoff`: a failure raises the level only while the
*uncapped* duration of the next level still fits in
`max_backoff_duration`, so a long run of failures stops climbing at the
highest level that fits and the same number of successes brings the
consumer back (instead of an unbounded level that would take as many
successes as there were failures to undo).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "exponential",
    "full_jitter",
    "STRATEGIES",
    "get_strategy",
    "BackoffCounter",
]


class _Rng(Protocol):
    """What a strategy draws from: a random.Random, or the random module itself."""

    def randrange(self, start: int, stop: int | None = ..., step: int = ...) -> int: ...


# (level, config, rng) -> seconds, not capped.
RawStrategy = Callable[[int, object, _Rng], float]


def _exponential_raw(attempt: int, config, rng: _Rng) -> float:
    return config.backoff_multiplier * 2.0 ** attempt


def _full_jitter_raw(attempt: int, config, rng: _Rng) -> float:
    # go-nsq draws a whole number of nanoseconds in [0, multiplier × 2^attempt).
    ceiling = config.backoff_multiplier * 2.0 ** attempt
    if ceiling <= 0:
        return 0.0
    return rng.randrange(int(ceiling * 1e9)) / 1e9


_RAW: dict[str, RawStrategy] = {
    "exponential": _exponential_raw,
    "full_jitter": _full_jitter_raw,
}


def exponential(attempt: int, config, rng: random.Random | None = None) -> float:
    """`backoff_multiplier × 2**attempt` seconds, at most `max_backoff_duration`."""
    return min(_exponential_raw(attempt, config, rng or random), config.max_backoff_duration)


def full_jitter(attempt: int, config, rng: random.Random | None = None) -> float:
    """Uniform in [0, `backoff_multiplier × 2**attempt`), at most `max_backoff_duration`.

    Spreads the retries of many consumers that failed at the same moment
    (AWS's "full jitter").
    """
    return min(_full_jitter_raw(attempt, config, rng or random), config.max_backoff_duration)


STRATEGIES: dict[str, Callable[..., float]] = {
    "exponential": exponential,
    "full_jitter": full_jitter,
}


def get_strategy(name: str) -> Callable[..., float]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown backoff_strategy {name!r}") from None


class BackoffCounter:
    """go-nsq's backoff level and the duration it asks for.

    Pure state: the consumer decides when a signal counts (never while a
    backoff timer runs) and what to do with the answer.
    """

    __slots__ = ("config", "level", "_raw", "_rng")

    def __init__(self, config, rng: random.Random | None = None) -> None:
        self.config = config
        self.level = 0
        name = getattr(config, "backoff_strategy", "exponential")
        try:
            self._raw = _RAW[name]
        except KeyError:
            raise ValueError(f"unknown backoff_strategy {name!r}") from None
        self._rng = rng or random.Random()

    def failure(self) -> bool:
        """One level up unless that level's wait would exceed the maximum.

        With `max_backoff_duration` 0 the level never rises: no backoff.
        """
        if self._raw(self.level + 1, self.config, self._rng) <= self.config.max_backoff_duration:
            self.level += 1
            return True
        return False

    def success(self) -> bool:
        """One level down; False when already at 0."""
        if self.level > 0:
            self.level -= 1
            return True
        return False

    def duration(self) -> float:
        """Seconds to wait at the current level, capped by `max_backoff_duration`."""
        return min(self._raw(self.level, self.config, self._rng), self.config.max_backoff_duration)
