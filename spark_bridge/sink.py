"""The `mqd` sink: `df.write` / `df.writeStream.format("mqd")` publish each row as a message.

Columns (matched case-insensitively, as Spark matches names; others are ignored):

- `body` (binary or string, required): the message; a string is sent as its
  UTF-8 bytes. A null body fails the task (nsqd takes no empty message).
- `topic` (string, optional): where the row goes; null means the `topic`
  option. Each name is checked against NSQ's rules before anything of its
  batch is sent, and a row with no topic at all fails the task.
- `defer_ms` (integer or long, optional): above 0 the row is published with
  DPUB, delivered that many milliseconds later (one command per row: MPUB
  cannot defer); null or 0 means an ordinary MPUB.

The schema and the options are checked when Spark builds the writer on the
driver, so a missing `body` column, a column of the wrong type or a bad
option is one `StreamOptionError` line before any task starts.

Each Spark task (one `write` call) opens its own txnsq `Producer` on the
process's reactor thread (reactor_thread.py) to one broker: the `nsqd`
option's addresses, or every broker lookupd's `/nodes` lists when only
`lookupd` is given, picked round robin by partition id (a retried attempt
takes the next one; the `auth_secret` option, the secret sent with AUTH,
also goes to lookupd as `Authorization: Bearer`, for lookupds run with
`--http-auth-required`, and a lookupd refusing it fails the task with one
line naming it). Rows become MPUBs of at most `batchSize` messages and
`batchBytes` bytes per topic, up to `maxOutstanding` of them on the wire at
once; the task ends when every command has been answered, and fails (so
that Spark retries it) unless every MPUB and DPUB got OK. The producer is
stopped at the end of the task whatever happened.

Rows arrive as Arrow record batches (`DataSourceArrowWriter`): the body
column becomes Python bytes in one call per batch instead of one Row
object per message. Turning 100k Arrow rows into Rows, as Spark does for a
Row writer, costs ~0.25 s of CPU; the whole Arrow task costs ~0.07 s, which
leaves the two cores to the JVM and the broker (the broker's ingest is what
bounds a local write: ~200k rows/s in local[2], ~300k/s for one task alone).

Delivery is at least once. nsqd has no idempotent publish, so a task that
fails after some of its MPUBs were accepted, and is retried, publishes
those rows again; a streaming query restarted from its checkpoint replays
the micro-batch that was not committed, with the same effect. Consumers
that must not see a message twice need a key in the body to deduplicate on.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    ByteType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
)

from mqd.client.discovery import ACCEPT, LookupdError, lookup_answer
from mqd.clusterinfo.bearer import (
    REFUSALS,
    bearer_headers,
    check_secret,
    refusal_hint,
    refusal_text,
)
from mqd.names import is_valid_name
from spark_bridge import reactor_thread
from spark_bridge.stream_options import (
    StreamOptionError,
    addresses,
    client_config,
    lookupd_url,
    option_duration,
    option_int,
    topic_name,
)

__all__ = [
    "SinkError",
    "StreamOptionError",
    "TopicCommitMessage",
    "TopicStreamWriter",
    "TopicWriter",
    "lookupd_brokers",
]

DEFAULT_BATCH_SIZE = 500
DEFAULT_BATCH_BYTES = 1024 * 1024  # well under nsqd's default --max-body-size of 5 MiB
DEFAULT_MAX_OUTSTANDING = 8
DEFAULT_PUBLISH_TIMEOUT = 30.0
# Connecting and stopping are bounded too: a task must never hang on a broker.
STOP_TIMEOUT = 10.0
LOOKUPD_TIMEOUT = 5.0
_NAME_RULE = "1-64 characters of [.a-zA-Z0-9_-], optionally ending in #ephemeral"
_INTEGER_TYPES = (ByteType, ShortType, IntegerType, LongType)


class SinkError(RuntimeError):
    """A write task could not publish all its rows (one line; Spark retries the task)."""


@dataclass
class TopicCommitMessage(WriterCommitMessage):
    """What one task published: {topic: [messages, bytes]}, the broker, how many were deferred."""

    broker: str
    topics: dict[str, list[int]] = field(default_factory=dict)
    deferred: int = 0

    @property
    def messages(self) -> int:
        return sum(m for m, _ in self.topics.values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.topics.values())


@dataclass(frozen=True)
class _Plan:
    """Everything a task needs, checked on the driver; plain values, so it pickles small."""

    nsqd: tuple[str, ...]
    lookupd: tuple[str, ...]
    topic: str | None
    body: str
    body_is_string: bool
    topic_column: str | None
    defer_column: str | None
    batch_size: int
    batch_bytes: int
    max_outstanding: int
    timeout: float
    options: dict[str, str]
    auth_secret: str  # the client option, also sent to lookupd as `Authorization: Bearer`


def _plan(options: Mapping[str, str], schema: StructType) -> _Plan:
    fields = {f.name.lower(): f for f in schema.fields}
    body = fields.get("body")
    if body is None:
        raise StreamOptionError("mqd: the DataFrame has no body column (binary or string)")
    if not isinstance(body.dataType, (BinaryType, StringType)):
        raise StreamOptionError(
            f"mqd: column {body.name} is {body.dataType.simpleString()}, not binary or string")
    topic_field = fields.get("topic")
    if topic_field is not None and not isinstance(topic_field.dataType, StringType):
        raise StreamOptionError(
            f"mqd: column {topic_field.name} is {topic_field.dataType.simpleString()}, not string")
    defer_field = fields.get("defer_ms")
    if defer_field is not None and not isinstance(defer_field.dataType, _INTEGER_TYPES):
        raise StreamOptionError(
            f"mqd: column {defer_field.name} is {defer_field.dataType.simpleString()}, "
            "not integer or long")
    nsqd, lookupd = addresses(options)
    topic = topic_name(options, "topic", required=topic_field is None)
    if topic is None and topic_field is None:  # pragma: no cover - topic_name raised
        raise StreamOptionError("mqd: option topic is required")
    timeout = option_duration(options, "publishTimeout", DEFAULT_PUBLISH_TIMEOUT)
    plain = {str(k): str(v) for k, v in options.items() if v is not None}
    auth_secret = client_config(plain).auth_secret  # fails here, on the driver, with the option's name
    if lookupd:
        try:
            check_secret(auth_secret, "mqd: option auth_secret")  # it goes in an HTTP header too
        except ValueError as e:
            raise StreamOptionError(str(e)) from None
    return _Plan(
        nsqd=nsqd, lookupd=lookupd, topic=topic,
        body=body.name, body_is_string=isinstance(body.dataType, StringType),
        topic_column=topic_field.name if topic_field is not None else None,
        defer_column=defer_field.name if defer_field is not None else None,
        batch_size=option_int(options, "batchSize", DEFAULT_BATCH_SIZE),
        batch_bytes=option_int(options, "batchBytes", DEFAULT_BATCH_BYTES),
        max_outstanding=option_int(options, "maxOutstanding", DEFAULT_MAX_OUTSTANDING),
        timeout=timeout,
        options=plain, auth_secret=auth_secret,
    )


# -- brokers ---------------------------------------------------------------------------


def lookupd_brokers(lookupds: tuple[str, ...], timeout: float = LOOKUPD_TIMEOUT, auth_secret: str = "") -> list[str]:
    """Every broker (`host:tcp_port`) the lookupds' `/nodes` list, sorted; SinkError if none answers.

    `auth_secret` goes as `Authorization: Bearer`; a lookupd refusing it
    (401/403) is a SinkError at once, naming it: a wrong secret is wrong
    whatever the other lookupds say.
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    found: set[str] = set()
    errors: list[str] = []
    answered = False
    headers = {"Accept": ACCEPT.decode()}
    headers.update({k.decode(): v[0].decode() for k, v in bearer_headers(auth_secret).items()})
    for address in lookupds:
        url = lookupd_url(address, "nodes")
        request = urllib.request.Request(url, headers=headers)
        try:
            with opener.open(request, timeout=timeout) as response:
                found |= lookup_answer(response.read(16 * 1024 * 1024))
            answered = True
        except urllib.error.HTTPError as e:
            if e.code in REFUSALS:
                body = e.read(4096)
                raise SinkError(f"mqd: {refusal_text('nsqlookupd', url, e.code, body)}: "
                                f"{refusal_hint(e.code, body, 'option auth_secret')}") from None
            errors.append(f"{url}: {e.reason or e}")
        except (OSError, LookupdError) as e:
            errors.append(f"{url}: {getattr(e, 'reason', None) or e}")
    if not answered:
        raise SinkError(f"mqd: no lookupd answered /nodes: {'; '.join(errors)}")
    if not found:
        raise SinkError(f"mqd: lookupd {', '.join(lookupds)} knows no broker to publish to")
    return sorted(found)


