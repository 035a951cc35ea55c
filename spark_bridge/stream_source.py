"""`spark.readStream.format("mqd")`: a topic's channel as a Structured Streaming source.

    spark.readStream.format("mqd")
        .option("topic", "events").option("channel", "spark")
        .option("nsqd", "127.0.0.1:4150")            # or .option("lookupd", "127.0.0.1:4161")
        .option("checkpointLocation", CHECKPOINT)    # the query's own checkpoint location
        .load()

It speaks only NSQ's TCP protocol (txnsq, `mqd.client`), so the broker may
be mqd or nsqd. Rows: topic, channel, message_id (nsqd's 16 hex
characters), timestamp (the publish time), attempts, body (binary) and
nsqd (the broker's address).

Delivery. Spark's driver runs this reader in a long-lived Python process;
a reactor thread there (reactor_thread.py) keeps the consumer connections
and receives messages between Spark's calls. `latestOffset` takes up to
`maxMessagesPerTrigger` received messages, writes them to the write-ahead
log under the checkpoint (stream_wal.py) and only then offers them as a
micro-batch; `partitions` hands Spark's tasks the batch as read back from
that log, so a batch replayed after a crash has exactly the same rows. A
message is FINished only once Spark has committed the batch holding it:
Spark asks for the batch after offset `start` only when the batch ending
at `start` is in its commit log, so `latestOffset(start)` (and `commit`)
settle every batch up to `start`. Until then messages stay in flight,
TOUCHed well inside the broker's message timeout. Redeliveries are sorted
by stream_ledger.py: a message a batch already holds is never emitted
again. Every message thus lands in exactly one committed batch; with an
idempotent sink (the file sink, foreachBatch keyed by batch id) that is
exactly once end to end.

In-flight capacity. NSQ caps what one connection may hold unanswered
(`--max-rdy-count`, 2,500 by default), and this source holds a batch's
messages until Spark commits it. So it opens `connectionsPerBroker`
consumers to every broker (by default enough for `maxInFlight`, twice
`maxMessagesPerTrigger`): one batch being processed while the next one
arrives.

HTTP auth. The `auth_secret` option, the secret sent with AUTH, is also
sent as `Authorization: Bearer` with the consumers' lookupd queries, for
lookupds run with `--http-auth-required`; a lookupd that refuses it
(401/403) fails the query with one line naming it, as a broker refusing
AUTH does.

Not supported: asynchronous progress tracking (Spark then commits offsets
before batches end), and Spark's continuous processing mode.
"""

from __future__ import annotations

import gc
import itertools
import math
import os
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
)

from mqd.client import Consumer
from spark_bridge.stream_ledger import FINISH, NEW, Ledger
from spark_bridge.stream_options import (
    StreamOptionError,
    addresses,
    client_config,
    lookupd_url,
    option_duration,
    option_int,
    topic_name,
)
from spark_bridge.stream_schema import ARROW_STREAM_SCHEMA, STREAM_SCHEMA_DDL
from spark_bridge.stream_wal import RECORD_DTYPE, WalDirectory, foreign_checkpoint, lost_offsets

if TYPE_CHECKING:
    from twisted.internet.task import LoopingCall

__all__ = ["ARROW_STREAM_SCHEMA", "STREAM_SCHEMA_DDL", "ChannelFeed", "StreamSourceError",
           "TopicStreamReader", "rows_of"]

DEFAULT_MAX_PER_TRIGGER = 10_000
DEFAULT_MAX_BYTES_PER_TRIGGER = 128 * 1024 * 1024
NSQD_MAX_RDY_COUNT = 2_500  # nsqd's --max-rdy-count default
ROWS_PER_ARROW_BATCH = 32_768
MIN_ROWS_PER_PARTITION = 5_000  # below this, another Spark task costs more than it saves


class StreamSourceError(RuntimeError):
    """The source cannot go on: no broker reachable, or one refused it (a one-line message)."""


