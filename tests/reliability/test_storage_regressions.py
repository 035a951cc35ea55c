"""Storage defects found in review: one regression test (or a few) per defect, named after the behaviour.

Everything runs in-process on a task.Clock (`clock.advance(0)` runs the
LMDB group commit). Durable tests check `check_durable_invariant` after each
step, so a record read twice or lost shows up at the step that causes it.
"""

from __future__ import annotations

import random

import lmdb
import pytest
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher

from mqd.nsqd import channel as channel_module
from mqd.nsqd.channel import Channel
from mqd.nsqd.queuescan import QueueScanner
from tests.support.http_client import HTTPClient, parse_response
from tests.support.inprocess_broker import failing_once, lmdb_store, msgs, new_broker, scan
from tests.support.invariants import check_durable_invariant, stored_keys
from tests.support.v2_client import Client
from tests.support.v2_frames import HEARTBEAT, Msg, cmd, dpub, err, identify, mpub, ok, pub

FULL = "LMDB write failed: No space left on device"


def lmdb_broker(path, clock, **flags):
    return new_broker(path, clock, backend="lmdb", **flags)


def crash(broker, **flags):
    """The process dies after its last commit; a new broker starts on the same data."""
    broker.clock.advance(0)
    assert not broker.store._pending()
    broker.metadata.close()
    broker.store.env.close()
    clock = Clock()
    clock.advance(broker.clock.seconds())
    return lmdb_broker(broker.data_path, clock, **flags)


def delivered(c: Client) -> list[Msg]:
    frames = [f for f in c.read() if f != HEARTBEAT]
    assert all(isinstance(f, Msg) for f in frames), frames
    return frames


def records_of(broker, name: str) -> int:
    """How many records the queue `name` (topic, or topic:channel) will have once committed."""
    store = broker.store
    return len(stored_keys(store, store.open_queue(name)))