def _task_position() -> tuple[int, int]:
    """(partition id, attempt number) of the Spark task running this, (0, 0) outside Spark."""
    try:
        from pyspark import TaskContext

        context = TaskContext.get()
    except Exception:  # noqa: BLE001 - no Spark task here
        context = None
    if context is None:
        return 0, 0
    return context.partitionId(), context.attemptNumber()


def _pick_broker(plan: _Plan) -> str:
    brokers = list(plan.nsqd) or lookupd_brokers(plan.lookupd, auth_secret=plan.auth_secret)
    partition, attempt = _task_position()
    return brokers[(partition + attempt) % len(brokers)]


# -- one task's connection -----------------------------------------------------------------


class _Publisher:
    """One task's Producer: commands sent from the task's thread, answered on the reactor's.

    A semaphore of `max_outstanding` slots is the pipeline: each command
    takes one before it is handed to the reactor and gives it back when
    nsqd answers, so the task's thread runs ahead by at most that many
    commands. The first failed answer is kept and raised on the task's
    thread at the next command or at `finish`.
    """

    def __init__(self, address: str, plan: _Plan) -> None:
        from mqd.client import Producer

        self.address = address
        self.timeout = plan.timeout
        self.max_outstanding = plan.max_outstanding
        self._slots = threading.Semaphore(plan.max_outstanding)
        self._failure: str | None = None
        config = client_config(plan.options)

        def start() -> Producer:
            producer = Producer(address, config, max_outstanding=plan.max_outstanding,
                                max_queued=plan.max_outstanding)
            producer.startService()
            return producer

        self.producer = reactor_thread.call(start)

    def _take_slot(self) -> None:
        if not self._slots.acquire(timeout=self.timeout):
            self._fail_now(f"mqd: nsqd {self.address} did not answer within {self.timeout:g}s")
        if self._failure is not None:
            self._slots.release()
            raise SinkError(self._failure)

    def _fail_now(self, text: str) -> None:
        if self._failure is None:
            self._failure = text
        raise SinkError(self._failure)

    def mpub(self, topic: str, bodies: list[bytes]) -> None:
        self._take_slot()
        reactor_thread.post(self._send, "MPUB", topic, bodies, 0)

    def dpub(self, topic: str, body: bytes, delay_ms: int) -> None:
        self._take_slot()
        reactor_thread.post(self._send, "DPUB", topic, body, delay_ms)

    def _send(self, verb: str, topic: str, payload: Any, delay_ms: int) -> None:
        """On the reactor thread: the command, and what to do with its answer."""
        try:
            if verb == "MPUB":
                d = self.producer.multi_publish(topic, payload)
            else:
                d = self.producer.deferred_publish(topic, payload, delay_ms)
        except Exception as e:  # noqa: BLE001 - reported on the task's thread
            self._answered(e, verb, topic)
            return
        d.addBoth(self._answered, verb, topic)

    def _answered(self, result: Any, verb: str, topic: str) -> None:
        if result != b"OK" and self._failure is None:
            reason = getattr(result, "value", result)
            text = str(reason) or type(reason).__name__
            self._failure = f"mqd: {verb} to topic {topic} on nsqd {self.address} failed: {text}"
        self._slots.release()

    def finish(self) -> None:
        """Wait until every command sent has been answered; SinkError unless all were OK."""
        for _ in range(self.max_outstanding):
            if not self._slots.acquire(timeout=self.timeout):
                self._fail_now(f"mqd: nsqd {self.address} did not answer within {self.timeout:g}s")
        for _ in range(self.max_outstanding):
            self._slots.release()
        if self._failure is not None:
            raise SinkError(self._failure)

    def close(self) -> None:
        """Stop the producer (what was sent is answered first); never raises."""
        try:
            reactor_thread.call(self.producer.stop, timeout=STOP_TIMEOUT)
        except Exception:  # noqa: BLE001 - the task's outcome is already decided
            pass


