"""mqd.client.backoff: go-nsq's backoff strategies and level counter."""

from __future__ import annotations

import random

import pytest

from mqd.client.backoff import BackoffCounter, exponential, full_jitter, get_strategy
from mqd.client.config import Config


def test_exponential_doubles_from_the_multiplier_and_is_capped():
    config = Config(backoff_multiplier=1.0, max_backoff_duration=10.0)
    assert [exponential(a, config) for a in range(6)] == [1, 2, 4, 8, 10, 10]
    config = Config(backoff_multiplier="250ms", max_backoff_duration="2m")
    assert [exponential(a, config) for a in range(4)] == [0.25, 0.5, 1.0, 2.0]


def test_full_jitter_stays_below_the_exponential_ceiling_and_the_cap():
    rng = random.Random(7)
    config = Config(backoff_multiplier=1.0, max_backoff_duration=5.0)
    for attempt in range(6):
        values = [full_jitter(attempt, config, rng) for _ in range(200)]
        ceiling = min(2.0 ** attempt, 5.0)
        assert all(0 <= v < 2.0 ** attempt and v <= 5.0 for v in values)
        # really random, and spread over the range
        assert len(set(values)) > 20
        assert max(values) > ceiling * 0.8


def test_full_jitter_with_zero_multiplier_is_zero():
    assert full_jitter(3, Config(backoff_multiplier=0.0)) == 0.0


def test_get_strategy():
    assert get_strategy("exponential") is exponential
    assert get_strategy("full_jitter") is full_jitter
    with pytest.raises(ValueError, match="backoff_strategy"):
        get_strategy("linear")


def test_counter_climbs_only_while_the_next_level_fits():
    """go-nsq: the level stops at the highest 2^level × multiplier ≤ max."""
    counter = BackoffCounter(Config(backoff_multiplier=1.0, max_backoff_duration="2m"))
    durations = []
    for _ in range(9):
        counter.failure()
        durations.append(counter.duration())
    assert durations == [2, 4, 8, 16, 32, 64, 64, 64, 64]
    assert counter.level == 6
    # as many successes as levels bring it back to 0
    for expected in range(5, -1, -1):
        assert counter.success()
        assert counter.level == expected
    assert not counter.success()
    assert counter.level == 0


def test_counter_duration_capped_by_max_backoff_duration():
    counter = BackoffCounter(Config(backoff_multiplier=1.0, max_backoff_duration=10.0))
    levels = []
    for _ in range(5):
        counter.failure()
        levels.append((counter.level, counter.duration()))
    assert levels == [(1, 2), (2, 4), (3, 8), (3, 8), (3, 8)]


def test_zero_max_backoff_duration_disables_backoff():
    counter = BackoffCounter(Config(max_backoff_duration=0.0))
    assert not counter.failure()
    assert counter.level == 0


def test_full_jitter_counter_durations_within_bounds():
    config = Config(backoff_strategy="full_jitter", backoff_multiplier=1.0,
                    max_backoff_duration=30.0)
    counter = BackoffCounter(config, random.Random(3))
    for _ in range(10):
        counter.failure()
        assert 0 <= counter.duration() < 2.0 ** counter.level
        assert counter.duration() <= 30.0
    assert counter.level >= 4
