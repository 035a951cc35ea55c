"""Chunks of the durable store's publish log on their way to disk, and their landing.

A chunk is numbered (its epoch) and encoded on the reactor, then handed
to one writer thread, which writes every chunk handed to it meanwhile
and syncs them with one fdatasync (backends.lmdb_log.PublishLog). The
chunks then land back on the reactor, oldest first: a chunk that landed
is durable (its publishers are answered, its messages readable); one
that failed fails every later one too, as none may be on disk after one
that is not. What landing does is the store's (the `landed`, `failed`
and `settled` callbacks); when LMDB takes what was logged (a checkpoint)
is the store's too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from backends.lmdb_log import PublishLog, encode_chunk
from backends.lmdb_pending import Chunk, Stager
from mqd.logs import get_logger

__all__ = ["Flight", "LogWriter"]

# The store speaks for its publish log: one namespace for every LMDB log line.
log = get_logger("backends.lmdb")


class Flight:
    """A chunk of the publish log being written, and what waits for it."""

    __slots__ = ("epoch", "chunk", "queues", "data", "error", "done")

    def __init__(self, epoch: int, chunk: Chunk[Stager], queues: list[Stager]) -> None:
        self.epoch = epoch
        self.chunk = chunk
        # The queues whose staged messages are in it: readable once it lands.
        self.queues = queues
        # The encoded chunk (header, payload); None if it could not be encoded.
        self.data: tuple[bytes, bytes] | None = (b"", b"")
        self.error: BaseException | None = None
        self.done = threading.Event()


class LogWriter:
    """The chunks handed to the writer thread and not landed yet, oldest first, and that thread.

    `epoch` is the last chunk's number (LMDB's last checkpoint's, at
    start-up). Once chunks land on the reactor, `landed(flight)` is called
    for each that was written, in order, then `settled()` if none is left
    in flight; for one that failed, `failed(flights)` with it and every
    later one, all failed and out of flight.
    """

    __slots__ = ("_log", "_clock", "_epoch", "_landed", "_failed", "_settled", "_flights", "_outbox",
                 "_outbox_lock", "_writing", "_broken")

    def __init__(self, publish_log: PublishLog, clock: Any, epoch: int, *,
                 landed: Callable[[Flight], None], failed: Callable[[list[Flight]], None],
                 settled: Callable[[], None]) -> None:
        self._log = publish_log
        self._clock = clock
        self._epoch = epoch
        self._landed = landed
        self._failed = failed
        self._settled = settled
        # Chunks handed to the writer thread and not landed yet, oldest first;
        # the writer's inbox, whether it is running, and the error that broke it.
        self._flights: deque[Flight] = deque()
        self._outbox: list[Flight] = []
        self._outbox_lock = threading.Lock()
        self._writing = False
        self._broken: BaseException | None = None

    @property
    def epoch(self) -> int:
        """The number of the last chunk taken (what a checkpoint records it holds)."""
        return self._epoch

    @property
    def in_flight(self) -> bool:
        """Chunks are being written, not landed yet."""
        return bool(self._flights)

    def take_off(self, chunk: Chunk[Stager], queues: list[Stager]) -> None:
        """Number and encode `chunk` (whose staged messages `queues` hold) and hand it to the writer thread."""
        self._epoch += 1
        flight = Flight(self._epoch, chunk, queues)
        self._flights.append(flight)
        try:
            flight.data = encode_chunk(flight.epoch, chunk.puts, chunk.updates, chunk.dels)
        except Exception:  # a bug, not the disk: fail the chunk as the disk would
            log.failure("publish log: encoding a chunk failed")
            flight.data = None
        with self._outbox_lock:
            self._outbox.append(flight)
            if self._writing:
                return
            self._writing = True
        self._clock.callInThread(self._write_out)

    def _write_out(self) -> None:
        """In a thread: write every chunk handed over, one fdatasync for all, then land them on the reactor.

        After a failed write, every chunk handed over until the reactor has
        dealt with the failure fails too, unwritten: chunks land in order,
        and none may be on disk after one that is not.
        """
        outbox = self._outbox
        while True:
            with self._outbox_lock:
                if not outbox:
                    self._writing = False
                    return
                batch = list(outbox)
                outbox.clear()
            error = self._broken
            if error is None:
                try:
                    pieces: list[bytes] = []
                    for flight in batch:
                        if flight.data is None:
                            raise ValueError("a chunk could not be encoded")
                        pieces += flight.data
                    self._log.append(pieces)
                except BaseException as e:
                    error = self._broken = e
            for flight in batch:
                flight.error = error
                flight.done.set()
            self._clock.callFromThread(self._land, batch)

    def land_now(self) -> None:
        """Wait for the chunks being written and land them (before a checkpoint or a close), without `settled`."""
        flights = list(self._flights)
        for flight in flights:
            flight.done.wait()
        if flights:
            self._land(flights, go_on=False)

    def _land(self, batch: list[Flight], go_on: bool = True) -> None:
        """On the reactor: chunks are synced (publishes answered, messages readable), or failed."""
        flights = self._flights
        for flight in batch:
            if not flights or flights[0] is not flight:
                continue  # landed already by land_now, or failed with an earlier one
            if flight.error is not None:
                self._failed(self._fail_all())
                return
            flights.popleft()
            self._landed(flight)
        if go_on and not flights:
            self._settled()

    def _fail_all(self) -> list[Flight]:
        """Every chunk in flight fails with the first: out of flight, the writer ready to write again."""
        failed = list(self._flights)
        self._flights.clear()
        for flight in failed:
            flight.done.wait()  # the writer fails them at once, unwritten
        self._broken = None
        return failed
