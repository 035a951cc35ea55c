"""A broker-like backlog with known shape, written through the real store.

For trying the bridge (`python -m spark_bridge sample`), for its
benchmark (bench/scenarios/spark_bridge.py) and for building the JVM class archive
(jvm_archive.py): 4 topics whose own queues are nearly empty and whose
2-3 channel queues hold uneven backlogs, nsqd-style ids, timestamps over
the last hours (a stuck consumer's queue reaches further back), attempts
mostly 0-1 with a tail to 10 (above 5 is poison), ~2 % deferred, JSON
bodies of an exact size with a `type` field. Seeded, so repeatable.
"""

from __future__ import annotations

import os
import random
import time
import types
from pathlib import Path

from twisted.internet.task import Clock

from backends.lmdb import LmdbStore
from mqd.message import Message
from mqd.nsqd.snapshot_format import take_snapshot

__all__ = ["MAX_MESSAGES", "write_sample", "write_sample_snapshot"]

# Ids carry a 22-bit counter (nsqd's layout): unique up to this many messages.
MAX_MESSAGES = 1 << 22
CHUNK = 10_000
HOURS = 6
TWEPOCH_MS = 1288834974657  # the epoch of nsqd's GUIDs (Twitter snowflake's)

# topic -> share of the messages held by the topic queue itself (nearly none) and
# by each channel queue; shares are relative, per topic and across topics.
TOPICS: dict[str, dict[str | None, float]] = {
    "orders": {None: 0.001, "billing": 0.16, "shipping": 0.09, "audit": 0.05},
    "clicks": {None: 0.002, "analytics": 0.22, "archive": 0.11},
    "emails": {None: 0.001, "sender": 0.12, "bounces": 0.03},
    "payments": {None: 0.001, "ledger": 0.13, "fraud": 0.06, "notify": 0.025},
}
# How far back each queue's backlog reaches, in hours (a stuck consumer keeps old messages).
SPAN_HOURS = {"audit": 6.0, "archive": 5.5, "fraud": 4.0, "bounces": 3.0, "billing": 2.0}
TYPES = ["order.created", "order.paid", "page.view", "email.sent", "payment.refunded"]
TYPE_WEIGHTS = [30, 15, 35, 12, 8]
ATTEMPTS = list(range(11))
ATTEMPT_WEIGHTS = [70, 20, 3, 2, 1.5, 1, 0.8, 0.6, 0.5, 0.3, 0.3]
DEFERRED_SHARE = 0.02

def queue_counts(n: int) -> list[tuple[str, int]]:
    """(queue name, message count) for every queue, summing to n."""
    names, weights = [], []
    for topic, queues in TOPICS.items():
        for channel, w in queues.items():
            names.append(topic if channel is None else f"{topic}:{channel}")
            weights.append(w)
    total = sum(weights)
    counts = [int(n * w / total) for w in weights]
    counts[weights.index(max(weights))] += n - sum(counts)
    return list(zip(names, counts, strict=True))


def make_body_factory(size: int):
    """A function (type, seq, ts_ms) -> JSON body of exactly `size` bytes."""
    head = '{"type":"%s","seq":%d,"ts":%d,"pad":"'
    longest = len(head % (max(TYPES, key=len), 10**12, 10**13)) + 2
    if size < longest:
        raise ValueError(f"body size must be at least {longest} bytes")

    def body(kind: str, seq: int, ts_ms: int) -> bytes:
        s = head % (kind, seq, ts_ms)
        return (s + "x" * (size - len(s) - 2) + '"}').encode()

    return body


def write_sample(data_dir: str | os.PathLike, n: int, body_size: int = 200, seed: int = 7) -> dict:
    """Write n messages through the real LmdbStore into data_dir; returns what was written."""
    rng = random.Random(seed)
    body = make_body_factory(body_size)
    now_ns = time.time_ns()
    now_s = now_ns / 1e9
    store = LmdbStore(
        types.SimpleNamespace(data_path=os.fspath(data_dir), durable=False, sync_every=10**9, sync_timeout=0),
        clock=Clock(),
    )
    seq = 0
    poison = deferred = 0
    try:
        for name, count in queue_counts(n):
            q = store.open_queue(name)
            span_ns = int(SPAN_HOURS.get(name.partition(":")[2], rng.uniform(0.1, HOURS)) * 3600e9)
            # Publish order: timestamps ascending within a queue, as a broker writes them.
            stamps = sorted(rng.randrange(now_ns - span_ns, now_ns) for _ in range(count))
            kinds = rng.choices(TYPES, TYPE_WEIGHTS, k=count)
            attempts = rng.choices(ATTEMPTS, ATTEMPT_WEIGHTS, k=count)
            rand = rng.random
            for start in range(0, count, CHUNK):
                batch = []
                for i in range(start, min(start + CHUNK, count)):
                    ts = stamps[i]
                    ts_ms = ts // 1_000_000
                    # nsqd's GUID layout: ms since its epoch << 22 | node/sequence bits;
                    # the low 22 bits carry a global counter, so ids are unique.
                    msg_id = b"%016x" % (((ts_ms - TWEPOCH_MS) << 22) | (seq & 0x3FFFFF))
                    due = 0.0
                    if rand() < DEFERRED_SHARE:
                        due = now_s + rng.uniform(-60.0, 7200.0)
                        deferred += 1
                    att = attempts[i]
                    poison += att > 5
                    batch.append(Message(msg_id, body(kinds[i], seq, ts_ms), ts, att, due))
                    seq += 1
                q.put(batch)
                store.commit()
    finally:
        store.close()
    return {"messages": seq, "poison": poison, "deferred": deferred}


def write_sample_snapshot(data_dir: str | os.PathLike, out: str | os.PathLike,
                          n: int = 20_000) -> Path:
    """A sample backlog of n messages in data_dir, and a snapshot of it at out."""
    write_sample(data_dir, n)
    take_snapshot(data_dir, out, broker_id="sample")
    return Path(out)
