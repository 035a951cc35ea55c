"""Exactly-once for the streaming source, on every order of deliveries, batches and crashes.

The real TopicStreamReader, ChannelFeed, Ledger and WalDirectory (files in a
temporary directory) run against two models:

- a broker (two nsqd addresses; ids may repeat across them): a message is
  delivered with attempts + 1, stays in flight until FINished, and goes
  back to the queue when its delivery times out or its connection ends; a
  FIN for a delivery that is no longer the current one fails (nsqd's
  non-fatal E_FIN_FAILED: the connection stays up);
- Spark's micro-batch loop: latestOffset -> offset log -> partitions
  (rows read back as Arrow) -> sink (idempotent by batch id) -> commit log
  -> commit, with the driver (Spark and the source's process) crashing
  between any two of those steps. A restart is what Spark and the source
  do: the ledger rebuilt from the WAL by ChannelFeed.recover, the last
  batch of the offset log replayed if it is not in the commit log, the
  broker's connections to the dead process gone.

The reactor thread is modelled on the test's thread: `reactor_thread.call`
runs what was posted before, then its function; `reactor_thread.post`
queues, and the queue runs when the story says so ("reactor"), so
deliveries may come between a post and its run, as they do on the real
reactor; a crash loses what was still queued. The feed's clock is a
task.Clock; the feed is not started (no consumers): the broker model
delivers to the feed's delivery callback as its consumers would.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
from twisted.internet.task import Clock

from mqd.client.message import Message
from spark_bridge import reactor_thread
from spark_bridge.stream_ledger import FINISH, HELD, NEW, Ledger
from spark_bridge.stream_source import ChannelFeed, TopicStreamReader, rows_of
from spark_bridge.stream_wal import WalDirectory, WalError

TOPIC, CHANNEL = "events", "spark"
BROKERS = ("127.0.0.1:4150", "127.0.0.1:4151")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
CONFIRM_AFTER = 5.0


# -- the broker model -----------------------------------------------------------------


class Conn:
    """One consumer connection to one broker, as a delivered Message's delegate sees it."""

    def __init__(self, broker: Broker, address: str) -> None:
        self.broker = broker
        self.address = address
        self.connected = True

    def finish_message(self, message: Message) -> None:
        self.broker.fin(self, message)

    def finish_messages(self, messages) -> None:
        for message in messages:
            if not message.has_responded():
                message.finish()

    def touch_message(self, message: Message) -> None:
        pass

    def requeue_message(self, message: Message, delay, backoff: bool) -> None:
        key = (self.address, message.id)
        if self.connected and self.broker.in_flight.get(key) is message:
            self.broker.time_out(key)


class Broker:
    """Both nsqd's: published messages, the queue, what is in flight and on which delivery."""

    def __init__(self) -> None:
        self.published: dict[tuple[str, bytes], tuple[bytes, int]] = {}
        self.queue: list[tuple[str, bytes]] = []
        self.in_flight: dict[tuple[str, bytes], Message] = {}
        self.attempts: Counter = Counter()
        self.finished: set = set()
        self.conns = {address: Conn(self, address) for address in BROKERS}
        self.next_id = Counter()
        self.on_fin = None  # the world's check that a FIN is allowed
        self.on_fin_failed = None  # E_FIN_FAILED to the consumer that sent the FIN
        self.failed_fins = 0

    def publish(self, broker: int, body: bytes) -> None:
        address = BROKERS[broker]
        key = (address, b"%016x" % self.next_id[address])  # the same ids on both brokers
        self.next_id[address] += 1
        self.published[key] = (body, 1_700_000_000_000_000_000 + 1_001 * len(self.published))
        self.queue.append(key)

    def deliver(self, pick: int, feed: ChannelFeed) -> None:
        if not self.queue:
            return
        key = self.queue.pop(pick % len(self.queue))
        self.attempts[key] += 1
        body, timestamp = self.published[key]
        message = Message(key[1], body, timestamp, self.attempts[key], key[0], self.conns[key[0]])
        self.in_flight[key] = message
        feed._delivered(message)

    def time_out(self, key) -> None:
        del self.in_flight[key]
        self.queue.append(key)

    def drop(self, address: str, feed: ChannelFeed | None) -> None:
        """The connection ends: its messages go back to the queue."""
        conn = self.conns[address]
        conn.connected = False
        if feed is not None:
            feed.connection_closed(conn)
        for key, message in list(self.in_flight.items()):
            if message.delegate is conn:
                self.time_out(key)
        self.conns[address] = Conn(self, address)

    def fin(self, conn: Conn, message: Message) -> None:
        key = (conn.address, message.id)
        self.on_fin(key)
        if not conn.connected:
            return
        if self.in_flight.get(key) is message:
            del self.in_flight[key]
            self.finished.add(key)
        else:
            # E_FIN_FAILED "FIN <id> failed ...": not in flight on this delivery; not fatal
            self.failed_fins += 1
            self.on_fin_failed(conn, message.id)


