"""Snapshots of a real, busy broker (twistd mqd --durable) read back with Spark.

With --durable every message is in LMDB from its publish until its FIN
(the memory queue is bypassed, a read only moves the queue's position),
so a snapshot holds exactly the messages not yet FINished, and once
traffic has stopped each channel holds "published minus finished".

Publishers (HTTP /mpub and a raw TCP MPUB connection) and a consumer that
FINishes two messages in three run in threads while the test takes
snapshots through POST /snapshot. The snapshots are read with Spark after
traffic stops (so Spark does not compete with the broker for the cores).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable

from spark_bridge.snapshot import read_manifest
from tests.integration._support import (
    FAST_SCAN,
    FRAME_MESSAGE,
    FRAME_RESPONSE,
    MAGIC_V2,
    RawConn,
    command,
    mpub_body,
    wait_for,
)
from tests.integration.test_snapshot import call, create, queue_stats

TOPIC, SOLO = "live", "solo"
BATCH = 20


def number(body: bytes) -> int:
    return int(body.split(b"-")[1])


class Traffic:
    """Publisher and consumer threads sharing a stop flag; everything they saw, under a lock."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.published: dict[str, list[bytes]] = defaultdict(list)  # topic -> acknowledged bodies
        self.finished: dict[bytes, bytes] = {}  # body -> id, FIN sent (channel c1)
        self.delivered: dict[bytes, bytes] = {}  # body -> id, every delivery on c1
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def start(self, target: Callable[..., None], *args: object) -> None:
        def run() -> None:
            try:
                target(*args)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                with self.lock:
                    self.errors.append(f"{target.__name__}{args[1:]}: {e!r}")

        thread = threading.Thread(target=run, daemon=True)
        self.threads.append(thread)
        thread.start()

    def count(self, topic: str) -> int:
        with self.lock:
            return len(self.published[topic])

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
            assert not thread.is_alive(), "a traffic thread did not stop"


def http_publisher(traffic: Traffic, broker, tag: int) -> None:
    i = 0
    while not traffic.stop.is_set():
        bodies = [b"h%d-%d-" % (tag, i + k) + b"x" * ((i + k) % 97) for k in range(BATCH)]
        status, text = call(broker, "POST", f"/mpub?topic={TOPIC}", b"\n".join(bodies))
        assert status == 200, text
        with traffic.lock:
            traffic.published[TOPIC].extend(bodies)
        i += BATCH


def tcp_publisher(traffic: Traffic, broker) -> None:
    with RawConn(broker, timeout=30) as conn:
        i = 0
        while not traffic.stop.is_set():
            bodies = [b"s-%d-" % (i + k) + b"y" * (i % 13) for k in range(BATCH)]
            conn.send(command(f"MPUB {SOLO}", mpub_body(bodies)))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
            with traffic.lock:
                traffic.published[SOLO].extend(bodies)
            i += BATCH


def consumer(traffic: Traffic, broker, channel: str) -> None:
    """FIN every message whose number is not a multiple of 3; keep the others in flight.

    At the stop, CLS: the broker answers CLOSE_WAIT after every FIN sent
    before it, so all of them are processed when this returns.
    """
    sock = socket.create_connection((broker.tcp_host, broker.tcp_port), timeout=30)
    sock.settimeout(0.05)
    buf = b""
    closing = False

    def frames():
        nonlocal buf
        while len(buf) >= 8:
            size, kind = struct.unpack_from(">ii", buf)
            if len(buf) < 4 + size:
                return
            payload, buf = buf[8:4 + size], buf[4 + size:]
            yield kind, payload

    try:
        sock.sendall(MAGIC_V2 + command(f"SUB {TOPIC} {channel}") + command("RDY 2500"))
        deadline = None
        while True:
            if traffic.stop.is_set() and not closing:
                sock.sendall(command("CLS"))
                closing, deadline = True, time.monotonic() + 30
            if deadline is not None and time.monotonic() > deadline:
                raise AssertionError("no CLOSE_WAIT")
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise AssertionError("the broker closed the consumer's connection")
            buf += chunk
            for kind, payload in frames():
                if kind == FRAME_RESPONSE:
                    if payload == b"CLOSE_WAIT":
                        return
                    if payload == b"_heartbeat_":
                        sock.sendall(command("NOP"))
                    else:
                        assert payload == b"OK", payload
                    continue
                assert kind == FRAME_MESSAGE, (kind, payload)
                msg_id, body = payload[10:26], payload[26:]
                with traffic.lock:
                    assert traffic.delivered.setdefault(body, msg_id) == msg_id
                if number(body) % 3 and not closing:
                    sock.sendall(command(b"FIN " + msg_id))
                    with traffic.lock:
                        traffic.finished[body] = msg_id
    finally:
        sock.close()


