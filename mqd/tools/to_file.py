"""mq-to-file: nsq_to_file on mqd.client — a topic's messages to files, one line each.

A message is FINed only once its line is on disk: the handler writes the
line and keeps the message (auto-response off); the held messages are
fsynced and FINed together every `--sync-interval`, when `max-in-flight`
of them are held, or when the consumer is starved (nsq_to_file's batching:
one fsync per batch, not per message). A crash before the sync leaves the
messages un-FINed in the broker, which delivers them again: at least once,
never lost.

Files are written in `--work-dir` and moved to `--output-dir` when closed
(rotation, SIGHUP, exit), never over an existing file: the `<REV>` of the
name is bumped instead. With `--gzip` each sync ends a gzip member and
starts another, so a file is always a valid (multi-member) gzip stream up
to the last sync, which `gunzip` reads whole.

Without `--topic`, the topics are lookupd's (`GET /topics` on every
`--lookupd-http-address`), filtered by `--topic-pattern` (a regular
expression searched in the name, required then) and looked up again
every `--topic-refresh` (never when it is 0); each topic gets its own
consumer and files.

An nsqd given with `--nsqd-tcp-address` that refuses the AUTH secret or
the IDENTIFY, or answers the handshake with something the client cannot
use, ends the tool with exit status 1 and go-nsq's message, as mq-tail does
(nsq_to_file logs "couldn't create logger" and carries on with nothing to
write, which helps nobody).

Every lookupd query (`/topics`, and the consumers' `/lookup`) carries
`--http-auth-secret` (or $MQ_HTTP_AUTH_SECRET) as `Authorization:
Bearer`, for lookupds run with `--http-auth-required`; a lookupd answering
401 or 403 ends the tool with one line naming it and exit 1.

`FileLogger` (naming, rotation, gzip) and `BatchingWriter` (holding and
FINing) are plain classes over a clock, testable without a broker.
"""

from __future__ import annotations

import gzip
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from mqd.logs import LEVELS, get_logger
from mqd.tools.flags import (
    ToolError,
    ToolParser,
    http_auth_secret,
    make_config,
    parse_checked,
    refused_line,
    run,
)

if TYPE_CHECKING:
    from twisted.python.failure import Failure

__all__ = [
    "BatchingWriter",
    "DEFAULT_FILENAME_FORMAT",
    "FileLogger",
    "FileOptions",
    "compute_filename_format",
    "main",
]

log = get_logger("mqd.tools.to_file")

TOOL = "mq-to-file"
DEFAULT_FILENAME_FORMAT = "<TOPIC>.<HOST><REV>.<DATETIME>.log"


@dataclass(frozen=True)
class FileOptions:
    """nsq_to_file's file flags (Options in nsq's options.go), durations in seconds."""

    output_dir: str = "/tmp"
    work_dir: str = ""  # "" means output_dir, as nsq_to_file's default
    filename_format: str = DEFAULT_FILENAME_FORMAT
    datetime_format: str = "%Y-%m-%d_%H"
    host_identifier: str = ""
    gzip: bool = False
    gzip_level: int = 6
    rotate_size: int = 0
    rotate_interval: float = 0.0
    skip_empty_files: bool = False

    @property
    def work(self) -> str:
        return self.work_dir or self.output_dir


