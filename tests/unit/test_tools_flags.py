"""mqd.tools.flags (Go's flag forms, repeatable flags, pass-through options), and the pieces
of mq-pub and mq-tail that need no broker (line splitting, token bucket, printing)."""

from __future__ import annotations

import pytest
from twisted.internet import defer, task

from mqd import __version__
from mqd.tools.flags import (
    ToolError,
    ToolParser,
    apply_config_opts,
    fatal,
    make_config,
    parse_checked,
    split_config_opt,
)
from mqd.tools.pub import LineSplitter, Publisher
from mqd.tools.tail import Printer


def parser() -> ToolParser:
    p = ToolParser("mq-test")
    p.add_list("topic", "NSQ topic")
    p.add_str("channel", "", "NSQ channel")
    p.add_int("n", 0, "total messages")
    p.add_int("max-in-flight", 200, "max in flight")
    p.add_bool("print-topic", "print topic")
    p.add_bool("gzip", "gzip")
    p.add_duration("sync-interval", "30s", "sync interval")
    p.add_addresses()
    p.add_config_opts("consumer")
    return p


@pytest.mark.parametrize(
    "argv",
    [
        ["-topic=a", "-channel=c"],
        ["-topic", "a", "-channel", "c"],
        ["--topic=a", "--channel=c"],
        ["--topic", "a", "--channel", "c"],
    ],
)
def test_every_go_form_of_a_value_flag(argv):
    args = parser().parse_args(argv)
    assert args.topic == ["a"]
    assert args.channel == "c"


def test_defaults():
    args = parser().parse_args([])
    assert args.topic == [] and args.nsqd_tcp_address == [] and args.lookupd_http_address == []
    assert args.consumer_opt == []
    assert (args.n, args.max_in_flight, args.sync_interval) == (0, 200, 30.0)
    assert args.print_topic is False and args.channel == ""


def test_a_negative_count_or_rate_is_no_limit_as_in_nsqs_tools():
    from mqd.tools import pub, tail

    args, _ = parse_checked(tail.build_parser(), tail.check_args,
                            ["--topic=t", "--nsqd-tcp-address=a:1", "-n", "-1"])
    assert (args.n, args.max_in_flight) == (0, 200)
    args, _ = parse_checked(pub.build_parser(), pub.check_args,
                            ["--topic=t", "--nsqd-tcp-address=a:1", "--rate=-5"])
    assert args.rate == 0


def test_repeatable_flags_keep_every_value_in_order():
    args = parser().parse_args(
        [
            "--nsqd-tcp-address=127.0.0.1:4150",
            "-nsqd-tcp-address",
            "127.0.0.1:4250",
            "--lookupd-http-address",
            "127.0.0.1:4161",
            "-topic=a",
            "-topic=b",
        ]
    )
    assert args.nsqd_tcp_address == ["127.0.0.1:4150", "127.0.0.1:4250"]
    assert args.lookupd_http_address == ["127.0.0.1:4161"]
    assert args.topic == ["a", "b"]


def test_repeatable_default_is_not_shared_between_parses():
    p = parser()
    p.parse_args(["--topic=a"])
    assert p.parse_args([]).topic == []


def test_single_letter_flag_in_go_forms():
    assert parser().parse_args(["-n", "5"]).n == 5
    assert parser().parse_args(["-n=7"]).n == 7
    assert parser().parse_args(["--n=9"]).n == 9


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["-print-topic"], True),
        (["--print-topic"], True),
        (["--print-topic=true"], True),
        (["-print-topic=1"], True),
        (["--print-topic=false"], False),
        (["-print-topic=F"], False),
        ([], False),
    ],
)
def test_boolean_flags_take_go_spellings(argv, expected):
    assert parser().parse_args(argv).print_topic is expected


def test_bare_boolean_does_not_swallow_the_next_flag():
    args = parser().parse_args(["--gzip", "--topic", "a"])
    assert args.gzip is True and args.topic == ["a"]


