"""The LMDB store: every topic and channel queue in one LMDB environment.

The layout is backends.lmdb_records' (one `messages` database for all
queues, each a contiguous key range; measured against one named database
per queue with 10,000 queues, see the storage docs), a queue is
backends.lmdb_queue's LmdbQueue, and a shutdown on a full disk is
backends.lmdb_spill's.

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
import mmap
import os
import struct
import sys
import threading
from collections import deque
from itertools import chain
from typing import Any

import lmdb
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.task import LoopingCall
from zope.interface import implementer

from backends.interface import BackendError, IBackendStore, StoreOpenError
from backends.lmdb_log import LOG_FILE, PublishLog, encode_chunk, parse_chunks
from backends.lmdb_queue import LmdbQueue
from backends.lmdb_records import (
    ENV_DIR,
    FORMAT,
    KEY,
    OUR_DBS,
    QID,
    RECORD,
    drop_range,
    encode_record,
)
from backends.lmdb_spill import SPILL_FILE, SpillingShutdown, no_room
from mqd.logs import get_logger
from mqd.message import Message

__all__ = ["ENV_DIR", "FORMAT", "KEY", "LmdbQueue", "LmdbStore", "RECORD", "SPILL_FILE", "StoreOpenError"]

log = get_logger(__name__)

DEFAULT_MAP_SIZE = 1 << 30
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
# Durable with a publish log: LMDB takes what was logged (a checkpoint) once
# this many records are pending, or this many seconds after the last one.
_CHECKPOINT_RECORDS = 4096
_CHECKPOINT_LOG_BYTES = 16 << 20
# The publish log's file is preallocated to this size (see backends.lmdb_log).
_LOG_PREALLOCATE = 2 * _CHECKPOINT_LOG_BYTES
_CHECKPOINT_EVERY = 0.2
# The meta key of the last publish-log chunk a checkpoint covers.
_LOG_EPOCH = b"log-epoch"
_EPOCH = struct.Struct(">Q")
# How long a commit that needs a bigger map waits for a running snapshot copy.
_COPY_WAIT = 0.05
# Room a new environment needs before LMDB creates its files: LMDB writes
# its lock file through a memory map, and on a full disk a page fault there
# is a SIGBUS, which kills the process without a word.
_ROOM_FOR_NEW_ENV = 1 << 20


@implementer(IBackendStore)
class LmdbStore(SpillingShutdown):
    """One LMDB environment under data-path, shared by every queue of the broker."""

    # Seconds before a failed commit (or a shutdown write on a full disk) is tried again.
    RETRY_AFTER = 1.0

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
        # The publish log (backends.lmdb_log): durable, on a reactor with
        # threads. Whatever the mode, what a log left by a crash holds is
        # written into LMDB first.
        self._log: PublishLog | None = None
        self._log_epoch = 0
        self._replay_log()
        if self.durable and IReactorThreads.providedBy(clock):
            self._log = PublishLog(os.path.join(self.path, LOG_FILE), _LOG_PREALLOCATE)
        # What changed since the last chunk was taken (None without a log):
        # batches of new and of rewritten messages, and deleted keys.
        self._log_puts: list | None = [] if self._log is not None else None
        self._log_updates: list = []
        self._log_dels: list | None = [] if self._log is not None else None
        # Chunks handed to the writer thread and not landed yet, oldest
        # first; the queues with messages staged since the last chunk; the
        # writer's inbox, whether it is running, and the error that broke it.
        # `_again`: a checkpoint (or a probe) waits for those chunks to land.
        self._flights: deque[_Flight] = deque()
        self._staging: set[LmdbQueue] = set()
        self._outbox: list[_Flight] = []
        self._outbox_lock = threading.Lock()
        self._writing = False
        self._broken: BaseException | None = None
        self._again = False
        self._idle_call = None
        self._checkpointed = clock.seconds()
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
            if no_room(e):
                raise StoreOpenError(self._no_room_text(e.strerror)) from None
            raise StoreOpenError(f"{self.path}: {e.strerror}") from None
        try:
            with env.begin() as txn:
                names = {bytes(k) for k, _ in txn.cursor()}
            foreign = names - OUR_DBS
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
            if no_room(e):
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
            if no_room(e):
                raise
            # No fallocate on this filesystem: LMDB's own errors will tell.
        finally:
            os.close(fd)
            os.unlink(probe)

    def _no_room_text(self, error: str) -> str:
        return (f"{self.path}: cannot create the store: {error}; "
                f"free space on that filesystem or choose another --data-path")

    def _replay_log(self) -> None:
        """Write into LMDB what a publish log holds past the last checkpoint (a crash).

        Torn or damaged chunks at the end are what a crash cut short: their
        publishers were never answered, so they are dropped. A durable store
        then writes the log over from its start; any other removes it.
        """
        with self.env.begin(db=self.meta_db) as txn:
            mark = txn.get(_LOG_EPOCH)
        self._log_epoch = done = _EPOCH.unpack(mark)[0] if mark is not None else 0
        path = os.path.join(self.path, LOG_FILE)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            raise StoreOpenError(f"{path}: cannot read the publish log: {e.strerror}") from None
        if not raw:
            return
        try:
            with self.env.begin(write=True, db=self.data_db) as txn:
                epoch = done
                records = deleted = 0
                for epoch_, ops in parse_chunks(raw):
                    if epoch_ <= done:
                        continue
                    epoch = epoch_
                    for key, record in ops:
                        if record is None:
                            deleted += txn.delete(key)
                        else:
                            txn.put(key, record)
                            records += 1
                if epoch != done:
                    txn.put(_LOG_EPOCH, _EPOCH.pack(epoch), db=self.meta_db)
            self.env.sync(True)
        except lmdb.Error as e:
            raise StoreOpenError(f"{path}: cannot replay the publish log into LMDB ({e})") from None
        self._log_epoch = epoch
        if epoch != done:
            log.info("{path}: {n} records written and {d} deleted from the publish log (chunks "
                     "{first} to {last})", path=path, n=records, d=deleted, first=done + 1, last=epoch)
        if not self.durable:
            # A durable store writes over it (replay skips what LMDB holds);
            # any other has no use for it.
            try:
                os.unlink(path)
            except OSError as e:
                log.warn("{path}: cannot remove the publish log ({error}); it is replayed no "
                         "further than LMDB says", path=path, error=e.strerror)

    def _load_registry(self) -> None:
        try:
            with self.env.begin(db=self.registry_db) as txn:
                for name, qid in txn.cursor():
                    self._known[bytes(name).decode()] = QID.unpack(qid)[0]
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
            self._registry_puts[name.encode()] = QID.pack(qid)
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
        prefix = QID.pack(qid)
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
        self._commit_call = self.clock.callLater(self.RETRY_AFTER, self.commit)

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
        self._land_now()
        self._checkpoint()
        if self.failure or self._pending():
            raise BackendError(self.failure or "a commit is waiting for a snapshot copy")
        return self.env.begin(buffers=False)

    def commit(self) -> None:
        """Make what was gathered since the last commit durable (a reactor turn's group commit).

        Durable with a publish log, that is a chunk of the log, handed to
        a writer thread while the reactor goes on; the writer writes every
        chunk handed to it meanwhile and syncs them with one fdatasync.
        LMDB takes everything in a checkpoint when one is due. Otherwise,
        one LMDB transaction.
        """
        if self._log is None:
            self._checkpoint()
            return
        if self.closing:
            self._land_now()
            self._checkpoint()
            return
        if self._commit_call is not None and self._commit_call.active():
            self._commit_call.cancel()
        self._commit_call = None
        if self._checkpoint_due() or self.failure:
            # A checkpoint, or a probe while failing, waits for the chunks
            # being written: they land first, in order.
            if self._flights:
                self._again = True
            elif self._checkpoint_due():
                self._checkpoint()
            else:
                self._take_off()
            return
        if not (self._waiters or self._log_puts):
            # Nobody waits: no publisher, no message to hand out. Rewrites
            # and FINs go with the next chunk, or LMDB takes them when due.
            if self._unchecked():
                self._checkpoint_later(_CHECKPOINT_EVERY - (self.clock.seconds() - self._checkpointed))
            return
        self._take_off()

    def _checkpoint_due(self) -> bool:
        """LMDB must take what is pending now: structure changed, a probe, or enough gathered."""
        if (self._drops or self._registry_puts or self._registry_dels or self._probe
                or self._spill_loaded):
            return True
        pending = len(self._puts) + len(self._updates) + len(self._dels)
        if pending >= _CHECKPOINT_RECORDS or self._log.size >= _CHECKPOINT_LOG_BYTES:
            return True
        return self._unchecked() and self.clock.seconds() - self._checkpointed >= _CHECKPOINT_EVERY

    def _unchecked(self) -> bool:
        """Something LMDB has not taken: pending records, or a log to empty (what FINs cancelled)."""
        return self._pending() or (self._log is not None and self._log.size > 0)

    def _take_off(self) -> None:
        """Hand what changed since the last chunk to the writer thread, as one chunk of the publish log."""
        self._log_epoch += 1
        flight = _Flight(self._log_epoch, self._waiters, self._fresh, self._log_puts,
                         self._log_updates, self._log_dels)
        self._waiters, self._fresh = [], []
        self._log_puts, self._log_updates, self._log_dels = [], [], []
        staging, self._staging = self._staging, set()
        for queue in staging:
            if queue._fly():
                flight.queues.append(queue)
        self._flights.append(flight)
        try:
            flight.data = encode_chunk(flight.epoch, flight.puts, flight.updates, flight.dels)
        except Exception:  # a bug, not the disk: fail the chunk as the disk would
            log.failure("publish log: encoding a chunk failed")
            flight.data = None
        with self._outbox_lock:
            self._outbox.append(flight)
            if self._writing:
                return
            self._writing = True
        self.clock.callInThread(self._write_out)

    def _write_out(self) -> None:
        """In a thread: write every chunk handed over, one fdatasync for all, then land them on the reactor.

        After a failed write, every chunk handed over until the reactor has
        dealt with the failure fails too, unwritten: chunks land in order,
        and none may be on disk after one that is not.
        """
        outbox = self._outbox
        while True:
            with self._outbox_lock:
                if not outbox:
                    self._writing = False
                    return
                batch = list(outbox)
                outbox.clear()
            error = self._broken
            if error is None:
                try:
                    if any(flight.data is None for flight in batch):
                        raise ValueError("a chunk could not be encoded")
                    self._log.append([piece for flight in batch for piece in flight.data])
                except BaseException as e:
                    error = self._broken = e
            for flight in batch:
                flight.error = error
                flight.done.set()
            self.clock.callFromThread(self._land, batch)

    def _land_now(self) -> None:
        """Wait for the chunks being written and land them (before a checkpoint or a close)."""
        flights = list(self._flights)
        for flight in flights:
            flight.done.wait()
        if flights:
            self._land(flights, go_on=False)

    def _land(self, batch: list[_Flight], go_on: bool = True) -> None:
        """On the reactor: chunks are synced (publishes answered, messages readable), or failed."""
        flights = self._flights
        for flight in batch:
            if not flights or flights[0] is not flight:
                continue  # landed already by _land_now, or failed with an earlier one
            if flight.error is not None:
                self._log_failed()
                return
            flights.popleft()
            self._healthy()
            self._hand_over(flight.waiters,
                            [(queue, held) for queue in flight.queues if (held := queue._landed()) is not None])
        if not go_on or flights:
            return
        if self._again or self._checkpoint_due():
            self._again = False
            self.commit()
        elif self._unchecked():
            self._checkpoint_later(_CHECKPOINT_EVERY)

    def _checkpoint_later(self, delay: float) -> None:
        """Quiet now: LMDB takes what was logged a little later (a commit asked for meanwhile comes first)."""
        if self._idle_call is None or not self._idle_call.active():
            self._idle_call = self.clock.callLater(max(delay, 0.0), self.commit)

    def _log_failed(self) -> None:
        """A chunk could not be written (a full disk): it and every later one fail, as a failed commit.

        Their new publishes are dropped, their publishers answered with the
        error. Their other changes (messages moved to channels, rewrites,
        deletions) were acknowledged long ago: they go back, in order, to
        be logged again.
        """
        flights = list(self._flights)
        self._flights.clear()
        for flight in flights:
            flight.done.wait()  # the writer fails them at once, unwritten
        self._broken = None
        error = flights[0].error
        text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        if not isinstance(error, OSError):
            log.error("publish log: writing a chunk failed: {error!r}", error=error)
        queues = {queue for flight in flights for queue in flight.queues}
        for queue in queues:
            queue._unfly()
        self._staging |= queues
        self._log_puts[:0] = [batch for flight in flights for batch in flight.puts]
        self._log_updates[:0] = [batch for flight in flights for batch in flight.updates]
        self._log_dels[:0] = [key for flight in flights for key in flight.dels]
        if self.failure is None:
            log.error("publish log write failed, retrying every {s}s: {error}", s=self.RETRY_AFTER,
                      error=text)
            if self.health_listener is not None:
                self.health_listener(f"LMDB write failed: {text}")
        self.failure = f"LMDB write failed: {text}"
        self._roll_back([fresh for flight in flights for fresh in flight.fresh])
        for flight in flights:
            for callback in flight.waiters:
                callback(self.failure)
        if self._commit_call is not None and self._commit_call.active():
            self._commit_call.cancel()
        self._commit_call = self.clock.callLater(self.RETRY_AFTER, self.commit)

    def _checkpoint(self) -> None:
        """Write everything gathered since the last checkpoint in one LMDB transaction."""
        if self._commit_call is not None and self._commit_call.active():
            self._commit_call.cancel()
        self._commit_call = None
        waiters, self._waiters = self._waiters, []
        if not self._unchecked():
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
            self._checkpoint()
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
        self._healthy()
        if self._spill_loaded:
            self._remove_spill()
        self._fresh.clear()
        if self._log is not None:
            # LMDB holds everything logged, and the epoch says so: a crash
            # from now on replays only later chunks.
            self._log_puts.clear()
            self._log_updates.clear()
            self._log_dels.clear()
            self._checkpointed = self.clock.seconds()
            try:
                self._log.empty()
            except OSError as e:
                log.warn("publish log: cannot empty it ({error}); replay skips what LMDB holds",
                         error=e.strerror)
        self._unsynced += written
        self.io_records += written
        if self.io_records >= _UNMAP_RECORDS:
            self.check_mapped_pages()
        if not self.durable and self.sync_every and self._unsynced >= self.sync_every:
            self.sync()
        touched, self._touched = self._touched, set()
        self._hand_over(waiters, [(queue, held) for queue in touched if (held := queue._committed()) is not None])

    def _healthy(self) -> None:
        """A write succeeded: a failure is over."""
        if self.failure is not None:
            self.failure = None
            if self.health_listener is not None:
                self.health_listener(None)

    def _hand_over(self, waiters: list, stored: list) -> None:
        """Durable writes landed: answer their waiters, then tell the queues' owners what became readable.

        The owners deliver it, or drain it (a topic's); what they put
        meanwhile goes into the next commit.
        """
        for callback in waiters:
            callback(None)
        for queue, held in stored:
            try:
                queue.on_stored(held)
            except Exception:
                log.failure("queue {name}: handing over stored messages failed", name=queue.name)

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
        self._write_records(chain(puts.items(), updates.items()) if updates else puts.items(), meta,
                            last=True)
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
            size += len(item[1].data)
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

    def _write_records(self, records, meta: bool, last: bool = False) -> None:
        """One transaction: `records` ((key, message) pairs), after drops, deletions and the registry if `meta`.

        The `last` transaction of a checkpoint also records the publish
        log's last chunk, as everything logged is in LMDB once it commits.
        """
        with self.env.begin(write=True, db=self.data_db) as txn:
            if last and self._log is not None:
                txn.put(_LOG_EPOCH, _EPOCH.pack(self._log_epoch), db=self.meta_db)
            if meta:
                for qid, bound in self._drops:
                    drop_range(txn, qid, bound)
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
            txn.cursor().putmulti([(key, encode_record(msg)) for key, msg in records])

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
            log.error("LMDB commit failed, retrying every {s}s: {error}", s=self.RETRY_AFTER, error=error)
            if self.health_listener is not None:
                self.health_listener(f"LMDB write failed: {error}")
        self.failure = f"LMDB write failed: {error}"
        fresh, self._fresh = self._fresh, []
        self._roll_back(fresh)
        # The retry writes something even if FINs have emptied what was
        # pending by then; otherwise nothing would ever clear the failure.
        self._probe = True
        for callback in waiters:
            callback(self.failure)
        self._commit_call = self.clock.callLater(self.RETRY_AFTER, self.commit)

    def _roll_back(self, fresh: list) -> None:
        """Unstage the new publishes of a failed commit: no record, no place in any queue."""
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
            self._land_now()
            self._checkpoint()
            if self.failure is not None:
                waiting = self._close_bounded()
            else:
                self.sync()
        finally:
            for call in (self._commit_call, self._idle_call):
                if call is not None and call.active():
                    call.cancel()
            self._commit_call = self._idle_call = None
            if waiting is None:
                self.env.close()
            if self._log is not None:
                self._log.close()
        return waiting

    def stats(self) -> dict[str, Any]:
        return {"path": self.path, **self.env.info(), **self.env.stat()}


class _Flight:
    """A chunk of the publish log being written, and what waits for it."""

    __slots__ = ("epoch", "waiters", "fresh", "puts", "updates", "dels", "queues", "data", "error",
                 "done")

    def __init__(self, epoch: int, waiters: list, fresh: list, puts: list, updates: list,
                 dels: list) -> None:
        self.epoch = epoch
        self.waiters = waiters
        self.fresh = fresh
        self.puts = puts
        self.updates = updates
        self.dels = dels
        self.queues: list[LmdbQueue] = []
        # The encoded chunk (header, payload); None if it could not be encoded.
        self.data: tuple[bytes, bytes] | None = (b"", b"")
        self.error: BaseException | None = None
        self.done = threading.Event()


# -- helpers -------------------------------------------------------------------------------------


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
