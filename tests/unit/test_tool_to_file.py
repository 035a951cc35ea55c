"""mq-to-file's file logic without a broker: naming, rotation, gzip members, sync before FIN."""

from __future__ import annotations

import gzip
import os
import random
import time

import pytest
import pytest_twisted
from twisted.internet import defer, task

from mqd.tools import to_file
from mqd.tools.flags import ToolError
from mqd.tools.to_file import (
    BatchingWriter,
    FileLogger,
    FileOptions,
    build_parser,
    check_args,
    compute_filename_format,
)

HOUR = 3600.0


def stamp(clock, fmt="%Y-%m-%d_%H") -> str:
    return time.strftime(fmt, time.localtime(clock.seconds()))


@pytest.fixture
def clock():
    c = task.Clock()
    c.advance(1_700_000_000)  # a round hour would make the datetime tests depend on the zone
    c.advance(HOUR - (c.seconds() % HOUR) + 60)  # one minute past a UTC hour
    return c


@pytest.fixture
def fsyncs(monkeypatch):
    """Every fsync'd fd's path, in order (the real fsync still runs)."""
    done: list[str] = []
    real = os.fsync

    def fsync(fd):
        real(fd)
        done.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(to_file.os, "fsync", fsync)
    return done


_open: list[FileLogger] = []


@pytest.fixture(autouse=True)
def _close_loggers():
    """Close what a test left open (close is idempotent), so no file leaks to the next."""
    yield
    while _open:
        _open.pop().close()


def make(tmp_path, clock, **kw) -> FileLogger:
    kw.setdefault("output_dir", str(tmp_path / "out"))
    logger = FileLogger("events", FileOptions(**kw), clock=clock, hostname="box.example.com")
    _open.append(logger)
    return logger


