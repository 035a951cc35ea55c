"""mq-tail's retained-log mode without a broker: its flags, and the read loop against a fake HTTP answer.

The fake broker answers `/topic/offsets` and `/topic/read` as the
contract says (frames built with mqd.wire.log_frames.frame_records, the
`X-Mqd-*` headers, 400 RETENTION_OFF, 404 TOPIC_NOT_FOUND, 416 with the
bounds); its Deferreds fire at once and the reader's waits run on a
task.Clock, so every step is driven by hand.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from twisted.internet import defer
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from mqd.clusterinfo.bearer import HTTPRefusedError
from mqd.tools import retained, tail
from mqd.tools.flags import ToolError, parse_checked
from mqd.tools.retained import Answer, LogReader, Since, Start
from mqd.wire.log_frames import frame_records

# -- the flags -------------------------------------------------------------------------------------


def parse(*argv: str) -> Any:
    args, _ = parse_checked(tail.build_parser(), tail.check_args, ["--topic=t", "--nsqd-tcp-address=h:4150", *argv])
    return args


@pytest.mark.parametrize("value, start", [
    ("earliest", Start(keyword="earliest")), ("latest", Start(keyword="latest")), ("0", Start(offset=0)),
    ("50", Start(offset=50)),
])
def test_offset_takes_earliest_latest_or_a_number(value, start):
    args = parse(f"--offset={value}")
    assert args.retained_start == start


@pytest.mark.parametrize("value", ["-1", "first", "1.5", ""])
def test_a_bad_offset_is_a_bad_flag_in_gos_words(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(f"--offset={value}")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f'invalid value "{value}" for flag -offset: want earliest, latest or an offset (an integer >= 0)')


def test_the_start_is_described_for_the_log():
    assert Start(keyword="earliest").describe() == "earliest"
    assert Start(offset=50).describe() == "offset 50"
    assert Start(timestamp_ms=1767323045250).describe() == "the first record at or after 2026-01-02T03:04:05.250Z"


def test_since_a_duration_is_that_long_before_the_start():
    assert retained.since_arg("2h") == Since(ago=7200.0)
    assert retained.start_of(None, Since(ago=7200.0), now=10_000.0) == Start(timestamp_ms=(10_000 - 7200) * 1000)


@pytest.mark.parametrize("text, ms", [
    ("2026-01-02T03:04:05Z", 1767323045000),
    ("2026-01-02T04:04:05.250+01:00", 1767323045250),
])
def test_since_an_rfc3339_time_is_that_moment(text, ms):
    assert retained.since_arg(text) == Since(at_ms=ms)
    assert parse(f"--since={text}").retained_start == Start(timestamp_ms=ms)


@pytest.mark.parametrize("value", ["2026-01-02T03:04:05", "2026-01-02", "-5m", "yesterday"])
def test_since_without_a_zone_or_unreadable_is_a_bad_flag(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(f"--since={value}")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f'invalid value "{value}" for flag -since: ')


@pytest.mark.parametrize("argv, line", [
    (["--offset=1", "--since=1h"], "use --offset or --since not both"),
    (["--offset=1", "--channel=c"], "--offset and --since read the topic's retained log, which has no channel: "
                                    "do not give --channel"),
])
def test_offset_excludes_since_and_channel(argv, line, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*argv)
    assert exit_.value.code == 1
    assert capsys.readouterr().err == line + "\n"


def test_without_offset_or_since_the_tool_is_nsq_tail():
    args = parse()
    assert args.retained_start is None and args.channel.endswith("#ephemeral")


# -- a fake broker ---------------------------------------------------------------------------------


def _id(i: int) -> bytes:
    return b"%016x" % i


class FakeLog:
    """One topic's retained log behind `fetch(url)`, answered as /topic/offsets and /topic/read answer."""

    def __init__(self, bodies: list[bytes] = (), epoch: int = 7, earliest: int = 0) -> None:
        self.epoch = epoch
        self.earliest = earliest
        self.records: list[tuple[int, int, bytes]] = []
        self.retention = True
        self.exists = True
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.fail: list[Any] = []  # exceptions or Answers given instead of the next answers
        self.append(bodies, first=earliest)

    def append(self, bodies, first: int | None = None) -> None:
        start = self.latest if first is None else first
        for i, body in enumerate(bodies):
            offset = start + i
            self.records.append((offset, 1_000_000_000 * (offset + 1), _id(offset) + body))

    @property
    def latest(self) -> int:
        return self.records[-1][0] + 1 if self.records else self.earliest

    def recreate(self, epoch: int, bodies) -> None:
        self.epoch, self.earliest, self.records = epoch, 0, []
        self.append(bodies, first=0)

    def expire(self, upto: int) -> None:
        self.earliest = upto
        self.records = [r for r in self.records if r[0] >= upto]

    def fetch(self, url: str) -> defer.Deferred:
        parts = urlsplit(url)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        self.requests.append((parts.path, query))
        if self.fail:
            what = self.fail.pop(0)
            return defer.succeed(what) if isinstance(what, Answer) else defer.fail(what)
        return defer.succeed(self.answer(parts.path, query))

    @staticmethod
    def error(code: int, message: str, **more: Any) -> Answer:
        return Answer(code, {"content-type": "application/json"}, json.dumps({"message": message, **more}).encode())

    def answer(self, path: str, query: dict[str, str]) -> Answer:
        if not self.exists:
            return self.error(404, "TOPIC_NOT_FOUND")
        if not self.retention:
            return self.error(400, "RETENTION_OFF")
        if path == "/topic/offsets":
            doc = {"topic": query["topic"], "epoch": self.epoch, "earliest": self.earliest, "latest": self.latest,
                   "retained_bytes": 0, "oldest_timestamp": None, "kept": True}
            if "timestamp" in query:
                ns = int(query["timestamp"]) * 1_000_000
                doc["offset_for_timestamp"] = next((o for o, ts, _ in self.records if ts >= ns), self.latest)
            return Answer(200, {}, json.dumps(doc).encode())
        assert path == "/topic/read", path
        offset, limit = int(query["offset"]), int(query["max_messages"])
        if not self.earliest <= offset <= self.latest:
            return self.error(416, "OFFSET_OUT_OF_RANGE", earliest=self.earliest, latest=self.latest)
        chosen = [r for r in self.records if r[0] >= offset][:limit]
        after = chosen[-1][0] + 1 if chosen else offset
        return Answer(200, {"content-type": retained.FRAMES_TYPE, "x-mqd-epoch": str(self.epoch),
                            "x-mqd-next-offset": str(after), "x-mqd-earliest": str(self.earliest),
                            "x-mqd-latest": str(self.latest)}, frame_records(chosen))

    def reads(self) -> list[int]:
        return [int(q["offset"]) for path, q in self.requests if path == "/topic/read"]


