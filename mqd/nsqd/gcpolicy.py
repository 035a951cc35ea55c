"""The broker's policy for CPython's cyclic garbage collector.

A backlog held in memory is millions of `Message` objects, each tracked by
the cyclic GC, though none of them is ever part of a cycle: they are freed by
reference counting when FINed. CPython runs a full (generation-2) collection
each time the long-lived objects grow by 25%, and each one traverses all of
them: with a multi-million backlog that is seconds of reactor stall, and in
py-spy's flame graphs of the bench a third of the broker's samples.

So what survives a collection is moved to the permanent generation
(`gc.freeze`), and later collections traverse only what is newer: a queued
message is traversed once, by the first collection after it was made, not
by every collection of its life. (Freezing after full collections only was
measured too: it left 13% of the samples of a writer flame graph in the
collector, against 8.5% freezing after generation-1 and -2 ones, 32% with
neither.)

And the generation-0 threshold is raised from CPython's 700 to 50,000. The
collector counts allocations of tracked objects net of deallocations and
starts the count again at each collection. A broker relaying messages
makes them in bursts (a channel's copies of an MPUB) and frees them a
little later (on FIN): at 700 nearly every burst set off a collection,
which traversed messages about to be FINished. With 10 channels under
NSQ's bench that was about 5,000 collections in 8 s, a tenth of the
reactor's CPU; at 50,000 a steady flow sets off none, and collections come
with growth only: a backlog building up, or cyclic garbage, which is still
reclaimed after at most 50,000 allocations. Survivors of generation-0
collections are frozen too: left to generation 1, they would be traversed
again by its collection, every tenth, over 500,000 objects out of the
cache (a backlog building up was relayed at 0.86× of what it was with
the threshold at 700 that way, and at 1.04× with them frozen).

Frozen objects are still freed by reference counting; only cyclic garbage
among them (a closed connection's protocol/transport cycle, a
Failure with its traceback) would wait forever, so every `thaw_interval`
they are unfrozen and collected in one full pass, then frozen again: cyclic
garbage is reclaimed within that bound, at the price of one pass over the
backlog per interval instead of one per 25% of growth.
"""

from __future__ import annotations

import gc
import time

from twisted.application import service
from twisted.internet.task import LoopingCall

from mqd.logs import get_logger

__all__ = ["GCPolicy"]

log = get_logger(__name__)

# Full collections slower than this are logged at info level when thawing.
_SLOW_THAW = 0.5
# Net allocations of tracked objects between generation-0 collections.
YOUNG_THRESHOLD = 50_000


class GCPolicy(service.Service):
    """Raises the generation-0 threshold, freezes the survivors of every collection, thaws periodically.

    On stop the collector's thresholds are restored, the frozen objects
    given back to it and the hook removed.
    """

    name = "gc-policy"

    def __init__(self, clock=None, thaw_interval: float = 300.0,
                 young_threshold: int = YOUNG_THRESHOLD) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.clock = clock
        self.thaw_interval = thaw_interval
        self.young_threshold = young_threshold
        self._loop: LoopingCall | None = None
        self._thresholds: tuple[int, ...] | None = None
        self.thaws = 0

    def startService(self) -> None:
        super().startService()
        # What start-up built (modules, options, listeners) lives as long as
        # the process: collect what of it is already garbage, keep the rest
        # out of every later traversal.
        gc.collect()
        gc.freeze()
        self._thresholds = gc.get_threshold()
        gc.set_threshold(self.young_threshold, *self._thresholds[1:])
        gc.callbacks.append(self._collected)
        self._loop = LoopingCall(self.thaw)
        self._loop.clock = self.clock
        self._loop.start(self.thaw_interval, now=False).addErrback(
            lambda f: log.failure("GC thaw loop failed", f))

    def _collected(self, phase: str, info: dict) -> None:
        # Called by CPython around every collection, of any generation.
        if phase == "stop":
            gc.freeze()

    def thaw(self) -> None:
        """Collect everything once, frozen objects included, then freeze the survivors again."""
        self.thaws += 1
        frozen = gc.get_freeze_count()
        start = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        took = time.perf_counter() - start
        emit = log.info if took >= _SLOW_THAW else log.debug
        emit("GC thaw: {frozen} frozen objects traversed, {found} unreachable, {took:.3f}s",
             frozen=frozen, found=found, took=took)

    def stopService(self):
        super().stopService()
        if self._loop is not None:
            if self._loop.running:
                self._loop.stop()
            self._loop = None
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None
        gc.unfreeze()
        return None
