"""Channel: one consumer group's copy of a topic's stream.

A channel owns its queues (memory deque, backend overflow, in-flight and
deferred heaps) and knows its subscribed clients. Delivery is pushed, not
polled: whatever can make a message deliverable (a put, a RDY change, a FIN
freeing a slot, an expiry) calls `deliver()`, which hands messages to ready
clients in batches until either side runs out.

A channel is given what it needs when built (its queue, the options, the
clock, the delivery batch and the listener it tells when an ephemeral
channel has lost its last client: its topic) and calls nothing above it.
"""

from __future__ import annotations

import random
from itertools import islice
from typing import TYPE_CHECKING

from twisted.logger import LogLevel
from twisted.python.failure import Failure

from backends import BackendError
from mqd.latency import LatencyWindow
from mqd.logs import get_logger
from mqd.message import ID_SIZE, Message, Run
from mqd.nsqd.inflight import InFlightQueue
from mqd.nsqd.overflow import OverflowQueue
from mqd.nsqd.pqueue import DeferredQueue

if TYPE_CHECKING:
    from collections.abc import Iterator, KeysView

    from twisted.internet.interfaces import IReactorTime

    from mqd.nsqd.delivery import DeliveryBatch
    from mqd.nsqd.interfaces import IChannelFeed, IChannelLifecycle
    from mqd.options import Settings

__all__ = ["Channel", "ChannelError"]

log = get_logger(__name__)

# How many messages one refill takes from the backend into memory: enough to
# amortise a backend read, small enough not to stall the reactor.
BACKEND_READ_BATCH = 1024


class ChannelError(Exception):
    """A FIN/REQ/TOUCH/SUB the channel refuses; the text is nsqd's reason."""