# -- the source as Spark's driver runs it -------------------------------------------------


def open_source(checkpoint: str, clock: Clock, retention: float = 1e9) -> TopicStreamReader:
    """A reader as after `_started()`, but without consumers: the WAL recovered, nothing dialled."""
    reader = TopicStreamReader({
        "topic": TOPIC, "channel": CHANNEL, "nsqd": ",".join(BROKERS),
        "checkpointLocation": checkpoint, "partitions": "2",
        "finConfirm": f"{CONFIRM_AFTER}s", "walRetention": f"{retention}s"})
    reader._wal = WalDirectory(checkpoint, TOPIC, CHANNEL)
    reader._feed = ChannelFeed(TOPIC, CHANNEL, reader.nsqd, reader.lookupd, reader.config, 1,
                               reader._wal, reader.confirm_after, reader.retention, clock=clock)
    reader._feed.recover()
    reader._committed = reader._feed.ledger.committed
    return reader


def _key(row: dict) -> tuple[str, bytes]:
    return (row["nsqd"], row["message_id"].encode())


class World:
    """The broker, the source, Spark's logs and sink; `act` runs one step of the story."""

    TICK = 2.0  # seconds between two steps of the story

    def __init__(self, checkpoint: str, eager: bool = True) -> None:
        self.checkpoint = checkpoint
        self.eager = eager  # posted calls run at once (else when the story says)
        self.posted: list = []
        self.broker = Broker()
        self.broker.on_fin = self.check_fin
        self.broker.on_fin_failed = self.fin_failed
        self.clock = Clock()
        self.clock.advance(1_000)
        self.reader = open_source(checkpoint, self.clock)
        # Spark's side
        self.offset_log: list[tuple[int, int]] = []
        self.commit_log: set[int] = set()
        self.sink: dict[int, list[dict]] = {}
        self.rows_of_span: dict[tuple[int, int], list[dict]] = {}
        self.initial: int | None = None
        self.phase = "idle"
        self.offered: tuple[int, int] | None = None

    def fin_failed(self, conn: Conn, message_id: bytes) -> None:
        """E_FIN_FAILED reaches the consumer a round trip after the FIN was written.

        The consumer passes it to the feed's `fin_failed(conn, message_id)`
        if the feed has one; without it the error is only logged (as txnsq's
        Consumer.connection_error does).
        """
        def arrived() -> None:
            listener = getattr(self.feed, "fin_failed", None)
            if listener is not None:
                listener(conn, message_id)

        self.clock.callLater(0.001, arrived)

    # -- the reactor thread ----------------------------------------------------------

    def call(self, function, *args, timeout=None, **kwargs):
        self.run_posted()
        return function(*args, **kwargs)

    def post(self, function, *args) -> None:
        self.posted.append((function, args))
        if self.eager:
            self.run_posted()

    def run_posted(self) -> None:
        while self.posted:
            function, args = self.posted.pop(0)
            function(*args)

    @property
    def feed(self) -> ChannelFeed:
        return self.reader._feed

    def offset(self, n: int) -> dict:
        return {"topic": TOPIC, "channel": CHANNEL, "offset": n}

    # -- invariants ---------------------------------------------------------------

    def committed_keys(self) -> set:
        return {_key(r) for batch in self.commit_log for r in self.sink[batch]}

    def check_fin(self, key) -> None:
        assert key in self.committed_keys(), f"FIN of {key} before Spark committed its batch"

    def check(self) -> None:
        seen = Counter(_key(r) for rows in self.sink.values() for r in rows)
        twice = [k for k, n in seen.items() if n > 1]
        assert not twice, f"messages in more than one batch (or twice in one): {twice}"
        for rows in self.sink.values():
            for row in rows:
                key = _key(row)
                body, timestamp = self.broker.published[key]
                assert row["body"] == body and row["topic"] == TOPIC and row["channel"] == CHANNEL
                assert row["timestamp"] == EPOCH + timedelta(microseconds=timestamp // 1000)
                assert 1 <= row["attempts"] <= self.broker.attempts[key]

    # -- Spark ----------------------------------------------------------------------

    def spark_step(self, limit: int) -> None:
        """One step of MicroBatchExecution, from where the last one stopped."""
        reader = self.reader
        if self.phase == "idle":
            if self.offset_log:
                start = self.offset_log[-1][1]
            else:
                if self.initial is None:
                    self.initial = reader.initialOffset()["offset"]
                start = self.initial
            wanted = ReadAllAvailable() if limit > 3 else ReadMaxRows(limit)
            end = reader.latestOffset(self.offset(start), wanted)["offset"]
            assert end >= start, f"latestOffset({start}) went back to {end}"
            if end > start:
                self.offered = (start, end)
                self.phase = "offered"
        elif self.phase == "offered":
            self.offset_log.append(self.offered)
            if len(self.offset_log) > 1:  # Spark lets the source drop the batch before
                reader.commit(self.offset(self.offset_log[-2][1]))
            self.phase = "logged"
        elif self.phase == "logged":
            start, end = self.offset_log[-1]
            rows = []
            for part in reader.partitions(self.offset(start), self.offset(end)):
                for arrow in rows_of(part.value):
                    rows.extend(arrow.to_pylist())
            assert len(rows) == end - start
            first = self.rows_of_span.setdefault((start, end), rows)
            assert rows == first, f"batch {start}-{end} replayed with other rows"
            self.phase = "read"
        elif self.phase == "read":
            span = self.offset_log[-1]
            self.sink[len(self.offset_log) - 1] = self.rows_of_span[span]
            self.phase = "written"
        elif self.phase == "written":
            self.commit_log.add(len(self.offset_log) - 1)
            self.phase = "committed"
        elif self.phase == "committed":
            reader.commit(self.offset(self.offset_log[-1][1]))
            self.phase = "idle"

    def crash(self, marker_only: bool = False) -> None:
        """The driver dies (Spark and the source's process): then both start again."""
        if marker_only and self.phase == "idle" and self.offset_log:
            # died inside latestOffset(start): the committed marker written, no FIN sent yet
            self.reader._wal.set_committed(self.offset_log[-1][1])
        self.posted.clear()
        for address in BROKERS:
            self.broker.drop(address, None)
        self.reader = open_source(self.checkpoint, self.clock)
        last = len(self.offset_log) - 1
        self.phase = "logged" if self.offset_log and last not in self.commit_log else "idle"
        self.offered = None

    # -- the story ------------------------------------------------------------------

    def act(self, action: tuple) -> None:
        kind = action[0]
        broker = self.broker
        if kind == "publish":
            for _ in range(action[3]):
                broker.publish(action[1], action[2])
        elif kind == "deliver":
            for _ in range(action[2]):
                broker.deliver(action[1], self.feed)
        elif kind == "timeout":
            if broker.in_flight:
                keys = list(broker.in_flight)
                broker.time_out(keys[action[1] % len(keys)])
        elif kind == "drop":
            broker.drop(BROKERS[action[1]], self.feed)
        elif kind == "spark":
            for _ in range(action[2]):
                self.spark_step(action[1])
        elif kind == "crash":
            self.crash(action[1])
        elif kind == "stop":
            # the query stopped (not crashed): the source hands back what it holds, then
            # the driver ends, and the query is started again on the same checkpoint
            self.reader.stop()
            self.crash()
        elif kind == "reactor":
            self.run_posted()
        elif kind == "wait":
            self.clock.advance(action[1])
        # the feed's LoopingCall: time passes between any two events
        self.clock.advance(self.TICK)
        self.feed.tick()
        self.check()

    def drain(self) -> None:
        """No more faults: the broker delivers everything, Spark runs until nothing is left.

        The broker also times out what the source no longer holds (it never
        TOUCHes those), as nsqd does after its message timeout.
        """
        ledger = self.feed.ledger
        for _ in range(20):
            while self.phase != "idle":
                self.spark_step(1000)
            self.run_posted()
            held = {id(m) for m in (*ledger.pending.values(), *ledger.live.values())}
            for key, message in list(self.broker.in_flight.items()):
                if id(message) not in held:
                    self.broker.time_out(key)
            while self.broker.queue:
                self.broker.deliver(0, self.feed)
            if not self.broker.in_flight and not ledger.pending:
                break
            self.spark_step(1000)
            self.check()
        self.spark_step(1000)  # settles the last batch if nothing else did
        self.run_posted()
        self.check()


_ACTION = st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 1), st.sampled_from([b"", b"x", b"\x00\xff"]),
              st.integers(1, 3)),
    st.tuples(st.just("deliver"), st.just(0), st.integers(1, 3)),  # nsqd's queue order
    st.tuples(st.just("deliver"), st.integers(0, 20), st.integers(1, 3)),
    st.tuples(st.just("timeout"), st.integers(0, 20)),
    st.tuples(st.just("timeout"), st.integers(0, 20)),
    st.tuples(st.just("drop"), st.integers(0, 1)),
    st.tuples(st.just("spark"), st.integers(1, 4), st.integers(1, 6)),  # 4: all available
    st.tuples(st.just("crash"), st.booleans()),
    st.tuples(st.just("reactor")),
    st.tuples(st.just("reactor")),
    st.tuples(st.just("stop")),
    st.tuples(st.just("wait"), st.sampled_from([CONFIRM_AFTER + 1, 3600.0])),
)


