"""Load on a real broker whose every acknowledged body and durable FIN is accounted for.

Bodies say what they should contain (`make_body`, `check_body`), so damage
shows. `Publisher` records exactly which bodies the broker acknowledged,
`Consumer` which of its FINs a durable OK has covered; `drain` takes what
a (restarted) broker gives back. The crash tests of the durable store and
the kill -9 loop build on them.
"""

from __future__ import annotations

import hashlib
import random
import re
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tests.support.authd import identify_auth
from tests.support.raw_conn import FRAME_ERROR, FRAME_MESSAGE, FRAME_RESPONSE, RawConn, command
from tests.support.v2_frames import mpub_body


def make_body(tag: bytes, seq: int) -> bytes:
    """`<tag>-<seq>-<len>-<filler>`: the filler is derived from the rest, so any damage shows."""
    size = (seq * 7919) % 211
    head = b"%s-%08d-%03d-" % (tag, seq, size)
    return head + _filler(head, size)


def _filler(head: bytes, size: int) -> bytes:
    out = b""
    block = head
    while len(out) < size:
        block = hashlib.sha256(block).hexdigest().encode()
        out += block
    return out[:size]


_BODY = re.compile(rb"([a-z0-9]+)-(\d{8})-(\d{3})-([0-9a-f]*)\Z")


def check_body(body: bytes) -> bytes:
    """The body's tag, after checking the body is exactly what make_body made."""
    m = _BODY.match(body)
    assert m is not None, f"corrupted body {body[:80]!r}"
    tag, seq = m.group(1), int(m.group(2))
    assert body == make_body(tag, seq), f"corrupted body {body[:80]!r}"
    return tag


@dataclass
class Delivery:
    id: bytes
    attempts: int
    body: bytes
    at: float


def parse_message(payload: bytes, at: float) -> Delivery:
    attempts = int.from_bytes(payload[8:10], "big")
    return Delivery(bytes(payload[10:26]), attempts, bytes(payload[26:]), at)


# Messages a drain lets the broker send ahead of its FINs.
DRAIN_RDY = 200


