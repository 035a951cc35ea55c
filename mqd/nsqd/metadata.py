"""The metadata file, nsqd's `nsqd.dat`, and the data-path lock that goes with it.

The file lists the non-ephemeral topics and channels with their paused
flags (same name, same JSON as nsqd), so a restart comes back with them.
It is rewritten atomically (temp file, fsync, rename) whenever one
appears, goes, or is paused. The writes run in the reactor's thread pool,
one at a time, each taking every change made since the previous one
started; the first write (at start-up) and the last (at shutdown) are
synchronous.

`MetadataFile` owns all of it: the lock, the reading, the scheduling of
writes, who waits for one, and the retries when the disk is full. The
broker owns the topics: it recreates them from what `load` read, tells
the file when something changed (`changed`), and reads the topics it was
given only when a write takes their state.

The service's life follows the broker's storage: `open` takes the data
path (one broker per data-path, as nsqd's directory lock), `startService`
makes the first write and keeps the file up to date from then on,
`stopService` makes the last one, and `close` lets go of the data path
once the store is closed too.

The id lease (`IdLease`, `mqd-ids.lease` next to `nsqd.dat`) follows the
same life: read by `load`, started by `startService` before any id is
issued, written exactly by `stopService`, closed by `close`. It keeps
message ids unique across restarts whatever the wall clock does.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import tempfile
import threading
import zlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure

from mqd import NSQ_VERSION
from mqd.logs import get_logger
from mqd.message import IdFactory, id_time, id_time_span
from mqd.nsqd.metadata_listing import ListedTopic, Listing, topic_entry
from mqd.options import ConfigError

__all__ = [
    "ID_LEASE_FILE",
    "LEASE_SECONDS",
    "METADATA_FILE",
    "RETRY_DELAY",
    "MetadataFile",
    "IdLease",
    "Runner",
    "SavedChannel",
    "SavedTopic",
    "describe",
    "thread_runner",
]

METADATA_FILE = "nsqd.dat"
# How often a metadata write that failed (a full disk) is retried.
RETRY_DELAY = 1.0

log = get_logger(__name__)

# run(f, *args) -> Deferred of f(*args), run somewhere off the caller's stack.
Runner = Callable[..., "Deferred[Any]"]


class SavedChannel(NamedTuple):
    """A channel as the file lists it (its name not checked yet)."""

    name: str
    paused: bool


class SavedTopic(NamedTuple):
    """A topic as the file lists it, with its channels (names not checked yet).

    `retention` is the (time in ms, bytes) set for the topic alone, None
    when it follows the broker's options.
    """

    name: str
    paused: bool
    channels: tuple[SavedChannel, ...]
    retention: tuple[int, int] | None = None


def thread_runner(clock: object) -> Runner:
    """run(f, *args) -> Deferred: in the reactor's thread pool, or inline on a clock without threads.

    Unit tests drive the broker with a task.Clock, whose writes stay
    synchronous and deterministic; they may replace `MetadataFile.runner`.
    """
    if IReactorThreads.providedBy(clock):
        pool = clock.getThreadPool()
        return lambda f, *args: deferToThreadPool(clock, pool, f, *args)
    return maybeDeferred


def describe(topics: Mapping[str, ListedTopic]) -> dict[str, Any]:
    """The file's content for these topics: nsqd's JSON, ephemeral topics and channels left out.

    The writes take it from a `Listing`, which keeps it encoded topic by topic.
    """
    listed = [topic_entry(topic) for topic in topics.values() if not topic.ephemeral]
    return {"topics": listed or None, "version": NSQ_VERSION}


def _parse(path: str, raw: bytes) -> list[SavedTopic]:
    """The topics a file lists; ConfigError for a file nsqd would refuse (wrong JSON types)."""
    try:
        meta = json.loads(raw)
        topics = meta.get("topics") or []
        if not isinstance(topics, list):
            raise ValueError("'topics' is not a list")
        for entry in topics:
            channels = entry.get("channels") or []
            if not isinstance(entry.get("name", ""), str) or not isinstance(channels, list):
                raise ValueError(f"bad topic entry {entry!r}")
            for ch in channels:
                if not isinstance(ch.get("name", ""), str):
                    raise ValueError(f"bad channel entry {ch!r}")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: corrupt metadata file: {e}") from None
    return [
        SavedTopic(
            entry.get("name", ""),
            bool(entry.get("paused")),
            tuple(SavedChannel(ch.get("name", ""), bool(ch.get("paused")))
                  for ch in entry.get("channels") or []),
            _saved_retention(path, entry),
        )
        for entry in topics
    ]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _saved_retention(path: str, entry: dict[str, Any]) -> tuple[int, int] | None:
    """A topic entry's own retention, (time_ms, bytes), or None.

    nsqd ignores the key, so a malformed one does not stop start-up
    either: it is logged and the topic follows the broker's options.
    """
    raw = entry.get("retention")
    if raw is None:
        return None
    if isinstance(raw, dict) and _is_count(raw.get("time_ms")) and _is_count(raw.get("bytes")):
        return raw["time_ms"], raw["bytes"]
    log.warn("{path}: ignoring the malformed retention of topic {name!r}: {raw!r}",
             path=path, name=entry.get("name", ""), raw=raw)
    return None


class MetadataFile(Service):
    """`<data-path>/nsqd.dat` and the data-path lock: see the module doc.

    `topics` is the broker's mapping of its topics, read (never changed)
    on the reactor thread whenever a write takes the state. `unwritable`
    is told the health text when the file cannot be written at start-up,
    `written_again` the same text once a retry has written it. `ids` is the
    broker's id factory, held by the id lease (`lease`).
    """

    name = "metadata"

    def __init__(self, data_path: str, clock: IReactorTime, topics: Mapping[str, ListedTopic], *,
                 unwritable: Callable[[str], None], written_again: Callable[[str], None],
                 ids: IdFactory) -> None:
        self.data_path = data_path
        self.path = os.path.join(data_path, METADATA_FILE)
        self.clock = clock
        # The file's content, encoded again only for the topics said to have changed.
        self._listing = Listing(topics)
        self._unwritable = unwritable
        self._written_again = written_again
        # Writes run in the reactor's thread pool (or inline on a test clock,
        # which has none); see _write_async.
        self.runner: Runner = thread_runner(clock)
        # The write scheduled (callLater), if any: a coalesced one, or a retry.
        self._call: IDelayedCall | None = None
        self._dirty = False
        self._writing: Deferred[None] | None = None
        self._waiters: list[Deferred[None]] = []
        # Writes are numbered when their state is taken: under the lock an
        # older state never replaces a newer one, and no two writes overlap.
        self._seq = itertools.count(1)
        self._written_seq = 0
        self._lock = threading.Lock()
        # After the last (shutdown) write, nothing more is scheduled.
        self._closed = False
        self._lock_fd: int | None = None
        self.lease = IdLease(data_path, clock, ids, written_again=written_again)

    # -- the data path ---------------------------------------------------------------

    def open(self) -> None:
        """Create the data path if missing and lock it; ConfigError if it cannot be, or is in use."""
        try:
            os.makedirs(self.data_path, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"data-path {self.data_path}: {e.strerror}") from None
        fd = os.open(self.data_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"--data-path={self.data_path} in use (possibly by another instance of nsqd)"
            ) from None
        self._lock_fd = fd

    def close(self) -> None:
        """Let go of the data path: after the last write (stopService), once the store is closed too.

        It writes nothing itself: start-up that stops before the first write
        lets go of the data path with the file as it found it.
        """
        self.lease.close()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def load(self) -> list[SavedTopic]:
        """The topics and channels of the last run, as the file lists them ([] without a file).

        The id lease is read too. ConfigError when either cannot be read or
        is corrupt: start-up stops there, and the files are left as they are.
        """
        self.lease.load()
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return []
        except OSError as e:
            raise ConfigError(f"{self.path}: cannot read metadata: {e.strerror}") from None
        return _parse(self.path, raw)

    # -- the service -------------------------------------------------------------------

    def startService(self) -> None:
        """The first write, synchronous, of what was restored; from now on the file follows changes.

        A file that cannot be written (a full disk) does not stop start-up:
        the broker serves what the store holds, which is what frees space,
        and the write is retried every RETRY_DELAY seconds.
        """
        if self._lock_fd is None:
            self.open()
        # Twisted's Service is unannotated, and the untyped-calls exclusion misses super() calls.
        super().startService()  # type: ignore[no-untyped-call]
        # Before any publish: ids start past the last run's (IdLease).
        self.lease.start()
        try:
            self.write_now()
        except OSError as e:
            self._unwritable_at_start(e)

    def stopService(self) -> None:
        """The last write, synchronous (it waits for one in progress); nothing is scheduled after it.

        A failure (a full disk) is logged: it must not keep the queues from
        being flushed after it.
        """
        super().stopService()  # type: ignore[no-untyped-call]  # as in startService
        self._closed = True
        try:
            self.write_now()
        except OSError as e:
            log.error("{path}: cannot write metadata at shutdown ({error}); topics and channels "
                      "made since it was last written will not come back by themselves",
                      path=self.path, error=e.strerror)
        self.lease.stop()

    def _unwritable_at_start(self, error: OSError) -> None:
        # The health text is the one line that says it (the broker's set_health logs it).
        text = (f"{self.path}: cannot write metadata: {error.strerror}; serving what the "
                f"store holds, publishes fail until there is room: free space under "
                f"{os.path.abspath(self.data_path)}")
        self._unwritable(text)
        self._call = self.clock.callLater(RETRY_DELAY, self._retry, text)

    def _retry(self, text: str) -> None:
        self._call = None
        try:
            self.write_now()
        except OSError:
            self._call = self.clock.callLater(RETRY_DELAY, self._retry, text)
            return
        log.info("{path}: metadata written", path=self.path)
        self._written_again(text)

    # -- writes ------------------------------------------------------------------------

    @property
    def writing(self) -> Deferred[None] | None:
        """The write running in a thread, if any (the broker waits for it before closing)."""
        return self._writing

    def changed(self, ephemeral: bool, topic: str | None = None) -> None:
        """A topic or channel appeared, went or was paused: schedule one write for however many changes.

        `topic` names the topic whose entry changed, so that the write
        encodes that one again and not every topic (None: any may have).

        Changes to ephemeral ones are not written. Creating topics in a
        burst used to rewrite and fsync the whole file on the reactor for
        each reactor turn (PUB latency of 100-300 ms at 7.5k topics): the
        file is written in a thread, and changes made while a write runs
        are all taken by the next one.
        """
        if ephemeral:
            return
        self._listing.stale(topic)
        self._dirty = True
        self._schedule()

    def _schedule(self, delay: float = 0) -> None:
        if self._closed or self._call is not None or self._writing is not None:
            # A write already scheduled takes the state as it is then; one
            # running reschedules when it is done (_write_done).
            return
        self._call = self.clock.callLater(delay, self._write_async, True)

    def written(self, topic: str | None = None) -> Deferred[None]:
        """A Deferred firing once the state as of now is on disk.

        `topic` names the topic whose entry may have changed without a
        `changed` call (a pause); None: any may have.

        nsqd answers /topic/pause and friends only after persisting, so a
        crash right after the answer cannot bring the topic back unpaused.
        It fails with the write's error (which nsqd only logs).
        """
        d: Deferred[None] = Deferred()
        if self._closed:
            # Shut down: the last write has been made; nothing would answer.
            d.callback(None)
            return d
        self._waiters.append(d)
        self._listing.stale(topic)
        self._dirty = True
        if self._writing is None:
            self._write_async()
        return d

    def _write_async(self, scheduled: bool = False) -> None:
        """Take the state now (on the reactor) and write it in a thread."""
        if scheduled:
            self._call = None
        if self._writing is not None or self._closed:
            return
        if not (self._dirty or self._waiters):
            return  # a scheduled write whose changes a written() write already took
        self._dirty = False
        waiters, self._waiters = self._waiters, []
        data = self._bytes()
        d = self.runner(self._write_file, data, next(self._seq))
        self._writing = d
        d.addBoth(self._write_done, waiters)

    def _write_done(self, result: object, waiters: list[Deferred[None]]) -> None:
        self._writing = None
        failed = isinstance(result, Failure)
        if isinstance(result, Failure):
            log.error("{path}: cannot write metadata ({error}); retrying in {s:g}s", path=self.path,
                      error=getattr(result.value, "strerror", None) or result.value, s=RETRY_DELAY)
            self._dirty = True
        for waiter in waiters:
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(None)
        if self._waiters:
            self._write_async()
        elif self._dirty:
            self._schedule(RETRY_DELAY if failed else 0)

    def _bytes(self) -> bytes:
        return self._listing.encoded()

    def write_now(self) -> None:
        """Write the file now, on this thread (start-up, shutdown): it waits for a write in progress.

        Raises OSError when it cannot be written; the file is then as it was.
        """
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        self._dirty = False
        self._listing.stale(None)  # start-up and shutdown: whatever changed, said or not
        self._write_file(self._bytes(), next(self._seq))

    def _write_file(self, data: bytes, seq: int) -> None:
        """Write the file atomically: temp file, fsync, rename (any thread).

        A state taken before the one already written is dropped: a thread
        write that lost the race to a later synchronous one must not undo it.
        """
        with self._lock:
            if seq <= self._written_seq:
                return
            _replace_synced(self.data_path, METADATA_FILE, data)
            self._written_seq = seq


def _replace_synced(directory: str, name: str, data: bytes) -> None:
    """`directory/name` holds `data`, whole or not at all: a synced temp file renamed over it."""
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- the id lease ----------------------------------------------------------------------

ID_LEASE_FILE = "mqd-ids.lease"
# How far past the ids issued the lease is written: a crash and restart
# starts ids at most this far ahead of the last ones; a publishing broker
# renews it every LEASE_SECONDS / 2, in a thread.
LEASE_SECONDS = 10.0
# One slot: the bound in 16 hex digits, a space, the CRC-32 of those 16 in 8, a newline.
_SLOT_SIZE = 26


def _slot(value: int) -> bytes:
    digits = b"%016x" % value
    return b"%s %08x\n" % (digits, zlib.crc32(digits))


def _parse_slot(raw: bytes) -> int | None:
    """The slot's bound, or None for a slot torn or never written."""
    if len(raw) != _SLOT_SIZE or raw[16:17] != b" " or raw[-1:] != b"\n":
        return None
    digits = raw[:16]
    try:
        value, crc = int(digits, 16), int(raw[17:25], 16)
    except ValueError:
        return None
    return value if crc == zlib.crc32(digits) else None


