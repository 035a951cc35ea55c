"""The client benchmark's pure helpers: /stats parsing, py-spy summaries, medians.

The benchmark's figures are never asserted; these check that what it reads
(the broker's /stats, py-spy's collapsed stacks) is read right.
"""

from __future__ import annotations

import pytest

from bench.harness.broker import REPO
from bench.harness.pyspy import strip_line as _strip_line
from bench.harness.pyspy import top_frames
from bench.harness.report import ratio
from bench.harness.wire import channel_counts
from bench.scenarios.client import medians

STATS = {
    "version": "1.3.0",
    "topics": [
        {"topic_name": "other", "channels": [{"channel_name": "ch", "depth": 9}]},
        {
            "topic_name": "client_sub",
            "channels": [
                {"channel_name": "x", "depth": 5, "in_flight_count": 1},
                {"channel_name": "ch", "depth": 7, "in_flight_count": 3},
            ],
        },
    ],
}


def test_channel_counts_flat_shape():
    assert channel_counts(STATS, "client_sub", "ch") == (7, 3)
    assert channel_counts(STATS, "client_sub", "x") == (5, 1)


def test_channel_counts_legacy_envelope():
    assert channel_counts({"status_code": 200, "data": STATS}, "client_sub", "ch") == (7, 3)


@pytest.mark.parametrize(("topic", "channel"), [("client_sub", "nope"), ("missing", "ch")])
def test_channel_counts_absent(topic, channel):
    assert channel_counts(STATS, topic, channel) is None
    assert channel_counts({"topics": None}, topic, channel) is None


def test_strip_line_drops_line_numbers_and_prefixes():
    assert _strip_line("send (bench/client.py:123)") == "send (bench/client.py)"
    site = "/tmp/venv/lib/python3.11/site-packages/twisted/internet/tcp.py:250"
    assert _strip_line(f"doRead ({site})") == "doRead (twisted/internet/tcp.py)"
    assert _strip_line(f"pub ({REPO}/mqd/client/protocol.py:9)") == "pub (mqd/client/protocol.py)"
    assert _strip_line("<native>") == "<native>"


def test_top_frames_self_and_total_share():
    collapsed = "\n".join(
        [
            "main (a.py:1);loop (a.py:2);parse (p.py:10) 6",
            "main (a.py:1);loop (a.py:2);parse (p.py:11) 2",  # same function, other line
            "main (a.py:1);loop (a.py:2);write (w.py:5) 2",
            "garbage line",
            "",
        ]
    )
    top = top_frames(collapsed, limit=2)
    assert top == [("parse (p.py)", 8, 80.0, 80.0), ("write (w.py)", 2, 20.0, 20.0)]


def test_top_frames_counts_recursion_once_in_total():
    top = top_frames("f (r.py:1);f (r.py:1);g (r.py:2) 4\nf (r.py:1) 4")
    assert dict((frame, (own, total)) for frame, _, own, total in top) == {
        "g (r.py)": (50.0, 50.0),
        "f (r.py)": (50.0, 100.0),
    }
    assert top_frames("") == []


def test_ratio():
    assert ratio(100.0, 150.0) == 1.5
    assert ratio(None, 150.0) is None
    assert ratio(0.0, 150.0) is None
    assert ratio(100.0, None) is None


def test_medians_skip_failed_runs():
    runs = [
        {"rate": 10.0, "ack_p50": 1.0, "ack_p99": 2.0, "client_cpu": 90.0, "broker_cpu": None},
        {"rate": 30.0, "ack_p50": 3.0, "ack_p99": 4.0, "client_cpu": 70.0, "broker_cpu": 50.0},
        {"rate": 20.0, "ack_p50": 2.0, "ack_p99": 3.0, "client_cpu": 80.0, "broker_cpu": 60.0},
        {"rate": 25.0, "ack_p50": 2.5, "ack_p99": 3.5, "client_cpu": 85.0, "client_us": 4.0},
        {"rate": 1.0, "error": "no progress for 10 s"},
    ]
    assert medians(runs) == {
        "runs": 4,
        "rate": 22.5,
        "ack_p50": 2.25,
        "ack_p99": 3.25,
        "client_cpu": 82.5,
        "client_us": 4.0,
        "broker_cpu": 55.0,
    }
    assert medians([{"rate": None, "error": "boom"}])["rate"] is None
