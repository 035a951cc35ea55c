"""The LMDB store: every topic and channel queue in one LMDB environment.

Layout (measured against one named database per queue with 10,000 queues,
see the README): one `messages` database for all queues, keyed by a 4-byte
queue id and an 8-byte sequence number, big-endian, so each queue is a
contiguous, ordered key range; a `queues` registry maps names to ids and a
`meta` database marks the environment as mqd's.

Writes are grouped: everything put, finished or rewritten during one
reactor turn is committed in one transaction at the start of the next
(`callLater(0)`), so the reactor never waits on LMDB per message.

Two durability modes:
- default: like nsqd's disk queue, a read removes the record, and the
  environment is fsynced after `sync-every` writes or every `sync-timeout`;
- durable: every commit is synced, a publish is acknowledged only after
  the commit holding it, and a record stays until its message is FINished
  (a read only moves the queue's read position; REQ and timeouts rewrite
  the record), so after a crash everything not FINished is delivered again.
"""

from __future__ import annotations

import os
import struct
from collections import deque
from typing import Any

import lmdb
from twisted.internet.task import LoopingCall
from zope.interface import implementer

from mqd.logs import get_logger
from mqd.message import Message

from .interface import BackendError, IBackendQueue, IBackendStore

__all__ = ["LmdbStore", "LmdbQueue", "StoreOpenError", "ENV_DIR"]

log = get_logger(__name__)

ENV_DIR = "mqd.lmdb"
FORMAT = b"mqd-queues-1"
_OUR_DBS = {b"meta", b"queues", b"messages"}

KEY = struct.Struct(">IQ")
_QID = struct.Struct(">I")
# timestamp (ns), attempts, deferred_until (reactor seconds, 0 = due), id; then the body.
RECORD = struct.Struct(">qHd16s")
_RECORD_SIZE = RECORD.size

DEFAULT_MAP_SIZE = 1 << 30
# Messages a durable queue keeps decoded in memory past its read position,
# so reads right after a publish need no decoding (bounded per queue).
_READ_CACHE = 10000
_RETRY_AFTER = 1.0
# How long a commit that needs a bigger map waits for a running snapshot copy.
_COPY_WAIT = 0.05


class StoreOpenError(Exception):
    """The data directory cannot be used; start-up stops with this text."""


def _encode(msg: Message) -> bytes:
    # attempts is nsqd's uint16, which wraps: a record must never fail to pack,
    # or every later commit of the whole store would fail with it.
    return RECORD.pack(msg.timestamp, msg.attempts & 0xFFFF, msg.deferred_until, msg.id) + msg.body


def _decode(key: bytes, value: bytes) -> Message:
    timestamp, attempts, deferred_until, msg_id = RECORD.unpack_from(value)
    msg = Message(msg_id, value[_RECORD_SIZE:], timestamp, attempts, deferred_until)
    msg.key = key
    return msg