@contextmanager
def world(eager: bool = True):
    """A World in a fresh checkpoint, TopicStreamReader's reactor calls routed to it."""
    checkpoint = tempfile.mkdtemp(prefix="mqd-ledger-")
    try:
        w = World(checkpoint, eager)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(reactor_thread, "call", w.call)
            mp.setattr(reactor_thread, "post", w.post)
            yield w
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(_ACTION, max_size=60))
def test_every_message_lands_in_exactly_one_committed_batch_whatever_fails(actions):
    """Any interleaving of deliveries, timeouts, lost connections, Spark steps, driver
    crashes and FIN confirmations: no duplicate, no loss, same rows on replay, FIN only
    after commit, and at the end nothing left in flight anywhere."""
    with world(eager=False) as w:
        for action in actions:
            w.act(action)
        w.drain()
        published = Counter(list(w.broker.published))
        output = Counter(_key(r) for b in sorted(w.commit_log) for r in w.sink[b])
        assert output == published
        assert not w.broker.queue and not w.broker.in_flight
        assert w.broker.finished == set(published)
        assert not w.feed.ledger.pending and not w.feed.ledger.live


CONFIRMED, FIN_UNCONFIRMED, FIN_NEVER_SENT = range(3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.tuples(st.integers(1, 3), st.sampled_from(range(3))), max_size=6),
       last=st.integers(0, 3), steps=st.integers(0, 6), new=st.integers(0, 3))
