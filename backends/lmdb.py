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

  A durable queue hands out only committed messages: what was put waits,
  unreadable, until the commit holding it has succeeded (then the queue's
  owner hears of it through `on_stored`). A commit that fails drops the
  new publishes it held (those staged while `LmdbStore.publishing` was
  set): their publishers are answered with the error, so an error answer
  means "not stored", and nobody has seen them. Everything else it held
  (FINs, rewrites, messages moved from a topic to its channels) is kept
  and retried, as those were acknowledged long ago.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import sys
import zlib
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator
from itertools import chain, islice
from typing import Any

import lmdb
from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall
from zope.interface import implementer

from backends.interface import BackendError, IBackendQueue, IBackendStore, IPiecewisePeek
from mqd.logs import get_logger
from mqd.message import Message

__all__ = ["LmdbStore", "LmdbQueue", "StoreOpenError", "ENV_DIR", "SPILL_FILE"]

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
# A commit writing more records than this (or this many bytes of bodies) is
# split into transactions of at most this size (see LmdbStore._write).
_COMMIT_CHUNK = 2048
_COMMIT_CHUNK_BYTES = 4 << 20
# The pages mapped from the data file are unmapped (release_mapped_pages) once
# they have grown by _UNMAP_ABOVE bytes since the last time: checked every
# _UNMAP_EVERY seconds, and after a commit once _UNMAP_RECORDS records were
# read or written. Below that they stay: the pages in use would only be
# faulted in again.
_UNMAP_EVERY = 5.0
_UNMAP_RECORDS = 1 << 14
_UNMAP_ABOVE = 64 << 20
# A piecewise peek (GET /channel/peek) reads at most this many records, and
# this many bytes of their bodies, per piece: one reactor turn's worth.
_PEEK_PIECE_COUNT = 256
_PEEK_PIECE_BYTES = 256 << 10
# How long a commit that needs a bigger map waits for a running snapshot copy.
_COPY_WAIT = 0.05

# What a clean shutdown could not write into LMDB (a full disk), next to the
# environment; the next start writes it back (see LmdbStore.close).
SPILL_FILE = "mqd.lmdb.spill"
_SPILL_MAGIC = b"mqd-spill-1\n"
_SPILL_ENTRY = struct.Struct(">BII")  # kind, key length, value length
_SPILL_END = struct.Struct(">BII")  # 0xFF, entry count, CRC-32 of the entries
_SPILL_REGISTRY, _SPILL_RECORD, _SPILL_DONE = 1, 2, 0xFF
# A shutdown whose one-transaction commit failed writes in transactions of
# at most this many changes (halved on each failure down to one), so what
# fits on the disk is kept.
_CLOSE_CHUNK = 1024
_CLOSE_CHUNK_BYTES = 4 << 20
# Room a new environment needs before LMDB creates its files: LMDB writes
# its lock file through a memory map, and on a full disk a page fault there
# is a SIGBUS, which kills the process without a word.
_ROOM_FOR_NEW_ENV = 1 << 20
# Write operations of a bounded commit, in the order they are applied.
_DROP, _DEL, _REG_DEL, _REG_PUT, _PUT = range(5)


class StoreOpenError(Exception):
    """The data directory cannot be used; start-up stops with this text."""


def _no_room(error: BaseException) -> bool:
    """A write failed for lack of space (a full disk or quota), not because the data is bad."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, lmdb.DiskError) or "No space left" in str(error) or "quota" in str(error)


def _encode(msg: Message) -> bytes:
    # attempts is nsqd's uint16, which wraps: a record must never fail to pack,
    # or every later commit of the whole store would fail with it.
    return RECORD.pack(msg.timestamp, msg.attempts & 0xFFFF, msg.deferred_until, msg.id) + msg.body


def _decode(key: bytes, value: bytes) -> Message:
    timestamp, attempts, deferred_until, msg_id = RECORD.unpack_from(value)
    msg = Message(msg_id, value[_RECORD_SIZE:], timestamp, attempts, deferred_until)
    msg.key = key
    return msg


def _seq(msg: Message) -> int:
    """The sequence number of a message's record (-1 for one finished, whose key is gone)."""
    return KEY.unpack(msg.key)[1] if msg.key is not None else -1


