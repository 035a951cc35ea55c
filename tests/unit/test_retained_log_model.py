"""Model-based test of the stores' retained logs: a hypothesis state machine against a model of each log.

Two topics' logs in one store of a kind (tests.support.retained_stores:
memory, LMDB default, LMDB --durable with a commit per turn, and with
the publish log) take batches of records whose timestamps follow a clock
that also steps back, expire by time, by bytes or both, restart, crash
(after the commit ran; in --durable also in the middle of a turn, the
chunk written or not), fail a commit, and are deleted. An append is a
batch, split past 4 records here, so expiry stops inside batches and
reads start and stop inside them. After every step, for each log:

- its epoch, earliest and latest are the model's, and `read` from the
  earliest returns exactly the model's records, offsets contiguous;
  `read_frames` frames the same; bounded reads stop where they must;
- no (epoch, offset) ever named two different records, across the whole
  run (restarts, crashes, failed commits and deletes included);
- retained bytes and the oldest timestamp are the model's, and
  `offset_for_timestamp` is the first record at or after each time tried;
- an expiry dropped exactly what its bounds said.

Runs are derandomized; MQD_LOG_MODEL_EXAMPLES and MQD_LOG_MODEL_STEPS
make a longer hunt.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import lmdb
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

from mqd.message import Message
from mqd.wire.log_frames import FRAME_OVERHEAD, iter_frames
from tests.support.retained_stores import KINDS, LogStores

EXAMPLES = int(os.environ.get("MQD_LOG_MODEL_EXAMPLES", "250"))
STEPS = int(os.environ.get("MQD_LOG_MODEL_STEPS", "40"))
# LMDB on tmpfs where there is one: --durable syncs every commit.
DATA_ROOT = os.environ.get("MQD_MODEL_TMP") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)

TOPICS = ("t0", "t1")
BIG = 1 << 40


@dataclass
class Expected:
    """What a log holds: its epoch, and the records (timestamp, data) from offset `earliest` on."""

    epoch: int
    earliest: int = 0
    records: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def latest(self) -> int:
        return self.earliest + len(self.records)

    def size(self) -> int:
        return sum(FRAME_OVERHEAD + len(data) for _, data in self.records)

    def expired(self, before: int, max_bytes: int) -> int:
        """How many head records `expire(before, max_bytes)` must drop."""
        size = self.size()
        gone = 0
        for ts, data in self.records:
            if not ((before > 0 and ts < before) or (max_bytes > 0 and size > max_bytes)):
                break
            size -= FRAME_OVERHEAD + len(data)
            gone += 1
        return gone


def fail_next_write(store) -> None:
    """The store's next write fails as on a full disk, once: a commit into LMDB or a chunk of the publish log."""
    armed = [True]
    write = store._write

    def failing_write() -> int:
        if armed.pop() if armed else False:
            raise lmdb.Error("No space left on device")
        return write()

    store._write = failing_write
    if store._log is not None:
        append = store._log.append

        def failing_append(data: list[bytes]) -> None:
            if armed.pop() if armed else False:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            append(data)

        store._log.append = failing_append