@implementer(IBackendQueue)
class LmdbQueue:
    """One queue's key range, its read position, and what a commit has not written yet."""

    __slots__ = ("name", "qid", "_store", "_next_seq", "_read_seq", "_depth", "_tail", "_held")

    def __init__(self, store: LmdbStore, name: str, qid: int, first_seq: int, next_seq: int,
                 depth: int) -> None:
        self.name = name
        self.qid = qid
        self._store = store
        self._next_seq = next_seq
        self._read_seq = first_seq
        self._depth = depth
        # Unread messages this process put, oldest first: every one not yet
        # committed, plus (durable) up to _READ_CACHE committed ones.
        self._tail: deque[Message] = deque()
        # Keys of records stored by `hold` (deferred messages), so past the
        # read position while their messages live outside the queue: in the
        # deferred queue, then in memory or in flight once due or requeued.
        # Reads pass over them until they are FINished (or the queue is
        # emptied); releasing one earlier would let a read return it twice.
        self._held: set[bytes] = set()

    def _tail_start(self) -> int:
        return KEY.unpack(self._tail[0].key)[1] if self._tail else self._next_seq

    def put(self, messages) -> None:
        self._store_new(messages)
        self._tail.extend(messages)
        self._depth += len(messages)

    def _store_new(self, messages) -> None:
        """Give the messages the queue's next keys and stage them for the commit."""
        store = self._store
        if store.failure:
            raise BackendError(store.failure)
        puts = store._puts
        qid = self.qid
        seq = self._next_seq
        pack = KEY.pack
        for msg in messages:
            msg.key = key = pack(qid, seq)
            puts[key] = msg
            seq += 1
        self._next_seq = seq
        store._touched.add(self)
        store._schedule()

    def hold(self, messages) -> None:
        if not self._store.durable:
            return
        self._store_new(messages)
        self._held.update(m.key for m in messages)

    def read(self, count: int) -> list[Message]:
        out: list[Message] = []
        tail_start = self._tail_start()
        if self._read_seq < tail_start:
            out = self._read_stored(count, tail_start)
        tail = self._tail
        while tail and len(out) < count:
            out.append(tail.popleft())
        if out:
            self._read_seq = KEY.unpack(out[-1].key)[1] + 1
            depth = self._depth - len(out)
            if depth < 0:
                # More read than the queue held: a record was read twice. Say
                # so, and keep the depth sane for everything sizing by it.
                log.error("queue {name}: read {n} messages with depth {depth}; depth reset to 0",
                          name=self.name, n=len(out), depth=self._depth)
                depth = 0
            self._depth = depth
            if not self._store.durable:
                # Without durability a read removes the records (one never
                # written is just dropped), exactly what a FIN does.
                self.finish(out)
        return out

    def _read_stored(self, count: int, tail_start: int) -> list[Message]:
        """Decode up to `count` committed records from the read position."""
        start = KEY.pack(self.qid, self._read_seq)
        stop = KEY.pack(self.qid, tail_start)
        held = self._held
        out: list[Message] = []
        store = self._store
        dels = store._dels
        updates = store._updates
        with store.env.begin(db=store.data_db, buffers=False) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start):
                return out
            for key, value in cursor:
                if key >= stop or len(out) >= count:
                    break
                if (held and key in held) or key in dels:
                    continue
                msg = updates.get(key)
                out.append(msg if msg is not None else _decode(key, value))
        if not out:
            # Only held or deleted records before the cached tail.
            self._read_seq = tail_start
        return out

    def finish(self, messages) -> None:
        store = self._store
        puts = store._puts
        updates = store._updates
        dels = store._dels
        held = self._held
        for msg in messages:
            key = msg.key
            if key is None:
                continue
            msg.key = None
            updates.pop(key, None)
            held.discard(key)
            if puts.pop(key, None) is None:
                dels.add(key)
        store._schedule()

    def update(self, messages) -> None:
        """Rewrite the records; a held one stays held (its message is still outside the queue)."""
        store = self._store
        puts = store._puts
        updates = store._updates
        for msg in messages:
            key = msg.key
            if key is None:
                continue
            if key not in puts:
                updates[key] = msg
        store._schedule()

    def depth(self) -> int:
        return self._depth

    def empty(self) -> None:
        """Drop every record up to now, and everything not yet written."""
        store = self._store
        prefix = _QID.pack(self.qid)
        store._drops.append((self.qid, self._next_seq))
        for table in (store._puts, store._updates):
            for key in [k for k in table if k.startswith(prefix)]:
                table[key].key = None
                del table[key]
        for msg in self._tail:
            msg.key = None
        self._tail.clear()
        self._held.clear()
        self._read_seq = self._next_seq
        self._depth = 0
        store._schedule()

    def delete(self) -> None:
        self.empty()
        self._store._forget_queue(self)

    def close(self) -> None:
        """The store commits and closes everything at once."""

    def sync(self) -> None:
        self._store.sync()

    def _trim(self) -> None:
        """After a commit: keep at most the read cache of committed messages in memory."""
        limit = _READ_CACHE if self._store.durable else 0
        tail = self._tail
        puts = self._store._puts
        while len(tail) > limit and tail[0].key not in puts:
            tail.popleft()


