"""mq-stat: nsq_stat for mqd — one channel's totals across every producer of its topic, every interval.

The producers are the topic's as the lookupds list them (`/lookup`), or
the `--nsqd-http-address` brokers that have the topic; each one's
`/stats?format=json&topic=&channel=&include_clients=false` is summed, as
nsq's clusterinfo sums them. The table is nsq_stat's, byte for byte: a
two-line header every 25 polls, then one row per poll after the first
(the first only gives the rates their starting point). `ingress` and
`egress` are messages per second over the last interval (the channel's
message_count delta, and that delta less the depth's, divided by the
interval and truncated as Go's int64() does); every other column is the
current total, as nsq_stat prints them.

As in nsq_stat, any failure (a lookupd or broker that does not answer, a
channel no producer has) ends the tool with `ERROR: ...` and exit 1:
totals that silently miss a broker would be worse than none.

The flags are nsq_stat 1.x's; `--status-every`, its name before
`--interval`, is still taken (with nsq 0.3's deprecation notice). Brokers
given by `--nsqd-http-address` are queried at that address, not at the
broadcast address their /info names (which may not resolve from here).
The HTTP side (timeouts, lookupd 404 = no producer, the union of the
lookupds' producers) is mqadmin's `Cluster` over `Upstream`.

`--http-auth-secret` (or $MQ_HTTP_AUTH_SECRET) is sent as
`Authorization: Bearer` with every request, for lookupds and brokers run
with `--http-auth-required`. A 401 or 403 from any of them ends the tool
with one line naming it (`ERROR: nsqd HOST:PORT answered 401 Unauthorized
(AUTH_REQUIRED): ...`) and exit 1.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import IO, Any, NoReturn

from twisted.internet import defer, task

from mqd.clusterinfo.bearer import bearer_headers
from mqd.clusterinfo.cluster import Cluster
from mqd.clusterinfo.upstream import Authorized, Upstream
from mqd.tools.flags import (
    ToolError,
    ToolParser,
    bad_flag_value,
    fatal,
    go_duration,
    http_auth_secret,
    refused_line,
    run,
)

__all__ = ["ChannelTotals", "StatTable", "channel_totals", "format_row", "header", "main", "parse_args"]

TOOL = "mq-stat"
# nsq_stat prints its header again every this many polls.
HEADER_EVERY = 25


@dataclass(frozen=True, slots=True)
class ChannelTotals:
    """One channel's counters summed over every producer (nsq's clusterinfo.ChannelStats.Add)."""

    depth: int = 0
    memory_depth: int = 0
    backend_depth: int = 0
    in_flight_count: int = 0
    deferred_count: int = 0
    requeue_count: int = 0
    timeout_count: int = 0
    message_count: int = 0
    client_count: int = 0

    def __add__(self, other: ChannelTotals) -> ChannelTotals:
        return ChannelTotals(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _int(doc: Mapping[str, Any], key: str) -> int:
    value = doc.get(key) or 0
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _channel(doc: Mapping[str, Any]) -> ChannelTotals:
    depth, backend = _int(doc, "depth"), _int(doc, "backend_depth")
    clients = doc.get("client_count")
    if not isinstance(clients, int):  # an nsqd older than client_count: count the list
        clients = len(doc.get("clients") or ())
    return ChannelTotals(
        depth=depth,
        # nsq computes it rather than reading memory_depth (nsqd's /stats has none).
        memory_depth=depth - backend,
        backend_depth=backend,
        in_flight_count=_int(doc, "in_flight_count"),
        deferred_count=_int(doc, "deferred_count"),
        requeue_count=_int(doc, "requeue_count"),
        timeout_count=_int(doc, "timeout_count"),
        message_count=_int(doc, "message_count"),
        client_count=clients,
    )


def channel_totals(answers: Iterable[Mapping[str, Any]], topic: str, channel: str) -> ChannelTotals | None:
    """The channel's totals over the producers' `/stats?format=json` answers; None if none has it.

    An answer may be the flat document or the old `{"status_code", "data"}`
    envelope; other topics and channels in it are ignored.
    """
    total: ChannelTotals | None = None
    for doc in answers:
        if isinstance(doc, Mapping) and "data" in doc and "status_code" in doc:
            doc = doc["data"]
        if not isinstance(doc, Mapping):
            continue
        for topic_doc in doc.get("topics") or ():
            if not isinstance(topic_doc, Mapping) or topic_doc.get("topic_name") != topic:
                continue
            for channel_doc in topic_doc.get("channels") or ():
                if isinstance(channel_doc, Mapping) and channel_doc.get("channel_name") == channel:
                    one = _channel(channel_doc)
                    total = one if total is None else total + one
    return total


def header() -> str:
    """nsq_stat's two header lines."""
    return (
        "------rate------+----------------depth----------------+--------------metadata---------------\n"
        f"{'ingress':>7} {'egress':>7} | {'total':>7} {'mem':>7} {'disk':>7} {'inflt':>5} "
        f"{'def':>5} | {'req':>7} {'t-o':>7} {'msgs':>12} {'clients':>7}\n"
    )


