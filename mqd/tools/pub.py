"""mq-pub: to_nsq on mqd.client — publish the lines of stdin to a topic.

Every line (split at `--delimiter`, default newline; empty ones skipped)
is published to every `--nsqd-tcp-address`, as to_nsq does. Publishes are
pipelined (the Producer matches answers in order) while stdin is read
through Twisted's StandardIO, paused while too many publishes wait, so a
large input is streamed, not loaded. The tool exits 0 after EOF once
every publish is acknowledged; a failed publish ends it with the error
and exit status 1 (to_nsq's log.Fatal).

`--rate N` throttles to N messages a second with to_nsq's token bucket:
one token every 1/N s, at most N saved up, one spent per line.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

from twisted.internet import protocol

from mqd.logs import get_logger
from mqd.tools.flags import ToolError, ToolParser, make_config, parse_checked, run
from mqd.wire.errors import go_refused

__all__ = ["LineSplitter", "Publisher", "build_parser", "main"]

log = get_logger("mqd.tools.pub")

TOOL = "mq-pub"
# Lines published but not acknowledged (per producer) above which stdin is paused.
HIGH_WATER = 1000
LOW_WATER = 250


def build_parser() -> ToolParser:
    p = ToolParser(TOOL, "Publish the lines of stdin to an NSQ topic.")
    p.add_str("topic", "", "NSQ topic to publish to")
    p.add_str("delimiter", "\n", "character to split input from stdin")
    p.add_int("rate", 0, "Throttle messages to n/second. 0 to disable")
    p.add_addresses(lookupd=False)
    p.add_config_opts("producer")
    return p


def check_args(args: Any) -> None:
    if not args.topic:
        raise ToolError("--topic required")
    if len(args.delimiter.encode()) != 1:
        raise ToolError("--delimiter must be a single byte")
    if not args.nsqd_tcp_address:
        raise ToolError("--nsqd-tcp-address required")
    # A negative rate is to_nsq's "no throttle", as 0 (its test is `> 0`).
    args.rate = max(args.rate, 0)


class LineSplitter(protocol.Protocol):
    """stdin's bytes → `on_line(line)` per delimited, non-empty line; `on_eof()` at the end."""

    def __init__(self, delimiter: bytes, on_line: Callable[[bytes], None],
                 on_eof: Callable[[], None]) -> None:
        self.delimiter = delimiter
        self.on_line = on_line
        self.on_eof = on_eof
        self._buffer = b""

    def dataReceived(self, data: bytes) -> None:
        *lines, self._buffer = (self._buffer + data).split(self.delimiter)
        on_line = self.on_line
        for line in lines:
            if line:
                on_line(line)

    def connectionLost(self, reason: Any = None) -> None:
        rest, self._buffer = self._buffer, b""
        if rest:
            self.on_line(rest)
        self.on_eof()