@implementer(IBackendStore)
class LmdbStore:
    """One LMDB environment under data-path, shared by every queue of the broker."""

    def __init__(self, options, clock=None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.clock = clock
        self.durable = bool(getattr(options, "durable", False))
        self.sync_every = getattr(options, "sync_every", 2500)
        self.sync_timeout = getattr(options, "sync_timeout", 2.0)
        self.path = os.path.join(options.data_path or ".", ENV_DIR)
        self.failure: str | None = None
        self.health_listener = None
        self._puts: dict[bytes, Message] = {}
        self._updates: dict[bytes, Message] = {}
        self._dels: set[bytes] = set()
        self._drops: list[tuple[int, int]] = []
        self._registry_puts: dict[bytes, bytes] = {}
        self._registry_dels: set[bytes] = set()
        self._touched: set[LmdbQueue] = set()
        self._waiters: list = []
        self._commit_call = None
        self._unsynced = 0
        # Snapshot copies reading the environment from other threads right now.
        self.copies = 0
        self._queues: dict[str, LmdbQueue] = {}
        self._known: dict[str, int] = {}
        self._next_qid = 1
        self.env = self._open_env(getattr(options, "lmdb_map_size", DEFAULT_MAP_SIZE))
        self._load_registry()
        self._sync_loop = None
        if not self.durable and self.sync_timeout > 0:
            self._sync_loop = LoopingCall(self._sync_if_dirty)
            self._sync_loop.clock = clock
            self._sync_loop.start(self.sync_timeout, now=False)

    # -- opening -------------------------------------------------------------------

    def _open_env(self, map_size: int) -> lmdb.Environment:
        try:
            os.makedirs(self.path, exist_ok=True)
            env = lmdb.open(
                self.path, map_size=map_size, max_dbs=8, subdir=True,
                sync=self.durable, metasync=self.durable, readahead=False,
            )
        except lmdb.Error as e:
            raise StoreOpenError(f"{self.path}: not a usable LMDB environment ({e})") from None
        except OSError as e:
            raise StoreOpenError(f"{self.path}: {e.strerror}") from None
        try:
            with env.begin() as txn:
                names = {bytes(k) for k, _ in txn.cursor()}
            foreign = names - _OUR_DBS
            if foreign:
                raise StoreOpenError(
                    f"{self.path}: an LMDB environment that is not mqd's (databases {sorted(foreign)!r})"
                )
            # The databases and the format mark are created in one
            # transaction, so a crash cannot leave a half-made environment.
            with env.begin(write=True) as txn:
                self.meta_db = env.open_db(b"meta", txn=txn)
                self.registry_db = env.open_db(b"queues", txn=txn)
                self.data_db = env.open_db(b"messages", txn=txn)
                mark = txn.get(b"format", db=self.meta_db)
                if mark is None:
                    if names & {b"queues", b"messages"}:
                        raise StoreOpenError(f"{self.path}: mqd data without a format mark; refusing it")
                    txn.put(b"format", FORMAT, db=self.meta_db)
                elif mark != FORMAT:
                    raise StoreOpenError(f"{self.path}: unknown data format {mark!r} (expected {FORMAT!r})")
        except lmdb.Error as e:
            env.close()
            raise StoreOpenError(f"{self.path}: corrupt LMDB environment ({e})") from None
        except StoreOpenError:
            env.close()
            raise
        return env

    def _load_registry(self) -> None:
        try:
            with self.env.begin(db=self.registry_db) as txn:
                for name, qid in txn.cursor():
                    self._known[bytes(name).decode()] = _QID.unpack(qid)[0]
        except (lmdb.Error, UnicodeDecodeError, struct.error) as e:
            raise StoreOpenError(f"{self.path}: corrupt queue registry ({e})") from None
        self._next_qid = max(self._known.values(), default=0) + 1

    def queue_names(self) -> list[str]:
        """Names of the queues the store holds, for the broker to reconcile with its metadata."""
        return sorted(self._known)

    def open_queue(self, name: str) -> LmdbQueue:
        queue = self._queues.get(name)
        if queue is not None:
            return queue
        qid = self._known.get(name)
        first = nxt = depth = 0
        if qid is None:
            qid = self._next_qid
            self._next_qid += 1
            self._known[name] = qid
            self._registry_puts[name.encode()] = _QID.pack(qid)
            self._registry_dels.discard(name.encode())
            self._schedule()
        else:
            first, nxt, depth = self._scan(qid)
        queue = self._queues[name] = LmdbQueue(self, name, qid, first, nxt, depth)
        return queue

    def _scan(self, qid: int) -> tuple[int, int, int]:
        """First sequence, next sequence and record count of a stored queue."""
        prefix = _QID.pack(qid)
        count = 0
        first = last = None
        with self.env.begin(db=self.data_db) as txn:
            cursor = txn.cursor()
            if cursor.set_range(prefix):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(prefix):
                        break
                    if first is None:
                        first = key
                    last = key
                    count += 1
        if not count:
            return 0, 0, 0
        return KEY.unpack(first)[1], KEY.unpack(last)[1] + 1, count

    def _forget_queue(self, queue: LmdbQueue) -> None:
        self._queues.pop(queue.name, None)
        self._known.pop(queue.name, None)
        name = queue.name.encode()
        self._registry_puts.pop(name, None)
        self._registry_dels.add(name)
        self._touched.discard(queue)
        self._schedule()

    # -- group commit -------------------------------------------------------------------

    def _schedule(self) -> None:
        if self._commit_call is None:
            self._commit_call = self.clock.callLater(0, self.commit)

    def when_durable(self, callback) -> None:
        if not self.durable:
            callback(None)
            return
        self._waiters.append(callback)
        self._schedule()

    def _pending(self) -> bool:
        return bool(self._puts or self._updates or self._dels or self._drops
                    or self._registry_puts or self._registry_dels)

    def commit(self) -> None:
        """Write everything gathered since the last commit in one transaction."""
        if self._commit_call is not None and self._commit_call.active():
            self._commit_call.cancel()
        self._commit_call = None
        waiters, self._waiters = self._waiters, []
        if not self._pending():
            for callback in waiters:
                callback(None)
            return
        try:
            written = self._write()
        except lmdb.MapFullError:
            self._waiters[:0] = waiters
            if self.copies:
                # A snapshot thread is reading the map: resizing it now could
                # pull it from under the copy. Try again shortly.
                self._commit_call = self.clock.callLater(_COPY_WAIT, self.commit)
                return
            self._grow()
            self.commit()
            return
        except lmdb.Error as e:
            self._failed(str(e), waiters)
            return
        except Exception as e:
            # Not the disk: a bug. Report it as a failed store (/ping says so)
            # rather than raise out of the reactor with nothing noticing.
            if self.failure is None:
                log.failure("LMDB commit failed")
            self._failed(f"{type(e).__name__}: {e}", waiters)
            return
        if self.failure is not None:
            self.failure = None
            if self.health_listener is not None:
                self.health_listener(None)
        self._unsynced += written
        if not self.durable and self.sync_every and self._unsynced >= self.sync_every:
            self.sync()
        for queue in self._touched:
            queue._trim()
        self._touched.clear()
        for callback in waiters:
            callback(None)

    def _write(self) -> int:
        env = self.env
        with env.begin(write=True, db=self.data_db) as txn:
            for qid, bound in self._drops:
                cursor = txn.cursor()
                # Keys are fixed-length, so every key in [qid, (qid, bound)) is the queue's.
                stop = KEY.pack(qid, bound)
                if cursor.set_range(_QID.pack(qid)):
                    while cursor.key() < stop:
                        if not cursor.delete():  # False once past the last record
                            break
            delete = txn.delete
            for key in self._dels:
                delete(key)
            put = txn.put
            for key, msg in self._puts.items():
                put(key, _encode(msg))
            for key, msg in self._updates.items():
                put(key, _encode(msg))
            for name, qid in self._registry_puts.items():
                put(name, qid, db=self.registry_db)
            for name in self._registry_dels:
                delete(name, db=self.registry_db)
        written = len(self._puts) + len(self._updates) + len(self._dels)
        self._puts.clear()
        self._updates.clear()
        self._dels.clear()
        self._drops.clear()
        self._registry_puts.clear()
        self._registry_dels.clear()
        return written

    def _grow(self) -> None:
        size = self.env.info()["map_size"] * 2
        log.info("LMDB map full; growing it to {size} bytes", size=size)
        self.env.set_mapsize(size)

    def _failed(self, error: str, waiters: list) -> None:
        """A commit failed (a full disk): keep everything for the retry, fail the waiters."""
        if self.failure is None:
            log.error("LMDB commit failed, retrying every {s}s: {error}", s=_RETRY_AFTER, error=error)
            if self.health_listener is not None:
                self.health_listener(f"LMDB write failed: {error}")
        self.failure = f"LMDB write failed: {error}"
        for callback in waiters:
            callback(self.failure)
        self._commit_call = self.clock.callLater(_RETRY_AFTER, self.commit)

    # -- syncing -----------------------------------------------------------------------

    def sync(self) -> None:
        self.env.sync(True)
        self._unsynced = 0

    def _sync_if_dirty(self) -> None:
        if self._unsynced:
            self.sync()

    def close(self) -> None:
        if self._sync_loop is not None and self._sync_loop.running:
            self._sync_loop.stop()
        try:
            self.commit()
            if self.failure is not None:
                log.error("closing LMDB with unwritten changes: {error}", error=self.failure)
            else:
                self.sync()
        finally:
            if self._commit_call is not None and self._commit_call.active():
                self._commit_call.cancel()
            self._commit_call = None
            self.env.close()

    def stats(self) -> dict[str, Any]:
        return {"path": self.path, **self.env.info(), **self.env.stat()}
