"""mq-tail: nsq_tail on mqd.client — print the messages of topics as they arrive.

Each body is written to stdout followed by a newline (with `--print-topic`,
prefixed by "<topic> | "). With `-n N` the tool exits once N messages are
printed; `--max-in-flight` is lowered to N so the broker does not send
more than it will show. The default channel is an ephemeral
`tail<NNNNNN>#ephemeral`, which disappears with the tool.

An nsqd given with `--nsqd-tcp-address` that refuses the AUTH secret (or
wants one and none was given), refuses the IDENTIFY, or answers the
handshake with something the client cannot use (a `max_rdy_count` of
10^30, an HTTP port dialed) ends the tool with go-nsq's message and exit
status 1, as nsq_tail's log.Fatal does: the same nsqd gives the same
answer to a retry. An unreachable nsqd is retried (nsq_tail exits on
that too). With `--lookupd-http-address`, as in nsq_tail, a refusing nsqd
is logged and dialed again when lookupd lists it at the next poll.

The lookupd queries carry `--http-auth-secret` (or $MQ_HTTP_AUTH_SECRET)
as `Authorization: Bearer`, for lookupds run with `--http-auth-required`;
a lookupd answering 401 or 403 ends the tool with one line naming it and
exit 1 (the TCP AUTH secret is `--consumer-opt=auth_secret,...`).

`--offset=earliest|latest|N` or `--since=2h|<RFC3339>` print the topic's
retained log instead (brokers run with retention): read over HTTP, no
channel, nothing consumed; mqd.tools.retained says how.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

from mqd.logs import get_logger
from mqd.tools import retained
from mqd.tools.flags import (
    ToolError,
    ToolParser,
    http_auth_secret,
    make_config,
    parse_checked,
    refused_line,
    run,
)

__all__ = ["Printer", "build_parser", "main"]

log = get_logger("mqd.tools.tail")

TOOL = "mq-tail"


def build_parser() -> ToolParser:
    p = ToolParser(TOOL, "Print the messages of NSQ topics to stdout, like tail -f.")
    p.add_list("topic", "NSQ topic (may be given multiple times)", "TOPIC")
    p.add_str("channel", "", "NSQ channel (default: tail<6 random digits>#ephemeral)")
    p.add_int("max-in-flight", 200, "max number of messages to allow in flight")
    p.add_int("n", 0, "total messages to show (will wait if starved)")
    p.add_bool("print-topic", "print topic name where message was received")
    p.add_addresses()
    p.add_config_opts("consumer")
    p.add_http_auth_secret()
    p.add_argument("--offset", type=retained.offset_arg, default=None, metavar="earliest|latest|N",
                   help="print the topic's retained log from this offset on, without a channel "
                        "(brokers with retention; not with --channel)")
    p.add_argument("--since", type=retained.since_arg, default=None, metavar="DURATION|RFC3339",
                   help="print the topic's retained log from the first message published at or after "
                        "this time (2h: two hours ago; or 2006-01-02T15:04:05Z), without a channel")
    return p


def check_args(args: Any) -> None:
    """nsq_tail's checks and defaults, with its messages; then those of the retained log's flags."""
    args.retained_start = None
    if args.offset is not None or args.since is not None:
        if args.offset is not None and args.since is not None:
            raise ToolError("use --offset or --since not both")
        if args.channel:
            raise ToolError("--offset and --since read the topic's retained log, which has no channel: "
                            "do not give --channel")
        args.retained_start = retained.start_of(args.offset, args.since)
    if not args.channel:
        args.channel = f"tail{random.randrange(999999):06d}#ephemeral"
    # nsq_tail's order: the addresses first, then the topic.
    if not args.nsqd_tcp_address and not args.lookupd_http_address:
        raise ToolError("--nsqd-tcp-address or --lookupd-http-address required")
    if args.nsqd_tcp_address and args.lookupd_http_address:
        raise ToolError("use --nsqd-tcp-address or --lookupd-http-address not both")
    if not args.topic:
        raise ToolError("--topic required")
    # Go's int flag takes a negative count, which nsq_tail's `> 0` tests read as no limit.
    args.n = max(args.n, 0)
    # Don't ask for more messages than we want.
    if 0 < args.n < args.max_in_flight:
        args.max_in_flight = args.n
    args.http_auth_secret = http_auth_secret(args)


def die_of_sigpipe() -> None:
    """End as a Go program ends when its stdout is a closed pipe (`mq-tail | head -1`): killed by SIGPIPE.

    Python ignores SIGPIPE, so the write raised instead; Go's runtime lets
    the signal kill the process for a write to stdout, with no message
    (the shell sees status 141). Messages in flight go back to the channel
    when the broker sees the connection drop.
    """
    sys.stderr.flush()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)


class Printer:
    """The handler of every topic's consumer: print, count, and say when `total` is reached.

    The count is over all topics (nsq_tail counts per topic handler, which
    lets `-n 5` over two topics print up to 9); messages arriving after
    the total are requeued at once, without backoff, for the next reader.
    """

    def __init__(self, out: BinaryIO, total: int = 0, print_topic: bool = False,
                 on_done: Any = None, on_error: Any = None,
                 on_broken_pipe: Any = die_of_sigpipe) -> None:
        self.out = out
        self.on_broken_pipe = on_broken_pipe
        self.total = total
        self.print_topic = print_topic
        self.on_done = on_done
        self.on_error = on_error
        self.shown = 0

    def remaining(self) -> int:
        """How many more bodies are wanted: 0 for no limit (but at least 1 while one is)."""
        return max(self.total - self.shown, 1) if self.total else 0

    def write(self, prefix: bytes, body: bytes) -> bool:
        """Print one body (after `prefix`); False, printing nothing, once the total is reached."""
        if self.total and self.shown >= self.total:
            return False
        try:
            self.out.write(prefix + body + b"\n")
            self.out.flush()
        except BrokenPipeError:  # stdout closed (| head)
            self.on_broken_pipe()
            raise
        except OSError as e:  # stdout failing otherwise: nsq_tail's log.Fatalf
            error = ToolError(f"ERROR: failed to write to stdout - {e}")
            if self.on_error is not None:
                self.on_error(error)
            raise error from None
        self.shown += 1
        if self.total and self.shown >= self.total and self.on_done is not None:
            self.on_done()
        return True

    def _prefix(self, topic: str) -> bytes:
        return topic.encode() + b" | " if self.print_topic else b""

    def handler(self, topic: str):
        """The consumer's handler for `topic`: print each message; requeue those past the total."""
        prefix = self._prefix(topic)

        def handle(message: Any) -> None:
            if not self.write(prefix, message.body):
                message.requeue(0, backoff=False)

        return handle

    def shower(self, topic: str):
        """A retained-log reader's `show(body)` for `topic`: print it; whether more are wanted."""
        prefix = self._prefix(topic)

        def show(body: bytes) -> bool:
            return self.write(prefix, body) and not (self.total and self.shown >= self.total)

        return show