def lines(n: int, width: int = 10) -> list[bytes]:
    return [f"line-{i:0{width - 5}d}".encode() for i in range(n)]


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def files(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


# -- naming ------------------------------------------------------------------------


def test_default_format_drops_rev_and_fills_topic_and_short_host():
    fmt = compute_filename_format(FileOptions(), "events", hostname="box.example.com", pid=42)
    assert fmt == "events.box.<DATETIME>.log"


def test_host_identifier_tokens_and_pid():
    opts = FileOptions(host_identifier="<SHORT_HOST>-<HOSTNAME>",
                       filename_format="<TOPIC>.<HOST>.<PID>.<DATETIME>.log")
    fmt = compute_filename_format(opts, "t", hostname="box.example.com", pid=42)
    assert fmt == "t.box-box.example.com.42.<DATETIME>.log"


@pytest.mark.parametrize(
    "kw", [{"gzip": True}, {"rotate_size": 10}, {"rotate_interval": 60.0}, {"work_dir": "/w"}]
)
def test_rev_is_required_when_names_can_be_taken(kw):
    opts = FileOptions(filename_format="<TOPIC>.<DATETIME>.log", **kw)
    with pytest.raises(ToolError, match="missing <REV> in --filename-format"):
        compute_filename_format(opts, "t", hostname="h")
    assert "<REV>" in compute_filename_format(FileOptions(**kw), "t", hostname="h")


def test_gzip_adds_the_suffix_once_and_gziprev_is_the_old_spelling_of_rev():
    opts = FileOptions(gzip=True, filename_format="<TOPIC><GZIPREV>.log")
    assert compute_filename_format(opts, "t", hostname="h") == "t<REV>.log.gz"
    opts = FileOptions(gzip=True, filename_format="<TOPIC><REV>.log.gz")
    assert compute_filename_format(opts, "t", hostname="h") == "t<REV>.log.gz"


def test_file_is_named_from_the_clock_and_holds_one_line_per_message(tmp_path, clock):
    logger = make(tmp_path, clock)
    for body in [b"one", b"two", b""]:
        logger.write_line(body)
    logger.close()
    name = f"events.box.{stamp(clock)}.log"
    assert files(tmp_path / "out") == [name]
    assert read(tmp_path / "out" / name) == b"one\ntwo\n\n"


def test_plain_file_without_rotation_is_appended_to(tmp_path, clock):
    for body in (b"first", b"second"):
        logger = make(tmp_path, clock)
        logger.write_line(body)
        logger.close()
    (only,) = files(tmp_path / "out")
    assert read(tmp_path / "out" / only) == b"first\nsecond\n"


# -- sync and FIN ---------------------------------------------------------------------


class FakeMessage:
    def __init__(self, body: bytes, on_finish=None) -> None:
        self.body = body
        self.finished = False
        self.auto_response = True
        self.on_finish = on_finish

    def disable_auto_response(self) -> None:
        self.auto_response = False

    def finish(self) -> None:
        assert not self.finished, "FINed twice"
        if self.on_finish:
            self.on_finish(self)
        self.finished = True


def opened(writer: BatchingWriter, fsyncs: list) -> FakeMessage:
    """The first message opens the file and, as in nsq_to_file, is synced at once."""
    first = FakeMessage(b"first")
    writer(first)
    assert first.finished and len(fsyncs) == 1
    fsyncs.clear()
    return first


def test_message_is_finished_only_after_its_line_is_written_and_fsynced(tmp_path, clock, fsyncs):
    logger = make(tmp_path, clock)
    writer = BatchingWriter(logger, max_pending=100)
    opened(writer, fsyncs)
    seen = []

    def on_finish(message):
        # At FIN time the line is in the file and the file has been fsynced.
        assert fsyncs and fsyncs[-1] == logger.path
        assert message.body + b"\n" in read(logger.path)
        seen.append(message.body)

    messages = [FakeMessage(b, on_finish) for b in lines(5)]
    for m in messages:
        writer(m)
    assert all(not m.auto_response for m in messages)
    assert not any(m.finished for m in messages)  # held: no sync yet
    assert fsyncs == []
    writer.sync()
    assert seen == lines(5)
    assert len(fsyncs) == 1  # one fsync for the batch


def test_max_pending_messages_trigger_the_sync(tmp_path, clock, fsyncs):
    writer = BatchingWriter(make(tmp_path, clock), max_pending=3)
    opened(writer, fsyncs)
    messages = [FakeMessage(b) for b in lines(7)]
    for m in messages:
        writer(m)
    assert [m.finished for m in messages] == [True] * 6 + [False]
    assert len(fsyncs) == 2


def test_a_starved_consumer_triggers_the_sync(tmp_path, clock, fsyncs):
    starved = []
    writer = BatchingWriter(make(tmp_path, clock), max_pending=100, is_starved=lambda: bool(starved))
    opened(writer, fsyncs)
    first, second = FakeMessage(b"a"), FakeMessage(b"b")
    writer(first)
    assert not first.finished
    starved.append(True)
    writer(second)
    assert first.finished and second.finished


def test_stopping_writer_syncs_every_message_at_once(tmp_path, clock, fsyncs):
    writer = BatchingWriter(make(tmp_path, clock), max_pending=100)
    writer.stopping = True
    m = FakeMessage(b"late")
    writer(m)
    assert m.finished and len(fsyncs) == 1


def test_tick_syncs_held_messages_and_nothing_when_none(tmp_path, clock, fsyncs):
    writer = BatchingWriter(make(tmp_path, clock), max_pending=100)
    opened(writer, fsyncs)
    m = FakeMessage(b"x")
    writer(m)
    assert not m.finished
    writer.tick()
    assert m.finished and len(fsyncs) == 1
    writer.tick()
    assert len(fsyncs) == 1  # nothing held, no fsync


def test_close_syncs_and_finishes_before_closing(tmp_path, clock, fsyncs):
    logger = make(tmp_path, clock)
    writer = BatchingWriter(logger, max_pending=100)
    m = FakeMessage(b"x")
    writer(m)
    writer.close()
    assert m.finished and logger.out is None
    assert read(logger.closed_files[0]) == b"x\n"


# -- gzip ------------------------------------------------------------------------------


def test_gzip_file_is_one_valid_stream_across_syncs(tmp_path, clock):
    logger = make(tmp_path, clock, gzip=True)
    data = lines(30)
    for i, body in enumerate(data):
        logger.write_line(body)
        if i % 7 == 6:
            logger.sync()
            # Up to the last sync the file is a complete gzip stream already.
            assert gzip.decompress(read(logger.path)) == b"".join(b + b"\n" for b in data[: i + 1])
    logger.close()
    (name,) = files(tmp_path / "out")
    assert name == f"events.box-000000.{stamp(clock)}.log.gz"
    with gzip.open(tmp_path / "out" / name) as f:  # what gunzip reads
        assert f.read().splitlines() == data


def test_gzip_file_is_never_appended_to_a_new_revision_is_opened(tmp_path, clock):
    for body in (b"first", b"second"):
        logger = make(tmp_path, clock, gzip=True)
        logger.write_line(body)
        logger.close()
    names = files(tmp_path / "out")
    assert names == [f"events.box-00000{i}.{stamp(clock)}.log.gz" for i in (0, 1)]
    assert [gzip.decompress(read(tmp_path / "out" / n)) for n in names] == [b"first\n", b"second\n"]


def test_gzip_level_is_used(tmp_path, clock):
    rng = random.Random(7)
    data = [bytes(rng.choice(b"abcdefgh ") for _ in range(200)) for _ in range(100)]
    sizes = {}
    for level in (1, 9):
        logger = make(tmp_path / str(level), clock, gzip=True, gzip_level=level)
        for body in data:
            logger.write_line(body)
        logger.close()
        sizes[level] = os.path.getsize(logger.closed_files[0])
        assert gzip.decompress(read(logger.closed_files[0])).splitlines() == data
    assert sizes[9] < sizes[1]


# -- rotation -----------------------------------------------------------------------------


def test_rotate_size_makes_several_files_whose_concatenation_is_the_lines(tmp_path, clock):
    logger = make(tmp_path, clock, rotate_size=35)
    data = lines(20)  # 11 bytes a line: a file rotates once it holds more than 35 bytes
    for body in data:
        logger.write_line(body)
    logger.close()
    names = files(tmp_path / "out")
    assert names == [f"events.box-{i:06d}.{stamp(clock)}.log" for i in range(5)]
    contents = [read(tmp_path / "out" / n) for n in names]
    assert b"".join(contents).splitlines() == data
    assert all(len(c) == 44 for c in contents)  # 4 lines: the 4th takes it over 35


def test_rotation_syncs_the_held_messages_into_the_closed_file(tmp_path, clock, fsyncs):
    logger = make(tmp_path, clock, rotate_size=15)
    writer = BatchingWriter(logger, max_pending=100)
    opened(writer, fsyncs)
    a, b, c = (FakeMessage(x) for x in (b"aaaaaaaaa", b"bbbbbbbbb", b"ccc"))
    writer(a)
    assert not a.finished
    writer(b)  # the file is over 15 bytes after a: rotate before writing b, then sync
    assert a.finished and b.finished and len(fsyncs) == 2  # the closed file, then the new one
    writer(c)
    assert not c.finished
    writer.close()
    assert c.finished
    assert [read(p) for p in logger.closed_files] == [b"first\naaaaaaaaa\n", b"bbbbbbbbb\nccc\n"]


def test_gzip_with_rotate_size_each_file_is_a_valid_stream(tmp_path, clock):
    logger = make(tmp_path, clock, gzip=True, rotate_size=50)
    data = lines(40)
    for i, body in enumerate(data):
        logger.write_line(body)
        if i % 3 == 0:
            logger.sync()
    logger.close()
    names = files(tmp_path / "out")
    assert len(names) > 3
    out = b"".join(gzip.decompress(read(tmp_path / "out" / n)) for n in names)
    assert out.splitlines() == data


def test_rotate_interval_on_the_clock(tmp_path, clock):
    logger = make(tmp_path, clock, rotate_interval=60.0, datetime_format="%Y")
    logger.write_line(b"a")
    clock.advance(59)
    logger.write_line(b"b")
    assert len(logger.closed_files) == 0
    clock.advance(2)
    logger.write_line(b"c")  # 61 s after the open: rotate first
    logger.close()
    assert [read(p) for p in logger.closed_files] == [b"a\nb\n", b"c\n"]
    assert [os.path.basename(p) for p in logger.closed_files] == [
        f"events.box-00000{i}.{stamp(clock, '%Y')}.log" for i in (0, 1)
    ]


def test_tick_rotates_an_expired_file_without_messages(tmp_path, clock):
    logger = make(tmp_path, clock, rotate_interval=60.0)
    logger.write_line(b"a")
    clock.advance(61)
    logger.tick()
    assert logger.out is not None and len(logger.closed_files) == 1  # a new, empty file
    logger.close()
    assert [read(p) for p in logger.closed_files] == [b"a\n", b""]


def test_skip_empty_files_tick_closes_instead_of_opening_an_empty_one(tmp_path, clock):
    logger = make(tmp_path, clock, rotate_interval=60.0, skip_empty_files=True)
    logger.tick()  # nothing written yet: no file
    assert files(tmp_path / "out") == []
    logger.write_line(b"a")
    clock.advance(61)
    logger.tick()
    assert logger.out is None
    assert [read(p) for p in logger.closed_files] == [b"a\n"]
    assert len(files(tmp_path / "out")) == 1


def test_new_datetime_rotates_to_a_new_name(tmp_path, clock):
    logger = make(tmp_path, clock)
    logger.write_line(b"a")
    first = stamp(clock)
    clock.advance(HOUR)
    logger.write_line(b"b")
    logger.close()
    second = stamp(clock)
    assert first != second
    assert files(tmp_path / "out") == sorted([f"events.box.{first}.log", f"events.box.{second}.log"])


# -- work dir ------------------------------------------------------------------------------


def test_work_dir_file_moves_to_output_dir_when_closed(tmp_path, clock):
    work, out = tmp_path / "work", tmp_path / "out"
    logger = make(tmp_path, clock, work_dir=str(work), output_dir=str(out))
    logger.write_line(b"a")
    name = f"events.box-000000.{stamp(clock)}.log"
    assert files(work) == [name] and files(out) == []
    logger.close()
    assert files(work) == [] and files(out) == [name]
    assert read(out / name) == b"a\n"


def test_work_dir_open_skips_revisions_taken_in_output_dir(tmp_path, clock):
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    taken = f"events.box-000000.{stamp(clock)}.log"
    (out / taken).write_bytes(b"old\n")
    logger = make(tmp_path, clock, work_dir=str(work), output_dir=str(out))
    logger.write_line(b"a")
    logger.close()
    assert read(out / taken) == b"old\n"  # never overwritten
    assert read(out / f"events.box-000001.{stamp(clock)}.log") == b"a\n"


def test_work_dir_move_bumps_the_revision_when_the_name_appeared_meanwhile(tmp_path, clock):
    work, out = tmp_path / "work", tmp_path / "out"
    logger = make(tmp_path, clock, work_dir=str(work), output_dir=str(out))
    logger.write_line(b"a")
    name = f"events.box-000000.{stamp(clock)}.log"
    (out / name).write_bytes(b"someone else's\n")
    logger.close()
    assert read(out / name) == b"someone else's\n"
    assert read(out / f"events.box-000001.{stamp(clock)}.log") == b"a\n"
    assert files(work) == []


def test_rotate_size_skips_an_existing_revision_already_too_big(tmp_path, clock):
    out = tmp_path / "out"
    out.mkdir()
    (out / f"events.box-000000.{stamp(clock)}.log").write_bytes(b"x" * 100)
    logger = make(tmp_path, clock, rotate_size=50)
    logger.write_line(b"a")
    logger.close()
    assert read(out / f"events.box-000001.{stamp(clock)}.log") == b"a\n"


# -- flags -----------------------------------------------------------------------------


def parse(*argv):
    return check_args(build_parser().parse_args(list(argv)))


def test_flags_defaults_and_work_dir_defaults_to_output_dir():
    opts = parse("--topic=t", "--nsqd-tcp-address=127.0.0.1:4150")
    assert opts == FileOptions(output_dir="/tmp", work_dir="/tmp")
    args = build_parser().parse_args(["--topic=t"])
    assert (args.channel, args.max_in_flight, args.sync_interval) == ("nsq_to_file", 200, 30.0)
    assert (args.topic_refresh, args.gzip_level, args.rotate_size) == (60.0, 6, 0)


def test_flags_in_go_forms():
    opts = parse("-topic", "t", "-nsqd-tcp-address=a:1", "-gzip", "-gzip-level=9",
                 "-rotate-size", "1000", "-rotate-interval=1h", "-output-dir=/o", "-work-dir=/w")
    assert opts == FileOptions(output_dir="/o", work_dir="/w", gzip=True, gzip_level=9,
                               rotate_size=1000, rotate_interval=3600.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topic=t"], "--nsqd-tcp-address or --lookupd-http-address required"),
        (["--topic=t", "--nsqd-tcp-address=a:1", "--lookupd-http-address=b:2"],
         "use --nsqd-tcp-address or --lookupd-http-address not both"),
        (["--nsqd-tcp-address=a:1"], "--topic or --topic-pattern required"),
        (["--lookupd-http-address=b:2"], "--topic or --topic-pattern required"),
        (["--nsqd-tcp-address=a:1", "--topic-pattern=x"],
         "--lookupd-http-address must be specified when no --topic specified"),
        (["--topic=t", "--nsqd-tcp-address=a:1", "--log-level=loud"], "--log-level is invalid"),
        (["--topic=t", "--nsqd-tcp-address=a:1", "--gzip-level=10"],
         r"invalid --gzip-level value \(10\), should be 1-9"),
        (["--topic=t", "--nsqd-tcp-address=a:1", "--channel="], "--channel is required"),
        (["--topic=t", "--nsqd-tcp-address=a:1", "--gzip", "--filename-format=<TOPIC>.log"],
         "missing <REV>"),
        (["--topic=t", "--nsqd-tcp-address=a:1", "--topic-pattern=("], "invalid --topic-pattern"),
    ],
)
def test_flag_errors_in_nsq_to_files_words(argv, message):
    with pytest.raises(ToolError, match=message):
        parse(*argv)


