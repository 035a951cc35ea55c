"""A broker in the test process, on a task.Clock: its settings, its store, its queue scan.

Heartbeats, read timeouts, in-flight expiry and deferred delivery are
driven by `clock.advance()`; data goes to a temporary directory.
"""

from __future__ import annotations

import lmdb
from twisted.internet.task import Clock

from backends.lmdb import LmdbStore
from mqd.message import Message
from mqd.nsqd.broker import Broker
from mqd.nsqd.queuescan import QueueScanner
from mqd.options import MQD_OPTIONS, resolve

# A reactor time in the present, so message timestamps and ids look real.
START_TIME = 1_700_000_000.0
NODE_ID = 7


def scan(broker: Broker) -> int:
    """One queue-scan tick over every channel that exists now."""
    scanner = QueueScanner(broker)
    scanner.refresh()
    return scanner.scan()


def settings(tmp_path, **flags):
    # The in-memory store unless a test asks for another: most unit tests
    # look at what the queues hold; tests/unit/test_lmdb*.py use the real LMDB.
    values = {
        "data-path": str(tmp_path),
        "node-id": NODE_ID,
        "broadcast-address": "test-host",
        "backend": "memory",
    }
    values.update({k.replace("_", "-"): v for k, v in flags.items()})
    return resolve(MQD_OPTIONS, values)


def new_broker(path, clock: Clock, **flags) -> Broker:
    broker = Broker(settings(path, **flags), clock=clock)
    broker.open()
    return broker


def lmdb_store(path, clock: Clock, **flags) -> LmdbStore:
    """An LMDB store of its own (no broker) in `path`."""
    return LmdbStore(settings(path, backend="lmdb", **flags), clock)


def msgs(n: int, start: int = 0, body: bytes = b"m") -> list[Message]:
    """`n` messages numbered from `start`: id i in 16 digits, body `body`+i, timestamp 1000+i."""
    return [Message(b"%016d" % i, body + b"%d" % i, 1_000 + i) for i in range(start, start + n)]


def failing_once(store, error="No space left on device"):
    """Make the store's next commit fail as a full disk would, once; returns the call log."""
    real = store._write
    calls = []

    def write():
        calls.append(1)
        if len(calls) == 1:
            raise lmdb.Error(error)
        return real()

    store._write = write
    return calls
