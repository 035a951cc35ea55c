"""The tools fail as NSQ's do: the same line on stderr and the same exit status, for scripts that grep them.

tests/fixtures/nsq_tools/errors.json holds what nsq_tail, nsq_stat and
to_nsq 1.3.0 printed for each bad input. The command-line cases run our
parsing and checks (nothing reaches a network); the run-time ones drive
the piece that words the failure.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from twisted.internet import defer, error
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure

from mqd.client.errors import error_from_frame
from mqd.clusterinfo.upstream import UpstreamError
from mqd.tools import pub, stat, tail
from mqd.tools.flags import ToolError, parse_checked

FIXTURE = Path(__file__).parent.parent / "fixtures" / "nsq_tools" / "errors.json"
CASES = {(c["tool"], c["case"]): c for c in json.loads(FIXTURE.read_text())["cases"]}

# Failures that happen once the tool runs; everything else is the command line.
RUN_TIME = {
    ("nsq_tail", "bad-max-in-flight"), ("nsq_tail", "bad-topic-name"), ("nsq_tail", "unreachable-nsqd"),
    ("to_nsq", "bad-topic-name"), ("to_nsq", "unreachable-nsqd"), ("to_nsq", "unterminated-line-bad-topic"),
    *((t, c) for t, c in CASES if t == "nsq_stat" and c.startswith(("unknown-", "unreachable-"))),
}
# go-nsq words a bad option value its own way after the part naming the flag.
OWN_REASON = {("nsq_tail", "bad-consumer-opt-value")}


def parse(tool: str, argv: list[str]) -> None:
    if tool == "nsq_stat":
        stat.parse_args(argv)
    else:
        module = tail if tool == "nsq_tail" else pub
        parse_checked(module.build_parser(), module.check_args, argv)


@pytest.mark.parametrize("key", [k for k in CASES if k not in RUN_TIME], ids="-".join)
def test_command_line_errors_match_nsq(key, capsys):
    case = CASES[key]
    with pytest.raises(SystemExit) as exit_:
        parse(case["tool"], case["args"])
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert exit_.value.code == case["exit"]
    if key in OWN_REASON:
        prefix = case["message"].split(": ", 1)[0] + ": "
        assert first.startswith(prefix)
    else:
        assert first == case["message"]
    assert err.splitlines()[1:2] == (["Usage of " + {"nsq_tail": "mq-tail", "nsq_stat": "mq-stat",
                                                     "to_nsq": "mq-pub"}[case["tool"]] + ":"]
                                     if case["usage_follows"] else [])


# -- run time ----------------------------------------------------------------------------


def test_tail_bad_topic_name_as_nsq_tail():
    case = CASES[("nsq_tail", "bad-topic-name")]
    args, _ = parse_checked(tail.build_parser(), tail.check_args, case["args"])
    d = defer.ensureDeferred(tail._main(Clock(), args))
    failures: list[Failure] = []
    d.addErrback(failures.append)
    assert failures[0].check(ToolError)
    assert str(failures[0].value) == case["message"]


@pytest.mark.parametrize("case_name, failure", [
    ("bad-topic-name", lambda: Failure(error_from_frame(b'E_BAD_TOPIC PUB topic name "bad!name" is not valid'))),
    ("unreachable-nsqd", lambda: Failure(error.ConnectionRefusedError())),
])
def test_pub_failed_publish_as_to_nsq(case_name, failure):
    case = CASES[("to_nsq", case_name)]
    address = next(a.split("=", 1)[1] for a in case["args"] if a.startswith("--nsqd-tcp-address="))
    assert pub.go_nsq_text(failure(), address) == case["message"]


class Answers:
    """Upstream's get_json answering every URL from `answer(url)`."""

    def __init__(self, answer) -> None:
        self.answer = answer

    def get_json(self, url: str) -> defer.Deferred:
        try:
            return defer.succeed(self.answer(url))
        except Exception as e:  # noqa: BLE001 - handed to the caller as the request's failure
            return defer.fail(e)

    def close(self) -> defer.Deferred:
        return defer.succeed(None)


def stats_doc(channel: str) -> dict:
    return {"version": "1.3.0", "health": "OK", "start_time": 1, "producers": None,
            "topics": [{"topic_name": "known", "depth": 0, "backend_depth": 0, "message_count": 0,
                        "paused": False,
                        "channels": [{"channel_name": channel, "depth": 0, "backend_depth": 0,
                                      "in_flight_count": 0, "deferred_count": 0, "message_count": 0,
                                      "requeue_count": 0, "timeout_count": 0, "client_count": 0,
                                      "clients": None, "paused": False}]}]}


NSQD_INFO = {"version": "1.3.0", "broadcast_address": "127.0.0.1", "hostname": "h",
             "tcp_port": 24150, "http_port": 24151}
LOOKUP = {"channels": ["ch"], "producers": [
    {"remote_address": "127.0.0.1:1", "hostname": "h", "broadcast_address": "127.0.0.1",
     "tcp_port": 24150, "http_port": 24151, "version": "1.3.0"}]}
NOT_FOUND = b'{"message":"TOPIC_NOT_FOUND"}'


def cluster_answer(url: str):
    """What the recorded cluster answered: lookupd and nsqd on their ports, nothing on 24199."""
    if ":24199" in url:
        raise UpstreamError(url, "connection refused")
    if "/lookup" in url:
        if "topic=known" in url:
            return LOOKUP
        raise UpstreamError(url, f"got response 404 {NOT_FOUND!r}", 404, NOT_FOUND)
    if "/info" in url:
        return NSQD_INFO
    if "topic=known" in url:
        return stats_doc("ch")
    return {**stats_doc("ch"), "topics": []}


@pytest.mark.parametrize("case_name", sorted(c for t, c in RUN_TIME if t == "nsq_stat"))
def test_stat_failures_as_nsq_stat(case_name):
    case = CASES[("nsq_stat", case_name)]
    options = stat.parse_args(case["args"])
    d = stat.stat_loop(MemoryReactorClock(), options, io.StringIO(), Answers(cluster_answer))
    failures: list[Failure] = []
    d.addErrback(failures.append)
    assert failures[0].check(ToolError)
    # mq-stat's /stats request also asks for include_mem=false; the rest of the line is nsq_stat's.
    assert str(failures[0].value).replace("&include_mem=false", "") == case["message"]
    assert case["exit"] == 1


def test_nsq_errors_joins_partial_failures_without_the_all_failed_prefix():
    lines = [SimpleNamespace(go="got response 500 Internal Server Error \"\"")] * 2
    assert stat.nsq_errors(lines, "nsqd", False) == "\n".join(line.go for line in lines)
    assert stat.nsq_errors([], "nsqd", True) == "failed to query any nsqd: "
