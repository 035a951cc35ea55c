"""The model a state-machine test checks the broker against; a guard for a looping step.

`M` is one channel's copy of one message where the model expects it
(queued, deferred, in flight with an owner, or gone); `Consumer` is a
subscribed client as the model sees it. `bounded`/`guarded` fail a step
that does not return (a broker bug can make Channel.deliver spin) with
`StepTimeout`, by SIGALRM, so hypothesis can shrink it.
"""

from __future__ import annotations

import functools
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field

from tests.support.v2_client import Client

# Seconds a step may run before it counts as looping.
STEP_LIMIT = float(os.environ.get("MQD_MODEL_STEP_LIMIT", "3"))


class StepTimeout(AssertionError):
    """A step did not return: the broker is looping."""


class _Alarm(BaseException):
    """Raised by the alarm inside the broker: not an Exception, so no `except Exception` there swallows it."""


class NegativeDepth(AssertionError):
    """A backend queue read more than it held."""


@contextmanager
def bounded(seconds: float):
    """Fail with StepTimeout if the block runs longer than `seconds` (main thread only).

    The alarm raises a BaseException, which the broker's error handling does
    not catch, and repeats until the block is left; it becomes an
    AssertionError here, outside the broker, so hypothesis shrinks it.
    """
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _Alarm

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.5)
    try:
        yield
    except _Alarm:
        armed[0] = False
        raise StepTimeout(f"step still running after {seconds}s: the broker is looping") from None
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def guarded(step):
    """Run a rule under the hang guard."""

    @functools.wraps(step)
    def run(self, *args, **kwargs):
        with bounded(STEP_LIMIT):
            return step(self, *args, **kwargs)

    return run


QUEUED, DEFERRED, IN_FLIGHT = "queued", "deferred", "in flight"
DONE, EMPTIED, LOST = "finished", "emptied", "lost in a crash"
GONE = (DONE, EMPTIED, LOST)


@dataclass(eq=False)
class M:
    """One channel's copy of one message, as the model expects it."""

    body: bytes
    state: str
    timestamp: int  # ns, the publish time: kept across requeues and restarts
    attempts: int = 0
    # After a crash the stored attempts may lag (a delivery alone does not
    # rewrite the record): the next delivery may say anything in 1..attempts+1.
    attempts_known: bool = True
    due: float = 0.0
    owner: Consumer | None = None
    deadline: float = 0.0
    delivered_at: float = 0.0
    id: bytes | None = None


@dataclass(eq=False)
class Consumer:
    client: Client
    topic: str
    channel: str
    n: int
    rdy: int = 0
    in_flight: set = field(default_factory=set)  # of M

    def __repr__(self) -> str:
        return f"consumer{self.n}({self.topic}:{self.channel}, rdy {self.rdy}, {len(self.in_flight)} in flight)"