class Run:
    """A LogReader over a FakeLog on a Clock, printing into a list; `ended` is run()'s Deferred."""

    def __init__(self, log: FakeLog, start: Start, total: int = 0, batch: int = 1000) -> None:
        self.log = log
        self.clock = Clock()
        self.shown: list[bytes] = []
        self.warnings: list[str] = []
        self.total = total

        def show(body: bytes) -> bool:
            self.shown.append(body)
            return not (total and len(self.shown) >= total)

        self.reader = LogReader("h:4151", "t", start, log.fetch, show, self.clock, warn=self.warnings.append,
                                batch=lambda: batch)
        self.ended = defer.Deferred.fromCoroutine(self.reader.run())
        self.failures: list[Failure] = []
        self.ended.addErrback(self.failures.append)

    def error(self) -> str:
        assert self.failures, "the reader did not fail"
        assert self.failures[0].check(ToolError), self.failures[0]
        return str(self.failures[0].value)


def bodies(n: int, prefix: str = "m") -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


# -- reading ---------------------------------------------------------------------------------------


def test_earliest_prints_every_record_in_offset_order_batch_by_batch():
    run = Run(FakeLog(bodies(25)), Start(keyword="earliest"), total=25, batch=10)
    assert run.shown == bodies(25)
    assert run.ended.called and not run.failures
    assert run.log.reads() == [0, 10, 20]


