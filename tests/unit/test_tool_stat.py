"""mq-stat without a network: nsq_stat's table, its arithmetic, its flags, and the poll loop on a Clock."""

from __future__ import annotations

import io
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest
from twisted.internet import defer
from twisted.internet.testing import MemoryReactorClock

from mqd import __version__
from mqd.clusterinfo.upstream import UpstreamError
from mqd.tools.flags import ToolError
from mqd.tools.stat import (
    ChannelTotals,
    StatTable,
    channel_totals,
    format_row,
    header,
    parse_args,
    stat_loop,
)

HEADER = (
    "------rate------+----------------depth----------------+--------------metadata---------------\n"
    "ingress  egress |   total     mem    disk inflt   def |     req     t-o         msgs clients\n"
)


def channel_doc(name: str, **counts) -> dict:
    doc = {"channel_name": name, "depth": 0, "backend_depth": 0, "in_flight_count": 0, "deferred_count": 0,
           "message_count": 0, "requeue_count": 0, "timeout_count": 0, "client_count": 0, "clients": None,
           "paused": False}
    doc.update(counts)
    return doc


def stats_doc(*topics: tuple[str, list[dict]]) -> dict:
    return {"version": "1.3.0", "health": "OK", "start_time": 1,
            "topics": [{"topic_name": t, "channels": chans, "depth": 0, "backend_depth": 0,
                        "message_count": 0, "paused": False} for t, chans in topics],
            "producers": None}


# -- the table -------------------------------------------------------------------------


def test_header_is_nsq_stats_byte_for_byte():
    assert header() == HEADER


def test_channel_totals_sum_every_producer_of_the_topic():
    a = stats_doc(("t", [channel_doc("c", depth=10, backend_depth=4, in_flight_count=2, deferred_count=1,
                                     requeue_count=3, timeout_count=1, message_count=100, client_count=2),
                         channel_doc("other", depth=999, message_count=999)]),
                  ("t2", [channel_doc("c", depth=777, message_count=777)]))
    # The old envelope, and an nsqd without client_count (clients listed instead).
    b = {"status_code": 200, "status_txt": "OK",
         "data": stats_doc(("t", [channel_doc("c", depth=5, in_flight_count=1, message_count=50,
                                              client_count=None, clients=[{}, {}, {}])]))}
    c = stats_doc()  # a producer whose topic has not this channel yet
    totals = channel_totals([a, b, c], "t", "c")
    assert totals == ChannelTotals(depth=15, memory_depth=11, backend_depth=4, in_flight_count=3,
                                   deferred_count=1, requeue_count=3, timeout_count=1, message_count=150,
                                   client_count=5)
    assert channel_totals([c, {"topics": None}], "t", "c") is None
    assert channel_totals([a], "t", "missing") is None


def test_row_rates_are_deltas_over_the_interval_truncated_like_go():
    before = ChannelTotals(depth=100, message_count=1000)
    now = ChannelTotals(depth=97, memory_depth=90, backend_depth=7, in_flight_count=12, deferred_count=3,
                        requeue_count=44, timeout_count=5, message_count=1007, client_count=2)
    # ingress 7 / 2 s → 3 (3.5 truncated); egress (7 - (-3)) / 2 → 5.
    assert format_row(now, before, 2.0) == (
        "      3       5 |      97      90       7    12     3 |      44       5         1007       2\n")
    # A falling message count (a broker restarted) gives negative rates, truncated toward zero.
    assert format_row(ChannelTotals(depth=0, message_count=0), ChannelTotals(depth=0, message_count=3),
                      2.0).startswith("     -1      -1 |")
    # Half a second: rates scale up.
    assert format_row(ChannelTotals(message_count=5, depth=5), ChannelTotals(), 0.5).startswith(
        "     10       0 |")


