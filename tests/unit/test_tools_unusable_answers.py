"""The tools' line for a broker answer they cannot use: go-nsq's, NSQ's tools' exit 1.

The TCP tools (mq-tail, mq-to-file, mq-pub) get the client's
HandshakeRefusedError and print its `nsq_text`
(tests/integration/test_tools_unusable_answer.py runs them against a fake
broker); mq-stat reads /stats and /lookup into nsq's Go structs, so a
number no int64 holds fails the poll as nsq_stat's json.Unmarshal does.
"""

from __future__ import annotations

import io

from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure

from mqd.client.errors import UnusableAnswerError
from mqd.tools import pub, stat
from mqd.tools.flags import ToolError

HUGE = 10**30


def test_pub_prints_go_nsqs_text_of_an_unusable_identify_answer():
    error = UnusableAnswerError("IDENTIFY answer field max_rdy_count is not an integer: 10**30",
                                "failed to IDENTIFY - json: cannot unmarshal number ...")
    assert pub.go_nsq_text(Failure(error), "127.0.0.1:4150") == error.nsq_text


class Answers:
    """Upstream's get_json answering every URL from `answer(url)`."""

    def __init__(self, answer) -> None:
        self.answer = answer

    def get_json(self, url: str) -> defer.Deferred:
        return defer.succeed(self.answer(url))

    def close(self) -> defer.Deferred:
        return defer.succeed(None)


def _stats(depth: int) -> dict:
    channel = {"channel_name": "ch", "depth": depth, "backend_depth": 0, "in_flight_count": 0,
               "deferred_count": 0, "message_count": 0, "requeue_count": 0, "timeout_count": 0,
               "client_count": 0, "clients": None, "paused": False}
    return {"version": "1.3.0", "health": "OK", "start_time": 1, "producers": None,
            "topics": [{"topic_name": "t", "depth": 0, "backend_depth": 0, "message_count": 0,
                        "paused": False, "channels": [channel]}]}


def _poll_once(answer) -> tuple[list[Failure], str]:
    options = stat.parse_args(["--topic=t", "--channel=ch", "--nsqd-http-address=127.0.0.1:4151",
                               "--count=1"])

    def answering(url: str):
        return {"version": "1.3.0", "broadcast_address": "127.0.0.1", "hostname": "h",
                "tcp_port": 4150, "http_port": 4151} if "/info" in url else answer(url)

    out = io.StringIO()
    d = stat.stat_loop(MemoryReactorClock(), options, out, Answers(answering))
    failures: list[Failure] = []
    d.addErrback(failures.append)
    return failures, out.getvalue()


def test_stat_ends_with_one_error_line_on_a_depth_no_int64_holds():
    failures, out = _poll_once(lambda url: _stats(HUGE))
    assert failures and failures[0].check(ToolError)
    text = str(failures[0].value)
    assert "\n" not in text
    assert text.startswith("ERROR: failed to get nsqd stats - failed to query any nsqd: ")
    assert f"json: cannot unmarshal number {HUGE}" in text and text.endswith("of type int64")
    assert out == ""


def test_stat_takes_the_largest_depth_an_int64_holds():
    failures, out = _poll_once(lambda url: _stats(2**63 - 1))
    assert failures == [] and "ingress" in out  # the first poll printed the header
