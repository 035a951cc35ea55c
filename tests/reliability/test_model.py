"""Model-based test of the V2 protocol: a hypothesis state machine
drives a publisher and consumers of an in-process broker (task.Clock,
StringTransports) and checks it, after every step, against a model of where
each message is.

Per channel every acknowledged message is in exactly one place: queued,
deferred, in flight (owned by one consumer), finished or emptied, so
depth + in flight + deferred == published - finished - emptied at every
step. Each delivery is checked against the model: the message was
deliverable (queued, or deferred and due), never to two consumers at once,
attempts one more than last time, never more in flight than RDY; FIN/REQ
work for the owner only; nothing deliverable waits while a consumer on its
channel has RDY to spare. Restarts: a clean one keeps everything on LMDB (in
flight comes back queued, deferred keeps its deadline) and nothing but the
topics and channels on the memory backend. In --durable mode a crash keeps
every acknowledged message that was not FINished, nothing FINished comes
back, and (a crash in the middle of a turn) a PUB not yet answered is gone
while a FIN not yet committed is undone; LMDB's records are compared with
the model after every step.

Four variants: memory backend, LMDB default mode, LMDB --durable with a
synced commit per turn (a reactor without threads), and --durable with the
publish log, whose writer "thread" runs when the test says so
(tests.support.threaded_clock): chunks pile up while it has not run, and a
crash may come after a chunk is written but before it lands (the PUB,
never answered, comes back; the FIN in it holds). The runs
are derandomized (the same examples on every run, no example database);
MQD_MODEL_EXAMPLES (and MQD_MODEL_STEPS, steps per example) make a longer
hunt, e.g. MQD_MODEL_EXAMPLES=1000.

A step that loops forever (a broker bug can make Channel.deliver spin) is cut
off by SIGALRM after MQD_MODEL_STEP_LIMIT seconds, and an LMDB queue read
that returns more than the queue held (the way into that loop) fails at the
read, before delivery can spin on it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from twisted.internet.task import Clock

from backends.lmdb import KEY, RECORD, LmdbQueue
from tests.support.inprocess_broker import START_TIME, new_broker, scan
from tests.support.invariants import check_durable_invariant, stored_keys
from tests.support.message_model import (
    DEFERRED,
    DONE,
    EMPTIED,
    GONE,
    IN_FLIGHT,
    LOST,
    QUEUED,
    STEP_LIMIT,
    Consumer,
    M,
    NegativeDepth,
    bounded,
    guarded,
)
from tests.support.threaded_clock import ThreadedClock
from tests.support.v2_client import Client
from tests.support.v2_frames import HEARTBEAT, Msg, cmd, dpub, err, identify, mpub, ok, pub

EXAMPLES = int(os.environ.get("MQD_MODEL_EXAMPLES", "200"))
STEPS = int(os.environ.get("MQD_MODEL_STEPS", "60"))
# Data paths on tmpfs where there is one: --durable fsyncs every commit, and
# a crash here is simulated in-process, so a real disk adds only waiting.
DATA_ROOT = os.environ.get("MQD_MODEL_TMP") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)

TOPICS = ("t0", "t1")
CHANNELS = ("a", "b")
WHERE = tuple((t, c) for t in TOPICS for c in CHANNELS)
MAX_CONSUMERS = 4
# RDY counts, the simplest (what shrinking goes to) first: a consumer that takes messages.
RDY = (2, 1, 0, 5)
# Time passes in slices of one of these (seconds), each ending with a queue
# scan; every consumer sends a NOP after each, as a live client answers
# heartbeats, so none misses two in a row (they come every 30 s).
SCAN_EVERY = (10.0, 0.25)
# How long the broker is down across a restart.
DOWN_TIMES = (0.01, 2, 30)

VARIANTS = {
    "memory": {"backend": "memory"},
    "lmdb": {"backend": "lmdb"},
    "durable": {"backend": "lmdb", "durable": True},
    # --durable on a reactor with threads: acknowledged through the publish log.
    "durable_log": {"backend": "lmdb", "durable": True},
}
# Small, so the overflow backend is used all the time; 0 puts everything there.
MEM_QUEUE_SIZES = (2, 0, 50)


@pytest.fixture
def depth_tripwire(monkeypatch):
    """Raise NegativeDepth at the LMDB read that takes a queue's depth below zero.

    With depth -1 the queue is truthy but reads nothing, and Channel.deliver
    retries it forever; failing at the read names the cause instead.
    """
    real = LmdbQueue.read

    def read(self, count):
        depth = self._depth
        out = real(self, count)
        if len(out) > depth or self._depth < 0:
            raise NegativeDepth(
                f"LMDB queue {self.name}: read {len(out)} messages with depth {depth} (now {self._depth}): "
                f"{[(KEY.unpack(m.key)[1] if m.key else None, m.body) for m in out]}"
            )
        return out

    monkeypatch.setattr(LmdbQueue, "read", read)


# -- the state machine ---------------------------------------------------------------------


class BrokerModel(RuleBasedStateMachine):
    """Subclassed per variant (`variant` set on the subclass)."""

    variant = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.flags = dict(VARIANTS[self.variant])
        self.lmdb = self.flags["backend"] == "lmdb"
        self.durable = bool(self.flags.get("durable"))
        self.logged = self.variant == "durable_log"
        self.path = tempfile.mkdtemp(prefix="mqd-model-", dir=DATA_ROOT)
        self.broker = None

    @initialize(mem=st.sampled_from(MEM_QUEUE_SIZES))
    def start(self, mem):
        """The broker, with a mem-queue-size of `mem` (--durable bypasses memory queues)."""
        if not self.durable:
            self.flags["mem_queue_size"] = mem
        clock = self._new_clock()
        clock.advance(START_TIME)
        self.broker = new_broker(self.path, clock, **self.flags)
        assert (getattr(self.broker.store, "_log", None) is not None) == self.logged, "publish log or not"
        # channel (topic, name) -> {body: M}; channels exist before any publish.
        self.model: dict[tuple[str, str], dict[bytes, M]] = {}
        for t in TOPICS:
            topic = self.broker.topic(t)
            for c in CHANNELS:
                topic.channel(c)
                self.model[(t, c)] = {}
        self.consumers: list[Consumer] = []
        self.paused: set[tuple[str, str]] = set()
        self.published = self.disrupted_at = 0
        self.ports = iter(range(20000, 60000))
        self.consumer_ids = itertools.count(1)
        self.restarted = False
        self.publisher = self._new_publisher()
        self._settle()

    # -- plumbing -------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.broker.clock.seconds()

    def _new_publisher(self) -> Client:
        p = Client(self.broker, port=next(self.ports))
        assert p.request(identify(heartbeat_interval=-1)) == [ok()]
        return p

    def _new_clock(self) -> Clock:
        """The broker's reactor: with threads (run by `_settle`) for the publish log."""
        return ThreadedClock() if self.logged else Clock()

    def _settle(self) -> None:
        """Run what is due now: the group commit, the log's writer, topic drains, durable OKs."""
        clock = self.broker.clock
        for _ in range(20):
            clock.advance(0)
            ran = clock.run_threads() if self.logged else 0
            if not ran and all(call.getTime() > clock.seconds() for call in clock.getDelayedCalls()):
                return
        raise AssertionError("calls due now keep being scheduled")

    def _channel(self, topic: str, name: str):
        return self.broker.topics[topic].channels[name]

    def _frames(self, c: Consumer) -> list:
        return [f for f in c.client.read() if f != HEARTBEAT]

    def _take_deliveries(self, expected: dict | None = None) -> None:
        """Read every consumer; check each delivery against the model and record it.

        `expected` maps a consumer to the non-message frames it must have got.
        """
        self._settle()
        now = self.now
        for c in list(self.consumers):
            frames = self._frames(c)
            others = [f for f in frames if not isinstance(f, Msg)]
            want = (expected or {}).get(c, [])
            assert others == want, f"{c}: got {others}, expected {want}"
            assert not c.client.closed, f"{c} was disconnected"
            msgs = self.model[(c.topic, c.channel)]
            for f in frames:
                if isinstance(f, Msg):
                    self._delivered(c, msgs, f, now)

    def _delivered(self, c: Consumer, msgs: dict, f: Msg, now: float) -> None:
        m = msgs.get(f.body)
        assert m is not None, f"{c} got a message never published to {c.topic}:{c.channel}: {f}"
        assert (c.topic, c.channel) not in self.paused, f"{c} got {f.body!r} from a paused channel"
        assert m.id in (None, f.id), f"{f.body!r}: id {f.id!r}, earlier {m.id!r}"
        assert f.timestamp == m.timestamp, f"{f.body!r}: timestamp {f.timestamp}, published at {m.timestamp}"
        assert m.state not in GONE, f"{c} got {f.body!r} again after it was {m.state}"
        assert m.state != IN_FLIGHT, f"{c} got {f.body!r} while it is in flight to {m.owner}"
        assert m.state == QUEUED or m.due <= now, (
            f"{c} got {f.body!r} at {now - START_TIME:.3f} s, deferred until {m.due - START_TIME:.3f} s"
        )
        if m.attempts_known:
            assert f.attempts == m.attempts + 1, f"{f.body!r}: attempts {f.attempts}, expected {m.attempts + 1}"
        else:
            assert 1 <= f.attempts <= m.attempts + 1, (
                f"{f.body!r}: attempts {f.attempts} after a crash, expected 1..{m.attempts + 1}"
            )
        m.id = f.id
        m.attempts = f.attempts
        m.attempts_known = True
        m.state = IN_FLIGHT
        m.owner = c
        m.delivered_at = now
        m.deadline = now + c.client.proto.msg_timeout
        c.in_flight.add(m)
        assert len(c.in_flight) <= c.rdy, f"{c} has more in flight than its RDY"

    def _requeue(self, m: M, delay: float = 0.0) -> None:
        if m.owner is not None:
            m.owner.in_flight.discard(m)
        m.owner = None
        if delay > 0:
            m.state = DEFERRED
            m.due = self.now + delay
        else:
            m.state = QUEUED
            m.due = 0.0

    def _publish(self, data: bytes, topic: str, bodies: list[bytes], delay: float, replies: int) -> None:
        """Publish; one OK per command (after the commit, when durable)."""
        self.publisher.send(data)
        self._settle()
        assert self.publisher.read() == [ok()] * replies
        self._published(topic, bodies, delay)
        self._take_deliveries()

    def _published(self, topic: str, bodies: list[bytes], delay: float = 0.0) -> None:
        """The model's messages for `bodies`, published to every channel of `topic` now."""
        for msgs in (v for (t, _), v in self.model.items() if t == topic):
            for b in bodies:
                msgs[b] = M(b, DEFERRED if delay > 0 else QUEUED, int(self.now * 1e9),
                            due=self.now + delay if delay > 0 else 0.0)

    def _bodies(self, topic: str, n: int) -> list[bytes]:
        first = self.published
        self.published += n
        return [b"%s-%d" % (topic.encode(), i) for i in range(first, first + n)]

    def _copy(self, c: Consumer, msg_id: bytes) -> M | None:
        """The model's message with this id on `c`'s channel."""
        for m in self.model[(c.topic, c.channel)].values():
            if m.id == msg_id:
                return m
        return None

    def _in_flight(self) -> list[M]:
        return [m for c in self.consumers for m in sorted(c.in_flight, key=lambda m: m.body)]

    # -- publishing -----------------------------------------------------------------------

    @rule(do=st.tuples(st.sampled_from(["PUB", "MPUB", "DPUB"]), st.sampled_from(TOPICS), st.integers(1, 4),
                       st.sampled_from([500, 0, 1, 3000, 20_000])))
    @guarded
    def publish(self, do):
        """n PUBs in one write (published as one batch), MPUB of n, or DPUB of one after ms.

        do = (verb, topic, n, ms).
        """
        verb, topic, n, ms = do
        if verb == "DPUB":
            bodies = self._bodies(topic, 1)
            self._publish(dpub(topic, ms, bodies[0]), topic, bodies, ms / 1000, 1)
            return
        bodies = self._bodies(topic, n)
        if verb == "MPUB":
            self._publish(mpub(topic, bodies), topic, bodies, 0.0, 1)
        else:
            self._publish(b"".join(pub(topic, b) for b in bodies), topic, bodies, 0.0, n)

    @precondition(lambda self: self.logged)
    @rule(topic=st.sampled_from(TOPICS), turns=st.integers(2, 3))
    @guarded
    def publish_while_the_writer_is_busy(self, topic, turns):
        """A PUB per reactor turn while the log's writer has not run: its chunks wait, then go in one write.

        Each is answered once its chunk has landed (or a checkpoint, a
        synced LMDB commit, took it), in order; a crash later finds them all.
        """
        clock = self.broker.clock
        bodies = self._bodies(topic, turns)
        for body in bodies:
            self.publisher.send(pub(topic, body))
            clock.advance(0)
        clock.run_threads()
        self._settle()
        assert self.publisher.read() == [ok()] * turns
        self._published(topic, bodies)
        self._take_deliveries()

    # -- consumers ------------------------------------------------------------------------

    @precondition(lambda self: len(self.consumers) < MAX_CONSUMERS)
    @rule(topic=st.sampled_from(TOPICS), channel=st.sampled_from(CHANNELS), rdy=st.sampled_from(RDY),
          msg_timeout=st.sampled_from([0, 5000]))
    @guarded
    def sub(self, topic, channel, rdy, msg_timeout):
        """A new consumer: IDENTIFY with its own msg_timeout (ms; 0: the broker's), SUB, RDY."""
        client = Client(self.broker, port=next(self.ports))
        if msg_timeout:
            assert client.request(identify(msg_timeout=msg_timeout)) == [ok()]
        assert client.request(cmd("SUB", topic, channel)) == [ok()]
        c = Consumer(client, topic, channel, next(self.consumer_ids))
        self.consumers.append(c)
        c.rdy = rdy
        client.send(cmd("RDY", rdy))
        self._take_deliveries()

    @precondition(lambda self: self.consumers)
    @rule(i=st.integers(0, MAX_CONSUMERS - 1), rdy=st.sampled_from(RDY))
    @guarded
    def rdy(self, i, rdy):
        c = self.consumers[i % len(self.consumers)]
        c.rdy = rdy
        c.client.send(cmd("RDY", rdy))
        self._take_deliveries()

    def _pause(self, where: tuple[str, str], paused: bool) -> None:
        """/channel/pause or /unpause; nsqd answers once the metadata is written, as metadata.write_now does."""
        channel = self._channel(*where)
        if paused:
            channel.pause()
            self.paused.add(where)
        else:
            channel.unpause()
            self.paused.discard(where)
        self.broker.metadata.write_now()
        self._take_deliveries()

    def _flying(self, i: int) -> M:
        flying = self._in_flight()
        return flying[i % len(flying)]

    @precondition(lambda self: any(c.in_flight for c in self.consumers))
    @rule(i=st.integers(0, 1000))
    @guarded
    def fin(self, i):
        m = self._flying(i)
        m.owner.client.fin(m.id)
        m.owner.in_flight.discard(m)
        m.state, m.owner = DONE, None
        self._take_deliveries()

    @precondition(lambda self: any(c.in_flight for c in self.consumers))
    @rule(i=st.integers(0, 1000), ms=st.sampled_from([0, 1000, 5000, 30_000]))
    @guarded
    def req(self, i, ms):
        m = self._flying(i)
        m.owner.client.req(m.id, ms)
        self._requeue(m, ms / 1000)
        self._take_deliveries()

    @precondition(lambda self: any(c.in_flight for c in self.consumers))
    @rule(i=st.integers(0, 1000))
    @guarded
    def touch(self, i):
        m = self._flying(i)
        m.owner.client.touch(m.id)
        latest = m.delivered_at + self.broker.options.max_msg_timeout
        m.deadline = min(self.now + m.owner.client.proto.msg_timeout, latest)
        self._take_deliveries()

    @precondition(lambda self: len(self.consumers) >= 2 and any(c.in_flight for c in self.consumers))
    @rule(i=st.integers(0, 1000), j=st.integers(0, MAX_CONSUMERS - 1), verb=st.sampled_from(["FIN", "REQ"]))
    @guarded
    def not_owner(self, i, j, verb):
        """FIN/REQ of a message in flight to another consumer fails and changes nothing."""
        m = self._flying(i)
        # Copies of a message share its id across a topic's channels: skip
        # consumers that hold their own copy in flight.
        others = [c for c in self.consumers if c is not m.owner and self._copy(c, m.id) not in c.in_flight]
        if not others:
            return
        c = others[j % len(others)]
        mine = self._copy(c, m.id)
        reason = "client does not own message" if mine is not None and mine.state == IN_FLIGHT else "ID not in flight"
        mid = m.id.decode()
        if verb == "FIN":
            c.client.fin(m.id)
            want = err(f"E_FIN_FAILED FIN {mid} failed {reason}")
        else:
            c.client.req(m.id, 0)
            want = err(f"E_REQ_FAILED REQ {mid} failed {reason}")
        self._settle()
        self._take_deliveries({c: [want]})

    @precondition(lambda self: any(
        m.state in GONE and m.id is not None
        for c in self.consumers for m in self.model[(c.topic, c.channel)].values()))
    @rule(i=st.integers(0, 1000), j=st.integers(0, MAX_CONSUMERS - 1))
    @guarded
    def fin_finished(self, i, j):
        """FIN of a message finished (or emptied) before: ID not in flight."""
        chosen = [c for c in self.consumers
                  if any(m.state in GONE and m.id for m in self.model[(c.topic, c.channel)].values())]
        c = chosen[j % len(chosen)]
        done = sorted((m.body, m.id) for m in self.model[(c.topic, c.channel)].values()
                      if m.state in GONE and m.id)
        _, mid = done[i % len(done)]
        c.client.fin(mid)
        self._settle()
        self._take_deliveries({c: [err(f"E_FIN_FAILED FIN {mid.decode()} failed ID not in flight")]})

    @precondition(lambda self: self.consumers)
    @rule(i=st.integers(0, MAX_CONSUMERS - 1))
    @guarded
    def disconnect(self, i):
        c = self.consumers.pop(i % len(self.consumers))
        c.client.lose()
        for m in list(c.in_flight):
            self._requeue(m)
        self._settle()
        self._take_deliveries()

    # -- time -----------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([0.5, 1, 3, 10, 25, 61]), every=st.sampled_from(SCAN_EVERY))
    @guarded
    def advance(self, seconds, every):
        """Time passes, with a queue scan `every` seconds: in flight times out, deferred comes due."""
        left = float(seconds)
        while left > 0:
            step = min(left, every)
            left -= step
            self.broker.clock.advance(step)
            for c in self.consumers:
                c.client.send(cmd("NOP"))
            scan(self.broker)
            now = self.now
            for msgs in self.model.values():
                for m in msgs.values():
                    if (m.state == IN_FLIGHT and m.deadline <= now) or (m.state == DEFERRED and m.due <= now):
                        self._requeue(m)
            self._settle()
            self._take_deliveries()

    # -- restarts -------------------------------------------------------------------------

    def _reopen(self, down: float) -> None:
        """The next run of the broker on the same data-path, `down` seconds after the last one stopped.

        Never at the very same time: message ids are made from the time, and
        a process that starts takes longer than the id's 1.05 ms tick.
        """
        clock = self._new_clock()
        clock.advance(self.now + down)
        self.consumers = []
        self.broker = new_broker(self.path, clock, **self.flags)
        self.publisher = self._new_publisher()
        self.restarted = True
        self._settle()

    @precondition(lambda self: self.published > self.disrupted_at)
    @rule(how=st.sampled_from(["restart", "crash", "crash mid-turn", "empty", "pause", "unpause",
                               "crash after the write"]),
          down=st.sampled_from(DOWN_TIMES),
          where=st.sampled_from(WHERE))
    @guarded
    def disrupt(self, how, down, where):
        """Restart the broker on the same data-path `down` seconds later, or empty, pause or unpause a channel.

        restart (clean): LMDB keeps everything; memory keeps only topics and
        channels. crash (LMDB; on memory a clean restart): the process dies
        after its last commit; no close(), memory is lost. --durable keeps
        every message not FINished; the default mode keeps exactly the unread
        records (as nsqd's disk queue: what was read or held in memory is
        lost). crash mid-turn (--durable): a FIN and a PUB arrive in the turn
        the process dies in, so neither reaches LMDB: the PUB was never
        acknowledged and is gone, the FINished message comes back (at least
        once). crash after the write (the publish log; elsewhere crash
        mid-turn): that turn's chunk is on disk, but the process dies before
        it lands: the PUB, never answered, is there after the restart and
        the FIN holds. With the publish log, a crash follows a publish
        whose OK makes every earlier FIN and rewrite durable (FINs alone
        wait for the next chunk or checkpoint: at least once), and LMDB's
        records stay behind the log until a checkpoint. empty, pause,
        unpause: /channel/empty, /pause or
        /unpause of channel `where` (a paused channel delivers nothing; the
        flag survives restarts).

        Only once something was published since the last one: hypothesis
        would otherwise draw these at nearly every other step.
        """
        self.disrupted_at = self.published
        if how == "empty":
            self._empty(*where)
            return
        if how in ("pause", "unpause"):
            self._pause(where, how == "pause")
            return
        if how == "restart" or not self.lmdb:
            self._clean_restart()
        elif not self.durable or how == "crash":
            self._crash()
        elif how == "crash after the write" and self.logged:
            self._crash(mid_turn=True, written=True)
        else:
            self._crash(mid_turn=True)
        self._reopen(down)
        assert sorted(self.broker.topics) == list(TOPICS)
        for t in TOPICS:
            assert sorted(self.broker.topics[t].channels) == list(CHANNELS)

    def _empty(self, topic: str, channel: str) -> None:
        """Queued, in-flight and deferred messages are dropped; consumers stay."""
        self._channel(topic, channel).empty()
        for m in self.model[(topic, channel)].values():
            if m.state not in GONE:
                if m.owner is not None:
                    m.owner.in_flight.discard(m)
                m.state, m.owner = EMPTIED, None
        self._take_deliveries()

    def _clean_restart(self) -> None:
        self.broker.close()
        for c in self.consumers:
            c.client.lose()
        for msgs in self.model.values():
            for body, m in list(msgs.items()):
                if m.state == IN_FLIGHT:
                    self._requeue(m)
                if not self.lmdb and m.state not in GONE:
                    del msgs[body]  # documented: queued messages do not survive on memory

    def _crash(self, mid_turn: bool = False, written: bool = False) -> None:
        """The process dies: after its last commit, in the middle of a turn, or (`written`) after the turn's chunk is on disk."""
        broker = self.broker
        if self.logged:
            # Its OK makes the FINs and rewrites before it durable.
            (body,) = self._bodies(TOPICS[0], 1)
            self._publish(pub(TOPICS[0], body), TOPICS[0], [body], 0.0, 1)
        if mid_turn:
            flying = self._in_flight()
            fin = flying[0] if flying else None
            if fin is not None:
                fin.owner.client.fin(fin.id)
            (body,) = self._bodies(TOPICS[0], 1)
            self.publisher.send(pub(TOPICS[0], body))
            assert self.publisher.transport.value() == b"", "durable PUB answered before its commit"
            assert broker.store._pending()
            if written:
                broker.clock.advance(0)  # the turn ends: its chunk goes to the writer
                assert broker.clock.run_threads() == 1, "no chunk for the turn"
                assert self.publisher.transport.value() == b"", "PUB answered before its chunk landed"
                self._published(TOPICS[0], [body])
                if fin is not None:
                    fin.owner.in_flight.discard(fin)
                    fin.state, fin.owner = DONE, None
            elif fin is not None:
                self._requeue(fin)
        else:
            broker.clock.advance(0)
            assert not (broker.store._log_writer.in_flight if self.logged else broker.store._pending())
        kept = None if self.durable else self._stored_bodies()
        broker.metadata.close()
        broker.store.env.close()
        if self.logged:
            broker.store._log.close()
        for where, msgs in self.model.items():
            for m in msgs.values():
                if m.state == IN_FLIGHT:
                    self._requeue(m)
                if m.state in GONE:
                    continue
                m.attempts_known = False
                if kept is not None:
                    if m.body not in kept[where]:
                        m.state = LOST
                    elif kept[where][m.body]:
                        m.state, m.due = DEFERRED, kept[where][m.body]
                    else:
                        self._requeue(m)

    def _stored_bodies(self) -> dict[tuple[str, str], dict[bytes, float]]:
        """Per channel, body -> deferral deadline of the records LMDB holds; each must be a message not finished."""
        store = self.broker.store
        qids = {self._channel(*where)._queue.backend.qid: where for where in WHERE}
        kept: dict[tuple[str, str], dict[bytes, float]] = {where: {} for where in WHERE}
        with store.env.begin(db=store.data_db) as txn:
            for key, value in txn.cursor():
                where = qids.get(KEY.unpack(key)[0])
                if where is not None:
                    body = bytes(value[RECORD.size:])
                    m = self.model[where].get(body)
                    assert m is not None and m.state not in GONE, (
                        f"{where}: LMDB keeps {body!r}, {m.state if m else 'never published'}")
                    kept[where][body] = RECORD.unpack_from(value)[2]
        return kept

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def accounted(self):
        """Per channel, broker and model agree on where every message is."""
        with bounded(STEP_LIMIT):
            self._check()

    def _check(self) -> None:
        broker = self.broker
        for t in TOPICS:
            topic = broker.topics[t]
            assert topic.depth() == 0, f"topic {t} holds {topic.depth()} with channels to take them"
        for (t, c), msgs in self.model.items():
            ch = self._channel(t, c)
            states = [m.state for m in msgs.values()]
            queued, deferred, flying = states.count(QUEUED), states.count(DEFERRED), states.count(IN_FLIGHT)
            depth, in_flight, held = ch.depth(), ch.in_flight_count(), ch.deferred_count()
            where = (f"{t}:{c}: broker depth {depth} + in flight {in_flight} + deferred {held}; "
                     f"model queued {queued} + in flight {flying} + deferred {deferred}")
            assert depth >= 0 and ch.backend_depth() >= 0, where
            assert depth + in_flight + held == queued + deferred + flying, where
            assert in_flight == flying, where
            if self.restarted and self.lmdb:
                # Deferred messages read back from LMDB count in depth until read.
                assert held <= deferred, where
            else:
                assert held == deferred and depth == queued, where
            assert ch.paused == ((t, c) in self.paused), f"{where}: paused {ch.paused}"
            ready = [k for k in self.consumers if (k.topic, k.channel) == (t, c) and k.rdy > len(k.in_flight)]
            assert not (queued and ready and not ch.paused), f"{where}: {ready} ready yet nothing delivered"
        for k in self.consumers:
            assert k.client.proto.in_flight_count == len(k.in_flight), k
        if self.lmdb:
            self._check_records()

    def _check_records(self) -> None:
        """What LMDB holds after the commit: durable, one record per message not finished;
        default mode, the unread overflow only."""
        broker = self.broker
        store = broker.store
        # With the publish log every chunk has landed, and LMDB takes the
        # records at its next checkpoint: they are counted as it will hold them.
        assert not (store._log_writer.in_flight if self.logged else store._pending())
        if self.durable:  # LMDB's records cross-checked against the channels
            check_durable_invariant(broker)
        counts: dict[int, int] = {}
        if self.logged:
            for topic in broker.topics.values():
                for queue in (topic._queue, *(ch._queue for ch in topic.channels.values())):
                    counts[queue.backend.qid] = len(stored_keys(store, queue.backend))
        else:
            with store.env.begin(db=store.data_db) as txn:
                for key in txn.cursor().iternext(keys=True, values=False):
                    qid = KEY.unpack(key)[0]
                    counts[qid] = counts.get(qid, 0) + 1
        for t in TOPICS:
            topic = broker.topics[t]
            assert counts.get(topic._queue.backend.qid, 0) == 0, f"topic {t} has records"
            for c in CHANNELS:
                ch = topic.channels[c]
                stored = counts.get(ch._queue.backend.qid, 0)
                if self.durable:
                    live = sum(m.state not in GONE for m in self.model[(t, c)].values())
                    assert stored == live, f"{t}:{c}: {stored} LMDB records for {live} messages not finished"
                else:
                    assert stored == ch.backend_depth(), (
                        f"{t}:{c}: {stored} LMDB records, backend depth {ch.backend_depth()}")

    def teardown(self) -> None:
        if self.broker is None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        try:
            with bounded(STEP_LIMIT):
                if self.logged:
                    self.broker.clock.run_threads()  # close waits for chunks being written
                self.broker.close()
        except Exception:  # noqa: BLE001 - a broken broker must not hide the failure
            try:
                self.broker.metadata.close()
                if self.lmdb:
                    self.broker.store.env.close()
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(self.path, ignore_errors=True)


def _run(variant: str) -> None:
    machine = type(f"BrokerModel_{variant}", (BrokerModel,), {"variant": variant})
    run_state_machine_as_test(
        machine,
        settings=hsettings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_model_memory_backend():
    _run("memory")


def test_model_lmdb_default_mode_with_restarts(depth_tripwire):
    _run("lmdb")


def test_model_lmdb_durable_with_restarts_and_crashes(depth_tripwire):
    _run("durable")


def test_model_durable_publish_log_with_crashes(depth_tripwire, monkeypatch):
    # A log preallocated to 4 KiB, not 32 MiB per broker started (most of
    # the run's time): longer runs go past it, so the log is both written
    # in place and grown.
    monkeypatch.setattr("backends.lmdb._LOG_PREALLOCATE", 4 << 10)
    _run("durable_log")