def test_a_restart_after_any_mix_of_settled_and_unsettled_batches_keeps_exactly_once(
        batches, last, steps, new):
    """Committed batches are forgotten one by one, each when its own FINs are confirmed,
    so a crash leaves the WAL with any subset of them: none may be lost to the restart."""
    with world() as w:
        for size, fate in batches:
            for _ in range(size):
                w.broker.publish(0, b"m")
                w.broker.deliver(0, w.feed)
            for _ in range(5):  # latestOffset, offset log, partitions, sink, commit log
                w.spark_step(5)
            if fate == FIN_NEVER_SENT:
                w.broker.drop(BROKERS[0], w.feed)
            w.spark_step(5)  # reader.commit: the FINs
            if fate == FIN_UNCONFIRMED:
                w.broker.drop(BROKERS[0], w.feed)
            w.clock.advance(CONFIRM_AFTER + 1)
            w.feed.tick()
            w.broker.deliver(0, w.feed)
        for _ in range(last):
            w.broker.publish(0, b"last")
            w.broker.deliver(0, w.feed)
        for _ in range(steps):
            w.spark_step(5)
        w.crash()
        for _ in range(new):
            w.broker.publish(0, b"new")
        w.drain()
        assert Counter(_key(r) for b in sorted(w.commit_log) for r in w.sink[b]) == Counter(
            list(w.broker.published))
        assert not w.broker.in_flight and not w.feed.ledger.pending and not w.feed.ledger.live