def test_wide_numbers_widen_the_columns_as_go_does():
    row = format_row(ChannelTotals(depth=123456789, message_count=1234567890123), ChannelTotals(), 1.0)
    assert row == ("1234567890123 1234444433334 | 123456789       0       0     0     0 |"
                   "       0       0 1234567890123       0\n")


def test_table_first_poll_only_header_then_rows_header_every_25_polls():
    table = StatTable(1.0)
    text = "".join(table.add(ChannelTotals(message_count=i, depth=i, memory_depth=i)) for i in range(52))
    lines = text.splitlines(keepends=True)
    head = HEADER.splitlines(keepends=True)
    # Poll 0: the header, no row; polls 1..24: rows; poll 25: header then its row; poll 50 again.
    assert lines[:2] == head
    assert lines[2] == "      1       0 |       1       1       0     0     0 |       0       0            1       0\n"
    assert len(lines) == 3 * 2 + 51  # three headers (polls 0, 25, 50), a row for each of polls 1..51
    assert lines[26:28] == head
    assert lines[28].split()[3] == "25"  # the row of poll 25 follows its header
    assert lines[53:55] == head
    assert sum(1 for line in lines if line in head) == 6


# -- the flags ------------------------------------------------------------------------------


def test_flags_in_every_go_form():
    options = parse_args(["-topic=t", "-channel", "c", "--lookupd-http-address", "127.0.0.1:4161",
                          "-lookupd-http-address=127.0.0.1:4261", "-interval=500ms", "--count=3",
                          "-http-client-connect-timeout", "1s", "--http-client-request-timeout=1500ms"])
    assert (options.topic, options.channel, options.interval, options.count) == ("t", "c", 0.5, 3)
    assert options.lookupd_http_addresses == ["127.0.0.1:4161", "127.0.0.1:4261"]
    assert options.nsqd_http_addresses == []
    assert (options.http_client_connect_timeout, options.http_client_request_timeout) == (1.0, 1.5)
    defaults = parse_args(["--topic=t", "--channel=c", "--nsqd-http-address=127.0.0.1:4151"])
    assert (defaults.interval, defaults.count) == (2.0, None)
    assert (defaults.http_client_connect_timeout, defaults.http_client_request_timeout) == (2.0, 5.0)


