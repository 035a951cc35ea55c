"""The options of the `mqd` format's offset mode, and the offsets Spark keeps for it.

Offset mode reads topics' retained logs by offset (docs: the retained
log), as Spark's Kafka source reads partitions: it is chosen when a read
names a topic and no `channel`. A (broker, topic) log plays the part of a
Kafka partition; a broker is named by its TCP address `host:port`, the
name rows carry in their `nsqd` column.

The offsets Spark stores in its checkpoint (and `startingOffsets`'s JSON)
are one object per topic, one entry per broker:

    {"events": {"10.0.0.5:4150": {"epoch": 812..., "offset": 1200}}}

`offset` is the next record to read; `epoch` names the life of the log it
counts in (a topic deleted and created again starts a new log with a new
epoch, whose offsets start again). In `startingOffsets` an entry may be a
bare number instead, -2 for the log's earliest record and -1 for its
latest, as Kafka's JSON has them, and the epoch may be left out.

Every problem is one `StreamOptionError` line naming the option.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spark_bridge.stream_options import (
    StreamOptionError,
    addresses,
    client_config,
    option_int,
    topic_name,
)

__all__ = ["EARLIEST", "LATEST", "Bound", "LogOptions", "log_options", "parse_offsets_json"]

# A bound's offset when it means the log's earliest or latest record (Kafka's numbers).
EARLIEST = -2
LATEST = -1

# Offsets: topic -> broker -> {"epoch": int, "offset": int}.
Offsets = dict[str, dict[str, dict[str, int]]]


@dataclass(frozen=True)
class Bound:
    """Where a read starts or ends: "earliest", "latest", a time (ms since the epoch), or offsets per broker.

    `offsets`: topic -> broker -> (offset or EARLIEST/LATEST, epoch or None).
    """

    kind: str  # "earliest", "latest", "timestamp" or "offsets"
    timestamp_ms: int | None = None
    offsets: Mapping[str, Mapping[str, tuple[int, int | None]]] | None = None


@dataclass(frozen=True)
class LogOptions:
    """The offset mode's options, checked; the source's and the batch read's alike."""

    topics: tuple[str, ...]
    nsqd: tuple[str, ...]
    lookupd: tuple[str, ...]
    starting: Bound
    ending: Bound
    max_offsets_per_trigger: int | None
    min_partitions: int
    fail_on_data_loss: bool
    secret: str | None
    tls: bool
    tls_root_ca_file: str | None
    tls_cert: str | None
    tls_key: str | None
    tls_insecure_skip_verify: bool
    max_bytes_per_request: int
    config: Any  # the txnsq Config the brokers' IDENTIFY is made with (TLS, AUTH, timeouts)


def _get(options: Mapping[str, str], name: str) -> str | None:
    value = options.get(name)
    if value is None:
        value = options.get(name.lower())
    return None if value is None else str(value)


def _topics(options: Mapping[str, str]) -> tuple[str, ...]:
    one = _get(options, "topic")
    many = _get(options, "topics")
    if one and many:
        raise StreamOptionError("mqd: give option topic or topics, not both")
    if many:
        names = tuple(dict.fromkeys(part.strip() for part in many.split(",") if part.strip()))
        if not names:
            raise StreamOptionError("mqd: option topics names no topic")
        return tuple(topic_name({"topics": name}, "topics") for name in names)
    return (topic_name(options, "topic"),)


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    text = _get(options, name)
    if text is None or text.strip() == "":
        return default
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise StreamOptionError(f"mqd: option {name}: {text!r} is not true or false")


