"""What the LMDB store keeps across a crash, a clean stop and a restart, on the real process.

The crash test is the acceptance test of `--durable`: publishers record
exactly which bodies the broker acknowledged, a consumer records which of
its FINs a durable OK has covered, the broker is SIGKILLed mid-load, and
the restarted broker must give back every acknowledged body and none of
the finished ones.
"""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import lmdb
import pytest

from backends.lmdb import ENV_DIR, KEY, RECORD
from tests.integration._support import (
    FAST_SCAN,
    FRAME_ERROR,
    FRAME_MESSAGE,
    FRAME_RESPONSE,
    RawConn,
    child_env,
    command,
    mpub_body,
    twistd_command,
)

_HEX_ID = re.compile(rb"[0-9a-f]{16}")


# -- bodies that say what they should contain -------------------------------------


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


def _some(bodies, n: int = 3) -> str:
    """A few bodies, shortened, for an assertion message."""
    return ", ".join(repr(b[:24]) for b in sorted(bodies)[:n]) or "none"


# -- raw clients ------------------------------------------------------------------------


@dataclass
class Delivery:
    id: bytes
    attempts: int
    body: bytes
    at: float


def parse_message(payload: bytes, at: float) -> Delivery:
    attempts = int.from_bytes(payload[8:10], "big")
    return Delivery(bytes(payload[10:26]), attempts, bytes(payload[26:]), at)


def drain(broker, topic: str, channel: str, *, silence: float = 1.5, expect: int | None = None,
          timeout: float = 60.0) -> list[Delivery]:
    """Subscribe, FIN everything, stop after `silence` seconds without a message.

    With `expect`, stop as soon as that many arrived (and a short silence after
    them), so a test that knows the count does not wait the full silence.
    """
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    with RawConn(broker, timeout=10) as conn:
        conn.send(command(f"SUB {topic} {channel}") + command("RDY 2500"))
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


# -- 1. the crash -----------------------------------------------------------------------


@pytest.mark.parametrize("restart_as", ["non-durable", "durable"])
def test_sigkill_mid_load_loses_no_acknowledged_publish_and_no_durable_fin(start_broker, name,
                                                                           restart_as):
    broker = start_broker("--durable", "--msg-timeout=1s", *FAST_SCAN)
    consumed, lonely, markers = name("consumed"), name("lonely"), name("markers")
    # `consumed` has two channels: c1 is consumed during the load, c2 only
    # after the restart, so it must hold a copy of every acknowledged body.
    # `lonely` has no channel: its messages wait at the topic.
    # Both channels exist before any publisher starts: a channel created
    # later only gets what is published after it (NSQ A4).
    for channel in ("c1", "c2"):
        with RawConn(broker) as setup:
            setup.send(command(f"SUB {consumed} {channel}"))
            assert setup.read_frame() == (FRAME_RESPONSE, b"OK")
    consumer = Consumer(broker, consumed, "c1", markers)
    consumer.start()
    publishers = [Publisher(broker, i, [consumed, lonely], window)
                  for i, window in enumerate((1, 2, 4, 8, 16))]
    for p in publishers:
        p.start()

    started = time.monotonic()
    while time.monotonic() - started < 2.0:
        time.sleep(0.05)
        assert consumer.is_alive() and all(p.is_alive() for p in publishers), broker.describe()
    broker.crash()
    for thread in (*publishers, consumer):
        thread.join(30)
        assert not thread.is_alive(), f"{thread.name} still running after the crash"
    # They all were cut off by the crash, mid-load, not by an error.
    for thread in (*publishers, consumer):
        assert isinstance(thread.ended_by, OSError), (thread.name, thread.ended_by)
        assert not thread.errors, (thread.name, thread.errors[:3])

    acked = {b: t for p in publishers for b, t in p.acked.items()}
    sent = {b: t for p in publishers for b, t in p.sent.items()}
    finished = consumer.finished
    assert len(acked) > 200, f"only {len(acked)} publishes acknowledged in 2s of load"
    assert finished, "no FIN was confirmed durable during the load"

    # Either way the data written in durable mode is read as it is.
    broker.reconfigure(*FAST_SCAN, *(["--durable=true"] if restart_as == "durable" else []))
    broker.start()
    out = drain_all(broker, [(consumed, "c1"), (consumed, "c2"), (lonely, "d"), (markers, "d")])
    broker.stop_cleanly()

    for (topic, channel), deliveries in out.items():
        bodies = Counter(d.body for d in deliveries)
        dups = [b for b, n in bodies.items() if n > 1]
        assert not dups, f"{topic}/{channel}: {len(dups)} bodies delivered twice: {_some(dups)}"
        for d in deliveries:
            assert _HEX_ID.fullmatch(d.id), d.id
            assert d.attempts >= 1, d
            tag = check_body(d.body)
            if topic == markers:
                assert tag == b"m" and d.body in consumer.markers_sent
            else:
                assert sent.get(d.body) == topic, f"{topic}/{channel}: unexpected body {d.body[:40]!r}"

    def got(topic, channel):
        return {d.body for d in out[(topic, channel)]}

    def acked_to(topic):
        return {b for b, t in acked.items() if t == topic}

    c1, c2, at_topic = got(consumed, "c1"), got(consumed, "c2"), got(lonely, "d")
    missing = {
        "c2": acked_to(consumed) - c2,
        # A FIN sent but not confirmed may or may not have been committed.
        "c1": acked_to(consumed) - set(consumer.fin_sent.values()) - c1,
        "lonely": acked_to(lonely) - at_topic,
        "markers": set(consumer.markers_acked) - got(markers, "d"),
    }
    for where, lost in missing.items():
        assert not lost, f"{len(lost)} acknowledged bodies lost in {where}: {_some(lost)}"
    back = set(finished.values()) & c1
    assert not back, f"{len(back)} FINished (durably) messages came back: {_some(back)}"
    back_ids = set(finished) & {d.id for d in out[(consumed, "c1")]}
    assert not back_ids, back_ids

    extras = (c2 | at_topic) - set(acked)
    print(f"\ncrash (restarted {restart_as}): {sum(p.commands for p in publishers)} commands, {len(sent)} bodies sent, "
          f"{len(acked)} acknowledged, {len(extras)} unacknowledged ones came back; "
          f"consumer: {len(consumer.received)} received, {consumer.redelivered} redelivered, "
          f"{consumer.requeued} REQ, {len(finished)} finished for sure, "
          f"{consumer.fin_failures} FIN failures, {len(consumer.markers_acked)} markers acked; "
          f"after restart c1={len(c1)} c2={len(c2)} topic={len(at_topic)}")


