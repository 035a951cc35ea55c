"""Checks that a real broker still serves a well-behaved client after abuse, and reads of its log.

`Control` publishes messages on a control connection before the abuse and
afterwards checks a new client is answered and every acknowledged control
message is still there; `log_problems` finds unhandled exceptions in the log.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from dataclasses import dataclass, field

from tests.support.authd import identify_auth
from tests.support.durable_load import check_body, drain_all, make_body
from tests.support.processes import BrokerProcess
from tests.support.raw_conn import FRAME_ERROR, FRAME_RESPONSE, RawConn, command


def raw_http(broker: BrokerProcess, method: str, target: str, body: bytes | None,
             timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request written by hand (any target bytes), (status, body) of the answer.

    Status 0: the broker closed the connection without answering.
    """
    head = [f"{method} {target} HTTP/1.1", f"Host: {broker.http_address}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
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
    `secret`: a broker with --auth-http-address (and --http-auth-required):
    the control client AUTHs with it, and sends it as a bearer secret.
    """

    broker: BrokerProcess
    topic: str = "zz_control"
    channel: str = "zz_control_c"
    published: list[bytes] = field(default_factory=list)
    secret: bytes | None = None

    def _conn(self) -> RawConn:
        conn = RawConn(self.broker)
        if self.secret is not None:
            assert identify_auth(conn, self.secret)[0] == FRAME_RESPONSE
        return conn

    def http(self, method: str, target: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = {} if self.secret is None else {"Authorization": f"Bearer {self.secret.decode()}"}
        return raw_http(self.broker, method, target, body, headers=headers)

    def setup(self, n: int = 20) -> None:
        with self._conn() as conn:
            conn.send(command(f"SUB {self.topic} {self.channel}") + command("CLS"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
            assert conn.read_frame() == (FRAME_RESPONSE, b"CLOSE_WAIT")
        with self._conn() as conn:
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
        with self._conn() as conn:
            self.publish(conn)
        status, body = raw_http(self.broker, "GET", "/ping", None)
        assert (status, body) == (200, b"OK"), f"/ping after {what}: {status} {body[:200]!r}"
        status, body = self.http("GET", "/stats?format=json&topic=" + self.topic)
        assert status == 200, f"/stats after {what}: {status} {body[:300]!r}"
        count = queue_count(json.loads(body), self.topic, self.channel)
        assert count == len(self.published), (
            f"after {what}: control channel counts {count}, {len(self.published)} were acknowledged")
        for path in ("/stats", "/metrics"):
            status, body = self.http("GET", path)
            assert status == 200, f"{path} after {what}: {status} {body[:300]!r}"

    def drain_and_compare(self) -> None:
        """Every acknowledged control body comes out of the channel, intact, once."""
        got = drain_all(self.broker, [(self.topic, self.channel)], silence=0.5,
                        expect=len(self.published), secret=self.secret)[(self.topic, self.channel)]
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