class IdLease:
    """`<data-path>/mqd-ids.lease`: a persisted bound above the time of every id issued on this data path.

    Ids are made of the clock's time (nsqd's layout), so a broker restarted
    with its clock behind (an NTP step, a VM moved or restored) would issue
    the ids of its last run again: two stored messages with one id, and a
    FIN for one finishing the other. The broker's IdFactory therefore
    issues ids only below a limit this file already holds (a lease), and
    a new run starts its ids at max(clock, the file's bound).

    - `start` (start-up, before any publish): the factory starts at
      max(now, bound) and the file is written, synced, with that plus
      LEASE_SECONDS, which the factory is granted.
    - While running, a batch whose ids reach the last LEASE_SECONDS / 2 of
      the lease asks for more: written in the reactor's thread pool, granted
      once synced. A batch that would reach the limit itself (the write is
      late, or the clock jumped ahead) waits for a synchronous write; one
      that cannot be made fails the publish (OSError), nothing issued.
    - `stop` (clean shutdown) writes the exact bound, so a clean restart
      does not skip the rest of the lease.

    The file holds two slots of 26 bytes, each a bound and its CRC-32;
    the bound is the larger valid one. A renewal rewrites the smaller slot
    in place (pwrite, fdatasync), so a torn write loses at most that slot,
    and once the file exists no write needs free space: a full disk does
    not stop ids. It is created whole (temp file, fsync, rename) before
    the first id.
    """

    def __init__(self, data_path: str, clock: IReactorTime, ids: IdFactory, *,
                 written_again: Callable[[str], None]) -> None:
        self.data_path = data_path
        self.path = os.path.join(data_path, ID_LEASE_FILE)
        self.clock = clock
        self._ids = ids
        self._written_again = written_again
        self._span = id_time_span(LEASE_SECONDS)
        # Renewals run in the reactor's thread pool (inline on a test clock).
        self.runner: Runner = thread_runner(clock)
        # The bound the file held at load (0: no file).
        self._loaded = 0
        # What each slot holds on disk (-1: invalid, rewritten first); the fd once open.
        self._slots = [-1, -1]
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._writing: Deferred[None] | None = None
        # The failure being reported (health text), and no background retry before _retry_at.
        self._failure: str | None = None
        self._retry_at = 0.0
        self._started = False
        self._closed = False
        ids.held_by(self)

    @property
    def writing(self) -> Deferred[None] | None:
        """The renewal running in a thread, if any (the broker waits for it before closing)."""
        return self._writing

    def load(self) -> int:
        """The bound the file holds (0 without a file); ConfigError for a file with no valid slot."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(2 * _SLOT_SIZE + 1)
        except FileNotFoundError:
            self._loaded = 0
            return 0
        except OSError as e:
            raise ConfigError(f"{self.path}: cannot read the id lease: {e.strerror}") from None
        slots = [_parse_slot(raw[i * _SLOT_SIZE:(i + 1) * _SLOT_SIZE]) for i in range(2)]
        valid = [v for v in slots if v is not None]
        if not valid or len(raw) > 2 * _SLOT_SIZE:
            raise ConfigError(
                f"{self.path}: corrupt id lease; removing it lets the broker start, but message ids "
                f"may then repeat those of earlier runs if the clock is behind them") from None
        self._slots = [-1 if v is None else v for v in slots]
        self._loaded = max(valid)
        return self._loaded

    def start(self) -> None:
        """Start the factory at max(now, the loaded bound) and grant it a lease written now.

        A lease that cannot be written does not stop start-up: publishes
        try again, and fail until it is written.
        """
        floor = max(id_time(int(self.clock.seconds() * 1e9)), self._loaded)
        self._ids.start_at(floor)
        self._started = True
        try:
            self.extend(self._ids, floor)
        except OSError:
            pass  # logged and reported by extend

    def extend(self, ids: IdFactory, end: int) -> None:
        """A batch reaches id time `end` (IdTimeLease): renew in a thread, or now past the limit."""
        target = end + self._span
        if end < ids.limit:
            if self._writing is None and not self._closed and self.clock.seconds() >= self._retry_at:
                d = self.runner(self._write, target)
                self._writing = d
                d.addBoth(self._renewed, target)
            return
        if self._closed:
            raise OSError(f"{self.path}: closed, no more ids")
        try:
            self._write(target)
        except OSError as e:
            raise OSError(self._failed(e)) from None
        self._granted(target)

    def _renewed(self, result: object, target: int) -> None:
        self._writing = None
        if self._closed:
            return  # shut down (or a simulated crash) meanwhile: stop's write is the last word
        if isinstance(result, Failure):
            self._failed(result.value)
            self._retry_at = self.clock.seconds() + RETRY_DELAY
        else:
            self._granted(target)

    def _granted(self, target: int) -> None:
        self._retry_at = 0.0
        if target > self._ids.limit:
            self._ids.grant(target, target - self._span // 2)
        if self._failure is not None:
            text, self._failure = self._failure, None
            log.info("{path}: id lease written", path=self.path)
            self._written_again(text)

    def _failed(self, error: object) -> str:
        """Log a write failure once per incident; the text publishes fail with."""
        reason = getattr(error, "strerror", None) or error
        text = f"{self.path}: cannot write the id lease: {reason}"
        if self._failure is None:
            log.error("{text}; publishes fail once their ids reach the lease", text=text)
        self._failure = text
        return text

    def stop(self) -> None:
        """Clean shutdown: no more ids, and the file holds the exact bound of those issued.

        A broker stopped before `start` (start-up failed) leaves the file as it is.
        """
        self._closed = True
        if not self._started:
            return
        bound = self._ids.issued_below
        self._ids.grant(bound, bound)
        try:
            self._write(bound, lower=True)
        except OSError as e:
            log.error("{path}: cannot write the id lease at shutdown ({error}); the next run "
                      "starts its ids past the last lease", path=self.path, error=e.strerror or e)

    def close(self) -> None:
        """Let go of the file (after `stop`, or a simulated crash): a write in progress ends first."""
        self._closed = True
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)

    def _write(self, value: int, lower: bool = False) -> None:
        """Persist `value` (any thread): a renewal raises the bound; `lower` (shutdown) sets both slots.

        A renewal at or below what the file holds already is dropped: one
        that lost the race to a synchronous write must not undo it.
        """
        with self._lock:
            if self._fd is None:
                if self._closed and not lower:
                    raise OSError(f"{self.path}: closed")
                if not os.path.exists(self.path):
                    self._create(value)
                    return
                self._fd = os.open(self.path, os.O_RDWR)
            slots = self._slots
            if not lower and value <= max(slots):
                return
            # The smaller slot first: the other keeps a bound at least as high meanwhile.
            order = sorted(range(2), key=slots.__getitem__)
            for i in order if lower else order[:1]:
                os.pwrite(self._fd, _slot(value), i * _SLOT_SIZE)
                os.fdatasync(self._fd)
                slots[i] = value

    def _create(self, value: int) -> None:
        """The file, whole: temp file, fsync, rename, fsync of the directory (under the lock)."""
        _replace_synced(self.data_path, ID_LEASE_FILE, _slot(value) * 2)
        dir_fd = os.open(self.data_path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._fd = os.open(self.path, os.O_RDWR)
        self._slots = [value, value]
