"""``python -m bench memory --nsqd-bin``: a real nsqd measured the way mqd is.

A stand-in nsqd (a Python script speaking just enough of nsqd's TCP and HTTP
APIs, and logging every request) takes the place of the binary, so the test
sees what the harness asks of nsqd: its command line, the channels created
before the first publish, the warm-up collected before the baseline, the
topic deleted before the stop. No NSQ binary is needed.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from bench.harness import broker as bench_broker
from bench.scenarios import memory

STAND_IN = textwrap.dedent(
    """\
    #!{python}
    # A stand-in nsqd: V2 MPUB over TCP, the HTTP calls of bench memory, an event log.
    import json, os, socketserver, struct, sys, threading, urllib.parse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    LOG = os.environ["STAND_IN_LOG"]
    lock = threading.Lock()
    topics = {{}}  # topic -> {{channel: depth}}

    def event(**kw):
        with lock, open(LOG, "a") as f:
            f.write(json.dumps(kw) + "\\n")

    event(kind="argv", argv=sys.argv[1:])

    def frame(payload):
        return struct.pack(">ii", len(payload) + 4, 0) + payload

    class V2(socketserver.StreamRequestHandler):
        def handle(self):
            if self.rfile.read(4) != b"  V2":
                return
            while True:
                line = self.rfile.readline()
                if not line:
                    return
                verb, _, topic = line.strip().decode().partition(" ")
                (size,) = struct.unpack(">i", self.rfile.read(4))
                body = self.rfile.read(size)
                (n,) = struct.unpack(">i", body[:4])
                with lock:
                    for channel in topics.setdefault(topic, {{}}):
                        topics[topic][channel] += n
                event(kind="tcp", verb=verb, topic=topic, count=n)
                self.wfile.write(frame(b"OK"))

    class Http(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, body=b"OK"):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            url = urllib.parse.urlsplit(self.path)
            q = dict(urllib.parse.parse_qsl(url.query))
            event(kind="http", path=url.path, query=q)
            with lock:
                if url.path == "/topic/create":
                    topics.setdefault(q["topic"], {{}})
                elif url.path == "/channel/create":
                    topics.setdefault(q["topic"], {{}}).setdefault(q["channel"], 0)
                elif url.path == "/topic/delete":
                    topics.pop(q["topic"], None)
            self.reply()

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            q = dict(urllib.parse.parse_qsl(url.query))
            event(kind="http", path=url.path, query=q)
            if url.path == "/stats":
                with lock:
                    shown = [t for t in topics if t == q.get("topic", t)]
                    body = {{"topics": [
                        {{"topic_name": t, "channels": [
                            {{"channel_name": c, "depth": d, "in_flight_count": 0}}
                            for c, d in topics[t].items()]}}
                        for t in shown]}}
                self.reply(json.dumps(body).encode())
            else:
                self.reply(b"heap profile")

    class Tcp(socketserver.ThreadingTCPServer):
        daemon_threads = True

    tcp = Tcp(("127.0.0.1", 0), V2)
    http = ThreadingHTTPServer(("127.0.0.1", 0), Http)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    print("HTTP: listening on 127.0.0.1:%d" % http.server_address[1], flush=True)
    print("TCP: listening on 127.0.0.1:%d" % tcp.server_address[1], flush=True)
    tcp.serve_forever()
    """
)


@pytest.fixture
def no_default_nsq(tmp_path, monkeypatch):
    """Neither $NSQD_BIN nor a directory of NSQ's binaries beside the checkout."""
    monkeypatch.delenv(bench_broker.NSQD_BIN_ENV, raising=False)
    monkeypatch.setattr(bench_broker, "NSQ_BIN_BESIDE", tmp_path / "absent")


