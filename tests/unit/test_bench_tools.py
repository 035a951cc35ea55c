"""Pure helpers of the memory, latency and flame benchmarks.

Figures are never asserted; these check the arithmetic the reports rest on:
py-spy's collapsed stacks read right, percentiles, the writer's pacing
schedule, and the per-message memory sums.
"""

from __future__ import annotations

import math

import pytest

from bench.harness.load import due_commands
from bench.harness.pyspy import frame_counts, frame_name, top, top_table
from bench.scenarios.latency import latency_summary, split_rate
from bench.scenarios.memory import nsqd_estimate, per_message, pymalloc_block

COLLAPSED = """\
<module> (twistd:8);run (twisted/base.py:1);doRead (twisted/tcp.py:10);_parse (mqd/nsqd/protocol/v2.py:400) 6
<module> (twistd:8);run (twisted/base.py:1);doRead (twisted/tcp.py:12);_parse (mqd/nsqd/protocol/v2.py:410) 2
<module> (twistd:8);run (twisted/base.py:1);deliver (mqd/nsqd/channel.py:200);send (libc.so.6) 1
<module> (twistd:8);run (twisted/base.py:2);f (a.py:1);f (a.py:2);f (a.py:3) 1
<module> (twistd:8);0x7f00aa (libc.so.6) 3
<module> (twistd:8);0x7f00bb (libc.so.6) 1
garbage line without a count
"""


def test_frame_name_drops_line_numbers_and_merges_unresolved_addresses():
    assert frame_name("_parse (mqd/nsqd/protocol/v2.py:400)") == "_parse (mqd/nsqd/protocol/v2.py)"
    assert frame_name("send (libc.so.6)") == "send (libc.so.6)"
    assert frame_name("0x7f00aa (libc.so.6)") == "? (libc.so.6)"
    assert frame_name("0x7f00aa") == "?"


def test_frame_counts_self_and_total():
    own, total, samples = frame_counts(COLLAPSED)
    assert samples == 14
    # One function's lines add up, for self and total alike.
    assert own["_parse (mqd/nsqd/protocol/v2.py)"] == 8
    assert total["doRead (twisted/tcp.py)"] == 8
    assert own["send (libc.so.6)"] == 1
    assert own["? (libc.so.6)"] == 4
    # Recursion counts a function once per stack in total, its leaf once in self.
    assert total["f (a.py)"] == 1
    assert own["f (a.py)"] == 1
    assert total["<module> (twistd)"] == 14
    assert total["run (twisted/base.py)"] == 10


def test_top_orders_by_samples_and_leaves_out_the_trunk():
    own, total, samples = frame_counts(COLLAPSED)
    assert top(own, samples, 2) == [
        ("_parse (mqd/nsqd/protocol/v2.py)", 8, pytest.approx(100 * 8 / 14)),
        ("? (libc.so.6)", 4, pytest.approx(100 * 4 / 14)),
    ]
    # <module> is in every stack: the trunk, left out below 90%.
    names = [f for f, _, _ in top(total, samples, 10, below=0.9)]
    assert "<module> (twistd)" not in names
    assert names[0] == "run (twisted/base.py)"
    assert top(own, 0) == []


def test_top_table_lists_self_and_total():
    text = top_table(COLLAPSED, limit=3)
    assert text.startswith("14 samples")
    self_part, total_part = text.split("top 3 by total")
    assert "_parse (mqd/nsqd/protocol/v2.py)" in self_part.splitlines()[2]
    assert "1 trunk frames" in total_part
    assert "run (twisted/base.py)" in total_part.splitlines()[1]


def test_latency_summary_percentiles_in_ms():
    values = [i * 1_000_000 for i in range(1, 1001)]  # 1..1000 ms
    s = latency_summary(values[::-1])
    assert s["samples"] == 1000
    assert s["p50"] == 500.0
    assert s["p99"] == 990.0
    assert s["p99.9"] == 999.0
    empty = latency_summary([])
    assert empty["p50"] is None and empty["p99.9"] is None


def test_split_rate_adds_up():
    rates = split_rate(300_000.0, 3)
    assert rates == [100_000.0] * 3
    assert math.isclose(sum(split_rate(1000.0, 7)), 1000.0)


def test_due_commands_follows_an_absolute_schedule():
    # 100 commands/s: command k is due at k * 10 ms; the first at once.
    assert due_commands(0.0, 100.0, 0) == 1
    assert due_commands(0.0095, 100.0, 1) == 0
    assert due_commands(0.010, 100.0, 1) == 1
    # Behind by 5 commands (slow acks): all of them are owed, to catch up.
    assert due_commands(0.0555, 100.0, 1) == 5
    # Ahead of schedule, or before the start: nothing.
    assert due_commands(0.02, 100.0, 10) == 0
    assert due_commands(-1.0, 100.0, 0) == 0


def test_pymalloc_block_rounds_to_size_classes():
    assert pymalloc_block(233) == 240  # a 200-byte body
    assert pymalloc_block(49) == 64  # a 16-byte id
    assert pymalloc_block(104) == 112  # a Message
    assert pymalloc_block(512) == 512
    assert pymalloc_block(513) == 528  # system malloc: header and alignment


def test_per_message_and_nsqd_estimate():
    assert per_message(1000, 1000 + 390_625, 1_000_000) == 400.0
    assert per_message(1, 2, 0) == 0.0
    low, mid, high = nsqd_estimate()
    # 1.2 GB / 2.4 M, 1.3 GB / 2.3 M, 1.4 GB / 2.2 M messages in memory.
    assert low == pytest.approx(500.0)
    assert mid == pytest.approx(1.3e9 / 2.3e6)
    assert high == pytest.approx(1.4e9 / 2.2e6)