def snapshot(broker, name: str) -> str:
    status, text = call(broker, "POST", f"/snapshot?out={name}")
    assert status == 200, text
    return json.loads(text)["path"]


def read_with_spark(spark, path: str) -> dict[str, list[tuple[str, bytes]]]:
    """{queue name: [(message id, body), ...]} of a snapshot, read through the mqd format."""
    table = (spark.read.format("mqd").option("partitions", "2").load(path)
             .select("topic", "channel", "message_id", "body").toArrow())
    out: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
    for row in table.to_pylist():
        name = row["topic"] if row["channel"] is None else f"{row['topic']}:{row['channel']}"
        out[name].append((row["message_id"], row["body"]))
    return out


def test_snapshots_of_a_busy_durable_broker(start_broker, spark):
    broker = start_broker(*FAST_SCAN, "--durable")
    create(broker, TOPIC, "c1")
    assert call(broker, "POST", f"/channel/create?topic={TOPIC}&channel=c2")[0] == 200
    assert call(broker, "POST", f"/topic/create?topic={SOLO}")[0] == 200

    traffic = Traffic()
    traffic.start(consumer, traffic, broker, "c1")
    for tag in (1, 2):
        traffic.start(http_publisher, traffic, broker, tag)
    traffic.start(tcp_publisher, traffic, broker)
    paths = []
    try:
        for i in range(4):
            # Each snapshot with more traffic behind it than the last one.
            goal = 200 * (i + 1)
            wait_for(lambda goal=goal: (traffic.count(TOPIC) >= goal and traffic.count(SOLO) >= goal // 4
                                        and len(traffic.finished) >= goal // 10) or traffic.errors,
                     timeout=30, what=f"{goal} messages published")
            assert not traffic.errors, traffic.errors
            paths.append(snapshot(broker, f"busy{i}"))
    finally:
        traffic.join()
    assert not traffic.errors, traffic.errors
    published = {topic: set(bodies) for topic, bodies in traffic.published.items()}
    assert len(published[TOPIC]) == len(traffic.published[TOPIC])  # bodies are unique
    assert len(published[SOLO]) == len(traffic.published[SOLO])
    finished = set(traffic.finished)

    # Traffic has stopped and the consumer is gone: wait for its in-flight
    # messages to be requeued, then take the final snapshot.
    want_c1 = len(published[TOPIC]) - len(finished)
    def requeued() -> bool:
        c1 = queue_stats(broker)[f"{TOPIC}:c1"]
        return (c1["client_count"], c1["in_flight_count"], c1["depth"]) == (0, 0, want_c1)

    wait_for(requeued, timeout=30, what="the consumer's in-flight messages to be requeued")
    paths.append(snapshot(broker, "final"))

    ids: dict[bytes, str] = {}  # body -> message id, the same in every queue and snapshot
    for path in paths:
        manifest = read_manifest(path)
        got = read_with_spark(spark, path)
        counts = {q.name: q.count for q in manifest.queues}
        assert {name: len(rows) for name, rows in got.items()} == {n: c for n, c in counts.items() if c}
        assert set(counts) <= {TOPIC, f"{TOPIC}:c1", f"{TOPIC}:c2", SOLO}
        for name, rows in got.items():
            topic = name.partition(":")[0]
            repeated = [i for i, n in Counter(i for i, _ in rows).items() if n > 1]
            assert not repeated, f"{path} {name}: message ids more than once: {repeated[:5]}"
            unknown = [b for _, b in rows if b not in published[topic]]
            assert not unknown, f"{path} {name}: bodies never published: {unknown[:5]}"
            for msg_id, body in rows:
                assert ids.setdefault(body, msg_id) == msg_id, (path, name, body)

    # The final cut: each channel holds what was published minus what was finished.
    final = read_with_spark(spark, paths[-1])
    bodies = {name: {b for _, b in rows} for name, rows in final.items()}
    assert bodies[f"{TOPIC}:c1"] == published[TOPIC] - finished
    assert bodies[f"{TOPIC}:c2"] == published[TOPIC]
    assert bodies[SOLO] == published[SOLO]
    assert TOPIC not in bodies  # the topic's own queue is drained into its channels
    assert finished and all(number(b) % 3 for b in finished)
    # The consumer saw the same ids as the snapshots hold.
    for body, msg_id in traffic.delivered.items():
        assert ids[body] == msg_id.decode()