@pytest.fixture
def stand_in(tmp_path, monkeypatch, no_default_nsq):
    """A bin directory whose nsqd is the stand-in; returns (bin dir, event log path)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    nsqd = bindir / "nsqd"
    nsqd.write_text(STAND_IN.format(python=sys.executable))
    os.chmod(nsqd, 0o755)
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    for name, value in (("WARM_PAUSE", 0.0), ("SETTLE", 0.0), ("STEADY_INTERVAL", 0.01)):
        monkeypatch.setattr(memory, name, value)
    return bindir, log


def _events(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_nsqd_bin_names_the_binary_or_its_directory(stand_in):
    bindir, _ = stand_in
    assert memory.parse(["--nsqd-bin", str(bindir)]).nsqd == str(bindir / "nsqd")
    assert memory.parse(["--nsqd-bin", str(bindir / "nsqd")]).nsqd == str(bindir / "nsqd")
    assert memory.parse(["--nsqd-bin", "none"]).nsqd is None


def test_nsqd_defaults_to_the_environment_then_beside_the_checkout(stand_in, monkeypatch):
    bindir, _ = stand_in
    assert memory.parse([]).nsqd is None  # nothing found: mqd alone, as before
    monkeypatch.setattr(bench_broker, "NSQ_BIN_BESIDE", bindir)
    assert memory.parse([]).nsqd == str((bindir / "nsqd").resolve())
    monkeypatch.setenv(bench_broker.NSQD_BIN_ENV, str(bindir / "nsqd"))
    assert memory.parse([]).nsqd == str(bindir / "nsqd")
    assert memory.parse(["--nsqd-bin", "none"]).nsqd is None


def test_nsqd_bin_that_is_no_executable_is_a_usage_error(no_default_nsq, tmp_path, capsys):
    with pytest.raises(SystemExit):
        memory.parse(["--nsqd-bin", str(tmp_path / "missing")])
    assert "not an executable nsqd" in capsys.readouterr().err


def test_nsqd_run_is_measured_like_mqd(stand_in):
    bindir, log = stand_in
    args = memory.parse(
        ["--nsqd-bin", str(bindir), "--count", "1000", "--warmup", "400", "--batch", "100",
         "--size", "50", "--channels", "3"]
    )
    run = memory.broker_run(args, 3, "nsqd")
    assert run.broker == "nsqd" and run.channels == 3 and run.count == 1000
    assert set(run.readings) == {"created", "warm", "full", "settled"}
    assert all(r["VmRSS"] > 0 for r in run.readings.values())

    events = _events(log)
    argv = events[0]["argv"]
    assert "--mem-queue-size=2000" in argv  # larger than the backlog: it all stays in memory
    assert "--tcp-address=127.0.0.1:0" in argv and "--http-address=127.0.0.1:0" in argv

    def index(pred) -> int:
        return next(i for i, e in enumerate(events) if pred(e))

    def http(path, **query):
        return lambda e: e["kind"] == "http" and e["path"] == path and all(
            e["query"].get(k) == v for k, v in query.items())

    first_pub = index(lambda e: e["kind"] == "tcp" and e["topic"] == memory.TOPIC)
    created = [e["query"]["channel"] for e in events[:first_pub]
               if http("/channel/create", topic=memory.TOPIC)(e)]
    assert created == ["c0", "c1", "c2"]  # every channel exists before the first message
    published = [e for e in events if e["kind"] == "tcp"]
    assert all(e["verb"] == "MPUB" and e["count"] == 100 for e in published)
    assert sum(e["count"] for e in published if e["topic"] == memory.TOPIC) == 1000
    assert sum(e["count"] for e in published if e["topic"] == memory.WARM_TOPIC) == 400
    # The warm-up's garbage is collected after its topic is gone and before the backlog.
    warm_deleted = index(http("/topic/delete", topic=memory.WARM_TOPIC))
    collected = index(http("/debug/pprof/heap", gc="1"))
    assert warm_deleted < collected < first_pub
    # Measured, the backlog is dropped rather than written to disk at the stop.
    assert http("/topic/delete", topic=memory.TOPIC)(events[-1])


def test_main_alternates_mqd_and_nsqd_and_prints_the_side_by_side_table(
    stand_in, monkeypatch, capsys
):
    bindir, _ = stand_in
    order = []
    growth = {"mqd": 600, "nsqd": 400}  # bytes per message per channel, made up

    def fake_run(args, channels, name="mqd"):
        order.append((name, channels))
        run = memory.BrokerRun(channels, args.count, broker=name)
        base = {"VmRSS": 10_000, "RssAnon": 8_000}
        grown = {k: v + growth[name] * channels * args.count // 1024 for k, v in base.items()}
        run.readings = {"created": base, "warm": base, "full": grown, "settled": grown}
        return run

    monkeypatch.setattr(memory, "broker_run", fake_run)
    monkeypatch.setattr(memory, "nsqd_version", lambda path: "nsqd v1.3.0 (stand-in)")
    code = memory.main(["--nsqd-bin", str(bindir), "--count", "102400", "--channels", "1,3",
                        "--breakdown-count", "0"])
    assert code == 0
    assert order == [("mqd", 1), ("nsqd", 1), ("mqd", 3), ("nsqd", 3)]
    out = capsys.readouterr().out
    assert "| channels | mqd B/msg | nsqd B/msg | mqd ÷ nsqd |" in out
    assert "| 1 | 600 | 400 | 1.50 |" in out
    assert "| 3 | 1,800 | 1,200 | 1.50 |" in out
    assert "- nsqd: nsqd v1.3.0 (stand-in) --mem-queue-size=204,800" in out


def test_without_nsqd_no_side_by_side_table(no_default_nsq):
    args = memory.parse(["--count", "10", "--channels", "1"])
    run = memory.BrokerRun(1, 10)
    run.readings = {k: {"VmRSS": 100, "RssAnon": 90} for k in ("created", "warm", "full", "settled")}
    text = memory.report([run], None, args)
    assert "mqd ÷ nsqd" not in text
    assert "estimate from its reference run" in text
    assert memory.comparison([run]) == [(1, 0.0, None)]