def test_status_every_is_the_deprecated_interval(capsys):
    options = parse_args(["--topic=t", "--channel=c", "--nsqd-http-address=h:1", "-status-every=1m"])
    assert options.interval == 60.0
    assert capsys.readouterr().err == "--status-every is deprecated, use --interval\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--channel=c", "--nsqd-http-address=h:1"], "--topic and --channel are required"),
    (["--topic=t", "--nsqd-http-address=h:1"], "--topic and --channel are required"),
    (["--topic=t", "--channel=c", "--nsqd-http-address=h:1", "--interval=0"], "--interval should be positive"),
    (["--topic=t", "--channel=c", "--nsqd-http-address=h:1", "--http-client-connect-timeout=0"],
     "--http-client-connect-timeout should be positive"),
    (["--topic=t", "--channel=c", "--nsqd-http-address=h:1", "--http-client-request-timeout=-1s"],
     "--http-client-request-timeout should be positive"),
    (["--topic=t", "--channel=c", "--nsqd-http-address=h:1", "--count=0"], "--count should be positive"),
    (["--topic=t", "--channel=c"], "--nsqd-http-address or --lookupd-http-address required"),
    (["--topic=t", "--channel=c", "--nsqd-http-address=h:1", "--lookupd-http-address=l:2"],
     "use --nsqd-http-address or --lookupd-http-address not both"),
    (["--topic=t", "--channel=c", "--nsqd-http-address=http://h:1"],
     "--nsqd-http-address error - address should not contain scheme"),
    (["--topic=t", "--channel=c", "--lookupd-http-address=https://l:2"],
     "--lookupd-http-address error - address should not contain scheme"),
])
def test_bad_flags_end_the_tool_as_log_fatal(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 1
    assert capsys.readouterr().err == message + "\n"


def test_unparsable_values_exit_2_as_go_flag_does(capsys):
    for bad in (["--interval=soon"], ["--count=x"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--topic=t", "--channel=c", "--nsqd-http-address=h:1", *bad])
        assert exit_.value.code == 2
    assert "parse error" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["-version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"mq-stat v{__version__}\n"


# -- the loop, on a Clock, against a fake upstream ------------------------------------------------


class FakeUpstream:
    """Upstream's get_json over canned answers: `routes[(host, path)]` is a list, one per request."""

    def __init__(self, routes: dict[tuple[str, str], list]) -> None:
        self.routes = routes
        self.urls: list[str] = []
        self.closed = False

    def get_json(self, url: str) -> defer.Deferred:
        self.urls.append(url)
        parts = urlsplit(url)
        answers = self.routes[(parts.netloc, parts.path)]
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            return defer.fail(answer)
        return defer.succeed(answer)

    def close(self) -> defer.Deferred:
        self.closed = True
        return defer.succeed(None)


def lookup(*http_ports: int) -> dict:
    return {"channels": ["c"], "producers": [
        {"remote_address": "127.0.0.1:1", "hostname": "h", "broadcast_address": "127.0.0.1",
         "tcp_port": port - 1, "http_port": port, "version": "1.3.0"} for port in http_ports]}


def options(**changes):
    base = {"topic": "t", "channel": "c", "interval": 2.0, "count": 2, "http_client_connect_timeout": 2.0,
            "http_client_request_timeout": 5.0, "nsqd_http_addresses": [], "lookupd_http_addresses": ["lk:4161"]}
    base.update(changes)
    return SimpleNamespace(**base)


def shut_down(reactor: MemoryReactorClock) -> bool:
    """What the reactor does as it stops: its "before shutdown" triggers (those the loop added)."""
    triggers = reactor.triggers.get("before", {}).get("shutdown", [])
    for f, args, kw in triggers:
        f(*args, **kw)
    return bool(triggers)


def test_loop_polls_every_interval_prints_count_rows_then_stops():
    one = [stats_doc(("t", [channel_doc("c", depth=d, message_count=m, in_flight_count=1, client_count=1)]))
           for d, m in ((5, 10), (9, 30), (0, 30))]
    two = [stats_doc(("t", [channel_doc("c", depth=d, message_count=m, requeue_count=r, client_count=1)]))
           for d, m, r in ((1, 4, 0), (1, 8, 2), (0, 8, 2))]
    upstream = FakeUpstream({
        ("lk:4161", "/lookup"): [lookup(4151, 4251)],
        ("127.0.0.1:4151", "/stats"): one,
        ("127.0.0.1:4251", "/stats"): two,
    })
    clock, out = MemoryReactorClock(), io.StringIO()
    d = stat_loop(clock, options(), out, upstream)
    assert out.getvalue() == HEADER
    clock.advance(1.99)
    assert out.getvalue() == HEADER
    clock.advance(0.01)
    # ingress (38 - 14) / 2 = 12; egress (24 - (10 - 6)) / 2 = 10.
    row1 = "     12      10 |      10      10       0     1     0 |       2       0           38       2\n"
    assert out.getvalue() == HEADER + row1
    clock.advance(2)
    # ingress 0; egress (0 - (0 - 10)) / 2 = 5.
    row2 = "      0       5 |       0       0       0     1     0 |       2       0           38       2\n"
    assert out.getvalue() == HEADER + row1 + row2
    assert d.called and d.result is None
    assert shut_down(clock) and upstream.closed
    assert clock.getDelayedCalls() == []
    stats_queries = [parse_qs(urlsplit(u).query) for u in upstream.urls if "/stats" in u]
    assert len(stats_queries) == 6
    assert all(q == {"format": ["json"], "topic": ["t"], "channel": ["c"], "include_clients": ["false"],
                     "include_mem": ["false"]} for q in stats_queries)
    assert sum("/lookup?topic=t" in u for u in upstream.urls) == 3


def test_loop_with_nsqd_addresses_queries_them_where_given():
    doc = stats_doc(("t", [channel_doc("c", depth=3, message_count=3)]))
    info = {"version": "1.3.0", "broadcast_address": "unresolvable.example", "hostname": "h",
            "tcp_port": 4150, "http_port": 4151}
    upstream = FakeUpstream({("10.0.0.1:4151", "/stats"): [doc], ("10.0.0.1:4151", "/info"): [info]})
    clock, out = MemoryReactorClock(), io.StringIO()
    d = stat_loop(clock, options(lookupd_http_addresses=[], nsqd_http_addresses=["10.0.0.1:4151"], count=1),
                  out, upstream)
    clock.advance(2)
    assert out.getvalue() == HEADER + (
        "      0       0 |       3       3       0     0     0 |       0       0            3       0\n")
    assert d.called
    assert all(urlsplit(u).netloc == "10.0.0.1:4151" for u in upstream.urls)


@pytest.mark.parametrize(("routes", "message"), [
    ({("lk:4161", "/lookup"): [UpstreamError("http://lk:4161/lookup?topic=t", "connection refused")]},
     'ERROR: failed to get topic producers - failed to query any nsqlookupd: Get "http://lk:4161/lookup?topic=t":'
     " dial tcp lk:4161: connect: connection refused"),
    ({("lk:4161", "/lookup"): [lookup(4151)],
      ("127.0.0.1:4151", "/stats"): [UpstreamError("http://127.0.0.1:4151/stats", "request timed out")]},
     'ERROR: failed to get nsqd stats - failed to query any nsqd: Get "http://127.0.0.1:4151/stats":'
     " net/http: timeout awaiting response headers (Client.Timeout exceeded while awaiting headers)"),
    ({("lk:4161", "/lookup"): [lookup(4151)],
      ("127.0.0.1:4151", "/stats"): [UpstreamError("http://127.0.0.1:4151/stats", "connect timed out")]},
     'ERROR: failed to get nsqd stats - failed to query any nsqd: Get "http://127.0.0.1:4151/stats":'
     " dial tcp 127.0.0.1:4151: i/o timeout"),
    ({("lk:4161", "/lookup"): [lookup(4151)], ("127.0.0.1:4151", "/stats"): [stats_doc(("t", []))]},
     "ERROR: failed to find channel(c) in stats metadata for topic(t)"),
    # No producer: nsq's GetNSQDStats queried none, and says so with nothing after the colon.
    ({("lk:4161", "/lookup"): [lookup()]}, "ERROR: failed to get nsqd stats - failed to query any nsqd: "),
])
def test_any_failure_ends_the_loop_with_nsq_stats_error(routes, message):
    upstream = FakeUpstream(routes)
    reactor = MemoryReactorClock()
    d = stat_loop(reactor, options(), io.StringIO(), upstream)
    failure = d.result
    d.addErrback(lambda f: None)
    assert failure.check(ToolError)
    assert str(failure.value) == message
    assert shut_down(reactor) and upstream.closed


def test_a_broker_failing_later_ends_the_loop_after_the_rows_so_far():
    doc = stats_doc(("t", [channel_doc("c", depth=1, message_count=1)]))
    upstream = FakeUpstream({("lk:4161", "/lookup"): [lookup(4151)],
                             ("127.0.0.1:4151", "/stats"): [doc, doc, UpstreamError("u", "connection refused")]})
    clock, out = MemoryReactorClock(), io.StringIO()
    d = stat_loop(clock, options(count=None), out, upstream)
    clock.advance(2)
    clock.advance(2)
    assert out.getvalue().count("\n") == 3
    assert d.called and d.result.check(ToolError)
    d.addErrback(lambda f: None)
