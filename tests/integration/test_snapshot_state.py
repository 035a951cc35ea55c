"""Snapshots of the real broker: a snapshot holds the whole queue state, in every mode.

Each mode (default LMDB with a small --mem-queue-size, so a backlog is
split over memory and the store; --durable; the memory backend) gets the
same scene: a channel backlog, messages in flight with a raw client that
does not FIN them, a REQ with a delay and an HTTP DPUB (deferred), and a
topic without channels. The snapshot's rows, read with the bridge's own
reader (no Spark), must be exactly that, row for row, and its counts those
of /stats at the instant; afterwards everything is consumed and compared
with what was published and with the snapshot's message ids.

A second test takes 20 snapshots while publishers and a consumer keep
running: every snapshot must add up, and the traffic must lose nothing.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from mqd.nsqd.snapshot_format import Manifest, read_manifest
from spark_bridge.records import ARROW_SCHEMA, open_snapshot, read_ranges, snapshot_ranges
from tests.support.broker_http import call, create, queue_stats
from tests.support.processes import FAST_SCAN, wait_for
from tests.support.raw_conn import FRAME_RESPONSE, RawConn, command
from tests.support.traffic import Traffic, consumer, http_publisher, number, tcp_publisher

MODES = {
    "lmdb": (),
    "durable": ("--durable",),
    "memory": ("--backend=memory",),
}
MEM = 50
BACKLOG = 200  # m000..m199 on t:c: MEM in memory, the rest in the backend
WAITING = 80  # w000..w079 at the topic `waiting`, which has no channel
HELD = 5  # what the raw client takes (RDY 5): m000 is REQed, m001..m004 stay in flight
DEFER = 3.0  # seconds: the REQ's delay and the DPUB's defer
MSG_TIMEOUT = 60.0
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def counts(broker) -> dict[str, dict[str, int]]:
    """/stats as a snapshot's manifest states it: per queue depth, in_flight_count, deferred_count."""
    out = {}
    for name, stats in queue_stats(broker).items():
        if ":" in name:
            out[name] = {k: stats[k] for k in ("depth", "in_flight_count", "deferred_count")}
        else:
            out[name] = {"depth": stats["depth"], "in_flight_count": 0, "deferred_count": 0}
    return out


def take_snapshot(broker, name: str) -> tuple[str, Manifest]:
    status, text = call(broker, "POST", f"/snapshot?out={name}")
    assert status == 200, text
    answer = json.loads(text)
    manifest = read_manifest(answer["path"])
    assert manifest.to_json() == answer["manifest"]
    return answer["path"], manifest


def snapshot_table(path: str) -> pa.Table:
    manifest, env = open_snapshot(path)
    try:
        batches = list(read_ranges(env, snapshot_ranges(manifest)))
    finally:
        env.close()
    return pa.Table.from_batches(batches, schema=ARROW_SCHEMA)


def rows_by_queue(path: str) -> dict[str, list[dict]]:
    """{queue name: rows in key order} of a snapshot."""
    out: dict[str, list[dict]] = defaultdict(list)
    for row in snapshot_table(path).to_pylist():
        out[row["topic"] if row["channel"] is None else f"{row['topic']}:{row['channel']}"].append(row)
    return dict(out)


