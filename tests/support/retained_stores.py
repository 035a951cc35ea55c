"""Stores with retained logs, driven step by step: every kind on its own clock, restarted or crashed.

A `LogStores` holds one store of a kind in a directory:

- "memory", "dummy": RAM, or nothing;
- "lmdb": LMDB in default mode (a commit per reactor turn);
- "durable": --durable on a task.Clock, which has no threads, so every
  commit is a synced LMDB transaction;
- "durable_log": --durable on a ThreadedClock, so commits go through the
  publish log, whose writer "thread" runs in `settle` (or when a test
  says so).

`settle()` runs what is due now (commits, chunks, landings); `restart()`
closes the store and opens a new one on the same directory (`reopen()`
only opens it, after a test closed the last one its way); `crash()`
drops the store without closing it (the environment and the publish log
closed as the process's death would), then opens a new one, which
replays the publish log.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from backends.dummy import DummyStore
from backends.memory import MemoryStore
from mqd.message import Message
from tests.support.inprocess_broker import START_TIME, lmdb_store
from tests.support.threaded_clock import ThreadedClock

__all__ = ["KINDS", "LMDB_KINDS", "LogStores", "records_of"]

KINDS = ("memory", "lmdb", "durable", "durable_log")
LMDB_KINDS = ("lmdb", "durable", "durable_log")


def records_of(stamps: list[int], start: int = 0, body: bytes = b"r") -> list[Message]:
    """Messages with these timestamps: id = 16 digits of start + i, body `body` + that number."""
    return [Message(b"%016d" % n, body + b"%d" % n, ts) for n, ts in enumerate(stamps, start)]


class LogStores:
    """One store of `kind` in `path` on its own clock (see the module)."""

    def __init__(self, kind: str, path: Any) -> None:
        self.kind = kind
        self.path = path
        self.clock = self._new_clock(START_TIME)
        self.store = self._open()

    @property
    def lmdb(self) -> bool:
        return self.kind in LMDB_KINDS

    @property
    def durable(self) -> bool:
        return self.kind.startswith("durable")

    @property
    def logged(self) -> bool:
        return self.kind == "durable_log"

    def _new_clock(self, at: float) -> Clock:
        clock = ThreadedClock() if self.logged else Clock()
        clock.advance(at)
        return clock

    def _open(self) -> Any:
        if self.kind == "memory":
            return MemoryStore()
        if self.kind == "dummy":
            return DummyStore()
        return lmdb_store(self.path, self.clock, durable=self.durable)

    def settle(self) -> None:
        """Run what is due now: the group commit, the publish log's writer, the chunks' landing."""
        clock = self.clock
        for _ in range(50):
            clock.advance(0)
            ran = clock.run_threads() if isinstance(clock, ThreadedClock) else 0
            if not ran and all(call.getTime() > clock.seconds() for call in clock.getDelayedCalls()):
                return
        raise AssertionError("calls due now keep being scheduled")

    def restart(self) -> None:
        """A clean shutdown and a new start on the same directory (RAM keeps nothing)."""
        self.settle()
        self.store.close()
        self.clock = self._new_clock(self.clock.seconds())
        self.store = self._open()

    def crash(self) -> None:
        """The process dies: no close, no checkpoint; a new store on the directory (RAM keeps nothing)."""
        if self.lmdb:
            self.store.env.close()
            if self.logged:
                self.store._log.close()
        self.clock = self._new_clock(self.clock.seconds())
        self.store = self._open()

    def reopen(self) -> None:
        """A new store on the directory, the last one closed already (by the test)."""
        self.clock = self._new_clock(self.clock.seconds())
        self.store = self._open()

    def close(self) -> None:
        """At the end of a test: run the writer's jobs (close waits for chunks being written), then close."""
        if isinstance(self.clock, ThreadedClock):
            self.clock.run_threads()
        self.store.close()
