"""Message ids never repeat: within a run whatever the clock does, across runs through the id lease.

The factory's time is max(clock, last id issued), so a clock stepped back
mid-run only slows the ids' time down. Across restarts the broker's
IdFactory issues ids only below a bound that `<data-path>/mqd-ids.lease`
already holds, and a new run starts at or above it: a broker restarted
with its clock behind (clean stop or crash) never issues an id again.
"""

from __future__ import annotations

import os

import pytest
from twisted.internet.task import Clock

from backends.lmdb_records import RECORD, RECORD_SIZE
from mqd.message import IdFactory, id_time, id_time_span
from mqd.nsqd.metadata import ID_LEASE_FILE, LEASE_SECONDS
from mqd.options import ConfigError
from tests.support.held_jobs import HeldJobs
from tests.support.inprocess_broker import START_TIME, new_broker
from tests.support.v2_client import Client
from tests.support.v2_frames import err, identify, mpub, ok, pub

NS = 10**9
NOW = int(START_TIME * NS)
DAY = 86_400


def id_times(ids: list[bytes]) -> list[int]:
    return [int(i, 16) >> 22 for i in ids]


def check_increasing(ids: list[bytes]) -> None:
    assert len(set(ids)) == len(ids), "an id was issued twice"
    assert ids == sorted(ids), "ids went backwards"


# -- the factory: within a run --------------------------------------------------------------


@pytest.mark.parametrize("back", [0.001, 1.0, 1.8, DAY], ids=["1ms", "1s", "1.8s", "1day"])
@pytest.mark.parametrize("batch", [1, 3, 5000])
def test_ids_never_go_backwards_when_the_clock_steps_back_mid_run(back, batch):
    f = IdFactory(3)
    now = NOW
    ids: list[bytes] = []
    for _ in range(4):
        ids += f.new_ids(batch, now)
        now += NS // 100
    before = f.issued_below
    now -= int(back * NS)
    for _ in range(4):
        ids += f.new_ids(batch, now)  # behind the last id: borrowed from it, never earlier
        now += NS // 100
    check_increasing(ids)
    assert f.issued_below >= before
    # Once the clock passes the last id again, ids follow it.
    later = now + int(back * NS) + NS
    [i] = f.new_ids(1, later)
    assert id_times([i]) == [id_time(later)]


def test_a_factory_with_a_lease_issues_nothing_at_or_past_its_limit():
    class Refusing:
        def __init__(self) -> None:
            self.calls: list[tuple[int, bool]] = []

        def extend(self, ids: IdFactory, end: int) -> None:
            self.calls.append((end, end >= ids.limit))
            if end >= ids.limit:
                raise OSError("no room for the lease")

    lease = Refusing()
    f = IdFactory(1, lease)
    f.start_at(id_time(NOW))
    with pytest.raises(OSError):
        f.new_ids(1, NOW)  # nothing granted yet
    start = id_time(NOW)
    f.grant(start + 2, start + 1)
    assert id_times(f.new_ids(1, NOW)) == [start]  # below renew_at: no call
    assert lease.calls == [(start, True)]
    # 4096 per pseudo-ms: this batch ends in start + 1, past renew_at but below the limit.
    got = f.new_ids(4096, NOW)
    assert lease.calls[-1] == (start + 1, False)
    # The next would borrow start + 2, the limit: refused, nothing issued.
    with pytest.raises(OSError):
        f.new_ids(4096, NOW)
    more = f.new_ids(4095, NOW)  # what is left below the limit still goes
    check_increasing([*got, *more])
    assert max(id_times(got + more)) < f.limit


# -- the lease across runs ------------------------------------------------------------------


def lease_bound(path) -> int:
    raw = (path / ID_LEASE_FILE).read_bytes()
    return max(int(raw[i:i + 16], 16) for i in (0, 26))


def crash(broker):
    """The process dies: nothing of shutdown runs (a durable store's last turn is committed)."""
    broker.clock.advance(0)
    broker.metadata.close()
    store = broker.store
    if getattr(store, "env", None) is not None:
        store.env.close()


def restart(broker, path, behind: float, **flags):
    """A crash, and a new broker on the same data with its clock `behind` seconds back."""
    crash(broker)
    clock = Clock()
    clock.advance(broker.clock.seconds() - behind)
    return new_broker(path, clock, **flags)


def test_start_writes_a_lease_ahead_of_now_before_any_id(tmp_path, clock):
    broker = new_broker(tmp_path, clock)
    assert lease_bound(tmp_path) == id_time(NOW) + id_time_span(LEASE_SECONDS)
    assert broker.ids.limit == lease_bound(tmp_path)


@pytest.mark.parametrize("clean", [True, False], ids=["clean", "crash"])
@pytest.mark.parametrize("behind", [1.8, 0.001, DAY])
@pytest.mark.parametrize("backend", ["memory", "lmdb", "durable"])
def test_a_restart_with_the_clock_behind_issues_no_id_again(tmp_path, clock, backend, behind, clean):
    flags = {"backend": "lmdb", "durable": True} if backend == "durable" else {"backend": backend}
    broker = new_broker(tmp_path, clock, **flags)
    t = broker.topic("t")
    issued: list[bytes] = []
    for _ in range(20):
        issued += broker.ids.new_ids(500, int(broker.clock.seconds() * NS))
        t.publish([b"x"] * 50)
        broker.clock.advance(0.1)
    last = broker.ids.issued_below
    if clean:
        broker.close()
        assert lease_bound(tmp_path) == last  # the exact bound: a clean restart skips nothing
    else:
        crash(broker)
        assert last <= lease_bound(tmp_path) <= last + id_time_span(LEASE_SECONDS)
    bound = lease_bound(tmp_path)
    clock = Clock()
    clock.advance(broker.clock.seconds() - behind)
    broker = new_broker(tmp_path, clock, **flags)
    now = int(clock.seconds() * NS)
    issued += broker.ids.new_ids(5000, now)
    check_increasing(issued)
    assert id_times(issued[-5000:])[0] == max(bound, id_time(now))
    broker.close()


