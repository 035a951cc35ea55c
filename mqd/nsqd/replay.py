"""Replay: a range of a topic's retained log streamed into one of its channels as the channel drains.

`POST /channel/replay` (mqd.nsqd.http.replay) starts one; the channel holds
it (`Channel.replay`, an IChannelFeed) until it ends, which it does by
itself at the end of its range, when it is stopped (`DELETE
/channel/replay`, or another replay of the channel replacing it), when the
channel is emptied or deleted (the channel calls `stop`), or when the topic
goes or its log does (retention turned off: checked every turn).

**Memory.** A replay never queues more than `bound` messages (the broker's
mem-queue-size) in the channel: it reads the log only while the channel's
queue (memory and backend) holds fewer than that, and only as many records
as fit. So the messages it adds in memory never pass what mem-queue-size
allows, and none of them overflows to the backend because of it (with
--durable, where a channel's queue is its store, the store holds at most
that many of them). It reads
one bounded batch per reactor turn (`BATCH_RECORDS`, `BATCH_BYTES`), so a
publisher waits at most one batch. When the queue is full it sleeps until
the channel tells it (`delivered`) that its queue went down to the
low-water mark (a batch below the bound), or `WAIT_POLL` at the latest.

**No duplicates.** A record whose message the channel held when the replay
started (queued in memory or in the backend, deferred or in flight) is not
queued again: its consumers get that one, or got it since. The ids of those
messages are gathered first (`held`), a bounded piece per turn: the
in-flight and deferred ids and the queue's in its first turn (a backend
that reads from disk a piece per turn), then the memory queue's again at
the end, plus those the channel delivered meanwhile, so a message moving
from the backend to a consumer while the pieces are read is not missed.
That set costs about 80 bytes per message the channel held (a 16-byte id
and its set slot), and shrinks as the replay passes those ids. A record
whose id is in flight when it comes up is skipped too (a live lookup).

**Expiry.** Records may expire under a replay (retention): a read below the
log's earliest offset jumps there, and the records lost are counted in
`skipped`.

Records become Messages with their original id, body and timestamp, and
attempts 0, and go through `Channel.put` as the topic's messages do. No
Deferred or timer per message: one `callLater` per turn or wait.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from zope.interface import implementer

from backends import BackendError
from backends.interface import OffsetOutOfRange
from mqd.logs import get_logger
from mqd.message import ID_SIZE, Message
from mqd.nsqd.interfaces import IChannelFeed

if TYPE_CHECKING:
    from twisted.internet.interfaces import IDelayedCall, IReactorTime

    from backends.interface import IRetainedLog
    from mqd.nsqd.channel import Channel
    from mqd.nsqd.topic import Topic

__all__ = ["BATCH_BYTES", "BATCH_RECORDS", "Replay", "replay_into"]

log = get_logger(__name__)

# One turn's read of the log: at most this many records, and this many bytes past the first.
BATCH_RECORDS = 1000
BATCH_BYTES = 1 << 20
# Ids of held messages gathered per turn before the replay starts.
GATHER_PER_TURN = 4096
# The longest a replay waiting for room sleeps without being told (a safety net:
# the channel says when its queue goes down).
WAIT_POLL = 1.0
# How long a put the channel's store refused (a full disk) waits before it is tried again.
RETRY_AFTER = 1.0

# Phases.
_GATHERING = "gathering"
_RUNNING = "running"
_WAITING = "waiting"
_DONE = "done"


@implementer(IChannelFeed)
class Replay:
    """Records [start, end) of `log` into `channel`, at most `bound` of them queued at a time.

    Built by `replay_into`, which hands it to the channel; it runs on
    `clock` from the next turn on. Its own state only: it reads the topic
    and channel through their public calls, and of theirs sets only the
    channel's `replay` (back to None when it ends).
    """

    __slots__ = ("topic", "channel", "epoch", "start", "end", "position", "skipped", "duplicates",
                 "queued", "_log", "_clock", "_bound", "_low_water", "_phase", "_call", "_held",
                 "_pieces", "reason")

    def __init__(self, topic: Topic, channel: Channel, log: IRetainedLog, start: int, end: int, *,
                 clock: IReactorTime, bound: int) -> None:
        """`bound`: the most messages the channel may queue when the replay adds some (mem-queue-size).

        A bound of 0 (nsqd's "everything to disk") lets the replay keep one
        batch queued, which such a channel's store holds.
        """
        self.topic = topic
        self.channel = channel
        self.epoch: int = log.epoch
        self.start = start
        self.end = end
        # The next offset to queue.
        self.position = start
        # Records that expired before the replay reached them.
        self.skipped = 0
        # Records not queued because the channel held their message.
        self.duplicates = 0
        # Messages queued into the channel.
        self.queued = 0
        # Why it ended (None while it runs).
        self.reason: str | None = None
        self._log = log
        self._clock = clock
        self._bound = bound if bound > 0 else BATCH_RECORDS
        # The queue depth at or below which a waiting replay reads again: a
        # batch below the bound (half of a small bound), so it reads whole
        # batches rather than a few records per delivery.
        self._low_water = self._bound - min(BATCH_RECORDS, max(1, self._bound // 2))
        self._phase = _GATHERING
        self._call: IDelayedCall | None = None
        self._held: set[bytes] = set()
        self._pieces: Iterator[list[tuple[Message, int]]] | None = None

    def __repr__(self) -> str:
        return (f"<Replay {self.topic.name}:{self.channel.name} [{self.start}, {self.end}) "
                f"at {self.position}, {self._phase}>")

    @property
    def running(self) -> bool:
        return self._phase != _DONE

    # -- what the channel tells it (IChannelFeed) --------------------------------

    def delivered(self, messages: list[Message]) -> None:
        """The channel's queue went down by `messages`: read again if it is low enough.

        While the held ids are being gathered, these are held messages the
        pieces may not have seen (they left the backend meanwhile).
        """
        phase = self._phase
        if phase is _WAITING:
            if self.channel.depth() <= self._low_water:
                self._schedule(0)
        elif phase is _GATHERING:
            self._held.update([m.id for m in messages])

    def stop(self) -> None:
        """Stop now (the channel is emptied or deleted, or a caller asked): the channel lets go of it."""
        self._finish("stopped")

    def stats(self) -> dict[str, int]:
        """The channel's `/stats` entry "replay": where it is, where it ends, the log's epoch, records lost."""
        return {"position": self.position, "end": self.end, "epoch": self.epoch, "skipped": self.skipped}

    # -- running -----------------------------------------------------------------

    def begin(self) -> None:
        """Gather the held ids from the next turn on, then stream."""
        self._schedule(0)

    def _schedule(self, delay: float) -> None:
        call = self._call
        if call is not None and call.active():
            call.cancel()
        if self._phase is _WAITING:
            self._phase = _RUNNING
        self._call = self._clock.callLater(delay, self._turn)

    def _turn(self) -> None:
        self._call = None
        reason = self._gone()
        if reason is not None:
            self._finish(reason)
        elif self._phase is _GATHERING:
            self._gather()
        else:
            self._stream()

    def _gone(self) -> str | None:
        """Why the replay cannot go on (its channel, topic or log went), or None."""
        channel = self.channel
        topic = self.topic
        if self._phase is _DONE:
            return "stopped"
        if channel.exiting or channel.replay is not self or topic.channels.get(channel.name) is not channel:
            return "channel gone"
        if topic.exiting:
            return "topic gone"
        log_now = topic.log
        if log_now is not self._log or log_now.epoch != self.epoch:
            return "retention off"
        return None

    def _gather(self) -> None:
        """One turn of gathering the ids the channel holds; streaming starts once all are in."""
        channel = self.channel
        held = self._held
        pieces = self._pieces
        if pieces is None:
            held.update(channel.in_flight_ids())
            _, deferred, _ = channel.holdings()
            held.update([m.id for _, m in deferred.entries()])
            pieces = self._pieces = channel.peek_queued(channel.depth(), 0)
        taken = 0
        for piece in pieces:
            held.update([m.id for m, _ in piece])
            taken += len(piece)
            if taken >= GATHER_PER_TURN:
                self._schedule(0)
                return
        # Messages moved from the backend to memory while the pieces were read.
        in_memory = channel.depth() - channel.backend_depth()
        for piece in channel.peek_queued(in_memory, 0):
            held.update([m.id for m, _ in piece])
            break
        self._pieces = None
        self._phase = _RUNNING
        log.info("REPLAY({topic}:{channel}): offsets {start} to {end} of epoch {epoch}; "
                 "{held} messages held by the channel are not queued again",
                 topic=self.topic.name, channel=channel.name, start=self.start, end=self.end,
                 epoch=self.epoch, held=len(held))
        self._stream()

    def _stream(self) -> None:
        """One turn: read a batch into the channel if it has room, else wait for it to drain."""
        if self.position >= self.end:
            self._finish("end")
            return
        channel = self.channel
        depth = channel.depth()
        if depth > self._low_water:
            self._phase = _WAITING
            self._call = self._clock.callLater(WAIT_POLL, self._turn)
            return
        log_ = self._log
        n = min(self._bound - depth, BATCH_RECORDS, self.end - self.position)
        try:
            records = log_.read(self.position, n, BATCH_BYTES)
        except OffsetOutOfRange as e:
            if self.position < e.earliest:
                # Expired under the replay: go on from the oldest record kept.
                jump = min(e.earliest, self.end)
                self.skipped += jump - self.position
                self.position = jump
                self._schedule(0)
            else:
                # Beyond the latest: records the store gave back (a failed durable commit).
                self._finish("records gone")
            return
        except BackendError as e:
            self._retry(e)
            return
        if not records:
            # At latest below end: as above, records gone from the log.
            self._finish("records gone")
            return
        held = self._held
        in_flight = channel.in_flight_ids()
        msgs: list[Message] = []
        matched: list[bytes] = []
        of = Message.of
        for _, timestamp, data in records:
            key = data[:ID_SIZE]
            if key in held:
                matched.append(key)
            elif key in in_flight:
                self.duplicates += 1
            else:
                msgs.append(of(data, timestamp))
        if msgs:
            try:
                channel.put(msgs)
            except BackendError as e:
                self._retry(e)
                return
        if matched:
            held.difference_update(matched)
            self.duplicates += len(matched)
        self.queued += len(msgs)
        self.position = records[-1][0] + 1
        self._schedule(0)

    def _retry(self, error: Exception) -> None:
        log.warn("REPLAY({topic}:{channel}): cannot queue at offset {position}, retrying in {s}s: {error}",
                 topic=self.topic.name, channel=self.channel.name, position=self.position,
                 s=RETRY_AFTER, error=error)
        self._call = self._clock.callLater(RETRY_AFTER, self._turn)

    def _finish(self, reason: str) -> None:
        if self._phase is _DONE:
            return
        self._phase = _DONE
        self.reason = reason
        call = self._call
        self._call = None
        if call is not None and call.active():
            call.cancel()
        self._held = set()
        self._pieces = None
        if self.channel.replay is self:
            self.channel.replay = None
        log.info("REPLAY({topic}:{channel}): {reason} at offset {position} of [{start}, {end}): "
                 "{queued} queued, {duplicates} already held, {skipped} expired",
                 topic=self.topic.name, channel=self.channel.name, reason=reason, position=self.position,
                 start=self.start, end=self.end, queued=self.queued, duplicates=self.duplicates,
                 skipped=self.skipped)


def replay_into(topic: Topic, channel: Channel, log: IRetainedLog, start: int, end: int, *,
                clock: IReactorTime, bound: int) -> Replay:
    """Start replaying records [start, end) of `log` (the topic's) into `channel`; one running there stops.

    Returns the replay, which the channel holds until it ends.
    """
    old = channel.replay
    if old is not None:
        old.stop()
    replay = Replay(topic, channel, log, start, end, clock=clock, bound=bound)
    channel.replay = replay
    replay.begin()
    return replay