def test_bad_boolean_is_a_command_line_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--gzip=maybe"])
    assert exc.value.code == 2  # Go's flag package exits 2 on a bad command line
    err = capsys.readouterr().err
    assert err.startswith('invalid boolean value "maybe" for -gzip: parse error\nUsage of mq-test:\n')


@pytest.mark.parametrize(
    "text, seconds", [("30s", 30.0), ("1m30s", 90.0), ("250ms", 0.25), ("0", 0.0), ("2h", 7200.0)]
)
def test_duration_flags_take_go_durations(text, seconds):
    assert parser().parse_args([f"-sync-interval={text}"]).sync_interval == seconds


def test_bad_duration_is_a_command_line_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--sync-interval", "30"])
    assert exc.value.code == 2
    # Go's time.ParseDuration wants a unit; its flag package says no more than "parse error".
    assert capsys.readouterr().err.startswith('invalid value "30" for flag -sync-interval: parse error\n')


def test_unknown_flag_and_abbreviation_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--bogus=1"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        parser().parse_args(["--max-in=3"])  # Go has no abbreviations
    lines = capsys.readouterr().err.splitlines()
    assert "flag provided but not defined: -bogus" in lines
    assert "flag provided but not defined: -max-in" in lines


def test_a_flag_without_its_value_is_refused_as_go_does(capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--channel"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("flag needs an argument: -channel\nUsage of mq-test:\n")


def test_usage_lists_flags_as_go_does(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--bogus"])
    err = capsys.readouterr().err
    assert "  -gzip\n    \t" in err  # a boolean takes no value
    assert "  -channel string\n    \t" in err
    assert "  -max-in-flight int\n    \t" in err
    assert "  -sync-interval duration\n    \t" in err
    assert "  -topic value\n    \t" in err


def test_version_prints_tool_and_mqd_version(capsys):
    for argv in (["--version"], ["-version"]):
        with pytest.raises(SystemExit) as exc:
            parser().parse_args(argv)
        assert exc.value.code == 0
        assert capsys.readouterr().out == f"mq-test v{__version__}\n"


def test_reader_opt_is_the_deprecated_spelling_of_consumer_opt():
    args = parser().parse_args(["--reader-opt=snappy", "--consumer-opt", "max_attempts,3"])
    assert args.consumer_opt == ["snappy", "max_attempts,3"]


def test_values_after_double_dash_are_left_alone():
    p = parser()
    p.add_argument("rest", nargs="*")
    args = p.parse_args(["--topic=a", "--", "-topic=b"])
    assert args.topic == ["a"] and args.rest == ["-topic=b"]


@pytest.mark.parametrize(
    "opt, pair",
    [
        ("max_in_flight,5", ("max_in_flight", "5")),
        ("max_in_flight=5", ("max_in_flight", "5")),
        ("snappy", ("snappy", "true")),
        ("auth_secret,a=b,c", ("auth_secret", "a=b,c")),
        ("auth_secret=a,b=", ("auth_secret", "a,b=")),
        ("read_timeout=1m30s", ("read_timeout", "1m30s")),
    ],
)
def test_split_config_opt(opt, pair):
    assert split_config_opt(opt) == pair


class FakeConfig:
    def __init__(self):
        self.values = {}

    def set(self, name, value):
        if name == "bogus":
            raise ValueError("unknown option 'bogus'")
        self.values[name] = value


def test_apply_config_opts_sets_each_in_order():
    cfg = FakeConfig()
    apply_config_opts(cfg, ["max_in_flight,5", "snappy", "max_in_flight=7"])
    assert cfg.values == {"max_in_flight": "7", "snappy": "true"}


def test_apply_config_opts_bad_option_is_a_tool_error():
    with pytest.raises(ToolError, match="bogus"):
        apply_config_opts(FakeConfig(), ["bogus=1"])


def test_fatal_writes_the_message_and_exits_1(capsys):
    with pytest.raises(SystemExit) as exc:
        fatal("--topic is required")
    assert exc.value.code == 1
    assert capsys.readouterr().err == "--topic is required\n"


# -- with the real client Config --------------------------------------------------


def test_make_config_applies_opts_then_the_tools_own_flags():
    cfg = make_config(
        "mq-tail", ["max_in_flight,5", "max_attempts=3", "read_timeout,90s"], max_in_flight=200
    )
    assert cfg.max_in_flight == 200  # --max-in-flight wins, as in nsq's tools
    assert cfg.max_attempts == 3
    assert cfg.read_timeout == 90.0
    assert cfg.user_agent.startswith(f"mq-tail/{__version__} ")


def test_make_config_unknown_or_out_of_range_option_is_a_tool_error():
    with pytest.raises(ToolError, match="bogus"):
        make_config("mq-tail", ["bogus,1"])
    with pytest.raises(ToolError, match="max_attempts"):
        make_config("mq-tail", ["max_attempts,100000"])


# -- mq-pub's and mq-tail's pieces, without a broker ----------------------------------------


class FakeProducer:
    def __init__(self, address="a:1"):
        self.address = address
        self.sent: list[tuple[str, bytes, defer.Deferred]] = []

    def publish(self, topic, body):
        d = defer.Deferred()
        self.sent.append((topic, body, d))
        return d

    def ack_all(self):
        for _, _, d in self.sent:
            if not d.called:
                d.callback(b"OK")


def test_line_splitter_skips_empty_lines_and_keeps_a_last_line_without_delimiter():
    got, ends = [], []
    splitter = LineSplitter(b",", got.append, lambda: ends.append(True))
    splitter.dataReceived(b"a,,b")
    splitter.dataReceived(b"c,d")
    assert got == [b"a", b"bc"]
    splitter.connectionLost()
    assert got == [b"a", b"bc", b"d"] and ends == [True]


def test_publisher_sends_every_line_to_every_producer_and_is_done_after_eof_and_acks():
    producers = [FakeProducer("a:1"), FakeProducer("b:2")]
    publisher = Publisher("t", producers)
    for line in (b"x", b"y"):
        publisher.line(line)
    publisher.end()
    assert [[(t, b) for t, b, _ in p.sent] for p in producers] == [[("t", b"x"), ("t", b"y")]] * 2
    assert not publisher.done.called  # EOF, but not acknowledged yet
    producers[0].ack_all()
    assert not publisher.done.called
    producers[1].ack_all()
    assert publisher.done.result == 2


def test_publisher_failed_publish_fails_done_with_a_tool_error():
    producer = FakeProducer()
    publisher = Publisher("t", [producer])
    publisher.line(b"x")
    producer.sent[0][2].errback(RuntimeError("E_BAD_TOPIC PUB topic name is not valid"))
    failures = []
    publisher.done.addErrback(failures.append)
    assert failures[0].check(ToolError)
    # to_nsq prints go-nsq's error and nothing else.
    assert str(failures[0].value) == "E_BAD_TOPIC PUB topic name is not valid"


def test_publisher_rate_is_to_nsqs_token_bucket():
    clock = task.Clock()
    producer = FakeProducer()
    publisher = Publisher("t", [producer], rate=10, clock=clock)
    for i in range(5):
        publisher.line(b"%d" % i)
    assert len(producer.sent) == 1  # one token to start with
    for expected in (2, 3, 4, 5):
        clock.advance(0.1)
        assert len(producer.sent) == expected
    clock.advance(10)  # idle: at most one second of tokens saved up
    for _ in range(15):
        publisher.line(b"more")
    assert len(producer.sent) == 5 + 10
    publisher.end()
    clock.advance(0.5)
    assert len(producer.sent) == 20
    producer.ack_all()
    assert publisher.done.result == 20
    assert not clock.getDelayedCalls()  # the ticker stops when done


def test_publisher_pauses_stdin_while_too_many_publishes_wait():
    from mqd.tools import pub

    events = []
    producer = FakeProducer()
    publisher = Publisher("t", [producer], pause=lambda: events.append("pause"),
                          resume=lambda: events.append("resume"))
    for _ in range(pub.HIGH_WATER):
        publisher.line(b"x")
    assert events == ["pause"]
    producer.ack_all()
    assert events == ["pause", "resume"]


def test_publisher_sends_nothing_until_every_broker_is_connected():
    events = []
    producers = [FakeProducer("a:1"), FakeProducer("b:2")]
    connecting = defer.Deferred()
    publisher = Publisher("t", producers, pause=lambda: events.append("pause"),
                          resume=lambda: events.append("resume"), connect=lambda: connecting)
    publisher.line(b"x")
    publisher.line(b"y")  # read in the same chunk as x, after the pause
    publisher.end()
    assert [p.sent for p in producers] == [[], []] and events == ["pause"]
    connecting.callback(None)
    assert [[b for _, b, _ in p.sent] for p in producers] == [[b"x", b"y"]] * 2
    assert events == ["pause", "resume"]
    for p in producers:
        p.ack_all()
    assert publisher.done.result == 2


def test_publisher_whose_broker_cannot_be_reached_publishes_nowhere():
    producers = [FakeProducer("a:1"), FakeProducer("b:2")]
    connecting = defer.Deferred()
    publisher = Publisher("t", producers, connect=lambda: connecting)
    publisher.line(b"x")
    connecting.errback(ToolError("dial tcp b:2: connect: connection refused"))
    failures = []
    publisher.done.addErrback(failures.append)
    assert str(failures[0].value) == "dial tcp b:2: connect: connection refused"
    publisher.line(b"y")
    assert [p.sent for p in producers] == [[], []]


def test_publisher_of_no_line_never_connects():
    connects = []
    publisher = Publisher("t", [FakeProducer()], connect=lambda: connects.append(1) or defer.Deferred())
    publisher.end()
    assert publisher.done.result == 0 and connects == []


class FakeMessage:
    def __init__(self, body):
        self.body = body
        self.requeued = None

    def requeue(self, delay=None, backoff=True):
        self.requeued = (delay, backoff)


def test_printer_prints_counts_over_topics_and_requeues_beyond_n():
    import io

    out, done = io.BytesIO(), []
    printer = Printer(out, total=3, print_topic=True, on_done=lambda: done.append(True))
    a, b = printer.handler("a"), printer.handler("b")
    a(FakeMessage(b"1"))
    b(FakeMessage(b"2"))
    assert not done
    a(FakeMessage(b"3"))
    assert done == [True]
    extra = FakeMessage(b"4")
    b(extra)
    assert out.getvalue() == b"a | 1\nb | 2\na | 3\n"
    assert extra.requeued == (0, False)


class FailingOut:
    def __init__(self, error: OSError) -> None:
        self.error = error

    def write(self, data):
        raise self.error

    def flush(self):
        pass


def test_printer_failing_stdout_is_fatal():
    errors = []
    handle = Printer(FailingOut(OSError(28, "No space left on device")), on_error=errors.append).handler("t")
    with pytest.raises(ToolError, match="failed to write to stdout"):
        handle(FakeMessage(b"x"))
    assert len(errors) == 1 and isinstance(errors[0], ToolError)


def test_printer_closed_stdout_ends_as_go_does_by_sigpipe():
    errors, broken = [], []
    handle = Printer(FailingOut(BrokenPipeError(32, "Broken pipe")), on_error=errors.append,
                     on_broken_pipe=lambda: broken.append(True)).handler("t")
    with pytest.raises(BrokenPipeError):
        handle(FakeMessage(b"x"))
    assert (broken, errors) == ([True], [])


@pytest.mark.parametrize("module", ["tail", "pub", "to_file", "stat"])
@pytest.mark.parametrize("flag", ["-help", "--help", "-h"])
def test_every_tools_help_is_gos_flag_listing_on_stderr(module, flag, capsys):
    """As nsq's tools answer -help: `Usage of <tool>:`, each flag as flag.PrintDefaults writes it, exit 0."""
    import importlib

    tool = importlib.import_module(f"mqd.tools.{module}")
    parser = tool.build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([flag])
    assert exc.value.code == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"Usage of {parser.prog}:\n  -")
    assert "\n  -version\n    \tprint version string\n" in err
