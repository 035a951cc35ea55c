"""The LMDB store: every topic and channel queue in one LMDB environment.

The layout is backends.lmdb_records' (one `messages` database for all
queues, each a contiguous key range; measured against one named database
per queue with 10,000 queues, see the storage docs). The store is made of:

- backends.lmdb_env: opening the environment (and refusing one that is
  not mqd's, or a disk without room to create it);
- backends.lmdb_replay: writing into LMDB, at start-up, what the publish
  log holds past the last checkpoint (a crash);
- backends.lmdb_queue: a queue (LmdbQueue), its read position and what
  it has staged;
- backends.lmdb_retained: a topic's retained log (LmdbLog), one more key
  range, staged like a queue's puts;
- backends.lmdb_pending: the pending write set (PendingWrites), where the
  queues stage what a commit has to write, and the commit's schedule;
- backends.lmdb_log_writer: the chunks of the durable publish log being
  written by a thread, and their landing;
- backends.lmdb_pages: releasing the data file's mapped pages;
- backends.lmdb_spill: a shutdown on a full disk;
- this module: the store (LmdbStore), which opens the queues and decides
  when and how the write set goes into LMDB.

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
  new publishes it held (those put or held with `fresh`): their
  publishers are answered with the error, so an error answer means "not
  stored", and nobody has seen them. Everything else it held (FINs,
  rewrites, messages moved from a topic to its channels) is kept and
  retried, as those were acknowledged long ago.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import Any, cast

import lmdb
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorThreads
from twisted.internet.task import LoopingCall
from zope.interface import implementer

from backends.interface import BackendError, IBackendStore, IRetainingStore, StoreOpenError
from backends.lmdb_env import open_environment
from backends.lmdb_log import LOG_FILE, PublishLog
from backends.lmdb_log_writer import Flight, LogWriter
from backends.lmdb_pages import MappedPages
from backends.lmdb_pending import PendingWrites, Stager, Waiter
from backends.lmdb_queue import LmdbQueue
from backends.lmdb_records import (
    ENV_DIR,
    EPOCH,
    FORMAT,
    KEY,
    LOG_EPOCH,
    LOG_SUFFIX,
    QID,
    RECORD,
    drop_range,
    encode_record,
    is_log_name,
    record_seq,
)
from backends.lmdb_replay import replay_publish_log
from backends.lmdb_retained import LmdbLog, load_log
from backends.lmdb_spill import SPILL_FILE, SpillingShutdown
from mqd.logs import get_logger
from mqd.message import Message

__all__ = ["ENV_DIR", "FORMAT", "KEY", "LmdbQueue", "LmdbStore", "RECORD", "SPILL_FILE", "StoreOpenError"]

log = get_logger(__name__)

DEFAULT_MAP_SIZE = 1 << 30
# A commit writing more records than this (or this many bytes of bodies) is
# split into transactions of at most this size (see LmdbStore._write).
_COMMIT_CHUNK = 2048
_COMMIT_CHUNK_BYTES = 4 << 20
# Durable with a publish log: LMDB takes what was logged (a checkpoint) once
# this many records are pending, or this many seconds after the last one.
_CHECKPOINT_RECORDS = 4096
_CHECKPOINT_LOG_BYTES = 16 << 20
# The publish log's file is preallocated to this size (see backends.lmdb_log).
_LOG_PREALLOCATE = 2 * _CHECKPOINT_LOG_BYTES
_CHECKPOINT_EVERY = 0.2
# How long a commit that needs a bigger map waits for a running snapshot copy.
_COPY_WAIT = 0.05


@implementer(IBackendStore, IRetainingStore)
class LmdbStore(SpillingShutdown):
    """One LMDB environment under data-path, shared by every queue of the broker.

    The store owns the environment, the queue registry (names to ids),
    the failure state, the publish log and when LMDB takes what the
    write set (`PendingWrites`) holds. Its queues stage their changes in
    that write set and are told through their public methods what became
    of them.
    """

    # Seconds before a failed commit (or a shutdown write on a full disk) is tried again.
    RETRY_AFTER = 1.0

    def __init__(self, options: Any, clock: Any = None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.clock = clock
        self.durable = bool(getattr(options, "durable", False))
        self.sync_every = getattr(options, "sync_every", 2500)
        self.sync_timeout = getattr(options, "sync_timeout", 2.0)
        self.path = os.path.join(options.data_path or ".", ENV_DIR)
        self.spill_path = os.path.join(options.data_path or ".", SPILL_FILE)
        self.failure: str | None = None
        # Set by the broker's shutdown (begin_close): what memory still holds is staged
        # even after a failed commit, for close() to write what fits and spill the rest.
        self._closing = False
        # Messages read back from the spill file, by queue id, until their queue opens.
        self._spilled: dict[int, list[Message]] = {}
        self._spill_loaded = False
        self.health_listener: Callable[[str | None], Any] | None = None
        self._unsynced = 0
        # Snapshot copies reading the environment from other threads right now
        # (copy_started / copy_ended): the map is not resized under them.
        self._copies = 0
        self._queues: dict[str, LmdbQueue] = {}
        self._logs: dict[str, LmdbLog] = {}
        self._known: dict[str, int] = {}  # registry names (queues', logs' "<topic>/log") to ids
        self._next_qid = 1
        handles = open_environment(self.path, getattr(options, "lmdb_map_size", DEFAULT_MAP_SIZE),
                                   self.durable)
        self.env, self.meta_db, self.registry_db, self.data_db = handles
        self._load_registry()
        # The publish log (backends.lmdb_log): durable, on a reactor with
        # threads. Whatever the mode, what a log left by a crash holds is
        # written into LMDB first.
        epoch = replay_publish_log(handles, self.path, self.durable)
        self._log: PublishLog | None = None
        self._log_writer: LogWriter | None = None
        if self.durable and IReactorThreads.providedBy(clock):
            self._log = PublishLog(os.path.join(self.path, LOG_FILE), _LOG_PREALLOCATE)
            self._log_writer = LogWriter(self._log, clock, epoch, landed=self._landed,
                                     failed=self._log_failed, settled=self._settled)
        self._writes: PendingWrites[Stager] = PendingWrites(clock, self.commit, self._log is not None)
        # A checkpoint (or a probe) waits for the chunks in flight to land.
        self._again = False
        self._idle_call: IDelayedCall | None = None
        self._checkpointed = clock.seconds()
        self._load_spill()
        self._sync_loop = None
        if not self.durable and self.sync_timeout > 0:
            self._sync_loop = LoopingCall(self._sync_if_dirty)
            self._sync_loop.clock = clock
            self._sync_loop.start(self.sync_timeout, now=False)
        self._pages = MappedPages(os.path.join(self.path, "data.mdb"), clock)

    # -- queues ------------------------------------------------------------------------

    def _load_registry(self) -> None:
        try:
            with self.env.begin(db=self.registry_db) as txn:
                for name, qid in txn.cursor():
                    self._known[bytes(name).decode()] = QID.unpack(qid)[0]
        except (lmdb.Error, UnicodeDecodeError, struct.error) as e:
            raise StoreOpenError(f"{self.path}: corrupt queue registry ({e})") from None
        self._next_qid = max(self._known.values(), default=0) + 1

    def queue_names(self) -> list[str]:
        """Names of the queues the store holds, for the broker to reconcile with its metadata (not the retained logs)."""
        return sorted(name for name in self._known if not is_log_name(name))

    def log_names(self) -> list[str]:
        """The topics whose retained logs the store holds."""
        return sorted(name[:-len(LOG_SUFFIX)] for name in self._known if is_log_name(name))

    def open_log(self, name: str) -> LmdbLog:
        """Topic `name`'s retained log, created with a new epoch if new (backends.lmdb_retained)."""
        found = self._logs.get(name)
        if found is not None:
            return found
        registered = name + LOG_SUFFIX
        qid = self._known.get(registered)
        new = qid is None
        if qid is None:
            qid = self._register(registered)
        retained = self._logs[name] = load_log(
            name, qid, new, self.env, self.meta_db, self.data_db, self._writes,
            spilled=self._spilled.pop(qid, []), durable=self.durable,
            check_writable=self._check_writable, read_records=self._pages.read, forget=self._forget_log)
        return retained

    def _register(self, name: str) -> int:
        """Give registry name `name` (a queue's, or a log's) the next queue id, staged with the next commit."""
        qid = self._next_qid
        self._next_qid += 1
        self._known[name] = qid
        self._writes.register(name.encode(), QID.pack(qid))
        return qid

    def _forget_log(self, retained: LmdbLog) -> None:
        self._logs.pop(retained.name, None)
        self._known.pop(retained.name + LOG_SUFFIX, None)
        self._writes.unregister((retained.name + LOG_SUFFIX).encode(), retained)

    def open_queue(self, name: str) -> LmdbQueue:
        queue = self._queues.get(name)
        if queue is not None:
            return queue
        qid = self._known.get(name)
        first = nxt = depth = 0
        if qid is None:
            qid = self._register(name)
        else:
            first, nxt, depth = self._scan(qid)
        spilled = self._spilled.pop(qid, None)
        if spilled:
            # Put after everything LMDB holds of the queue (the shutdown wrote
            # each queue's oldest first), so they follow it, in order.
            # Read back from the spill file, every one has its record's key.
            spilled.sort(key=lambda m: cast(bytes, m.key))
            if not depth:
                first = record_seq(spilled[0])
            nxt = max(nxt, record_seq(spilled[-1]) + 1)
            depth += len(spilled)
        queue = self._queues[name] = LmdbQueue(
            name, qid, first, nxt, depth, env=self.env, data_db=self.data_db, writes=self._writes,
            durable=self.durable, check_writable=self._check_writable, read_records=self._pages.read,
            forget=self._forget_queue, sync=self.sync, restored=spilled or ())
        if spilled:
            self._writes.touch(queue)
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
        # count > 0: both keys were set.
        return KEY.unpack(cast(bytes, first))[1], KEY.unpack(cast(bytes, last))[1] + 1, count

    def _forget_queue(self, queue: LmdbQueue) -> None:
        self._queues.pop(queue.name, None)
        self._known.pop(queue.name, None)
        self._writes.unregister(queue.name.encode(), queue)

    def begin_close(self) -> None:
        """Shutdown has begun: take what memory still holds even while failing (see close)."""
        self._closing = True

    @property
    def copies(self) -> int:
        """Snapshot copies reading the environment from other threads right now."""
        return self._copies

    def copy_started(self) -> None:
        """A snapshot thread reads the map from now on: it must not be resized meanwhile."""
        self._copies += 1

    def copy_ended(self) -> None:
        self._copies -= 1

    def _check_writable(self) -> None:
        """A queue is given messages: refuse them (BackendError) while the store is failing, unless closing."""
        if self.failure and not self._closing:
            raise BackendError(self.failure)

    # -- group commit -------------------------------------------------------------------

    def when_durable(self, callback: Waiter) -> None:
        if not self.durable:
            callback(None)
            return
        self._writes.wait(callback)

    def _pending(self) -> bool:
        return self._writes.pending()

    def mark_failed(self, error: str) -> None:
        """A write next to the store failed at start-up (nsqd.dat on a full disk).

        The disk is full: refuse puts as after a failed commit (E_PUB_FAILED,
        /ping NOK) and retry a commit that writes something every second;
        the first that succeeds clears the failure, as when the disk fills
        while running.
        """
        self._writes.probe()
        if self.failure is None:
            self._failing(error)
        self._writes.retry_in(self.RETRY_AFTER)

    def cut(self) -> lmdb.Transaction[bytes]:
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
        writer = self._log_writer
        if writer is None:
            self._checkpoint()
            return
        if self._closing:
            self._land_now()
            self._checkpoint()
            return
        self._writes.unschedule()
        if self._checkpoint_due() or self.failure:
            # A checkpoint, or a probe while failing, waits for the chunks
            # being written: they land first, in order.
            if writer.in_flight:
                self._again = True
            elif self._checkpoint_due():
                self._checkpoint()
            else:
                self._take_off(writer)
            return
        if not self._writes.chunk_wanted():
            # Nobody waits: no publisher, no message to hand out. Rewrites
            # and FINs go with the next chunk, or LMDB takes them when due.
            if self._unchecked():
                self._checkpoint_later(_CHECKPOINT_EVERY - (self.clock.seconds() - self._checkpointed))
            return
        self._take_off(writer)

    def _checkpoint_due(self) -> bool:
        """LMDB must take what is pending now: structure changed, a probe, or enough gathered."""
        writes = self._writes
        if writes.structural() or self._spill_loaded:
            return True
        if writes.records() >= _CHECKPOINT_RECORDS or (self._log is not None
                                                         and self._log.size >= _CHECKPOINT_LOG_BYTES):
            return True
        return self._unchecked() and self.clock.seconds() - self._checkpointed >= _CHECKPOINT_EVERY

    def _unchecked(self) -> bool:
        """Something LMDB has not taken: pending records, or a log to empty (what FINs cancelled)."""
        return self._writes.pending() or (self._log is not None and self._log.size > 0)

    # -- the publish log's chunks ------------------------------------------------------------

    def _take_off(self, writer: LogWriter) -> None:
        """Hand what changed since the last chunk to the writer thread, as one chunk of the publish log."""
        chunk = self._writes.take_chunk()
        writer.take_off(chunk, [queue for queue in chunk.staging if queue.fly()])

    def _land_now(self) -> None:
        """Wait for the chunks being written and land them (before a checkpoint or a close)."""
        if self._log_writer is not None:
            self._log_writer.land_now()

    def _landed(self, flight: Flight) -> None:
        """On the reactor: a chunk is synced: its publishes are answered, its messages readable."""
        self._healthy()
        self._hand_over(flight.chunk.waiters,
                        [(queue, held) for queue in flight.queues if (held := queue.landed()) is not None])

    def _settled(self) -> None:
        """Every chunk handed over has landed: LMDB takes what was logged now if due, or a little later."""
        if self._again or self._checkpoint_due():
            self._again = False
            self.commit()
        elif self._unchecked():
            self._checkpoint_later(_CHECKPOINT_EVERY)

    def _checkpoint_later(self, delay: float) -> None:
        """Quiet now: LMDB takes what was logged a little later (a commit asked for meanwhile comes first)."""
        if self._idle_call is None or not self._idle_call.active():
            self._idle_call = self.clock.callLater(max(delay, 0.0), self.commit)

    def _log_failed(self, flights: list[Flight]) -> None:
        """A chunk could not be written (a full disk): it and every later one fail, as a failed commit.

        Their new publishes are dropped, their publishers answered with the
        error. Their other changes (messages moved to channels, rewrites,
        deletions) were acknowledged long ago: they go back, in order, to
        be logged again.
        """
        error = flights[0].error
        text = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        if not isinstance(error, OSError):
            log.error("publish log: writing a chunk failed: {error!r}", error=error)
        queues = {queue for flight in flights for queue in flight.queues}
        for queue in queues:
            queue.unfly()
        chunks = [flight.chunk for flight in flights]
        self._writes.put_back(chunks, queues)
        if self.failure is None:
            log.error("publish log write failed, retrying every {s}s: {error}", s=self.RETRY_AFTER,
                      error=text)
        self._failing(f"LMDB write failed: {text}")
        self._roll_back([fresh for chunk in chunks for fresh in chunk.fresh])
        for chunk in chunks:
            for callback in chunk.waiters:
                callback(self.failure)
        self._writes.retry_in(self.RETRY_AFTER)

    # -- checkpoints: LMDB takes the write set ----------------------------------------------

    def _checkpoint(self) -> None:
        """Write everything gathered since the last checkpoint in one LMDB transaction."""
        writes = self._writes
        writes.unschedule()
        waiters = writes.take_waiters()
        if not self._unchecked():
            writes.forget_fresh()  # emptied queues' messages, if any: nothing left to drop
            for callback in waiters:
                callback(None)
            return
        try:
            written = self._write()
        except lmdb.MapFullError:
            writes.return_waiters(waiters)
            if self._copies:
                # A snapshot thread is reading the map: resizing it now could
                # pull it from under the copy. Try again shortly.
                writes.retry_in(_COPY_WAIT)
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
        # LMDB holds everything logged, and the epoch says so: a crash from
        # now on replays only later chunks.
        touched = writes.checkpointed()
        if self._log is not None:
            self._checkpointed = self.clock.seconds()
            try:
                self._log.empty()
            except OSError as e:
                log.warn("publish log: cannot empty it ({error}); replay skips what LMDB holds",
                         error=e.strerror)
        self._unsynced += written
        self._pages.written(written)
        if not self.durable and self.sync_every and self._unsynced >= self.sync_every:
            self.sync()
        self._hand_over(waiters, [(queue, held) for queue in touched if (held := queue.committed()) is not None])

    def _failing(self, failure: str) -> None:
        """A write failed: the store refuses new messages with `failure`; the broker hears when it starts failing."""
        started = self.failure is None
        self.failure = failure
        if started and self.health_listener is not None:
            self.health_listener(failure)

    def _healthy(self) -> None:
        """A write succeeded: a failure is over."""
        if self.failure is not None:
            self.failure = None
            if self.health_listener is not None:
                self.health_listener(None)

    def _hand_over(self, waiters: list[Waiter], stored: list[tuple[Stager, list[Message]]]) -> None:
        """Durable writes landed: answer their waiters, then tell the queues' owners what became readable.

        The owners deliver it, or drain it (a topic's); what they put
        meanwhile goes into the next commit.
        """
        for callback in waiters:
            callback(None)
        for queue, held in stored:
            try:
                if queue.on_stored is not None:
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
        writes = self._writes
        puts, updates = writes.puts, writes.updates
        written = writes.records()
        meta = True
        if len(puts) + len(updates) > _COMMIT_CHUNK:
            meta = self._write_early()
        self._write_records(chain(puts.items(), updates.items()) if updates else puts.items(), meta,
                            last=True)
        writes.records_written()
        if meta:
            writes.meta_written()
        return written

    def _write_early(self) -> bool:
        """A big commit's records but the new publishes, in bounded transactions, but a last part.

        Each transaction's records are forgotten once it is committed (the
        first also writes drops, deletions and the registry). Returns
        whether those are still to be written.
        """
        writes = self._writes
        fresh = writes.fresh_keys()
        early = [item for item in writes.puts.items() if item[0] not in fresh]
        early += writes.updates.items()
        meta = True
        chunk: list[tuple[bytes, Message]] = []
        size = 0
        for item in early:
            chunk.append(item)
            size += len(item[1].data)
            if len(chunk) >= _COMMIT_CHUNK or size >= _COMMIT_CHUNK_BYTES:
                self._write_records(chunk, meta)
                if meta:
                    writes.meta_written()
                    meta = False
                writes.written(chunk)
                chunk, size = [], 0
        return meta

    def _write_records(self, records: Iterable[tuple[bytes, Message]], meta: bool, last: bool = False) -> None:
        """One transaction: `records` ((key, message) pairs), after drops, deletions and the registry if `meta`.

        The `last` transaction of a checkpoint also records the publish
        log's last chunk, as everything logged is in LMDB once it commits.
        """
        writes = self._writes
        with self.env.begin(write=True, db=self.data_db) as txn:
            if last and self._log_writer is not None:
                txn.put(LOG_EPOCH, EPOCH.pack(self._log_writer.epoch), db=self.meta_db)
            if meta:
                for qid, bound in writes.drops:
                    drop_range(txn, qid, bound)
                if writes.probing:
                    txn.put(b"format", FORMAT, db=self.meta_db)
                delete = txn.delete
                for key in writes.dels:
                    delete(key)
                put = txn.put
                for name, packed in writes.registry_puts.items():
                    put(name, packed, db=self.registry_db)
                for name in writes.registry_dels:
                    delete(name, db=self.registry_db)
                for name, value in writes.meta_puts.items():
                    if value is None:
                        delete(name, db=self.meta_db)
                    else:
                        put(name, value, db=self.meta_db)
            # One C loop over the records instead of a put call each; their
            # list is as big as a transaction, bounded by _write.
            txn.cursor().putmulti([(key, encode_record(msg)) for key, msg in records])

    def _grow(self) -> None:
        size = self.env.info()["map_size"] * 2
        log.info("LMDB map full; growing it to {size} bytes", size=size)
        self.env.set_mapsize(size)

    def _failed(self, error: str, waiters: list[Waiter]) -> None:
        """A commit failed (a full disk): drop its new publishes, keep the rest for the retry, fail the waiters.

        The waiters' publishers are answered with the error, so their
        messages must never be stored nor delivered: the new publishes go
        (nobody has seen them, as a durable queue hands out only committed
        messages). Everything else was acknowledged before and is retried.
        """
        if self.failure is None:
            log.error("LMDB commit failed, retrying every {s}s: {error}", s=self.RETRY_AFTER, error=error)
        self._failing(f"LMDB write failed: {error}")
        self._roll_back(self._writes.take_fresh())
        # The retry writes something even if FINs have emptied what was
        # pending by then; otherwise nothing would ever clear the failure.
        self._writes.probe()
        for callback in waiters:
            callback(self.failure)
        self._writes.retry_in(self.RETRY_AFTER)

    def _roll_back(self, fresh: list[tuple[Stager, Sequence[Message]]]) -> None:
        """Unstage the new publishes of a failed commit: no record, no place in any queue."""
        if not fresh:
            return
        dropped = self._writes.drop_fresh(fresh)
        for queue, keys in dropped.items():
            queue.roll_back(keys)
        log.warn("LMDB commit failed: {n} newly published messages dropped (their publishers are "
                 "answered with the error)", n=sum(map(len, dropped.values())))

    # -- syncing -----------------------------------------------------------------------

    def sync(self) -> None:
        self.env.sync(True)
        self._unsynced = 0

    def _sync_if_dirty(self) -> None:
        if self._unsynced:
            self.sync()

    @property
    def io_records(self) -> int:
        """Records read or written through the map since its pages were last looked at."""
        return self._pages.io_records

    def release_mapped_pages(self) -> int:
        """Unmap the pages of the data file this process has read through LMDB's map; bytes released.

        The data stays in the page cache (backends.lmdb_pages).
        """
        return self._pages.release()

    def close(self) -> Deferred[None] | None:
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
        self._pages.stop()
        waiting = None
        try:
            self._land_now()
            self._checkpoint()
            if self.failure is not None:
                waiting = self._close_bounded()
            else:
                self.sync()
        finally:
            self._writes.unschedule()
            if self._idle_call is not None and self._idle_call.active():
                self._idle_call.cancel()
            self._idle_call = None
            if waiting is None:
                self.env.close()
            if self._log is not None:
                self._log.close()
        return waiting

    def stats(self) -> dict[str, Any]:
        return {"path": self.path, **self.env.info(), **self.env.stat()}
