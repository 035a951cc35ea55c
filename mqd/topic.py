"""Topic: the publish side; copies every message to each of its channels.

While a topic has no channel (or is paused) messages wait in its own
memory queue and backend, and flow to the channels once there are some
(NSQ behaviour A3). Otherwise a publish goes straight through to the
channels in the same call: there is no topic pump to wake.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .channel import Channel
from .message import IdFactory, Message

if TYPE_CHECKING:
    from .broker import Broker

__all__ = ["Topic"]

# How many queued messages one drain step moves to the channels before it
# yields the reactor to other connections.
DRAIN_BATCH = 8192


class Topic:
    __slots__ = (
        "broker",
        "name",
        "ephemeral",
        "paused",
        "exiting",
        "channels",
        "message_count",
        "message_bytes",
        "ids",
        "_mem",
        "_mem_size",
        "_backend",
        "_drain_call",
        "__weakref__",
    )

    def __init__(self, broker: Broker, name: str) -> None:
        self.broker = broker
        self.name = name
        self.ephemeral = name.endswith("#ephemeral")
        self.paused = False
        self.exiting = False
        self.channels: dict[str, Channel] = {}
        self.message_count = 0
        self.message_bytes = 0
        self.ids = IdFactory(broker.options.node_id)
        self._mem: deque[Message] = deque()
        self._mem_size = broker.options.mem_queue_size
        self._backend = broker.open_queue(name, self.ephemeral)
        self._drain_call = None

    def __repr__(self) -> str:
        return f"<Topic {self.name}>"

    # -- stats ---------------------------------------------------------------

    def depth(self) -> int:
        return len(self._mem) + self._backend.depth()

    def backend_depth(self) -> int:
        return self._backend.depth()

    # -- publishing ----------------------------------------------------------

    def publish(self, bodies: list[bytes], defer: float = 0.0) -> None:
        """Accept message bodies from a producer; raises BackendError if they cannot be stored.

        `defer` (seconds) holds the messages in each channel's deferred
        queue, as DPUB does.
        """
        now = self.broker.clock.seconds()
        ts = int(now * 1e9)
        ids = self.ids.new_ids(len(bodies), ts)
        msgs = [Message(i, b, ts) for i, b in zip(ids, bodies, strict=True)]
        if defer > 0:
            due = now + defer
            for msg in msgs:
                msg.deferred_until = due
        self.put(msgs)

    def put(self, msgs: list[Message]) -> None:
        self.message_count += len(msgs)
        self.message_bytes += sum([len(m.body) for m in msgs])
        if self.channels and not self.paused and not self._mem and not self._backend.depth():
            self._fan_out(msgs)
        else:
            self._enqueue(msgs)
            if self.channels and not self.paused:
                self._schedule_drain()

    def _enqueue(self, msgs: list[Message]) -> None:
        mem = self._mem
        backend = self._backend
        room = self._mem_size - len(mem)
        if room >= len(msgs) and not backend.depth():
            mem.extend(msgs)
            return
        if room > 0 and not backend.depth():
            mem.extend(msgs[:room])
            msgs = msgs[room:]
        backend.put(msgs)

    def _fan_out(self, msgs: list[Message]) -> None:
        """One copy per channel; the first channel takes the originals."""
        if msgs[0].deferred_until or msgs[-1].deferred_until:
            now_due = [m for m in msgs if not m.deferred_until]
            later = [m for m in msgs if m.deferred_until]
        else:
            now_due, later = msgs, None
        first = True
        for channel in list(self.channels.values()):
            if first:
                first = False
            else:
                now_due = [m.copy() for m in now_due]
                if later:
                    later = [m.copy() for m in later]
            if later:
                channel.put_deferred(later)
            if now_due:
                channel.put(now_due)

    def _drain(self) -> None:
        """Move what waited at the topic to the channels, a batch per reactor turn."""
        self._drain_call = None
        if not self.channels or self.paused or self.exiting:
            return
        mem = self._mem
        if mem:
            n = min(len(mem), DRAIN_BATCH)
            batch = [mem.popleft() for _ in range(n)]
        else:
            batch = self._backend.read(DRAIN_BATCH)
        if batch:
            self._fan_out(batch)
        if mem or self._backend.depth():
            self._drain_call = self.broker.clock.callLater(0, self._drain)

    def _schedule_drain(self) -> None:
        if self._drain_call is None and (self._mem or self._backend.depth()):
            self._drain()

    # -- channels ------------------------------------------------------------

    def channel(self, name: str) -> Channel:
        """The channel called `name`, created (and announced) if new."""
        channel = self.channels.get(name)
        if channel is None:
            channel = Channel(
                self,
                name,
                self.broker.open_queue(f"{self.name}:{name}", self.ephemeral or name.endswith("#ephemeral")),
                self.broker.options,
                self.broker.clock,
            )
            self.channels[name] = channel
            self.broker.channel_created(self, channel)
            self._schedule_drain()
        return channel

    def delete_channel(self, name: str) -> None:
        """Delete a channel; an ephemeral topic goes with its last channel (E3)."""
        channel = self.channels.pop(name, None)
        if channel is None:
            return
        channel.delete()
        self.broker.channel_deleted(self, channel)
        if self.ephemeral and not self.channels:
            self.broker.delete_topic(self.name)

    # -- administration ------------------------------------------------------

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self._schedule_drain()

    def empty(self) -> None:
        """Drop what waits at the topic; channels keep theirs (F2)."""
        self._mem.clear()
        self._backend.empty()

    def delete(self) -> None:
        self.exiting = True
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        for name in list(self.channels):
            channel = self.channels.pop(name)
            channel.delete()
            self.broker.channel_deleted(self, channel)
        self.empty()
        self._backend.delete()

    def close(self) -> None:
        """Clean shutdown: channels flush to their backends, then the topic's memory to its own."""
        self.exiting = True
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        for channel in self.channels.values():
            channel.close()
        if self._mem:
            self._backend.put(list(self._mem))
            self._mem.clear()
        self._backend.close()
