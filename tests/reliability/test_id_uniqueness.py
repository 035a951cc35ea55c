"""No message id is ever issued twice on a data path, whatever the clock and restarts do.

Hypothesis draws histories of an in-process broker (task.Clock, a real
LMDB environment in a temporary directory for the LMDB modes): publishes
of one to a few thousand messages, clock steps forward and back (a
millisecond to a day), lease renewals that land late or never, clean
restarts and crashes (the broker dropped without closing). Over the
whole history the ids issued are strictly increasing (so unique, and
sortable across runs too), and after every step the id lease on disk is
above every id issued: nothing was issued past an unpersisted lease.

MQD_ID_EXAMPLES makes a longer hunt (default 40 per mode).
"""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock

import mqd.nsqd.broker
from mqd.message import IdFactory, IdTimeLease
from mqd.nsqd.metadata import ID_LEASE_FILE
from tests.support.held_jobs import HeldJobs
from tests.support.inprocess_broker import START_TIME, new_broker

EXAMPLES = int(os.environ.get("MQD_ID_EXAMPLES", "40"))
DATA_ROOT = os.environ.get("MQD_MODEL_TMP") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
DAY = 86_400.0
MODES = {
    "memory": {"backend": "memory"},
    "lmdb": {"backend": "lmdb"},
    "durable": {"backend": "lmdb", "durable": True},
}

step = st.one_of(
    st.tuples(st.just("publish"), st.sampled_from([1, 2, 50, 4097])),
    st.tuples(st.just("clock"), st.sampled_from(
        [-DAY, -3600.0, -1.8, -0.5, -0.001, 0.001, 0.3, 1.8, 6.0, 11.0, 3600.0])),
    st.tuples(st.just("restart"), st.sampled_from(["clean", "crash"])),
    # Lease renewals stop landing ("late": the write never ends) or land ("land").
    st.tuples(st.just("lease"), st.sampled_from(["late", "land"])),
)


class Recording(IdFactory):
    """The broker's IdFactory, keeping every id it issues."""

    __slots__ = ("issued",)

    def __init__(self, node_id: int, lease: IdTimeLease | None = None) -> None:
        super().__init__(node_id, lease)
        self.issued: list[bytes] = []

    def new_ids(self, count: int, now_ns: int) -> list[bytes]:
        ids = super().new_ids(count, now_ns)
        self.issued.extend(ids)
        return ids


def lease_bound(path: str) -> int:
    with open(os.path.join(path, ID_LEASE_FILE), "rb") as f:
        raw = f.read()
    return max(int(raw[i:i + 16], 16) for i in (0, 26))


class History:
    def __init__(self, path: str, flags: dict) -> None:
        self.path = path
        self.flags = flags
        self.issued: list[bytes] = []
        self.late: HeldJobs | None = None
        # The time of the last id issued (ids increase: the largest).
        self.top = -1
        clock = Clock()
        clock.advance(START_TIME)
        self.broker = self._open(clock)

    def _open(self, clock: Clock):
        broker = new_broker(self.path, clock, **self.flags)
        broker.topic("t").channel("c")
        return broker

    def run(self, kind: str, arg) -> None:
        broker = self.broker
        if kind == "publish":
            broker.topic("t").publish([b"x"] * arg)
            broker.clock.advance(0)
        elif kind == "clock":
            broker.clock.advance(arg)
        elif kind == "lease":
            lease = broker.metadata.lease
            if arg == "late" and self.late is None:
                self.late = lease.runner = HeldJobs()
            elif arg == "land" and self.late is not None:
                self.late.run()
        else:
            self.restart(clean=arg == "clean")
        ids = self.broker.ids.issued
        if ids:
            self.top = max(self.top, int(ids[-1], 16) >> 22)
        assert self.top < lease_bound(self.path), "an id was issued past the lease on disk"

    def restart(self, clean: bool) -> None:
        broker = self.broker
        self.issued += broker.ids.issued
        if clean:
            assert broker.close() is None
        else:
            broker.clock.advance(0)
            broker.metadata.close()
            if getattr(broker.store, "env", None) is not None:
                broker.store.env.close()
        if self.late is not None:
            self.late.run()  # a renewal that ends after the process is gone changes nothing
            self.late = None
        clock = Clock()
        clock.advance(broker.clock.seconds())
        self.broker = self._open(clock)

    def finish(self) -> list[bytes]:
        self.issued += self.broker.ids.issued
        self.broker.close()
        return self.issued


@pytest.mark.parametrize("mode", list(MODES))
def test_no_id_is_issued_twice_whatever_the_clock_and_restarts_do(mode):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(steps=st.lists(step, max_size=25))
    def check(steps):
        with tempfile.TemporaryDirectory(dir=DATA_ROOT) as path, pytest.MonkeyPatch.context() as mp:
            mp.setattr(mqd.nsqd.broker, "IdFactory", Recording)
            history = History(path, MODES[mode])
            for kind, arg in steps:
                history.run(kind, arg)
            issued = history.finish()
        assert len(set(issued)) == len(issued), "an id was issued twice"
        assert issued == sorted(issued), "ids went backwards across the history"

    check()