def stored_ids(broker) -> list[bytes]:
    store = broker.store
    with store.env.begin(db=store.data_db) as txn:
        return [bytes(value[:RECORD_SIZE])[-16:] for _, value in txn.cursor()
                if len(value) >= RECORD_SIZE]


def test_durable_restart_with_the_clock_behind_stores_no_id_twice(tmp_path, clock):
    """The incident: a --durable broker restarted 1.8 s behind gave stored ids to new messages."""
    assert RECORD.size == RECORD_SIZE
    broker = new_broker(tmp_path, clock, backend="lmdb", durable=True)
    Client(broker).sub("t", "c")  # no RDY: everything stays stored
    for body in (b"before", b"after"):
        publisher = Client(broker)
        for _ in range(30):
            publisher.send(mpub("t", [body] * 100))
            broker.clock.advance(0)  # the turn's commit, synced: then the OK
            assert publisher.read() == [ok()]
            broker.clock.advance(0.1)
        if body == b"before":
            broker = restart(broker, tmp_path, 1.8, backend="lmdb", durable=True)
    ids = stored_ids(broker)
    assert len(ids) == 6000 and len(set(ids)) == 6000
    broker.close()


# -- renewals ----------------------------------------------------------------------------------


def test_the_lease_is_renewed_in_the_background_before_ids_reach_it(tmp_path, clock):
    broker = new_broker(tmp_path, clock)
    lease = broker.metadata.lease
    lease.runner = jobs = HeldJobs()
    c = Client(broker)
    first = lease_bound(tmp_path)
    clock.advance(LEASE_SECONDS / 2 - 0.5)
    assert c.request(pub("t", b"x")) == [ok()]
    assert jobs.jobs == []  # not near the limit yet
    clock.advance(1)
    assert c.request(pub("t", b"x")) == [ok()]
    assert c.request(pub("t", b"x")) == [ok()]
    assert len(jobs.jobs) == 1  # one renewal at a time
    assert lease_bound(tmp_path) == first and broker.ids.limit == first
    assert jobs.run() == 1
    assert lease_bound(tmp_path) > first and broker.ids.limit == lease_bound(tmp_path)


def test_ids_wait_for_a_synchronous_write_rather_than_pass_a_late_lease(tmp_path, clock):
    broker = new_broker(tmp_path, clock)
    broker.metadata.lease.runner = jobs = HeldJobs()  # never run: the renewal is late
    c = Client(broker)
    assert c.request(identify(heartbeat_interval=-1)) == [ok()]
    ids: list[bytes] = []
    for _ in range(30):
        clock.advance(1)
        assert c.request(pub("t", b"x")) == [ok()]
        ids += broker.ids.new_ids(1, int(clock.seconds() * NS))
        # Every id issued is below what the file holds, at every step.
        assert max(id_times(ids)) < lease_bound(tmp_path)
    assert jobs.jobs  # the background renewal never landed
    check_increasing(ids)


def test_a_lease_that_cannot_be_written_fails_publishes_then_recovers(tmp_path, clock, monkeypatch):
    broker = new_broker(tmp_path, clock)
    c = Client(broker)
    real = os.pwrite

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    clock.advance(LEASE_SECONDS + 1)  # past the lease: a synchronous write is needed
    text = f"{tmp_path / ID_LEASE_FILE}: cannot write the id lease: No space left on device"
    assert c.request(pub("t", b"x")) == [err(f"E_PUB_FAILED PUB failed {text}")]
    assert broker.health == text
    monkeypatch.setattr(os, "pwrite", real)
    c = Client(broker)
    assert c.request(pub("t", b"x")) == [ok()]
    assert broker.health is None


# -- the file -------------------------------------------------------------------------------


def test_a_torn_slot_leaves_the_other_bound(tmp_path, clock):
    broker = new_broker(tmp_path, clock)
    broker.close()
    path = tmp_path / ID_LEASE_FILE
    raw = bytearray(path.read_bytes())
    bound = lease_bound(tmp_path)
    raw[3] ^= 0x01  # the first slot no longer matches its CRC
    path.write_bytes(bytes(raw))
    behind = Clock()
    behind.advance(START_TIME - 60)
    again = new_broker(tmp_path, behind)
    assert id_times(again.ids.new_ids(1, int(behind.seconds() * NS))) == [bound]
    again.close()


@pytest.mark.parametrize("content", [b"", b"garbage", b"x" * 52])
def test_a_corrupt_lease_stops_start_up(tmp_path, clock, content):
    (tmp_path / ID_LEASE_FILE).write_bytes(content)
    with pytest.raises(ConfigError, match="corrupt id lease"):
        new_broker(tmp_path, clock)
    assert (tmp_path / ID_LEASE_FILE).read_bytes() == content
