"""A broker's whole queue state in a snapshot, in-process on a task.Clock.

Each backend gets the same scene: a channel backlog split over memory and
the backend, messages in flight with a client, requeued with a delay and
DPUBbed (deferred), messages waiting at a topic without channels, and an
ephemeral channel (left out). The snapshot's rows, read with the bridge's
own reader, must be exactly that, state by state, and the manifest's
counts those of /stats; the live broker must be unchanged afterwards.
The copy runs synchronously (deferToThread replaced), as in test_snapshot.
"""

from __future__ import annotations

import pytest

from mqd.nsqd.snapshot_format import HELD_BIT, read_manifest
from spark_bridge.records import open_snapshot, read_ranges, snapshot_ranges
from tests.support.http_client import HTTPClient, error, parse_response
from tests.support.inprocess_broker import new_broker, scan
from tests.support.v2_client import Client
from tests.support.v2_frames import Msg, cmd, dpub, identify, ok

MODES = {
    "memory": {"backend": "memory"},
    "lmdb": {"backend": "lmdb"},
    "durable": {"backend": "lmdb", "durable": True},
}




def rows_of(path) -> list[dict]:
    manifest, env = open_snapshot(path)
    try:
        return [row for batch in read_ranges(env, snapshot_ranges(manifest)) for row in batch.to_pylist()]
    finally:
        env.close()


def stats_of(http) -> dict[str, dict]:
    out = {}
    for topic in http.get("/stats?format=json").json()["topics"]:
        out[topic["topic_name"]] = {"depth": topic["depth"], "in_flight_count": 0, "deferred_count": 0}
        for c in topic["channels"]:
            out[f"{topic['topic_name']}:{c['channel_name']}"] = {
                k: c[k] for k in ("depth", "in_flight_count", "deferred_count")}
    return out


class Scene:
    """The scene every mode is snapshotted in; remembers what it did."""

    def __init__(self, broker, clock) -> None:
        self.broker, self.clock = broker, clock
        self.http = HTTPClient(broker)
        http = self.http
        assert http.post("/topic/create?topic=t").status == 200
        assert http.post("/channel/create?topic=t&channel=c").status == 200
        assert http.post("/channel/create?topic=t&channel=e%23ephemeral").status == 200
        self.publish("/mpub?topic=t", b"\n".join(b"m%d" % i for i in range(12)))
        self.publish("/pub?topic=waiting", b"w0")
        self.publish("/pub?topic=waiting", b"w1")
        self.consumer = Client(broker, port=4242)
        assert self.consumer.request(identify(msg_timeout=30_000, heartbeat_interval=60_000)) == [ok()]
        self.consumer.sub("t", "c", 3)
        got = self.consumer.messages()
        assert [m.body for m in got] == [b"m0", b"m1", b"m2"]
        # m0 comes back in 10 s; RDY 1 more fetches m3.
        self.consumer.req(got[0], 10_000)
        self.delivered = got[1:] + self.consumer.messages()
        self.consumer.send(cmd("RDY", 0))
        producer = Client(broker, port=4343)
        producer.send(dpub("t", 60_000, b"later"))
        clock.advance(0)  # a durable store answers once committed
        assert producer.read() == [ok()]

    def publish(self, path: str, body: bytes) -> None:
        transport = self.http.send("POST", path, body)
        self.clock.advance(0)
        assert parse_response(transport.value()).status == 200