def compute_filename_format(
    opts: FileOptions, topic: str, hostname: str | None = None, pid: int | None = None
) -> str:
    """The topic's file name template: <TOPIC> <HOST> <PID> filled, <DATETIME> <REV> left.

    <REV> is required whenever a name can be taken already (gzip files are
    never appended to, rotation reopens the same name, a work dir moves
    files into a directory that may hold one); otherwise it is dropped.
    """
    hostname = socket.gethostname() if hostname is None else hostname
    short = hostname.split(".")[0]
    identifier = short
    if opts.host_identifier:
        identifier = opts.host_identifier.replace("<SHORT_HOST>", short).replace(
            "<HOSTNAME>", hostname
        )
    fmt = opts.filename_format.replace("<GZIPREV>", "<REV>")  # nsq's deprecated spelling
    needs_rev = (
        opts.gzip or opts.rotate_size > 0 or opts.rotate_interval > 0 or opts.work != opts.output_dir
    )
    if needs_rev:
        if "<REV>" not in fmt:
            raise ToolError(
                "missing <REV> in --filename-format when gzip, rotation, or work dir enabled"
            )
    else:
        fmt = fmt.replace("<REV>", "")
    fmt = fmt.replace("<TOPIC>", topic).replace("<HOST>", identifier)
    fmt = fmt.replace("<PID>", str(os.getpid() if pid is None else pid))
    if opts.gzip and not fmt.endswith(".gz"):
        fmt += ".gz"
    return fmt


def _exclusive_rename(src: str, dst: str) -> None:
    """rename(2) that never replaces dst: FileExistsError instead (link, then unlink)."""
    os.link(src, dst)
    os.unlink(src)


