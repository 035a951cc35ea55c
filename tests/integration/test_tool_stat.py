"""mq-stat end to end: real mqlookupd + two mqd, the tool run as a process, its rows against /stats.

Between two polls the test changes the cluster (publishes, then consumes
with a raw connection), waits for the brokers to show the change, and
checks the next row against both brokers' own /stats: the totals, and the
two rates as nsq_stat computes them from the previous poll.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from urllib.parse import quote

import pytest

from tests.support.processes import FAST_SCAN, child_env, http_request, wait_for
from tests.support.raw_conn import RawConn, command

HEADER = [
    "------rate------+----------------depth----------------+--------------metadata---------------",
    "ingress  egress |   total     mem    disk inflt   def |     req     t-o         msgs clients",
]
KEYS = ("depth", "backend_depth", "in_flight_count", "deferred_count", "requeue_count", "timeout_count",
        "message_count", "client_count")


def mq_stat_command(*args: str) -> list[str]:
    """The installed console script when there is one, else the module."""
    script = os.path.join(os.path.dirname(sys.executable), "mq-stat")
    if os.path.exists(script):
        return [script, *args]
    return [sys.executable, "-m", "mqd.tools.stat", *args]


class Tool:
    """mq-stat as a child process whose stdout is read line by line, each read with a deadline."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(mq_stat_command(*args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=child_env(), bufsize=0)
        self._buf = b""
        self.lines: list[str] = []
        self.rest = b""  # stdout after the last line read, once finished

    def line(self, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise AssertionError(f"no line from mq-stat within {timeout}s; so far {self.lines}\n"
                                         f"{self.finish()[1]}")
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"mq-stat ended; so far {self.lines}\n{self.finish()[1]}")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        self.lines.append(raw.decode())
        return self.lines[-1]

    def finish(self, timeout: float = 10.0) -> tuple[int, str]:
        """(exit status, stderr) once it has ended (killed after `timeout`)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.rest = self._buf + out
        return self.proc.returncode, err.decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def cluster(start_lookupd, start_broker):
    lookupd = start_lookupd()
    brokers = [start_broker(*FAST_SCAN, "--broadcast-address=127.0.0.1",
                            f"--lookupd-tcp-address={lookupd.tcp_address}") for _ in range(2)]
    return lookupd, brokers


def channel_stats(broker, topic: str, channel: str) -> dict:
    status, doc = broker.get(f"/stats?format=json&topic={quote(topic)}&channel={channel}")
    assert status == 200, doc
    [topic_doc] = doc["topics"]
    [channel_doc] = topic_doc["channels"]
    return channel_doc


def totals(brokers, topic: str, channel: str) -> dict:
    """Both brokers' channel counters summed, as the test computes them (not the tool's code)."""
    docs = [channel_stats(b, topic, channel) for b in brokers]
    return {k: sum(d[k] for d in docs) for k in KEYS}


def expected_row(now: dict, before: dict, interval: float) -> list[int]:
    messages = now["message_count"] - before["message_count"]
    depth_change = now["depth"] - before["depth"]
    return [int(messages / interval), int((messages - depth_change) / interval),
            now["depth"], now["depth"] - now["backend_depth"], now["backend_depth"], now["in_flight_count"],
            now["deferred_count"], now["requeue_count"], now["timeout_count"], now["message_count"],
            now["client_count"]]


def tool_stderr(err: str) -> list[str]:
    """stderr's lines: tools.flags.run lets none of Twisted's own info lines through."""
    return err.splitlines()


def parse_row(line: str) -> list[int]:
    parts = line.split()
    assert parts[2] == parts[8] == "|", line
    return [int(p) for i, p in enumerate(parts) if i not in (2, 8)]


def create(broker, topic: str, channel: str) -> None:
    assert broker.post(f"/topic/create?topic={quote(topic)}") == 200
    assert broker.post(f"/channel/create?topic={quote(topic)}&channel={channel}") == 200


def publish(broker, topic: str, count: int, tag: str) -> None:
    for i in range(count):
        status, body = http_request(broker.http_address, "POST", f"/pub?topic={quote(topic)}",
                                    f"{tag}-{i}".encode())
        assert (status, body) == (200, b"OK")


def test_rows_match_the_brokers_stats_through_lookupd(cluster, name):
    lookupd, (b1, b2) = cluster
    topic, channel, interval = name("t"), "c", 2.0
    for broker in (b1, b2):
        create(broker, topic, channel)

    def listed() -> bool:
        status, doc = lookupd.get(f"/lookup?topic={quote(topic)}")
        return status == 200 and {p["http_port"] for p in doc["producers"]} == {b1.http_port, b2.http_port}

    wait_for(listed, what="both brokers listed by lookupd")
    publish(b1, topic, 5, "a")
    publish(b2, topic, 3, "b")
    first = totals((b1, b2), topic, channel)
    assert (first["depth"], first["message_count"]) == (8, 8)

    tool = Tool(f"-topic={topic}", "--channel", channel, "--lookupd-http-address", lookupd.http_address,
                "--count=2", "-status-every=2s")
    try:
        assert [tool.line(), tool.line()] == HEADER  # poll 0 is done: the rates' starting point

        # Before poll 1: six more messages.
        publish(b1, topic, 4, "c")
        publish(b2, topic, 2, "d")
        second = totals((b1, b2), topic, channel)
        row1 = parse_row(tool.line())
        assert row1 == expected_row(second, first, interval)
        assert row1[:3] == [3, 0, 14]  # 6 / 2 s in, none out, 14 queued

        # Before poll 2: a consumer on b1 takes three, finishes one, defers one (REQ 60 s) and is sent two more.
        with RawConn(b1) as conn:
            conn.send(command(f"SUB {topic} {channel}"))
            assert conn.read_frame() == (0, b"OK")
            conn.send(command("RDY 3"))
            ids = [conn.read_message()[2] for _ in range(3)]
            conn.send(command(b"FIN " + ids[0]) + command(b"REQ " + ids[1] + b" 60000"))
            conn.read_message(), conn.read_message()

            def settled():
                now = channel_stats(b1, topic, channel)
                return (now["in_flight_count"], now["deferred_count"], now["requeue_count"]) == (3, 1, 1)

            wait_for(settled, what="b1 to show 3 in flight, 1 deferred")
            third = totals((b1, b2), topic, channel)
            row2 = parse_row(tool.line())
        assert row2 == expected_row(third, second, interval)
        # 14 - 5 delivered = 9 queued; 3 in flight, 1 deferred, 1 requeue, 1 client.
        assert row2[2:9] == [9, 9, 0, 3, 1, 1, 0]
        assert row2[10] == 1
        assert row2[1] == int((third["message_count"] - 14 + 5) / interval)

        code, err = tool.finish()
        assert code == 0, err
        assert tool_stderr(err) == ["--status-every is deprecated, use --interval"]
        assert tool.rest == b"" and len(tool.lines) == 4  # --count=2: two rows, then it exits
    finally:
        tool.kill()


def test_nsqd_addresses_instead_of_lookupd(start_broker, name):
    brokers = [start_broker(*FAST_SCAN) for _ in range(2)]
    topic = name("t")
    for i, broker in enumerate(brokers):
        create(broker, topic, "c")
        publish(broker, topic, i + 2, "x")
    expected = totals(brokers, topic, "c")
    args = [f"--nsqd-http-address={b.http_address}" for b in brokers]
    tool = Tool(f"--topic={topic}", "--channel=c", "--interval=200ms", "--count=1", *args)
    try:
        assert [tool.line(), tool.line()] == HEADER
        assert parse_row(tool.line()) == expected_row(expected, expected, 0.2)
        code, err = tool.finish()
        assert (code, tool_stderr(err)) == (0, [])
    finally:
        tool.kill()


def test_unknown_channel_is_fatal(twistd_broker, name):
    topic = name("t")
    assert twistd_broker.post(f"/topic/create?topic={quote(topic)}") == 200
    tool = Tool(f"--topic={topic}", "--channel=nope", f"--nsqd-http-address={twistd_broker.http_address}")
    code, err = tool.finish()
    assert code == 1
    assert tool_stderr(err) == [f"ERROR: failed to find channel(nope) in stats metadata for topic({topic})"]
    assert tool.rest == b""  # not even the header: nsq_stat prints it only with the first totals