@pytest.mark.parametrize("mode", MODES)
def test_every_state_in_every_backend(tmp_path, clock, sync_threads, mode):
    broker = new_broker(tmp_path, clock, mem_queue_size=5, **MODES[mode])
    try:
        scene = Scene(broker, clock)
        http = scene.http
        before = stats_of(http)
        reply = http.post("/snapshot?out=s1")
        assert reply.status == 200, reply.body
        path = reply.json()["path"]
        manifest = read_manifest(path)
        assert manifest.format_version == 2 and manifest.source == "broker"
        assert manifest.backend == MODES[mode]["backend"] and manifest.durable == (mode == "durable")
        # The counts are /stats' at the instant, and the rows say the same.
        queues = {q.name: q for q in manifest.queues}
        assert set(queues) == {"t", "t:c", "waiting"}
        for name, q in queues.items():
            assert q.stats == before[name], name
            assert (q.queued, q.in_flight, q.deferred) == (
                before[name]["depth"], before[name]["in_flight_count"], before[name]["deferred_count"])
            assert q.count == q.queued + q.in_flight + q.deferred == q.stored + q.held
        assert manifest.left_out == [{"topic": "t", "channel": "e#ephemeral", "reason": "ephemeral",
                                      "depth": 5, "in_flight_count": 0, "deferred_count": 1}]
        rows = rows_of(path)
        by_state: dict[tuple[str | None, str], list[dict]] = {}
        for row in rows:
            by_state.setdefault((row["channel"], row["state"]), []).append(row)
        bodies = {k: sorted(r["body"] for r in v) for k, v in by_state.items()}
        assert bodies == {
            ("c", "queued"): sorted(b"m%d" % i for i in range(4, 12)),
            ("c", "in_flight"): [b"m1", b"m2", b"m3"],
            ("c", "deferred"): [b"later", b"m0"],
            (None, "queued"): [b"w0", b"w1"],
        }
        # Every message once; each row where the broker had it.
        assert len({(r["channel"], r["message_id"]) for r in rows}) == len(rows) == 15
        for row in by_state[("c", "in_flight")]:
            assert row["in_flight_client"] == "127.0.0.1:4242"
            assert row["timeout_at"].timestamp() == pytest.approx(clock.seconds() + 30)
            assert row["attempts"] == 1
        for row in by_state[("c", "queued")] + by_state[(None, "queued")]:
            assert row["in_flight_client"] is None and row["timeout_at"] is None and row["attempts"] == 0
        due = {r["body"]: r["deferred_until"].timestamp() for r in by_state[("c", "deferred")]}
        assert due == pytest.approx({b"m0": clock.seconds() + 10, b"later": clock.seconds() + 60})
        attempts = {r["body"]: r["attempts"] for r in by_state[("c", "deferred")]}
        assert attempts == {b"m0": 1, b"later": 0}
        assert manifest.clients[0]["remote_address"] == "127.0.0.1:4242"
        # In the durable mode every message has a store record: its sequence.
        sequences = [r["sequence"] for r in rows]
        if mode == "durable":
            assert None not in sequences
        elif mode == "memory":
            assert set(sequences) == {None}

        # Nothing changed in the live broker: same counts, and everything
        # is still delivered once.
        assert stats_of(http) == before
        for m in scene.delivered:
            scene.consumer.fin(m)
        clock.advance(61)
        scan(broker)
        scene.consumer.send(cmd("RDY", 100))
        clock.advance(0)
        seen = [f.body for f in scene.consumer.read() if isinstance(f, Msg)]
        assert sorted(seen) == sorted([b"later", b"m0", *(b"m%d" % i for i in range(4, 12))])
    finally:
        broker.close()


def test_held_rows_follow_every_stored_record_in_key_order(tmp_path, clock, sync_threads):
    broker = new_broker(tmp_path, clock, backend="lmdb", mem_queue_size=5)
    try:
        Scene(broker, clock)
        manifest = read_manifest(HTTPClient(broker).post("/snapshot?out=k").json()["path"])
        ranges = snapshot_ranges(manifest)
        keys = [(r.key_id, r.first) for r in ranges]
        assert keys == sorted(keys)
        assert [r.held for r in ranges] == sorted(r.held for r in ranges)
        assert all(r.key_id & HELD_BIT for r in ranges if r.held)
    finally:
        broker.close()


def test_a_failing_store_refuses_and_changes_nothing(tmp_path, clock, sync_threads):
    broker = new_broker(tmp_path, clock, backend="lmdb", mem_queue_size=5)
    try:
        http = HTTPClient(broker)
        assert http.post("/pub?topic=t", b"x").status == 200
        clock.advance(0)
        broker.store.mark_failed("LMDB write failed: No space left on device")
        before = stats_of(http)
        assert error(http.post("/snapshot?out=f")) == (503, "STORE_FAILED")
        assert stats_of(http) == before
        assert not (tmp_path / "snapshots" / "f").exists()
    finally:
        broker.close()