class FileLogger:
    """One topic's current output file: naming, rotation, gzip members, fsync, move.

    Rotation follows nsq_to_file: a new name (the <DATETIME> changed), the
    file older than `rotate_interval`, or bigger than `rotate_size` bytes
    (bytes written, before compression, plus the size it had when opened).
    `clock` gives the time for both the interval and <DATETIME> (local
    time, as Go's time.Now()).
    """

    def __init__(self, topic: str, opts: FileOptions, clock: Any = None,
                 hostname: str | None = None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.topic = topic
        self.opts = opts
        self.clock = clock
        self.template = compute_filename_format(opts, topic, hostname)
        self.out: BinaryIO | None = None
        self.path = ""  # the open file's path (in the work dir)
        self._gzip: gzip.GzipFile | None = None
        self._write: Callable[[bytes], Any] | None = None
        self.filename = ""  # current_filename() of the open file: <REV> still in it
        self.open_time = 0.0
        self.filesize = 0
        self.rev = 0
        self.closed_files: list[str] = []  # final paths, in the order they were closed

    # -- naming --------------------------------------------------------------

    def current_filename(self) -> str:
        stamp = time.strftime(self.opts.datetime_format, time.localtime(self.clock.seconds()))
        return self.template.replace("<DATETIME>", stamp)

    def _output_path(self, work_path: str) -> str:
        return os.path.join(self.opts.output_dir, os.path.relpath(work_path, self.opts.work))

    # -- rotation ------------------------------------------------------------

    def needs_rotation(self) -> bool:
        if self.out is None:
            return True
        filename = self.current_filename()
        if filename != self.filename:
            log.info("[{topic}] new filename {name}, rotating...", topic=self.topic, name=filename)
            return True
        interval = self.opts.rotate_interval
        if interval > 0 and self.clock.seconds() - self.open_time > interval:
            log.info("[{topic}] {interval}s since last open, rotating...", topic=self.topic,
                     interval=interval)
            return True
        if self.opts.rotate_size > 0 and self.filesize > self.opts.rotate_size:
            log.info("[{topic}] {path} currently {size} bytes (> {max}), rotating...",
                     topic=self.topic, path=self.path, size=self.filesize,
                     max=self.opts.rotate_size)
            return True
        return False

    def update_file(self) -> None:
        """Close the current file (moving it out) and open the next one."""
        self.close()
        filename = self.current_filename()
        if filename != self.filename:
            self.rev = 0
        else:
            self.rev += 1
        self.filename = filename
        self.open_time = self.clock.seconds()
        full = os.path.join(self.opts.work, filename)
        os.makedirs(os.path.dirname(full) or ".", 0o770, exist_ok=True)
        exclusive = self.opts.gzip or self.opts.rotate_interval > 0
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_APPEND)
        while True:
            path = full.replace("<REV>", f"-{self.rev:06d}")
            if self.opts.work != self.opts.output_dir:
                # Look for the name in the output dir now, so the move at close
                # does not have to bump the revision in the usual case.
                target = self._output_path(path)
                os.makedirs(os.path.dirname(target) or ".", 0o770, exist_ok=True)
                if os.path.exists(target):
                    log.warn("[{topic}] output file already exists: {path}", topic=self.topic,
                             path=target)
                    self._next_rev(full)
                    continue
            try:
                fd = os.open(path, flags, 0o666)
            except FileExistsError:
                log.warn("[{topic}] working file already exists: {path}", topic=self.topic,
                         path=path)
                self._next_rev(full)
                continue
            size = os.fstat(fd).st_size
            if self.opts.rotate_size > 0 and size > self.opts.rotate_size:
                os.close(fd)
                self._next_rev(full)
                continue
            break
        log.info("[{topic}] opening {path}", topic=self.topic, path=path)
        self.out = os.fdopen(fd, "ab")
        self.path = path
        self.filesize = size
        self._start_writer()

    def _next_rev(self, full: str) -> None:
        if "<REV>" not in full:  # unreachable: compute_filename_format insists on <REV>
            raise ToolError(f"{full} is taken and --filename-format has no <REV>")
        self.rev += 1

    def _start_writer(self) -> None:
        assert self.out is not None
        if self.opts.gzip:
            # filename="" and mtime=0: no name or time in the member header, as Go's gzip.Writer.
            self._gzip = gzip.GzipFile(
                filename="", mode="wb", compresslevel=self.opts.gzip_level, fileobj=self.out,
                mtime=0,
            )
            self._write = self._gzip.write
        else:
            self._gzip = None
            self._write = self.out.write

    # -- writing ---------------------------------------------------------------

    def write_line(self, body: bytes) -> bool:
        """Write body + newline, rotating first if due; True when it rotated (a sync is due)."""
        rotated = False
        if self.needs_rotation():
            self.update_file()
            rotated = True
        write = self._write
        assert write is not None
        write(body)
        write(b"\n")
        self.filesize += len(body) + 1
        return rotated

    def sync(self) -> None:
        """Everything written so far durably on disk; with gzip, the member is ended first."""
        if self.out is None:
            return
        if self._gzip is not None:
            self._gzip.close()  # writes the member's trailer; the file stays open
            self.out.flush()
            os.fsync(self.out.fileno())
            self._start_writer()
        else:
            self.out.flush()
            os.fsync(self.out.fileno())

    def tick(self) -> None:
        """The sync-interval timer: rotate an expired file (or just close it, skip-empty-files)."""
        if self.needs_rotation():
            if self.opts.skip_empty_files:
                self.close()
            else:
                self.update_file()

    def close(self) -> None:
        """End the gzip stream, fsync, close, and move the file to the output dir."""
        if self.out is None:
            return
        if self._gzip is not None:
            self._gzip.close()
            self._gzip = None
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        self.out = None
        self._write = None
        src = self.path
        final = src
        if self.opts.work != self.opts.output_dir:
            final = self._move(src)
        self.closed_files.append(final)

    def _move(self, src: str) -> str:
        dst = self._output_path(src)
        log.info("[{topic}] moving finished file {src} to {dst}", topic=self.topic, src=src, dst=dst)
        try:
            _exclusive_rename(src, dst)
            return dst
        except FileExistsError:
            pass
        template = self._output_path(os.path.join(self.opts.work, self.filename))
        rev = self.rev + 1
        while True:
            log.warn("[{topic}] destination file already exists: {dst}", topic=self.topic, dst=dst)
            dst = template.replace("<REV>", f"-{rev:06d}")
            try:
                _exclusive_rename(src, dst)
            except FileExistsError:
                rev += 1
                continue
            log.info("[{topic}] renamed finished file {src} to {dst} to avoid overwrite",
                     topic=self.topic, src=src, dst=dst)
            return dst


