"""mqd.client.ready: RDY arithmetic, redistribution and backoff over fake connections."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from mqd.client.config import Config
from mqd.client.ready import RDY_RETRY_DELAY, ReadyController


class FakeConn:
    """The attributes of NSQClientProtocol the RDY logic reads, and rdy(n)."""

    def __init__(self, address: str, clock: Clock, max_rdy_count: int = 2500) -> None:
        self.address = address
        self.rdy_count = 0
        self.last_rdy_count = 0
        self.last_rdy_at = 0.0
        self.last_message_at = clock.seconds()
        self.in_flight = 0
        self.max_rdy_count = max_rdy_count
        self.closing = False
        self.sent: list[int] = []

    def rdy(self, count: int) -> None:
        self.sent.append(count)

    def __repr__(self) -> str:
        return f"FakeConn({self.address})"


class PickLast:
    """An rng whose random choice is always the last candidate."""

    def randrange(self, n: int) -> int:
        return n - 1

    def random(self) -> float:
        return 0.5


class PickFirst(PickLast):
    def randrange(self, n: int) -> int:
        return 0


def make(clock, n=1, rng=None, max_rdy_count=2500, **options):
    conns: list[FakeConn] = []
    ready = ReadyController(Config(**options), clock, lambda: conns, rng=rng or PickLast())
    for i in range(n):
        add(ready, conns, clock, f"127.0.0.1:{4150 + i}", max_rdy_count)
    return ready, conns


def add(ready, conns, clock, address, max_rdy_count=2500) -> FakeConn:
    conn = FakeConn(address, clock, max_rdy_count)
    conns.append(conn)
    ready.connection_added(conn)
    return conn


def remove(ready, conns, conn) -> None:
    conns.remove(conn)
    ready.connection_removed(conn)


@pytest.fixture
def clock() -> Clock:
    clock = Clock()
    clock.advance(1000)
    return clock


@pytest.mark.parametrize("max_in_flight, n, max_rdy, expected", [
    (2500, 1, 2500, [2500]),
    (10, 3, 2500, [3, 3, 3]),
    (1, 2, 2500, [1, 0]),
    (2, 4, 2500, [1, 1, 0, 0]),
    (2500, 1, 100, [100]),
    (2500, 2, 1000, [1000, 1000]),
    (100, 3, 2500, [33, 33, 33]),
    (0, 2, 2500, [0, 0]),
])
def test_rdy_arithmetic(clock, max_in_flight, n, max_rdy, expected):
    ready, conns = make(clock, n, max_rdy_count=max_rdy, max_in_flight=max_in_flight)
    assert [c.rdy_count for c in conns] == expected
    assert ready.total_rdy == sum(expected) <= max_in_flight
    # what went on the wire ends with the RDY each connection holds
    for conn, rdy in zip(conns, expected, strict=True):
        assert (conn.sent[-1] if conn.sent else 0) == rdy


def test_per_conn_share_shrinks_as_connections_arrive(clock):
    ready, conns = make(clock, 3, max_in_flight=10)
    # the first got everything, then was lowered before the others were raised
    assert conns[0].sent == [10, 5, 3]
    assert conns[1].sent == [5, 3]
    assert conns[2].sent == [3]
    assert ready.per_conn_max_in_flight() == 3


def test_unchanged_rdy_is_not_resent_but_refreshes_its_time(clock):
    ready, (conn,) = make(clock, 1, max_in_flight=5)
    clock.advance(7)
    ready.maybe_update_rdy(conn)
    assert conn.sent == [5]
    assert conn.last_rdy_at == clock.seconds()


def test_closing_connection_gets_no_rdy(clock):
    ready, (conn,) = make(clock, 1, max_in_flight=5)
    conn.closing = True
    assert not ready.update_rdy(conn, 1)
    assert conn.sent == [5]


def test_starved_connection_retries_after_five_seconds(clock):
    """max_in_flight 1 over 2 connections: the second waits, and is retried."""
    ready, (c1, c2) = make(clock, 2, max_in_flight=1)
    assert (c1.rdy_count, c2.rdy_count) == (1, 0)
    # the budget frees up (c1's RDY taken away) before the retry fires
    ready.update_rdy(c1, 0)
    clock.advance(RDY_RETRY_DELAY)
    assert c2.sent == [1]
    assert ready.total_rdy == 1


def test_redistribution_rotates_rdy_to_the_connection_with_work(clock):
    ready, (c1, c2) = make(clock, 2, max_in_flight=1, low_rdy_idle_timeout="10s",
                           low_rdy_timeout="30s", rdy_redistribute_interval="5s")
    ready.start()
    assert (c1.rdy_count, c2.rdy_count) == (1, 0)
    # c1 receives nothing: not yet idle for longer than low_rdy_idle_timeout
    clock.advance(5)
    clock.advance(5)
    assert (c1.rdy_count, c2.rdy_count) == (1, 0)
    clock.advance(5)  # idle 15 s > 10 s: c1 gives up its RDY, c2 gets it
    assert c1.sent == [1, 0]
    assert c2.sent == [1]
    assert ready.total_rdy == 1
    # c2 has work: it keeps its RDY while messages arrive...
    for _ in range(6):
        c2.last_message_at = clock.seconds()
        clock.advance(5)
        assert (c1.rdy_count, c2.rdy_count) == (0, 1)
    # ...until its RDY is older than low_rdy_timeout: then it is handed out again
    c2.last_message_at = clock.seconds()
    clock.advance(5)
    assert c2.sent == [1, 0, 1]
    assert ready.total_rdy == 1
    ready.stop()
    assert clock.getDelayedCalls() == []


def test_no_redistribution_when_rdy_is_plentiful(clock):
    ready, (c1, c2) = make(clock, 2, max_in_flight=10)
    ready.start()
    clock.advance(60)
    assert c1.sent == [10, 5] and c2.sent == [5]


def test_removed_connection_frees_its_rdy_and_flags_redistribution(clock):
    ready, conns = make(clock, 3, max_in_flight=2)
    c1, c2, c3 = conns
    assert [c.rdy_count for c in conns] == [1, 1, 0]
    remove(ready, conns, c1)
    assert ready.total_rdy == 1
    # 2 left == max_in_flight and c1 held RDY: the next tick hands it to another
    assert ready.need_redistribute
    ready.redistribute()
    assert ready.total_rdy == 2
    assert c3.rdy_count == 1


def test_change_max_in_flight(clock):
    ready, (c1, c2) = make(clock, 2, max_in_flight=2)
    assert (c1.rdy_count, c2.rdy_count) == (1, 1)
    ready.change_max_in_flight(10)
    assert (c1.rdy_count, c2.rdy_count) == (5, 5)
    ready.change_max_in_flight(2)  # lowering works even though the total is over budget
    assert (c1.rdy_count, c2.rdy_count) == (1, 1)
    assert ready.total_rdy == 2
    ready.change_max_in_flight(0)  # pause
    assert (c1.sent[-1], c2.sent[-1]) == (0, 0)
    assert ready.total_rdy == 0


def test_backoff_sequence(clock):
    """RDY 0 everywhere, wait, RDY 1 on one connection, back to full RDY."""
    ready, (c1, c2) = make(clock, 2, max_in_flight=10, backoff_multiplier="1s",
                           max_backoff_duration="2m")
    assert (c1.sent, c2.sent) == ([10, 5], [5])

    ready.on_failure()
    assert ready.backoff.level == 1
    assert (c1.rdy_count, c2.rdy_count) == (0, 0)
    assert ready.in_backoff_timeout()
    # signals while the timer runs change nothing
    ready.on_failure()
    ready.on_success()
    assert ready.backoff.level == 1
    clock.advance(1.999)
    assert (c1.rdy_count, c2.rdy_count) == (0, 0)
    clock.advance(0.001)  # go-nsq: level 1 waits multiplier × 2^1
    assert (c1.rdy_count, c2.rdy_count) == (0, 1)  # testing the waters on one connection
    assert not ready.in_backoff_timeout()

    ready.on_failure()  # the test message failed too: level 2, 4 s
    assert (c1.rdy_count, c2.rdy_count) == (0, 0)
    clock.advance(3.9)
    assert ready.total_rdy == 0
    clock.advance(0.1)
    assert ready.total_rdy == 1

    ready.on_success()  # level 1: still backing off, 2 s
    assert ready.backoff.level == 1
    assert ready.total_rdy == 0
    clock.advance(2)
    assert ready.total_rdy == 1
    ready.on_success()  # level 0: everyone back to full RDY
    assert ready.backoff.level == 0
    assert (c1.rdy_count, c2.rdy_count) == (5, 5)
    assert c2.sent == [5, 0, 1, 0, 1, 0, 1, 5]
    assert clock.getDelayedCalls() == []


def test_backoff_durations_double_up_to_the_highest_level_that_fits(clock):
    ready, (conn,) = make(clock, 1, max_in_flight=5, backoff_multiplier="1s",
                          max_backoff_duration="20s")
    waits = []
    for _ in range(6):
        ready.on_failure()
        call, = clock.getDelayedCalls()
        waits.append(call.getTime() - clock.seconds())
        clock.advance(waits[-1])
    assert waits == [2, 4, 8, 16, 16, 16]


def test_continue_keeps_the_level_but_backs_off_again(clock):
    ready, (conn,) = make(clock, 1, max_in_flight=5)
    ready.on_failure()
    clock.advance(2)
    assert conn.rdy_count == 1
    ready.on_continue()
    assert ready.backoff.level == 1
    assert conn.rdy_count == 0
    clock.advance(2)
    assert conn.rdy_count == 1
    # without backoff, continue does nothing
    ready.on_success()
    assert conn.rdy_count == 5
    ready.on_continue()
    assert conn.rdy_count == 5


def test_no_backoff_when_max_backoff_duration_is_zero(clock):
    ready, (conn,) = make(clock, 1, max_in_flight=5, max_backoff_duration=0.0)
    ready.on_failure()
    assert conn.sent == [5]
    assert clock.getDelayedCalls() == []


def test_new_connection_during_backoff_waits(clock):
    ready, conns = make(clock, 1, max_in_flight=5)
    ready.on_failure()
    late = add(ready, conns, clock, "127.0.0.1:5000")
    assert late.sent == []
    clock.advance(2)
    ready.on_success()
    assert [c.rdy_count for c in conns] == [2, 2]


def test_resume_without_connections_retries_every_second(clock):
    conns: list[FakeConn] = []
    ready = ReadyController(Config(max_in_flight=5), clock, lambda: conns, rng=PickLast())
    conn = add(ready, conns, clock, "a:1")
    ready.on_failure()
    remove(ready, conns, conn)
    clock.advance(2)
    assert ready.in_backoff_timeout()
    late = add(ready, conns, clock, "b:1")
    assert late.sent == []
    clock.advance(1)
    assert late.sent == [1]


def test_backoff_redistribution_keeps_one_in_flight(clock):
    """In backoff with several connections, the single RDY moves between them."""
    ready, (c1, c2) = make(clock, 2, max_in_flight=10, low_rdy_idle_timeout="1s",
                           rdy_redistribute_interval="1s", rng=PickFirst())
    ready.start()
    ready.on_failure()
    clock.advance(2)  # resume: PickFirst → c1 gets RDY 1
    assert (c1.rdy_count, c2.rdy_count) == (1, 0)
    clock.advance(1)
    clock.advance(1)  # c1 idle > 1 s: its RDY is taken and handed out again
    assert ready.total_rdy == 1
    ready.stop()


def test_is_starved(clock):
    ready, (conn,) = make(clock, 1, max_in_flight=10)
    assert not ready.is_starved()
    conn.in_flight = 7
    assert not ready.is_starved()
    conn.in_flight = 8  # 85 % of RDY 10
    assert ready.is_starved()
    conn.closing = True
    assert not ready.is_starved()


def test_stop_cancels_timers(clock):
    ready, (c1, c2) = make(clock, 2, max_in_flight=1)
    ready.start()
    ready.on_failure()
    assert clock.getDelayedCalls()
    ready.stop()
    assert clock.getDelayedCalls() == []
    ready.on_failure()
    assert clock.getDelayedCalls() == []
