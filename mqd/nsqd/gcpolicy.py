"""The broker's policy for CPython's cyclic garbage collector.

A backlog held in memory is millions of `Message` objects, each tracked by
the cyclic GC, though none of them is ever part of a cycle: they are freed by
reference counting when FINed. CPython runs a full (generation-2) collection
each time the long-lived objects grow by 25%, and each one traverses all of
them: with a multi-million backlog that is seconds of reactor stall, and in
py-spy's flame graphs of the bench a third of the broker's samples.

So what survives a generation-1 or generation-2 collection (it has lived
through at least two collections: a queued message, not a temporary) is
moved to the permanent generation (`gc.freeze`), and later collections
traverse only what is newer: a queued message is traversed by the
generation-0 and -1 collections only, no longer by every full collection
of its life as well. Freezing after full collections only was measured
too: it left 13% of the samples of a writer flame graph in the collector,
against 8.5% this way (32% with neither).

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


class GCPolicy(service.Service):
    """Freezes survivors of generation-1 and -2 collections; thaws and collects periodically.

    The collector's thresholds are left as they are: a higher generation-0
    threshold (20,000) was measured too and did no better. On stop the
    frozen objects are given back to the collector and the hook removed.
    """

    name = "gc-policy"

    def __init__(self, clock=None, thaw_interval: float = 300.0) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.clock = clock
        self.thaw_interval = thaw_interval
        self._loop: LoopingCall | None = None
        self.thaws = 0

    def startService(self) -> None:
        super().startService()
        # What start-up built (modules, options, listeners) lives as long as
        # the process: collect what of it is already garbage, keep the rest
        # out of every later traversal.
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._collected)
        self._loop = LoopingCall(self.thaw)
        self._loop.clock = self.clock
        self._loop.start(self.thaw_interval, now=False).addErrback(
            lambda f: log.failure("GC thaw loop failed", f))

    def _collected(self, phase: str, info: dict) -> None:
        # Called by CPython around every collection, of any generation;
        # survivors of a generation-0 collection are mostly still in use
        # by the code that allocated them, so they are left to the collector.
        if phase == "stop" and info["generation"] >= 1:
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
        gc.unfreeze()
        return None
