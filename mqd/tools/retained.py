"""`mq-tail --offset` / `--since`: print a topic's retained log, read over HTTP, without consuming anything.

A broker run with retention keeps every message published to a topic in
the topic's retained log, numbered by offset (docs: the retained log).
Reading it takes no channel and changes nothing a consumer sees: the tool
asks `GET /topic/offsets` where to begin (`--offset=earliest|latest|N`,
or `--since=2h|<RFC3339>`: the first record published at or after that
time), then `GET /topic/read` from there in a loop, each answer a run of
binary record frames (mqd.wire.log_frames) and the next offset to ask for
in `X-Mqd-Next-Offset`. At the log's end it asks again every
`POLL_INTERVAL`, so it follows the topic as `tail -f` follows a file.

The brokers are found as for channels. `--nsqd-tcp-address`: the tool
connects, IDENTIFYs (with the `--consumer-opt` settings: TLS, AUTH) and
reads the broker's HTTP port from the answer's `http_port`, then speaks
HTTP to the same host; a broker whose answer has none (nsqd, or an mqd
without retained logs) ends the tool with one line. `--lookupd-http-address`:
the topic's producers as the lookupds list them (`broadcast_address`,
`http_port`), asked again every `lookupd_poll_interval`; each broker's
log is read on its own and the bodies are printed interleaved in the
order the answers arrive (each broker's in offset order; offsets are per
broker, so `--offset=N` starts every broker's log at its own N).

Every request carries `--http-auth-secret` (or $MQ_HTTP_AUTH_SECRET) as
`Authorization: Bearer`; a 401 or 403 ends the tool with the tools' line.
A topic without retention (`400 RETENTION_OFF`) or a start out of range
(`416`) ends it with one line naming the broker and, for the latter, its
earliest and latest offsets. While tailing, a log recreated under the
tool (the topic deleted and created again: a new epoch) is said on stderr
and read on from its new earliest offset; records that expired before the
tool read them are counted on stderr and skipped. An unreachable broker
or a 5xx answer is retried, as the tools retry an unreachable broker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from twisted.internet import defer, task

from mqd.clusterinfo.bearer import BearerHTTP, HTTPRefusedError
from mqd.endpoints import join_host_port
from mqd.http_body import read_bounded
from mqd.logs import get_logger
from mqd.moments import Since, parse_since
from mqd.tools.flags import ToolError, bad_flag_value, refused_line
from mqd.wire.go_json import error_message
from mqd.wire.log_frames import FrameError, iter_frames

__all__ = [
    "ANSWER_MAX",
    "POLL_INTERVAL",
    "Answer",
    "BrokerHTTP",
    "LogReader",
    "Offsets",
    "Since",
    "Start",
    "http_port_of",
    "lookupd_http_producers",
    "offset_arg",
    "since_arg",
    "tail_logs",
]

log = get_logger("mqd.tools.tail")

# How often a reader at the end of a log asks again.
POLL_INTERVAL = 0.2
# Records asked per read (the broker's default); fewer when -n needs fewer.
BATCH = 1000
# Bytes of records asked per read past the first (the broker's default).
BATCH_BYTES = 1 << 20
# The most of one answer read: a batch, and a first record as large as a broker may take.
ANSWER_MAX = 128 << 20
# Seconds one request may take, connect to last byte.
REQUEST_TIMEOUT = 30.0
# Waits between attempts on an unreachable broker or a failing answer: doubling to the last.
RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 15.0)
FRAMES_TYPE = "application/vnd.mqd.log-frames"
_ACCEPT = b"application/vnd.nsq; version=1.0"


# -- the command line ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """Where a read of a log begins: `earliest`, `latest`, an offset, or the first record at or after a time."""

    keyword: str = ""
    offset: int | None = None
    timestamp_ms: int | None = None

    def describe(self) -> str:
        """`earliest`, `offset 50`, or `the first record at or after 2026-01-02T03:04:05.000Z`, for the log."""
        if self.timestamp_ms is not None:
            moment = datetime.fromtimestamp(self.timestamp_ms / 1000, UTC)
            return f"the first record at or after {moment.isoformat(timespec='milliseconds')}".replace("+00:00", "Z")
        return self.keyword or f"offset {self.offset}"


def offset_arg(text: str) -> Start:
    """`--offset`'s value: `earliest`, `latest` or an offset (an integer >= 0); a bad one is a bad flag (exit 2)."""
    value = text.strip()
    if value in ("earliest", "latest"):
        return Start(keyword=value)
    if value.isdigit():
        return Start(offset=int(value))
    raise bad_flag_value(text, "want earliest, latest or an offset (an integer >= 0)")