class _Batches:
    """Bodies waiting for their topic's next MPUB, and what the task published so far."""

    def __init__(self, publisher: _Publisher, plan: _Plan) -> None:
        self.publisher = publisher
        self.size = plan.batch_size
        self.byte_cap = plan.batch_bytes
        # Several topics may each hold a batch; past this, all are flushed.
        self.total_cap = plan.batch_bytes * 4
        self.pending: dict[str, list[bytes]] = {}
        self.pending_bytes: dict[str, int] = {}
        self.total = 0
        self.done = TopicCommitMessage(broker=publisher.address)

    def add(self, topic: str, body: bytes) -> None:
        size = len(body)
        bodies = self.pending.get(topic)
        if bodies is None:
            bodies = self.pending[topic] = []
            self.pending_bytes[topic] = 0
        elif self.pending_bytes[topic] + size > self.byte_cap:
            self.flush(topic)
            bodies = self.pending[topic] = []
            self.pending_bytes[topic] = 0
        bodies.append(body)
        self.pending_bytes[topic] += size
        self.total += size
        if len(bodies) >= self.size:
            self.flush(topic)
        elif self.total > self.total_cap:
            self.flush_all()

    def add_many(self, topic: str, bodies: list[bytes]) -> None:
        """A run of bodies for one topic: whole MPUB-sized slices when they fit the byte cap."""
        start, count = 0, len(bodies)
        if self.pending.get(topic):
            while start < count and self.pending.get(topic):
                self.add(topic, bodies[start])
                start += 1
        while start < count:
            chunk = bodies[start:start + self.size]
            size = sum(map(len, chunk))
            if len(chunk) < self.size or size > self.byte_cap:
                for body in chunk:
                    self.add(topic, body)
            else:
                self._send(topic, chunk, size)
            start += len(chunk)

    def defer(self, topic: str, body: bytes, delay_ms: int) -> None:
        self.publisher.dpub(topic, body, delay_ms)
        self._count(topic, 1, len(body))
        self.done.deferred += 1

    def flush(self, topic: str) -> None:
        bodies = self.pending.pop(topic, None)
        size = self.pending_bytes.pop(topic, 0)
        self.total -= size
        if bodies:
            self._send(topic, bodies, size)

    def flush_all(self) -> None:
        for topic in list(self.pending):
            self.flush(topic)

    def _send(self, topic: str, bodies: list[bytes], size: int) -> None:
        self.publisher.mpub(topic, bodies)
        self._count(topic, len(bodies), size)

    def _count(self, topic: str, messages: int, size: int) -> None:
        counts = self.done.topics.setdefault(topic, [0, 0])
        counts[0] += messages
        counts[1] += size


