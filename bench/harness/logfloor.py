"""mqd with the least durable store: the floor of a durable mqd, for benchmarks only.

The probe (bench/harness/probe.py ``--durable``) is the floor of any
durable relay on one reactor; this is the floor of mqd itself. It runs the
real broker (``twistd mqd``, every flag as usual) with ``--durable`` on a
store that does only what durability cannot do without: each reactor turn's
publishes (length, id, body) and FINs (an id) are one chunk of a
preallocated log, written and fdatasync'ed by a thread, one sync for every
chunk handed over meanwhile; a publish is answered, and its messages become
readable, once their chunk has landed. Messages live in a deque per queue.
No checksum, checkpoint, replay, keys, deferred or failure handling: what
LMDB adds over this is what mqd's durable mode could still win back, and
what this store misses with mqd's whole broker in front of it no durable
store can win.

``python -m bench.harness.logfloor --tcp-address=127.0.0.1:0 --data-path=DIR
[mqd flags...]`` is the broker command (``bench both --broker-cmd``).
"""

from __future__ import annotations

import os
import struct
import sys
from collections import deque
from itertools import islice

from zope.interface import implementer

import backends
from backends.interface import IBackendQueue, IBackendStore
from backends.memory import take
from bench.harness.turn_log import TurnLog
from mqd.message import ID_SIZE

NAME = "logfloor"
# A published message in the log: data length (id and body), then the data.
_RECORD = struct.Struct(">I")
_LOG_SIZE = 32 << 20


@implementer(IBackendQueue)
class FloorQueue:
    """A deque; what is put waits in `_staged` until its chunk lands."""

    __slots__ = ("name", "_items", "_staged", "_store", "on_stored")

    def __init__(self, name: str, store: LogFloorStore) -> None:
        self.name = name
        self._items: deque = deque()
        self._staged: list = []
        self._store = store
        self.on_stored = None

    def put(self, messages, fresh: bool = False) -> None:
        store = self._store
        self._log_records(messages)
        if not self._staged:
            store.stage(self)
        self._staged += messages

    def _log_records(self, messages) -> None:
        log = self._store.log
        pack = _RECORD.pack
        append = log.pieces.append
        for m in messages:
            data = m.key = m.data  # a key: the broker hands it back to finish
            append(pack(len(data)))
            append(data)
        log.turn()

    def take_staged(self) -> list:
        """What was put since the last chunk was taken: it lands with that chunk."""
        staged, self._staged = self._staged, []
        return staged

    def landed(self, msgs: list) -> None:
        self._items.extend(msgs)
        if self.on_stored is not None:
            self.on_stored([])

    def read(self, count: int) -> list:
        return take(self._items, count)

    def peek(self, count: int) -> list:
        return list(islice(self._items, max(count, 0)))

    def finish(self, messages) -> None:
        log = self._store.log
        log.pieces += [m.data[:ID_SIZE] for m in messages]
        log.turn()

    def update(self, messages) -> None:
        """A requeue or a deferral rewrites the records: logged again, whole."""
        self._log_records(messages)

    def hold(self, messages, fresh: bool = False) -> bool:
        return False

    def depth(self) -> int:
        return len(self._items) + len(self._staged)

    def empty(self) -> None:
        self._items.clear()

    def delete(self) -> None:
        self._items.clear()

    def close(self) -> None:
        pass

    def sync(self) -> None:
        pass


@implementer(IBackendStore)
class LogFloorStore:
    durable = True

    def __init__(self, options=None, clock=None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.log = TurnLog(clock, os.path.join(options.data_path, "floor.log"), _LOG_SIZE,
                           self._take, self._land)
        self._queues: dict[str, FloorQueue] = {}
        self._waiters: list = []
        self._staged: list[FloorQueue] = []

    def open_queue(self, name: str) -> FloorQueue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = FloorQueue(name, self)
        return queue

    def stage(self, queue: FloorQueue) -> None:
        """`queue` has records waiting for the next chunk."""
        self._staged.append(queue)

    def when_durable(self, callback) -> None:
        self._waiters.append(callback)
        self.log.turn()

    def _take(self) -> tuple[list, list]:
        landing = []
        for queue in self._staged:
            landing.append((queue, queue.take_staged()))
        taken = (self._waiters, landing)
        self._waiters, self._staged = [], []
        return taken

    def _land(self, batch: list) -> None:
        for waiters, landing in batch:
            for callback in waiters:
                callback(None)
            for queue, msgs in landing:
                queue.landed(msgs)

    def begin_close(self) -> None:
        pass

    def close(self) -> None:
        self._queues.clear()
        self.log.close()


def main(argv: list[str] | None = None) -> None:
    """Run ``twistd mqd --durable --backend=logfloor`` with the given mqd flags."""
    from twisted.scripts.twistd import run

    backends.register(NAME, LogFloorStore)
    args = sys.argv[1:] if argv is None else argv
    sys.argv = ["twistd", "-n", "--pidfile=", "mqd", "--durable", f"--backend={NAME}", *args]
    run()


if __name__ == "__main__":
    main()
