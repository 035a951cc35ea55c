"""The Twisted side of the client end-to-end tests: waits on the reactor, a recording handler, /stats.

The tests run in pytest-twisted's reactor while the brokers are
subprocesses, so every wait here polls with `task.deferLater` (the reactor
keeps serving the client's connections) under an overall deadline, and
fails saying what it waited for.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from twisted.internet import defer, reactor, task

from tests.support.processes import DEFAULT_TIMEOUT, TwistdProcess


def sleep(seconds: float) -> defer.Deferred:
    """Let the reactor run for a while (between polls, never as an assertion)."""
    return task.deferLater(reactor, seconds, lambda: None)


@defer.inlineCallbacks
def wait_until(condition: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT,
               what: str | Callable[[], str] = "condition", interval: float = 0.02):
    """Poll `condition()` on the reactor until truthy (its value is the result); AssertionError after `timeout`.

    `what` may be a callable, called on failure, to describe the state then.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for "
                                 f"{what() if callable(what) else what}")
        yield sleep(interval)


def free_port() -> int:
    """A loopback port free right now, for a broker that must come back on the same address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder:
    """A consumer handler that records every delivery; `respond(message)` decides the result."""

    def __init__(self, respond: Callable[[Any], Any] | None = None) -> None:
        self.deliveries: list[tuple[bytes, bytes, int, str]] = []  # (id, body, attempts, nsqd)
        self.respond = respond

    def __call__(self, message: Any) -> Any:
        self.deliveries.append((message.id, message.body, message.attempts, message.nsqd_address))
        if self.respond is not None:
            return self.respond(message)
        return None

    def __len__(self) -> int:
        return len(self.deliveries)

    @property
    def bodies(self) -> Counter:
        return Counter(d[1] for d in self.deliveries)

    @property
    def ids(self) -> Counter:
        return Counter(d[0] for d in self.deliveries)

    def from_nsqd(self, address: str) -> list[bytes]:
        return [d[1] for d in self.deliveries if d[3] == address]


def channel_stats(broker: TwistdProcess, topic: str, channel: str) -> dict[str, Any] | None:
    """The channel's entry in the broker's GET /stats?format=json (None until it exists)."""
    status, stats = broker.get(f"/stats?format=json&topic={topic}&channel={channel}")
    assert status == 200, stats
    for t in stats.get("topics") or []:
        if t["topic_name"] != topic:
            continue
        for c in t.get("channels") or []:
            if c["channel_name"] == channel:
                return c
    return None


def ready_counts(broker: TwistdProcess, topic: str, channel: str) -> list[int]:
    """`ready_count` of each client of the channel on this broker, as nsqd reports it."""
    stats = channel_stats(broker, topic, channel)
    return [c["ready_count"] for c in (stats or {}).get("clients") or []]
