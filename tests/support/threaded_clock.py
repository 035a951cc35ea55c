"""A task.Clock with threads that run when the test says so.

On a reactor with threads a durable LmdbStore acknowledges through its
publish log, written and synced by a thread. Here `callInThread` queues
the job and `run_threads()` runs it, so a test decides when a chunk is on
disk, and `clock.advance(0)` lands it on the "reactor" (`callFromThread`).
"""

from __future__ import annotations

from twisted.internet.interfaces import IReactorThreads
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from zope.interface import implementer

__all__ = ["ThreadedClock"]


@implementer(IReactorThreads)
class ThreadedClock(Clock):
    """A Clock whose threads run when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs: list = []

    def callInThread(self, f, *args, **kwargs) -> None:
        self.jobs.append((f, args, kwargs))

    def callFromThread(self, f, *args, **kwargs) -> None:
        self.callLater(0, f, *args, **kwargs)

    def getThreadPool(self) -> _Pool:
        """A pool for `deferToThreadPool` (the broker's metadata writes): its jobs wait with the others."""
        return _Pool(self)

    def suggestThreadPoolSize(self, size: int) -> None:
        pass

    def run_threads(self) -> int:
        """Run the jobs queued so far (not those they queue); how many ran."""
        jobs, self.jobs = self.jobs, []
        for f, args, kwargs in jobs:
            f(*args, **kwargs)
        return len(jobs)


class _Pool:
    """What `deferToThreadPool` needs of a thread pool, queueing on a ThreadedClock."""

    def __init__(self, clock: ThreadedClock) -> None:
        self.clock = clock

    def callInThreadWithCallback(self, on_result, f, *args, **kwargs) -> None:
        def job() -> None:
            try:
                result = f(*args, **kwargs)
            except BaseException:  # noqa: BLE001 - handed back as the pool would
                on_result(False, Failure())
            else:
                on_result(True, result)

        self.clock.callInThread(job)