class TopicStreamReader(DataSourceStreamReader):
    """The `mqd` streaming source: options checked here, the consumer started on first use."""

    def __init__(self, options) -> None:
        self.topic = topic_name(options, "topic")
        self.channel = topic_name(options, "channel")
        self.nsqd, self.lookupd = addresses(options)
        self.max_per_trigger = option_int(options, "maxMessagesPerTrigger", DEFAULT_MAX_PER_TRIGGER)
        self.max_bytes_per_trigger = option_int(options, "maxBytesPerTrigger",
                                                DEFAULT_MAX_BYTES_PER_TRIGGER)
        self.max_in_flight = option_int(options, "maxInFlight", 2 * self.max_per_trigger)
        self.connections = option_int(options, "connectionsPerBroker",
                                       min(64, math.ceil(self.max_in_flight / NSQD_MAX_RDY_COUNT)))
        self.partitions_wanted = option_int(options, "partitions", os.cpu_count() or 1)
        self.retention = option_duration(options, "walRetention", 3600.0)
        self.confirm_after = option_duration(options, "finConfirm", 5.0)
        self.checkpoint = options.get("checkpointLocation") or options.get("checkpointlocation")
        if not self.checkpoint:
            raise StreamOptionError(
                "mqd: option checkpointLocation is required on readStream: the query's "
                "checkpoint location, where the source keeps its write-ahead log")
        # Checked now, so that a bad client option fails the query at once.
        self.config = client_config(options, max_in_flight=max(1, self.max_in_flight // self.connections),
                                    max_attempts=0)
        self._feed: ChannelFeed | None = None
        self._wal: WalDirectory | None = None
        self._committed = 0  # the highest offset Spark committed, as this process knows it

    def __getstate__(self) -> dict[str, Any]:
        # Spark's tasks get the reader to call read(): without the driver's connections.
        state = dict(self.__dict__)
        state["_feed"] = state["_wal"] = None
        return state

    # -- offsets -------------------------------------------------------------------

    def _offset(self, offset: int) -> dict:
        return {"topic": self.topic, "channel": self.channel, "offset": offset}

    def _position(self, offset: dict) -> int:
        if (offset.get("topic"), offset.get("channel")) != (self.topic, self.channel):
            raise foreign_checkpoint(self.checkpoint, offset, self.topic, self.channel)
        return int(offset["offset"])

    # -- the driver's calls ----------------------------------------------------------

    def _started(self) -> ChannelFeed:
        if self._feed is None:
            from spark_bridge.reactor_thread import call

            self._wal = WalDirectory(self.checkpoint, self.topic, self.channel)
            if self.lookupd and not self.nsqd:
                _check_lookupd(self.lookupd)
            feed = ChannelFeed(self.topic, self.channel, self.nsqd, self.lookupd, self.config,
                               self.connections, self._wal, self.confirm_after, self.retention,
                               max_bytes=self.max_bytes_per_trigger)
            call(feed.start)
            # This process (Spark's streaming source runner) runs only this reader and holds
            # up to maxInFlight deliveries, a few tracked objects each: with the default
            # thresholds the collector rescans them all dozens of times per million
            # messages. Measured: the source alone ~73k -> 110-121k msgs/s.
            gc.freeze()
            gc.set_threshold(50_000, 20, 100)
            self._committed = feed.ledger.committed
            self._feed = feed
        return self._feed

    def _settle(self, offset: int) -> None:
        """Spark has committed every batch up to `offset`: record it, then FIN them.

        The FINs are posted to the reactor thread, not waited for: Spark goes
        on planning the next batch while they are written, and whatever the
        reader asks the reactor next runs after them.
        """
        from spark_bridge.reactor_thread import post

        feed = self._started()
        if offset > self._committed:
            wal = cast(WalDirectory, self._wal)  # set by _started
            # A batch is removed only once committed here, so offsets past the last
            # marker are in a file still, unless mqd-source/ was lost: then stop, before
            # a marker in the new one makes the next run go on from offsets it never held.
            held = max([self._committed, *(end for _start, end in wal.spans())])
            if offset > held:
                raise lost_offsets(wal.path, held, offset)
            wal.set_committed(offset)
            self._committed = offset
            post(feed.settle, offset)

    def initialOffset(self) -> dict:
        self._started()
        return self._offset(self._committed)

    def getDefaultReadLimit(self):
        return ReadMaxRows(self.max_per_trigger)

    def latestOffset(self, start: dict, limit=None) -> dict:
        from spark_bridge.reactor_thread import call, post

        at = self._position(start)
        feed = self._started()
        if feed.fatal:
            raise StreamSourceError(feed.fatal)
        self._settle(at)
        most: int | None
        most, most_bytes = self.max_per_trigger, self.max_bytes_per_trigger
        if isinstance(limit, ReadMaxRows):
            most = limit.max_rows
        elif isinstance(limit, ReadMaxBytes):
            most, most_bytes = None, limit.max_bytes
        elif isinstance(limit, ReadAllAvailable):
            most = None
        least = limit.min_rows if isinstance(limit, ReadMinRows) else 1
        # After the FINs of the batch before (posted first): they free the brokers' RDY
        # sooner, which measured faster overall than taking the next batch ahead of them.
        answer = call(feed.next_batch, at, most, least, most_bytes)
        if answer is None:
            return start
        if isinstance(answer, int):
            # A batch written before a crash and never run: offered again, exactly as it was.
            return self._offset(answer)
        base, taken = answer
        try:
            end = cast(WalDirectory, self._wal).write(base, taken)  # set by _started
        except BaseException:
            post(feed.give_back, base)
            raise
        post(feed.written, base, end)
        return self._offset(end)

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        lo, hi = self._position(start), self._position(end)
        self._settle(lo)
        if hi <= lo:
            return []
        wal = cast(WalDirectory, self._wal)  # set by _settle's _started
        spans = [s for s in wal.spans() if lo <= s[0] and s[1] <= hi]
        at = lo
        for s, e in spans:
            if s != at:
                break
            at = e
        if at != hi:
            raise lost_offsets(wal.path, lo, hi)
        batches = [wal.read(s, e) for s, e in spans]
        parts = max(1, min(self.partitions_wanted, (hi - lo) // MIN_ROWS_PER_PARTITION))
        out: list[InputPartition] = []
        for batch in batches:
            n = len(batch)
            share = max(1, math.ceil(n * parts / (hi - lo)))
            step = math.ceil(n / share)
            out.extend(InputPartition(batch.slice(i, min(n, i + step))) for i in range(0, n, step))
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from rows_of(partition.value)

    def commit(self, end: dict) -> None:
        self._settle(self._position(end))

    def stop(self) -> None:
        if self._feed is not None:
            from spark_bridge.reactor_thread import call

            feed, self._feed = self._feed, None
            call(feed.stop, timeout=30)


def _check_lookupd(addresses) -> None:
    """At least one lookupd answers /ping, or StreamSourceError: a typo fails the query at once."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    reasons = []
    for address in addresses:
        try:
            with opener.open(lookupd_url(address, "ping"), timeout=5) as answer:
                if answer.status == 200:
                    return
                reasons.append(f"{address} (HTTP {answer.status})")
        except OSError as e:
            reasons.append(f"{address} ({getattr(e, 'reason', e)})")
    raise StreamSourceError("mqd: no lookupd reachable: " + "; ".join(reasons))


def rows_of(value: tuple) -> Iterator[pa.RecordBatch]:
    """A partition's messages (WalBatch.slice) as Arrow record batches of the stream's schema."""
    topic, channel, brokers, record_bytes, offset_bytes, bodies = value
    records = np.frombuffer(record_bytes, RECORD_DTYPE)
    n = len(records)
    if n == 0:
        return
    offsets = np.frombuffer(offset_bytes, "<i8")
    body = pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets),
                                                        pa.py_buffer(bodies)]).cast(pa.binary())
    ids = pa.Array.from_buffers(pa.string(), n, [
        None, pa.py_buffer(np.arange(0, 16 * (n + 1), 16, dtype="<i4")),
        pa.py_buffer(records["id"].tobytes())])
    stamps = pa.array(records["timestamp"].astype("<i8") // 1000, pa.timestamp("us", tz="UTC"))
    attempts = pa.array(records["attempts"].astype("<i4"), pa.int32())
    nsqd = pa.DictionaryArray.from_arrays(
        pa.array(records["broker"].astype("<i4")), pa.array(brokers, pa.string())).dictionary_decode()
    table = pa.RecordBatch.from_arrays(
        [_repeat(topic, n), _repeat(channel, n), ids, stamps, attempts, body, nsqd],
        schema=ARROW_STREAM_SCHEMA)
    for at in range(0, n, ROWS_PER_ARROW_BATCH):
        yield table.slice(at, ROWS_PER_ARROW_BATCH)


def _repeat(text: str, n: int) -> pa.Array:
    """`text` n times, built from buffers (topic and channel names are never empty)."""
    data = text.encode()
    return pa.Array.from_buffers(pa.string(), n, [
        None, pa.py_buffer(np.arange(0, len(data) * (n + 1), len(data), dtype="<i4")),
        pa.py_buffer(data * n)])


class ChannelFeed:
    """The reactor side of the source: consumers, the ledger, TOUCH, FIN and their confirmation.

    Every method runs on the reactor thread (TopicStreamReader reaches it
    through reactor_thread.call). `clock` is the reactor unless a test
    gives a task.Clock.
    """

    TICK = 1.0

    def __init__(self, topic: str, channel: str, nsqd, lookupd, config, connections: int,
                 wal: WalDirectory, confirm_after: float, retention: float, clock=None,
                 max_bytes: int = DEFAULT_MAX_BYTES_PER_TRIGGER) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.topic = topic
        self.channel = channel
        self.nsqd = tuple(nsqd)
        self.lookupd = tuple(lookupd)
        self.config = config
        self.connection_count = connections
        self.wal = wal
        self.confirm_after = confirm_after
        self.retention = retention
        self.clock = clock
        self.ledger = Ledger()
        self.consumers: list = []
        # Per connection, FINs written on it and when, until the broker surely read them.
        self._fins: dict[Any, deque[tuple[float, list]]] = defaultdict(deque)
        self._last_touch = 0.0
        self._ticker: LoopingCall | None = None
        self.fatal: str | None = None
        self._stopping = False
        self._taken: dict[int, list] = {}  # batches being written to the WAL, by first offset
        # Bodies held in pending: past twice a batch's bytes the consumers pause (RDY 0), so
        # large messages cannot fill the driver's memory however many may be in flight.
        self.max_bytes = max_bytes
        self.pending_bytes = 0
        self.paused = False

    # -- life ------------------------------------------------------------------------

    def start(self):
        """Recover the WAL, start the consumers; fails if no broker of `nsqd` can be reached."""
        from twisted.internet import defer
        from twisted.internet.task import LoopingCall

        self.recover()
        lookupd_http = None
        if self.lookupd:
            from mqd.clusterinfo.bearer import BearerHTTP

            lookupd_http = BearerHTTP(self.config.auth_secret, reactor=self.clock, on_refused=self._http_refused)
        for _ in range(self.connection_count):
            consumer = _SourceConsumer(self, self.topic, self.channel, self._delivered,
                                       lookupd_http_addresses=self.lookupd,
                                       config=self.config.copy(), reactor=self.clock,
                                       on_fatal=self._fatal, lookupd_http=lookupd_http)
            self.consumers.append(consumer)
        # Before startService: each address's first attempt is reported to these.
        first = [c.connect_to_nsqd(address) for c in self.consumers for address in self.nsqd]
        for consumer in self.consumers:
            consumer.startService()
        self._last_touch = self.clock.seconds()
        self._ticker = LoopingCall(self.tick)
        self._ticker.clock = self.clock
        self._ticker.start(self.TICK, now=False)
        if not first:
            return None
        return defer.DeferredList(first, consumeErrors=True).addCallback(self._first_attempts)

    def _first_attempts(self, results):
        if any(ok for ok, _ in results):
            return None
        reasons: dict[str, str] = {}
        for (_ok, failure), address in zip(results, [a for _c in self.consumers for a in self.nsqd],
                                           strict=True):
            reasons.setdefault(address, failure.getErrorMessage() or type(failure.value).__name__)
        d = self.stop()

        def fail(_):
            raise StreamSourceError("mqd: no broker reachable: " + "; ".join(
                f"{address} ({reason})" for address, reason in reasons.items()))
        return d.addCallback(fail)

    def _fatal(self, address: str, error: Exception) -> None:
        # A broker refused the consumer for good (AUTH or IDENTIFY refused, or a handshake
        # answer the client cannot use): the query fails with it.
        self.fatal = f"mqd: {address} refused the consumer: {error}"

    def _http_refused(self, error: Exception) -> None:
        # A lookupd refused the HTTP auth secret (option auth_secret): the query fails with it.
        from mqd.clusterinfo.bearer import refusal_hint

        code, body = getattr(error, "code", 401), getattr(error, "body", b"")
        self.fatal = f"mqd: {error}: {refusal_hint(code, body, 'option auth_secret')}"

    def recover(self) -> None:
        """The ledger rebuilt from the WAL: every batch a crash left, committed or not."""
        ledger = self.ledger
        ledger.committed = self.wal.committed()
        now = self.clock.seconds()
        spans = self.wal.spans()
        for start, end in spans:
            ledger.add_batch(start, end, self.wal.read(start, end).keys(), since=now)
        ledger.end = max(ledger.end, ledger.committed)

    def stop(self):
        from twisted.internet import defer

        if self._ticker is not None and self._ticker.running:
            self._ticker.stop()
        # Nothing uncommitted may be FINished, and a consumer closing waits for its in-flight
        # messages: hand them back (REQ 0), and any that arrive until the CLS is read. A batch
        # the WAL holds is replayed from there and its redeliveries recognised, whatever Spark
        # does next with this checkpoint.
        self._stopping = True
        stopped = defer.DeferredList([defer.maybeDeferred(c.stopService) for c in self.consumers],
                                     consumeErrors=True)
        ledger = self.ledger
        for holder in (ledger.pending, ledger.live):
            for message in holder.values():
                _give_back(message)
        ledger.pending.clear()
        ledger.live.clear()
        return stopped

    # -- deliveries ----------------------------------------------------------------------

    def _delivered(self, message) -> None:
        message.disable_auto_response()
        if self._stopping:
            _give_back(message)
            return
        key = (message.nsqd_address, message.id)
        answer = self.ledger.delivered(key, message)
        if answer == FINISH:
            self._finish([(key, message)])
        elif answer == NEW:
            self.pending_bytes += len(message.body)
            if not self.paused and self.pending_bytes > 2 * self.max_bytes:
                self._pause(True)
        else:  # held: its row is in the WAL, the delivery is kept only to TOUCH and FIN
            message.body = b""

    def _pause(self, paused: bool) -> None:
        self.paused = paused
        for consumer in self.consumers:
            consumer.change_max_in_flight(0 if paused else self.config.max_in_flight)

    def next_batch(self, start: int, most: int | None, least: int = 1,
                   most_bytes: int | None = None):
        """What latestOffset(start) offers: an int (the end of open batches the WAL already
        holds from `start`: offered again, unchanged), None (fewer than `least` messages
        received), or (first offset, deliveries) for a new batch of at most `most` messages
        and `most_bytes` of bodies (at least one message)."""
        end = self.open_end(start)
        if end is not None:
            return end
        pending = self.ledger.pending
        if len(pending) < max(1, least):
            return None
        # Redeliveries that replaced a pending delivery were counted twice: recount.
        self.pending_bytes = sum(len(m.body) for m in pending.values())
        if most_bytes is not None and self.pending_bytes > most_bytes:
            count = size = 0
            for message in itertools.islice(pending.values(), most):
                size += len(message.body)
                if size > most_bytes and count:
                    break
                count += 1
            most = count
        pairs = self.ledger.take(most)
        self.pending_bytes -= sum(len(m.body) for _key, m in pairs)
        if self.paused and self.pending_bytes <= self.max_bytes:
            self._pause(False)
        base = self.ledger.end
        self._taken[base] = pairs  # until written() or give_back()
        return base, [delivery for _key, delivery in pairs]

    def give_back(self, base: int) -> None:
        self.ledger.give_back(self._taken.pop(base))

    def written(self, start: int, end: int) -> None:
        pairs = self._taken.pop(start)
        keys = [key for key, _delivery in pairs]
        deliveries = [delivery for _key, delivery in pairs]
        self.ledger.add_batch(start, end, keys, deliveries, since=self.clock.seconds())
        for message in deliveries:
            message.body = b""  # in the WAL now; the delivery is kept only to TOUCH and FIN

    def open_end(self, start: int) -> int | None:
        """The end of the open batches the WAL holds from `start` on (None: there are none)."""
        batches = self.ledger.open_batches(start)
        return batches[-1].end if batches else None

    # -- settling ------------------------------------------------------------------------

    def settle(self, offset: int) -> None:
        self._finish([(key, delivery) for _b, key, delivery in self.ledger.commit(offset)])

    def _finish(self, deliveries: list) -> None:
        now = self.clock.seconds()
        by_conn: dict[Any, list] = defaultdict(list)
        for key, message in deliveries:
            conn = message.delegate
            if conn is not None and conn.connected:
                by_conn[conn].append((key, message))
            # else: its connection is gone; the broker redelivers it, and the ledger FINs that.
        for conn, finished in by_conn.items():
            conn.finish_messages([message for _key, message in finished])
            self._fins[conn].append((now, [key for key, _message in finished]))

    def connection_closed(self, conn) -> None:
        # FINs it carried lately may not have been read: their messages stay recognisable.
        self._fins.pop(conn, None)

    def fin_failed(self, conn, message_id: bytes | None) -> None:
        """E_FIN_FAILED: that delivery had timed out, so the broker will deliver it again.

        Its FIN is no confirmation: the key stays unconfirmed (its batch keeps
        recognising the redelivery). Without an id, nothing FINished on that
        connection lately counts as read.
        """
        log = self._fins.get(conn)
        if not log:
            return
        if message_id is None:
            del self._fins[conn]
            return
        for _when, keys in log:
            for i, key in enumerate(keys):
                if key[1] == message_id:
                    del keys[i]
                    return

    def tick(self) -> None:
        now = self.clock.seconds()
        settled = []
        horizon = now - self.confirm_after
        for conn, log in list(self._fins.items()):  # a closed connection's log is gone already
            while log and log[0][0] <= horizon:
                settled.extend(log.popleft()[1])
            if not log:
                del self._fins[conn]
        done = self.ledger.confirm(settled) if settled else []
        done += self.ledger.expire(now - self.retention)
        for batch in done:
            self.wal.remove(batch.start, batch.end)
        self._touch(now)

    def _touch(self, now: float) -> None:
        """TOUCH every held delivery at a third of the shortest message timeout of the brokers."""
        timeouts = [conn.server.get("msg_timeout") for c in self.consumers
                    for conn in c.connections.values()
                    if isinstance(getattr(conn, "server", None), dict)]
        timeout = min([t / 1000 for t in timeouts if isinstance(t, int) and t > 0] or [60.0])
        if now - self._last_touch < timeout / 3:
            return
        self._last_touch = now
        ledger = self.ledger
        for holder in (ledger.pending, ledger.live):
            for message in holder.values():
                conn = message.delegate
                if conn is not None and conn.connected:
                    message.touch()


def _give_back(message) -> None:
    """REQ 0 on the connection that delivered it, if that is still up."""
    conn = message.delegate
    if conn is not None and conn.connected and not message.has_responded():
        message.requeue(0, backoff=False)


class _SourceConsumer(Consumer):
    """A txnsq Consumer that also tells the feed when a connection ends."""

    def __init__(self, feed: ChannelFeed, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._feed = feed

    def connection_closed(self, conn, reason) -> None:
        super().connection_closed(conn, reason)
        self._feed.connection_closed(conn)

    def connection_error(self, conn, err) -> None:
        super().connection_error(conn, err)
        words = str(err).split()
        if words and words[0] == "E_FIN_FAILED":
            # nsqd: "E_FIN_FAILED FIN <id> failed ID not in flight"
            message_id = words[2].encode() if len(words) > 2 and len(words[2]) == 16 else None
            self._feed.fin_failed(conn, message_id)
