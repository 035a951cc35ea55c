"""Broker: owns the topics, knows the clients, keeps the metadata file.

The metadata file is nsqd's `nsqd.dat` (same name, same JSON), rewritten
atomically whenever a non-ephemeral topic or channel appears, goes, or is
paused, so a restart comes back with the same topics and channels. The
writes run in the reactor's thread pool, one at a time, each taking every
change made since the previous one started; start-up and shutdown write
synchronously.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure
from zope.interface import implementer

import backends
from mqd import NSQ_VERSION
from mqd.logs import get_logger, set_log_level
from mqd.names import is_valid_name
from mqd.nsqd.auth import AuthClient
from mqd.nsqd.channel import Channel
from mqd.nsqd.delivery import DeliveryBatch
from mqd.nsqd.http.authorization import AuthCache
from mqd.nsqd.http.peek import PeekWork
from mqd.nsqd.interfaces import ITopicLifecycle
from mqd.nsqd.overflow import OverflowQueue
from mqd.nsqd.snapshot_space import SnapshotSpace
from mqd.nsqd.topic import Topic
from mqd.options import MQD_OPTIONS, ConfigError, Settings
from mqd.wire.json_encoding import encode_json

__all__ = ["Broker", "METADATA_FILE"]

METADATA_FILE = "nsqd.dat"
# How often a metadata write that failed (a full disk) is retried.
_METADATA_RETRY = 1.0

log = get_logger(__name__)


def _thread_runner(clock):
    """run(f, *args) -> Deferred: in the reactor's thread pool, or inline on a clock without threads.

    Unit tests drive the broker with a task.Clock, whose writes stay
    synchronous and deterministic; they may set `Broker.metadata_runner`.
    """
    if IReactorThreads.providedBy(clock):
        return lambda f, *args: deferToThreadPool(clock, clock.getThreadPool(), f, *args)
    return maybeDeferred


@implementer(ITopicLifecycle)
class Broker:
    def __init__(self, options: Settings, clock=None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.options = options
        self.clock = clock
        self.start_time = int(time.time())
        self.topics: dict[str, Topic] = {}
        self.clients: set = set()
        self.health: str | None = None
        # Objects told when topics and channels come and go (the lookupd
        # peers); each has topic_created/topic_deleted/channel_created/channel_deleted,
        # and optionally options_changed(old, new).
        self.observers: list[Any] = []
        self.data_path = options.data_path or "."
        self.metadata_path = os.path.join(self.data_path, METADATA_FILE)
        self._client_ids = itertools.count(1)
        # While a connection's data is processed: the channels to deliver
        # once it is done (see V2Protocol.dataReceived).
        self.deliveries = DeliveryBatch()
        self._loading = False
        # The metadata write scheduled (callLater), if any.
        self._persist_call = None
        # Metadata writes run in the reactor's thread pool (or inline on a test
        # clock, which has none); see _write_metadata_async.
        self.metadata_runner = _thread_runner(clock)
        self._metadata_dirty = False
        self._metadata_writing: Deferred | None = None
        self._metadata_waiters: list[Deferred] = []
        # Writes are numbered when their state is taken: under the lock an
        # older state never replaces a newer one, and no two writes overlap.
        self._metadata_seq = itertools.count(1)
        self._metadata_written_seq = 0
        self._metadata_lock = threading.Lock()
        self._metadata_closed = False
        self._lock_fd: int | None = None
        self.store = None
        # Work running in threads on the store (POST /snapshot copies): the
        # store is closed only once they are done (BrokerService.stopService).
        self.background: set = set()
        self._ephemeral_store = backends.open_store("dummy", options)
        # Asks the auth servers for AUTH (tests replace its fetch function).
        self.auth = AuthClient(options, clock)
        # The HTTP endpoints that show bodies: the bearer secrets' answers,
        # cached (mqd.nsqd.http.authorization), and what peek answers hold (mqd.nsqd.http.peek).
        self.http_auth = AuthCache(self.auth, clock)
        self.peeks = PeekWork(clock)
        # Snapshot admissions (mqd.nsqd.snapshot_space): one at a time, each reserving its estimate.
        self.snapshots = SnapshotSpace()
        # The server TLS context (tlsconfig.ServerTLS) IDENTIFY upgrades
        # with, and whose policy may require it; set by tap.build_service.
        self.tls = None

    def open(self) -> None:
        """Open the store and bring back the last run's topics and channels.

        Separate from __init__ so that twistd opens storage in the process
        that will serve (after daemonising), and so a store that cannot be
        opened stops start-up before any port is listening.
        """
        try:
            os.makedirs(self.data_path, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"data-path {self.data_path}: {e.strerror}") from None
        self._lock_data_path()
        try:
            self.store = backends.open_store(self.options.backend, self.options, self.clock)
        except backends.StoreOpenError as e:
            self._unlock_data_path()
            raise ConfigError(str(e)) from None
        self.store.health_listener = self.set_health
        try:
            self.load_metadata()
        except ConfigError:
            # Start-up stops here (a corrupt nsqd.dat): let go of the store and the data-path.
            self.store.close()
            self.store = None
            self._unlock_data_path()
            raise
        self._adopt_stored_queues()
        for topic in list(self.topics.values()):
            topic.drain_waiting()
        try:
            self.persist_metadata()
        except OSError as e:
            self._metadata_unwritten_at_start(e)

    @property
    def loading(self) -> bool:
        """True while the last run's topics and channels are being brought back (in `open`).

        Meanwhile their creation is not written to the metadata file, and
        the lookupd peers do not ask lookupd for the new topics' channels.
        """
        return self._loading

    def _metadata_unwritten_at_start(self, error: OSError) -> None:
        """nsqd.dat cannot be written at start-up (a full disk): serve anyway, and retry.

        Stopping would keep consumers from draining what the store holds,
        which is what frees space. The store refuses publishes until one of
        its commits succeeds, as when the disk fills while running.
        """
        # The health text is the one line that says it (set_health logs it).
        text = (f"{self.metadata_path}: cannot write metadata: {error.strerror}; serving what the "
                f"store holds, publishes fail until there is room: free space under "
                f"{os.path.abspath(self.data_path)}")
        mark_failed = getattr(self.store, "mark_failed", None)
        if mark_failed is not None:
            mark_failed(text)
        else:
            self.set_health(text)
        self._persist_call = self.clock.callLater(_METADATA_RETRY, self._retry_metadata, text)

    def _retry_metadata(self, text: str) -> None:
        self._persist_call = None
        try:
            self.persist_metadata()
        except OSError:
            self._persist_call = self.clock.callLater(_METADATA_RETRY, self._retry_metadata, text)
            return
        log.info("{path}: metadata written", path=self.metadata_path)
        if self.health == text and getattr(self.store, "failure", None) is None:
            self.set_health(None)

    def _lock_data_path(self) -> None:
        """One broker per data-path, as nsqd's directory lock."""
        fd = os.open(self.data_path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"--data-path={self.data_path} in use (possibly by another instance of nsqd)"
            ) from None
        self._lock_fd = fd

    def _unlock_data_path(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def _adopt_stored_queues(self) -> None:
        """Bring back topics and channels the store has queues for.

        The metadata file and the store are written separately, so a crash
        between the two can leave a queue whose channel the file does not
        list yet; its messages win and the channel is recreated.
        """
        names = getattr(self.store, "queue_names", lambda: [])()
        self._loading = True
        try:
            for name in names:
                topic_name, _, channel_name = name.partition(":")
                if not is_valid_name(topic_name) or (channel_name and not is_valid_name(channel_name)):
                    log.warn("ignoring stored queue {name!r}: invalid name", name=name)
                    continue
                topic = self.topic(topic_name)
                if channel_name:
                    topic.channel(channel_name, drain=False)
        finally:
            self._loading = False

    # -- queues --------------------------------------------------------------

    def open_queue(self, name: str, ephemeral: bool) -> OverflowQueue:
        """The memory queue and backend queue for a topic ('t') or channel ('t:c').

        With a durable store the memory queue is bypassed (size 0): every
        message is stored before it is acknowledged. Ephemeral queues keep
        theirs, their backend being the dropping one.
        """
        if ephemeral:
            return OverflowQueue(self.options.mem_queue_size, self._ephemeral_store.open_queue(name))
        size = 0 if self.store.durable else self.options.mem_queue_size
        return OverflowQueue(size, self.store.open_queue(name))

    # -- topics ----------------------------------------------------------------

    def topic(self, name: str) -> Topic:
        """The topic called `name`, created if new (names are checked by the caller)."""
        topic = self.topics.get(name)
        if topic is None:
            topic = self.topics[name] = Topic(
                name,
                clock=self.clock,
                options=self.options,
                store=self.store,
                open_queue=self.open_queue,
                listener=self,
                deliveries=self.deliveries,
            )
            log.info("TOPIC({topic}): created", topic=name)
            for observer in self.observers:
                observer.topic_created(topic)
            self._metadata_changed(topic.ephemeral)
        return topic

    def delete_topic(self, name: str) -> bool:
        topic = self.topics.pop(name, None)
        if topic is None:
            return False
        topic.delete()
        log.info("TOPIC({topic}): deleted", topic=name)
        for observer in self.observers:
            observer.topic_deleted(topic)
        self._metadata_changed(topic.ephemeral)
        return True

    def topic_abandoned(self, topic: Topic) -> None:
        """An ephemeral topic lost its last channel: it goes too (ITopicLifecycle)."""
        self.delete_topic(topic.name)

    def channel_created(self, topic: Topic, channel: Channel) -> None:
        log.info("TOPIC({topic}): new channel({channel})", topic=topic.name, channel=channel.name)
        for observer in self.observers:
            observer.channel_created(topic, channel)
        self._metadata_changed(channel.ephemeral)

    def channel_deleted(self, topic: Topic, channel: Channel) -> None:
        log.info("TOPIC({topic}): deleted channel({channel})", topic=topic.name, channel=channel.name)
        for observer in self.observers:
            observer.channel_deleted(topic, channel)
        self._metadata_changed(channel.ephemeral)

    def channels(self) -> Iterator[Channel]:
        for topic in list(self.topics.values()):
            yield from list(topic.channels.values())

    # -- clients -----------------------------------------------------------------

    def next_client_id(self) -> int:
        return next(self._client_ids)

    def client_connected(self, client) -> None:
        self.clients.add(client)

    def client_disconnected(self, client) -> None:
        self.clients.discard(client)

    # -- health --------------------------------------------------------------------

    def set_health(self, error: str | None) -> None:
        """Record a storage failure (or its end); logged once per incident."""
        if error and self.health is None:
            log.error("broker unhealthy: {error}", error=error)
        elif not error and self.health is not None:
            log.info("broker healthy again")
        self.health = error or None

    # -- run-time configuration ------------------------------------------------------

    def update_options(self, **changes: Any) -> None:
        """Change options at run time (nsqd's `PUT /config/...`): check, swap, apply.

        Settings stay immutable: the broker takes a new copy, as nsqd swaps
        its options pointer, so whatever reads `broker.options` sees the old
        values or the new ones, never a mix. Raises ValueError for an
        unknown option or a bad value, before anything changes.
        """
        table = {opt.attr: opt for opt in MQD_OPTIONS}
        parsed = {}
        for attr, value in changes.items():
            if attr not in table:
                raise ValueError(f"unknown option {attr!r}")
            parsed[attr] = table[attr].parse(value)
        if "log_level" in parsed:
            set_log_level(parsed["log_level"])
        old, self.options = self.options, self.options.replace(**parsed)
        # Channels created from now on are built with the new options.
        for topic in list(self.topics.values()):
            topic.options = self.options
        # Observers that follow options (the lookupd peers) see old and new.
        for observer in list(self.observers):
            hook = getattr(observer, "options_changed", None)
            if hook is not None:
                hook(old, self.options)

    # -- metadata ------------------------------------------------------------------

    def _metadata_changed(self, ephemeral: bool) -> None:
        """Schedule one metadata write for however many changes come before it starts.

        Creating topics in a burst used to rewrite and fsync the whole file on
        the reactor for each reactor turn (PUB latency of 100-300 ms at 7.5k
        topics): now the file is written in a thread, and changes made while
        a write runs are all taken by the next one.
        """
        if ephemeral or self._loading:
            return
        self._metadata_dirty = True
        self._schedule_metadata_write()

    def _schedule_metadata_write(self, delay: float = 0) -> None:
        if self._metadata_closed or self._persist_call is not None or self._metadata_writing is not None:
            # A write already scheduled takes the state as it is then; one
            # running reschedules when it is done (_metadata_write_done).
            return
        self._persist_call = self.clock.callLater(delay, self._write_metadata_async, True)

    def metadata_written(self) -> Deferred:
        """A Deferred firing once the metadata as of now is on disk.

        nsqd answers /topic/pause and friends only after persisting, so a
        crash right after the answer cannot bring the topic back unpaused.
        It fails with the write's error (which nsqd only logs).
        """
        d: Deferred = Deferred()
        if self._metadata_closed:
            # Shut down: the last write has been made; nothing would answer.
            d.callback(None)
            return d
        self._metadata_waiters.append(d)
        self._metadata_dirty = True
        if self._metadata_writing is None:
            self._write_metadata_async()
        return d

    def _write_metadata_async(self, scheduled: bool = False) -> None:
        """Take the state now (on the reactor) and write it in a thread."""
        if scheduled:
            self._persist_call = None
        if self._metadata_writing is not None or self._metadata_closed:
            return
        if not (self._metadata_dirty or self._metadata_waiters):
            return  # a scheduled write whose changes a metadata_written() write already took
        self._metadata_dirty = False
        waiters, self._metadata_waiters = self._metadata_waiters, []
        data = self._metadata_bytes()
        d = self.metadata_runner(self._write_metadata_file, data, next(self._metadata_seq))
        self._metadata_writing = d
        self.background.add(d)
        d.addBoth(self._metadata_write_done, d, waiters)

    def _metadata_write_done(self, result, d: Deferred, waiters: list[Deferred]) -> None:
        self._metadata_writing = None
        self.background.discard(d)
        failed = isinstance(result, Failure)
        if failed:
            log.error("{path}: cannot write metadata ({error}); retrying in {s:g}s", path=self.metadata_path,
                      error=getattr(result.value, "strerror", None) or result.value, s=_METADATA_RETRY)
            self._metadata_dirty = True
        for waiter in waiters:
            if failed:
                waiter.errback(result)
            else:
                waiter.callback(None)
        if self._metadata_waiters:
            self._write_metadata_async()
        elif self._metadata_dirty:
            self._schedule_metadata_write(_METADATA_RETRY if failed else 0)

    def metadata(self) -> dict[str, Any]:
        topics = []
        for topic in self.topics.values():
            if topic.ephemeral:
                continue
            channels = [
                {"name": c.name, "paused": c.paused}
                for c in topic.channels.values()
                if not c.ephemeral
            ]
            topics.append({"name": topic.name, "paused": topic.paused, "channels": channels or None})
        return {"topics": topics or None, "version": NSQ_VERSION}

    def _metadata_bytes(self) -> bytes:
        return encode_json(self.metadata())

    def persist_metadata(self) -> None:
        """Write nsqd.dat now, on this thread (start-up, shutdown): it waits for a write in progress."""
        if self._persist_call is not None and self._persist_call.active():
            self._persist_call.cancel()
        self._persist_call = None
        self._metadata_dirty = False
        self._write_metadata_file(self._metadata_bytes(), next(self._metadata_seq))

    def _write_metadata_file(self, data: bytes, seq: int) -> None:
        """Write nsqd.dat atomically: temp file, fsync, rename (any thread).

        A state taken before the one already written is dropped: a thread
        write that lost the race to a later synchronous one must not undo it.
        """
        with self._metadata_lock:
            if seq <= self._metadata_written_seq:
                return
            os.makedirs(self.data_path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=METADATA_FILE + ".", suffix=".tmp", dir=self.data_path)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.metadata_path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            self._metadata_written_seq = seq

    def load_metadata(self) -> None:
        """Recreate the topics and channels of the last run, with their paused flags."""
        try:
            with open(self.metadata_path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            raise ConfigError(f"{self.metadata_path}: cannot read metadata: {e.strerror}") from None
        try:
            meta = json.loads(raw)
            topics = meta.get("topics") or []
            if not isinstance(topics, list):
                raise ValueError("'topics' is not a list")
            # nsqd refuses a file whose fields have the wrong JSON types.
            for entry in topics:
                channels = entry.get("channels") or []
                if not isinstance(entry.get("name", ""), str) or not isinstance(channels, list):
                    raise ValueError(f"bad topic entry {entry!r}")
                for ch in channels:
                    if not isinstance(ch.get("name", ""), str):
                        raise ValueError(f"bad channel entry {ch!r}")
        except (ValueError, AttributeError) as e:
            raise ConfigError(f"{self.metadata_path}: corrupt metadata file: {e}") from None
        self._loading = True
        try:
            for entry in topics:
                name = entry.get("name", "")
                if not is_valid_name(name) or name.endswith("#ephemeral"):
                    log.warn("skipping topic {name!r} in metadata: invalid name", name=name)
                    continue
                topic = self.topic(name)
                if entry.get("paused"):
                    topic.pause()
                for ch in entry.get("channels") or []:
                    ch_name = ch.get("name", "")
                    if not is_valid_name(ch_name) or ch_name.endswith("#ephemeral"):
                        log.warn("skipping channel {name!r} in metadata: invalid name", name=ch_name)
                        continue
                    channel = topic.channel(ch_name, drain=False)
                    if ch.get("paused"):
                        channel.pause()
        finally:
            self._loading = False

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> Deferred | None:
        """Clean shutdown: clients off, metadata saved, queues flushed to their backends.

        Returns a Deferred when the store is still writing (a full disk).
        """
        for client in list(self.clients):
            client.lose_connection()
        # The last write is this synchronous one: nothing is scheduled after it.
        self._metadata_closed = True
        try:
            self.persist_metadata()
        except OSError as e:
            # A full disk must not keep the queues from being flushed below.
            log.error("{path}: cannot write metadata at shutdown ({error}); topics and channels "
                      "made since it was last written will not come back by themselves",
                      path=self.metadata_path, error=e.strerror)
        if hasattr(self.store, "closing"):
            # What memory holds is staged even if the store has failed: its
            # close writes what fits and spills the rest.
            self.store.closing = True
        for topic in list(self.topics.values()):
            topic.close()
        closed = self.store.close() if self.store is not None else None
        if closed is not None:
            # The store waits for disk space to write what it holds (LmdbStore.close):
            # the data-path stays locked until it has.
            closed.addBoth(lambda result: (self._unlock_data_path(), result)[1])
            return closed
        self._unlock_data_path()
        return None