class BatchingWriter:
    """The consumer's handler for one topic: write the line, hold the message, FIN after sync.

    `max_pending` is the consumer's max-in-flight: holding that many means
    the broker sends no more until they are FINed, so they are synced at
    once. `is_starved` (the consumer's) says the same sooner. When
    `stopping`, every message is synced and FINed as it comes, since the
    connection may close before the next sync.
    """

    def __init__(self, logger: FileLogger, max_pending: int,
                 is_starved: Callable[[], bool] | None = None) -> None:
        self.logger = logger
        self.max_pending = max(1, max_pending)
        self.is_starved = is_starved or (lambda: False)
        self.pending: list[Any] = []
        self.stopping = False
        self.synced = 0  # messages FINed after a sync, for the log and tests

    def __call__(self, message: Any) -> None:
        message.disable_auto_response()
        sync = self.logger.write_line(message.body)
        self.pending.append(message)
        if sync or self.stopping or len(self.pending) >= self.max_pending or self.is_starved():
            self.sync()

    def sync(self) -> None:
        if not self.pending:
            return
        log.info("[{topic}] syncing {n} records to disk", topic=self.logger.topic,
                 n=len(self.pending))
        self.logger.sync()
        pending, self.pending = self.pending, []
        for message in pending:
            message.finish()
        self.synced += len(pending)

    def tick(self) -> None:
        self.logger.tick()
        self.sync()

    def hup(self) -> None:
        """SIGHUP: sync and close the file (the next message opens a new one)."""
        self.sync()
        self.logger.close()

    def close(self) -> None:
        self.sync()
        self.logger.close()


# -- the tool ------------------------------------------------------------------


def build_parser() -> ToolParser:
    p = ToolParser(TOOL, "Write the messages of NSQ topics to files, one line per message.")
    p.add_list("topic", "nsq topic (may be given multiple times)", "TOPIC")
    p.add_str("topic-pattern", "", "only log topics matching the following pattern "
              "(topics discovered from lookupd when no --topic is given)")
    p.add_duration("topic-refresh", "1m", "how frequently the topic list should be refreshed")
    p.add_str("channel", "nsq_to_file", "nsq channel")
    p.add_int("max-in-flight", 200, "max number of messages to allow in flight")
    p.add_addresses()
    p.add_config_opts("consumer")
    p.add_duration("http-client-connect-timeout", "2s", "timeout for HTTP connect")
    p.add_duration("http-client-request-timeout", "5s", "timeout for HTTP request")
    p.add_http_auth_secret()
    p.add_str("log-level", "info", "set log verbosity: debug, info, warn, error, or fatal")
    p.add_str("log-prefix", "[nsq_to_file] ", "log message prefix (accepted, not used)")
    p.add_str("output-dir", "/tmp", "directory to write output files to")
    p.add_str("work-dir", "", "directory for in-progress files before moving to output-dir")
    p.add_str("datetime-format", "%Y-%m-%d_%H",
              "strftime compatible format for <DATETIME> in filename format")
    p.add_str("filename-format", DEFAULT_FILENAME_FORMAT,
              "output filename format (<TOPIC>, <HOST>, <PID>, <DATETIME>, <REV> are replaced. "
              "<REV> is increased when file already exists)")
    p.add_str("host-identifier", "", "value to output in log filename in place of hostname. "
              "<SHORT_HOST> and <HOSTNAME> are valid replacement tokens")
    p.add_int("gzip-level", 6, "gzip compression level (1-9, 1=BestSpeed, 9=BestCompression)")
    p.add_bool("gzip", "gzip output files.")
    p.add_bool("skip-empty-files", "skip writing empty files")
    p.add_int("rotate-size", 0, "rotate the file when it grows bigger than `rotate-size` bytes")
    p.add_duration("rotate-interval", "0", "rotate the file every duration")
    p.add_duration("sync-interval", "30s", "sync file to disk every duration")
    return p