# -- rows ------------------------------------------------------------------------------------


class _Rows:
    """Turns Arrow record batches into MPUB batches and DPUBs, checking each row's topic."""

    def __init__(self, plan: _Plan, batches: _Batches) -> None:
        self.plan = plan
        self.batches = batches
        self.valid: set[str] = set()
        self.row = 0  # rows of this task seen so far, for error messages

    def _check_topic(self, topic: str | None) -> str:
        if topic is None:
            topic = self.plan.topic
            if topic is None:
                raise SinkError(
                    f"mqd: row {self.row} has a null topic and there is no topic option")
            return topic
        if topic not in self.valid:
            if not is_valid_name(topic):
                raise SinkError(
                    f"mqd: row {self.row}: topic {topic!r} is not a valid NSQ name ({_NAME_RULE})")
            if len(self.valid) < 4096:
                self.valid.add(topic)
        return topic

    def _bodies(self, batch) -> list[bytes]:
        import pyarrow as pa

        column = batch.column(self.plan.body)
        if column.null_count:
            first = column.is_null().index(True).as_py()
            raise SinkError(f"mqd: row {self.row + first} has a null body (nsqd takes no empty message)")
        if pa.types.is_large_string(column.type):
            column = column.cast(pa.large_binary())
        elif pa.types.is_string(column.type) or getattr(pa.types, "is_string_view",
                                                          lambda _: False)(column.type):
            column = column.cast(pa.binary())
        return column.to_pylist()

    def add(self, batch) -> None:
        plan = self.plan
        bodies = self._bodies(batch)
        topics = batch.column(plan.topic_column).to_pylist() if plan.topic_column else None
        defers = batch.column(plan.defer_column).to_pylist() if plan.defer_column else None
        if topics is None and defers is None:
            self.batches.add_many(self._check_topic(None), bodies)
            self.row += len(bodies)
            return
        check, add, defer = self._check_topic, self.batches.add, self.batches.defer
        for i, body in enumerate(bodies):
            topic = check(topics[i] if topics is not None else None)
            delay = defers[i] if defers is not None else None
            if delay:
                if delay < 0:
                    raise SinkError(f"mqd: row {self.row}: defer_ms is negative ({delay})")
                defer(topic, body, delay)
            else:
                add(topic, body)
            self.row += 1


