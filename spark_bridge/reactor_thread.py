"""Twisted's reactor on a daemon thread of a Spark Python process.

The streaming source runs inside Spark's driver-side Python process, which
calls the reader's methods one at a time and is idle in between; the sink
runs inside executor Python workers, which Spark reuses from task to task.
Both need NSQ connections that live across those calls (heartbeats
answered, messages received, MPUBs pipelined), which is what txnsq
(`mqd.client`) gives on a running reactor. A reactor can run only once per
process, so this module starts the global one on a daemon thread the first
time it is needed and leaves it running for the life of the process; code
on other threads reaches it through `call`, which is Twisted's
`blockingCallFromThread` with a time limit, or through `post`, which does
not wait (`callFromThread`: calls posted from one thread run in order).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from twisted.internet import defer
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.failure import Failure

__all__ = ["ReactorThreadError", "call", "ensure_running", "post"]

T = TypeVar("T")

_lock = threading.Lock()
_owner_pid: int | None = None
_thread: threading.Thread | None = None


class ReactorThreadError(RuntimeError):
    """The reactor thread cannot serve this process (it was forked from the one that started it)."""


def ensure_running() -> None:
    """Start the reactor on a daemon thread once per process; later calls return at once."""
    global _owner_pid, _thread
    with _lock:
        if _thread is not None:
            if _owner_pid != os.getpid():
                raise ReactorThreadError(
                    "mqd: this process was forked after its reactor thread started; "
                    "the reactor cannot run in the child")
            return
        from twisted.internet import reactor

        ready = threading.Event()
        reactor.callWhenRunning(ready.set)
        thread = threading.Thread(
            target=reactor.run, kwargs={"installSignalHandlers": False},
            name="mqd-reactor", daemon=True)
        thread.start()
        _thread, _owner_pid = thread, os.getpid()
    ready.wait()


def call(function: Callable[..., Any], *args: Any, timeout: float | None = None,
         **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` run on the reactor thread; its result, waiting for a Deferred.

    A Deferred (or coroutine) is waited for; with `timeout` it is cancelled
    after that many seconds (the caller gets `defer.TimeoutError`, or what
    the cancellation raised). Exceptions come back to the caller's thread.
    """
    ensure_running()
    from twisted.internet import reactor
    from twisted.internet.threads import blockingCallFromThread

    def run() -> defer.Deferred[Any]:
        d = defer.maybeDeferred(function, *args, **kwargs)
        if timeout is not None:
            d.addTimeout(timeout, reactor)
        return d

    try:
        # Twisted types the global reactor with its commonest interfaces only.
        return blockingCallFromThread(cast(IReactorFromThreads, reactor), run)
    except Exception as e:  # noqa: BLE001 - re-raised with Failure's traceback cleaned
        if isinstance(e, Failure):  # pragma: no cover - blockingCallFromThread raises the value
            e.raiseException()
        raise


def post(function: Callable[..., Any], *args: Any) -> None:
    """Run `function(*args)` on the reactor thread without waiting for it (in order of posting)."""
    ensure_running()
    from twisted.internet import reactor

    cast(IReactorFromThreads, reactor).callFromThread(function, *args)