def check_args(args: Any) -> FileOptions:
    """nsq_to_file's checks of its flags, in its order, with its messages."""
    args.log_level = args.log_level.lower()  # lg.ParseLogLevel ignores case
    if args.log_level not in LEVELS:
        raise ToolError("--log-level is invalid")
    if not args.channel:
        raise ToolError("--channel is required")
    if args.http_client_connect_timeout <= 0:
        raise ToolError("--http-client-connect-timeout should be positive")
    if args.http_client_request_timeout <= 0:
        raise ToolError("--http-client-request-timeout should be positive")
    if not args.nsqd_tcp_address and not args.lookupd_http_address:
        raise ToolError("--nsqd-tcp-address or --lookupd-http-address required.")
    if args.nsqd_tcp_address and args.lookupd_http_address:
        raise ToolError("use --nsqd-tcp-address or --lookupd-http-address not both")
    if not 1 <= args.gzip_level <= 9:
        raise ToolError(f"invalid --gzip-level value ({args.gzip_level}), should be 1-9")
    if not args.topic and not args.topic_pattern:
        raise ToolError("--topic or --topic-pattern required")
    if not args.topic and not args.lookupd_http_address:
        raise ToolError("--lookupd-http-address must be specified when no --topic specified")
    if args.sync_interval <= 0:
        raise ToolError("--sync-interval should be positive")
    if args.topic_pattern:
        try:
            re.compile(args.topic_pattern)
        except re.error as e:
            raise ToolError(f"invalid --topic-pattern {args.topic_pattern!r}: {e}") from None
    args.http_auth_secret = http_auth_secret(args)
    opts = FileOptions(
        output_dir=args.output_dir,
        work_dir=args.work_dir or args.output_dir,
        filename_format=args.filename_format,
        datetime_format=args.datetime_format,
        host_identifier=args.host_identifier,
        gzip=args.gzip,
        gzip_level=args.gzip_level,
        rotate_size=args.rotate_size,
        rotate_interval=args.rotate_interval,
        skip_empty_files=args.skip_empty_files,
    )
    compute_filename_format(opts, "topic")  # the <REV> check, before anything starts
    return opts


class TopicLogger:
    """One topic: its Consumer, its BatchingWriter and the sync timer.

    A write or sync that fails (disk full, directory gone) ends the tool,
    as nsq_to_file's log.Fatal does: `on_error` gets the exception, and the
    messages held are left un-FINed for the broker to deliver again.
    """

    def __init__(self, reactor: Any, topic: str, args: Any, opts: FileOptions, config: Any,
                 on_error: Callable[[BaseException], None],
                 on_fatal: Callable[[str, Exception], Any] | None = None, lookupd_http: Any = None) -> None:
        from twisted.internet import task

        from mqd.client.consumer import Consumer

        self.topic = topic
        self.sync_interval = args.sync_interval
        self.on_error = on_error
        self.writer = BatchingWriter(FileLogger(topic, opts, clock=reactor), args.max_in_flight)
        self.consumer = Consumer(
            topic, args.channel, self.handle,
            nsqd_tcp_addresses=args.nsqd_tcp_address,
            lookupd_http_addresses=args.lookupd_http_address,
            config=config, reactor=reactor, on_fatal=on_fatal, lookupd_http=lookupd_http,
        )
        self.writer.is_starved = self.consumer.is_starved
        self.ticker = task.LoopingCall(self.writer.tick)
        self.ticker.clock = reactor
        self._stopped: Any = None

    def handle(self, message: Any) -> None:
        try:
            self.writer(message)
        except OSError as e:
            self.on_error(e)
            raise

    def start(self) -> None:
        self.consumer.startService()
        self.ticker.start(self.sync_interval, now=False).addErrback(self._tick_failed)

    def _tick_failed(self, failure: Failure) -> None:
        self.on_error(cast(BaseException, failure.value))  # a Failure's value is set

    def stop(self) -> Any:
        """Stop consuming: FIN what is held now and whatever still arrives, then close the file."""
        from twisted.internet import defer

        if self._stopped is None:
            if self.ticker.running:
                self.ticker.stop()
            self.writer.stopping = True
            d = defer.maybeDeferred(self.consumer.stop)
            self._guarded(self.writer.sync)

            def closed(result: Any) -> Any:
                self._guarded(self.writer.close)
                return result

            self._stopped = d.addBoth(closed)
        return self._stopped

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except OSError as e:
            self.on_error(e)


