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
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure

from mqd import NSQ_VERSION
from mqd.logs import get_logger
from mqd.options import ConfigError
from mqd.wire.json_encoding import encode_json

__all__ = [
    "METADATA_FILE",
    "RETRY_DELAY",
    "MetadataFile",
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


class _Listed(Protocol):
    """What the file records of a channel: its name, its paused flag; ephemeral ones are left out."""

    @property
    def name(self) -> str: ...

    @property
    def paused(self) -> bool: ...

    @property
    def ephemeral(self) -> bool: ...


class _ListedTopic(_Listed, Protocol):
    """What the file records of a topic: as a channel, and its channels."""

    @property
    def channels(self) -> Mapping[str, _Listed]: ...


class SavedChannel(NamedTuple):
    """A channel as the file lists it (its name not checked yet)."""

    name: str
    paused: bool


class SavedTopic(NamedTuple):
    """A topic as the file lists it, with its channels (names not checked yet)."""

    name: str
    paused: bool
    channels: tuple[SavedChannel, ...]


def thread_runner(clock: object) -> Runner:
    """run(f, *args) -> Deferred: in the reactor's thread pool, or inline on a clock without threads.

    Unit tests drive the broker with a task.Clock, whose writes stay
    synchronous and deterministic; they may replace `MetadataFile.runner`.
    """
    if IReactorThreads.providedBy(clock):
        pool = clock.getThreadPool()
        return lambda f, *args: deferToThreadPool(clock, pool, f, *args)
    return maybeDeferred


def describe(topics: Mapping[str, _ListedTopic]) -> dict[str, Any]:
    """The file's content for these topics: nsqd's JSON, ephemeral topics and channels left out."""
    listed = []
    for topic in topics.values():
        if topic.ephemeral:
            continue
        channels = [
            {"name": c.name, "paused": c.paused}
            for c in topic.channels.values()
            if not c.ephemeral
        ]
        listed.append({"name": topic.name, "paused": topic.paused, "channels": channels or None})
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
        )
        for entry in topics
    ]


class MetadataFile(Service):
    """`<data-path>/nsqd.dat` and the data-path lock: see the module doc.

    `topics` is the broker's mapping of its topics, read (never changed)
    on the reactor thread whenever a write takes the state. `unwritable`
    is told the health text when the file cannot be written at start-up,
    `written_again` the same text once a retry has written it.
    """

    name = "metadata"

    def __init__(self, data_path: str, clock: IReactorTime, topics: Mapping[str, _ListedTopic], *,
                 unwritable: Callable[[str], None], written_again: Callable[[str], None]) -> None:
        self.data_path = data_path
        self.path = os.path.join(data_path, METADATA_FILE)
        self.clock = clock
        self._topics = topics
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
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def load(self) -> list[SavedTopic]:
        """The topics and channels of the last run, as the file lists them ([] without a file).

        ConfigError when the file cannot be read or is corrupt: start-up
        stops there, and the file is left as it is.
        """
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

    def changed(self, ephemeral: bool) -> None:
        """A topic or channel appeared, went or was paused: schedule one write for however many changes.

        Changes to ephemeral ones are not written. Creating topics in a
        burst used to rewrite and fsync the whole file on the reactor for
        each reactor turn (PUB latency of 100-300 ms at 7.5k topics): the
        file is written in a thread, and changes made while a write runs
        are all taken by the next one.
        """
        if ephemeral:
            return
        self._dirty = True
        self._schedule()

    def _schedule(self, delay: float = 0) -> None:
        if self._closed or self._call is not None or self._writing is not None:
            # A write already scheduled takes the state as it is then; one
            # running reschedules when it is done (_write_done).
            return
        self._call = self.clock.callLater(delay, self._write_async, True)

    def written(self) -> Deferred[None]:
        """A Deferred firing once the state as of now is on disk.

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
        return encode_json(describe(self._topics))

    def write_now(self) -> None:
        """Write the file now, on this thread (start-up, shutdown): it waits for a write in progress.

        Raises OSError when it cannot be written; the file is then as it was.
        """
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        self._dirty = False
        self._write_file(self._bytes(), next(self._seq))

    def _write_file(self, data: bytes, seq: int) -> None:
        """Write the file atomically: temp file, fsync, rename (any thread).

        A state taken before the one already written is dropped: a thread
        write that lost the race to a later synchronous one must not undo it.
        """
        with self._lock:
            if seq <= self._written_seq:
                return
            os.makedirs(self.data_path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=METADATA_FILE + ".", suffix=".tmp", dir=self.data_path)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            self._written_seq = seq