def test_an_offset_starts_there_and_n_stops_the_reader():
    run = Run(FakeLog(bodies(100)), Start(offset=50), total=10)
    assert run.shown == bodies(100)[50:60]
    assert run.reader.stopped and run.ended.called


def test_since_starts_at_the_first_record_at_or_after_the_time():
    # Record k was published at (k + 1) s: from 30.5 s on is record 30.
    run = Run(FakeLog(bodies(40)), Start(timestamp_ms=30_500), total=10)
    assert run.shown == bodies(40)[30:40]
    assert ("/topic/offsets", {"topic": "t", "timestamp": "30500"}) in run.log.requests


def test_latest_prints_only_what_is_published_after_polling_every_interval():
    log = FakeLog(bodies(5))
    run = Run(log, Start(keyword="latest"), total=3)
    assert run.shown == [] and log.reads() == [5]
    run.clock.advance(retained.POLL_INTERVAL)
    assert log.reads() == [5, 5]
    log.append([b"new0", b"new1", b"new2"])
    run.clock.advance(retained.POLL_INTERVAL)
    assert run.shown == [b"new0", b"new1", b"new2"] and run.ended.called


def test_an_offset_out_of_range_ends_the_tool_naming_earliest_and_latest():
    run = Run(FakeLog(bodies(10), earliest=5), Start(offset=2))
    assert run.error() == "offset 2 is out of range for topic t on nsqd h:4151: earliest 5, latest 15"
    run = Run(FakeLog(bodies(10)), Start(offset=11))
    assert run.error() == "offset 11 is out of range for topic t on nsqd h:4151: earliest 0, latest 10"


def test_a_topic_without_retention_ends_the_tool_in_one_line():
    log = FakeLog()
    log.retention = False
    run = Run(log, Start(keyword="earliest"))
    assert run.error() == ("topic t on nsqd h:4151 keeps no retained log: retention is off for it "
                           "(the broker's --retention-time / --retention-bytes, or POST /topic/retention)")


def test_a_broker_without_the_endpoint_is_not_an_mqd():
    log = FakeLog()
    log.fail = [FakeLog.error(404, "NOT_FOUND")]
    run = Run(log, Start(keyword="earliest"))
    assert run.error().startswith("nsqd h:4151 has no /topic/offsets (404 NOT_FOUND): it does not keep retained logs")


def test_a_refused_secret_ends_the_tool_with_the_tools_line():
    log = FakeLog()
    log.fail = [HTTPRefusedError("nsqd", "http://h:4151/topic/offsets?topic=t", 401, b'{"message":"AUTH_REQUIRED"}')]
    run = Run(log, Start(keyword="earliest"))
    assert run.error() == ("ERROR: nsqd h:4151 answered 401 Unauthorized (AUTH_REQUIRED): "
                           "it requires a secret (--http-auth-secret)")


def test_an_unreachable_broker_or_a_5xx_is_asked_again_after_a_wait():
    log = FakeLog(bodies(3))
    log.fail = [ConnectionRefusedError(), FakeLog.error(500, "STORE_FAILED")]
    run = Run(log, Start(keyword="earliest"), total=3)
    assert run.shown == [] and len(run.warnings) == 1 and "asking again in 1s" in run.warnings[0]
    run.clock.advance(1)
    assert "500 STORE_FAILED; asking again in 2s" in run.warnings[1]
    run.clock.advance(2)
    assert run.shown == bodies(3) and not run.failures


