"""Invariants of a broker's queues that any test (regression, model-based) can check after each step.

`check_durable_invariant(broker)` looks at what a durable LMDB store will hold
once its pending commit is written (committed records, minus pending drops
and deletes, plus pending puts and rewrites) and at where every topic's and
channel's messages are, and raises AssertionError naming the queue and the
records at fault. Each stored record must be in exactly one place:

- unread: at or past the queue's read position and not held, so a later
  read returns it (counted by the backend's depth);
- or out of the store's hands, in exactly one of the owner's memory queue,
  its in-flight table or its deferred queue (a topic has only its memory).

A record in two places is delivered twice; a record in none is lost until
a restart delivers it again; a message that
claims a record which does not exist will never be forgotten by its FIN.
"""

from __future__ import annotations

from backends.lmdb import KEY, LmdbQueue, LmdbStore
from backends.lmdb_records import QID

__all__ = ["check_durable_invariant", "stored_keys"]


def stored_keys(store: LmdbStore, queue: LmdbQueue) -> set[bytes]:
    """The keys `queue` will have on disk once the store's pending commit is written."""
    qid = queue.qid
    prefix = QID.pack(qid)
    keys: set[bytes] = set()
    with store.env.begin(db=store.data_db) as txn:
        cursor = txn.cursor()
        if cursor.set_range(prefix):
            for key in cursor.iternext(keys=True, values=False):
                if not key.startswith(prefix):
                    break
                keys.add(bytes(key))
    # The commit applies drops, then deletes, then puts and rewrites (LmdbStore._write).
    for drop_qid, bound in store._writes.drops:
        if drop_qid == qid:
            stop = KEY.pack(qid, bound)
            keys = {k for k in keys if k >= stop}
    keys -= store._writes.dels
    keys.update(k for k in store._writes.puts if k.startswith(prefix))
    keys.update(k for k in store._writes.updates if k.startswith(prefix))
    return keys


def _check_queue(store: LmdbStore, where: str, overflow, places: dict[str, list]) -> int:
    """Check one queue's records against where its messages are; returns the keyless messages' count."""
    queue = overflow.backend
    records = stored_keys(store, queue)
    read_seq = queue._read_seq
    held = queue._held
    unread = {k for k in records if KEY.unpack(k)[1] >= read_seq and k not in held}
    seen: dict[bytes, str] = {}
    keyless = 0
    for place, messages in places.items():
        for msg in messages:
            key = msg.key
            if key is None:
                keyless += 1
                continue
            assert key not in seen, (
                f"{where}: record {KEY.unpack(key)} of message {msg.id!r} is both {seen[key]} and {place}"
            )
            seen[key] = place
            assert key in records, (
                f"{where}: message {msg.id!r} ({place}) claims record {KEY.unpack(key)}, which is not stored"
            )
            assert key not in unread, (
                f"{where}: record {KEY.unpack(key)} of message {msg.id!r} is {place} and also unread "
                f"(read position {read_seq}): it would be read a second time"
            )
    orphans = sorted(KEY.unpack(k) for k in records - unread - seen.keys())
    assert not orphans, (
        f"{where}: {len(orphans)} records (first {orphans[:10]}) are read or held "
        f"but in no memory queue, in-flight table or deferred queue"
    )
    depth = queue.depth()
    assert depth == len(unread), (
        f"{where}: backend depth {depth} but {len(unread)} unread records "
        f"(read position {read_seq}, {len(held)} held)"
    )
    for msg in queue._tail:
        assert msg.key in unread, f"{where}: read cache holds {msg.id!r}, whose record is not unread"
    return keyless


def check_durable_invariant(broker) -> None:
    """Every record of a durable broker's store is in exactly one place; counts agree.

    Raises AssertionError with the queue and records at fault. Ephemeral
    topics and channels (never stored) are only checked for their counts.
    """
    store = broker.store
    assert isinstance(store, LmdbStore) and store.durable, "check_durable_invariant needs a durable LMDB broker"
    for topic in broker.topics.values():
        tq = topic._queue
        if isinstance(tq.backend, LmdbQueue):
            _check_queue(store, f"topic {topic.name}", tq, {"in the topic's memory": list(tq.mem)})
        for channel in topic.channels.values():
            where = f"channel {topic.name}:{channel.name}"
            cq = channel._queue
            in_flight = list(channel._in_flight.values())
            deferred = [msg for _, msg in channel._deferred.entries()]
            assert channel.in_flight_count() == len(in_flight)
            assert channel.deferred_count() == len(deferred), (
                f"{where}: deferred_count {channel.deferred_count()} but {len(deferred)} deferred messages"
            )
            assert channel.depth() >= 0, f"{where}: negative depth {channel.depth()}"
            if not isinstance(cq.backend, LmdbQueue):
                continue
            keyless = _check_queue(
                store,
                where,
                cq,
                {"in memory": list(cq.mem), "in flight": in_flight, "deferred": deferred},
            )
            total = channel.depth() + channel.in_flight_count() + channel.deferred_count()
            stored = len(stored_keys(store, cq.backend))
            assert total == stored + keyless, (
                f"{where}: depth {channel.depth()} + in flight {channel.in_flight_count()} + deferred "
                f"{channel.deferred_count()} = {total}, but {stored} records and {keyless} unstored messages"
            )