class Channel:
    __slots__ = (
        "topic_name",
        "name",
        "ephemeral",
        "paused",
        "exiting",
        "clients",
        "message_count",
        "requeue_count",
        "timeout_count",
        "e2e",
        "replay",
        "_queue",
        "_in_flight",
        "_in_flight_pq",
        "_deferred",
        "_rr",
        "_clock",
        "_max_msg_timeout",
        "_max_consumers",
        "_deliveries",
        "_listener",
        "_scan_errors",
        "__weakref__",
    )

    def __init__(self, name: str, topic_name: str, queue: OverflowQueue, options: Settings,
                 clock: IReactorTime, deliveries: DeliveryBatch, listener: IChannelLifecycle) -> None:
        """Channel `name` of topic `topic_name`, holding its messages in `queue`.

        `deliveries` collects the channels to deliver at the end of the
        read being handled (deliver_soon); `listener` (the topic) is told
        when an ephemeral channel's last client has left.
        """
        self.topic_name = topic_name
        self.name = name
        self.ephemeral = name.endswith("#ephemeral")
        self.paused = False
        self.exiting = False
        self.clients: list = []
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        # End-to-end latency window, only when percentiles are configured:
        # FIN then costs one test for None when the feature is off.
        percentiles = options.e2e_processing_latency_percentile
        self.e2e = (
            LatencyWindow(percentiles, options.e2e_processing_latency_window_time, clock)
            if percentiles
            else None
        )
        # What replays the topic's retained log into this channel (mqd.nsqd.replay),
        # or None: told when messages leave the queue and when the channel is emptied.
        self.replay: IChannelFeed | None = None
        self._queue = queue
        self._in_flight: dict[bytes, Message] = {}
        self._in_flight_pq = InFlightQueue()
        self._deferred = DeferredQueue()
        self._rr = 0
        self._clock = clock
        self._max_msg_timeout = options.max_msg_timeout
        self._max_consumers = options.max_channel_consumers
        self._deliveries = deliveries
        self._listener = listener
        # The kinds of queue-scan failure already logged: (what, exception type).
        self._scan_errors: set[tuple[str, object]] = set()
        if hasattr(queue.backend, "on_stored"):
            # A durable store hands out messages only once committed: it says when.
            queue.backend.on_stored = self._stored

    def __repr__(self) -> str:
        return f"<Channel {self.topic_name}:{self.name}>"

    # -- what /stats reports -------------------------------------------------

    def depth(self) -> int:
        return len(self._queue)

    def backend_depth(self) -> int:
        return self._queue.backend_depth()

    def in_flight_count(self) -> int:
        return len(self._in_flight)

    def in_flight_ids(self) -> KeysView[bytes]:
        """The ids in flight, a live view: whether a message is, in one lookup (a replay's check)."""
        return self._in_flight.keys()

    def deferred_count(self) -> int:
        return len(self._deferred)

    # -- inspection (GET /channel/peek) --------------------------------------

    def peek(self, state: str, count: int) -> list[tuple[Message, float | None, object | None]]:
        """The first `count` messages of one state as (message, due or timeout, client), moving none.

        `queued`: delivery order (memory, then the backend), no time, no
        client; `deferred`: by due time (reactor seconds); `in_flight`: by
        timeout (reactor seconds), with the client holding each. The heaps
        are only read (their live entries, as `pop_due` would surface them),
        so no count, timer, order or attempt changes. ValueError for
        another state.
        """
        if state == "queued":
            return [(msg, None, None) for msg in self._queue.peek(count)]
        pq: DeferredQueue | InFlightQueue
        if state == "deferred":
            pq = self._deferred
        elif state == "in_flight":
            pq = self._in_flight_pq
        else:
            raise ValueError(f"unknown state {state!r}")
        if pq is self._deferred:
            return [(msg, due, None) for due, msg in pq.peek(count)]
        return [(msg, timeout, msg.client) for timeout, msg in pq.peek(count)]

    def peek_queued(self, count: int, body_limit: int) -> Iterator[list[tuple[Message, int]]]:
        """`peek("queued", count)` as (message, body size) pieces: OverflowQueue.peek_pieces."""
        return self._queue.peek_pieces(count, body_limit)

    # -- queueing ------------------------------------------------------------

    def put(self, msgs: list[Message] | Run, spill: bool = False, fresh: bool = False) -> None:
        """Messages from the topic (a list, or a run of a publish); delivered at once if a client is ready.

        Raises BackendError (nothing queued) if the overflow cannot be
        stored, unless `spill`: then the messages stay in memory beyond the
        bound, for a topic whose other channels already took their copies.
        `fresh`: new publishes (IBackendQueue.put).
        """
        try:
            self._queue.put(msgs, fresh)
        except BackendError:
            if not spill:
                raise
            self._queue.mem.add(msgs)
        self.message_count += len(msgs)
        self.deliver_soon()

    def deliver_soon(self) -> None:
        """Deliver now, or once the connection being read has handled its whole read.

        While a read is processed the channels to deliver are collected in
        the DeliveryBatch (one delivery pass per read, not per command).
        """
        pending = self._deliveries.pending
        if pending is None:
            self.deliver()
        else:
            pending.add(self)

    def put_deferred(self, msgs: list[Message], spill: bool = False, fresh: bool = False) -> None:
        """Messages from the topic that are due only at their `deferred_until`.

        A store that cannot keep them raises BackendError, unless `spill`
        (see `put`): then they are deferred in memory only. `fresh` as for `put`.
        """
        try:
            later = self._queue.hold(msgs, fresh)
        except BackendError:
            if not spill:
                raise
            later = False
        self.message_count += len(msgs)
        if not later:
            self._defer(msgs)

    def _stored(self, held: list[Message]) -> None:
        """A durable store committed messages of this channel: the deferred ones start waiting, the rest is delivered."""
        if held:
            self._defer(held)
        self.deliver_soon()

    def _defer(self, msgs: list[Message]) -> None:
        push = self._deferred.push
        for msg in msgs:
            push(msg, msg.deferred_until)

    # -- delivery ------------------------------------------------------------

    def deliver(self) -> None:
        """Hand queued messages to ready clients until one side runs out.

        With several ready clients the queue is split among them in turn,
        starting with a different client each time, so a channel spreads
        its messages evenly whatever the clients' RDY windows are.
        """
        if self.paused or self.exiting:
            return
        clients = self.clients
        if not clients:
            return
        queue = self._queue
        mem = queue.mem
        take = mem.take
        send = self._send
        while True:
            pending = mem.count
            if not pending:
                # Read the backend only for a client that can take messages
                # now, so the memory queue stays within mem-queue-size.
                if not any(c.ready() > 0 for c in clients):
                    return
                later = queue.refill(BACKEND_READ_BATCH, self._clock.seconds())
                if later:
                    self._defer(later)
                pending = mem.count
                if not pending:
                    # Only deferred ones came back: read on. Nothing at all
                    # means the backend has nothing now, whatever its depth
                    # says: reading again would spin the reactor forever.
                    if later and queue:
                        continue
                    return
            if len(clients) == 1:
                client = clients[0]
                window = client.ready()
                if window <= 0:
                    return
                send(client, take(window if window < pending else pending))
                continue
            windows = [(c, w) for c in clients if (w := c.ready()) > 0]
            if not windows:
                return
            count = len(windows)
            start = self._rr % count
            self._rr += 1
            share = -(-pending // count)
            for i in range(count):
                client, window = windows[(start + i) % count]
                n = min(window, share, mem.count)
                if n <= 0:
                    break
                send(client, take(n))

    def _send(self, client, batch: list[Message]) -> None:
        if self.replay is not None:
            self.replay.delivered(batch)
        now = self._clock.seconds()
        rate = client.sample_rate
        if rate:
            batch = self._sample(batch, rate)
            if not batch:
                return
        in_flight = self._in_flight
        # One delivery's state, shared by its messages (Message.state).
        delivery = (client, now)
        for msg in batch:
            # nsqd's attempts is a uint16 and wraps (65535 -> 0); a larger
            # number could not be packed into a frame nor a record.
            msg.attempts = (msg.attempts + 1) & 0xFFFF
            msg.state = delivery
            in_flight[msg.id_key or msg.data[:16]] = msg  # msg.id, without the property's call
        self._in_flight_pq.push_batch(batch, now + client.msg_timeout, delivery)
        client.sending_messages(len(batch))
        client.send_messages(batch)

    def _sample(self, batch: list[Message], rate: int) -> list[Message]:
        """The messages a client with `sample_rate` gets; the others are done for good.

        nsqd draws r in [0,100) and drops the message when r > rate; the
        dropped ones are consumed for this channel, not requeued, so a
        durable store must forget them as a FIN would.
        """
        randrange = random.randrange
        kept: list[Message] = []
        dropped: list[Message] = []
        for m in batch:
            (kept if randrange(100) <= rate else dropped).append(m)
        if dropped:
            self._queue.finish(dropped)
        return kept

    # -- FIN / REQ / TOUCH ---------------------------------------------------

    def _owned(self, client, msg_id: bytes) -> Message:
        msg = self._in_flight.get(msg_id)
        if msg is None:
            raise ChannelError("ID not in flight")
        if msg.state[0] is not client:
            raise ChannelError("client does not own message")
        return msg

    def _pop_in_flight(self, client, msg_id: bytes) -> Message:
        msg = self._owned(client, msg_id)
        del self._in_flight[msg_id]
        msg.state = None
        self._in_flight_pq.forget(1)
        return msg

    def finish(self, client, msg_id: bytes) -> None:
        """FIN: the message is done for good. The caller runs `deliver()` once per batch."""
        if not self.finish_run(client, (msg_id,)):
            self._owned(client, msg_id)  # raises: not in flight, or not this client's

    def finish_run(self, client, msg_ids, start: int = 0) -> int:
        """FIN the ids from `start` on until one fails; how many were finished.

        A reader FINs every message, usually many per read: the parser hands
        such a run over whole, so the bookkeeping (in-flight heap, counts,
        the store's deletions) is done once per run instead of per message.
        The caller runs `deliver()` once per batch, and answers the failing
        id (if any) with `finish`'s error.
        """
        in_flight = self._in_flight
        get = in_flight.get
        done: list[Message] = []
        append = done.append
        for msg_id in islice(msg_ids, start, None):
            msg = get(msg_id)
            if msg is None or msg.state[0] is not client:
                break
            del in_flight[msg_id]
            msg.state = None
            append(msg)
        n = len(done)
        if n:
            self._in_flight_pq.forget(n)
            client.finished_messages(n)
            if self.e2e is not None:
                record = self.e2e.record
                for msg in done:
                    record(msg.timestamp)
            self._queue.finish(done)
        return n

    def requeue(self, client, msg_id: bytes, delay: float) -> None:
        """REQ: back to the tail now, or into the deferred queue for `delay` seconds."""
        if self.exiting:
            raise ChannelError("exiting")
        msg = self._pop_in_flight(client, msg_id)
        client.requeued_message()
        self.requeue_count += 1
        if delay > 0:
            msg.deferred_until = due = self._clock.seconds() + delay
            self._deferred.push(msg, due)
            if msg.key is not None:
                self._queue.backend.update((msg,))
        else:
            self._queue.put_accepted([msg])

    def touch(self, client, msg_id: bytes) -> None:
        """TOUCH: a fresh msg_timeout, but never past delivery + max-msg-timeout."""
        msg = self._owned(client, msg_id)
        deadline = self._clock.seconds() + client.msg_timeout
        delivered_at = msg.state[1]
        latest = delivered_at + self._max_msg_timeout
        # A new state object: the entry of the old deadline is dead for this message.
        msg.state = (client, delivered_at)
        self._in_flight_pq.renew(msg, deadline if deadline < latest else latest)

    # -- timeouts and deferred, driven by the queue scan ----------------------
    #
    # Neither pass may give up halfway: a message taken out of its heap and
    # put nowhere would be neither queued nor in flight until a restart.
    # The normal path is one loop per pass inside a try, which costs nothing
    # until it raises; then the entry that failed is repaired or put back in
    # the queue, the failure is logged once per channel and kind, and the
    # pass goes on with the other entries.

    def process_in_flight(self, now: float) -> bool:
        """Requeue messages whose deadline passed; True if there were any.

        Raises only if the delivery that follows does. The in-flight table
        and heap count the same messages unless something went wrong (two
        deliveries with one id, a lost entry): one comparison per pass
        notices it and `_reconcile_in_flight` makes them agree. A bad heap
        entry is repaired the same way, a message the pass fails on by
        `_expire_bad`, and every other message times out as usual.
        """
        pq = self._in_flight_pq
        in_flight = self._in_flight
        requeued = False
        if len(pq) != len(in_flight):
            requeued = self._reconcile_in_flight(now, None)
        try:
            expired = pq.pop_due(now)
        except Exception:
            requeued = self._reconcile_in_flight(now, Failure()) or requeued
            try:
                expired = pq.pop_due(now)
            except Exception:
                self._scan_failed("in-flight queue after its repair", "its heap")
                expired = []
        if not expired:
            if requeued:
                self.deliver()
            return requeued
        # Each client is told once per pass how many of its messages timed out.
        owners: dict = {}
        skipped: list[Message] = []
        msgs = iter(expired)
        while True:
            try:
                # A message that raises leaves the table and `owners` as
                # they were, or (an unhashable client) is out of the table
                # only; the loop then resumes after it.
                for msg in msgs:
                    client = msg.state[0]
                    del in_flight[msg.id]
                    owners[client] = owners.get(client, 0) + 1
                    msg.state = None
                break
            except Exception:
                if not self._expire_bad(msg, owners):
                    skipped.append(msg)
        if skipped:
            expired = _without(expired, skipped)
        self._timed_out(owners, expired)
        self.deliver()
        return True

    def _timed_out(self, owners: dict, msgs: list[Message]) -> None:
        """Messages out of flight go back to the queue; `owners` (client: count) are told."""
        for client, n in owners.items():
            try:
                client.timed_out_messages(n)
            except Exception:
                self._scan_failed("telling a client of its timeouts", f"{n} messages of {client!r}")
        self.timeout_count += len(msgs)
        self._requeue(msgs)

    def _expire_bad(self, msg: Message, owners: dict) -> bool:
        """A timed-out message the pass failed on: True if it is to be requeued. Logged once per kind.

        It was in flight if its state is a delivery or the in-flight table
        holds it; it leaves the table if the table holds it (under its id,
        or anywhere if its id cannot be read). Its client is told of the
        timeout, if it can be known. Something else a bad heap entry
        surfaced is not in flight (queued, deferred or finished, or not a
        message at all) and stays where it is. Never raises.
        """
        self._scan_failed("in-flight timeout", _describe(msg))
        if not isinstance(msg, Message):
            return False
        in_flight = self._in_flight
        state = msg.state
        held = False
        try:
            key = msg.id
            held = in_flight.get(key) is msg
            if held:
                del in_flight[key]
        except Exception:
            self._scan_failed("reading an in-flight message's id", _describe(msg))
            for key, m in in_flight.items():
                if m is msg:
                    del in_flight[key]
                    held = True
                    break
        if state.__class__ is not tuple:
            if held:
                # In the table without a delivery: no client to tell.
                msg.state = None
            return held
        msg.state = None
        try:
            client = state[0]
            owners[client] = owners.get(client, 0) + 1
        except Exception:
            self._scan_failed("counting a client's timeout", _describe(msg))
        return True

    def _reconcile_in_flight(self, now: float, failure: Failure | None) -> bool:
        """Make the in-flight table and heap hold the same messages again; True if any was requeued.

        After `failure` (the heap raised: a bad entry), or when the two
        count differently. The heap is rebuilt from its good entries
        (InFlightQueue.repair), and a message of the table that no entry
        holds any more times out now. A message the heap holds but the
        table does not (two deliveries with one id: the table keeps the
        later) times out now as well, since no FIN can reach it; so does
        one in the table without a delivery, which no FIN could finish.
        Logged once per kind. O(n), for a failure only; never raises.
        """
        table = self._in_flight
        pq = self._in_flight_pq
        if failure is None:
            failure = Failure(RuntimeError(
                f"the in-flight table holds {len(table)} messages, the heap {len(pq)}"))
        try:
            salvaged = pq.repair(now, table.values())
            strays = [(k, m) for k, m in table.items() if getattr(m, "state", None).__class__ is not tuple]
            for key, _ in strays:
                del table[key]
            shadowed = [m for _, m in pq.entries() if table.get(m.id) is not m]
            owners: dict = {}
            for m in shadowed:
                client = m.state[0]
                m.state = None
                owners[client] = owners.get(client, 0) + 1
            pq.forget(len(shadowed))
            gone = shadowed
            for _, m in strays:
                if isinstance(m, Message):
                    m.state = None
                    gone.append(m)
        except Exception:
            self._scan_failed("repairing the in-flight queue", "rebuilding its heap")
            return False
        if gone:
            self._timed_out(owners, gone)
        lost = salvaged + gone
        subject = _describe_all(lost, "timed out now") if lost else "no message lost"
        self._scan_failed("in-flight queue", subject, failure)
        return bool(gone)

    def process_deferred(self, now: float) -> bool:
        """Queue deferred messages that are due; True if there were any.

        Raises only if the delivery that follows does: a bad heap entry
        (`_repair_deferred`) is repaired and logged, and what is not a
        message is dropped; every due message is queued.
        """
        try:
            due = self._deferred.pop_due(now)
        except Exception:
            due = self._repair_deferred(now)
        if not due:
            return False
        skipped: list[Message] = []
        msgs = iter(due)
        while True:
            try:
                for msg in msgs:
                    msg.state = None
                break
            except Exception:
                # Only something other than a message has no state to set.
                self._scan_failed("deferred message", _describe(msg))
                skipped.append(msg)
        if skipped:
            due = _without(due, skipped)
        self._requeue(due)
        self.deliver()
        return True

    def _repair_deferred(self, now: float) -> list[Message]:
        """The deferred heap raised: rebuilt (DeferredQueue.repair); what is due now."""
        failure = Failure()
        try:
            salvaged = self._deferred.repair(now)
            due = self._deferred.pop_due(now)
        except Exception:
            self._scan_failed("repairing the deferred queue", "rebuilding its heap")
            return []
        subject = _describe_all(salvaged, "due now") if salvaged else "no message lost its due time"
        self._scan_failed("deferred queue", subject, failure)
        return due

    def _requeue(self, msgs: list[Message]) -> None:
        """Timed-out or due messages back in the queue; into memory if the queue raises.

        `put_accepted` already keeps messages in memory when the backend
        refuses them; any other error must not lose them either.
        """
        try:
            self._queue.put_accepted(msgs)
        except Exception:
            self._scan_failed("requeueing", _describe_all(msgs, "put in memory"))
            mem = self._queue.mem
            there = {id(m) for m in mem.messages()}
            mem.extend([m for m in msgs if id(m) not in there])

    def _scan_failed(self, what: str, subject: str, failure: Failure | None = None) -> None:
        """Log a failure of the queue scan on this channel (the current exception, or `failure`).

        Once per channel and kind (what failed, and the exception's type):
        the scan runs every 100 ms, and a failure that comes back must not
        flood the log. Never raises.
        """
        try:
            if failure is None:
                failure = Failure()
            kind = (what, failure.type)
            if kind in self._scan_errors:
                return
            self._scan_errors.add(kind)
            log.failure(
                "queue scan of {channel}: {what} failed at {subject}; the pass went on "
                "(logged once for this channel and error)",
                failure, LogLevel.error, what=what, channel=self, subject=subject,
            )
        except Exception:
            pass

    # -- snapshots -----------------------------------------------------------

    def holdings(self) -> tuple[OverflowQueue, DeferredQueue, InFlightQueue]:
        """The queue (memory + backend), the deferred queue and the in-flight queue, live.

        For a snapshot's capture (mqd.nsqd.capture), which must read all three
        at one instant and take what it needs before the reactor runs on.
        """
        return self._queue, self._deferred, self._in_flight_pq

    # -- clients -------------------------------------------------------------

    def add_client(self, client) -> None:
        if self.exiting:
            raise ChannelError("exiting")
        if self._max_consumers and len(self.clients) >= self._max_consumers:
            raise ChannelError(
                f"consumers for {self.topic_name}:{self.name} exceeds limit of {self._max_consumers}"
            )
        self.clients.append(client)

    def remove_client(self, client) -> None:
        """Forget a client that left; its in-flight messages go straight back to the queue.

        nsqd leaves them in flight until they time out; handing them on now
        costs nothing and spares consumers a msg_timeout of latency.
        """
        try:
            self.clients.remove(client)
        except ValueError:
            return
        if self.exiting:
            return
        orphans = [msg for msg in self._in_flight.values() if msg.state[0] is client]
        if orphans:
            for msg in orphans:
                del self._in_flight[msg.id]
                msg.state = None
            self._in_flight_pq.forget(len(orphans))
            # nsqd counts these as timeouts when their msg_timeout runs out.
            client.timed_out_messages(len(orphans))
            self.timeout_count += len(orphans)
            self._queue.put_accepted(orphans)
        if self.ephemeral and not self.clients:
            self._listener.channel_abandoned(self)
        else:
            self.deliver()

    # -- administration ------------------------------------------------------

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self.deliver()

    def empty(self) -> None:
        """Drop queued, in-flight and deferred messages (nsqd's /channel/empty); a replay stops."""
        if self.replay is not None:
            self.replay.stop()
        self._queue.empty()
        for msg in self._in_flight.values():
            msg.state = None
        self._in_flight.clear()
        self._in_flight_pq.drain()
        self._deferred.drain()
        for client in self.clients:
            client.in_flight_cleared()

    def delete(self) -> None:
        """Drop everything and the backend storage, and disconnect the clients."""
        self.exiting = True
        self.empty()
        self._queue.delete()
        clients, self.clients = self.clients, []
        for client in clients:
            client.channel_gone()

    def close(self) -> None:
        """Clean shutdown: everything held in memory goes to the backend.

        Memory queue first, then in-flight, then deferred, as nsqd flushes;
        attempts and deferral deadlines travel with each message so a
        persistent backend can give them back after a restart.
        """
        self.exiting = True
        in_flight = self._in_flight_pq.drain()
        self._in_flight.clear()
        for msg in in_flight:
            msg.state = None
        self._queue.close(in_flight + self._deferred.drain())


def _without(msgs: list[Message], skipped: list[Message]) -> list[Message]:
    """`msgs` less one occurrence of each of `skipped` (by identity): for a failure only."""
    left: dict[int, int] = {}
    for m in skipped:
        left[id(m)] = left.get(id(m), 0) + 1
    out = []
    for m in msgs:
        n = left.get(id(m))
        if n:
            left[id(m)] = n - 1
        else:
            out.append(m)
    return out


def _describe(msg: object) -> str:
    """`message <id>` for a log line, whatever `msg` turned out to be.

    Reads the id as `Message.id` does, without the property: a failing
    property must not hide which message failed.
    """
    try:
        key = msg.id_key or msg.data[:ID_SIZE]  # type: ignore[attr-defined]
        return f"message {key.decode('ascii', 'backslashreplace')}"
    except Exception:
        try:
            return f"entry {msg!r}"
        except Exception:
            return "an entry that has no repr"


def _describe_all(msgs: list[Message], what: str) -> str:
    """The first few messages' ids for a log line."""
    shown = ", ".join(_describe(m) for m in msgs[:5])
    more = f" and {len(msgs) - 5} more" if len(msgs) > 5 else ""
    return f"{shown}{more} ({what})"
