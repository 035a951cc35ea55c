"""Live traffic against a real broker: publisher and consumer threads, what they saw.

Snapshot tests take snapshots while this runs (tests/integration/test_snapshot_state.py,
tests/spark/test_live_snapshot.py); each picks its own topics, rates and
consumer behaviour through the parameters here, so both drive the broker
with the same, tested machinery.

Bodies are `<prefix>-<number>-<padding>`: `number(body)` decides what the
consumer does with a body, so a test can tell afterwards what happened to it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

from tests.support.broker_http import call
from tests.support.processes import BrokerProcess
from tests.support.raw_conn import FRAME_RESPONSE, RawConn, command, select_sockets
from tests.support.v2_frames import mpub_body


def number(body: bytes) -> int:
    return int(body.split(b"-")[1])


def make_body(prefix: bytes, n: int, pad: bytes, padding: int) -> bytes:
    """Unique per (prefix, n); `padding` > 1 varies the sizes (n % padding bytes of `pad`)."""
    return b"%s-%d-" % (prefix, n) + pad * (n % padding)


class Traffic:
    """Publisher and consumer threads sharing stop flags; everything they saw, under a lock.

    Publishers and consumers stop separately, so a test can stop publishing
    and let the consumer drain what is left.
    """

    def __init__(self) -> None:
        self.stop_publishing = threading.Event()
        self.stop_consuming = threading.Event()
        self.lock = threading.Lock()
        self.published: dict[str, list[bytes]] = defaultdict(list)  # topic -> acknowledged bodies
        self.deliveries: list[tuple[bytes, str, int]] = []  # (body, id, attempts), every delivery
        self.finished: dict[bytes, str] = {}  # body -> id, FIN sent
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def start(self, target: Callable[..., None], *args: object, **kwargs: object) -> threading.Thread:
        """Run `target(self, *args, **kwargs)` in a thread; what it raises goes to `errors`."""

        def run() -> None:
            try:
                target(self, *args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                with self.lock:
                    self.errors.append(f"{target.__name__}{args[1:]}{kwargs}: {e!r}")

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def count(self, topic: str) -> int:
        with self.lock:
            return len(self.published[topic])

    def join(self, threads: list[threading.Thread] | None = None) -> None:
        """Stop and wait for `threads` (publishers, say), or everything."""
        if threads is None:
            self.stop_consuming.set()
            threads = self.threads
        self.stop_publishing.set()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a traffic thread did not stop"


def http_publisher(traffic: Traffic, broker: BrokerProcess, topic: str, *, prefix: bytes = b"h",
                   batch: int = 10, padding: int = 1, pause: float = 0.0) -> None:
    """HTTP /mpub of `batch` bodies at a time, `pause` seconds apart, until publishing stops."""
    i = 0
    while not traffic.stop_publishing.is_set():
        bodies = [make_body(prefix, i + k, b"x", padding) for k in range(batch)]
        status, text = call(broker, "POST", f"/mpub?topic={topic}", b"\n".join(bodies))
        assert status == 200, text
        with traffic.lock:
            traffic.published[topic] += bodies
        i += batch
        if pause:
            time.sleep(pause)


def tcp_publisher(traffic: Traffic, broker: BrokerProcess, topic: str, *, prefix: bytes = b"s",
                  batches: Sequence[int] = (1,), padding: int = 1, pause: float = 0.0) -> None:
    """PUB (a batch of 1) or MPUB over one raw connection, batch sizes in turn from `batches`."""
    sizes = itertools.cycle(batches)
    with RawConn(broker, timeout=30) as conn:
        i = 0
        while not traffic.stop_publishing.is_set():
            bodies = [make_body(prefix, i + k, b"y", padding) for k in range(next(sizes))]
            if len(bodies) == 1:
                conn.send(command(f"PUB {topic}", bodies[0]))
            else:
                conn.send(command(f"MPUB {topic}", mpub_body(bodies)))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
            with traffic.lock:
                traffic.published[topic] += bodies
            i += len(bodies)
            if pause:
                time.sleep(pause)


class _CloseWait(Exception):
    """The broker's CLOSE_WAIT: every command sent before CLS has been processed."""


class _Subscriber(RawConn):
    """A RawConn whose frames are messages only: OKs are checked and skipped, CLOSE_WAIT raises."""

    def read_frame(self, skip_heartbeats: bool = True) -> tuple[int, bytes]:
        while True:
            kind, payload = super().read_frame(skip_heartbeats)
            if kind != FRAME_RESPONSE:
                return kind, payload
            if payload == b"CLOSE_WAIT":
                raise _CloseWait
            assert payload == b"OK", payload

    def readable(self, timeout: float) -> bool:
        """A frame (or part of one) is buffered or arrives within `timeout`."""
        return bool(self._buf) or bool(select_sockets([self.sock], [], timeout)[0])


def consumer(traffic: Traffic, broker: BrokerProcess, topic: str, channel: str, *, rdy: int,
             fin_delay: float = 0.0, req_every: int = 0, req_delay_ms: int = 100,
             keep_every: int = 0, poll: float = 0.01) -> None:
    """Consume `topic`/`channel` with RDY `rdy` until consuming stops; record every delivery.

    A body whose number is a multiple of `req_every` is REQed (`req_delay_ms`)
    on its first attempt; one whose number is a multiple of `keep_every` is
    never FINished (it stays in flight); every other one is FINished
    `fin_delay` seconds after it came. At the stop, once no FIN is pending,
    CLS: the broker answers CLOSE_WAIT after every FIN sent before it, so all
    of them are processed when this returns. Nothing is FINished after CLS.
    """
    pending: deque[tuple[float, bytes, bytes]] = deque()  # (due, id, body), in due order
    closing = False
    deadline = 0.0
    with _Subscriber(broker, timeout=30) as conn:
        conn.send(command(f"SUB {topic} {channel}") + command(f"RDY {rdy}"))
        while True:
            now = time.monotonic()
            due = []
            while pending and pending[0][0] <= now:
                due.append(pending.popleft())
            if due:
                conn.send(b"".join(command(b"FIN " + msg_id) for _, msg_id, _ in due))
                with traffic.lock:
                    traffic.finished.update((body, msg_id.decode()) for _, msg_id, body in due)
            if traffic.stop_consuming.is_set() and not closing and not pending:
                conn.send(command("CLS"))
                closing, deadline = True, now + 30
            if closing and now > deadline:
                raise AssertionError("no CLOSE_WAIT")
            if not conn.readable(poll):
                continue
            try:
                _, attempts, msg_id, body = conn.read_message()
            except _CloseWait:
                return
            with traffic.lock:
                traffic.deliveries.append((body, msg_id.decode(), attempts))
            if closing or (keep_every and number(body) % keep_every == 0):
                continue
            if req_every and attempts == 1 and number(body) % req_every == 0:
                conn.send(command(b"REQ " + msg_id + b" %d" % req_delay_ms))
            else:
                pending.append((time.monotonic() + fin_delay, msg_id, body))