def since_arg(text: str) -> Since:
    """`--since`'s value (mqd.moments); a bad one is a bad flag (exit 2)."""
    try:
        return parse_since(text)
    except ValueError as e:
        raise bad_flag_value(text, str(e)) from None


def start_of(offset: Start | None, since: Since | None, now: float | None = None) -> Start:
    """The Start the flags ask for (`--since` read against `now`, the tool's start)."""
    if since is not None:
        return Start(timestamp_ms=since.ms(time.time() if now is None else now))
    return offset if offset is not None else Start(keyword="earliest")


# -- HTTP -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP answer: status, headers (lower-case names, first value) and body."""

    code: int
    headers: Mapping[str, str]
    body: bytes

    def message(self) -> str:
        """The `{"message": ...}` of an error answer, or ""."""
        return error_message(self.body)

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object: {self.body[:200]!r}")
        return data


class AnswerTooLarge(Exception):
    """An answer over ANSWER_MAX."""


class BrokerHTTP:
    """GETs to brokers and lookupds with the tool's secret; `get(url)` fires with an Answer.

    A 401 or 403 fails with HTTPRefusedError (mqd.clusterinfo.bearer),
    anything that is no answer (refused, timed out, cut) with its own
    error. Connections are kept: a tailing reader asks several times a
    second.
    """

    def __init__(self, secret: str, reactor: Any, kind: str = "nsqd", http: Any = None) -> None:
        if http is None:
            from treq.client import HTTPClient
            from twisted.web.client import Agent, HTTPConnectionPool

            pool = HTTPConnectionPool(reactor, persistent=True)
            http = HTTPClient(Agent(reactor, connectTimeout=REQUEST_TIMEOUT, pool=pool))
        self.reactor = reactor
        self.client = BearerHTTP(secret, http=http, reactor=reactor, kind=kind)

    def get(self, url: str) -> defer.Deferred[Answer]:
        d = defer.Deferred.fromCoroutine(self._get(url))
        d.addTimeout(REQUEST_TIMEOUT, self.reactor)
        return d

    async def _get(self, url: str) -> Answer:
        response = await self.client.get(url, headers={b"Accept": [_ACCEPT]})
        body = await read_bounded(response, ANSWER_MAX, lambda why: AnswerTooLarge(f"{url}: {why}"))
        headers = {name.decode("latin-1").lower(): values[0].decode("latin-1")
                   for name, values in response.headers.getAllRawHeaders() if values}
        return Answer(response.code, headers, body)


Fetch = Callable[[str], "defer.Deferred[Answer]"]


def _sleep(clock: Any, seconds: float) -> defer.Deferred[None]:
    return task.deferLater(clock, seconds, lambda: None)


# -- one broker's log ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Offsets:
    """A `/topic/offsets` answer: the log's life and bounds, and the offset a timestamp asked for."""

    epoch: int
    earliest: int
    latest: int
    kept: bool
    for_timestamp: int | None

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Offsets:
        def number(key: str) -> int:
            value = data.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} is not an offset: {value!r:.60}")
            return value

        found = data.get("offset_for_timestamp")
        return cls(number("epoch"), number("earliest"), number("latest"), data.get("kept", True) is not False,
                   found if isinstance(found, int) and not isinstance(found, bool) else None)


class _Retry(Exception):
    """A failure worth asking again about (logged by the reader, then retried after a wait)."""