# -- scenarios the property found, and the rules one by one ------------------------------------


def test_a_crash_after_the_wal_write_offers_the_same_batch_again():
    with world() as w:
        for i in range(3):
            w.broker.publish(0, b"m%d" % i)
            w.broker.deliver(0, w.feed)
        w.spark_step(2)  # latestOffset: batch 0-2 in the WAL
        assert w.offered == (0, 2)
        w.crash()
        assert w.reader.latestOffset(w.offset(0), ReadMaxRows(3)) == w.offset(2)
        w.drain()
        assert sorted(_key(r) for r in w.sink[0]) == [(BROKERS[0], b"%016x" % i) for i in (0, 1)]
        assert Counter(_key(r) for rows in w.sink.values() for r in rows) == Counter(list(w.broker.published))


def test_redeliveries_of_an_open_batch_are_held_and_of_a_committed_one_finished():
    with world() as w:
        w.broker.publish(0, b"a")
        w.broker.deliver(0, w.feed)
        for _ in range(4):
            w.spark_step(5)  # offered, logged, read, written: batch 0 not committed yet
        key = (BROKERS[0], b"%016x" % 0)
        w.broker.time_out(key)
        w.broker.deliver(0, w.feed)
        assert w.feed.ledger.live[key] is w.broker.in_flight[key]  # held, newest kept
        assert not w.feed.ledger.pending
        w.spark_step(5)  # commit log
        assert key in w.broker.in_flight  # nothing FINished before reader.commit/latestOffset
        w.spark_step(5)  # reader.commit: FIN
        assert key in w.broker.finished and not w.broker.in_flight


def test_a_batch_is_forgotten_only_when_the_broker_read_every_fin(tmp_path):
    """A FIN on a connection that closed may never have been read: that batch stays."""
    with world() as w:
        for i in range(2):
            w.broker.publish(i, b"m")
            w.broker.deliver(0, w.feed)
        lost = w.broker.in_flight[(BROKERS[1], b"%016x" % 0)]
        for _ in range(6):
            w.spark_step(5)  # one batch of both, committed, FINs sent
        w.broker.drop(BROKERS[1], w.feed)
        w.clock.advance(CONFIRM_AFTER + 1)
        w.feed.tick()
        assert w.reader._wal.spans() == [(0, 2)]  # BROKERS[1]'s FIN may be lost: still known
        assert lost.delegate.connected is False
        w.broker.deliver(0, w.feed)  # the redelivery is FINished at once, not a new row
        assert not w.feed.ledger.pending and not w.broker.in_flight