class TopicDiscoverer:
    """All the topics being written: the --topic ones, or lookupd's (filtered, refreshed)."""

    def __init__(self, reactor: Any, args: Any, opts: FileOptions, config: Any) -> None:
        self.reactor = reactor
        self.args = args
        self.opts = opts
        self.config = config
        self.topics: dict[str, TopicLogger] = {}
        self.pattern = re.compile(args.topic_pattern) if args.topic_pattern else None
        self._stopping: Any = None
        self._refresh: Any = None
        self.on_error: Callable[[BaseException], None] = lambda e: None
        # (topic, address, error): an nsqd refused a topic's consumer for good.
        self.on_refused: Callable[[str, str, Exception], None] = lambda t, a, e: None
        # A lookupd refused the HTTP auth secret (HTTPRefusedError), at /topics or a consumer's /lookup.
        self.on_http_refused: Callable[[Exception], None] = lambda e: None
        from mqd.clusterinfo.bearer import BearerHTTP

        self.lookupd_http = BearerHTTP(getattr(args, "http_auth_secret", "") or "", reactor=reactor,
                                       on_refused=lambda e: self.on_http_refused(e))

    def add(self, topic: str, required: bool = False) -> None:
        """Start writing `topic`; a topic that cannot be consumed is fatal only if `required`."""
        if topic in self.topics or self._stopping is not None:
            return
        if self.pattern is not None and not self.pattern.search(topic):
            log.info("skipping topic {topic} as it didn't match required pattern: {pattern}",
                     topic=topic, pattern=self.args.topic_pattern)
            return
        try:
            logger = TopicLogger(self.reactor, topic, self.args, self.opts, self.config,
                                 self.on_error,
                                 lambda address, error: self.on_refused(topic, address, error),
                                 lookupd_http=self.lookupd_http)
        except ValueError as e:  # ClientConfigError: an invalid topic or channel name
            if required:
                raise ToolError(f"ERROR: couldn't create logger for topic {topic}: {e}") from None
            log.error("couldn't create logger for new topic {topic}: {error}", topic=topic,
                      error=e)
            return
        self.topics[topic] = logger
        log.info("logging topic {topic} to {dir}", topic=topic, dir=self.opts.output_dir)
        logger.start()

    async def start(self) -> None:
        from twisted.internet import task

        if self.args.topic:
            for topic in self.args.topic:
                self.add(topic, required=True)
            return
        # Lookupds that cannot be reached yet are logged, not fatal: the
        # next refresh asks again, as nsq_to_file's discoverer keeps running.
        await self.refresh()
        if self.args.topic_refresh <= 0:
            return  # as Go's time.Tick(0): no refresh at all
        self._refresh = task.LoopingCall(self.refresh)
        self._refresh.clock = self.reactor
        self._refresh.start(self.args.topic_refresh, now=False)

    async def refresh(self) -> None:
        from mqd.clusterinfo.bearer import HTTPRefusedError

        try:
            topics = await lookupd_topics(self.args.lookupd_http_address, self.args)
        except HTTPRefusedError as e:
            self.on_http_refused(e)
            return
        except ToolError as e:
            log.error("could not retrieve topic list: {error}", error=e)
            return
        for topic in topics:
            self.add(topic)

    def hup(self) -> None:
        for logger in self.topics.values():
            logger.writer.hup()

    def stop(self) -> Any:
        from twisted.internet import defer

        if self._stopping is None:
            if self._refresh is not None and self._refresh.running:
                self._refresh.stop()
            self._stopping = defer.DeferredList(
                [t.stop() for t in self.topics.values()], consumeErrors=True
            )
        return self._stopping


