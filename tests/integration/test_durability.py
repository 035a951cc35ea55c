"""What the LMDB store keeps across a crash, a clean stop and a restart, on the real process.

The crash test is the acceptance test of `--durable`: publishers record
exactly which bodies the broker acknowledged, a consumer records which of
its FINs a durable OK has covered, the broker is SIGKILLed mid-load, and
the restarted broker must give back every acknowledged body and none of
the finished ones.
"""

from __future__ import annotations

import random
import re
import subprocess
import time
from collections import Counter

import lmdb
import pytest

from backends.lmdb import ENV_DIR, KEY, RECORD
from tests.support.durable_load import (
    Consumer,
    Publisher,
    check_body,
    drain,
    drain_all,
    make_body,
    parse_message,
)
from tests.support.processes import FAST_SCAN, child_env, twistd_command
from tests.support.raw_conn import FRAME_RESPONSE, RawConn, command
from tests.support.v2_frames import mpub_body

# Every test starts `twistd mqd` (some as a plain subprocess, not through a fixture).
pytestmark = pytest.mark.slow

_HEX_ID = re.compile(rb"[0-9a-f]{16}")


def _some(bodies, n: int = 3) -> str:
    """A few bodies, shortened, for an assertion message."""
    return ", ".join(repr(b[:24]) for b in sorted(bodies)[:n]) or "none"


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
    # later only gets what is published after it (as in nsqd).
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
