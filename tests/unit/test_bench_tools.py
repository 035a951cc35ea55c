"""Pure helpers of the memory, latency, flame and compare benchmarks.

Figures are never asserted; these check the arithmetic the reports rest on:
py-spy's collapsed stacks read right, percentiles, the writer's pacing
schedule, the per-message memory sums, the rates NSQ's bench_writer and
bench_reader print, and which targets and loads ``compare`` accepts.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness import broker as bench_broker
from bench.harness.broker import Sampler
from bench.harness.load import due_commands
from bench.harness.nsqtools import (
    channel_names,
    deadline_after,
    go_duration,
    parse_tool_output,
)
from bench.harness.pyspy import frame_counts, frame_name, top, top_table
from bench.harness.session import Result
from bench.scenarios.compare import cpu_list, cpu_per_message, table, target_argv
from bench.scenarios.compare import parse_args as compare_args
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


# What NSQ 1.3.0's programs print on stderr at the end of a run.
WRITER_OUTPUT = (
    "[bench_writer] 2026/11/27 01:49:11 duration: 2.000832417s - 221.160mb/s "
    "- 1159517.399ops/s - 0.862us/op\n"
)
READER_OUTPUT = (
    "[bench_reader] 2026/11/27 01:49:13 sleeping until 2026-11-27 01:49:13 +0000 UTC (1.2s)\n"
    "[bench_reader] 2026/11/27 01:49:15 duration: 2.001126517s - 104.993mb/s "
    "- 550463.447ops/s - 1.817us/op\n"
)


def test_parse_tool_output_reads_the_rate_and_duration():
    w = parse_tool_output(WRITER_OUTPUT, "bench_writer")
    assert w.rate == pytest.approx(1159517.399)
    assert w.seconds == pytest.approx(2.000832417)
    assert w.messages == round(2.000832417 * 1159517.399)
    r = parse_tool_output(READER_OUTPUT, "bench_reader")
    assert r.rate == pytest.approx(550463.447)
    # An idle reader: no messages, so Go prints +Inf us/op.
    idle = parse_tool_output("duration: 8.0001s - 0.000mb/s - 0.000ops/s - +Infus/op")
    assert idle.rate == 0.0 and idle.messages == 0


def test_parse_tool_output_without_a_rate_line_is_a_bench_error():
    with pytest.raises(bench_broker.BenchError, match="no 'duration"):
        parse_tool_output("panic: E_BAD_TOPIC\n", "bench_writer")


def test_go_duration_reads_go_duration_strings():
    assert go_duration("8.000512s") == pytest.approx(8.000512)
    assert go_duration("1m0.5s") == pytest.approx(60.5)
    assert go_duration("950ms") == pytest.approx(0.95)
    assert go_duration("12.5µs") == pytest.approx(12.5e-6)
    with pytest.raises(ValueError):
        go_duration("8 seconds")


def test_deadline_is_a_whole_utc_second_ahead():
    now = 1_700_000_000.25
    text, at = deadline_after(1.5, now)
    assert at == 1_700_000_002.0
    assert text == time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))


def test_channel_names_keep_the_usual_channel_first():
    assert channel_names("ch", 1) == ["ch"]
    assert channel_names("ch", 3) == ["ch", "ch1", "ch2"]


@pytest.fixture
def nsq_bin(tmp_path, monkeypatch):
    """A directory of stand-in NSQ programs; no default $NSQD_BIN or directory beside the checkout."""
    monkeypatch.delenv(bench_broker.NSQD_BIN_ENV, raising=False)
    monkeypatch.setattr(bench_broker, "NSQ_BIN_BESIDE", tmp_path / "absent")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("nsqd", "bench_writer", "bench_reader"):
        path = bindir / name
        path.write_text("#!/bin/sh\n")
        os.chmod(path, 0o755)
    return bindir


def test_compare_takes_nsqd_as_a_target_and_the_nsq_load(nsq_bin):
    mine, args = compare_args(
        ["--targets", "nsqd,new", "--nsqd", str(nsq_bin), "--load", "nsq", "--channels", "3"]
    )
    assert mine.targets == ("new", "nsqd")
    assert args.nsqd == str(nsq_bin / "nsqd")
    assert args.bench_writer == str(nsq_bin / "bench_writer")
    assert args.bench_reader == str(nsq_bin / "bench_reader")
    assert (args.load, args.channels, args.batch) == ("nsq", 3, 200)


def test_compare_finds_nsq_through_the_environment(nsq_bin, monkeypatch):
    monkeypatch.setenv(bench_broker.NSQD_BIN_ENV, str(nsq_bin / "nsqd"))
    _, args = compare_args(["--targets", "new,nsqd", "--batch", "50"])
    assert args.nsqd == str(nsq_bin / "nsqd")
    assert args.load == "ours" and args.batch == 50 and args.bench_writer is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--targets", "new,nsqd"], "need NSQ's binaries"),
        (["--targets", "new", "--load", "nsq"], "need NSQ's binaries"),
        (["--targets", "new,nsqd", "--nsqd", "/nonexistent/nsqd"], "not an executable nsqd"),
        (["--targets", "new,bogus"], "subset of old,new,probe,nsqd"),
        (["--targets", "new", "--channels", "3"], "--channels needs --load nsq"),
        (["--targets", "new", "--channels", "0"], "at least 1"),
        (["--targets", "new", "--load", "nsq", "--count", "1000", "--nsqd", "BIN"], "--count"),
        (["--targets", "new", "--pin-broker", "x"], "--pin-broker / --pin-load"),
        (["--targets", "new", "--pin-load", "100000"], "no such CPU here"),
        (["--targets", "new", "--pin-broker", "1-0"], "bad CPU range"),
    ],
)
def test_compare_rejects_targets_and_flags_it_cannot_run(nsq_bin, capsys, argv, message):
    argv = [str(nsq_bin) if a == "BIN" else a for a in argv]
    with pytest.raises(SystemExit):
        compare_args(argv)
    assert message in capsys.readouterr().err


def test_compare_pins_every_broker_with_taskset_and_reports_it(nsq_bin):
    cpu = min(os.sched_getaffinity(0))
    _, args = compare_args(["--targets", "old,new,nsqd", "--nsqd", str(nsq_bin), "--pin-broker", str(cpu),
                            "--pin-load", f"{cpu}-{cpu}"])
    assert args.pin_broker == args.pin_load == {cpu}
    for target in ("new", "old", "nsqd", "probe"):
        argv = target_argv(target, args, Path("/old-tree"))
        assert argv[:3] == ["taskset", "-c", str(cpu)], target
    assert target_argv("old", args, Path("/old-tree"))[3:5] == ["env", "PYTHONPATH=/old-tree"]
    _, unpinned = compare_args(["--targets", "new"])
    assert unpinned.pin_broker is None and target_argv("new", unpinned, None)[0] != "taskset"


def test_cpu_lists_read_as_taskset_reads_them():
    cpu = min(os.sched_getaffinity(0))
    assert cpu_list(str(cpu)) == {cpu}
    if {0, 1} <= os.sched_getaffinity(0):
        assert cpu_list("0,1") == cpu_list("0-1") == {0, 1}


def test_compare_table_gives_ratios_to_nsqd_for_mqd_rows():
    medians = {
        "new": {"both": Result("both", rate_in=300.0, rate_out=600.0)},
        "nsqd": {"both": Result("both", rate_in=400.0, rate_out=400.0)},
    }
    head, _, new_row, nsqd_row = table(medians, ("both",))
    assert "in ÷ nsqd | out ÷ nsqd" in head and "probe" not in head and "old" not in head
    assert "| 0.75 | 1.50 |" in new_row
    assert "| - | - |" in nsqd_row


def test_compare_table_gives_the_broker_cpu_per_message_out_or_else_in():
    medians = {
        # 80% of a core for 400,000 deliveries a second: 2 µs each.
        "new": {"both": Result("both", rate_in=200_000.0, rate_out=400_000.0, cpu_pct=80.0, wait_pct=9.0),
                "writer": Result("writer", rate_in=500_000.0, cpu_pct=100.0)},
        "nsqd": {"both": Result("both", rate_in=250_000.0, rate_out=500_000.0),
                 "writer": Result("writer", rate_in=600_000.0, cpu_pct=120.0)},
    }
    head, _, *rows = table(medians, ("both", "writer"))
    assert head.endswith("broker CPU | waited for CPU | CPU µs/msg | peak RSS (MB) |")
    new_both, nsqd_both, new_writer, nsqd_writer = rows
    # The last four cells: broker CPU, its wait for a CPU, CPU per message, peak RSS.
    assert new_both.endswith("| 80% | 9% | 2.00 | - |")
    assert nsqd_both.endswith("| - | - | - | - |")  # no CPU figure, no per-message cost
    assert new_writer.endswith("| 100% | - | 2.00 | - |")
    assert nsqd_writer.endswith("| 120% | - | 2.00 | - |")
    assert cpu_per_message(Result("reader", cpu_pct=50.0)) is None


def test_sampler_tells_waiting_for_a_cpu_from_idle():
    """Three processes spinning on one CPU each wait for it most of the time; a sleeping one never does."""
    spin = [sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(3)]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy, idle = Sampler(spinners[0].pid), Sampler(sleeper.pid)
        time.sleep(0.3)  # the interpreters start, then spin
        busy.reset()
        idle.reset()
        time.sleep(1.0)
        _, busy_cpu = busy.window()
        _, idle_cpu = idle.window()
    finally:
        for p in (*spinners, sleeper):
            p.kill()
            p.wait()
    # One CPU shared three ways: about a third each, and about two thirds waiting.
    assert busy.wait_pct is not None and busy.wait_pct > 30
    assert busy_cpu < 70
    assert idle.wait_pct is not None and idle.wait_pct < 5 and idle_cpu < 5
