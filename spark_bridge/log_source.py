"""Offset mode of the `mqd` format: topics' retained logs read by offset, as Spark's Kafka source reads partitions.

    spark.readStream.format("mqd").option("topic", "events")
        .option("nsqd", "10.0.0.5:4150,10.0.0.6:4150")   # or .option("lookupd", "10.0.0.2:4161")
        .option("startingOffsets", "earliest")
        .load()

    spark.read.format("mqd").option("topic", "events")
        .option("startingTimestamp", ms).option("endingTimestamp", ms)  # a batch DataFrame of that window
        .load()

Chosen when a read names a topic and no `channel` (with a channel, the
stream consumes it: stream_source.py). Each (broker, topic) retained log
plays the part of a Kafka partition. The driver only asks each broker
`GET /topic/offsets`; a micro-batch is, per log, the offsets from the
previous batch's end to the latest (at most `maxOffsetsPerTrigger` over
all logs, shared in proportion to what each has waiting), cut into Spark
partitions until there are `minPartitions`; Spark's executors read their
ranges straight from the brokers (`GET /topic/read`, log_fetch.py) as
Arrow batches. Spark keeps the offsets in its own checkpoint (the query's
`checkpointLocation` on writeStream): the source writes nothing, FINishes
nothing and holds nothing in flight, and a batch read again after a crash
of either side is the same records, so an idempotent sink gets every
record exactly once.

Brokers (log_brokers.py) are TCP addresses IDENTIFYed once, or the
topic's producers as the lookupds list them at every trigger: a broker
new to the query is read from its earliest record, one that goes away
keeps its offsets (and is read on if it comes back). A broker that cannot
be asked is skipped by the driver while the others are read on; the
executors reading a range of it when it went try again for
UNREACHABLE_FOR seconds (a restarted broker keeps what it acknowledged).

Data loss. Records can go before the query reads them: expired by the
broker's retention, a topic deleted and created again (a new log, with
a new epoch and offsets from 0 again), or records a broker without
`--durable` had not synced when it crashed (its log then ends before the
offsets the query read to, and new records get those offsets again). With
`failOnDataLoss` true (the default, as Kafka's) the query fails with a
line naming the broker, topic and range; with false it is logged and the
read goes on from the log's earliest record (or its new end).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from spark_bridge.log_brokers import BrokerError, LogBrokers
from spark_bridge.log_fetch import (
    BrokerLog,
    EpochChanged,
    LogFetchError,
    LogOffsets,
    OffsetOutOfRange,
    RetentionOff,
    TopicMissing,
    Unreachable,
    freeze_worker_heap,
    log_offsets,
    read_batches,
)
from spark_bridge.log_options import EARLIEST, LATEST, Bound, LogOptions, Offsets, log_options
from spark_bridge.stream_options import StreamOptionError

__all__ = ["DataLossError", "LogBatchReader", "LogRange", "LogSourceError", "LogStreamReader", "plan_ranges",
           "read_range", "share_limit"]

logger = logging.getLogger("mqd.spark")

# A piece of a range smaller than this costs Spark more as a task than it saves.
MIN_RECORDS_PER_PARTITION = 2_000
# How long an executor keeps trying a broker that cannot be reached before its task fails.
UNREACHABLE_FOR = 60.0


class LogSourceError(RuntimeError):
    """The read cannot go on: a broker refused or is not an mqd with the topic's log (a one-line message)."""


class DataLossError(LogSourceError):
    """Records went before the query read them, and `failOnDataLoss` is true."""


class LogRange(InputPartition):
    """Offsets [start, end) of one broker's log of `topic`, in its life `epoch`: one Spark task's read."""

    def __init__(self, broker: BrokerLog, topic: str, start: int, end: int, epoch: int,
                 fail_on_data_loss: bool, max_bytes: int) -> None:
        self.broker = broker
        self.topic = topic
        self.start = start
        self.end = end
        self.epoch = epoch
        self.fail_on_data_loss = fail_on_data_loss
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"LogRange({self.broker.nsqd} {self.topic} [{self.start}, {self.end}) epoch {self.epoch})"