# -- 2. the clean stop ---------------------------------------------------------------------


def _stored_records(data_dir, queue: str) -> list[tuple[int, int, float, bytes, bytes]]:
    """(seq, attempts, deferred_until, id, body) of one queue, read from a stopped broker's store."""
    env = lmdb.open(str(data_dir / ENV_DIR), max_dbs=8, readonly=True, lock=False)
    try:
        registry, messages = env.open_db(b"queues"), env.open_db(b"messages")
        with env.begin() as txn:
            qid = txn.get(queue.encode(), db=registry)
            assert qid is not None, f"no queue {queue!r} in the store"
            prefix = bytes(qid)
            out = []
            cursor = txn.cursor(db=messages)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    _ts, attempts, deferred_until, msg_id = RECORD.unpack_from(value)
                    out.append((KEY.unpack(key)[1], attempts, deferred_until, msg_id,
                                bytes(value[RECORD.size:])))
            return out
    finally:
        env.close()


def test_clean_stop_keeps_queued_in_flight_and_deferred_messages(start_broker, name):
    broker = start_broker("--mem-queue-size=100", *FAST_SCAN)
    topic = name()
    bodies = [make_body(b"q", i) for i in range(500)]
    delayed = [make_body(b"d", i) for i in range(2)]

    consumer = RawConn(broker, timeout=10)
    consumer.send(command(f"SUB {topic} c"))
    assert consumer.read_frame() == (FRAME_RESPONSE, b"OK")
    with RawConn(broker) as producer:
        # 100 stay in memory, 400 go to LMDB.
        for i in range(0, 500, 50):
            producer.send(command(f"MPUB {topic}", mpub_body(bodies[i:i + 50])))
            assert producer.read_frame() == (FRAME_RESPONSE, b"OK")
        consumer.send(command("RDY 10"))
        taken = [parse_message(consumer.read_frame()[1], time.monotonic()) for _ in range(10)]
        assert [m.body for m in taken] == bodies[:10] and {m.attempts for m in taken} == {1}
        consumer.send(command("RDY 0") + b"REQ " + taken[0].id + b" 60000\n")
        req_at = time.time()
        published = time.monotonic()
        for body in delayed:
            producer.send(command(f"DPUB {topic} 4000", body))
            assert producer.read_frame() == (FRAME_RESPONSE, b"OK")
    consumer.expect_silence(0.1)  # nothing more: RDY 0, the rest deferred

    # Stop (the consumer still connected, 9 in flight) about a second after the DPUBs.
    time.sleep(max(0.0, published + 1.0 - time.monotonic()))
    broker.stop_cleanly()
    consumer.close()
    broker.start()
    restarted = time.monotonic()

    # The 499 come at once, the DPUBs some seconds later: wait for all 501.
    got = drain(broker, topic, "c", silence=6.0, expect=499 + 2, timeout=30)
    by_body = Counter(m.body for m in got)
    assert all(n == 1 for n in by_body.values()), _some(b for b, n in by_body.items() if n > 1)
    expected = set(bodies[1:]) | set(delayed)
    assert set(by_body) == expected, (
        f"missing {_some(expected - set(by_body))}, unexpected {_some(set(by_body) - expected)}")
    for m in got:
        check_body(m.body)
        assert _HEX_ID.fullmatch(m.id)
    in_flight_at_stop = {m.body for m in taken[1:]}
    for m in got:
        if m.body in in_flight_at_stop:
            assert m.attempts == 2, m  # delivered once before the stop, again now
        else:
            assert m.attempts == 1, m
    ids_before = {m.body: m.id for m in taken}
    assert all(ids_before[m.body] == m.id for m in got if m.body in ids_before)

    # The DPUBs stayed deferred across the restart: due 4s after they were
    # published, not delivered as soon as the broker was back.
    for m in got:
        if m.body in delayed:
            assert m.at - published >= 3.8, (
                f"DPUB delivered {m.at - published:.2f}s after publishing "
                f"({m.at - restarted:.2f}s after the restart)")
    # The REQ'd one (60s) did not come back during the drain; it is still
    # deferred, and stored so once more after this clean stop.
    broker.stop_cleanly()
    stored = _stored_records(broker.data_dir, f"{topic}:c")
    assert [(r[3], r[4]) for r in stored] == [(taken[0].id, bodies[0])], stored
    _seq, attempts, deferred_until, _id, _body = stored[0]
    assert attempts == 1
    assert req_at + 59 < deferred_until < req_at + 61, deferred_until - req_at


