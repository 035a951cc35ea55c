"""Brokers for the peek tests: one per store a queue can sit on, its memory queue small.

The memory backend, LMDB in default mode (memory queue, then LMDB) and
LMDB --durable (everything in LMDB, deferred messages held there); a
mem-queue-size of `MEM` makes queues overflow into the backend.
"""

from __future__ import annotations

from pathlib import Path

from twisted.internet.task import Clock

from tests.support.inprocess_broker import START_TIME, new_broker
from tests.support.v2_client import Client
from tests.support.v2_frames import identify, ok

MODES = {
    "memory": {"backend": "memory"},
    "lmdb": {"backend": "lmdb"},
    "durable": {"backend": "lmdb", "durable": True},
}
MEM = 4
DAY_MS = 86_400_000


def make(path: Path, mode: str, clock: Clock | None = None, **flags):
    """A broker of `mode` in `path` on its own clock (at START_TIME unless given)."""
    if clock is None:
        clock = Clock()
        clock.advance(START_TIME)
    path.mkdir(parents=True, exist_ok=True)
    flags.setdefault("mem_queue_size", MEM)
    flags.setdefault("max_heartbeat_interval", "24h")
    return new_broker(path, clock, **MODES[mode], **flags)


class Producer:
    """A publishing client whose every command is answered OK (a durable OK waits for the commit)."""

    def __init__(self, broker, port: int = 5000) -> None:
        self.broker = broker
        self.client = Client(broker, port=port)
        assert self.client.request(identify(heartbeat_interval=-1)) == [ok()]

    def __call__(self, data: bytes) -> None:
        self.client.send(data)
        self.broker.clock.advance(0)
        assert self.client.read() == [ok()]


def quiet_client(broker, port: int) -> Client:
    """A consumer with a heartbeat once a day (a SUB needs them), so moving the clock never closes it."""
    c = Client(broker, port=port)
    assert c.request(identify(heartbeat_interval=DAY_MS)) == [ok()]
    return c