def test_log_level_is_read_whatever_its_case():
    args = build_parser().parse_args(["--topic=t", "--nsqd-tcp-address=a:1", "--log-level=WARN"])
    check_args(args)
    assert args.log_level == "warn"


@pytest.mark.parametrize(("refresh", "lookups"), [("0", 1), ("1m", 2)])
def test_a_topic_refresh_of_zero_never_refreshes(monkeypatch, refresh, lookups):
    """Go's time.Tick(0) is nil: nsq_to_file never asks lookupd again, where a LoopingCall(0) would spin."""
    asked = []

    async def topics(addresses, args):
        asked.append(addresses)
        return []

    monkeypatch.setattr(to_file, "lookupd_topics", topics)
    clock = task.Clock()
    args = build_parser().parse_args(["--lookupd-http-address=b:2", "--topic-pattern=x",
                                      f"--topic-refresh={refresh}"])
    discoverer = to_file.TopicDiscoverer(clock, args, check_args(args), config=None)
    defer.ensureDeferred(discoverer.start())  # the lookups answer at once; the clock drives the refresh
    clock.advance(60)
    assert len(asked) == lookups
    discoverer.stop()


def test_every_lookupd_down_at_start_is_logged_and_asked_again_at_the_next_refresh(monkeypatch):
    """As nsq_to_file: started before its lookupds (a boot order), it keeps running and finds topics later."""
    answers = [ToolError("could not retrieve topic list: http://b:2/topics: connection refused"), ["xa"]]
    added = []

    async def topics(addresses, args):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(to_file, "lookupd_topics", topics)
    clock = task.Clock()
    args = build_parser().parse_args(["--lookupd-http-address=b:2", "--topic-pattern=x"])
    discoverer = to_file.TopicDiscoverer(clock, args, check_args(args), config=None)
    monkeypatch.setattr(discoverer, "add", added.append)
    started = defer.ensureDeferred(discoverer.start())
    assert started.called and started.result is None
    assert added == []
    clock.advance(60)
    assert added == ["xa"]
    discoverer.stop()


@pytest_twisted.inlineCallbacks
def test_a_lookupd_answer_over_the_bound_is_an_error_not_a_memory_cost(monkeypatch):
    from twisted.internet import reactor
    from twisted.web import resource, server

    from mqd.client import discovery

    monkeypatch.setattr(discovery, "MAX_RESPONSE_SIZE", 1000)

    class Topics(resource.Resource):
        isLeaf = True

        def render_GET(self, request):
            return b'{"topics":["' + b"x" * 5000 + b'"]}'

    root = resource.Resource()
    root.putChild(b"topics", Topics())
    port = reactor.listenTCP(0, server.Site(root), interface="127.0.0.1")
    address = f"127.0.0.1:{port.getHost().port}"
    args = build_parser().parse_args([f"--lookupd-http-address={address}", "--topic-pattern=x"])
    check_args(args)
    try:
        with pytest.raises(ToolError, match=f"http://{address}/topics: answer of 5015 bytes is over 1000"):
            yield defer.ensureDeferred(to_file.lookupd_topics([address], args))
    finally:
        yield port.stopListening()