def _lost(fail: bool, text: str) -> None:
    if fail:
        raise DataLossError(f"mqd: {text}; set option failOnDataLoss=false to go on without them")
    logger.warning("mqd: %s; going on (failOnDataLoss=false)", text)


def read_range(part: LogRange) -> Iterator[pa.RecordBatch]:
    """Every record of the range the broker still keeps, as Arrow batches (on an executor).

    A broker that cannot be reached is tried again for UNREACHABLE_FOR
    seconds, from the first record not yet given (a restarted broker keeps
    what it acknowledged, and Spark runs the task once more if it fails).
    """
    freeze_worker_heap()
    at = part.start
    failing_since: float | None = None
    where = f"topic {part.topic} on nsqd {part.broker.nsqd}"
    while at < part.end:
        try:
            for batch in read_batches(part.broker, part.topic, at, part.end, epoch=part.epoch,
                                      max_bytes=part.max_bytes):
                if batch.num_rows:
                    yield batch
                    at = batch.column(batch.num_columns - 1)[-1].as_py() + 1
                    failing_since = None
            return
        except OffsetOutOfRange as e:
            if e.earliest > at:
                _lost(part.fail_on_data_loss, f"records {at}-{min(e.earliest, part.end) - 1} of {where} "
                                              f"expired before they were read (its earliest is now {e.earliest})")
                at = e.earliest
                continue
            _lost(part.fail_on_data_loss, f"records {max(at, e.latest)}-{part.end - 1} of {where} are gone "
                                          f"(the broker's latest is now {e.latest}: it lost what it had not synced)")
            return
        except EpochChanged as e:
            _lost(part.fail_on_data_loss, f"the log of {where} was recreated (epoch {e.expected} -> {e.found}): "
                                          f"records {at}-{part.end - 1} of the old one were not read")
            return
        except Unreachable:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
            if now - failing_since > UNREACHABLE_FOR:
                raise
            time.sleep(0.5)


def share_limit(waiting: dict[Any, int], most: int) -> dict[Any, int]:
    """How many of `most` records each log gets, in proportion to what it has waiting (all when they fit).

    Every log with records waiting gets one first while `most` allows (the
    ones with most waiting first), so a small log is never starved by a
    big one; the rest goes in proportion to what is left waiting.
    """
    total = sum(waiting.values())
    if total <= most:
        return dict(waiting)
    share = dict.fromkeys(waiting, 0)
    for key in sorted((k for k, n in waiting.items() if n), key=lambda k: waiting[k], reverse=True)[:most]:
        share[key] = 1
    left = most - sum(share.values())
    if left > 0:
        rest = {key: n - share[key] for key, n in waiting.items()}
        rest_total = sum(rest.values())
        for key, n in rest.items():
            share[key] += n * left // rest_total
        left = most - sum(share.values())
        for key in sorted(waiting, key=lambda k: waiting[k] - share[k], reverse=True)[:left]:
            share[key] += 1
    return share