class LogReader:
    """Reads one broker's retained log of one topic from `start` on, following it as it grows.

    `fetch(url)` fires with an Answer (BrokerHTTP.get); `show(body)` prints
    one body and says whether more are wanted; `warn(text)` tells the
    user something on stderr. `run()` ends when `show` wants no more or
    `stop()` is called, and fails with ToolError for what ends the tool.
    """

    __slots__ = ("node", "base", "topic", "start", "fetch", "show", "clock", "warn", "batch", "poll",
                 "epoch", "offset", "_stopped", "_retries", "_waiting_said")

    def __init__(self, node: str, topic: str, start: Start, fetch: Fetch, show: Callable[[bytes], bool],
                 clock: Any, warn: Callable[[str], Any] | None = None, batch: Callable[[], int] | None = None,
                 poll: float = POLL_INTERVAL, base: str | None = None) -> None:
        self.node = node
        self.base = base or f"http://{node}"
        self.topic = topic
        self.start = start
        self.fetch = fetch
        self.show = show
        self.clock = clock
        self.warn = warn if warn is not None else (lambda text: log.warn("{text}", text=text))
        self.batch = batch if batch is not None else (lambda: BATCH)
        self.poll = poll
        self.epoch: int | None = None
        self.offset = 0
        self._stopped = False
        self._retries = 0
        self._waiting_said = False

    def stop(self) -> None:
        self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _where(self) -> str:
        return f"topic {self.topic} on nsqd {self.node}"

    def _url(self, path: str, **query: Any) -> str:
        return f"{self.base}{path}?{urlencode({'topic': self.topic, **query})}"

    async def run(self) -> None:
        info = await self._offsets(self.start.timestamp_ms)
        if info is None:
            return
        self.epoch = info.epoch
        self.offset = self._first(info)
        while not self._stopped:
            answer = await self._get(self._url("/topic/read", offset=self.offset, max_messages=self.batch(),
                                               max_bytes=BATCH_BYTES))
            if answer is None or self._stopped:
                continue
            if answer.code == 200:
                await self._records(answer)
            elif answer.code == 416:
                await self._resync()
            elif answer.code == 404 and answer.message() == "TOPIC_NOT_FOUND":
                self.warn(f"{self._where()} was deleted: waiting for it to be created again")
                self._waiting_said = True  # said: _offsets waits without saying it again
                await self._resync()
            else:
                self._refused("/topic/read", answer)

    def _first(self, info: Offsets) -> int:
        """The start offset, checked against the log's bounds (416's line when outside them)."""
        start = self.start
        if not info.kept:
            raise ToolError(f"nsqd {self.node} keeps no retained log for topic {self.topic}: "
                            "its store keeps no messages (--backend dummy)")
        if start.timestamp_ms is not None:
            return info.latest if info.for_timestamp is None else info.for_timestamp
        if start.keyword == "latest":
            return info.latest
        if start.offset is None:
            return info.earliest
        if not info.earliest <= start.offset <= info.latest:
            raise self._out_of_range(start.offset, info.earliest, info.latest)
        return start.offset

    def _out_of_range(self, offset: int, earliest: int, latest: int) -> ToolError:
        return ToolError(f"offset {offset} is out of range for {self._where()}: "
                         f"earliest {earliest}, latest {latest}")

    async def _records(self, answer: Answer) -> None:
        headers = answer.headers
        try:
            epoch = int(headers["x-mqd-epoch"])
            after = int(headers["x-mqd-next-offset"])
        except (KeyError, TypeError, ValueError):
            raise ToolError(f"nsqd {self.node} answered /topic/read without its X-Mqd-Epoch and "
                            "X-Mqd-Next-Offset headers: it does not keep retained logs") from None
        if epoch != self.epoch:
            earliest = headers.get("x-mqd-earliest", "")
            if earliest.isdigit():
                self._recreated(epoch, int(earliest))
            else:
                await self._resync()
            return
        try:
            for _offset, _ts, _attempts, _id, body in iter_frames(answer.body):
                if not self.show(body):
                    self._stopped = True
                    return
        except FrameError as e:
            raise ToolError(f"nsqd {self.node} answered /topic/read for topic {self.topic} "
                            f"with bytes that are not record frames: {e}") from None
        if after == self.offset:
            await _sleep(self.clock, self.poll)
        self.offset = after

    async def _resync(self) -> None:
        """After a 416 or a deleted topic: the log's bounds now, and where to read on."""
        info = await self._offsets(None)
        if info is None:
            return
        if info.epoch != self.epoch:
            self._recreated(info.epoch, info.earliest)
        elif self.offset < info.earliest:
            self.warn(f"{info.earliest - self.offset} records of {self._where()} expired before they were read "
                      f"(offsets {self.offset} to {info.earliest - 1}): reading on from offset {info.earliest}")
            self.offset = info.earliest
        elif self.offset > info.latest:
            # The same life shorter than what was read: a durable store gave offsets back. Read on from its end.
            self.offset = info.latest

    def _recreated(self, epoch: int, earliest: int) -> None:
        self.warn(f"{self._where()} was deleted and created again (the retained log's epoch changed from "
                  f"{self.epoch} to {epoch}): reading on from its earliest offset {earliest}")
        self.epoch = epoch
        self.offset = earliest

    async def _offsets(self, timestamp_ms: int | None) -> Offsets | None:
        """The log's offsets; waits while the topic does not exist. None once stopped."""
        query = {} if timestamp_ms is None else {"timestamp": timestamp_ms}
        while not self._stopped:
            answer = await self._get(self._url("/topic/offsets", **query))
            if answer is None or self._stopped:
                continue
            if answer.code == 200:
                self._waiting_said = False
                try:
                    return Offsets.of(answer.json())
                except ValueError as e:
                    raise ToolError(f"nsqd {self.node} answered /topic/offsets with something else: {e}") from None
            if answer.code == 404 and answer.message() == "TOPIC_NOT_FOUND":
                if not self._waiting_said:
                    self._waiting_said = True
                    self.warn(f"{self._where()} does not exist: waiting for it")
                await _sleep(self.clock, max(self.poll, 1.0))
                continue
            self._refused("/topic/offsets", answer)
        return None

    def _refused(self, path: str, answer: Answer) -> None:
        """An answer that ends the tool, in one line."""
        message = answer.message()
        if answer.code == 400 and message == "RETENTION_OFF":
            raise ToolError(f"{self._where()} keeps no retained log: retention is off for it "
                            "(the broker's --retention-time / --retention-bytes, or POST /topic/retention)")
        if answer.code == 416:
            data = _json_or_empty(answer)
            raise self._out_of_range(self.offset, data.get("earliest", "?"), data.get("latest", "?"))
        if answer.code in (404, 405):
            raise ToolError(f"nsqd {self.node} has no {path} ({answer.code} {message or 'NOT_FOUND'}): "
                            "it does not keep retained logs (it is not an mqd, or one without them)")
        raise ToolError(f"nsqd {self.node} answered {path} for topic {self.topic} with {answer.code}"
                        + (f" {message}" if message else ""))

    async def _get(self, url: str) -> Answer | None:
        """The answer to a GET; None after a failure worth retrying (said, and waited for)."""
        try:
            answer = await self.fetch(url)
            if answer.code >= 500:
                raise _Retry(f"{answer.code} {answer.message() or 'error'}")
        except HTTPRefusedError as e:
            raise ToolError(refused_line(e)) from None
        except Exception as e:  # noqa: BLE001 - unreachable, timed out, cut: the broker may come back
            delay = RETRY_DELAYS[min(self._retries, len(RETRY_DELAYS) - 1)]
            self._retries += 1
            self.warn(f"nsqd {self.node}: {_reason(e)}; asking again in {delay:g}s")
            await _sleep(self.clock, delay)
            return None
        self._retries = 0
        return answer