def test_a_wal_batch_is_removed_once_all_its_fins_are_confirmed():
    with world() as w:
        for _ in range(3):
            w.broker.publish(0, b"m")
            w.broker.deliver(0, w.feed)
        for _ in range(6):
            w.spark_step(5)
        w.clock.advance(CONFIRM_AFTER - 1)
        w.feed.tick()
        assert w.reader._wal.spans() == [(0, 3)]
        w.clock.advance(2)
        w.feed.tick()
        assert w.reader._wal.spans() == []
        assert not w.feed.ledger.batches and not w.feed.ledger.batch_of


def test_a_stale_fin_is_not_a_confirmation():
    """A message whose delivery timed out after its batch was committed: the FIN fails
    (E_FIN_FAILED, connection up) and the broker delivers it again, maybe much later
    (behind a backlog). The batch must still know it, however many seconds pass."""
    with world() as w:
        w.broker.publish(0, b"late")
        w.broker.deliver(0, w.feed)
        for _ in range(5):
            w.spark_step(5)  # committed in Spark's log, no FIN yet
        key = (BROKERS[0], b"%016x" % 0)
        w.broker.time_out(key)  # e.g. held past nsqd's --max-msg-timeout
        w.spark_step(5)  # reader.commit: FIN of the timed-out delivery fails at the broker
        assert w.broker.failed_fins == 1
        w.clock.advance(CONFIRM_AFTER + 1)
        w.feed.tick()
        w.broker.deliver(0, w.feed)
        assert not w.feed.ledger.pending, "a committed message came back as new"
        w.drain()
        assert Counter(_key(r) for rows in w.sink.values() for r in rows) == {key: 1}


def test_a_restart_recovers_batches_after_a_forgotten_one():
    """Batches are forgotten in any order (each when its own FINs are confirmed): the WAL
    may hold 0-1 and 2-3 without 1-2. A restart must still know 2-3 and continue at 3."""
    with world() as w:
        keys = []
        for batch in range(3):
            w.broker.publish(0, b"b%d" % batch)
            w.broker.deliver(0, w.feed)
            keys.append((BROKERS[0], b"%016x" % batch))
            w.spark_step(5)  # latestOffset: settles the batch before, offers this one
            for _ in range(5):
                w.spark_step(5)  # offset log ... reader.commit: FIN
            if batch == 0:
                w.broker.drop(BROKERS[0], w.feed)  # batch 0's FIN may be lost: kept
                w.broker.deliver(0, w.feed)  # redelivered: FINished at once, on a new connection
        w.clock.advance(CONFIRM_AFTER + 1)
        w.feed.tick()
        assert w.reader._wal.spans() == [(0, 1)]
        # batch 3-4: in Spark's offset log, not committed, when the driver dies
        w.broker.publish(0, b"b3")
        w.broker.deliver(0, w.feed)
        w.spark_step(5)
        w.spark_step(5)
        assert w.reader._wal.spans() == [(0, 1), (3, 4)]
        w.crash()
        assert w.phase == "logged"  # Spark replays batch 3-4 from the WAL
        w.broker.deliver(0, w.feed)  # the dead process's delivery of b3, again
        assert not w.feed.ledger.pending, "a message of the replayed batch came back as new"
        assert w.feed.ledger.end == 4
        w.broker.publish(0, b"b4")
        w.drain()
        assert Counter(_key(r) for rows in w.sink.values() for r in rows) == Counter(list(w.broker.published))


def _deliver(w: World, n: int) -> None:
    for i in range(n):
        w.broker.publish(0, b"m%d" % i)
        w.broker.deliver(0, w.feed)