def plan_ranges(ranges: Sequence[tuple[BrokerLog, str, int, int, int]], min_partitions: int,
                fail_on_data_loss: bool, max_bytes: int) -> list[LogRange]:
    """The ranges (broker, topic, start, end, epoch), each cut into pieces until there are `min_partitions`.

    A range gets pieces in proportion to its length, none shorter than
    MIN_RECORDS_PER_PARTITION (unless the range itself is).
    """
    total = sum(end - start for _, _, start, end, _ in ranges)
    out: list[LogRange] = []
    for broker, topic, start, end, epoch in ranges:
        n = end - start
        if n <= 0:
            continue
        pieces = 1
        if len(ranges) < min_partitions and total:
            pieces = max(1, min(math.ceil(n * min_partitions / total), n // MIN_RECORDS_PER_PARTITION))
        step = math.ceil(n / pieces)
        for at in range(start, end, step):
            out.append(LogRange(broker, topic, at, min(end, at + step), epoch, fail_on_data_loss, max_bytes))
    return out


class _Logs:
    """The driver's view of the logs: each broker's offsets now, and the ranges between two offsets."""

    def __init__(self, options: LogOptions) -> None:
        self.options = options
        self.brokers = LogBrokers(options)
        self._away: set[str] = set()  # brokers (or "lookupd") found away and not answering since

    def now(self, topic: str, *, strict: bool, timestamp_ms: int | None = None
            ) -> dict[str, tuple[BrokerLog, LogOffsets | None]]:
        """Each broker's log of `topic` now (None: the broker cannot be asked or lacks the topic).

        `strict` (a read starting): a broker that cannot be asked, or no
        broker having the topic, fails the read with one line; later a
        broker away is only skipped this time.
        """
        try:
            brokers, away = self.brokers.find(topic)
        except BrokerError as e:
            if strict:
                raise LogSourceError(str(e)) from None
            self._skip("lookupd", str(e))
            return {}
        self._back("lookupd")
        for name, reason in away.items():
            if strict:
                raise LogSourceError(reason)
            self._skip(name, reason)
        out: dict[str, tuple[BrokerLog, LogOffsets | None]] = {}
        missing = []
        for name, broker in brokers.items():
            try:
                out[name] = (broker, log_offsets(broker, topic, timestamp_ms))
                self._back(name)
            except RetentionOff as e:
                raise LogSourceError(
                    f"{e}: reading by offset needs it (or give a channel to consume the topic)") from None
            except TopicMissing:
                missing.append(name)
                out[name] = (broker, None)
            except Unreachable as e:
                if strict:
                    raise LogSourceError(str(e)) from None
                self._skip(name, str(e))
                out[name] = (broker, None)
                self.brokers.forget(name)
            except LogFetchError as e:
                raise LogSourceError(str(e)) from None
        if strict and (not brokers or len(missing) == len(brokers)):
            where = (f"nsqd {', '.join(self.options.nsqd)}" if self.options.nsqd
                     else f"the brokers lookupd {', '.join(self.options.lookupd)} lists")
            raise LogSourceError(f"mqd: topic {topic!r} does not exist on {where}")
        return out

    def _skip(self, name: str, reason: str) -> None:
        """A broker (or the lookupds) that cannot be asked now: said once, not at every trigger, until it answers."""
        if name not in self._away:
            self._away.add(name)
            logger.warning("%s; the read goes on without it until it answers again", reason)

    def _back(self, name: str) -> None:
        if name in self._away:
            self._away.discard(name)
            logger.warning("mqd: %s answers again", name if name == "lookupd" else f"nsqd {name}")

    def bound(self, bound: Bound, *, strict: bool) -> Offsets:
        """`startingOffsets`/`endingOffsets` (or the timestamps) made offsets: topic -> broker -> epoch, offset."""
        out: Offsets = {}
        for topic in self.options.topics:
            logs = self.now(topic, strict=strict, timestamp_ms=bound.timestamp_ms)
            given = (bound.offsets or {}).get(topic) if bound.kind == "offsets" else None
            if given is not None:
                unknown = sorted(set(given) - set(logs))
                if unknown:
                    raise StreamOptionError(
                        f"mqd: offsets JSON names broker {unknown[0]!r} for topic {topic!r}, which is not one "
                        f"of its brokers ({', '.join(sorted(logs)) or 'none'})")
            entries: dict[str, dict[str, int]] = {}
            for name, (_broker, offs) in logs.items():
                if offs is None:
                    continue
                if bound.kind == "earliest":
                    offset = offs.earliest
                elif bound.kind == "latest":
                    offset = offs.latest
                elif bound.kind == "timestamp":
                    offset = offs.latest if offs.offset_for_timestamp is None else offs.offset_for_timestamp
                else:
                    if given is None or name not in given:
                        raise StreamOptionError(
                            f"mqd: offsets JSON gives no offset for broker {name!r} of topic {topic!r}: "
                            "give every broker (-2 = earliest, -1 = latest)")
                    offset, epoch = given[name]
                    if epoch is not None and epoch != offs.epoch:
                        _lost(self.options.fail_on_data_loss,
                              f"the log of topic {topic} on nsqd {name} is not the one the offsets name "
                              f"(epoch {epoch}, now {offs.epoch})")
                        offset = EARLIEST
                    if offset == EARLIEST:
                        offset = offs.earliest
                    elif offset == LATEST:
                        offset = offs.latest
                    elif offset > offs.latest:
                        raise StreamOptionError(
                            f"mqd: offsets JSON: offset {offset} of topic {topic!r} on {name} is past its latest "
                            f"({offs.latest})")
                entries[name] = {"epoch": offs.epoch, "offset": offset}
            out[topic] = entries
        return out

    def broker(self, topic: str, name: str) -> BrokerLog | None:
        """The broker named `name`, to read a planned range from (None: gone, no longer a broker of the topic).

        Known since the offsets were asked, as a rule. A batch planned
        before the driver restarted names brokers not asked yet: one that
        cannot be asked now (its address given, or listed by a lookupd) is
        waited for as executors wait, UNREACHABLE_FOR seconds, since its
        range is not lost but away.
        """
        deadline = time.monotonic() + UNREACHABLE_FOR
        while True:
            known = self.brokers.known(name)
            if known is not None:
                return known
            try:
                found, away = self.brokers.find(topic)
            except BrokerError as e:
                found, away = {}, {name: str(e)}
            if name in found:
                return found[name]
            if name not in away:
                return None
            if time.monotonic() > deadline:
                raise LogSourceError(f"{away[name]} (for {UNREACHABLE_FOR:g}s)")
            time.sleep(1.0)

    def ranges(self, start: Offsets, end: Offsets) -> list[tuple[BrokerLog, str, int, int, int]]:
        """Every (broker, topic) range from `start` to `end` in the same log life."""
        out = []
        for topic, brokers in end.items():
            for name, e in brokers.items():
                s = start.get(topic, {}).get(name)
                if s is None or s["epoch"] != e["epoch"] or e["offset"] <= s["offset"]:
                    continue
                broker = self.broker(topic, name)
                if broker is None:
                    _lost(self.options.fail_on_data_loss,
                          f"records {s['offset']}-{e['offset'] - 1} of topic {topic} on nsqd {name} cannot be "
                          "read: the broker is gone")
                    continue
                out.append((broker, topic, s["offset"], e["offset"], e["epoch"]))
        return out

    def partitions(self, start: Offsets, end: Offsets) -> list[LogRange]:
        o = self.options
        return plan_ranges(self.ranges(start, end), o.min_partitions, o.fail_on_data_loss, o.max_bytes_per_request)


class LogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """`spark.readStream.format("mqd")` without a channel: the topics' logs by offset (see the module)."""

    def __init__(self, options: Any) -> None:
        self.options = log_options(options, batch=False)
        self._logs = _Logs(self.options)
        self._until: Offsets | None = None  # Trigger.AvailableNow: the latest offsets when it began
        self._seen: Offsets = {}  # each log's latest offset at the last trigger, for the query's progress

    def __getstate__(self) -> dict[str, Any]:
        # Executors only call read(): they need nothing of the driver's state.
        return {"options": None, "_logs": None, "_until": None, "_seen": None}

    def initialOffset(self) -> dict:
        return self._logs.bound(self.options.starting, strict=True)

    def getDefaultReadLimit(self) -> ReadLimit:
        most = self.options.max_offsets_per_trigger
        return ReadMaxRows(most) if most else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._until = self._logs.bound(Bound("latest"), strict=False)

    def latestOffset(self, start: dict, limit: ReadLimit | None = None) -> dict:
        end: Offsets = {}
        # Per (topic, broker) log read on: the first offset it still keeps and how many wait after it.
        first: dict[tuple[str, str], int] = {}
        waiting: dict[tuple[str, str], int] = {}
        fail = self.options.fail_on_data_loss
        seen: Offsets = {}
        for topic in self.options.topics:
            before = start.get(topic, {})
            entries = {name: dict(entry) for name, entry in before.items()}
            for name, (_broker, offs) in self._logs.now(topic, strict=False).items():
                s = before.get(name)
                if offs is None:
                    continue
                seen.setdefault(topic, {})[name] = {"epoch": offs.epoch, "offset": offs.latest}
                if s is None:
                    # New to the query: read from its earliest record, from the next batch on.
                    entries[name] = {"epoch": offs.epoch, "offset": offs.earliest}
                    continue
                if s["epoch"] != offs.epoch:
                    _lost(fail, f"the log of topic {topic} on nsqd {name} was recreated (epoch {s['epoch']} -> "
                                f"{offs.epoch}): records from offset {s['offset']} of the old one were not read")
                    entries[name] = {"epoch": offs.epoch, "offset": offs.earliest}
                    continue
                if s["offset"] > offs.latest:
                    # As Kafka's source when a partition's offset goes back: what the query read past the log's
                    # end is gone from the broker, and the offsets it had are given to new records from now on.
                    _lost(fail, f"the log of topic {topic} on nsqd {name} now ends at offset {offs.latest}, before "
                                f"offset {s['offset']} the query had read to: the broker lost records it had not "
                                f"synced (their offsets go to new records, read from {offs.latest} on)")
                    entries[name] = {"epoch": offs.epoch, "offset": offs.latest}
                    continue
                if s["offset"] < offs.earliest:
                    _lost(fail, f"records {s['offset']}-{offs.earliest - 1} of topic {topic} on nsqd {name} "
                                "expired before they were read")
                latest = offs.latest
                if self._until is not None:
                    cap = self._until.get(topic, {}).get(name)
                    latest = min(latest, cap["offset"]) if cap is not None and cap["epoch"] == offs.epoch else 0
                key = (topic, name)
                first[key] = max(s["offset"], offs.earliest)
                waiting[key] = max(0, latest - first[key])
            end[topic] = entries
        self._seen = seen
        most = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        for (topic, name), n in (share_limit(waiting, most) if most is not None else waiting).items():
            if n > 0:
                end[topic][name]["offset"] = first[(topic, name)] + n
        return end

    def reportLatestOffset(self) -> dict | None:
        """Each log's latest offset as the last trigger found it: the query's progress shows how far behind it is."""
        return self._seen or None

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return self._logs.partitions(start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, LogRange)
        yield from read_range(partition)

    def commit(self, end: dict) -> None:
        """Nothing to do: Spark keeps the offsets, and the brokers keep the records for their retention."""


class LogBatchReader(DataSourceReader):
    """`spark.read.format("mqd")` with a topic: the records between two bounds, read as the stream reads them."""

    def __init__(self, options: Any) -> None:
        self.options = log_options(options, batch=True)

    def partitions(self) -> Sequence[InputPartition]:
        logs = _Logs(self.options)
        start = logs.bound(self.options.starting, strict=True)
        end = logs.bound(self.options.ending, strict=True)
        for topic, brokers in end.items():
            for name, e in brokers.items():
                s = start.get(topic, {}).get(name)
                if s is not None and s["epoch"] == e["epoch"] and e["offset"] < s["offset"]:
                    raise StreamOptionError(
                        f"mqd: the ending bound is before the starting one for topic {topic!r} on {name} "
                        f"({e['offset']} < {s['offset']})")
        return logs.partitions(start, end) or [LogRange(_NOWHERE, "", 0, 0, 0, True, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, LogRange)
        yield from read_range(partition)


# An empty range: Spark wants at least one partition even for an empty read.
_NOWHERE = BrokerLog(nsqd="", http="")
