"""The CLI tools end to end: mq-pub, mq-tail, mq-to-file as subprocesses against twistd mqd."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.cli_tools import TIMEOUT, has_channel, tool
from tests.support.processes import FAST_SCAN, wait_for
from tests.support.raw_conn import RawConn, command

pytestmark = pytest.mark.slow


def pub(broker, topic: str, lines: list[bytes], *args: str, addresses=None) -> subprocess.CompletedProcess:
    addresses = addresses or [broker.tcp_address]
    flags = [f"--nsqd-tcp-address={a}" for a in addresses]
    proc = subprocess.run(
        tool("pub", f"--topic={topic}", *flags, *args),
        input=b"".join(line + b"\n" for line in lines),
        capture_output=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc


def start(name: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(tool(name, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            **kw)


def finish(proc: subprocess.Popen) -> tuple[bytes, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"tool did not exit\n{err.decode()}") from None
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in err.decode(), err.decode()
    return out, err.decode()


def channel_stats(broker, topic: str, channel: str) -> dict | None:
    _, stats = broker.get(f"/stats?format=json&topic={topic}")
    for t in stats["topics"] or []:
        if t["topic_name"] == topic:
            for c in t["channels"]:
                if c["channel_name"] == channel:
                    return c
    return None


def lines_of(n: int, prefix: str = "line") -> list[bytes]:
    return [f"{prefix} {i} ünïcode".encode() for i in range(n)]


# -- mq-pub | mq-tail ---------------------------------------------------------------------


def test_tail_prints_exactly_what_pub_sent(twistd_broker, name):
    topic = name()
    lines = lines_of(50)
    tail = start("tail", f"--topic={topic}", f"--nsqd-tcp-address={twistd_broker.tcp_address}", "-n", "50")
    wait_for(lambda: has_channel(twistd_broker, topic), TIMEOUT, "mq-tail's channel")
    pub(twistd_broker, topic, lines)
    out, _ = finish(tail)
    assert out.splitlines() == lines
    # The default channel is nsq_tail's ephemeral one, gone with the tool.
    wait_for(lambda: not has_channel(twistd_broker, topic), TIMEOUT, "the ephemeral channel to go")


def test_tail_print_topic_over_two_topics(twistd_broker, name):
    topics = [name(), name()]
    tail = start("tail", *(f"--topic={t}" for t in topics), "--print-topic",
                 f"--nsqd-tcp-address={twistd_broker.tcp_address}", "-n=20")
    wait_for(lambda: all(has_channel(twistd_broker, t) for t in topics), TIMEOUT, "both channels")
    for t in topics:
        pub(twistd_broker, t, lines_of(10, t))
    out, _ = finish(tail)
    got = out.splitlines()
    assert len(got) == 20
    for t in topics:
        assert [g for g in got if g.startswith(t.encode() + b" | ")] == [
            t.encode() + b" | " + line for line in lines_of(10, t)
        ]


def test_tail_through_lookupd(start_broker, start_lookupd, name):
    lookupd = start_lookupd()
    broker = start_broker(*FAST_SCAN, "--broadcast-address=127.0.0.1",
                          f"--lookupd-tcp-address={lookupd.tcp_address}")
    topic = name()
    lines = lines_of(30)
    pub(broker, topic, lines)  # the topic exists (and is registered) before the tail
    wait_for(lambda: lookupd.get(f"/lookup?topic={topic}")[0] == 200, TIMEOUT, "registration")
    tail = start("tail", f"--topic={topic}", f"--lookupd-http-address={lookupd.http_address}",
                 "-n", "30", "--channel=viaLookupd")
    out, _ = finish(tail)
    assert out.splitlines() == lines


def test_pub_to_several_brokers_publishes_every_line_to_each(start_broker, name):
    brokers = [start_broker(*FAST_SCAN), start_broker(*FAST_SCAN)]
    topic = name()
    pub(brokers[0], topic, lines_of(5), addresses=[b.tcp_address for b in brokers])
    for b in brokers:
        _, stats = b.get(f"/stats?format=json&topic={topic}")
        assert [t["message_count"] for t in stats["topics"] or [] if t["topic_name"] == topic] == [5]


def test_pub_failed_publish_exits_1_with_the_error(twistd_broker):
    proc = subprocess.run(
        tool("pub", "--topic=bad topic!", f"--nsqd-tcp-address={twistd_broker.tcp_address}"),
        input=b"x\n", capture_output=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 1
    assert "E_BAD_TOPIC" in proc.stderr.decode()


def test_pub_with_a_broker_down_exits_1_having_published_nowhere(twistd_broker, name):
    """As to_nsq: the broker that is up gets none of the lines, so running the input again adds no duplicate."""
    topic = name()
    proc = subprocess.run(
        tool("pub", f"--topic={topic}", f"--nsqd-tcp-address={twistd_broker.tcp_address}",
             "--nsqd-tcp-address=127.0.0.1:1"),
        input=b"".join(b"%d\n" % i for i in range(2000)), capture_output=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 1
    # to_nsq's line: Go's dial error and nothing else.
    assert "dial tcp 127.0.0.1:1: connect: connection refused\n" in proc.stderr.decode()
    _, stats = twistd_broker.get(f"/stats?format=json&topic={topic}")
    assert [t["message_count"] for t in stats["topics"] or [] if t["topic_name"] == topic] in ([], [0])


def test_pub_rate_paces_the_messages(twistd_broker, name):
    topic = name()
    rate, n = 20, 11
    pub(twistd_broker, topic, lines_of(n), f"--rate={rate}")
    with RawConn(twistd_broker, timeout=10) as conn:
        conn.send(command(f"SUB {topic} ch") + command(f"RDY {n}"))
        assert conn.read_frame() == (0, b"OK")
        stamps = sorted(conn.read_message()[0] for _ in range(n))
    spread = (stamps[-1] - stamps[0]) / 1e9
    # One token every 1/rate s: n messages take at least (n - 1) / rate, less a tick of slack.
    assert spread >= (n - 2) / rate, spread


def test_tool_errors_exit_1_in_nsqs_words(twistd_broker):
    for name, args, message in [
        ("tail", [f"--nsqd-tcp-address={twistd_broker.tcp_address}"], "--topic required"),
        ("tail", ["--topic=t"], "--nsqd-tcp-address or --lookupd-http-address required"),
        ("pub", [f"--nsqd-tcp-address={twistd_broker.tcp_address}"], "--topic required"),
        ("pub", ["--topic=t", "--delimiter=ab", "--nsqd-tcp-address=a:1"],
         "--delimiter must be a single byte"),
        # A bad pass-through option is a bad command line, as go-nsq's ConfigFlag makes it: exit 2.
        ("to_file", ["--topic=t", "--nsqd-tcp-address=a:1", "--consumer-opt=bogus,1"],
         'invalid value "bogus,1" for flag -consumer-opt: invalid option bogus'),
    ]:
        proc = subprocess.run(tool(name, *args), capture_output=True, timeout=TIMEOUT,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == (2 if "-opt" in args[-1] else 1), (name, args, proc.stderr)
        assert message in proc.stderr.decode(), (name, args, proc.stderr)


def test_version(twistd_broker):
    from mqd import __version__

    for name, prog in [("tail", "mq-tail"), ("pub", "mq-pub"), ("to_file", "mq-to-file")]:
        out = subprocess.run(tool(name, "-version"), capture_output=True, timeout=TIMEOUT).stdout
        assert out == f"{prog} v{__version__}\n".encode()


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_tail_started_with_sigint_ignored_still_stops_on_sigint(twistd_broker, name):
    """A script's `mq-tail ... &` inherits SIGINT ignored; Go's tools take it back, and so does mq-tail."""
    topic = name()
    proc = start("tail", f"--topic={topic}", f"--nsqd-tcp-address={twistd_broker.tcp_address}",
                 preexec_fn=_sigint_ignored)
    wait_for(lambda: has_channel(twistd_broker, topic), TIMEOUT, "mq-tail subscribed")
    proc.send_signal(signal.SIGINT)
    finish(proc)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_stat_stopped_by_a_signal_exits_0_with_nothing_on_stderr(twistd_broker, name, sig):
    """As nsq_stat, which ends on each of the three: the table so far on stdout, and no traceback."""
    topic = name()
    assert twistd_broker.post(f"/topic/create?topic={topic}") == 200
    assert twistd_broker.post(f"/channel/create?topic={topic}&channel=c") == 200
    proc = start("stat", f"--topic={topic}", "--channel=c", f"--nsqd-http-address={twistd_broker.http_address}")
    assert proc.stdout.readline().startswith(b"------rate------+")
    proc.send_signal(sig)
    _, err = finish(proc)
    assert err == ""


def test_tail_into_a_closed_pipe_dies_of_sigpipe_as_nsq_tail(twistd_broker, name):
    topic = name()
    proc = start("tail", f"--topic={topic}", f"--nsqd-tcp-address={twistd_broker.tcp_address}")
    pub(twistd_broker, topic, [b"first"])
    assert proc.stdout.readline() == b"first\n"
    proc.stdout.close()  # `| head -1` exits
    pub(twistd_broker, topic, [b"second"])
    assert proc.wait(timeout=TIMEOUT) == -signal.SIGPIPE
    err = proc.stderr.read()
    assert b"Traceback" not in err and b"Broken pipe" not in err, err.decode()


# -- mq-to-file ------------------------------------------------------------------------------


def to_file(broker, topic: str, out: Path, *args: str) -> subprocess.Popen:
    return start("to_file", f"--topic={topic}", f"--nsqd-tcp-address={broker.tcp_address}",
                 f"--output-dir={out}", *args)


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    return finish(proc)[1]


def all_finished(broker, topic: str, n: int) -> bool:
    c = channel_stats(broker, topic, "nsq_to_file")
    return bool(c and c["message_count"] == n and c["depth"] == 0 and c["in_flight_count"] == 0
                and c["client_count"] == 1)


def output(out: Path, gz: bool = False) -> list[bytes]:
    data = b""
    for path in sorted(out.iterdir()):
        raw = path.read_bytes()
        data += gzip.decompress(raw) if gz else raw
    return data.splitlines()


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_to_file_writes_exactly_the_published_lines(twistd_broker, name, tmp_path, gz):
    topic = name()
    lines = lines_of(300)
    pub(twistd_broker, topic, lines)
    out = tmp_path / "out"
    proc = to_file(twistd_broker, topic, out, "--sync-interval=200ms", *(["--gzip"] if gz else []))
    wait_for(lambda: all_finished(twistd_broker, topic, 300), TIMEOUT, "every message FINed")
    stop(proc)
    assert output(out, gz) == lines
    names = os.listdir(out)
    assert len(names) == 1 and names[0].startswith(f"{topic}.") and names[0].endswith(
        ".log.gz" if gz else ".log")
    c = channel_stats(twistd_broker, topic, "nsq_to_file")
    assert (c["depth"], c["in_flight_count"], c["requeue_count"]) == (0, 0, 0)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_to_file_rotate_size_files_concatenate_to_the_lines_in_order(twistd_broker, name, tmp_path, gz):
    topic = name()
    lines = lines_of(200)
    pub(twistd_broker, topic, lines)
    out, work = tmp_path / "out", tmp_path / "work"
    proc = to_file(twistd_broker, topic, out, "--rotate-size=1000", f"--work-dir={work}",
                   "--sync-interval=200ms", *(["--gzip"] if gz else []))
    wait_for(lambda: all_finished(twistd_broker, topic, 200), TIMEOUT, "every message FINed")
    stop(proc)
    assert len(os.listdir(out)) >= 4
    assert os.listdir(work) == []  # every file moved out when closed
    assert output(out, gz) == lines


def test_to_file_after_exit_all_messages_are_finished_and_the_channel_stays(twistd_broker, name, tmp_path):
    topic = name()
    proc = to_file(twistd_broker, topic, tmp_path / "out", "--sync-interval=100ms")
    wait_for(lambda: has_channel(twistd_broker, topic), TIMEOUT, "the channel")
    pub(twistd_broker, topic, lines_of(100))
    wait_for(lambda: all_finished(twistd_broker, topic, 100), TIMEOUT, "every message FINed")
    pub(twistd_broker, topic, lines_of(10, "late"))
    wait_for(lambda: all_finished(twistd_broker, topic, 110), TIMEOUT, "the late ones FINed")
    stop(proc)
    c = channel_stats(twistd_broker, topic, "nsq_to_file")
    assert (c["depth"], c["in_flight_count"], c["client_count"]) == (0, 0, 0)
    assert output(tmp_path / "out") == lines_of(100) + lines_of(10, "late")


def test_to_file_sigterm_syncs_and_finishes_what_it_holds(twistd_broker, name, tmp_path):
    topic = name()
    pub(twistd_broker, topic, lines_of(40))
    proc = to_file(twistd_broker, topic, tmp_path / "out", "--sync-interval=1h", "--max-in-flight=1000")
    # The first message opens the file and is synced at once; the rest are held.
    wait_for(lambda: (channel_stats(twistd_broker, topic, "nsq_to_file") or {}).get("in_flight_count")
             == 39, TIMEOUT, "39 messages held, unsynced")
    stop(proc)
    c = channel_stats(twistd_broker, topic, "nsq_to_file")
    assert (c["depth"], c["in_flight_count"], c["requeue_count"]) == (0, 0, 0)
    assert output(tmp_path / "out") == lines_of(40)


def test_to_file_killed_before_sync_leaves_the_messages_in_the_broker(twistd_broker, name, tmp_path):
    topic = name()
    lines = lines_of(40)
    pub(twistd_broker, topic, lines)
    proc = to_file(twistd_broker, topic, tmp_path / "first", "--sync-interval=1h", "--max-in-flight=1000")
    wait_for(lambda: (channel_stats(twistd_broker, topic, "nsq_to_file") or {}).get("in_flight_count")
             == 39, TIMEOUT, "39 messages held, unsynced")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=TIMEOUT)
    # Not FINed: back in the queue once the connection is gone, not lost.
    wait_for(lambda: (channel_stats(twistd_broker, topic, "nsq_to_file") or {}).get("depth") == 39,
             TIMEOUT, "the unsynced messages requeued")
    proc = to_file(twistd_broker, topic, tmp_path / "second", "--sync-interval=100ms")
    wait_for(lambda: all_finished(twistd_broker, topic, 40), TIMEOUT, "the redelivered ones FINed")
    stop(proc)
    assert output(tmp_path / "first")[:1] == lines[:1]  # synced and FINed before the kill
    assert output(tmp_path / "second") == lines[1:]  # redelivered: every unsynced one


def test_to_file_discovers_topics_from_lookupd_filtered_by_pattern(start_broker, start_lookupd,
                                                                    name, tmp_path):
    lookupd = start_lookupd()
    broker = start_broker(*FAST_SCAN, "--broadcast-address=127.0.0.1",
                          f"--lookupd-tcp-address={lookupd.tcp_address}")
    wanted, other, later = name("keep"), name("skip"), name("keep")
    for topic in (wanted, other):
        pub(broker, topic, lines_of(5, topic))
    wait_for(lambda: {wanted, other} <= set(lookupd.get("/topics")[1]["topics"]), TIMEOUT,
             "registration")
    out = tmp_path / "out"
    proc = start("to_file", f"--lookupd-http-address={lookupd.http_address}",
                 "--topic-pattern=keep", "--topic-refresh=200ms", "--sync-interval=100ms",
                 f"--output-dir={out}")
    wait_for(lambda: all_finished(broker, wanted, 5), TIMEOUT, "the matching topic written")
    pub(broker, later, lines_of(3, later))  # appears after the start: found by the refresh
    wait_for(lambda: all_finished(broker, later, 3), TIMEOUT, "the new topic written")
    stop(proc)
    assert channel_stats(broker, other, "nsq_to_file") is None  # never subscribed
    assert sorted(output(out)) == sorted(lines_of(5, wanted) + lines_of(3, later))
    assert sorted(p.name.split(".")[1] for p in out.iterdir()) == sorted(
        [wanted.split(".")[1], later.split(".")[1]])


def test_to_file_sighup_closes_and_moves_the_file(twistd_broker, name, tmp_path):
    topic = name()
    out, work = tmp_path / "out", tmp_path / "work"
    proc = to_file(twistd_broker, topic, out, f"--work-dir={work}", "--sync-interval=100ms")
    wait_for(lambda: has_channel(twistd_broker, topic), TIMEOUT, "the channel")
    pub(twistd_broker, topic, lines_of(5))
    wait_for(lambda: all_finished(twistd_broker, topic, 5), TIMEOUT, "every message FINed")
    assert len(os.listdir(work)) == 1 and os.listdir(out) == []
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: out.exists() and len(os.listdir(out)) == 1, TIMEOUT, "the file moved out")
    assert os.listdir(work) == []
    pub(twistd_broker, topic, lines_of(3, "after"))  # a new revision of the name is opened
    wait_for(lambda: all_finished(twistd_broker, topic, 8), TIMEOUT, "the next ones FINed")
    stop(proc)
    assert len(os.listdir(out)) == 2
    assert output(out) == lines_of(5) + lines_of(3, "after")


def test_pub_reads_a_regular_file_on_stdin(twistd_broker, name, tmp_path):
    topic = name()
    source = tmp_path / "source.txt"
    source.write_bytes(b"a,b,,c")  # no trailing delimiter, one empty field skipped
    with open(source, "rb") as stdin:
        proc = subprocess.run(tool("pub", f"--topic={topic}", "--delimiter=,",
                                   f"--nsqd-tcp-address={twistd_broker.tcp_address}"),
                              stdin=stdin, capture_output=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode()
    with RawConn(twistd_broker, timeout=10) as conn:
        conn.send(command(f"SUB {topic} ch") + command("RDY 3"))
        assert conn.read_frame() == (0, b"OK")
        assert [conn.read_message()[3] for _ in range(3)] == [b"a", b"b", b"c"]
