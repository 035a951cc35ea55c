"""Broker: owns the topics and the store, knows the clients.

It opens the storage in order (the data path, the store, the last run's
topics and channels) and closes it in reverse. The metadata file
(`nsqd.dat`) and the data-path lock are the `MetadataFile` service's
(mqd.nsqd.metadata): the broker recreates the topics it lists at start-up
and tells it whenever a topic or channel appears, goes or is paused. The
message ids of all topics come from one `IdFactory`, held by the file's
id lease so that no id is issued twice on a data path, across restarts
and clock steps (see IdLease). What
the HTTP API keeps between requests (bearer-secret answers, peek and
snapshot work) is the HTTP site's (mqd.nsqd.http.state).

Retention: a topic keeps a retained log (every message published to it,
by offset, `IRetainedLog`) while `--retention-time` / `--retention-bytes`
or its own override (`set_retention`, kept in nsqd.dat) says so. The
broker settles each topic's retention, opens and deletes the logs through
the store, drops their expired records once a second. A log no retaining topic
claims at start-up is kept (and said so), never deleted by a restart.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall
from zope.interface import implementer

import backends
from backends import BackendError, IBackendStore
from backends.interface import IRetainingStore
from mqd.http.auth import AuthClient
from mqd.logs import get_logger, set_log_level
from mqd.message import IdFactory
from mqd.names import is_valid_name
from mqd.nsqd.channel import Channel
from mqd.nsqd.delivery import DeliveryBatch
from mqd.nsqd.interfaces import ITopicLifecycle
from mqd.nsqd.metadata import MetadataFile, SavedTopic
from mqd.nsqd.overflow import OverflowQueue
from mqd.nsqd.topic import RETENTION_OFF, Retention, Topic
from mqd.options import MQD_OPTIONS, ConfigError, Settings, check_retention

__all__ = ["Broker"]

log = get_logger(__name__)

# Seconds between two passes that drop the retained logs' expired records.
EXPIRY_INTERVAL = 1.0


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
        self._client_ids = itertools.count(1)
        # While a connection's data is processed: the channels to deliver
        # once it is done (see V2Protocol.dataReceived).
        self.deliveries = DeliveryBatch()
        self._loading = False
        # Every topic's message ids: one factory, so that they are unique
        # across topics too; the metadata file's id lease bounds it.
        self.ids = IdFactory(options.node_id)
        # nsqd.dat, the id lease and the data-path lock: it reads self.topics when it writes.
        self.metadata = MetadataFile(self.data_path, clock, self.topics,
                                     unwritable=self._metadata_unwritable,
                                     written_again=self._metadata_written_again,
                                     ids=self.ids)
        # From open() on; None before it, and after one that failed.
        self.store: IBackendStore | None = None
        # Work running in threads on the store (POST /snapshot copies, see
        # hold_store): the store is closed only once they are done.
        self._store_users: set[Deferred] = set()
        self._ephemeral_store = backends.open_store("dummy", options)
        # Asks the auth servers, for AUTH and for the HTTP endpoints that
        # show bodies (tests replace its fetch function).
        self.auth = AuthClient(options, clock)
        # The bound port of each listener ("TCP", "HTTP", "HTTPS"), filled in as they start.
        self.ports: dict[str, int] = {}
        # The topics with a retained log, and the pass that expires their records (while any is).
        self._retaining: dict[str, Topic] = {}
        self._expiry: LoopingCall | None = None

    def open(self) -> None:
        """Open the store and bring back the last run's topics and channels.

        Separate from __init__ so that twistd opens storage in the process
        that will serve (after daemonising), and so a store that cannot be
        opened stops start-up before any port is listening.
        """
        check_retention(self.options)
        if self.options.backend == "dummy" and self.default_retention().on:
            log.warn("--backend dummy keeps no message: the topics' retained logs keep nothing "
                     "(/topic/offsets says \"kept\": false)")
        self.metadata.open()
        try:
            self.store = backends.open_store(self.options.backend, self.options, self.clock)
        except backends.StoreOpenError as e:
            self.metadata.close()
            raise ConfigError(str(e)) from None
        self.store.health_listener = self.set_health
        try:
            saved = self.metadata.load()
        except ConfigError:
            # Start-up stops here (a corrupt nsqd.dat): let go of the store and the data-path.
            self.store.close()
            self.store = None
            self.metadata.close()
            raise
        self._restore(saved)
        self._adopt_stored_queues()
        self._reconcile_logs()
        for topic in list(self.topics.values()):
            topic.drain_waiting()
        # Written now with what was restored, then after every change.
        self.metadata.startService()

    @property
    def loading(self) -> bool:
        """True while the last run's topics and channels are being brought back (in `open`).

        Meanwhile their creation is not written to the metadata file, and
        the lookupd peers do not ask lookupd for the new topics' channels.
        """
        return self._loading

    def _metadata_unwritable(self, text: str) -> None:
        """nsqd.dat cannot be written at start-up (a full disk): serve anyway (the file retries).

        Stopping would keep consumers from draining what the store holds,
        which is what frees space. The store refuses publishes until one of
        its commits succeeds, as when the disk fills while running; the
        health text is the one line that says it (set_health logs it).
        """
        mark_failed = getattr(self.store, "mark_failed", None)
        if mark_failed is not None:
            mark_failed(text)
        else:
            self.set_health(text)

    def _metadata_written_again(self, text: str) -> None:
        """A retry wrote nsqd.dat: healthy again, unless the store is still failing."""
        if self.health == text and getattr(self.store, "failure", None) is None:
            self.set_health(None)

    def _restore(self, saved: Iterable[SavedTopic]) -> None:
        """Recreate the topics and channels the metadata file lists, with their paused flags."""
        self._loading = True
        try:
            for entry in saved:
                if not is_valid_name(entry.name) or entry.name.endswith("#ephemeral"):
                    log.warn("skipping topic {name!r} in metadata: invalid name", name=entry.name)
                    continue
                topic = self.topic(entry.name, retention=self._saved_retention(entry))
                if entry.paused:
                    topic.pause()
                for ch in entry.channels:
                    if not is_valid_name(ch.name) or ch.name.endswith("#ephemeral"):
                        log.warn("skipping channel {name!r} in metadata: invalid name", name=ch.name)
                        continue
                    channel = topic.channel(ch.name, drain=False)
                    if ch.paused:
                        channel.pause()
        finally:
            self._loading = False

    def _adopt_stored_queues(self) -> None:
        """Bring back topics and channels the store has queues for.

        The metadata file and the store are written separately, so a crash
        between the two can leave a queue whose channel the file does not
        list yet; its messages win and the channel is recreated.
        """
        names: list[str] = getattr(self.store, "queue_names", lambda: [])()
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

    def _saved_retention(self, entry: SavedTopic) -> Retention | None:
        """The override nsqd.dat lists for a topic, if any and if this broker can keep it."""
        if entry.retention is None:
            return None
        time_ms, nbytes = entry.retention
        retention = Retention(time_ms / 1000, nbytes, True)
        problem = self.retention_problem(retention)
        if problem:
            log.warn("TOPIC({topic}): ignoring its retention in the metadata: {problem}",
                     topic=entry.name, problem=problem)
            return None
        return retention

    def _reconcile_logs(self) -> None:
        """Say which retained logs no retaining topic claims (the last run's), and keep them.

        A broker restarted without its retention flags, or whose nsqd.dat
        was lost, must not lose the records it kept: such a log stays in
        the store untouched until its topic retains again (it continues
        where it stopped, same epoch) or is deleted, or its retention is
        turned off explicitly (`POST /topic/retention` with both bounds 0).
        """
        for name in self._logs.log_names():
            topic = self.topics.get(name)
            if topic is None or topic.log is None:
                log.warn("TOPIC({topic}): its retained log is kept but not written to: {why}", topic=name,
                         why="no such topic" if topic is None else "retention is off for it")

    # -- queues --------------------------------------------------------------

    def open_queue(self, name: str, ephemeral: bool) -> OverflowQueue:
        """The memory queue and backend queue for a topic ('t') or channel ('t:c').

        With a durable store the memory queue is bypassed (size 0): every
        message is stored before it is acknowledged. Ephemeral queues keep
        theirs, their backend being the dropping one.
        """
        if ephemeral:
            return OverflowQueue(self.options.mem_queue_size, self._ephemeral_store.open_queue(name))
        store = cast(IBackendStore, self.store)  # queues are opened once the store is (open)
        size = 0 if store.durable else self.options.mem_queue_size
        return OverflowQueue(size, store.open_queue(name))

    # -- topics ----------------------------------------------------------------

    def topic(self, name: str, retention: Retention | None = None) -> Topic:
        """The topic called `name`, created if new (names are checked by the caller).

        A new topic retains as `retention` (its own override) says, else as
        the broker's options do; an ephemeral one never retains.
        """
        topic = self.topics.get(name)
        if topic is None:
            topic = Topic(
                name,
                clock=self.clock,
                options=self.options,
                store=cast(IBackendStore, self.store),  # topics exist once the store is open
                open_queue=self.open_queue,
                listener=self,
                deliveries=self.deliveries,
                ids=self.ids,
            )
            # Its log before it is listed: a store that cannot open one leaves no topic without it.
            self._use_retention(topic, retention or self.default_retention())
            self.topics[name] = topic
            log.info("TOPIC({topic}): created", topic=name)
            for observer in self.observers:
                observer.topic_created(topic)
            self._metadata_changed(topic.ephemeral, name)
        return topic

    def delete_topic(self, name: str) -> bool:
        topic = self.topics.pop(name, None)
        if topic is None:
            return False
        topic.delete()
        self._drop_log(topic)
        self._drop_kept_log(name)
        log.info("TOPIC({topic}): deleted", topic=name)
        for observer in self.observers:
            observer.topic_deleted(topic)
        self._metadata_changed(topic.ephemeral, name)
        return True

    def topic_abandoned(self, topic: Topic) -> None:
        """An ephemeral topic lost its last channel: it goes too (ITopicLifecycle)."""
        self.delete_topic(topic.name)

    def channel_created(self, topic: Topic, channel: Channel) -> None:
        log.info("TOPIC({topic}): new channel({channel})", topic=topic.name, channel=channel.name)
        for observer in self.observers:
            observer.channel_created(topic, channel)
        self._metadata_changed(channel.ephemeral, topic.name)

    def channel_deleted(self, topic: Topic, channel: Channel) -> None:
        log.info("TOPIC({topic}): deleted channel({channel})", topic=topic.name, channel=channel.name)
        for observer in self.observers:
            observer.channel_deleted(topic, channel)
        self._metadata_changed(channel.ephemeral, topic.name)

    def channels(self) -> Iterator[Channel]:
        for topic in list(self.topics.values()):
            yield from list(topic.channels.values())

    # -- retention -------------------------------------------------------------------

    @property
    def _logs(self) -> IRetainingStore:
        """Where the topics' logs are kept: the store, or (a store that keeps none) the dummy one's logs.

        mqd's stores all keep logs (the dummy one keeps nothing and says
        so); a store registered from elsewhere without IRetainingStore gets
        logs that keep nothing too, so its topics answer `"kept": false`.
        """
        store = self.store
        if IRetainingStore.providedBy(store):
            return cast(IRetainingStore, store)
        return cast(IRetainingStore, self._ephemeral_store)  # the dummy store keeps retained logs (none)

    def default_retention(self) -> Retention:
        """The retention of a topic without its own: `--retention-time` and `--retention-bytes`."""
        return Retention(self.options.retention_time, self.options.retention_bytes)

    def retention_problem(self, retention: Retention) -> str | None:
        """Why this broker cannot keep a log under `retention`, or None (mqd.options.check_retention's rule)."""
        if self.options.backend == "memory" and retention.time and not retention.bytes:
            return "--backend memory keeps the retained log in RAM: a size bound is required"
        if self.options.backend == "dummy" and retention.on:
            return "--backend dummy keeps no message: a retained log needs lmdb or memory"
        return None

    def set_retention(self, topic: Topic, time: float | None = None, nbytes: int | None = None,
                      default: bool = False) -> Retention:
        """Give `topic` retention of its own, or (`default`) the broker's again; returns what it has now.

        A bound left None keeps the topic's current value. Retention turned
        off deletes the topic's log (its records are gone, and a log
        opened later is a new life with a new epoch); turned on, a log is
        opened. The override goes to nsqd.dat. ValueError, with nothing
        changed, for an ephemeral topic (it never retains) or a retention
        this broker cannot keep (`retention_problem`).
        """
        if topic.ephemeral:
            raise ValueError("an ephemeral topic never retains")
        if default:
            retention = self.default_retention()
        else:
            current = topic.retention
            retention = Retention(current.time if time is None else time,
                                  current.bytes if nbytes is None else nbytes, True)
        problem = self.retention_problem(retention)
        if problem:
            raise ValueError(problem)
        self._use_retention(topic, retention)
        if not retention.on:
            self._drop_kept_log(topic.name)
        log.info("TOPIC({topic}): retention {time:g}s, {nbytes} bytes{own}", topic=topic.name,
                 time=retention.time, nbytes=retention.bytes, own=" (its own)" if retention.overridden else "")
        self._metadata_changed(topic.ephemeral, topic.name)
        return retention

    def _use_retention(self, topic: Topic, retention: Retention) -> None:
        """Settle `topic`'s retention: its log opened if it now retains, deleted if it no longer does."""
        if topic.ephemeral:
            retention = RETENTION_OFF
        if not retention.on:
            self._drop_log(topic)
            topic.use_retention(retention, None)
            return
        retained = topic.log
        if retained is None:
            retained = self._logs.open_log(topic.name)
            self._retaining[topic.name] = topic
            self._start_expiry()
        topic.use_retention(retention, retained)

    def _drop_log(self, topic: Topic) -> None:
        """Delete the topic's retained log, if it has one: a deleted topic's or one that stopped retaining."""
        retained = topic.log
        if retained is None:
            return
        topic.use_retention(topic.retention, None)
        if self._retaining.get(topic.name) is topic:
            del self._retaining[topic.name]
        try:
            retained.delete()
        except BackendError as e:
            log.error("TOPIC({topic}): cannot delete its retained log: {error}", topic=topic.name, error=e)

    def _drop_kept_log(self, name: str) -> None:
        """Delete a log kept from an earlier run that no topic had open (see `_reconcile_logs`)."""
        if name in self._logs.log_names():
            try:
                self._logs.open_log(name).delete()
            except BackendError as e:
                log.error("TOPIC({topic}): cannot delete its retained log: {error}", topic=name, error=e)

    def _start_expiry(self) -> None:
        if self._expiry is None:
            self._expiry = LoopingCall(self.expire_logs)
            self._expiry.clock = self.clock
            self._expiry.start(EXPIRY_INTERVAL, now=False)

    def expire_logs(self) -> None:
        """Drop every retained log's records past its topic's retention: one call per log, never per message."""
        now_ns = int(self.clock.seconds() * 1e9)
        for topic in list(self._retaining.values()):
            retained = topic.log
            if retained is None:
                continue
            retention = topic.retention
            before = now_ns - int(retention.time * 1e9) if retention.time else 0
            try:
                retained.expire(before, retention.bytes)
            except BackendError as e:
                log.warn("TOPIC({topic}): cannot expire its retained log: {error}", topic=topic.name, error=e)

    @property
    def http_port(self) -> int:
        """The HTTP port clients are told (IDENTIFY): `--broadcast-http-port`, else the bound one; 0 without HTTP."""
        return self.options.broadcast_http_port or self.ports.get("HTTP", 0)

    @property
    def https_port(self) -> int:
        """The HTTPS port clients are told (IDENTIFY): the bound one of `--https-address`; 0 without that listener."""
        return self.ports.get("HTTPS", 0)

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
            topic.use_options(self.options)
        # Observers that follow options (the lookupd peers) see old and new.
        for observer in list(self.observers):
            hook = getattr(observer, "options_changed", None)
            if hook is not None:
                hook(old, self.options)

    # -- metadata and background work ---------------------------------------------------

    def _metadata_changed(self, ephemeral: bool, topic: str) -> None:
        """Tell the metadata file which topic changed, unless this is the last run's state coming back."""
        if not self._loading:
            self.metadata.changed(ephemeral, topic)

    def hold_store(self, work: Deferred) -> None:
        """Keep the store open until `work` has fired: a thread reads it (a snapshot's copy).

        Closing an LMDB environment under a reader would crash the process,
        so the broker's service waits for `background` before `close`.
        """
        self._store_users.add(work)

        def done(result: Any) -> Any:
            self._store_users.discard(work)
            return result

        work.addBoth(done)

    @property
    def background(self) -> set[Deferred]:
        """Work running in threads that must end before `close`: store readers, the metadata and lease writes."""
        running = set(self._store_users)
        for writing in (self.metadata.writing, self.metadata.lease.writing):
            if writing is not None:
                running.add(writing)
        return running

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> Deferred[None] | None:
        """Clean shutdown: clients off, metadata saved, queues flushed to their backends.

        Returns a Deferred when the store is still writing (a full disk).
        """
        if self._expiry is not None and self._expiry.running:
            self._expiry.stop()
        for client in list(self.clients):
            client.lose_connection()
        # The last metadata write, synchronous: nothing is scheduled after it.
        self.metadata.stopService()
        if self.store is not None:
            # What memory holds is staged even if the store has failed: its
            # close writes what fits and spills the rest.
            self.store.begin_close()
        for topic in list(self.topics.values()):
            topic.close()
            if topic.log is not None:
                topic.log.close()
        closed = self.store.close() if self.store is not None else None
        if closed is not None:
            # The store waits for disk space to write what it holds (LmdbStore.close):
            # the data-path stays locked until it has.
            def unlock(result: Any) -> Any:
                self.metadata.close()
                return result

            closed.addBoth(unlock)
            return closed
        self.metadata.close()
        return None