def _timestamp(options: Mapping[str, str], name: str) -> int | None:
    text = _get(options, name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise StreamOptionError(
            f"mqd: option {name}: {text!r} is not a time in milliseconds since the Unix epoch") from None
    if value < 0:
        raise StreamOptionError(f"mqd: option {name} must not be negative, got {value}")
    return value


def parse_offsets_json(name: str, text: str, topics: tuple[str, ...]) -> Bound:
    """`startingOffsets` / `endingOffsets` given as JSON: topic -> broker -> offset or {"offset", "epoch"}."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise StreamOptionError(f"mqd: option {name}: malformed JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(document, dict) or not document:
        raise StreamOptionError(
            f'mqd: option {name}: expected {{"topic": {{"host:port": offset}}}}, got {text[:80]!r}')
    out: dict[str, dict[str, tuple[int, int | None]]] = {}
    for topic, brokers in document.items():
        if topic not in topics:
            raise StreamOptionError(f"mqd: option {name} names topic {topic!r}, which the query does not read")
        if not isinstance(brokers, dict) or not brokers:
            raise StreamOptionError(f"mqd: option {name}: topic {topic!r} must map brokers (host:port) to offsets")
        entries: dict[str, tuple[int, int | None]] = {}
        for broker, entry in brokers.items():
            epoch: Any = None
            offset: Any = entry
            if isinstance(entry, dict):
                offset, epoch = entry.get("offset"), entry.get("epoch")
            if (not isinstance(offset, int) or isinstance(offset, bool) or offset < EARLIEST
                    or (epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)))):
                raise StreamOptionError(
                    f"mqd: option {name}: topic {topic!r} broker {broker!r}: {entry!r} is not an offset "
                    "(a whole number, -2 = earliest, -1 = latest, or {\"offset\": N, \"epoch\": E})")
            host, _, port = str(broker).rpartition(":")
            if not host or not port.isdigit():
                raise StreamOptionError(f"mqd: option {name}: {broker!r} is not a broker's host:port")
            entries[str(broker)] = (offset, epoch)
        out[topic] = entries
    return Bound("offsets", offsets=out)


def _bound(options: Mapping[str, str], prefix: str, topics: tuple[str, ...], default: str,
           allowed: tuple[str, ...]) -> Bound:
    stamp = _timestamp(options, f"{prefix}Timestamp")
    if stamp is not None:
        # As Kafka's: a timestamp takes precedence over the offsets option.
        return Bound("timestamp", timestamp_ms=stamp)
    name = f"{prefix}Offsets"
    text = (_get(options, name) or default).strip()
    if text.startswith("{"):
        return parse_offsets_json(name, text, topics)
    if text.lower() not in allowed:
        raise StreamOptionError(f"mqd: option {name}: {text!r} is not {' or '.join(allowed)} or offsets JSON")
    return Bound(text.lower())


def _refuse_offset(bound: Bound, name: str, offset: int, meaning: str) -> None:
    for topic, brokers in (bound.offsets or {}).items():
        for broker, (at, _epoch) in brokers.items():
            if at == offset:
                raise StreamOptionError(f"mqd: option {name}: {offset} ({meaning}) is not allowed in a batch read "
                                        f"(topic {topic!r} broker {broker!r})")


def log_options(options: Mapping[str, str], *, batch: bool) -> LogOptions:
    """The offset mode's options out of Spark's; `batch`: a `spark.read` (default from earliest, an end)."""
    topics = _topics(options)
    nsqd, lookupd = addresses(options)
    starting = _bound(options, "starting", topics, "earliest" if batch else "latest",
                      ("earliest",) if batch else ("earliest", "latest"))
    if batch:
        ending = _bound(options, "ending", topics, "latest", ("latest",))
        # As Kafka's batch reads: never from the latest offsets (nothing) nor up to the earliest.
        _refuse_offset(starting, "startingOffsets", LATEST, "latest")
        _refuse_offset(ending, "endingOffsets", EARLIEST, "earliest")
    else:
        for name in ("endingOffsets", "endingTimestamp"):
            if _get(options, name):
                raise StreamOptionError(f"mqd: option {name} is for batch reads (spark.read), not streams")
        ending = Bound("latest")
    most = _get(options, "maxOffsetsPerTrigger")
    config = client_config(options)
    return LogOptions(
        topics=topics, nsqd=nsqd, lookupd=lookupd, starting=starting, ending=ending,
        max_offsets_per_trigger=option_int(options, "maxOffsetsPerTrigger", 0) if most else None,
        min_partitions=option_int(options, "minPartitions", os.cpu_count() or 1),
        fail_on_data_loss=_bool(options, "failOnDataLoss", True),
        secret=config.auth_secret or None,
        tls=bool(config.tls_v1),
        tls_root_ca_file=config.tls_root_ca_file or None,
        tls_cert=config.tls_cert or None,
        tls_key=config.tls_key or None,
        tls_insecure_skip_verify=bool(config.tls_insecure_skip_verify),
        max_bytes_per_request=option_int(options, "maxBytesPerRequest", 16 << 20, minimum=1024),
        config=config,
    )
