"""A thread-pool stand-in whose jobs wait until the test runs them: a slow disk, a late write."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred


class HeldJobs:
    """Called as `deferToThreadPool`-like `runner(f, *args)`; `run()` runs what waits, as a pool would."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Deferred[Any], Any, tuple[Any, ...]]] = []

    def __call__(self, f: Any, *args: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.jobs.append((d, f, args))
        return d

    def run(self) -> int:
        """Run every waiting job, results and errors handed to its Deferred; how many ran."""
        jobs, self.jobs = self.jobs, []
        for d, f, args in jobs:
            try:
                d.callback(f(*args))
            except Exception as e:  # noqa: BLE001 - handed to the Deferred as a pool would
                d.errback(e)
        return len(jobs)