class LogCapture:
    """Collects the events logged while it is installed."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def __call__(self, event: dict) -> None:
        self.events.append(event)

    def failures(self) -> list[dict]:
        return [e for e in self.events if "log_failure" in e]


@pytest.fixture
def logged():
    capture = LogCapture()
    globalLogPublisher.addObserver(capture)
    yield capture
    globalLogPublisher.removeObserver(capture)


# -- a deferred record read a second time ---------------------------------------


def test_durable_deferred_record_not_read_twice(tmp_path, clock):
    broker = lmdb_broker(tmp_path, clock, durable=True)
    c = Client(broker)
    c.sub(rdy=0)
    channel = broker.topics["t"].channels["c"]
    p = Client(broker)
    p.send(dpub("t", 100, b"x"))
    clock.advance(0)
    assert p.read() == [ok()]
    check_durable_invariant(broker)
    clock.advance(3)
    assert scan(broker) == 1  # x is due: into the channel's memory queue
    check_durable_invariant(broker)
    p.send(pub("t", b"y"))
    clock.advance(0)
    assert p.read() == [ok()]
    check_durable_invariant(broker)
    assert channel.depth() == 2
    c.send(cmd("RDY", 10))
    got = delivered(c)
    assert [(m.body, m.attempts) for m in got] == [(b"x", 1), (b"y", 1)]
    assert (channel.depth(), channel.in_flight_count(), channel.deferred_count()) == (0, 2, 0)
    check_durable_invariant(broker)
    for m in got:
        c.fin(m)
    clock.advance(0)
    check_durable_invariant(broker)
    assert records_of(broker, "t:c") == 0
    p.send(pub("t", b"z"))
    clock.advance(0)
    assert [m.body for m in delivered(c)] == [b"z"]
    check_durable_invariant(broker)
    broker.close()


def test_durable_deferred_via_http_then_requeued(tmp_path, clock):
    """The same via POST /pub?defer=, then a REQ and a timeout of the once-deferred message."""
    broker = lmdb_broker(tmp_path, clock, durable=True, msg_timeout="10s")
    c = Client(broker)
    c.sub(rdy=0)
    channel = broker.topics["t"].channels["c"]
    http = HTTPClient(broker)
    transport = http.send("POST", "/pub?topic=t&defer=100", b"x")
    clock.advance(0)  # durable: answered once committed
    assert parse_response(transport.value()).body == b"OK"
    check_durable_invariant(broker)
    clock.advance(3)
    scan(broker)
    for body in (b"y", b"z"):
        Client(broker).send(pub("t", body))
        clock.advance(0)
        check_durable_invariant(broker)
    c.send(cmd("RDY", 1))
    (x,) = delivered(c)
    assert x.body == b"x"
    c.req(x, 0)  # back to the memory queue, behind nothing
    check_durable_invariant(broker)
    (x2,) = delivered(c)
    assert (x2.body, x2.attempts) == (b"x", 2)
    clock.advance(11)
    scan(broker)  # timed out: queued again
    check_durable_invariant(broker)
    c.send(cmd("RDY", 10))
    got = delivered(c)
    assert sorted(m.body for m in got) == [b"x", b"y", b"z"]
    assert channel.depth() == 0
    check_durable_invariant(broker)
    broker.close()


def test_lmdb_update_keeps_a_held_record_hidden(tmp_path, clock):
    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t")
    (held,) = msgs(1)
    held.deferred_until = 1.0
    q.hold([held])
    clock.advance(0)
    # Due: the channel takes it back into memory and rewrites its record.
    held.deferred_until = 0.0
    held.attempts = 1
    q.update([held])
    q.put(msgs(1, 1))
    clock.advance(0)
    assert [m.body for m in q.read(10)] == [b"m1"]
    assert q.depth() == 0
    q.finish([held])
    clock.advance(0)
    q.put(msgs(1, 2))
    clock.advance(0)  # durable: readable once committed
    assert [m.body for m in q.read(10)] == [b"m2"]
    assert q.depth() == 0
    store.close()


class LyingBackend:
    """A backend whose depth says 1 while it has nothing to read."""

    def __init__(self, real) -> None:
        self.real = real
        self.reads = 0

    def depth(self) -> int:
        return 1

    def read(self, count: int) -> list:
        self.reads += 1
        if self.reads > 100:
            raise AssertionError("deliver() keeps reading an empty backend")
        return []

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_deliver_cannot_spin_on_a_wrong_depth(inproc_broker):
    c = Client(inproc_broker)
    c.sub(rdy=0)
    channel = inproc_broker.topics["t"].channels["c"]
    lying = channel._queue.backend = LyingBackend(channel._queue.backend)
    c.send(cmd("RDY", 5))
    assert lying.reads == 1
    assert c.read() == []


def test_lmdb_depth_never_negative(tmp_path, clock, logged):
    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t")
    q.put(msgs(2))
    clock.advance(0)  # durable: readable once committed
    q._depth = 1  # as a double read left it
    assert [m.body for m in q.read(10)] == [b"m0", b"m1"]
    assert q.depth() == 0
    assert [e["log_level"] for e in logged.events if e.get("log_namespace") == "backends.lmdb"] == [LogLevel.error]
    store.close()


# -- attempts past 65,535 -------------------------------------------------------


def test_attempts_wrap_like_nsqd(tmp_path, clock):
    broker = lmdb_broker(tmp_path, clock, durable=True)
    c = Client(broker)
    c.sub(rdy=1)
    p = Client(broker)
    p.send(pub("t", b"x"))
    clock.advance(0)
    (m,) = delivered(c)
    channel = broker.topics["t"].channels["c"]
    # As if it had been REQueued 65,534 more times.
    channel._in_flight[m.id].attempts = 65535
    c.req(m, 0)
    (again,) = delivered(c)
    assert (again.id, again.attempts) == (m.id, 0)  # nsqd's uint16 wraps
    assert not c.closed
    clock.advance(0)
    assert broker.store.failure is None
    assert broker.health is None
    check_durable_invariant(broker)
    c.req(again, 0)
    (third,) = delivered(c)
    assert third.attempts == 1
    # Later commits still work.
    p.send(pub("t", b"y"))
    clock.advance(0)
    assert p.read() == [ok(), ok()]
    broker = crash(broker, durable=True)
    c = Client(broker)
    c.sub(rdy=10)
    assert sorted((m.body, m.attempts) for m in delivered(c)) == [(b"x", 2), (b"y", 1)]
    broker.close()


def test_lmdb_record_packs_any_attempts(tmp_path, clock):
    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t")
    (m,) = msgs(1)
    m.attempts = 65536 + 7
    q.put([m])
    clock.advance(0)
    assert store.failure is None
    store.close()
    store = lmdb_store(tmp_path, clock, durable=True)
    (back,) = store.open_queue("t").read(1)
    assert back.attempts == 7
    store.close()


def test_failing_channel_does_not_stop_the_queue_scan(make_broker, clock, monkeypatch, logged):
    broker = make_broker(queue_scan_interval="100ms")
    bad = Client(broker)
    bad.sub("t", "bad", rdy=1)
    good = Client(broker)
    good.sub("t", "good", rdy=1)
    bad_channel = broker.topics["t"].channels["bad"]
    real = Channel.process_in_flight

    def process_in_flight(self, now):
        if self is bad_channel:
            raise RuntimeError("broken channel")
        return real(self, now)

    monkeypatch.setattr(Channel, "process_in_flight", process_in_flight)
    scanner = QueueScanner(broker)
    scanner.startService()
    try:
        p = Client(broker)
        p.send(dpub("t", 500, b"later"))
        assert p.read() == [ok()]
        for _ in range(10):
            clock.advance(0.1)
        assert [m.body for m in delivered(good)] == [b"later"]
        # The broken channel's own deferred queue is still processed.
        assert [m.body for m in delivered(bad)] == [b"later"]
        assert scanner._loop is not None and scanner._loop.running
        failures = logged.failures()
        assert len(failures) == 1, failures
        assert "broken channel" in str(failures[0]["log_failure"].value)
        p.send(dpub("t", 200, b"more"))
        good.send(cmd("RDY", 2))
        for _ in range(5):
            clock.advance(0.1)
        assert [m.body for m in delivered(good)] == [b"more"]
        assert len(logged.failures()) == 1  # logged once, not every tick
    finally:
        scanner.stopService()


# -- messages a sample_rate drops ------------------------------------------------


def test_durable_sample_rate_drops_are_forgotten(tmp_path, clock, monkeypatch):
    monkeypatch.setattr(channel_module, "random", random.Random(16))
    broker = lmdb_broker(tmp_path, clock, durable=True)
    c = Client(broker)
    assert c.request(identify(sample_rate=1)) == [ok()]
    c.sub(rdy=0)
    p = Client(broker)
    p.send(mpub("t", [b"%d" % i for i in range(200)]))
    clock.advance(0)
    assert p.read() == [ok()]
    c.send(cmd("RDY", 200))
    got = delivered(c)
    assert 0 < len(got) < 20
    channel = broker.topics["t"].channels["c"]
    assert (channel.depth(), channel.in_flight_count()) == (0, len(got))
    clock.advance(0)
    check_durable_invariant(broker)
    assert records_of(broker, "t:c") == len(got)
    for m in got:
        c.fin(m)
    clock.advance(0)
    check_durable_invariant(broker)
    assert records_of(broker, "t:c") == 0
    broker = crash(broker, durable=True)
    assert broker.topics["t"].channels["c"].depth() == 0
    c = Client(broker)
    c.sub(rdy=200)
    assert delivered(c) == []
    broker.close()


# -- a topic's backlog moved while the disk is full -----------------------------------


def fill_disk(broker) -> None:
    """The next commit fails as a full disk does (a publish to another topic triggers it)."""
    failing_once(broker.store)
    Client(broker).send(pub("other", b"o"))
    broker.clock.advance(0)
    assert broker.health == FULL


@pytest.mark.parametrize("durable", [False, True], ids=["default", "durable"])
def test_backlog_kept_when_store_fails_mid_move(tmp_path, clock, durable):
    flags = {"durable": True} if durable else {"mem_queue_size": 10}
    broker = lmdb_broker(tmp_path, clock, **flags)
    bodies = [b"%d" % i for i in range(100)]
    p = Client(broker)
    p.send(mpub("t", bodies))
    clock.advance(0)
    assert p.read() == [ok()]
    topic = broker.topics["t"]
    assert topic.depth() == 100
    fill_disk(broker)
    c = Client(broker)
    c.sub(rdy=0)
    channel = topic.channels["c"]
    clock.advance(0)
    clock.advance(0)
    # Whatever could not move waits at the topic; nothing is lost.
    assert topic.depth() + channel.depth() == 100
    if durable:
        assert channel.depth() == 0
        check_durable_invariant(broker)
    clock.advance(1)  # the disk has room again: the commit and the move are retried
    clock.advance(0)
    assert broker.health is None
    assert (topic.depth(), channel.depth()) == (0, 100)
    if durable:
        check_durable_invariant(broker)
        broker = crash(broker, durable=True)
        assert broker.topics["t"].depth() == 0
        assert broker.topics["t"].channels["c"].depth() == 100
        c = Client(broker)
        c.sub(rdy=0)
    c.send(cmd("RDY", 200))
    assert [m.body for m in delivered(c)] == bodies
    broker.close()


def test_publish_while_move_waits_stays_in_order(tmp_path, clock):
    broker = lmdb_broker(tmp_path, clock, durable=True)
    p = Client(broker)
    p.send(mpub("t", [b"a", b"b"]))
    clock.advance(0)
    assert p.read() == [ok()]
    fill_disk(broker)
    c = Client(broker)
    c.sub(rdy=0)
    clock.advance(0)
    assert p.request(pub("t", b"c")) == [err(f"E_PUB_FAILED PUB failed {FULL}")]
    check_durable_invariant(broker)
    clock.advance(1)
    q = Client(broker)
    q.send(pub("t", b"d"))
    clock.advance(0)
    assert q.read() == [ok()]
    check_durable_invariant(broker)
    c.send(cmd("RDY", 10))
    assert [m.body for m in delivered(c)] == [b"a", b"b", b"d"]
    check_durable_invariant(broker)
    broker.close()


def test_ephemeral_channel_does_not_take_a_batch_the_store_refuses(tmp_path, clock):
    broker = lmdb_broker(tmp_path, clock, durable=True)
    eph = Client(broker)
    eph.sub("t", "e#ephemeral", rdy=0)
    c = Client(broker)
    c.sub(rdy=0)
    topic = broker.topics["t"]
    topic.pause()
    p = Client(broker)
    p.send(mpub("t", [b"1", b"2", b"3"]))
    clock.advance(0)
    assert p.read() == [ok()]
    fill_disk(broker)
    topic.unpause()
    clock.advance(0)
    # Neither channel took the batch: the ephemeral one would have had it twice.
    assert (topic.depth(), topic.channels["e#ephemeral"].depth(), topic.channels["c"].depth()) == (3, 0, 0)
    check_durable_invariant(broker)
    clock.advance(1)
    clock.advance(0)
    assert (topic.depth(), topic.channels["e#ephemeral"].depth(), topic.channels["c"].depth()) == (0, 3, 3)
    check_durable_invariant(broker)
    for client in (eph, c):
        client.send(cmd("RDY", 10))
        assert [m.body for m in delivered(client)] == [b"1", b"2", b"3"]
    broker.close()


def test_shutdown_with_a_full_disk_still_closes_every_queue(tmp_path, clock, logged):
    broker = lmdb_broker(tmp_path, clock, mem_queue_size=10)
    p = Client(broker)
    assert p.request(mpub("t", [b"%d" % i for i in range(5)])) == [ok()]
    assert p.request(mpub("u", [b"%d" % i for i in range(5)])) == [ok()]
    clock.advance(0)

    def full():
        raise lmdb.Error("No space left on device")

    broker.store._write = full
    Client(broker).send(pub("other", b"o"))
    clock.advance(0)
    assert broker.health == FULL
    # Every queue still closes, and the memory queues are not
    # dropped either: the store takes them and writes what fits in bounded
    # transactions (here all of it: only the one-transaction commit fails).
    assert broker.close() is None
    lost = [e for e in logged.events if e.get("log_namespace") == "mqd.nsqd.overflow"]
    assert lost == []
    broker = lmdb_broker(tmp_path, clock, mem_queue_size=10)  # the data path and LMDB were released
    assert {name: broker.topics[name].depth() for name in ("t", "u", "other")} == {
        "t": 5, "u": 5, "other": 1}
    broker.close()


# -- the memory store and deleted queues ---------------------------------------------


def test_memory_store_forgets_deleted_queues(inproc_broker):
    store = inproc_broker.store
    for i in range(1000):
        topic = inproc_broker.topic(f"t{i}")
        topic.channel("c")
        topic.channel("d")
        topic.delete_channel("d")
        assert inproc_broker.delete_topic(f"t{i}")
    assert store._queues == {}
    # A queue opened again under a deleted name is a fresh, working one.
    Client(inproc_broker).send(pub("t0", b"x"))
    assert inproc_broker.topics["t0"].depth() == 1
    assert set(store._queues) == {"t0"}