@implementer(IBackendQueue, IPiecewisePeek)
class LmdbQueue:
    """One queue's key range, its read position, and what a commit has not written yet."""

    __slots__ = ("name", "qid", "_store", "_next_seq", "_read_seq", "_depth", "_tail", "_held",
                 "_staged", "_staged_held", "on_stored")

    def __init__(self, store: LmdbStore, name: str, qid: int, first_seq: int, next_seq: int,
                 depth: int) -> None:
        self.name = name
        self.qid = qid
        self._store = store
        self._next_seq = next_seq
        self._read_seq = first_seq
        self._depth = depth
        # Unread messages this process put, oldest first: default mode, every
        # one not yet committed; durable, up to _READ_CACHE committed ones.
        self._tail: deque[Message] = deque()
        # Durable: messages put (then held) and not committed yet, oldest
        # first. Not readable until their commit succeeds: they count in the
        # depth, and follow the tail.
        self._staged: list[Message] = []
        self._staged_held: list[Message] = []
        # Durable: called after a commit made staged messages readable, with
        # the held ones among them (their owner keeps those outside the
        # queue, from then on). Set by the queue's owner (mqd.nsqd.channel, mqd.nsqd.topic).
        self.on_stored = None
        # Keys of records stored by `hold` (deferred messages), so past the
        # read position while their messages live outside the queue: in the
        # deferred queue, then in memory or in flight once due or requeued.
        # Reads pass over them until they are FINished (or the queue is
        # emptied); releasing one earlier would let a read return it twice.
        self._held: set[bytes] = set()

    def _tail_start(self) -> int:
        if self._tail:
            return KEY.unpack(self._tail[0].key)[1]
        if self._staged:
            return KEY.unpack(self._staged[0].key)[1]
        return self._next_seq

    def put(self, messages) -> None:
        self._store_new(messages)
        self._depth += len(messages)
        store = self._store
        if store.durable:
            self._staged.extend(messages)
            if store.publishing:
                store._fresh.append((self, messages))
        else:
            self._tail.extend(messages)

    def _store_new(self, messages) -> None:
        """Give the messages the queue's next keys and stage them for the commit."""
        store = self._store
        if store.failure and not store.closing:
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

    def hold(self, messages) -> bool:
        """Durable: store them, and give them back through `on_stored` once committed (True)."""
        store = self._store
        if not store.durable:
            return False
        self._store_new(messages)
        self._held.update([m.key for m in messages])
        self._staged_held.extend(messages)
        if store.publishing:
            store._fresh.append((self, messages))
        return True

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

    def _stored(self, count: int, tail_start: int) -> list[Message]:
        """Up to `count` committed records from the read position to the tail, decoded, moving nothing.

        Held and deleted keys are passed over, a pending rewrite stands in
        for its record: what `read` hands out, and what `peek` shows.
        """
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
        return out

    def _read_stored(self, count: int, tail_start: int) -> list[Message]:
        """Decode up to `count` committed records from the read position."""
        out = self._stored(count, tail_start)
        if not out:
            # Only held or deleted records before the cached tail.
            self._read_seq = tail_start
        self._store.io_records += len(out)
        return out

    def peek(self, count: int) -> list[Message]:
        """What `read(count)` would return now, decoded in a read transaction of its own.

        The same records in the same order as `read`, then the tail, but
        nothing moves: not the read position (which `read` also advances
        past held records), the depth, the tail nor the store's pending
        changes, so a peek cannot change a later read.
        """
        if count <= 0:
            return []
        tail_start = self._tail_start()
        out = self._stored(count, tail_start) if self._read_seq < tail_start else []
        if len(out) < count:
            out += islice(self._tail, count - len(out))
        return out

    def peek_pieces(self, count: int, body_limit: int) -> Iterator[list[tuple[Message, int]]]:
        """IPiecewisePeek: `peek(count)` a piece at a time, record bodies cut at `body_limit`.

        A piece is at most _PEEK_PIECE_COUNT records and _PEEK_PIECE_BYTES
        of body, read in a transaction of its own from past the last
        sequence number handed out (or the read position, if reads went
        further meanwhile), so what was read away in between is skipped.
        """
        per_piece = max(1, min(_PEEK_PIECE_COUNT, _PEEK_PIECE_BYTES // (body_limit + _RECORD_SIZE)))
        after = -1
        while count > 0:
            piece, after = self._peek_piece(after, min(count, per_piece), body_limit)
            if not piece:
                return
            count -= len(piece)
            yield piece

    def _peek_piece(self, after: int, count: int, body_limit: int) -> tuple[list[tuple[Message, int]], int]:
        """Up to `count` (message, size) past sequence number `after`, and the last one's number."""
        start = max(self._read_seq, after + 1)
        tail_start = self._tail_start()
        out, last = self._peek_stored(start, tail_start, count, body_limit) if start < tail_start else ([], after)
        tail = self._tail
        if len(out) < count and tail:
            first = bisect_left(tail, start, key=_seq)
            for msg in islice(tail, first, None):
                if msg.key is None:  # finished meanwhile: gone
                    continue
                out.append((msg, len(msg.body)))
                last = _seq(msg)
                if len(out) >= count:
                    break
        return out, last

    def _peek_stored(self, start: int, stop: int, count: int,
                     body_limit: int) -> tuple[list[tuple[Message, int]], int]:
        """As `_stored` from sequence number `start`, only `body_limit` bytes of each body copied.

        Returns the (message, size) pairs and the sequence number of the last.
        """
        start_key = KEY.pack(self.qid, start)
        stop_key = KEY.pack(self.qid, stop)
        held = self._held
        store = self._store
        dels = store._dels
        updates = store._updates
        out: list[tuple[Message, int]] = []
        last = start - 1
        with store.env.begin(db=store.data_db, buffers=True) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start_key):
                return out, last
            for raw_key, value in cursor:
                key = bytes(raw_key)
                if key >= stop_key or len(out) >= count:
                    break
                if (held and key in held) or key in dels:
                    continue
                last = KEY.unpack(key)[1]
                msg = updates.get(key)
                if msg is None:
                    timestamp, attempts, deferred_until, msg_id = RECORD.unpack_from(value)
                    body = bytes(value[_RECORD_SIZE:_RECORD_SIZE + body_limit])
                    msg = Message(msg_id, body, timestamp, attempts, deferred_until)
                    msg.key = key
                    out.append((msg, len(value) - _RECORD_SIZE))
                else:
                    out.append((msg, len(msg.body)))
        return out, last

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
        for msg in self._staged_held:
            msg.key = None
        self._tail.clear()
        self._staged.clear()
        self._staged_held.clear()
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

    def _committed(self) -> list[Message] | None:
        """After a commit: staged messages become readable; the read cache is trimmed.

        Returns the held messages just committed when the owner must hear
        of the commit (`on_stored`), else None.
        """
        staged = self._staged
        held = self._staged_held
        tail = self._tail
        if staged:
            tail.extend(staged)
            self._staged = []
        if held:
            self._staged_held = []
        limit = _READ_CACHE if self._store.durable else 0
        puts = self._store._puts
        while len(tail) > limit and tail[0].key not in puts:
            tail.popleft()
        return held if (staged or held) and self.on_stored is not None else None

    def _drop_fresh(self) -> None:
        """After a failed commit: forget the staged messages `LmdbStore._roll_back` took the keys of."""
        staged = self._staged
        kept = [m for m in staged if m.key is not None]
        if len(kept) != len(staged):
            self._depth -= len(staged) - len(kept)
            self._staged = kept
        if self._staged_held:
            self._staged_held = [m for m in self._staged_held if m.key is not None]


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
        self.spill_path = os.path.join(options.data_path or ".", SPILL_FILE)
        self.failure: str | None = None
        # Set by the broker's shutdown: what memory still holds is staged even
        # after a failed commit, for close() to write what fits and spill the rest.
        self.closing = False
        # A commit must write something even with nothing pending: a start-up
        # write outside the store failed (mark_failed), and only a commit that
        # succeeds shows there is room again.
        self._probe = False
        # Messages read back from the spill file, by queue id, until their queue opens.
        self._spilled: dict[int, list[Message]] = {}
        self._spill_loaded = False
        self.health_listener = None
        # Set while a publisher's new messages are put (mqd.nsqd.topic.Topic.publish):
        # durable, what is put meanwhile goes into _fresh, and a failed commit
        # drops it, as its publishers are answered with the error.
        self.publishing = False
        self._fresh: list[tuple[LmdbQueue, list[Message]]] = []
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
        self._load_spill()
        self._sync_loop = None
        if not self.durable and self.sync_timeout > 0:
            self._sync_loop = LoopingCall(self._sync_if_dirty)
            self._sync_loop.clock = clock
            self._sync_loop.start(self.sync_timeout, now=False)
        self._unmap_loop = None
        # Records read or written since the mapped pages were last looked at,
        # and the process's file-backed RSS after they were last released.
        self.io_records = 0
        self._mapped_base = _file_rss()
        if _madvise is not None:
            self._unmap_loop = LoopingCall(self.check_mapped_pages)
            self._unmap_loop.clock = clock
            self._unmap_loop.start(_UNMAP_EVERY, now=False)

    # -- opening -------------------------------------------------------------------

    def _open_env(self, map_size: int) -> lmdb.Environment:
        try:
            os.makedirs(self.path, exist_ok=True)
            self._check_room()
            env = lmdb.open(
                self.path, map_size=map_size, max_dbs=8, subdir=True,
                sync=self.durable, metasync=self.durable, readahead=False,
            )
        except lmdb.Error as e:
            raise StoreOpenError(f"{self.path}: not a usable LMDB environment ({e})") from None
        except OSError as e:
            if _no_room(e):
                raise StoreOpenError(self._no_room_text(e.strerror)) from None
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
            if _no_room(e):
                raise StoreOpenError(self._no_room_text(str(e))) from None
            raise StoreOpenError(f"{self.path}: corrupt LMDB environment ({e})") from None
        except StoreOpenError:
            env.close()
            raise
        return env

    def _check_room(self) -> None:
        """Before LMDB creates files (a new environment): stop if the disk has no room for them.

        Only creating files needs room; an existing environment opens
        without writing, so a full disk does not keep it from serving.
        """
        if all(os.path.exists(os.path.join(self.path, f)) for f in ("data.mdb", "lock.mdb")):
            return
        probe = os.path.join(self.path, ".room-check")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, _ROOM_FOR_NEW_ENV)
        except OSError as e:
            if _no_room(e):
                raise
            # No fallocate on this filesystem: LMDB's own errors will tell.
        finally:
            os.close(fd)
            os.unlink(probe)

    def _no_room_text(self, error: str) -> str:
        return (f"{self.path}: cannot create the store: {error}; "
                f"free space on that filesystem or choose another --data-path")

    def _load_registry(self) -> None:
        try:
            with self.env.begin(db=self.registry_db) as txn:
                for name, qid in txn.cursor():
                    self._known[bytes(name).decode()] = _QID.unpack(qid)[0]
        except (lmdb.Error, UnicodeDecodeError, struct.error) as e:
            raise StoreOpenError(f"{self.path}: corrupt queue registry ({e})") from None
        self._next_qid = max(self._known.values(), default=0) + 1

    def _load_spill(self) -> None:
        """Take back what the last shutdown could not write (see close): it is staged for the next commit.

        The records keep their keys, so each queue gets them back in place,
        after what LMDB holds; they are served from memory until the commit
        writes them, and the file goes once a commit has.
        """
        try:
            with open(self.spill_path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            raise StoreOpenError(f"{self.spill_path}: cannot read the spill file: {e.strerror}") from None
        try:
            entries = _parse_spill(raw)
        except ValueError as e:
            raise StoreOpenError(
                f"{self.spill_path}: corrupt spill file ({e}); move it away to start without "
                f"the messages it holds") from None
        records = 0
        with self.env.begin(db=self.data_db, buffers=False) as txn:
            for kind, key, value in entries:
                if kind == _SPILL_REGISTRY:
                    name = key.decode()
                    if name not in self._known:
                        self._known[name] = _QID.unpack(value)[0]
                        self._registry_puts[key] = value
                    continue
                msg = _decode(key, value)
                records += 1
                if txn.get(key) is not None:
                    self._updates[key] = msg  # a rewrite of a record LMDB has
                else:
                    self._puts[key] = msg
                    self._spilled.setdefault(_QID.unpack_from(key)[0], []).append(msg)
        self._next_qid = max(self._known.values(), default=0) + 1
        self._spill_loaded = True
        log.warn("{spill}: {n} messages the last shutdown could not write to LMDB are back; "
                 "the file is removed once they are written", spill=self.spill_path, n=records)
        self._schedule()

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
        spilled = self._spilled.pop(qid, None)
        if spilled:
            # Put after everything LMDB holds of the queue (the shutdown wrote
            # each queue's oldest first), so they follow it, in order.
            spilled.sort(key=lambda m: m.key)
            if not depth:
                first = KEY.unpack(spilled[0].key)[1]
            nxt = max(nxt, KEY.unpack(spilled[-1].key)[1] + 1)
            depth += len(spilled)
        queue = self._queues[name] = LmdbQueue(self, name, qid, first, nxt, depth)
        if spilled:
            queue._tail.extend(spilled)
            self._touched.add(queue)
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
                    or self._registry_puts or self._registry_dels or self._probe)

    def mark_failed(self, error: str) -> None:
        """A write next to the store failed at start-up (nsqd.dat on a full disk).

        The disk is full: refuse puts as after a failed commit (E_PUB_FAILED,
        /ping NOK) and retry a commit that writes something every second;
        the first that succeeds clears the failure, as when the disk fills
        while running.
        """
        self._probe = True
        if self.failure is None:
            self.failure = error
            if self.health_listener is not None:
                self.health_listener(error)
        if self._commit_call is not None and self._commit_call.active():
            self._commit_call.cancel()
        self._commit_call = self.clock.callLater(_RETRY_AFTER, self.commit)

    def cut(self) -> lmdb.Transaction:
        """Commit what is pending now and open a read transaction on the result.

        A snapshot's consistent cut: called on the reactor, so nothing is
        staged between the commit and the transaction, which therefore
        holds every message the broker has put and not removed. Raises
        BackendError while the store is failing (or a commit is waiting
        for a running copy to finish): a cut then would miss what is
        staged. The caller aborts the transaction (any thread may).
        """
        if self.failure:
            raise BackendError(self.failure)
        self.commit()
        if self.failure or self._pending():
            raise BackendError(self.failure or "a commit is waiting for a snapshot copy")
        return self.env.begin(buffers=False)

    def commit(self) -> None:
        """Write everything gathered since the last commit in one transaction."""
        if self._commit_call is not None and self._commit_call.active():
            self._commit_call.cancel()
        self._commit_call = None
        waiters, self._waiters = self._waiters, []
        if not self._pending():
            self._fresh.clear()  # emptied queues' messages, if any: nothing left to drop
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
        if self._spill_loaded:
            self._remove_spill()
        self._fresh.clear()
        self._unsynced += written
        self.io_records += written
        if self.io_records >= _UNMAP_RECORDS:
            self.check_mapped_pages()
        if not self.durable and self.sync_every and self._unsynced >= self.sync_every:
            self.sync()
        touched, self._touched = self._touched, set()
        stored = [(queue, held) for queue in touched if (held := queue._committed()) is not None]
        for callback in waiters:
            callback(None)
        # Their owners deliver what became readable, or drain it (a topic's);
        # what they put meanwhile goes into the next commit.
        for queue, held in stored:
            try:
                queue.on_stored(held)
            except Exception:
                log.failure("queue {name}: handing over committed messages failed", name=queue.name)

    def _write(self) -> int:
        """Write everything pending; how many records were written or deleted.

        One transaction, unless more than _COMMIT_CHUNK records are to be
        written (a backlog requeued or timed out at once): then all but the
        last of them go in bounded transactions first. LMDB keeps the pages
        a transaction dirtied in a pool of its own for reuse and never gives
        them back, so one transaction of 100,000 1 KB records held ~200 MB
        for good. The new publishes go in the last transaction, so one that
        fails leaves none of them written: what earlier ones wrote was
        acknowledged long ago and stays, the rest is retried.
        """
        puts, updates = self._puts, self._updates
        written = len(puts) + len(updates) + len(self._dels)
        meta = True
        if len(puts) + len(updates) > _COMMIT_CHUNK:
            meta = self._write_early()
        self._write_records(chain(puts.items(), updates.items()) if updates else puts.items(), meta)
        puts.clear()
        updates.clear()
        if meta:
            self._meta_written()
        return written

    def _write_early(self) -> bool:
        """A big commit's records but the new publishes, in bounded transactions, but a last part.

        Each transaction's records are forgotten once it is committed (the
        first also writes drops, deletions and the registry). Returns
        whether those are still to be written.
        """
        fresh = {m.key for _, msgs in self._fresh for m in msgs} if self._fresh else ()
        early = [item for item in self._puts.items() if item[0] not in fresh]
        early += self._updates.items()
        puts, updates = self._puts, self._updates
        meta = True
        chunk: list[tuple[bytes, Message]] = []
        size = 0
        for item in early:
            chunk.append(item)
            size += len(item[1].body)
            if len(chunk) >= _COMMIT_CHUNK or size >= _COMMIT_CHUNK_BYTES:
                self._write_records(chunk, meta)
                if meta:
                    self._meta_written()
                    meta = False
                for key, _ in chunk:
                    if puts.pop(key, None) is None:
                        updates.pop(key, None)
                chunk, size = [], 0
        return meta

    def _write_records(self, records, meta: bool) -> None:
        """One transaction: `records` ((key, message) pairs), after drops, deletions and the registry if `meta`."""
        with self.env.begin(write=True, db=self.data_db) as txn:
            if meta:
                for qid, bound in self._drops:
                    _drop_range(txn, qid, bound)
                if self._probe:
                    txn.put(b"format", FORMAT, db=self.meta_db)
                delete = txn.delete
                for key in self._dels:
                    delete(key)
                put = txn.put
                for name, qid in self._registry_puts.items():
                    put(name, qid, db=self.registry_db)
                for name in self._registry_dels:
                    delete(name, db=self.registry_db)
            # One C loop over the records instead of a put call each; their
            # list is as big as a transaction, bounded by _write.
            txn.cursor().putmulti([(key, _encode(msg)) for key, msg in records])

    def _meta_written(self) -> None:
        self._dels.clear()
        self._drops.clear()
        self._registry_puts.clear()
        self._registry_dels.clear()
        self._probe = False

    def _grow(self) -> None:
        size = self.env.info()["map_size"] * 2
        log.info("LMDB map full; growing it to {size} bytes", size=size)
        self.env.set_mapsize(size)

    def _failed(self, error: str, waiters: list) -> None:
        """A commit failed (a full disk): drop its new publishes, keep the rest for the retry, fail the waiters.

        The waiters' publishers are answered with the error, so their
        messages must never be stored nor delivered: the new publishes go
        (nobody has seen them, as a durable queue hands out only committed
        messages). Everything else was acknowledged before and is retried.
        """
        if self.failure is None:
            log.error("LMDB commit failed, retrying every {s}s: {error}", s=_RETRY_AFTER, error=error)
            if self.health_listener is not None:
                self.health_listener(f"LMDB write failed: {error}")
        self.failure = f"LMDB write failed: {error}"
        self._roll_back()
        # The retry writes something even if FINs have emptied what was
        # pending by then; otherwise nothing would ever clear the failure.
        self._probe = True
        for callback in waiters:
            callback(self.failure)
        self._commit_call = self.clock.callLater(_RETRY_AFTER, self.commit)

    def _roll_back(self) -> None:
        """Unstage the new publishes of a failed commit: no record, no place in any queue."""
        fresh, self._fresh = self._fresh, []
        if not fresh:
            return
        puts = self._puts
        queues = set()
        dropped = 0
        for queue, messages in fresh:
            held = queue._held
            for msg in messages:
                key = msg.key
                if key is None:  # its queue was emptied meanwhile
                    continue
                msg.key = None
                puts.pop(key, None)
                held.discard(key)
                dropped += 1
            queues.add(queue)
        for queue in queues:
            queue._drop_fresh()
        log.warn("LMDB commit failed: {n} newly published messages dropped (their publishers are "
                 "answered with the error)", n=dropped)

    # -- syncing -----------------------------------------------------------------------

    def sync(self) -> None:
        self.env.sync(True)
        self._unsynced = 0

    def _sync_if_dirty(self) -> None:
        if self._unsynced:
            self.sync()

    def check_mapped_pages(self) -> None:
        """Release the mapped pages (release_mapped_pages) once they have grown by _UNMAP_ABOVE."""
        self.io_records = 0
        if _madvise is not None and _file_rss() - self._mapped_base > _UNMAP_ABOVE:
            self.release_mapped_pages()

    def release_mapped_pages(self) -> int:
        """Unmap the pages of the data file this process has read through LMDB's map; bytes released.

        Every record read maps its page into the process (RssFile), and it
        stays mapped: a broker that has moved a few GB through the store
        shows GBs of RSS that are only the page cache, which a broker
        reading its files (nsqd) does not count. MADV_DONTNEED drops the
        mappings, not the data: the map is read-only and shared, so the
        pages stay in the page cache and the next read maps them again (a
        minor fault), also for readers in other threads.
        """
        global _madvise
        self.io_records = 0
        if _madvise is None:
            return 0
        released = 0
        try:
            for start, length in _mapped_ranges(os.path.join(self.path, "data.mdb")):
                if _madvise(start, length, _MADV_DONTNEED) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
                released += length
        except (OSError, ValueError) as e:
            log.info("LMDB: mapped pages cannot be released ({error}); not tried again", error=e)
            _madvise = None
        self._mapped_base = _file_rss()
        return released

    def close(self) -> Deferred | None:
        """Write what is pending and close the environment.

        Pending changes go in one transaction, as every commit. If that fails
        (a full disk: one transaction needs room for all of it, and a shutdown
        flushes every memory queue at once) they go in bounded transactions
        instead, so what fits is kept; the rest is saved to the spill file
        that the next start reads back, and if even that cannot be written
        the store stays open and retries every second (the Deferred returned
        fires once closed), so acknowledged messages are not dropped silently.
        """
        if self._sync_loop is not None and self._sync_loop.running:
            self._sync_loop.stop()
        if self._unmap_loop is not None and self._unmap_loop.running:
            self._unmap_loop.stop()
        waiting = None
        try:
            self.commit()
            if self.failure is not None:
                waiting = self._close_bounded()
            else:
                self.sync()
        finally:
            if self._commit_call is not None and self._commit_call.active():
                self._commit_call.cancel()
            self._commit_call = None
            if waiting is None:
                self.env.close()
        return waiting

    # -- a shutdown on a full disk ----------------------------------------------------------

    def _ordered_ops(self) -> list[tuple[int, Any, Any]]:
        """Everything pending as write operations, what matters most first.

        Deletions first: they free pages, and FINished messages must not come
        back. Then the registry (records of an unregistered queue are never
        read), then new messages, each queue's oldest first so what is kept of
        a queue is its head, and last the rewrites of stored records (their
        attempts and deferral), whose messages LMDB already holds.
        """
        ops: list[tuple[int, Any, Any]] = [(_DROP, qid, bound) for qid, bound in self._drops]
        ops += [(_DEL, key, None) for key in sorted(self._dels)]
        ops += [(_REG_DEL, name, None) for name in sorted(self._registry_dels)]
        ops += [(_REG_PUT, name, qid) for name, qid in sorted(self._registry_puts.items())]
        ops += [(_PUT, key, _encode(msg)) for key, msg in sorted(self._puts.items())]
        ops += [(_PUT, key, _encode(msg)) for key, msg in sorted(self._updates.items())]
        return ops

    def _write_ops(self, ops) -> None:
        """Apply write operations in one transaction."""
        with self.env.begin(write=True, db=self.data_db) as txn:
            for op, key, value in ops:
                if op == _PUT:
                    txn.put(key, value)
                elif op == _DEL:
                    txn.delete(key)
                elif op == _REG_PUT:
                    txn.put(key, value, db=self.registry_db)
                elif op == _REG_DEL:
                    txn.delete(key, db=self.registry_db)
                else:
                    _drop_range(txn, key, value)

    def _write_bounded(self, ops) -> tuple[int, str | None]:
        """Write `ops` in order in bounded transactions; (how many were written, the last error).

        A transaction that does not fit is retried at half its size, down to
        one operation: the first single operation that does not fit ends it.
        """
        done, limit, error = 0, _CLOSE_CHUNK, None
        while done < len(ops):
            end, size = done, 0
            while end < len(ops) and end - done < limit and size < _CLOSE_CHUNK_BYTES:
                value = ops[end][2]
                size += len(value) if isinstance(value, bytes) else 16
                end += 1
            try:
                self._write_ops(ops[done:end])
            except lmdb.MapFullError:
                self._grow()
                continue
            except lmdb.Error as e:
                error = str(e)
                if end - done == 1:
                    break
                limit = (end - done) // 2
                continue
            done = end
        return done, error

    def _close_bounded(self) -> Deferred | None:
        """The shutdown's commit failed: keep what fits, spill the rest, say so in one line.

        Returns a Deferred when not even the spill file could be written:
        the store then retries both every second until one works.
        """
        ops = self._ordered_ops()
        total = sum(1 for op in ops if op[0] == _PUT)
        done, error = self._write_bounded(ops)
        left = ops[done:]
        if not left:
            self._finish_close(True, False)
            log.warn("closing LMDB: the shutdown's commit failed ({error}); written in smaller "
                     "transactions instead", error=self.failure)
            return None
        spill = [op for op in left if op[0] in (_PUT, _REG_PUT)]
        unwritten = sum(1 for op in spill if op[0] == _PUT)
        deletions = len(left) - len(spill)
        also = (f"; {deletions} deletions not written either (FINished messages may be delivered again)"
                if deletions else "")
        try:
            self._write_spill(spill)
        except OSError as e:
            log.error("closing LMDB: {n} of {total} messages could not be written ({error}) nor saved "
                      "to {spill} ({spill_error}): waiting for free space under {path}, retrying every "
                      "{s:g}s (killing the broker now loses them){also}", n=unwritten, total=total,
                      error=error, spill=self.spill_path, spill_error=e.strerror,
                      path=os.path.abspath(os.path.dirname(self.spill_path) or "."), s=_RETRY_AFTER,
                      also=also)
            closed = Deferred()
            self.clock.callLater(_RETRY_AFTER, self._retry_close, spill, closed)
            return closed
        self._finish_close(False, False)
        log.error("closing LMDB: {n} of {total} messages could not be written ({error}); saved to "
                  "{spill}, written back at the next start{also}", n=unwritten, total=total,
                  error=error, spill=self.spill_path, also=also)
        return None

    def _retry_close(self, ops, closed: Deferred) -> None:
        """Waiting at shutdown for room: write into LMDB what fits now, else try the spill file again."""
        try:
            done, _ = self._write_bounded(ops)
            ops = ops[done:]
            spilled = False
            if ops:
                try:
                    self._write_spill(ops)
                    spilled = True
                except OSError:
                    self.clock.callLater(_RETRY_AFTER, self._retry_close, ops, closed)
                    return
            self._finish_close(not spilled, True)
        except Exception:
            # A bug, not the disk: say so and let the shutdown finish rather than hang.
            log.failure("closing LMDB: {n} messages left unwritten", n=len(ops))
            self.env.close()
            closed.callback(None)
            return
        log.info("closing LMDB: there is room again; the messages left are {where}",
                 where=f"saved to {self.spill_path}" if spilled else "written")
        closed.callback(None)

    def _finish_close(self, all_in_lmdb: bool, close_env: bool) -> None:
        """Everything is in LMDB or the spill file: sync, drop a spill file now written back."""
        try:
            self.sync()
        except lmdb.Error:
            pass  # what was written is in the page cache; nothing better to do at exit
        if all_in_lmdb and self._spill_loaded:
            self._remove_spill()
        if close_env:
            self.env.close()

    def _write_spill(self, ops) -> None:
        """Save registry entries and records atomically (temp file, fsync, rename); raises OSError."""
        entries = [(_SPILL_REGISTRY if op == _REG_PUT else _SPILL_RECORD, key, value)
                   for op, key, value in ops]
        tmp = self.spill_path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_spill_bytes(entries))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.spill_path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(self.spill_path)

    def _remove_spill(self) -> None:
        """The spilled records are committed: sync them, then let the file go.

        A queue not opened yet now finds its records in LMDB (_scan): handing
        them over again from _spilled would count them twice.
        """
        self._spill_loaded = False
        self._spilled.clear()
        try:
            self.sync()
            os.unlink(self.spill_path)
            _fsync_dir(self.spill_path)
        except FileNotFoundError:
            pass
        except (OSError, lmdb.Error) as e:
            # Harmless: written back again at the next start, as rewrites.
            log.warn("{spill}: cannot remove it ({error})", spill=self.spill_path, error=e)
        else:
            log.info("{spill}: its messages are in LMDB again; removed", spill=self.spill_path)

    def stats(self) -> dict[str, Any]:
        return {"path": self.path, **self.env.info(), **self.env.stat()}