class Consumer(RawConn):
    """A raw V2 consumer: IDENTIFY (msg_timeout), SUB, then messages read as dicts."""

    def __init__(self, broker, topic: str, channel: str) -> None:
        super().__init__(broker, timeout=10)
        identify = json.dumps({"msg_timeout": int(MSG_TIMEOUT * 1000), "heartbeat_interval": 60_000,
                               "client_id": "holder", "hostname": "holder.example", "user_agent": "raw/1.0"})
        self.send(command("IDENTIFY", identify.encode()))
        assert self.read_frame() == (FRAME_RESPONSE, b"OK")
        self.send(command(f"SUB {topic} {channel}"))
        assert self.read_frame() == (FRAME_RESPONSE, b"OK")

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def take(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            ts, attempts, msg_id, body = self.read_message()
            out.append({"id": msg_id.decode(), "body": body, "attempts": attempts, "ts": ts,
                        "at": time.time()})
        return out

    def fin(self, msg_id: str) -> None:
        self.send(command(f"FIN {msg_id}"))


def micros(row_time: datetime) -> int:
    """A row's timestamp as the wire's nanoseconds give it, in whole microseconds."""
    return (row_time - EPOCH) // timedelta(microseconds=1)


def drain(conn: Consumer, expected: int, timeout: float) -> list[dict]:
    """Read and FIN `expected` messages (RDY must be open), then make sure no more come."""
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(got) < expected:
        assert time.monotonic() < deadline, f"only {len(got)} of {expected} messages came"
        message = conn.take(1)[0]
        conn.fin(message["id"])
        got.append(message)
    conn.expect_silence(0.3)
    return got


@pytest.mark.parametrize("mode", MODES)
def test_whole_state_row_for_row(start_broker, mode):
    broker = start_broker(*FAST_SCAN, f"--mem-queue-size={MEM}", *MODES[mode])
    create(broker, "t", "c")
    assert call(broker, "POST", "/channel/create?topic=t&channel=e%23ephemeral")[0] == 200
    started = time.time()
    backlog = [b"m%03d" % i for i in range(BACKLOG)]
    assert call(broker, "POST", "/mpub?topic=t", b"\n".join(backlog))[0] == 200
    waiting = [b"w%03d" % i for i in range(WAITING)]
    assert call(broker, "POST", "/mpub?topic=waiting", b"\n".join(waiting))[0] == 200
    published = time.time()
    # A DPUB at a topic without channels waits there, queued with its due time.
    assert call(broker, "POST", f"/pub?topic=waiting&defer={int(DEFER * 1000)}", b"w-later")[0] == 200
    w_due = (published + DEFER, time.time() + DEFER)

    consumer = Consumer(broker, "t", "c")
    consumer.send(command(f"RDY {HELD}"))
    asked = time.time()
    held = consumer.take(HELD)
    assert [m["body"] for m in held] == backlog[:HELD] and all(m["attempts"] == 1 for m in held)
    consumer.send(command("RDY 0"))
    req_sent = time.time()
    consumer.send(command(f"REQ {held[0]['id']} {int(DEFER * 1000)}"))
    dpub_sent = time.time()
    status, text = call(broker, "POST", f"/pub?topic=t&defer={int(DEFER * 1000)}", b"later")
    assert status == 200, text
    dpub_done = time.time()
    wait_for(lambda: counts(broker)["t:c"] == {"depth": BACKLOG - HELD, "in_flight_count": HELD - 1,
                                               "deferred_count": 2},
             what="the REQ and the DPUB to be deferred")

    before = counts(broker)
    path, manifest = take_snapshot(broker, "scene")
    after = counts(broker)
    assert time.time() < req_sent + DEFER, "too slow: a deferred message may have come due"
    assert before == after, "traffic between the two /stats"

    # The manifest: the instant's /stats, state by state.
    assert manifest.format_version == 2 and manifest.source == "broker"
    assert manifest.backend == ("memory" if mode == "memory" else "lmdb")
    assert manifest.durable is (mode == "durable")
    queues = {q.name: q for q in manifest.queues}
    assert set(queues) == {"t", "t:c", "waiting"}
    for name, q in queues.items():
        assert q.stats == before[name], name
        assert (q.queued, q.in_flight, q.deferred) == (
            before[name]["depth"], before[name]["in_flight_count"], before[name]["deferred_count"]), name
        assert q.count == q.queued + q.in_flight + q.deferred == q.stored + q.held, name
    assert (queues["t:c"].queued, queues["t:c"].in_flight, queues["t:c"].deferred) == (
        BACKLOG - HELD, HELD - 1, 2)
    assert (queues["waiting"].queued, queues["t"].count) == (WAITING + 1, 0)
    assert manifest.left_out == [{"topic": "t", "channel": "e#ephemeral", "reason": "ephemeral",
                                  **before["t:e#ephemeral"]}]
    assert before["t:e#ephemeral"]["deferred_count"] == 1
    assert manifest.clients == [{"remote_address": consumer.address, "client_id": "holder",
                                 "hostname": "holder.example", "user_agent": "raw/1.0"}]

    # Where each message was: memory and backend in the default mode;
    # durably stored, the channel's backlog read into memory by the
    # consumer's first RDY (one backend read of up to 1024), the topic's
    # still in the store; memory only with the memory backend.
    split = {  # (stored rows, held rows)
        "lmdb": {"t:c": (BACKLOG - MEM, MEM - HELD + (HELD - 1) + 2), "waiting": (WAITING + 1 - MEM, MEM)},
        "durable": {"t:c": (0, BACKLOG + 1), "waiting": (WAITING + 1, 0)},
        "memory": {"t:c": (0, BACKLOG - HELD + (HELD - 1) + 2), "waiting": (0, WAITING + 1)},
    }[mode]
    assert {name: (queues[name].stored, queues[name].held) for name in split} == split

    rows = rows_by_queue(path)
    assert set(rows) == {"t:c", "waiting"}
    for name, queue_rows in rows.items():
        ids = Counter(r["message_id"] for r in queue_rows)
        assert max(ids.values()) == 1, f"{name}: an id twice"
        by_state = Counter(r["state"] for r in queue_rows)
        q = queues[name]
        assert by_state == Counter({"queued": q.queued, "in_flight": q.in_flight,
                                    "deferred": q.deferred}) - Counter(), name
        for r in queue_rows:
            assert r["kind"] == ("topic" if name == "waiting" else "channel")
            assert r["body_size"] == len(r["body"])
            if mode == "durable":
                assert r["sequence"] is not None, r
            elif mode == "memory":
                assert r["sequence"] is None, r

    c_rows = rows["t:c"]
    state_of = {r["body"]: r["state"] for r in c_rows}
    assert state_of == {**dict.fromkeys(backlog[HELD:], "queued"), backlog[0]: "deferred",
                        **dict.fromkeys(backlog[1:HELD], "in_flight"), b"later": "deferred"}
    queued = [r for r in c_rows if r["state"] == "queued"]
    if mode == "lmdb":
        # Memory's part (held, no store record) in delivery order, then the store's.
        assert [r["body"] for r in queued if r["sequence"] is None] == backlog[HELD:MEM]
        stored = [r for r in queued if r["sequence"] is not None]
        assert [r["body"] for r in sorted(stored, key=lambda r: r["sequence"])] == backlog[MEM:]
    else:
        assert sorted(r["body"] for r in queued) == backlog[HELD:]
    for r in queued:
        assert (r["attempts"], r["deferred_until"], r["in_flight_client"], r["timeout_at"]) == (
            0, None, None, None), r
        assert started - 1 <= r["timestamp"].timestamp() <= published + 1
    delivered = {m["body"]: m for m in held}
    for r in (r for r in c_rows if r["state"] == "in_flight"):
        m = delivered[r["body"]]
        assert r["message_id"] == m["id"] and r["attempts"] == 1
        assert r["in_flight_client"] == consumer.address
        assert asked + MSG_TIMEOUT - 1 <= r["timeout_at"].timestamp() <= m["at"] + MSG_TIMEOUT + 1
        assert r["deferred_until"] is None
    deferred = {r["body"]: r for r in c_rows if r["state"] == "deferred"}
    req, dpub = deferred[backlog[0]], deferred[b"later"]
    assert (req["message_id"], req["attempts"], dpub["attempts"]) == (held[0]["id"], 1, 0)
    assert req_sent + DEFER - 0.5 <= req["deferred_until"].timestamp() <= req_sent + DEFER + 1
    assert dpub_sent + DEFER - 0.5 <= dpub["deferred_until"].timestamp() <= dpub_done + DEFER + 0.5
    for r in deferred.values():
        assert r["in_flight_client"] is None and r["timeout_at"] is None

    w_rows = rows["waiting"]
    assert {r["state"] for r in w_rows} == {"queued"}
    if mode == "lmdb":
        assert [r["body"] for r in w_rows if r["sequence"] is None] == waiting[:MEM]
        assert sorted(r["body"] for r in w_rows if r["sequence"] is not None) == sorted([*waiting[MEM:], b"w-later"])
    else:
        assert sorted(r["body"] for r in w_rows) == sorted([*waiting, b"w-later"])
    for r in w_rows:
        assert (r["attempts"], r["in_flight_client"], r["timeout_at"]) == (0, None, None), r
        if r["body"] == b"w-later":
            assert w_due[0] - 0.5 <= r["deferred_until"].timestamp() <= w_due[1] + 0.5
        else:
            assert r["deferred_until"] is None

    # The live broker lost and duplicated nothing: consume everything and
    # compare with the snapshot's ids.
    snap_ids = {r["body"]: (r["message_id"], micros(r["timestamp"])) for r in c_rows}
    for m in held[1:]:
        consumer.fin(m["id"])
    consumer.send(command(f"RDY {BACKLOG}"))
    rest = drain(consumer, BACKLOG - HELD + 2, timeout=DEFER + 10)
    got = {m["body"]: m for m in held[1:]}
    for m in rest:
        assert m["body"] not in got, f"{m['body']!r} delivered twice"
        got[m["body"]] = m
    assert set(got) == {*backlog, b"later"}
    assert {b: (m["id"], m["ts"] // 1000) for b, m in got.items()} == snap_ids
    assert got[backlog[0]]["attempts"] == 2
    assert got[backlog[0]]["at"] >= req_sent + DEFER - 0.1
    assert got[b"later"]["at"] >= dpub_sent + DEFER - 0.1
    with Consumer(broker, "waiting", "c") as reader:
        reader.send(command(f"RDY {WAITING}"))
        w_got = drain(reader, WAITING + 1, timeout=DEFER + 10)
    assert sorted(m["body"] for m in w_got) == sorted([*waiting, b"w-later"])
    assert {m["body"]: (m["id"], m["ts"] // 1000) for m in w_got} == {
        r["body"]: (r["message_id"], micros(r["timestamp"])) for r in w_rows}
    consumer.close()
    final = counts(broker)
    for name in ("t", "t:c", "waiting", "waiting:c"):
        assert final[name] == {"depth": 0, "in_flight_count": 0, "deferred_count": 0}, name


# -- snapshots of a busy broker -------------------------------------------------------------

TOPIC = "busy"
REQ_EVERY = 5  # the consumer REQs (100 ms) every fifth body on its first delivery
HOLD = 0.05  # and FINs the others this long after receiving them, so some are in flight


def check_snapshot(path: str, manifest: Manifest, ids: dict[bytes, str]) -> dict[str, int]:
    """Every queue of the snapshot adds up; its rows say the same. Returns t:c's state counts."""
    for q in manifest.queues:
        assert q.stats is not None, q.name
        assert q.queued + q.in_flight + q.deferred == (
            q.stats["depth"] + q.stats["in_flight_count"] + q.stats["deferred_count"]), (path, q)
        assert (q.queued, q.in_flight, q.deferred) == (
            q.stats["depth"], q.stats["in_flight_count"], q.stats["deferred_count"]), (path, q)
        assert q.count == q.queued + q.in_flight + q.deferred == q.stored + q.held, (path, q)
    table = snapshot_table(path)
    got: dict[tuple[str, str | None, str], int] = {}
    for r in table.group_by(["topic", "channel", "state"]).aggregate([("message_id", "count")]).to_pylist():
        got[(r["topic"], r["channel"], r["state"])] = r["message_id_count"]
    want = {}
    for q in manifest.queues:
        for state in ("queued", "in_flight", "deferred"):
            if getattr(q, state):
                want[(q.topic, q.channel, state)] = getattr(q, state)
    assert got == want, path
    for r in table.group_by(["topic", "channel"]).aggregate(
            [("message_id", "count"), ("message_id", "count_distinct")]).to_pylist():
        assert r["message_id_count"] == r["message_id_count_distinct"], (path, r)
    # A body keeps its id in every queue and every snapshot.
    for body, msg_id in zip(table.column("body").to_pylist(), table.column("message_id").to_pylist(),
                            strict=True):
        assert ids.setdefault(body, msg_id) == msg_id, (path, body)
    c = manifest.queue(f"{TOPIC}:c")
    return {"in_flight": c.in_flight, "deferred": c.deferred} if c else {"in_flight": 0, "deferred": 0}


@pytest.mark.parametrize("mode", ["lmdb", "durable"])
def test_twenty_snapshots_under_traffic(start_broker, mode):
    broker = start_broker(*FAST_SCAN, f"--mem-queue-size={MEM}", *MODES[mode])
    create(broker, TOPIC, "c")
    create(broker, TOPIC, "idle")  # nobody reads it: a growing backlog over memory and the store
    traffic = Traffic()
    traffic.start(consumer, broker, TOPIC, "c", rdy=100, fin_delay=HOLD, req_every=REQ_EVERY,
                  req_delay_ms=100)
    publishers = [traffic.start(http_publisher, broker, TOPIC, batch=10, pause=0.02),
                  traffic.start(tcp_publisher, broker, TOPIC, batches=(1, 1, 1, 2), pause=0.004)]
    ids: dict[bytes, str] = {}
    states = []
    try:
        wait_for(lambda: traffic.count(TOPIC) >= 200 or traffic.errors, timeout=10,
                 what="traffic to start")
        for i in range(20):
            assert not traffic.errors, traffic.errors
            path, manifest = take_snapshot(broker, f"busy{i}")
            states.append(check_snapshot(path, manifest, ids))
            time.sleep(0.1)
        traffic.join(publishers)
        total = traffic.count(TOPIC)
        reqs = sum(1 for b in traffic.published[TOPIC] if number(b) % REQ_EVERY == 0)
        wait_for(lambda: (len(traffic.deliveries) >= total + reqs
                          and counts(broker)[f"{TOPIC}:c"] == {"depth": 0, "in_flight_count": 0,
                                                               "deferred_count": 0})
                 or traffic.errors, timeout=20, what="the consumer to drain the channel")
    finally:
        traffic.join()
    assert not traffic.errors, traffic.errors
    published = traffic.published[TOPIC]
    assert len(set(published)) == len(published)
    # Snapshots saw the consumer at work (messages in flight and deferred).
    assert sum(s["in_flight"] for s in states) > 0 and sum(s["deferred"] for s in states) > 0, states
    # Every body delivered: once, or twice when REQed (once per attempt).
    per_body = Counter(body for body, _, _ in traffic.deliveries)
    assert set(per_body) == set(published)
    wrong = {b: n for b, n in per_body.items() if n != (2 if number(b) % REQ_EVERY == 0 else 1)}
    assert not wrong, list(wrong.items())[:10]
    for body, msg_id, attempts in traffic.deliveries:
        assert ids.get(body, msg_id) == msg_id, body
        assert attempts <= 2
    # The idle channel holds everything, and a last snapshot says so.
    final = counts(broker)
    assert final[f"{TOPIC}:idle"] == {"depth": len(published), "in_flight_count": 0, "deferred_count": 0}
    path, manifest = take_snapshot(broker, "final")
    check_snapshot(path, manifest, ids)
    idle = snapshot_table(path).filter(pa.compute.equal(pa.compute.field("channel"), "idle"))
    bodies = idle.column("body").to_pylist()
    assert len(bodies) == len(published) and set(bodies) == set(published)