def _json_or_empty(answer: Answer) -> dict[str, Any]:
    try:
        return answer.json()
    except ValueError:
        return {}


def _reason(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, defer.TimeoutError | defer.CancelledError):
        return f"no answer within {REQUEST_TIMEOUT:g}s"
    return text.splitlines()[0][:300]


# -- finding the brokers ---------------------------------------------------------------------------


def _split_host(address: str) -> str:
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


async def http_port_of(reactor: Any, address: str, config: Any,
                       warn: Callable[[str], Any] | None = None) -> str:
    """`host:http_port` of the nsqd at TCP `address`: from its IDENTIFY answer's `http_port`.

    The connection is closed at once. A broker that refuses the handshake
    ends the tool with go-nsq's line (as mq-tail's consumer does); one that
    cannot be reached, or closes during the handshake, is tried again.
    """
    from twisted.internet.error import ConnectError

    from mqd.client.errors import ConnectionClosed, HandshakeRefusedError
    from mqd.client.protocol import ConnectionDelegate, connect

    say = warn if warn is not None else (lambda text: log.warn("{text}", text=text))
    attempt = 0
    while True:
        try:
            # A quiet delegate: closing this connection at once is the plan, not news.
            proto = await connect(reactor, address, config, ConnectionDelegate())
        except ValueError as e:
            raise ToolError(str(e)) from None
        except HandshakeRefusedError as e:
            raise ToolError(e.nsq_text) from None
        except (ConnectError, ConnectionClosed, defer.TimeoutError) as e:
            delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]
            attempt += 1
            say(f"nsqd {address}: {_reason(e)}; trying again in {delay:g}s")
            await _sleep(reactor, delay)
            continue
        server = dict(proto.server)
        proto.close()
        port = server.get("http_port")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ToolError(f"nsqd {address} does not keep retained logs: its IDENTIFY answer has no http_port "
                            "(it is not an mqd, or one without retained logs); --offset and --since need one")
        return join_host_port(_split_host(address), port)