async def _main(reactor: Any, args: Any) -> None:
    from twisted.internet import defer

    from mqd.client.consumer import Consumer
    from mqd.clusterinfo.bearer import BearerHTTP
    from mqd.names import is_valid_name

    config = make_config(TOOL, args.consumer_opt, max_in_flight=args.max_in_flight)
    done: defer.Deferred = defer.Deferred()

    def finished() -> None:
        if not done.called:
            done.callback(None)

    def failed(error: ToolError) -> None:
        if not done.called:
            done.errback(error)

    def refused(_address: str, error: Exception) -> None:
        # Out of the consumer's call, which is still closing the connection.
        reactor.callLater(0, failed, ToolError(getattr(error, "nsq_text", str(error))))

    # A lookupd refusing the secret: one line and exit 1, out of the poller's call.
    lookupd_http = BearerHTTP(args.http_auth_secret, reactor=reactor,
                              on_refused=lambda e: reactor.callLater(0, failed, ToolError(refused_line(e))))
    # Out of the handler's call: the consumer answers the message first.
    printer = Printer(sys.stdout.buffer, args.n, args.print_topic,
                      on_done=lambda: reactor.callLater(0, finished),
                      on_error=lambda e: reactor.callLater(0, failed, e))
    if args.retained_start is not None:
        for topic in args.topic:
            if not is_valid_name(topic) or topic.endswith("#ephemeral"):
                raise ToolError("invalid topic name" if not is_valid_name(topic) else
                                f"topic {topic} is ephemeral: it keeps no retained log")
        retained.tail_logs(reactor, args, printer, config, done)
        reactor.addSystemEventTrigger("before", "shutdown", finished)
        await done
        return
    consumers = []
    for topic in args.topic:
        log.info("adding consumer for topic: {topic}", topic=topic)
        try:
            consumer = Consumer(
                topic, args.channel, printer.handler(topic),
                nsqd_tcp_addresses=args.nsqd_tcp_address,
                lookupd_http_addresses=args.lookupd_http_address,
                config=config, reactor=reactor, on_fatal=refused, lookupd_http=lookupd_http,
            )
        except ValueError as e:
            # go-nsq's NewConsumer words a bad name without quoting it: "invalid topic name".
            text = str(e)
            for what in ("invalid topic name", "invalid channel name"):
                if text.startswith(what):
                    text = what
            raise ToolError(text) from None
        consumers.append(consumer)

    stopping: list[defer.Deferred] = []

    def stop_all() -> defer.Deferred:
        if not stopping:
            stopping.append(defer.DeferredList([c.stop() for c in consumers], consumeErrors=True))
        return stopping[0]

    def shutdown() -> defer.Deferred:
        d = stop_all()
        d.addCallback(lambda _: finished())
        return d

    reactor.addSystemEventTrigger("before", "shutdown", shutdown)
    for consumer in consumers:
        consumer.startService()
    try:
        await done
    finally:
        await stop_all()  # -n reached: FIN the last one and leave the channel cleanly


def main(argv: Sequence[str] | None = None) -> None:
    args, _ = parse_checked(build_parser(), check_args, argv)
    run(_main, args)


if __name__ == "__main__":
    main()