# -- helpers -------------------------------------------------------------------------------------


def _drop_range(txn, qid: int, bound: int) -> None:
    """Delete the queue's records below sequence `bound` (an emptied queue)."""
    cursor = txn.cursor()
    # Keys are fixed-length, so every key in [qid, (qid, bound)) is the queue's.
    stop = KEY.pack(qid, bound)
    if cursor.set_range(_QID.pack(qid)):
        while cursor.key() < stop:
            if not cursor.delete():  # False once past the last record
                break


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    """(address, length) of this process's mappings of `path`, from /proc/self/maps."""
    suffix = " " + os.path.realpath(path) + "\n"
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.endswith(suffix):
                low, _, high = line.partition(" ")[0].partition("-")
                ranges.append((int(low, 16), int(high, 16) - int(low, 16)))
    return ranges


def _file_rss() -> int:
    """This process's resident file-backed and shared pages in bytes (/proc/self/statm), 0 if unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def _load_madvise():
    """libc's madvise(2) (Linux, with /proc/self/maps), or None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        func = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    func.restype = ctypes.c_int
    return func


_madvise = _load_madvise()
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def _fsync_dir(path: str) -> None:
    """Make a rename or unlink in `path`'s directory durable."""
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _spill_bytes(entries) -> bytes:
    """The spill file: a magic line, (kind, key, value) entries, then their count and CRC-32."""
    parts = []
    for kind, key, value in entries:
        parts += (_SPILL_ENTRY.pack(kind, len(key), len(value)), key, value)
    body = b"".join(parts)
    return _SPILL_MAGIC + body + _SPILL_END.pack(_SPILL_DONE, len(entries), zlib.crc32(body))


