"""`mq-tail --offset` / `--since` end to end: the tool as a process reading a real `twistd mqd`'s retained log.

One broker with `--retention-bytes` serves the module; each test uses
topics of its own. The tool is given the broker's TCP address, as for a
channel: it finds the HTTP port in the IDENTIFY answer.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from tests.support.cli_tools import TIMEOUT, has_channel, tool
from tests.support.processes import FAST_SCAN, BrokerProcess, http_request, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path_factory.mktemp("retaining"), [*FAST_SCAN, "--retention-bytes=10MB"])
    try:
        yield process.start()
    finally:
        process.kill()


def publish(broker: BrokerProcess, topic: str, bodies: list[bytes]) -> None:
    status, answer = http_request(broker.http_address, "POST", f"/mpub?topic={topic}", b"\n".join(bodies))
    assert status == 200, (status, answer)


def lines(n: int, prefix: str = "m", first: int = 0) -> list[bytes]:
    return [f"{prefix}{i} ünïcode".encode() for i in range(first, first + n)]


def tail(broker: BrokerProcess, topic: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(tool("tail", f"--topic={topic}", f"--nsqd-tcp-address={broker.tcp_address}", *args),
                          capture_output=True, timeout=TIMEOUT)


def ok(proc: subprocess.CompletedProcess) -> list[bytes]:
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "Traceback" not in err, err
    return proc.stdout.splitlines()


def test_offsets_and_since_print_the_retained_messages_in_order_without_a_channel(broker, name):
    topic = name()
    publish(broker, topic, lines(100))
    time.sleep(0.05)
    between = datetime.now(UTC)
    time.sleep(0.05)
    publish(broker, topic, lines(20, "later", 100))

    assert ok(tail(broker, topic, "--offset=earliest", "-n", "100")) == lines(100)
    assert ok(tail(broker, topic, "--offset=50", "--n=10")) == lines(100)[50:60]
    since = between.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    assert ok(tail(broker, topic, f"--since={since}", "-n", "20")) == lines(20, "later", 100)
    assert ok(tail(broker, topic, "--since=1h", "-n", "120", "--print-topic")) == [
        topic.encode() + b" | " + line for line in lines(100) + lines(20, "later", 100)]
    # Nothing was consumed: no channel, and the topic's own queue is as it was.
    assert not has_channel(broker, topic)


def test_an_offset_out_of_range_exits_1_naming_earliest_and_latest(broker, name):
    topic = name()
    publish(broker, topic, lines(3))
    proc = tail(broker, topic, "--offset=1000")
    assert proc.returncode == 1 and proc.stdout == b""
    assert proc.stderr.decode().splitlines()[-1] == (
        f"offset 1000 is out of range for topic {topic} on nsqd 127.0.0.1:{broker.http_port}: earliest 0, latest 3")


def test_a_topic_without_retention_exits_1_in_one_line(broker, name):
    topic = name()
    publish(broker, topic, lines(1))
    status, answer = http_request(broker.http_address, "POST", f"/topic/retention?topic={topic}&time=0&bytes=0")
    assert status == 200, answer
    proc = tail(broker, topic, "--offset=earliest")
    assert proc.returncode == 1
    assert proc.stderr.decode().splitlines()[-1].startswith(
        f"topic {topic} on nsqd 127.0.0.1:{broker.http_port} keeps no retained log: retention is off for it")


def test_tailing_follows_new_messages_and_a_topic_deleted_and_created_again(broker, name):
    topic = name()
    publish(broker, topic, lines(5, "old"))
    proc = subprocess.Popen(tool("tail", f"--topic={topic}", f"--nsqd-tcp-address={broker.tcp_address}",
                                 "--offset=5", "-n", "6"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)  # unbuffered: see _line
    try:
        time.sleep(0.5)  # a few polls at the end of the log
        publish(broker, topic, lines(3, "new"))
        assert [_line(proc) for _ in range(3)] == lines(3, "new")
        # Deleted and created again while the tool tails it: a new log, read from its start.
        status, _ = http_request(broker.http_address, "POST", f"/topic/delete?topic={topic}")
        assert status == 200
        time.sleep(0.5)
        publish(broker, topic, lines(3, "again"))
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    err_text = err.decode()
    assert proc.returncode == 0, err_text
    assert out.splitlines() == lines(3, "again")
    assert "was deleted and created again" in err_text and "reading on from its earliest offset 0" in err_text


def _line(proc: subprocess.Popen) -> bytes:
    """The tool's next line of output, within TIMEOUT (stdout unbuffered, so select sees every byte not read)."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
    assert ready, "the tool printed nothing"
    return proc.stdout.readline().rstrip(b"\n")


def test_through_lookupd_every_producers_log_is_read(start_broker, start_lookupd, name):
    lookupd = start_lookupd()
    brokers = [start_broker(*FAST_SCAN, "--retention-bytes=1MB", "--broadcast-address=127.0.0.1",
                            f"--lookupd-tcp-address={lookupd.tcp_address}") for _ in range(2)]
    topic = name()
    publish(brokers[0], topic, lines(3, "one"))
    publish(brokers[1], topic, lines(2, "two"))
    wait_for(lambda: len((lookupd.get(f"/lookup?topic={topic}")[1] or {}).get("producers") or ()) == 2,
             TIMEOUT, "both brokers registered")
    proc = subprocess.run(tool("tail", f"--topic={topic}", f"--lookupd-http-address={lookupd.http_address}",
                               "--offset=earliest", "-n", "5"), capture_output=True, timeout=TIMEOUT)
    got = ok(proc)
    # Interleaved as the answers came; each broker's in its own order.
    assert sorted(got) == sorted(lines(3, "one") + lines(2, "two"))
    assert [g for g in got if g.startswith(b"one")] == lines(3, "one")
    assert [g for g in got if g.startswith(b"two")] == lines(2, "two")