# -- 3. memory or lmdb, by flag or YAML -------------------------------------------------------


@pytest.mark.parametrize("how", ["flag-memory", "flag-lmdb", "yaml-lmdb", "default"])
def test_backend_choice_decides_what_survives_a_restart(start_broker, tmp_path, name, how):
    args: list[str] = list(FAST_SCAN)
    if how.startswith("flag-"):
        args.append(f"--backend={how[5:]}")
    elif how == "yaml-lmdb":
        config = tmp_path / "mqd.yaml"
        config.write_text("backend: lmdb\nsync-every: 10\nsync-timeout: 2s\n")
        args.append(f"--config={config}")
    broker = start_broker(*args)
    kept = how != "flag-memory"
    topic, lonely = name(), name()
    bodies = [make_body(b"s", i) for i in range(300)]
    with RawConn(broker) as setup:
        setup.send(command(f"SUB {topic} c"))
        assert setup.read_frame() == (FRAME_RESPONSE, b"OK")
    with RawConn(broker) as producer:
        for t in (topic, lonely):  # one queued at a channel, one at a topic
            producer.send(command(f"MPUB {t}", mpub_body(bodies[:200])))
            producer.send(command(f"PUB {t}", bodies[200]))
            assert producer.read_frame() == (FRAME_RESPONSE, b"OK")
            assert producer.read_frame() == (FRAME_RESPONSE, b"OK")
    broker.restart()
    assert (broker.data_dir / ENV_DIR / "data.mdb").exists() == kept

    out = drain_all(broker, [(topic, "c"), (lonely, "c")], silence=1.0,
                    expect=201 if kept else None)
    for queue, got in out.items():
        if kept:
            assert [m.body for m in got] == bodies[:201], queue
            assert {m.attempts for m in got} == {1}
        else:
            assert got == [], queue
    # Topics and channels come back either way (nsqd.dat).
    broker.stop_cleanly()
    assert broker.channels_in_metadata() == {topic: ["c"], lonely: ["c"]}


# -- 4. a data directory that is not ours -------------------------------------------------------


def _garbage(env_dir):
    env_dir.mkdir(parents=True)
    (env_dir / "data.mdb").write_bytes(random.Random(7).randbytes(3 * 4096 + 123))


def _foreign(env_dir):
    env_dir.mkdir(parents=True)
    env = lmdb.open(str(env_dir), max_dbs=4)
    with env.begin(write=True, db=env.open_db(b"somebody-elses")) as txn:
        txn.put(b"key", b"value")
    env.close()


@pytest.mark.parametrize("make, words", [
    (_garbage, ["not a usable LMDB environment"]),
    (_foreign, ["not mqd's", "somebody-elses"]),
])
def test_data_dir_that_is_not_mqds_stops_start_up(tmp_path, make, words):
    data = tmp_path / "data"
    env_dir = data / ENV_DIR
    make(env_dir)
    before = (env_dir / "data.mdb").read_bytes()
    proc = subprocess.run(
        twistd_command("--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                       f"--data-path={data}"),
        env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    # twistd -n logs what the broker printed on stderr as `[stderr#error] mqd: ...`.
    errors = [line for line in output.splitlines() if "mqd:" in line]
    assert len(errors) == 1, output
    assert str(env_dir) in errors[0], errors[0]
    for word in words:
        assert word in errors[0], errors[0]
    assert "Traceback" not in output and "listening on" not in output, output
    assert (env_dir / "data.mdb").read_bytes() == before
    assert not (data / "nsqd.dat").exists()