def test_a_lost_mqd_source_stops_the_replay_of_a_logged_batch_saying_how_to_start_afresh():
    with world() as w:
        _deliver(w, 3)
        w.spark_step(2)  # latestOffset: batch 0-2 in the WAL
        w.spark_step(2)  # in Spark's offset log
        shutil.rmtree(Path(w.checkpoint) / "mqd-source")
        w.crash()
        assert w.phase == "logged"  # Spark replays batch 0-2
        with pytest.raises(WalError) as e:
            w.spark_step(2)
        text = str(e.value)
        assert "does not hold offsets 0-2, which the query's checkpoint has already read" in text
        assert "mqd-source directory was lost or altered" in text
        assert "To start afresh on purpose, run the query with a new checkpointLocation" in text


def test_a_lost_mqd_source_after_a_committed_batch_stops_rather_than_go_back():
    """Spark's next batch starts at 2; a fresh WAL would offer offsets from 0 again, below it."""
    with world() as w:
        _deliver(w, 2)
        for _ in range(6):  # latestOffset ... reader.commit: batch 0-2 committed
            w.spark_step(5)
        assert w.phase == "idle" and w.offset_log == [(0, 2)]
        shutil.rmtree(Path(w.checkpoint) / "mqd-source")
        w.crash()
        _deliver(w, 1)
        for _attempt in range(2):  # the query started again on the same checkpoint: the same error
            with pytest.raises(WalError, match="does not hold offsets 0-2, which the query's checkpoint"):
                w.spark_step(5)
            w.crash()
        assert w.reader._wal.committed() == 0  # no marker made the new directory look complete


# -- the ledger's rules, directly ------------------------------------------------------


def _ledger_with_batch(committed: bool) -> tuple[Ledger, list]:
    ledger = Ledger()
    keys = [("b", b"%016x" % i) for i in range(3)]
    for k in keys:
        assert ledger.delivered(k, ("d1", k)) == NEW
    taken = ledger.take(None)
    ledger.add_batch(0, 3, [k for k, _ in taken], [d for _, d in taken], since=10.0)
    if committed:
        assert [(k, d) for _b, k, d in ledger.commit(3)] == taken
    return ledger, keys


def test_take_gives_the_oldest_pending_first_and_a_second_delivery_replaces_the_first():
    ledger = Ledger()
    for i in range(5):
        ledger.delivered(("b", b"%d" % i), i)
    assert ledger.delivered(("b", b"1"), "newer") == NEW
    assert ledger.take(2) == [(("b", b"0"), 0), (("b", b"1"), "newer")]
    assert ledger.take(None) == [(("b", b"2"), 2), (("b", b"3"), 3), (("b", b"4"), 4)]
    assert ledger.take(3) == []


def test_given_back_deliveries_come_first_again():
    ledger = Ledger()
    for i in range(3):
        ledger.delivered(("b", b"%d" % i), i)
    taken = ledger.take(2)
    ledger.delivered(("b", b"9"), 9)
    ledger.give_back(taken)
    assert [k[1] for k, _ in ledger.take(None)] == [b"0", b"1", b"2", b"9"]


def test_give_back_keeps_the_newest_delivery_of_a_message_redelivered_meanwhile():
    """The WAL write runs off the reactor: a taken message may be redelivered meanwhile.
    If the write fails, the pending delivery must be the newest (the one that can be
    FINished), in the taken one's place."""
    ledger = Ledger()
    key = ("b", b"1")
    ledger.delivered(key, "first")
    taken = ledger.take(None)
    assert ledger.delivered(key, "second") == NEW  # no batch holds it while being written
    ledger.give_back(taken)
    assert ledger.take(None) == [(key, "second")]


def test_a_batch_written_while_one_of_its_messages_was_redelivered_keeps_the_newest():
    """Same race, the write succeeding: the batch holds the message, and its live
    delivery (what commit FINishes) must be the redelivery, not the stale one."""
    ledger = Ledger()
    key = ("b", b"1")
    ledger.delivered(key, "first")
    ledger.take(None)
    ledger.delivered(key, "second")
    ledger.add_batch(0, 1, [key], ["first"])
    assert not ledger.pending
    assert ledger.live[key] == "second"
    assert [d for _b, _k, d in ledger.commit(1)] == ["second"]