async def lookupd_topics(addresses: Sequence[str], args: Any) -> list[str]:
    """The union of the topics every lookupd lists (GET /topics); ToolError when none answers.

    treq has one timeout for the whole request: --http-client-request-timeout
    (--http-client-connect-timeout is checked, as nsq_to_file does, but the
    request's timeout covers the connection too). The request carries the
    HTTP auth secret, as the consumers' /lookup does (BearerHTTP); a lookupd
    refusing it raises its HTTPRefusedError.
    """
    import json

    import treq

    from mqd.client.discovery import ACCEPT, MAX_RESPONSE_SIZE
    from mqd.clusterinfo.bearer import BearerHTTP, HTTPRefusedError
    from mqd.http_body import read_bounded

    client = BearerHTTP(getattr(args, "http_auth_secret", "") or "", http=treq)
    topics: set[str] = set()
    errors: list[str] = []
    for address in addresses:
        base = address if "://" in address else f"http://{address}"
        url = base.rstrip("/") + "/topics"
        try:
            response = await client.get(url, headers={b"Accept": [ACCEPT]},
                                        timeout=args.http_client_request_timeout)
            body = await read_bounded(response, MAX_RESPONSE_SIZE, ValueError)
            if response.code != 200:
                raise ValueError(f"HTTP {response.code}")
            doc = json.loads(body)
        except HTTPRefusedError:
            raise  # a wrong secret: no other lookupd's answer makes it right
        except Exception as e:  # noqa: BLE001 - any failure of one lookupd is reported, not fatal
            errors.append(f"{url}: {e}")
            continue
        if isinstance(doc, dict) and isinstance(doc.get("data"), dict):
            doc = doc["data"]  # the old {"status_code", "data"} envelope
        topics.update((doc or {}).get("topics") or [])
    if errors and len(errors) == len(addresses):
        raise ToolError("could not retrieve topic list: " + "; ".join(errors))
    return sorted(topics)


async def _main(reactor: Any, args: Any, opts: FileOptions) -> None:
    from twisted.internet import defer

    config = make_config(TOOL, args.consumer_opt, max_in_flight=args.max_in_flight)
    discoverer = TopicDiscoverer(reactor, args, opts, config)
    done: defer.Deferred = defer.Deferred()

    def shutdown() -> defer.Deferred:
        d = discoverer.stop()
        d.addBoth(lambda _: None if done.called else done.callback(None))
        return d

    def failed(error: BaseException) -> None:
        log.critical("writing to disk failed: {error}", error=error)
        if not done.called:
            done.errback(ToolError(f"ERROR: writing to disk failed: {error}"))

    def refused(topic: str, _address: str, error: Exception) -> None:
        if not done.called:
            text = getattr(error, "nsq_text", error)
            done.errback(ToolError(f"ERROR: couldn't create logger for topic {topic}: {text}"))

    def http_refused(error: Exception) -> None:
        if not done.called:
            done.errback(ToolError(refused_line(error)))

    discoverer.on_error = failed
    # Out of the poller's or the refresh's call.
    discoverer.on_http_refused = lambda e: reactor.callLater(0, http_refused, e)
    # Out of the consumer's call, which is still closing the connection.
    discoverer.on_refused = lambda *a: reactor.callLater(0, refused, *a)
    reactor.addSystemEventTrigger("before", "shutdown", shutdown)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: reactor.callFromThread(discoverer.hup))
    await discoverer.start()
    await done


def main(argv: Sequence[str] | None = None) -> None:
    args, opts = parse_checked(build_parser(), check_args, argv)
    run(_main, args, opts, log_level=args.log_level)


if __name__ == "__main__":
    main()