def drain(broker, topic: str, channel: str, *, silence: float = 1.5, expect: int | None = None,
          timeout: float = 60.0, secret: bytes | None = None) -> list[Delivery]:
    """Subscribe, FIN everything, stop after `silence` seconds without a message.

    With `expect`, stop as soon as that many arrived (and a short silence after
    them), so a test that knows the count does not wait the full silence.
    RDY stays at DRAIN_RDY: the tests run brokers with a 1 s msg-timeout, and
    on a busy machine a drain thread that had thousands of messages waiting
    in its socket could FIN one after it timed out and came back.
    `secret`: AUTH with it first (a broker with --auth-http-address).
    """
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    with RawConn(broker, timeout=10) as conn:
        if secret is not None:
            assert identify_auth(conn, secret)[0] == FRAME_RESPONSE
        conn.send(command(f"SUB {topic} {channel}") + command(f"RDY {DRAIN_RDY}"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        wait = silence
        while time.monotonic() < deadline:
            conn.sock.settimeout(wait)
            try:
                frame_type, payload = conn.read_frame()
            except TimeoutError:
                break
            assert frame_type == FRAME_MESSAGE, (frame_type, payload)
            msg = parse_message(payload, time.monotonic())
            got.append(msg)
            conn.send(b"FIN " + msg.id + b"\n")
            if expect is not None and len(got) >= expect:
                wait = min(silence, 0.3)
        else:
            raise AssertionError(f"{topic}/{channel} still delivering after {timeout}s")
    return got


def drain_all(broker, queues: list[tuple[str, str]], **kwargs) -> dict[tuple[str, str], list[Delivery]]:
    with ThreadPoolExecutor(len(queues)) as pool:
        futures = {q: pool.submit(drain, broker, *q, **kwargs) for q in queues}
        return {q: f.result() for q, f in futures.items()}


class Publisher(threading.Thread):
    """PUB and MPUB unique bodies with up to `window` commands outstanding.

    Responses come back in command order, so each OK acknowledges the
    oldest outstanding command: `acked` is exactly what the broker confirmed.
    """

    def __init__(self, broker, index: int, topics: list[str], window: int) -> None:
        super().__init__(daemon=True, name=f"publisher-{index}")
        self.conn = RawConn(broker, timeout=30)
        self.tag = b"p%d" % index
        self.topics = topics
        self.window = window
        self.rng = random.Random(index)
        self.sent: dict[bytes, str] = {}
        self.acked: dict[bytes, str] = {}
        self.errors: list[bytes] = []
        self.ended_by: BaseException | None = None
        self.commands = 0
        self._seq = 0

    def _next_command(self) -> tuple[bytes, list[bytes], str]:
        topic = self.rng.choice(self.topics)
        n = self.rng.choice((1, 1, 1, 2, 5, 17, 40)) if self.rng.random() < 0.4 else 0
        bodies = [make_body(self.tag, self._seq + i) for i in range(max(n, 1))]
        self._seq += len(bodies)
        if n:  # MPUB, even of one message
            return command(f"MPUB {topic}", mpub_body(bodies)), bodies, topic
        return command(f"PUB {topic}", bodies[0]), bodies, topic

    def run(self) -> None:
        outstanding: deque[tuple[list[bytes], str]] = deque()
        try:
            while True:
                out = []
                while len(outstanding) < self.window:
                    data, bodies, topic = self._next_command()
                    for body in bodies:
                        self.sent[body] = topic
                    outstanding.append((bodies, topic))
                    out.append(data)
                self.commands += len(out)
                self.conn.send(b"".join(out))
                frame_type, payload = self.conn.read_frame()
                bodies, topic = outstanding.popleft()
                if (frame_type, payload) == (FRAME_RESPONSE, b"OK"):
                    for body in bodies:
                        self.acked[body] = topic
                else:
                    self.errors.append(payload)
        except Exception as e:  # noqa: BLE001 - the test checks what ended it
            self.ended_by = e
        finally:
            self.conn.close()


class Consumer(threading.Thread):
    """Takes messages from one channel, FINs some, and learns which FINs are durable.

    After some FINs it publishes a marker on the same connection: commands
    run in order and a durable OK is sent only once the commit holding
    everything before it is synced, so the marker's OK makes the FINs sent
    before it "finished for sure" (those that got no E_FIN_FAILED).
    """

    def __init__(self, broker, topic: str, channel: str, marker_topic: str) -> None:
        super().__init__(daemon=True, name="consumer")
        self.conn = RawConn(broker, timeout=30)
        self.topic, self.channel, self.marker_topic = topic, channel, marker_topic
        self.received: dict[bytes, bytes] = {}  # id -> body
        self.finished: dict[bytes, bytes] = {}  # confirmed by a marker's OK
        self.fin_sent: dict[bytes, bytes] = {}  # every FIN sent, confirmed or not
        self.markers_sent: list[bytes] = []
        self.markers_acked: list[bytes] = []
        self.fin_failures = 0
        self.requeued = 0
        self.redelivered = 0
        self.ended_by: BaseException | None = None
        self.errors: list[bytes] = []

    def run(self) -> None:
        conn = self.conn
        pending: dict[bytes, bytes] = {}  # FINs sent, no marker after them yet
        waiting: deque[tuple[bytes, dict[bytes, bytes]]] = deque()  # (marker, its FINs)
        last_marker = time.monotonic()
        try:
            conn.send(command(f"SUB {self.topic} {self.channel}") + command("RDY 200"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
            conn.sock.settimeout(0.05)
            while True:
                try:
                    frame_type, payload = conn.read_frame()
                except TimeoutError:
                    frame_type = None
                if frame_type == FRAME_MESSAGE:
                    self._on_message(parse_message(payload, time.monotonic()), pending)
                elif frame_type == FRAME_RESPONSE:
                    assert payload == b"OK", payload
                    marker, fins = waiting.popleft()
                    self.markers_acked.append(marker)
                    self.finished.update(fins)
                elif frame_type == FRAME_ERROR:
                    self._on_error(payload, pending, waiting)
                now = time.monotonic()
                if pending and len(waiting) < 2 and (len(pending) >= 25 or now - last_marker > 0.05):
                    marker = make_body(b"m", len(self.markers_sent))
                    self.markers_sent.append(marker)
                    conn.send(command(f"PUB {self.marker_topic}", marker))
                    waiting.append((marker, pending))
                    pending = {}
                    last_marker = now
        except Exception as e:  # noqa: BLE001 - the test checks what ended it
            self.ended_by = e
        finally:
            conn.close()

    def _on_message(self, msg: Delivery, pending: dict[bytes, bytes]) -> None:
        if msg.id in self.received:
            self.redelivered += 1
            assert self.received[msg.id] == msg.body
        self.received[msg.id] = msg.body
        seq = int(msg.body.split(b"-")[1])
        kind = seq % 4
        if kind < 2 or msg.attempts > 1:
            self.conn.send(b"FIN " + msg.id + b"\n")
            pending[msg.id] = msg.body
            self.fin_sent[msg.id] = msg.body
        elif kind == 2:
            self.requeued += 1
            self.conn.send(b"REQ " + msg.id + b" 0\n")
        # kind 3, first delivery: left in flight until msg-timeout requeues it.

    def _on_error(self, payload: bytes, pending, waiting) -> None:
        # `E_FIN_FAILED FIN <id> failed ID not in flight` (it timed out first):
        # that FIN did nothing; forget it from the oldest batch that has it.
        if not payload.startswith(b"E_FIN_FAILED"):
            if not payload.startswith(b"E_REQ_FAILED"):
                self.errors.append(payload)
            return
        self.fin_failures += 1
        msg_id = payload.split(b" ")[2]
        for _, fins in waiting:
            if fins.pop(msg_id, None) is not None:
                return
        pending.pop(msg_id, None)
