"""The machinery of the fuzz and fault tests, shared with `python -m bench torture`.

The tests assert on what these helpers report; the bench runs the same
helpers longer and prints the figures. Everything talks to a real broker
(`tests.integration._support.BrokerProcess`) over sockets, except `LogWatch`
and the token lists, which the in-process fuzzers use too.

The kill -9 loop reuses the publisher, consumer and drain of
tests/integration/test_durability.py (the single-crash acceptance test of
`--durable`): here they run round after round on the same data directory.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twisted.logger import LogLevel, formatEvent, globalLogPublisher

from bench.broker import Sampler
from tests.integration._support import (
    FRAME_ERROR,
    FRAME_MESSAGE,
    FRAME_RESPONSE,
    MAGIC_V2,
    BrokerProcess,
    RawConn,
    command,
    mpub_body,
)
from tests.integration.test_durability import (
    Consumer,
    Delivery,
    Publisher,
    check_body,
    drain_all,
    make_body,
)
from tests.unit.conftest import sized

# -- the log oracle -------------------------------------------------------------------

# Where an error-level event reports a client's mistake, as nsqlookupd's own
# log does ("ERROR: [peer] - E_INVALID ..."): input may cause these.
CLIENT_ERROR_NAMESPACES = frozenset({"mqd.lookup.protocol"})


class LogWatch:
    """Collects the twisted.logger events that mean a bug, whatever the input was.

    A failure (a traceback: `log.failure`, Twisted's "Unhandled Error"), a
    critical event, or an error event from anywhere but the places that log
    a client's mistakes. Used as a context manager around in-process fuzzing.
    """

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        level = event.get("log_level")
        if (
            "log_failure" in event
            or level == LogLevel.critical
            or (level == LogLevel.error
                and event.get("log_namespace") not in CLIENT_ERROR_NAMESPACES)
        ):
            self.events.append(event)

    def __enter__(self) -> LogWatch:
        globalLogPublisher.addObserver(self)
        return self

    def __exit__(self, *exc: object) -> None:
        globalLogPublisher.removeObserver(self)

    def texts(self) -> list[str]:
        out = []
        for event in self.events:
            text = f"{event.get('log_namespace')}: {formatEvent(event)}"
            failure = event.get("log_failure")
            if failure is not None:
                text += "\n" + failure.getTraceback()
            out.append(text)
        return out

    def check(self, what: str = "") -> None:
        """Fail with the collected events, if any, and forget them."""
        texts = self.texts()
        self.events.clear()
        assert not texts, f"{what}: {len(texts)} bad log events:\n" + "\n".join(texts[:3])


# -- fuzz vocabulary -------------------------------------------------------------------

_I32 = struct.Struct(">i")


def _identify(body: bytes) -> bytes:
    return b"IDENTIFY\n" + sized(body)


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


DEEP_JSON = b"[" * 50_000 + b"]" * 50_000
DEEP_OBJECT = b'{"a":' * 20_000 + b"1" + b"}" * 20_000
HUGE = 10**30
LONG_NUMBER = b"9" * 5000  # past Python's default limit on int() of a digit string
ID = b"0123456789abcdef"

# Inputs that reach the corners: huge and odd numbers, odd JSON, odd names,
# compression and TLS negotiation, bodies of every size class. Random bytes
# and random sized blobs are mixed in by the fuzzers.
V2_TOKENS: list[bytes] = [
    b"NOP\n", b"\n", b"\r\n", b" ", b"CLS\n", b"AUTH\n", b"AUTH\n" + sized(b"secret"),
    b"SUB t c\n", b"SUB t#ephemeral c#ephemeral\n", b"SUB t\n", b"SUB " + b"x" * 70 + b" c\n",
    "SUB t\u00e9 c\n".encode(), b"SUB t c\xff\n",
    b"RDY 5\n", b"RDY 0\n", b"RDY -1\n", b"RDY x\n", b"RDY\n", b"RDY %d\n" % HUGE,
    b"RDY 2500\n", b"RDY 1e400\n", b"RDY 0x10\n", b"RDY  1\n", b"RDY " + LONG_NUMBER + b"\n",
    b"REQ " + ID + b" " + LONG_NUMBER + b"\n", b"DPUB t " + LONG_NUMBER + b"\n" + sized(b"x"),
    b"REQ " + ID + b" %d\n" % (2**63), b"DPUB t %d\n" % (2**64 + 5) + sized(b"x"),
    b"SUB t c\nRDY 10\nPUB t\n" + sized(b"in flight"),
    b"FIN " + ID + b"\n", b"FIN short\n", b"FIN " + ID + b" extra\n",
    b"REQ " + ID + b" 10\n", b"REQ " + ID + b" x\n", b"REQ " + ID + b" %d\n" % HUGE,
    b"REQ " + ID + b" -%d\n" % HUGE, b"REQ " + ID + b" 1e400\n",
    b"TOUCH " + ID + b"\n",
    b"PUB t\n", b"MPUB t\n", b"DPUB t 100\n",
    b"PUB t\n" + sized(b"hello"), b"PUB t\n" + sized(b""), b"PUB t\n" + _I32.pack(-1),
    b"PUB t\n" + _I32.pack(2**31 - 1), b"PUB bad!\n" + sized(b"x"),
    b"MPUB t\n" + sized(mpub_body([b"a", b"b"])), b"MPUB t\n" + sized(_I32.pack(0)),
    b"MPUB t\n" + sized(_I32.pack(2**31 - 1)), b"MPUB t\n" + sized(_I32.pack(-5)),
    b"MPUB t\n" + sized(_I32.pack(2) + sized(b"a")),
    b"MPUB t\n" + sized(_I32.pack(1) + _I32.pack(2**31 - 1)),
    b"DPUB t 5\n" + sized(b"later"), b"DPUB t %d\n" % HUGE + sized(b"x"),
    b"DPUB t -%d\n" % HUGE + sized(b"x"), b"DPUB t 1e400\n" + sized(b"x"),
    b"DPUB t 99999999999999999999999999999999999999\n" + sized(b"x"),
    b"IDENTIFY\n",
    _identify(_json(feature_negotiation=True)),
    _identify(_json(heartbeat_interval=-1)),
    _identify(b"null"), _identify(b"[]"), _identify(b"1"), _identify(b'"s"'), _identify(b""),
    _identify(b"{"), _identify(DEEP_JSON), _identify(DEEP_OBJECT),
    _identify(_json(heartbeat_interval=1.5, msg_timeout=2000.5, output_buffer_size=100.25)),
    _identify(_json(sample_rate=50.5, deflate_level=3.7, output_buffer_timeout=0.5)),
    _identify(_json(heartbeat_interval=HUGE, msg_timeout=HUGE, output_buffer_size=HUGE)),
    _identify(_json(output_buffer_timeout=-HUGE, sample_rate=-HUGE, deflate_level=HUGE)),
    _identify(b'{"heartbeat_interval": 1e400, "msg_timeout": -1e400, "sample_rate": NaN}'),
    _identify(b'{"heartbeat_interval": 2000.0, "msg_timeout": 1e300, "output_buffer_timeout": 1e15}'),
    _identify(b'{"user_agent": "\\udc80x", "client_id": "\\ud800", "hostname": "\\udfff"}'),
    _identify(b'{"user_agent": "\\udc80x", "client_id": "\\ud800"}') + b"SUB t c\n",
    _identify(_json(user_agent=["list"], client_id={"o": 1}, hostname=7)),
    _identify(_json(feature_negotiation=True, deflate=True, deflate_level=9)),
    _identify(_json(feature_negotiation=True, snappy=True)),
    _identify(_json(feature_negotiation=True, deflate=True, snappy=True)),
    _identify(_json(feature_negotiation=True, tls_v1=True)),
    _identify(_json(feature_negotiation="yes", tls_v1=1, snappy="x", deflate=None)),
]

LOOKUPD_TOKENS: list[bytes] = [
    b"  V1", b"PING\n", b"\n", b" ", b"REGISTER t c\n", b"REGISTER t\n", b"REGISTER\n",
    b"UNREGISTER t c\n", b"UNREGISTER t\n", b"UNREGISTER t#ephemeral\n", b"REGISTER bad! c\n",
    b"REGISTER t c d e\n", b"IDENTIFY\n",
    _identify(_json(version="1.3.0", tcp_port=4150, http_port=4151, broadcast_address="b")),
    _identify(b"null"), _identify(b"[]"), _identify(b"1"), _identify(b""), _identify(DEEP_JSON),
    _identify(DEEP_OBJECT),
    _identify(_json(version="1.3.0", tcp_port=4150.5, http_port=4151.0, broadcast_address="b")),
    _identify(_json(version="1.3.0", tcp_port=HUGE, http_port=-HUGE, broadcast_address="b")),
    _identify(_json(version=1, tcp_port="4150", http_port=None, broadcast_address=["b"])),
    _identify(b'{"version": "\\ud800", "tcp_port": 1, "http_port": 2, "broadcast_address": "\\udc80"}'),
    _I32.pack(-1), _I32.pack(2**31 - 1),
]

# HTTP requests (method, target, body) an API fuzzer combines with random ones.
HTTP_PATHS = [
    "/ping", "/info", "/stats", "/metrics", "/pub", "/mpub", "/topic/create", "/topic/delete",
    "/topic/empty", "/topic/pause", "/topic/unpause", "/channel/create", "/channel/delete",
    "/channel/empty", "/channel/pause", "/channel/unpause", "/snapshot", "/config/log_level",
    "/config/nsqlookupd_tcp_addresses", "/config/x", "/", "//ping", "/ping/", "/PING", "/%ff",
    "/%", "/a/../ping", "/lookup", "/topics", "/channels", "/nodes", "/debug",
    "/topic/tombstone", "/tombstone_topic_producer", "/create_topic", "/delete_topic",
]
HTTP_QUERY_KEYS = ["topic", "channel", "defer", "format", "out", "node", "binary", "channel",
                   "include_clients", "include_mem", "topic", "x", ""]
HTTP_QUERY_VALUES = [
    "t", "c", "t#ephemeral", "bad!", "", "json", "text", "prometheus", "true", "1", "-1",
    str(HUGE), "-" + str(HUGE), "1e400", "NaN", "%ff", "%ed%a0%80", "%00", "..", "a/../..",
    "/etc", "x" * 300, "%25", "snap1", "a/b", ".", "./x", "..%2fx", "nul%00l", "%c3%a9",
    "a%2fb%2fc", "x" * 5000, LONG_NUMBER.decode(), str(2**63), str(2**64 + 1),
]
HTTP_BODIES = [
    b"", b"hello", b"\x00" * 10, b"null", b"[]", b'["127.0.0.1:1"]', b'"info"', b"info", b"debug",
    b"INFO", b"[1]", b"{}", DEEP_JSON, DEEP_OBJECT, b"[" * 5000, mpub_body([b"a", b"b"]),
    b"a\nb\n", b"\n\n", _I32.pack(2**31 - 1), "\udc80".encode("utf-8", "surrogatepass"),
]
HTTP_METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "CONNECT"]
# Every route with the method it serves, for the systematic sweeps.
HTTP_ROUTES = [
    ("GET", "/ping"), ("GET", "/info"), ("GET", "/stats"), ("GET", "/metrics"), ("POST", "/pub"),
    ("POST", "/mpub"), ("POST", "/topic/create"), ("POST", "/topic/delete"),
    ("POST", "/topic/empty"), ("POST", "/topic/pause"), ("POST", "/topic/unpause"),
    ("POST", "/channel/create"), ("POST", "/channel/delete"), ("POST", "/channel/empty"),
    ("POST", "/channel/pause"), ("POST", "/channel/unpause"), ("POST", "/snapshot"),
    ("GET", "/config/log_level"), ("PUT", "/config/log_level"),
    ("PUT", "/config/nsqlookupd_tcp_addresses"), ("PUT", "/config/x"),
    ("GET", "/lookup"), ("GET", "/topics"), ("GET", "/channels"), ("GET", "/nodes"),
    ("GET", "/debug"), ("POST", "/topic/tombstone"),
]
SWEEP_KEYS = ["topic", "channel", "defer", "out", "format", "node"]


def http_sweep() -> Iterator[tuple[str, str, bytes | None]]:
    """Every route with every body, then with every value of every query key."""
    for method, path in HTTP_ROUTES:
        for body in HTTP_BODIES:
            yield method, f"{path}?topic=t&channel=c", body
        for key in SWEEP_KEYS:
            for value in HTTP_QUERY_VALUES:
                yield method, f"{path}?topic=t&channel=c&{key}={value}", b"x"


def random_v2_stream(rng: random.Random, max_tokens: int = 12) -> bytes:
    """Magic (usually) and a random mix of tokens, random bytes and sized blobs."""
    parts = [MAGIC_V2 if rng.random() < 0.9 else rng.randbytes(4)]
    for _ in range(rng.randrange(max_tokens + 1)):
        r = rng.random()
        if r < 0.65:
            parts.append(rng.choice(V2_TOKENS))
        elif r < 0.85:
            parts.append(rng.randbytes(rng.randrange(40)))
        else:
            parts.append(sized(rng.randbytes(rng.randrange(20))))
    return b"".join(parts)


def random_http_request(rng: random.Random) -> tuple[str, str, bytes | None]:
    """(method, target, body) built from the lists above and random characters."""
    path = rng.choice(HTTP_PATHS)
    if rng.random() < 0.1:
        path += "/" + "".join(rng.choice("ab%/.\u00e9") for _ in range(rng.randrange(8)))
    query = "&".join(
        f"{rng.choice(HTTP_QUERY_KEYS)}={rng.choice(HTTP_QUERY_VALUES)}"
        for _ in range(rng.randrange(4))
    )
    target = path + ("?" + query if query or rng.random() < 0.1 else "")
    body = rng.choice(HTTP_BODIES) if rng.random() < 0.7 else None
    return rng.choice(HTTP_METHODS), target, body


# -- control checks on a real broker ------------------------------------------------------


def raw_http(broker: BrokerProcess, method: str, target: str, body: bytes | None,
             timeout: float = 5.0) -> tuple[int, bytes]:
    """One request written by hand (any target bytes), (status, body) of the answer.

    Status 0: the broker closed the connection without answering.
    """
    head = [f"{method} {target} HTTP/1.1", f"Host: {broker.http_address}", "Connection: close"]
    if body is not None:
        head.append(f"Content-Length: {len(body)}")
    data = ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b"")
    with socket.create_connection((broker.http_host, broker.http_port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.startswith(b"HTTP/"):
        return 0, raw
    head_bytes, _, rest = raw.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), rest


def queue_count(stats: dict, topic_name: str, channel_name: str) -> int:
    """Depth + in flight + deferred of one channel in /stats JSON; -1 if it is not there."""
    for topic in stats.get("topics") or []:
        if topic["topic_name"] == topic_name:
            for channel in topic.get("channels") or []:
                if channel["channel_name"] == channel_name:
                    return channel["depth"] + channel["in_flight_count"] + channel["deferred_count"]
    return -1


def pub_round_trip(conn: RawConn, topic: str, body: bytes) -> bytes:
    """PUB on `conn` and return the answer's payload (OK, or the error text)."""
    conn.send(command(f"PUB {topic}", body))
    frame_type, payload = conn.read_frame()
    assert frame_type in (FRAME_RESPONSE, FRAME_ERROR), (frame_type, payload)
    return payload


@dataclass
class Control:
    """Messages published on a control connection before the abuse, and checks that the
    broker still serves a well-behaved client correctly afterwards.

    The control topic has a channel, so every acknowledged body must still be
    there at the end (depth + in flight), and come out of it, intact.
    """

    broker: BrokerProcess
    topic: str = "zz_control"
    channel: str = "zz_control_c"
    published: list[bytes] = field(default_factory=list)

    def setup(self, n: int = 20) -> None:
        with RawConn(self.broker) as conn:
            conn.send(command(f"SUB {self.topic} {self.channel}") + command("CLS"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
            assert conn.read_frame() == (FRAME_RESPONSE, b"CLOSE_WAIT")
        with RawConn(self.broker) as conn:
            for _ in range(n):
                self.publish(conn)

    def publish(self, conn: RawConn) -> None:
        body = make_body(b"ctl", len(self.published))
        answer = pub_round_trip(conn, self.topic, body)
        assert answer == b"OK", f"control PUB answered {answer!r}\n{self.broker.describe()}"
        self.published.append(body)

    def check(self, what: str) -> None:
        """A new client is served: PUB answered OK, /ping OK, stats count every control message."""
        assert self.broker.running, f"broker died after {what}\n{self.broker.describe()}"
        with RawConn(self.broker) as conn:
            self.publish(conn)
        status, body = raw_http(self.broker, "GET", "/ping", None)
        assert (status, body) == (200, b"OK"), f"/ping after {what}: {status} {body[:200]!r}"
        status, body = raw_http(self.broker, "GET", "/stats?format=json&topic=" + self.topic, None)
        assert status == 200, f"/stats after {what}: {status} {body[:300]!r}"
        count = queue_count(json.loads(body), self.topic, self.channel)
        assert count == len(self.published), (
            f"after {what}: control channel counts {count}, {len(self.published)} were acknowledged")
        for path in ("/stats", "/metrics"):
            status, body = raw_http(self.broker, "GET", path, None)
            assert status == 200, f"{path} after {what}: {status} {body[:300]!r}"

    def drain_and_compare(self) -> None:
        """Every acknowledged control body comes out of the channel, intact, once."""
        got = drain_all(self.broker, [(self.topic, self.channel)], silence=0.5,
                        expect=len(self.published))[(self.topic, self.channel)]
        bodies = Counter(d.body for d in got)
        for body in bodies:
            check_body(body)
        assert set(bodies) == set(self.published), (
            f"control channel: {len(set(self.published) - set(bodies))} missing, "
            f"{len(set(bodies) - set(self.published))} unknown")


def log_problems(broker: BrokerProcess) -> list[str]:
    """Where the broker's log (this run) shows an unhandled exception: each such line
    with the one before it and the traceback after it."""
    lines = broker.log().splitlines()
    return ["\n".join(lines[max(0, i - 1):i + 16])
            for i, line in enumerate(lines) if "Traceback" in line or "Unhandled" in line]


# -- fuzzing a real broker ---------------------------------------------------------------


@dataclass
class FuzzReport:
    streams: int = 0
    http_requests: int = 0
    closed_by_broker: int = 0
    http_500: list[str] = field(default_factory=list)
    http_no_answer: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def inputs(self) -> int:
        return self.streams + self.http_requests


def _send_streams(broker: BrokerProcess, streams: list[bytes], settle: float) -> int:
    """Open one connection per stream, send it, read what comes back for `settle` seconds.

    Returns how many connections the broker closed. A send may fail (the
    broker closed on a fatal error before all was sent): that is allowed.
    """
    socks = []
    for data in streams:
        s = socket.create_connection((broker.tcp_host, broker.tcp_port), timeout=5)
        s.settimeout(1.0)
        try:
            s.sendall(data)
        except OSError:
            pass
        s.setblocking(False)
        socks.append(s)
    closed = 0
    deadline = time.monotonic() + settle
    open_socks = set(socks)
    while open_socks and time.monotonic() < deadline:
        time.sleep(0.01)
        for s in list(open_socks):
            try:
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        closed += 1
                        open_socks.discard(s)
                        break
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
                open_socks.discard(s)
    for s in socks:
        s.close()
    return closed


def fuzz_broker(broker: BrokerProcess, control: Control, *, streams: int, http_requests: int,
                seed: int, batch: int = 25, settle: float = 0.15,
                progress: Callable[[str], None] | None = None) -> FuzzReport:
    """Random V2 streams over real sockets and random HTTP requests, in batches.

    After each batch the control checks run (the broker still serves a
    well-behaved client and still counts every control message). 500s and
    requests left unanswered are collected, not raised, so one run shows them all.
    """
    rng = random.Random(seed)
    report = FuzzReport()
    t0 = time.monotonic()
    while report.streams < streams or report.http_requests < http_requests:
        n = min(batch, streams - report.streams)
        if n > 0:
            report.closed_by_broker += _send_streams(
                broker, [random_v2_stream(rng) for _ in range(n)], settle)
            report.streams += n
        for _ in range(min(batch // 5 or 1, http_requests - report.http_requests)):
            method, target, body = random_http_request(rng)
            if target.startswith("/snapshot") and rng.random() < 0.7:
                target = "/ping"  # each snapshot copies the store: only a few
            _http_case(broker, report, method, target, body)
        control.check(f"{report.streams} streams / {report.http_requests} HTTP requests")
        if progress is not None:
            progress(f"fuzz: {report.streams} streams, {report.http_requests} HTTP requests")
    # The corners random requests rarely reach: every snapshot name, every config body.
    sweep = [("POST", f"/snapshot?out={value}", None) for value in HTTP_QUERY_VALUES]
    sweep += [("PUT", f"/config/{opt}", body) for opt in ("nsqlookupd_tcp_addresses", "log_level")
              for body in HTTP_BODIES]
    sweep.append(("PUT", "/config/log_level", b"info"))
    for method, target, body in sweep:
        _http_case(broker, report, method, target, body)
    control.check("the snapshot and config sweep")
    report.seconds = time.monotonic() - t0
    return report


def _http_case(broker: BrokerProcess, report: FuzzReport, method: str, target: str,
               body: bytes | None) -> None:
    status, answer = raw_http(broker, method, target, body)
    report.http_requests += 1
    shown = f"{method} {target[:120]} body={(body or b'')[:40]!r} -> {answer[:200]!r}"
    if status == 500:
        report.http_500.append(shown)
    elif status == 0 and method != "CONNECT":
        report.http_no_answer.append(shown)


# -- kill -9 in a loop -----------------------------------------------------------------------


class CrashPublisher(Publisher):
    """test_durability's publisher plus DPUB, with bodies unique across rounds."""

    def __init__(self, broker: BrokerProcess, index: int, topics: list[str], window: int,
                 round_no: int) -> None:
        super().__init__(broker, index, topics, window)
        self.tag = b"r%dp%d" % (round_no, index)
        self.rng = random.Random(round_no * 1000 + index)

    def _next_command(self) -> tuple[bytes, list[bytes], str]:
        if self.rng.random() < 0.15:
            topic = self.rng.choice(self.topics)
            body = make_body(self.tag, self._seq)
            self._seq += 1
            return command(f"DPUB {topic} {self.rng.randrange(1, 800)}", body), [body], topic
        return super()._next_command()


class CrashConsumer(Consumer):
    """test_durability's consumer (FIN some, let some time out), but REQ with a delay."""

    def __init__(self, broker: BrokerProcess, topic: str, channel: str, marker_topic: str,
                 seed: int) -> None:
        super().__init__(broker, topic, channel, marker_topic)
        self.rng = random.Random(seed)

    def _on_message(self, msg: Delivery, pending: dict[bytes, bytes]) -> None:
        seq = int(msg.body.split(b"-")[1])
        if seq % 4 == 2 and msg.attempts <= 1:
            self.received[msg.id] = msg.body
            self.requeued += 1
            self.conn.send(b"REQ " + msg.id + b" %d\n" % self.rng.randrange(1, 500))
            return
        super()._on_message(msg, pending)


@dataclass
class CrashReport:
    rounds: int = 0
    restarts: int = 0
    commands: int = 0
    acknowledged: int = 0
    missing: int = 0
    corrupt: int = 0
    unknown: int = 0
    duplicates: int = 0
    finished_came_back: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


class CrashLedger:
    """What must come back after a crash, and what may.

    `must[(topic, channel)]`: acknowledged bodies not FINished on that
    channel. `sent[topic]`: every body ever sent to the topic, acknowledged
    or not, FINished or not: at-least-once means any of those may come back
    (a FIN the broker got before the kill may or may not have landed), but
    nothing else may.
    """

    def __init__(self) -> None:
        self.sent: dict[str, set[bytes]] = {}
        self.must: dict[tuple[str, str], set[bytes]] = {}
        self.finished: dict[tuple[str, str], set[bytes]] = {}

    def queues(self) -> list[tuple[str, str]]:
        return list(self.must)

    def verify(self, broker: BrokerProcess, report: CrashReport, where: str) -> None:
        """Drain every queue of the restarted broker (FIN all) and compare with the ledger."""
        out = drain_all(broker, self.queues(), silence=1.5)
        for (topic, channel), deliveries in out.items():
            bodies = Counter(d.body for d in deliveries)
            report.duplicates += sum(n - 1 for n in bodies.values())
            for body in bodies:
                try:
                    check_body(body)
                except AssertionError:
                    report.corrupt += 1
                    report.problems.append(f"{where}: {topic}/{channel}: corrupt {body[:60]!r}")
                    continue
                if body not in self.sent.get(topic, ()):
                    report.unknown += 1
                    report.problems.append(f"{where}: {topic}/{channel}: unknown {body[:60]!r}")
                elif body in self.finished.get((topic, channel), ()):
                    report.finished_came_back += 1
            missing = self.must[(topic, channel)] - set(bodies)
            if missing:
                report.missing += len(missing)
                some = ", ".join(repr(b[:24]) for b in sorted(missing)[:3])
                report.problems.append(f"{where}: {topic}/{channel}: {len(missing)} acknowledged "
                                       f"bodies missing: {some}")
            self.must[(topic, channel)] = set()
            self.finished.setdefault((topic, channel), set()).update(bodies)


def crash_rounds(broker: BrokerProcess, rounds: int, *, prefix: str = "crash", seed: int = 16,
                 load: tuple[float, float] = (0.3, 1.2),
                 progress: Callable[[str], None] | None = None) -> CrashReport:
    """Mixed PUB/MPUB/DPUB, FIN, REQ with delay and msg timeouts; kill -9 at a random
    moment; restart on the same data directory; drain and compare; `rounds` times.

    `broker` must be running `--durable` with a short `--msg-timeout`; it is
    left running (verified after its last restart).
    """
    rng = random.Random(seed)
    report = CrashReport()
    ledger = CrashLedger()
    consumed, lonely = f"{prefix}.consumed", f"{prefix}.lonely"
    # c1 is consumed during the load, c2 only by the drain after each restart;
    # `lonely` has no channel until the first drain makes one.
    for channel in ("c1", "c2"):
        with RawConn(broker) as conn:
            conn.send(command(f"SUB {consumed} {channel}"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        ledger.must[(consumed, channel)] = set()
    ledger.must[(lonely, "d")] = set()
    ledger.sent[consumed], ledger.sent[lonely] = set(), set()
    t0 = time.monotonic()
    for round_no in range(rounds):
        markers = f"{prefix}.markers{round_no}"
        consumer = CrashConsumer(broker, consumed, "c1", markers, seed=rng.randrange(1 << 30))
        publishers = [CrashPublisher(broker, i, [consumed, lonely], window, round_no)
                      for i, window in enumerate((1, 4, 16))]
        consumer.start()
        for p in publishers:
            p.start()
        until = time.monotonic() + rng.uniform(*load)
        while time.monotonic() < until:
            time.sleep(0.02)
        broker.crash()
        threads = [*publishers, consumer]
        for thread in threads:
            thread.join(30)
            if thread.is_alive():
                report.problems.append(f"round {round_no}: {thread.name} hung after the kill")
            elif not isinstance(thread.ended_by, OSError):
                report.problems.append(f"round {round_no}: {thread.name} ended by {thread.ended_by!r}")
            if thread.errors:
                report.problems.append(f"round {round_no}: {thread.name} got {thread.errors[:3]!r}")
        for p in publishers:
            report.commands += p.commands
            for body, topic in p.sent.items():
                ledger.sent[topic].add(body)
            for body, topic in p.acked.items():
                report.acknowledged += 1
                channels = ("c1", "c2") if topic == consumed else ("d",)
                for channel in channels:
                    ledger.must[(topic, channel)].add(body)
        ledger.must[(consumed, "c1")] -= set(consumer.fin_sent.values())
        ledger.finished.setdefault((consumed, "c1"), set()).update(consumer.fin_sent.values())
        ledger.sent[markers] = set(consumer.markers_sent)
        ledger.must[(markers, "d")] = set(consumer.markers_acked)
        report.rounds += 1
        broker.start()
        report.restarts += 1
        ledger.verify(broker, report, f"after kill {round_no + 1}")
        if progress is not None:
            progress(f"kill -9 round {round_no + 1}/{rounds}: {report.acknowledged} acknowledged, "
                     f"{report.missing} missing, {report.corrupt} corrupt, {report.unknown} unknown")
    report.seconds = time.monotonic() - t0
    return report


# -- resource abuse: RSS and a bystander's latency -------------------------------------------


class Bystander(threading.Thread):
    """PUB round trips on its own connection: the worst one is what a client saw.

    `http`: GET /ping round trips instead, for a broker where PUB needs an AUTH
    the bystander could not get either.
    """

    def __init__(self, broker: BrokerProcess, topic: str = "zz_bystander", http: bool = False) -> None:
        super().__init__(daemon=True, name="bystander")
        self.broker, self.topic, self.http = broker, topic, http
        self.stop_event = threading.Event()
        self.worst = 0.0
        self.round_trips = 0
        self.errors: list[str] = []

    def run(self) -> None:
        if self.http:
            self._run_http()
            return
        try:
            with RawConn(self.broker, timeout=60) as conn:
                while not self.stop_event.is_set():
                    t0 = time.monotonic()
                    answer = pub_round_trip(conn, self.topic, b"bystander")
                    took = time.monotonic() - t0
                    if answer != b"OK":
                        self.errors.append(answer.decode(errors="replace"))
                        return
                    self.worst = max(self.worst, took)
                    self.round_trips += 1
                    self.stop_event.wait(0.01)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            self.errors.append(repr(e))

    def _run_http(self) -> None:
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            try:
                answer = raw_http(self.broker, "GET", "/ping", None, timeout=60)
            except OSError as e:
                self.errors.append(repr(e))
                return
            if answer != (200, b"OK"):
                self.errors.append(repr(answer))
                return
            self.worst = max(self.worst, time.monotonic() - t0)
            self.round_trips += 1
            self.stop_event.wait(0.01)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(60)


def _rss_anon_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class AnonSampler(Sampler):
    """bench's RSS sampler, also keeping the peak of RssAnon: the heap and other
    private memory, without the LMDB pages mapped from the page cache (RssFile),
    which the kernel can take back and which grow with the backlog on disk."""

    def reset(self) -> None:
        super().reset()
        with self._lock:
            self.anon_peak = self.anon_baseline = _rss_anon_kb(self.pid)

    def _sample(self) -> None:
        super()._sample()
        anon = _rss_anon_kb(self.pid)
        with self._lock:
            self.anon_peak = max(self.anon_peak, anon)


@dataclass
class AbuseResult:
    name: str
    baseline_mb: float
    peak_mb: float
    worst_latency_ms: float
    bystander_round_trips: int
    bystander_errors: list[str]
    detail: str = ""
    anon_baseline_mb: float = 0.0
    anon_peak_mb: float = 0.0

    @property
    def growth_mb(self) -> float:
        return self.peak_mb - self.baseline_mb

    @property
    def anon_growth_mb(self) -> float:
        return self.anon_peak_mb - self.anon_baseline_mb


@contextmanager
def measured(broker: BrokerProcess, name: str, http_bystander: bool = False) -> Iterator[dict[str, Any]]:
    """Peak RSS of the broker and the bystander's worst PUB round trip during the block.

    Yields a dict the block may put a `detail` text into; the result is
    left in it under `result` once the block is done.
    """
    sampler = AnonSampler(broker.proc.pid, interval=0.05).start()
    baseline = sampler.window()[0]
    bystander = Bystander(broker, http=http_bystander)
    bystander.start()
    out: dict[str, Any] = {}
    try:
        yield out
    finally:
        bystander.stop()
        peak = sampler.window()[0]
        sampler.stop()
        out["result"] = AbuseResult(name, baseline, peak, bystander.worst * 1000,
                                    bystander.round_trips, bystander.errors, out.get("detail", ""),
                                    sampler.anon_baseline / 1024, sampler.anon_peak / 1024)


def _send_until(sock: socket.socket, data: bytes, stop_at: float) -> int:
    """Send `data` over and over until `stop_at`; a blocked send (the broker stopped
    reading) just waits. Returns the bytes the kernel took."""
    sock.settimeout(0.2)
    sent = 0
    view = memoryview(data)
    pos = 0
    while time.monotonic() < stop_at:
        try:
            n = sock.send(view[pos:])
        except TimeoutError:
            continue
        sent += n
        pos = (pos + n) % len(data)
    return sent


def _lazy_reader(broker: BrokerProcess, rcvbuf: int) -> socket.socket:
    """A connection with a small receive buffer (set before connecting, so the
    TCP window stays small): what the client does not read piles up in the broker."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((broker.tcp_host, broker.tcp_port))
    return sock


def abuse_never_reading_consumer(broker: BrokerProcess, seconds: float, *,
                                 size: int = 16384) -> dict[str, Any]:
    """SUB + RDY 2500 and never read, next to a consumer that reads and FINs, while
    unique messages are published.

    With a short --msg-timeout the never-reading client is handed 2500 new
    messages a timeout; their frames sit in its write buffer after the
    other consumer has finished them. Without flow control that memory is
    never given back while the client stays connected.
    """
    topic = "abuse_never_reading"
    sock = _lazy_reader(broker, 4096)
    sock.sendall(MAGIC_V2 + command(f"SUB {topic} c") + command("RDY 2500"))
    stop = threading.Event()
    counts = {"published": 0, "finished": 0}

    def reader() -> None:
        with RawConn(broker, timeout=2) as conn:
            conn.send(command(f"SUB {topic} c") + command("RDY 2500"))
            fins: list[bytes] = []
            while not stop.is_set():
                try:
                    frame_type, payload = conn.read_frame()
                except TimeoutError:
                    continue
                if frame_type == FRAME_MESSAGE:
                    fins.append(b"FIN " + payload[10:26] + b"\n")
                    if len(fins) >= 100:
                        conn.send(b"".join(fins))
                        counts["finished"] += len(fins)
                        fins.clear()

    fast = threading.Thread(target=reader, daemon=True)
    fast.start()
    with measured(broker, "never-reading consumer") as out:
        deadline = time.monotonic() + seconds
        seq = 0
        with RawConn(broker, timeout=30) as publisher:
            while time.monotonic() < deadline:
                bodies = [b"%012d" % (seq + i) + b"y" * (size - 12) for i in range(50)]
                seq += len(bodies)
                publisher.send(command(f"MPUB {topic}", mpub_body(bodies)))
                assert publisher.read_frame() == (FRAME_RESPONSE, b"OK")
                counts["published"] = seq
        stop.set()
        fast.join(10)
        out["detail"] = (f"{counts['published']:,} x {size} B published, "
                         f"{counts['finished']:,} FINished by the other consumer")
    sock.close()
    return out


def abuse_fin_flood(broker: BrokerProcess, seconds: float) -> dict[str, Any]:
    """`FIN <unknown id>` forever, never reading the E_FIN_FAILED answers."""
    sock = _lazy_reader(broker, 4096)
    sock.sendall(MAGIC_V2 + command("SUB abuse_fin_flood c"))
    block = (b"FIN " + ID + b"\n") * 3000
    with measured(broker, "FIN flood, never reading") as out:
        sent = _send_until(sock, block, time.monotonic() + seconds)
        out["detail"] = f"{sent // 21:,} FINs taken by the kernel"
    sock.close()
    return out


def abuse_slow_consumer(broker: BrokerProcess, seconds: float, *, size: int = 4096) -> dict[str, Any]:
    """A consumer reading 8 KB every 50 ms (FINning what it got) while publishers flood."""
    topic = "abuse_slow"
    sock = _lazy_reader(broker, 8192)
    sock.sendall(MAGIC_V2 + command(f"SUB {topic} c") + command("RDY 2500"))
    stop = threading.Event()
    published = [0]

    def flood() -> None:
        with RawConn(broker, timeout=60) as conn:
            batch = command(f"MPUB {topic}", mpub_body([b"s" * size] * 100))
            while not stop.is_set():
                conn.send(batch)
                conn.read_frame()
                published[0] += 100

    flooder = threading.Thread(target=flood, daemon=True)
    with measured(broker, "slow consumer") as out:
        flooder.start()
        buf = b""
        fins = 0
        sock.settimeout(0.05)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                buf += sock.recv(8192)
            except TimeoutError:
                pass
            while len(buf) >= 8:
                frame_size, frame_type = struct.unpack(">ii", buf[:8])
                if len(buf) < 4 + frame_size:
                    break
                payload, buf = buf[8:4 + frame_size], buf[4 + frame_size:]
                if frame_type == FRAME_MESSAGE:
                    sock.sendall(b"FIN " + payload[10:26] + b"\n")
                    fins += 1
            time.sleep(0.05)
        stop.set()
        flooder.join(30)
        out["detail"] = f"{published[0]:,} published, {fins:,} read and FINished"
    sock.close()
    return out


def abuse_deflate_bomb(broker: BrokerProcess, seconds: float) -> dict[str, Any]:
    """IDENTIFY deflate, then ~1000:1 compressed NOPs without reading anything."""
    conn = RawConn(broker, timeout=10)
    conn.send(_identify(_json(feature_negotiation=True, deflate=True, deflate_level=1)))
    frame_type, payload = conn.read_frame()
    assert frame_type == FRAME_RESPONSE and json.loads(payload)["deflate"], payload
    sock = conn.sock  # from here on the broker reads deflate; what it writes is never read
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = compressor.compress(b"NOP\n" * (8 << 20)) + compressor.flush(zlib.Z_SYNC_FLUSH)
    with measured(broker, "deflate bomb") as out:
        sent = _send_until(sock, chunk, time.monotonic() + seconds)
        inflated = sent * (32 << 20) // len(chunk)
        out["detail"] = (f"{sent:,} compressed bytes taken by the kernel "
                         f"({inflated >> 20:,} MB of NOPs inflated)")
    sock.close()
    return out


def abuse_huge_mpub(broker: BrokerProcess, seconds: float) -> dict[str, Any]:
    """MPUBs of max-body-size (5 MB) in 1-byte messages, not reading the answers."""
    topic = "abuse_huge_mpub"
    per = (5 * 1024 * 1024 - 4) // 5
    body = mpub_body([b"x"] * per)
    data = command(f"MPUB {topic}", body)
    sock = socket.create_connection((broker.tcp_host, broker.tcp_port))
    sock.sendall(MAGIC_V2)
    with measured(broker, "huge MPUB (5 MB of 1-byte messages)") as out:
        sent = _send_until(sock, data, time.monotonic() + seconds)
        out["detail"] = f"{sent // len(data):,} MPUBs of {per:,} messages"
    sock.close()
    return out


def abuse_auth_pending(broker: BrokerProcess, seconds: float) -> dict[str, Any]:
    """AUTH against an auth server that never answers, then PUBs without reading.

    The broker must be started with --auth-http-address pointing at a socket
    that accepts and never responds (see `silent_server`).
    """
    sock = socket.create_connection((broker.tcp_host, broker.tcp_port))
    sock.sendall(MAGIC_V2 + _identify(_json(feature_negotiation=True))
                 + b"AUTH\n" + sized(b"secret"))
    block = command("PUB abuse_auth", b"z" * 1000) * 64
    with measured(broker, "AUTH pending, PUBs streaming (bystander: GET /ping)",
                  http_bystander=True) as out:
        sent = _send_until(sock, block, time.monotonic() + seconds)
        out["detail"] = f"{sent:,} bytes sent behind the pending AUTH"
    sock.close()
    return out


@contextmanager
def silent_server() -> Iterator[str]:
    """A listening socket that never accepts: HTTP requests to it hang. Yields HOST:PORT."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()

