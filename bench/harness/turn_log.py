"""The durable floors' log: each reactor turn's records one chunk, synced by a thread, landed in order.

Shared by the durable probe (bench/harness/probe.py) and mqd's log-floor
store (bench/harness/logfloor.py): the least a durable relay on one
reactor must do. Callers append a turn's records to `pieces` and call
`turn()`; when the turn ends the chunk goes to a writer thread, which
writes every chunk handed over meanwhile and fdatasyncs them once (a
group commit), then hands them back to the reactor in order. The file is
mqd's own publish log (`PublishLog`): preallocated, written in place, and
started over in place when a chunk would run past its end (these floors
replay nothing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from backends.lmdb_log import PublishLog

__all__ = ["TurnLog"]


class TurnLog:
    """A turn's `pieces` as one synced chunk; `take()` says what waits for it, `land(taken)` lets it go.

    `take` is called on the reactor when the turn's chunk is cut, and
    returns whatever the owner must release once the chunk is synced (its
    answers, its messages); `land` is called on the reactor with those, a
    list of one per chunk, in order.
    """

    def __init__(self, reactor, path: str, size: int, take: Callable[[], object],
                 land: Callable[[list], None]) -> None:
        self.reactor = reactor
        self.file = PublishLog(path, size)
        self.size = size
        self.pieces: list[bytes] = []
        self._take = take
        self._land = land
        self._call = None
        self._lock = threading.Lock()
        self._outbox: list[tuple[bytes, object]] = []
        self._writing = False
        self._closed = False

    def turn(self) -> None:
        """Something was logged: cut the chunk when this reactor turn ends."""
        if self._call is None and not self._closed:
            self._call = self.reactor.callLater(0, self._take_off)

    def close(self) -> None:
        """Log nothing more: a chunk not cut yet is dropped, one being written lands, then the file closes.

        Never waits: with the writer busy, the writer closes the file when
        it is done, so its descriptor is not closed (and reused) under it.
        """
        if self._call is not None:
            self._call.cancel()
            self._call = None
        with self._lock:
            self._closed = True
            if self._writing:
                return
        self.file.close()

    def _take_off(self) -> None:
        self._call = None
        chunk = (b"".join(self.pieces), self._take())
        self.pieces = []
        with self._lock:
            self._outbox.append(chunk)
            if self._writing:
                return
            self._writing = True
        self.reactor.callInThread(self._write_out)

    def _write_out(self) -> None:
        log = self.file
        while True:
            with self._lock:
                if not self._outbox:
                    self._writing = False
                    if self._closed:
                        self.file.close()
                    return
                batch, self._outbox = self._outbox, []
            data = [chunk[0] for chunk in batch]
            if log.size + sum(map(len, data)) > self.size:
                log.empty()  # no replay here: start over, in place
            log.append(data)
            self.reactor.callFromThread(self._land, [chunk[1] for chunk in batch])