def format_row(current: ChannelTotals, previous: ChannelTotals, interval: float) -> str:
    """One row of the table: rates over `interval` seconds from `previous`, then `current`'s totals."""
    messages = current.message_count - previous.message_count
    ingress = int(messages / interval)
    egress = int((messages - (current.depth - previous.depth)) / interval)
    c = current
    return (
        f"{ingress:7d} {egress:7d} | {c.depth:7d} {c.memory_depth:7d} {c.backend_depth:7d} "
        f"{c.in_flight_count:5d} {c.deferred_count:5d} | {c.requeue_count:7d} {c.timeout_count:7d} "
        f"{c.message_count:12d} {c.client_count:7d}\n"
    )


class StatTable:
    """nsq_stat's printing loop without the network: feed it each poll's totals, print what it returns."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.polls = 0
        self.previous: ChannelTotals | None = None

    def add(self, totals: ChannelTotals) -> str:
        text = header() if self.polls % HEADER_EVERY == 0 else ""
        if self.previous is not None:
            text += format_row(totals, self.previous, self.interval)
        self.previous = totals
        self.polls += 1
        return text


# -- the command line ----------------------------------------------------------------


def build_parser() -> ToolParser:
    parser = ToolParser(TOOL, "Polls /stats for all the producers of the specified topic/channel "
                              "and displays aggregate stats (nsq_stat).")
    parser.add_str("topic", "", "NSQ topic")
    parser.add_str("channel", "", "NSQ channel")
    parser.add_duration("interval", "2s", "duration of time between polling/printing output")
    parser.add_argument("--status-every", type=go_duration, default=None, metavar="DURATION",
                        help="(deprecated) use --interval")
    parser.add_duration("http-client-connect-timeout", "2s", "timeout for HTTP connect")
    parser.add_duration("http-client-request-timeout", "5s", "timeout for HTTP request")
    parser.add_argument("--count", type=_count, default=None, metavar="N", help="number of reports")
    parser.add_list("nsqd-http-address", "nsqd HTTP address (may be given multiple times)", "ADDR")
    parser.add_list("lookupd-http-address", "lookupd HTTP address (may be given multiple times)", "ADDR")
    parser.add_http_auth_secret()
    return parser


def _count(text: str) -> int:
    """nsq_stat's --count: base 10, and whether it was given at all matters (0 is refused)."""
    try:
        return int(text, 10)
    except ValueError:
        raise bad_flag_value(text, f"strconv.ParseInt: parsing {json.dumps(text)}: invalid syntax") from None


def parse_args(argv: Sequence[str] | None = None) -> SimpleNamespace:
    """The options, checked as nsq_stat checks them (a bad one ends the tool: exit 1)."""
    ns = build_parser().parse_args(argv)
    if not ns.topic or not ns.channel:
        fatal("--topic and --channel are required")
    interval = ns.interval
    if ns.status_every is not None:
        sys.stderr.write("--status-every is deprecated, use --interval\n")
        interval = ns.status_every
    if interval <= 0:
        fatal("--interval should be positive")
    if ns.http_client_connect_timeout <= 0:
        fatal("--http-client-connect-timeout should be positive")
    if ns.http_client_request_timeout <= 0:
        fatal("--http-client-request-timeout should be positive")
    if ns.count is not None and ns.count <= 0:
        fatal("--count should be positive")
    if not ns.nsqd_http_address and not ns.lookupd_http_address:
        fatal("--nsqd-http-address or --lookupd-http-address required")
    if ns.nsqd_http_address and ns.lookupd_http_address:
        fatal("use --nsqd-http-address or --lookupd-http-address not both")
    for flag, addresses in (("--nsqd-http-address", ns.nsqd_http_address),
                            ("--lookupd-http-address", ns.lookupd_http_address)):
        if any(a.startswith("http") for a in addresses):
            fatal(f"{flag} error - address should not contain scheme")
    try:
        secret = http_auth_secret(ns)
    except ToolError as e:
        fatal(str(e))
    return SimpleNamespace(
        topic=ns.topic, channel=ns.channel, interval=interval, count=ns.count,
        http_client_connect_timeout=ns.http_client_connect_timeout,
        http_client_request_timeout=ns.http_client_request_timeout,
        nsqd_http_addresses=list(ns.nsqd_http_address), lookupd_http_addresses=list(ns.lookupd_http_address),
        http_auth_secret=secret,
    )