def lookupd_http_producers(document: Any) -> list[str]:
    """`broadcast_address:http_port` of each producer of a `/lookup` answer (either shape), in its order."""
    if isinstance(document, dict) and "data" in document and "status_code" in document:
        document = document["data"]
    rows = document.get("producers") if isinstance(document, dict) else None
    found: list[str] = []
    for row in rows if isinstance(rows, list) else ():
        host = row.get("broadcast_address") if isinstance(row, dict) else None
        port = row.get("http_port") if isinstance(row, dict) else None
        if (isinstance(host, str) and host and isinstance(port, int) and not isinstance(port, bool)
                and 0 < port < 65536):
            node = join_host_port(host, port)
            if node not in found:
                found.append(node)
    return found


async def _lookup(fetch: Fetch, lookupds: Iterable[str], topic: str) -> list[str]:
    """The topic's producers over every lookupd that answered (their union); unreachable ones are logged."""
    from mqd.client.discovery import lookup_url

    found: list[str] = []
    for address in lookupds:
        url = lookup_url(address, topic)
        try:
            answer = await fetch(url)
        except HTTPRefusedError as e:
            raise ToolError(refused_line(e)) from None
        except Exception as e:  # noqa: BLE001 - one lookupd down: the others may answer
            log.warn("lookupd {address}: {reason}", address=address, reason=_reason(e))
            continue
        if answer.code == 404:
            continue
        if answer.code != 200:
            log.warn("lookupd {address} answered /lookup with {code}", address=address, code=answer.code)
            continue
        try:
            nodes = lookupd_http_producers(json.loads(answer.body))
        except ValueError:
            log.warn("lookupd {address} answered /lookup with something else", address=address)
            continue
        found.extend(n for n in nodes if n not in found)
    return found


# -- the tool ------------------------------------------------------------------------------------------


def tail_logs(reactor: Any, args: Any, printer: Any, config: Any, done: defer.Deferred,
              http: Any = None) -> dict[tuple[str, str], LogReader]:
    """Start reading every (broker, topic) log the flags name, until `done` fires; failures errback `done`.

    Returns the readers by (node, topic), filled in as the brokers are
    found (for tests).

    `printer.shower(topic)` gives the `show(body)` of one topic's bodies;
    `printer.remaining()` how many more are wanted (0: no limit).
    """
    start = args.retained_start
    fetch = BrokerHTTP(args.http_auth_secret, reactor, http=http).get
    readers: dict[tuple[str, str], LogReader] = {}

    def fail(error: BaseException) -> None:
        if not done.called:
            done.errback(error)

    def failed(failure: Any, what: str) -> None:
        fail(failure.value if failure.check(ToolError) else ToolError(f"{what}: {failure.getErrorMessage()}"))

    def batch() -> int:
        left = printer.remaining()
        return min(left, BATCH) if left > 0 else BATCH

    def read(node: str) -> None:
        for topic in args.topic:
            if (node, topic) in readers:
                continue
            log.info("reading the retained log of topic {topic} on nsqd {node} from {start}",
                     topic=topic, node=node, start=start.describe())
            reader = LogReader(node, topic, start, fetch, printer.shower(topic), reactor, batch=batch)
            readers[node, topic] = reader
            d = defer.Deferred.fromCoroutine(reader.run())
            d.addErrback(failed, f"reading topic {topic} from nsqd {node} failed")

    def stop_all(_: Any = None) -> Any:
        for reader in readers.values():
            reader.stop()
        return _

    done.addBoth(stop_all)

    async def find() -> None:
        if args.nsqd_tcp_address:
            for address in args.nsqd_tcp_address:
                read(await http_port_of(reactor, address, config))
            return
        lookup_fetch = BrokerHTTP(args.http_auth_secret, reactor, kind="nsqlookupd", http=http).get
        while not done.called:
            for topic in args.topic:
                for node in await _lookup(lookup_fetch, args.lookupd_http_address, topic):
                    read(node)
            await _sleep(reactor, config.lookupd_poll_interval)

    defer.Deferred.fromCoroutine(find()).addErrback(failed, "finding the brokers failed")
    return readers