def test_a_topic_not_created_yet_is_waited_for():
    log = FakeLog(bodies(2))
    log.exists = False
    run = Run(log, Start(keyword="earliest"), total=2)
    run.clock.advance(1)
    run.clock.advance(1)
    assert run.warnings == ["topic t on nsqd h:4151 does not exist: waiting for it"]
    log.exists = True
    run.clock.advance(1)
    assert run.shown == bodies(2)


def test_a_log_recreated_while_tailing_is_said_and_read_from_its_new_earliest():
    log = FakeLog(bodies(5))
    run = Run(log, Start(keyword="earliest"), total=8)
    assert run.shown == bodies(5)
    # Deleted and created again, with fewer records than were read: the read at 5 is out of range.
    log.recreate(99, bodies(2, "new"))
    run.clock.advance(retained.POLL_INTERVAL)
    assert run.warnings == ["topic t on nsqd h:4151 was deleted and created again (the retained log's epoch "
                            "changed from 7 to 99): reading on from its earliest offset 0"]
    assert run.shown == bodies(5) + bodies(2, "new")
    # Again, with more records than were read: the epoch header says so.
    log.recreate(100, bodies(9, "third"))
    run.clock.advance(retained.POLL_INTERVAL)
    assert "changed from 99 to 100" in run.warnings[-1]
    assert run.shown[7:] == [b"third0"] and run.ended.called


def test_a_deleted_topic_is_waited_for_then_read_from_the_start():
    log = FakeLog(bodies(2))
    run = Run(log, Start(keyword="earliest"), total=3)
    log.exists = False
    run.clock.advance(retained.POLL_INTERVAL)
    assert run.warnings[0] == "topic t on nsqd h:4151 was deleted: waiting for it to be created again"
    log.exists = True
    log.recreate(8, [b"again"])
    run.clock.advance(1)
    assert run.shown == [*bodies(2), b"again"]
    assert len(run.warnings) == 2 and "epoch changed from 7 to 8" in run.warnings[1]


def test_records_expired_before_they_were_read_are_counted_and_skipped():
    log = FakeLog(bodies(10))
    run = Run(log, Start(keyword="earliest"), batch=2)
    assert run.shown == bodies(10)
    # Three more published, and two of them expired before the reader asked again.
    log.append([b"x10", b"x11", b"x12"])
    log.expire(12)
    run.clock.advance(retained.POLL_INTERVAL)
    assert run.warnings == ["2 records of topic t on nsqd h:4151 expired before they were read "
                            "(offsets 10 to 11): reading on from offset 12"]
    assert run.shown[10:] == [b"x12"] and not run.failures


def test_bytes_that_are_not_frames_end_the_tool():
    log = FakeLog(bodies(1))
    good = log.answer("/topic/read", {"offset": "0", "max_messages": "10"})
    log.fail = [Answer(200, {}, json.dumps({"epoch": 7, "earliest": 0, "latest": 1}).encode()),
                Answer(200, good.headers, good.body[:-3])]
    run = Run(log, Start(keyword="earliest"))
    assert run.error().startswith("nsqd h:4151 answered /topic/read for topic t with bytes that are not record frames")


def test_a_dummy_store_keeps_nothing_to_read():
    log = FakeLog()
    log.fail = [Answer(200, {}, json.dumps({"epoch": 0, "earliest": 0, "latest": 0, "kept": False}).encode())]
    run = Run(log, Start(keyword="earliest"))
    assert "keeps no messages" in run.error()


# -- finding the brokers ---------------------------------------------------------------------------


def test_lookupd_producers_are_their_broadcast_addresses_and_http_ports():
    doc = {"channels": [], "producers": [
        {"broadcast_address": "a.example", "tcp_port": 4150, "http_port": 4151},
        {"broadcast_address": "::1", "tcp_port": 4152, "http_port": 4153},
        {"broadcast_address": "a.example", "tcp_port": 4150, "http_port": 4151},
        {"broadcast_address": "", "http_port": 1}, {"broadcast_address": "b", "http_port": True}, "junk"]}
    assert retained.lookupd_http_producers(doc) == ["a.example:4151", "[::1]:4153"]
    old = {"status_code": 200, "status_txt": "OK", "data": doc}
    assert retained.lookupd_http_producers(old) == ["a.example:4151", "[::1]:4153"]