class Publisher:
    """Lines → every producer, with the token bucket, flow control and completion.

    `done` fires once EOF was seen and every publish acknowledged, or
    fails with a ToolError at the first failed publish. With `connect`,
    the first line waits for it (every broker connected): a broker that
    cannot be reached fails the run before any line reaches the others,
    as to_nsq's first publish does, so a retried input is not published
    twice to the brokers that were up.
    """

    def __init__(self, topic: str, producers: Sequence[Any], rate: int = 0, clock: Any = None,
                 pause: Callable[[], None] | None = None,
                 resume: Callable[[], None] | None = None,
                 connect: Callable[[], Any] | None = None) -> None:
        from twisted.internet import defer, task

        self.topic = topic
        self.producers = list(producers)
        self.rate = rate
        self.pause = pause or (lambda: None)
        self.resume = resume or (lambda: None)
        self.done: defer.Deferred = defer.Deferred()
        self.waiting: deque[bytes] = deque()  # lines held by the throttle
        self.unacked = 0  # publishes sent, not answered (all producers)
        self.published = 0  # lines acknowledged by every producer
        self.eof = False
        self.paused = False
        self._line_acks: dict[int, int] = {}
        self._connect = connect
        # Lines read until `connect` succeeded (it is called at the first); None after.
        self._held: list[bytes] | None = [] if connect is not None else None
        self._balance = 1
        self._ticker = None
        if rate > 0:
            self._ticker = task.LoopingCall.withCount(self._tick)
            if clock is not None:
                self._ticker.clock = clock
            self._ticker.start(1.0 / rate, now=False)
            log.info("Throttling messages rate to max:{rate}/second", rate=rate)

    # -- input -----------------------------------------------------------------------

    def line(self, line: bytes) -> None:
        if self.done.called:
            return
        if self._held is not None:
            self._held.append(line)
            if len(self._held) == 1:
                self.pause()
                connect = cast(Callable[[], Any], self._connect)  # set while lines are held
                connect().addCallbacks(self._connected, self._not_connected)
            return
        if self._ticker is None:
            self._publish(line)
            return
        if self._balance > 0 and not self.waiting:
            self._balance -= 1
            self._publish(line)
        else:
            self.waiting.append(line)
        self._flow()

    def end(self) -> None:
        self.eof = True
        self._check_done()

    def _connected(self, _: Any) -> None:
        held, self._held = cast("list[bytes]", self._held), None  # connected once, while held
        for line in held:
            self.line(line)
        if not self.paused:
            self.resume()
        self._check_done()

    def _not_connected(self, failure: Any) -> None:
        if not self.done.called:
            self.stop_ticker()
            self.done.errback(failure)

    # -- throttle --------------------------------------------------------------------------

    def _tick(self, count: int) -> None:
        # Tokens saved up are capped at one second's worth, as to_nsq's.
        self._balance = min(self._balance + count, self.rate)
        while self._balance > 0 and self.waiting and not self.done.called:
            self._balance -= 1
            self._publish(self.waiting.popleft())
        self._flow()
        self._check_done()

    # -- publishing ---------------------------------------------------------------------------

    def _publish(self, line: bytes) -> None:
        for producer in self.producers:
            self.unacked += 1
            d = producer.publish(self.topic, line)
            d.addCallbacks(self._acked, self._failed, errbackArgs=(producer,))
        self._flow()

    def _acked(self, _answer: bytes) -> None:
        self.unacked -= 1
        self.published += 1
        self._flow()
        self._check_done()

    def _failed(self, failure: Any, producer: Any) -> None:
        self.unacked -= 1
        if not self.done.called:
            self.done.errback(ToolError(go_nsq_text(failure, producer.address)))

    def _flow(self) -> None:
        load = self.unacked + len(self.waiting) * len(self.producers)
        limit = HIGH_WATER * len(self.producers)
        if not self.paused and load >= limit:
            self.paused = True
            self.pause()
        elif self.paused and load <= LOW_WATER * len(self.producers):
            self.paused = False
            self.resume()

    def _check_done(self) -> None:
        if (self.eof and not self.unacked and not self.waiting and not self._held
                and not self.done.called):
            self.stop_ticker()
            self.done.callback(self.published // max(1, len(self.producers)))

    def stop_ticker(self) -> None:
        if self._ticker is not None and self._ticker.running:
            self._ticker.stop()


def go_nsq_text(failure: Any, address: str) -> str:
    """A failed publish as to_nsq's log.Fatal prints it: go-nsq's error, nothing added.

    An error frame is its own text (`E_BAD_TOPIC PUB topic name "x" is not
    valid`), refused credentials go-nsq's (`Error authenticating ...`), and
    a broker that cannot be reached Go's dial error
    (`dial tcp 127.0.0.1:4150: connect: connection refused`).
    """
    from twisted.internet import error

    text = getattr(failure.value, "nsq_text", None)
    if text:
        return text
    if failure.check(error.ConnectionRefusedError):
        return go_refused(address)
    if failure.check(error.TCPTimedOutError, error.TimeoutError):
        return f"dial tcp {address}: i/o timeout"
    return failure.getErrorMessage()


async def _main(reactor: Any, args: Any) -> None:
    from twisted.internet import defer, stdio

    from mqd.client.producer import Producer

    config = make_config(TOOL, args.producer_opt)
    try:
        producers = [Producer(address, config, reactor=reactor) for address in
                     dict.fromkeys(args.nsqd_tcp_address)]
    except ValueError as e:
        raise ToolError(f"failed to create producer - {e}") from None
    stopping: list[defer.Deferred] = []

    def stop_all() -> defer.Deferred:
        if not stopping:
            publisher.stop_ticker()
            stopping.append(defer.DeferredList([p.stop() for p in producers], consumeErrors=True))
        return stopping[0]

    reactor.addSystemEventTrigger("before", "shutdown", stop_all)
    for producer in producers:
        producer.startService()

    def connect_all() -> defer.Deferred:
        """Every broker connected, or a ToolError with to_nsq's text for the first that is not."""

        def check(results) -> None:
            for producer, (ok, result) in zip(producers, results, strict=True):
                if not ok:
                    raise ToolError(go_nsq_text(result, producer.address))

        return defer.DeferredList([p.ping() for p in producers], consumeErrors=True).addCallback(check)

    publisher = Publisher(args.topic, producers, args.rate, clock=reactor, connect=connect_all)
    splitter = LineSplitter(args.delimiter.encode(), publisher.line, publisher.end)
    io = stdio.StandardIO(splitter, reactor=reactor)
    publisher.pause = io.pauseProducing
    publisher.resume = io.resumeProducing
    try:
        count = await publisher.done
    finally:
        await stop_all()
    log.info("published {count} messages to {topic}", count=count, topic=args.topic)


def main(argv: Sequence[str] | None = None) -> None:
    args, _ = parse_checked(build_parser(), check_args, argv)
    run(_main, args)


if __name__ == "__main__":
    main()