def _parse_spill(raw: bytes) -> list[tuple[int, bytes, bytes]]:
    """The entries of a spill file; ValueError if it is not one, or not whole."""
    if not raw.startswith(_SPILL_MAGIC):
        raise ValueError("not an mqd spill file")
    if len(raw) < len(_SPILL_MAGIC) + _SPILL_END.size:
        raise ValueError("truncated")
    body = raw[len(_SPILL_MAGIC):-_SPILL_END.size]
    done, count, crc = _SPILL_END.unpack(raw[-_SPILL_END.size:])
    if done != _SPILL_DONE or zlib.crc32(body) != crc:
        raise ValueError("truncated or damaged (checksum mismatch)")
    entries = []
    pos = 0
    while pos < len(body):
        if pos + _SPILL_ENTRY.size > len(body):
            raise ValueError(f"entry header cut at byte {pos}")
        kind, klen, vlen = _SPILL_ENTRY.unpack_from(body, pos)
        pos += _SPILL_ENTRY.size
        key, value = body[pos:pos + klen], body[pos + klen:pos + klen + vlen]
        pos += klen + vlen
        if kind == _SPILL_RECORD:
            good = len(key) == KEY.size and len(value) == vlen >= _RECORD_SIZE
        else:
            good = kind == _SPILL_REGISTRY and len(value) == vlen == _QID.size and _is_utf8(key)
        if not good:
            raise ValueError(f"bad entry ending at byte {pos}")
        entries.append((kind, key, value))
    if len(entries) != count:
        raise ValueError(f"{len(entries)} entries, the trailer says {count}")
    return entries


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
