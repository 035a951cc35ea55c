"""Topic: the publish side; copies every message to each of its channels.

While a topic has no channel (or is paused) messages wait in its own
memory queue and backend, and flow to the channels once there are some,
as nsqd's do. Otherwise a publish goes straight through to the channels in
the same call: there is no topic pump to wake.

A topic is given what it needs when built (the clock, the options, the
store, a queue opener, the delivery batch its channels share and the
listener it tells about channels coming and going: the broker) and calls
nothing above it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from zope.interface import implementer

from backends import BackendError
from mqd.logs import get_logger
from mqd.message import ID_SIZE, IdFactory, Message, Run, channel_copies, new_messages, new_run
from mqd.nsqd.channel import Channel
from mqd.nsqd.interfaces import IChannelLifecycle

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from twisted.internet.interfaces import IDelayedCall, IReactorTime

    from backends.interface import IBackendStore, IRetainedLog
    from mqd.nsqd.delivery import DeliveryBatch
    from mqd.nsqd.interfaces import ITopicLifecycle
    from mqd.nsqd.overflow import OverflowQueue
    from mqd.options import Settings

__all__ = ["RETENTION_OFF", "Retention", "Topic"]

log = get_logger(__name__)

# How many queued messages one drain step moves to the channels before it
# yields the reactor to other connections.
DRAIN_BATCH = 8192
# How long a move the channels' store refused (a full disk) waits before it
# is tried again: the store itself retries its commit every second.
DRAIN_RETRY = 1.0


class Retention(NamedTuple):
    """What a topic's retained log keeps: `time` seconds and `bytes` (0: that bound off), and whether set for it alone.

    Retention is on when either bound is. `overridden` is true for the
    settings `POST /topic/retention` gave the topic (kept in nsqd.dat),
    false for the broker's `--retention-time` / `--retention-bytes`.
    """

    time: float
    bytes: int
    overridden: bool = False

    @property
    def on(self) -> bool:
        return bool(self.time or self.bytes)


RETENTION_OFF = Retention(0.0, 0)


@implementer(IChannelLifecycle)
class Topic:
    __slots__ = (
        "name",
        "ephemeral",
        "paused",
        "held",
        "exiting",
        "channels",
        "message_count",
        "message_bytes",
        "ids",
        "clock",
        "options",
        "store",
        "_open_queue",
        "_listener",
        "_deliveries",
        "_queue",
        "_drain_call",
        "log",
        "retention",
        "__weakref__",
    )

    def __init__(self, name: str, *, clock: IReactorTime, options: Settings, store: IBackendStore,
                 open_queue: Callable[[str, bool], OverflowQueue], listener: ITopicLifecycle,
                 deliveries: DeliveryBatch, ids: IdFactory | None = None) -> None:
        """A topic called `name`, its queue opened now with `open_queue(name, ephemeral)`.

        `store` is the broker's store (whether it is durable, and its
        commits, decide how a publish is answered); `options` are the
        settings new channels are built with (the owner may replace them:
        Broker.update_options); `listener` hears of channels created and
        deleted, and of an ephemeral topic left without channels;
        `deliveries` is handed to every channel. `ids` makes the message
        ids: the broker's one factory, bounded by its id lease (a topic
        built alone gets a factory of its own, without a lease).
        """
        self.name = name
        self.ephemeral = name.endswith("#ephemeral")
        self.paused = False
        # Set while the channels lookupd lists are being asked for (nsqd's
        # topic not yet started): messages wait at the topic, as when paused.
        self.held = False
        self.exiting = False
        self.channels: dict[str, Channel] = {}
        self.message_count = 0
        self.message_bytes = 0
        self.clock = clock
        self.options = options
        self.store = store
        self._open_queue = open_queue
        self._listener = listener
        self._deliveries = deliveries
        self.ids = ids if ids is not None else IdFactory(options.node_id)
        self._queue = open_queue(name, self.ephemeral)
        self._drain_call: IDelayedCall | None = None
        # The retained log, while retention is on (the broker sets both: use_retention).
        self.log: IRetainedLog | None = None
        self.retention = RETENTION_OFF
        if hasattr(self._queue.backend, "on_stored"):
            # A durable store hands out messages only once committed: it says when.
            self._queue.backend.on_stored = self._stored

    def __repr__(self) -> str:
        return f"<Topic {self.name}>"

    # -- stats ---------------------------------------------------------------

    def use_retention(self, retention: Retention, log: IRetainedLog | None) -> None:
        """The retention the broker settled for the topic, and its retained log (None while off)."""
        self.retention = retention
        self.log = log

    def use_options(self, options: Settings) -> None:
        """Options changed at run time (`PUT /config`): channels created from now on get these."""
        self.options = options

    def depth(self) -> int:
        return len(self._queue)

    def backend_depth(self) -> int:
        return self._queue.backend_depth()

    def peek(self, count: int) -> list[Message]:
        """The first `count` messages waiting at the topic, in the order its channels will get them.

        Only read (GET /topic/peek): nothing moves to the channels and no
        store position changes. A DPUB waiting here keeps its deferred_until.
        """
        return self._queue.peek(count)

    def peek_queued(self, count: int, body_limit: int) -> Iterator[list[tuple[Message, int]]]:
        """`peek(count)` as (message, body size) pieces: OverflowQueue.peek_pieces."""
        return self._queue.peek_pieces(count, body_limit)

    # -- publishing ----------------------------------------------------------

    def publish(self, bodies: list[bytes], defer: float = 0.0) -> None:
        """Accept message bodies from a producer; raises BackendError if they cannot be stored.

        `defer` (seconds) holds the messages in each channel's deferred
        queue, as DPUB does.
        """
        now = self.clock.seconds()
        ts = int(now * 1e9)
        try:
            ids = self.ids.new_ids(len(bodies), ts)
        except OSError as e:
            # The id lease cannot be written: no id may be issued past it.
            raise BackendError(str(e)) from None
        store = self.store
        log = self.log
        # The retained log first: an append the store refuses (BackendError)
        # fails the publish before any channel has seen it. It only reads
        # the records (their id, body and timestamp): the channels get them next.
        if not store.durable and defer <= 0 and len(bodies) > 1:
            # Held in memory only, due now: one run, not a Message per message and channel.
            run = new_run(ids, bodies, ts)
            if log is not None:
                log.append(run)
            self.put(run)
            return
        msgs = new_messages(ids, bodies, ts)
        if log is not None:
            log.append(msgs, fresh=store.durable)
        if defer > 0:
            due = now + defer
            for msg in msgs:
                msg.deferred_until = due
        if not store.durable:
            self.put(msgs)
            return
        if self.ephemeral:
            # Never stored, but its publisher is answered after the store's
            # next commit, with its error if it fails: in only if it does not.
            store.when_durable(partial(self._put_if_committed, msgs))
            return
        # New publishes: a commit that fails drops them (its publishers get the error).
        self.put(msgs, fresh=True)

    def _put_if_committed(self, msgs: list[Message], error: str | None) -> None:
        if error is None and not self.exiting:
            self.put(msgs)

    def put(self, msgs: list[Message] | Run, fresh: bool = False) -> None:
        """Messages (or a run) for the channels, or to wait at the topic; `fresh`: new publishes to a durable store.

        A durable store's commit that fails drops the fresh messages it
        held (their publishers are answered with its error); see
        IBackendQueue.put.
        """
        if self.channels and not self.paused and not self.held and not self._queue:
            if isinstance(msgs, Run):
                self._fan_out_run(msgs)
            else:
                self._fan_out(msgs, fresh=fresh)
        else:
            self._queue.put(msgs, fresh)
            if self.channels and not self.paused and not self.held:
                self.drain_waiting()
        # Counted once stored: a publish the backend refused is not (as nsqd).
        n = len(msgs)
        self.message_count += n
        if isinstance(msgs, Run):
            self.message_bytes += sum(map(len, msgs.datas)) - ID_SIZE * n
        else:
            self.message_bytes += sum([len(m.data) for m in msgs]) - ID_SIZE * n

    def _fan_out_run(self, run: Run) -> None:
        """Every channel gets the same run; each makes its own Messages as it takes them.

        The first channel's store may refuse it (BackendError, no channel
        has taken anything); a later one that does keeps the run in memory
        (see `_fan_out`).
        """
        channels = list(self.channels.values())
        if len(channels) > 1:
            channels.sort(key=_ephemeral_last)
            run.share()
        accepted = False
        for channel in channels:
            channel.put(run, accepted)
            accepted = True

    def _fan_out(self, msgs: list[Message], keep_originals: bool = False, fresh: bool = False) -> None:
        """One copy per channel; the last channel takes the originals unless `keep_originals`.

        Copies are taken from originals no channel has seen yet: a put may
        deliver at once, and a delivery's attempts+1 must not be inherited
        by the next channel's copy (each copy counts its own attempts, as in nsqd).

        Raises BackendError, with no channel having taken anything, when
        the first channel's store refuses the messages. Ephemeral channels
        (never stored) come last, so with one store behind all the others
        only the first put can be refused; should a later one be, that
        channel keeps its copies in memory, as the others took theirs.
        `fresh`: new publishes to a durable store (see `put`).
        """
        if msgs[0].deferred_until or msgs[-1].deferred_until:
            now_due = [m for m in msgs if not m.deferred_until]
            later = [m for m in msgs if m.deferred_until]
        else:
            now_due, later = msgs, None
        channels = list(self.channels.values())
        if len(channels) > 1:
            channels.sort(key=_ephemeral_last)
        last = len(channels) if keep_originals else len(channels) - 1
        accepted = False
        for i, channel in enumerate(channels):
            if i < last:
                due = channel_copies(now_due)
                deferred = channel_copies(later) if later else later
            else:
                due, deferred = now_due, later
            if channel.ephemeral and fresh:
                # A durable store's new publish: an ephemeral channel (never
                # stored) gets it once the commit holding it is over, or never.
                self.store.when_durable(partial(_put_if_committed, channel, due, deferred))
                continue
            if deferred:
                channel.put_deferred(deferred, accepted, fresh)
                accepted = True
            if due:
                channel.put(due, accepted, fresh)
                accepted = True

    def _drain(self) -> None:
        """Move what waited at the topic to the channels, a batch per reactor turn.

        A move the channels' store refuses (a full disk) gives the batch
        back to the topic and is tried again later: what was acknowledged
        stays where it is until a channel has it.
        """
        self._drain_call = None
        if not self.channels or self.paused or self.held or self.exiting:
            return
        queue = self._queue
        batch = queue.take(DRAIN_BATCH)
        if not batch:
            return
        # Messages a durable store keeps for the topic stay its own: the
        # channels get copies, with their own keys, so the topic's records
        # are finished only once every channel has the messages. Both land
        # in the same commit.
        stored = any([m.key is not None for m in batch])
        try:
            self._fan_out(batch, keep_originals=stored)
        except BackendError as e:
            queue.untake(batch)
            log.warn("TOPIC({topic}): cannot move {n} messages to its channels, retrying in {s}s: {error}",
                     topic=self.name, n=len(batch), s=DRAIN_RETRY, error=e)
            self._drain_call = self.clock.callLater(DRAIN_RETRY, self._drain)
            return
        if stored:
            queue.finish(batch)
        if queue:
            self._drain_call = self.clock.callLater(0, self._drain)

    def _stored(self, held: list[Message]) -> None:
        """A durable store committed messages waiting at the topic: they can move on now."""
        self.drain_waiting()

    def drain_waiting(self) -> None:
        """Start moving what waits at the topic to its channels, unless a drain is under way.

        The owner calls it once the last run's topics and channels are all
        back (nsqd starts a topic's pump after loading its channels).
        """
        if self._drain_call is None and self._queue:
            self._drain()

    def holdings(self) -> OverflowQueue:
        """What waits at the topic (memory + backend), live, for a snapshot's capture."""
        return self._queue

    # -- channels ------------------------------------------------------------

    def channel(self, name: str, *, drain: bool = True) -> Channel:
        """The channel called `name`, created (and announced to the listener) if new.

        A new channel gets what waits at the topic, unless `drain` is
        False: the broker bringing back the last run's channels drains
        each topic once all of them are back (as nsqd starts a topic's
        pump after loading its channels).
        """
        channel = self.channels.get(name)
        if channel is None:
            channel = Channel(
                name,
                self.name,
                self._open_queue(f"{self.name}:{name}", self.ephemeral or name.endswith("#ephemeral")),
                self.options,
                self.clock,
                self._deliveries,
                self,
            )
            self.channels[name] = channel
            self._listener.channel_created(self, channel)
            if drain:
                self.drain_waiting()
        return channel

    def delete_channel(self, name: str) -> None:
        """Delete a channel; an ephemeral topic goes with its last channel, as in nsqd."""
        channel = self.channels.pop(name, None)
        if channel is None:
            return
        channel.delete()
        self._listener.channel_deleted(self, channel)
        if self.ephemeral and not self.channels:
            self._listener.topic_abandoned(self)

    def channel_abandoned(self, channel: Channel) -> None:
        """An ephemeral channel's last client left: it is deleted (IChannelLifecycle)."""
        self.delete_channel(channel.name)

    # -- administration ------------------------------------------------------

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self.drain_waiting()

    def hold(self) -> None:
        """Keep messages at the topic until `release`: its channels are not all known yet.

        nsqd starts a new topic's pump only once the channels lookupd
        lists exist, so each of them gets the topic's first message.
        """
        self.held = True

    def release(self) -> None:
        self.held = False
        self.drain_waiting()

    def empty(self) -> None:
        """Drop what waits at the topic; channels keep theirs, as in nsqd."""
        self._queue.empty()

    def delete(self) -> None:
        self.exiting = True
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        for name in list(self.channels):
            channel = self.channels.pop(name)
            channel.delete()
            self._listener.channel_deleted(self, channel)
        self._queue.delete()

    def close(self) -> None:
        """Clean shutdown: channels flush to their backends, then the topic's memory to its own."""
        self.exiting = True
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        for channel in self.channels.values():
            channel.close()
        self._queue.close()


def _ephemeral_last(channel: Channel) -> bool:
    return channel.ephemeral


def _put_if_committed(channel: Channel, due: list[Message], deferred: list[Message] | None,
                      error: str | None) -> None:
    if error is not None or channel.exiting:
        return
    if deferred:
        channel.put_deferred(deferred, True)
    if due:
        channel.put(due, True)