class _Proto:
    def __init__(self, server: dict[str, Any]) -> None:
        self.server = server
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("server, result", [
    ({"max_rdy_count": 2500, "http_port": 4151}, "10.0.0.1:4151"),
    ({"max_rdy_count": 2500}, None),
    ({}, None),
])
def test_the_http_port_comes_from_the_identify_answer(monkeypatch, server, result):
    from mqd.client import protocol

    proto = _Proto(server)
    monkeypatch.setattr(protocol, "connect", lambda reactor, address, config, delegate: defer.succeed(proto))
    d = defer.Deferred.fromCoroutine(retained.http_port_of(Clock(), "10.0.0.1:4150", SimpleNamespace()))
    got: list[Any] = []
    d.addBoth(got.append)
    assert proto.closed
    if result is not None:
        assert got == [result]
    else:
        assert isinstance(got[0], Failure) and got[0].check(ToolError)
        assert str(got[0].value) == (
            "nsqd 10.0.0.1:4150 does not keep retained logs: its IDENTIFY answer has no http_port "
            "(it is not an mqd, or one without retained logs); --offset and --since need one")


def test_tail_logs_reads_every_producer_the_lookupd_lists(monkeypatch):
    """Two brokers listed: each one's log read, the bodies printed interleaved as the answers come."""
    logs = {"a:1": FakeLog([b"a0", b"a1"]), "b:2": FakeLog([b"b0"])}
    lookup = {"producers": [{"broadcast_address": "a", "http_port": 1}, {"broadcast_address": "b", "http_port": 2}]}

    class Http:
        def get(self, url: str):
            parts = urlsplit(url)
            if parts.path == "/lookup":
                return defer.succeed(Answer(200, {}, json.dumps(lookup).encode()))
            return logs[parts.netloc].fetch(url)

    monkeypatch.setattr(retained, "BrokerHTTP", lambda secret, reactor, kind="nsqd", http=None: Http())
    printed: list[bytes] = []
    done: defer.Deferred = defer.Deferred()
    printer = tail.Printer(SimpleNamespace(write=printed.append, flush=lambda: None), total=3, print_topic=True,
                           on_done=lambda: done.callback(None))
    args = SimpleNamespace(retained_start=Start(keyword="earliest"), http_auth_secret="", topic=["t"],
                           nsqd_tcp_address=[], lookupd_http_address=["l:4161"])
    clock = Clock()
    readers = retained.tail_logs(clock, args, printer, SimpleNamespace(lookupd_poll_interval=60.0), done)
    assert sorted(printed) == [b"t | a0\n", b"t | a1\n", b"t | b0\n"] and done.called
    assert set(readers) == {("a:1", "t"), ("b:2", "t")}
    assert all(r.stopped for r in readers.values())


def test_broker_http_sends_the_secret_and_keeps_the_answers_headers():
    from treq.testing import StubTreq
    from twisted.web import resource

    seen: list[Any] = []

    class Read(resource.Resource):
        isLeaf = True

        def render_GET(self, request):
            seen.append(request.getHeader(b"authorization"))
            request.setHeader(b"X-Mqd-Next-Offset", b"3")
            return b"frames"

    http = retained.BrokerHTTP("s3cret", Clock(), http=StubTreq(Read()))
    got: list[Any] = []
    http.get("http://h:4151/topic/read?topic=t&offset=0").addBoth(got.append)
    assert seen == [b"Bearer s3cret"]
    assert got[0].code == 200 and got[0].body == b"frames" and got[0].headers["x-mqd-next-offset"] == "3"