def _write(plan: _Plan, batches: Iterator[Any]) -> TopicCommitMessage:
    """One task: publish every row of `batches` (Arrow record batches) on one connection."""
    publisher = _Publisher(_pick_broker(plan), plan)
    try:
        pending = _Batches(publisher, plan)
        rows = _Rows(plan, pending)
        for batch in batches:
            if batch.num_rows:
                rows.add(batch)
        pending.flush_all()
        publisher.finish()
    except BaseException:
        # Not `finally`: Spark's worker prints a failed frame's last line run,
        # which would then be close() rather than what failed.
        publisher.close()
        raise
    publisher.close()
    return pending.done


class TopicWriter(DataSourceArrowWriter):
    """`df.write.format("mqd")`: every row published to its topic (see the module docstring)."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.plan = _plan(options, schema)

    def write(self, iterator: Iterator[Any]) -> TopicCommitMessage:
        """Publish one task's rows (Arrow record batches); SinkError unless nsqd accepted them all."""
        return _write(self.plan, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to do: every message was acknowledged by nsqd when its task ended."""

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to undo: what succeeded tasks published stays published (at least once)."""


class TopicStreamWriter(DataSourceStreamArrowWriter):
    """`df.writeStream.format("mqd")`: each micro-batch's rows published as `TopicWriter` does."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.plan = _plan(options, schema)

    def write(self, iterator: Iterator[Any]) -> TopicCommitMessage:
        """Publish one task's rows of the micro-batch; SinkError unless nsqd accepted them all."""
        return _write(self.plan, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: the micro-batch's messages were acknowledged when its tasks ended."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: a replayed micro-batch publishes its rows again (at least once)."""