# -- the loop ------------------------------------------------------------------------


def nsq_errors(errors: Sequence[str], kind: str, all_failed: bool) -> str:
    """The failures as nsq's clusterinfo words them, which nsq_stat prints after its `ERROR: ... - `.

    Each line is the Go client's (`got response 404 Not Found "..."`,
    `Get "URL": dial tcp ...: connect: connection refused`), joined by
    newlines; when every `kind` (`nsqlookupd`, `nsqd`) asked failed, or
    there was none to ask, nsq says `failed to query any <kind>: ` first.
    """
    text = "\n".join(getattr(e, "go", str(e)) for e in errors)
    return f"failed to query any {kind}: {text}" if all_failed else text


def _refused(errors: Sequence[Any]) -> None:
    """A lookupd or broker that refused the secret ends the tool with its one line (not nsq_stat's list)."""
    for e in errors:
        refusal = getattr(e, "refusal", None)
        if refusal is not None:
            raise ToolError(refused_line(refusal))


@defer.inlineCallbacks
def poll(cluster: Cluster, topic: str, channel: str):
    """This poll's totals: the producers, then each one's /stats; ToolError (nsq_stat's line) on any failure."""
    producers, errors = yield cluster.topic_producers(topic)
    _refused(errors)
    if errors or producers is None:
        kind = "nsqlookupd" if cluster.lookupds else "nsqd"
        raise ToolError(f"ERROR: failed to get topic producers - {nsq_errors(errors, kind, producers is None)}")
    answers, errors = yield cluster.stats(producers, topic, channel, include_clients=False)
    _refused(errors)
    if errors or answers is None or not producers:
        # With no producer at all nsq's GetNSQDStats has queried none: "failed to query any nsqd: ".
        all_failed = answers is None or not producers
        raise ToolError(f"ERROR: failed to get nsqd stats - {nsq_errors(errors, 'nsqd', all_failed)}")
    totals = channel_totals((a.stats for a in answers), topic, channel)
    if totals is None:
        raise ToolError(f"ERROR: failed to find channel({channel}) in stats metadata for topic({topic})")
    return totals


@defer.inlineCallbacks
def stat_loop(reactor: Any, options: SimpleNamespace, out: IO[str] | None = None, upstream: Any = None):
    """Poll and print until `count` rows are out (forever without --count)."""
    out = out if out is not None else sys.stdout
    if upstream is None:
        upstream = Upstream(reactor, options)
    secret = getattr(options, "http_auth_secret", "")
    client = Authorized(upstream, bearer_headers(secret)) if secret else upstream
    cluster = Cluster(client, options.lookupd_http_addresses, options.nsqd_http_addresses)
    table = StatTable(options.interval)
    # Closed as the reactor stops, however the loop ends: at --count, on an
    # error, or on SIGINT/SIGTERM, when the loop is left suspended (a
    # `finally` that waited there would run in a generator being discarded).
    reactor.addSystemEventTrigger("before", "shutdown", upstream.close)
    while True:
        totals = yield poll(cluster, options.topic, options.channel)
        out.write(table.add(totals))
        out.flush()
        if options.count is not None and table.polls > options.count:
            return
        yield task.deferLater(reactor, options.interval, lambda: None)


def _stat_until_a_signal(reactor: Any, options: SimpleNamespace) -> defer.Deferred:
    """The loop, stopped with exit status 0 by SIGHUP as by SIGINT and SIGTERM, as nsq_stat is."""
    signal.signal(signal.SIGHUP, lambda *_: reactor.callFromThread(reactor.stop))
    return stat_loop(reactor, options)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    options = parse_args(argv)
    # Warnings only: nsq_stat's stderr carries nothing but its fatal errors.
    run(_stat_until_a_signal, options, log_level="warn")


if __name__ == "__main__":
    main()