class LogModel(RuleBasedStateMachine):
    kind = "memory"

    @initialize()
    def start(self) -> None:
        self.path = tempfile.mkdtemp(prefix="mqd-log-model-", dir=DATA_ROOT)
        self.s = LogStores(self.kind, self.path)
        self.now = 1_700_000_000_000_000_000
        self.serial = 0
        self.logs = {t: self.s.store.open_log(t) for t in TOPICS}
        self.s.settle()
        self.expect = {t: Expected(log.epoch) for t, log in self.logs.items()}
        # Every record ever readable, by (epoch, offset): none may ever name another.
        self.seen: dict[tuple[int, int], tuple[int, bytes]] = {}

    # -- plumbing ------------------------------------------------------------------------

    def _records(self, sizes: list[int], steps: list[int]) -> list[Message]:
        out = []
        for size, step in zip(sizes, steps, strict=False):
            self.now += step * 1_000
            self.serial += 1
            out.append(Message(b"%016d" % self.serial, bytes([self.serial % 251]) * size, self.now))
        return out

    def _reopen(self, kept: bool) -> None:
        """The store was opened again: the logs too; `kept`, with what they held."""
        for t in TOPICS:
            log = self.logs[t] = self.s.store.open_log(t)
            if kept:
                assert log.epoch == self.expect[t].epoch
            else:
                assert log.epoch != self.expect[t].epoch
                self.expect[t] = Expected(log.epoch)
        self.s.settle()

    # -- rules ---------------------------------------------------------------------------

    @rule(topic=st.sampled_from(TOPICS), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
          steps=st.lists(st.integers(-3, 6), min_size=6, max_size=6))
    def append(self, topic: str, sizes: list[int], steps: list[int]) -> None:
        log = self.logs[topic]
        records = self._records(sizes, steps)
        before = log.latest()
        log.append(records, fresh=self.s.durable)
        assert log.latest() == (before if self.s.durable else before + len(records))
        self.s.settle()
        self.expect[topic].records += [(m.timestamp, m.data) for m in records]

    @rule(step=st.integers(-50, 50))
    def clock_steps(self, step: int) -> None:
        self.now += step * 1_000

    @rule(topic=st.sampled_from(TOPICS), age=st.integers(0, 8), share=st.sampled_from([0, 0, 1, 2, 3, 4]),
          slack=st.integers(-1, 1))
    def expire(self, topic: str, age: int, share: int, slack: int) -> None:
        expect = self.expect[topic]
        stamps = sorted({ts for ts, _ in expect.records})
        before = 0
        if age and stamps:
            before = stamps[min(age - 1, len(stamps) - 1)] + slack
        max_bytes = max(expect.size() * share // 4 + slack, 0) if share else 0
        want = expect.expired(before, max_bytes)
        assert self.logs[topic].expire(before, max_bytes) == want
        del expect.records[:want]
        expect.earliest += want
        self.s.settle()

    @rule()
    def restart(self) -> None:
        self.s.restart()
        self._reopen(kept=self.s.lmdb)

    @rule()
    def crash(self) -> None:
        """The process dies after the commit ran (all of it, publish log included)."""
        self.s.settle()
        self.s.crash()
        self._reopen(kept=self.s.lmdb)

    @precondition(lambda self: self.s.durable)
    @rule(topic=st.sampled_from(TOPICS), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4),
          written=st.booleans())
    def crash_mid_turn(self, topic: str, sizes: list[int], written: bool) -> None:
        """The process dies in the turn after a publish: what nobody could read yet may be lost.

        Without a commit, the records are gone (nobody saw them). With the
        publish log, the turn's chunk goes to the writer (or a checkpoint
        due takes everything into LMDB); a chunk written but not landed
        comes back from the publish log.
        """
        log = self.logs[topic]
        records = self._records(sizes, [1] * len(sizes))
        log.append(records, fresh=True)
        written = written and self.s.logged
        if self.s.logged:
            self.s.clock.advance(0)
            if written:
                self.s.clock.run_threads()
        kept = written or log.latest() > self.expect[topic].latest
        self.s.crash()
        if kept:
            self.expect[topic].records += [(m.timestamp, m.data) for m in records]
        self._reopen(kept=True)

    @precondition(lambda self: self.s.lmdb)
    @rule(topic=st.sampled_from(TOPICS), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4))
    def commit_fails(self, topic: str, sizes: list[int]) -> None:
        """A full disk fails the next write once: durable, its records are dropped; by default, retried."""
        s = self.s
        log = self.logs[topic]
        records = self._records(sizes, [1] * len(sizes))
        fail_next_write(s.store)
        answers: list = []
        log.append(records, fresh=s.durable)
        s.store.when_durable(answers.append)
        s.clock.advance(0)
        if s.logged:
            s.clock.run_threads()
            s.clock.advance(0)
        assert s.store.failure is not None
        if s.durable:
            assert answers and answers[0] is not None
            assert log.latest() == self.expect[topic].latest
        else:
            self.expect[topic].records += [(m.timestamp, m.data) for m in records]
        s.clock.advance(s.store.RETRY_AFTER)
        s.settle()
        assert s.store.failure is None

    @rule(topic=st.sampled_from(TOPICS))
    def delete(self, topic: str) -> None:
        self.logs[topic].delete()
        self.s.settle()
        log = self.logs[topic] = self.s.store.open_log(topic)
        assert log.epoch != self.expect[topic].epoch
        self.expect[topic] = Expected(log.epoch)
        self.s.settle()

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def logs_hold_what_the_model_says(self) -> None:
        for topic, log in self.logs.items():
            expect = self.expect[topic]
            assert (log.epoch, log.earliest(), log.latest()) == (expect.epoch, expect.earliest, expect.latest)
            got = log.read(log.earliest(), BIG, BIG)
            want = [(o, ts, data) for o, (ts, data) in enumerate(expect.records, expect.earliest)]
            assert got == want
            for offset, ts, data in got:
                assert self.seen.setdefault((log.epoch, offset), (ts, data)) == (ts, data), \
                    f"{topic}: offset {offset} of epoch {log.epoch} given to two records"
            framed, after = log.read_frames(log.earliest(), BIG, BIG)
            assert [(o, ts, i + b) for o, ts, _, i, b in iter_frames(framed)] == want
            assert after == expect.latest
            self._bounded_reads(log, want)
            assert log.retained_bytes() == expect.size()
            assert log.oldest_timestamp() == (expect.records[0][0] if expect.records else None)
            stamps = sorted({ts for ts, _ in expect.records})
            for t in {stamps[0] - 1, stamps[-1] + 1, *stamps[::3], *(s + 1 for s in stamps[1::4])} if stamps else {0}:
                first = next((o for o, ts, _ in want if ts >= t), expect.latest)
                assert log.offset_for_timestamp(t) == first, (topic, t)
        assert self.s.store.log_names() == sorted(TOPICS)
        if self.s.lmdb:
            assert self.s.store.queue_names() == []

    def _bounded_reads(self, log, want: list[tuple[int, int, bytes]]) -> None:
        """Reads from a few offsets with small bounds: the first record always, then within both."""
        if not want:
            return
        for start in {0, len(want) // 2, len(want) - 1}:
            exact = sum(len(data) for _, _, data in want[start:start + 2])  # two records' data, exactly
            for count, limit in ((1, BIG), (3, 20), (100, 0), (100, exact), (100, exact - 1)):
                got = log.read(want[start][0], count, limit)
                size = 0
                end = start
                while end < len(want) and end - start < count:
                    size += len(want[end][2])
                    if end > start and size > limit:
                        break
                    end += 1
                assert got == want[start:end], (start, count, limit)
                framed, after = log.read_frames(want[start][0], count, limit)
                assert [(o, ts, i + b) for o, ts, _, i, b in iter_frames(framed)] == got
                assert after == want[start][0] + len(got)
                assert log.frames_extent(want[start][0], count, limit) == (len(framed), after)

    def teardown(self) -> None:
        try:
            if getattr(self, "s", None) is not None:
                self.s.close()
        finally:
            shutil.rmtree(getattr(self, "path", ""), ignore_errors=True)


@pytest.mark.parametrize("kind", KINDS)
def test_retained_logs_follow_the_model(kind, monkeypatch):
    # The publish log preallocated to 4 KiB rather than 32 MiB per store opened.
    monkeypatch.setattr("backends.lmdb._LOG_PREALLOCATE", 4 << 10)
    # Blocks of 3 in the time index: a few records make several levels, and expiry trims them.
    monkeypatch.setattr("backends.retained_index.FANOUT", 3)
    # Batches of at most 4 records: an append of 5 or 6 is split.
    monkeypatch.setattr("backends.retained_index.MAX_BATCH_RECORDS", 4)
    machine = type(f"LogModel_{kind}", (LogModel,), {"kind": kind})
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