def test_deliveries_of_held_and_committed_messages():
    ledger, keys = _ledger_with_batch(committed=False)
    assert ledger.delivered(keys[0], "d2") == HELD
    assert ledger.live[keys[0]] == "d2" and not ledger.pending
    assert [d for _b, _k, d in ledger.commit(3)] == ["d2", ("d1", keys[1]), ("d1", keys[2])]
    assert ledger.delivered(keys[0], "d3") == FINISH
    assert not ledger.live and not ledger.pending and ledger.in_flight() == 0
    assert ledger.commit(3) == [] and ledger.commit(2) == []


def test_a_batch_may_leave_a_gap_but_never_overlap():
    """Recovery adds the WAL's batches with holes where settled ones were forgotten."""
    ledger, _keys = _ledger_with_batch(committed=False)
    with pytest.raises(ValueError, match="overlaps offsets up to 3"):
        ledger.add_batch(2, 5, [("b", b"x")])
    ledger.add_batch(4, 5, [("b", b"y")])
    assert ledger.end == 5 and [(b.start, b.end) for b in ledger.open_batches(4)] == [(4, 5)]


def test_open_batches_are_the_uncommitted_run_from_an_offset():
    ledger = Ledger()
    for start in range(0, 4):
        ledger.add_batch(start, start + 1, [("b", b"%d" % start)], ["d"])
    ledger.commit(2)
    assert [(b.start, b.end) for b in ledger.open_batches(2)] == [(2, 3), (3, 4)]
    assert [(b.start, b.end) for b in ledger.open_batches(3)] == [(3, 4)]
    assert ledger.open_batches(0) == [] and ledger.open_batches(4) == []


def test_confirm_forgets_a_batch_only_when_every_key_is_confirmed():
    """A forgotten batch's messages are unknown again: a redelivery after that is NEW
    and would be a second row. That is the known limit of `expire`: a broker that
    redelivers a message more than the retention after its batch was committed."""
    ledger, keys = _ledger_with_batch(committed=True)
    assert ledger.confirm(keys[:2]) == []
    assert ledger.delivered(keys[0], "again") == FINISH
    assert ledger.confirm([("b", b"unknown"), keys[1]]) == []
    [done] = ledger.confirm(keys[2:])
    assert (done.start, done.end) == (0, 3)
    assert not ledger.batches and not ledger.batch_of
    assert ledger.confirm(keys) == []
    assert ledger.delivered(keys[0], "after") == NEW  # the known limit


def test_confirm_ignores_keys_of_an_open_batch():
    ledger, keys = _ledger_with_batch(committed=False)
    assert ledger.confirm(keys) == []
    assert ledger.delivered(keys[0], "d2") == HELD


def test_expire_forgets_only_committed_batches_older_than_the_limit():
    """The known limit: after expiry a redelivery is NEW (see confirm's test)."""
    ledger, keys = _ledger_with_batch(committed=False)
    assert ledger.expire(before=1e9) == []  # open: kept however old
    ledger.commit(3)
    assert ledger.expire(before=10.0) == []  # written at 10.0: not older than 10.0
    [gone] = ledger.expire(before=10.5)
    assert (gone.start, gone.end) == (0, 3)
    assert ledger.delivered(keys[1], "late") == NEW


def test_feed_expiry_removes_the_wal_file_of_a_batch_whose_fins_were_never_confirmed():
    with world() as w:
        w.reader = open_source(w.checkpoint, w.clock, retention=60.0)
        w.broker.publish(0, b"m")
        w.broker.deliver(0, w.feed)
        for _ in range(6):
            w.spark_step(5)
        w.broker.drop(BROKERS[0], w.feed)  # its FIN never confirmed
        w.clock.advance(59)
        w.feed.tick()
        assert w.reader._wal.spans() == [(0, 1)]
        w.clock.advance(2)
        w.feed.tick()
        assert w.reader._wal.spans() == []
