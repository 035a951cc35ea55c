"""Broker: owns the topics, knows the clients, keeps the metadata file.

The metadata file is nsqd's `nsqd.dat` (same name, same JSON), rewritten
atomically whenever a non-ephemeral topic or channel appears, goes, or is
paused, so a restart comes back with the same topics and channels.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import backends

from .auth import AuthClient
from .channel import Channel
from .logs import get_logger, set_log_level
from .names import is_valid_name
from .options import MQD_OPTIONS, ConfigError, Settings
from .overflow import OverflowQueue
from .topic import Topic

__all__ = ["Broker", "METADATA_FILE"]

METADATA_FILE = "nsqd.dat"

log = get_logger(__name__)


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
        # once it is done (see V2Protocol.dataReceived); None otherwise.
        self.pending_deliveries: set[Channel] | None = None
        self._loading = False
        self._persist_call = None
        self._lock_fd: int | None = None
        self.store = None
        # Work running in threads on the store (POST /snapshot copies): the
        # store is closed only once they are done (BrokerService.stopService).
        self.background: set = set()
        self._ephemeral_store = backends.open_store("dummy", options)
        # Asks the auth servers for AUTH (tests replace its fetch function).
        self.auth = AuthClient(options, clock)
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
            topic._schedule_drain()
        self.persist_metadata()

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
                    topic.channel(channel_name)
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
            topic = self.topics[name] = Topic(self, name)
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
        # Observers that follow options (the lookupd peers, H3) see old and new.
        for observer in list(self.observers):
            hook = getattr(observer, "options_changed", None)
            if hook is not None:
                hook(old, self.options)

    # -- metadata ------------------------------------------------------------------

    def _metadata_changed(self, ephemeral: bool) -> None:
        """Schedule one metadata write for however many changes this reactor turn makes."""
        if ephemeral or self._loading or self._persist_call is not None:
            return
        self._persist_call = self.clock.callLater(0, self.persist_metadata)

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
        from .protocol.v2 import NSQ_VERSION

        return {"topics": topics or None, "version": NSQ_VERSION}

    def persist_metadata(self) -> None:
        """Write nsqd.dat atomically: temp file, fsync, rename."""
        if self._persist_call is not None and self._persist_call.active():
            self._persist_call.cancel()
        self._persist_call = None
        data = json.dumps(self.metadata(), separators=(",", ":")).encode()
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
                    channel = topic.channel(ch_name)
                    if ch.get("paused"):
                        channel.pause()
        finally:
            self._loading = False

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Clean shutdown: clients off, metadata saved, queues flushed to their backends."""
        for client in list(self.clients):
            client.transport.loseConnection()
        self.persist_metadata()
        for topic in list(self.topics.values()):
            topic.close()
        if self.store is not None:
            self.store.close()
        self._unlock_data_path()
