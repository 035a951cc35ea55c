"""The streaming source's write-ahead log: one file per micro-batch, under the query's checkpoint.

Before Spark reads a micro-batch, the source writes every message of it to
`<checkpointLocation>/mqd-source/batch-<start>-<end>.wal` (written to a
temporary name, fsynced, renamed, directory fsynced), so a restarted query
replays an unfinished batch with exactly the same rows, whatever the broker
redelivers in the meantime. Offsets are message counts: batch
`(start, end]` holds messages `start+1 .. end` of this query.

A file is laid out in columns, so that the Spark tasks that turn it into
Arrow record batches never loop over messages in Python:

    MQDWAL01                       magic
    u32 length, header JSON        topic, channel, start, end, brokers
    count x 28-byte records        broker index (u16), timestamp ns (i64),
                                   attempts (u16), message id (16 bytes),
                                   all big-endian as on NSQ's wire
    (count + 1) x u64 offsets      where each body starts in the bodies
    bodies                         concatenated
    u32 CRC-32 of all the above, then MQDWALEND

`committed` (a JSON file beside them, replaced atomically) holds the
highest offset Spark has committed, and `source.json` the topic and
channel the checkpoint belongs to: a checkpoint is never read for another.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import numpy as np

__all__ = [
    "RECORD_DTYPE",
    "WalBatch",
    "WalDirectory",
    "WalError",
    "encode_batch",
    "foreign_checkpoint",
    "lost_offsets",
]

MAGIC = b"MQDWAL01"
END = b"MQDWALEND"
DIRECTORY = "mqd-source"
RECORD_DTYPE = np.dtype([("broker", ">u2"), ("timestamp", ">i8"), ("attempts", ">u2"), ("id", "S16")])
_U32 = struct.Struct(">I")
_NAME = re.compile(r"^batch-(\d{20})-(\d{20})\.wal$")


class WalError(RuntimeError):
    """The write-ahead log is missing a batch, damaged, or belongs to another topic/channel."""


def foreign_checkpoint(checkpoint: object, theirs: dict, topic: str, channel: str) -> WalError:
    """The error for a checkpoint written by a query on another topic or channel."""
    return WalError(
        f"mqd: checkpoint {checkpoint} belongs to topic {theirs.get('topic')!r} channel "
        f"{theirs.get('channel')!r}, not topic {topic!r} channel {channel!r}: "
        "give this query its own checkpointLocation")


def lost_offsets(path: object, lo: int, hi: int) -> WalError:
    """The error for offsets the query's checkpoint has read and the write-ahead log does not hold.

    That happens when `mqd-source/` was deleted or replaced while the rest
    of the checkpoint was kept. The source stops rather than carry on by
    itself: those batches can no longer be replayed with the rows they
    had, and offsets it handed out again would not match Spark's. Starting
    afresh is the operator's choice, made with a new checkpointLocation.
    """
    return WalError(
        f"mqd: the write-ahead log under {path} does not hold offsets {lo}-{hi}, which the "
        "query's checkpoint has already read: its mqd-source directory was lost or altered "
        "since, so those batches cannot be replayed as they were. To start afresh on purpose, "
        "run the query with a new checkpointLocation (messages not yet FINished are delivered "
        "again; rows the sink already has may appear twice)")


@dataclass(frozen=True)
class WalBatch:
    """One micro-batch's messages, decoded from (or about to be encoded to) a WAL file."""

    topic: str
    channel: str
    start: int
    end: int
    brokers: tuple[str, ...]
    records: np.ndarray  # RECORD_DTYPE, one per message
    body_offsets: np.ndarray  # uint64, len(records) + 1
    bodies: bytes

    def __len__(self) -> int:
        return len(self.records)

    def keys(self) -> list[tuple[str, bytes]]:
        """(broker address, message id) of each message, in order."""
        brokers = self.brokers
        return [(brokers[b], i) for b, i in zip(self.records["broker"].tolist(),
                                                  self.records["id"].tolist(), strict=True)]

    def slice(self, lo: int, hi: int) -> tuple:
        """Messages lo..hi-1 as a picklable tuple, what a Spark task turns into rows (`to_arrow`)."""
        first, last = int(self.body_offsets[lo]), int(self.body_offsets[hi])
        return (self.topic, self.channel, self.brokers, self.records[lo:hi].tobytes(),
                (self.body_offsets[lo:hi + 1] - first).astype("<i8").tobytes(),
                self.bodies[first:last])


def encode_batch(topic: str, channel: str, start: int, messages: Sequence) -> bytes:
    """A WAL file's bytes for `messages` (objects with nsqd_address, timestamp, attempts, id, body).

    Each field is gathered for all messages at once (attrgetter, numpy):
    a loop over messages in Python cost ~3 us each, this ~0.5.
    """
    n = len(messages)
    addresses = list(map(attrgetter("nsqd_address"), messages))
    brokers = list(dict.fromkeys(addresses))
    records = np.empty(n, RECORD_DTYPE)
    if len(brokers) == 1:
        records["broker"] = 0
    else:
        index = {address: i for i, address in enumerate(brokers)}
        records["broker"] = np.fromiter(map(index.__getitem__, addresses), "<u2", n)
    records["timestamp"] = np.fromiter(map(attrgetter("timestamp"), messages), "<i8", n)
    records["attempts"] = np.fromiter(map(attrgetter("attempts"), messages), "<u2", n)
    records["id"] = np.frombuffer(b"".join(map(attrgetter("id"), messages)), "S16", n)
    bodies = list(map(attrgetter("body"), messages))
    offsets = np.zeros(n + 1, "<u8")
    np.cumsum(np.fromiter(map(len, bodies), "<u8", n), out=offsets[1:])
    header = json.dumps({"topic": topic, "channel": channel, "start": start,
                         "end": start + n, "brokers": brokers}).encode()
    out = bytearray(MAGIC)
    out += _U32.pack(len(header))
    out += header
    out += records.tobytes()
    out += offsets.tobytes()
    out += b"".join(bodies)
    out += _U32.pack(zlib.crc32(out))
    out += END
    return bytes(out)


def decode_batch(data: bytes, where: str = "WAL file") -> WalBatch:
    """The batch in a WAL file's bytes; WalError if it is not one, or damaged."""
    tail = 4 + len(END)
    if len(data) < len(MAGIC) + 4 + tail or not data.startswith(MAGIC) or not data.endswith(END):
        raise WalError(f"mqd: {where} is not a complete write-ahead batch")
    (crc,) = _U32.unpack_from(data, len(data) - tail)
    if zlib.crc32(memoryview(data)[:len(data) - tail]) != crc:
        raise WalError(f"mqd: {where} is damaged (checksum mismatch)")
    try:
        (length,) = _U32.unpack_from(data, len(MAGIC))
        at = len(MAGIC) + 4
        header = json.loads(data[at:at + length])
        at += length
        count = header["end"] - header["start"]
        records = np.frombuffer(data, RECORD_DTYPE, count, at)
        at += count * RECORD_DTYPE.itemsize
        offsets = np.frombuffer(data, "<u8", count + 1, at)
        at += (count + 1) * 8
        bodies = data[at:at + int(offsets[-1])]
        return WalBatch(header["topic"], header["channel"], header["start"], header["end"],
                        tuple(header["brokers"]), records, offsets, bodies)
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        # A checksum that matches a header that does not: written by something else.
        raise WalError(f"mqd: {where} is not a write-ahead batch this version can read ({e})") from None


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _fsync_directory(path.parent)


class WalDirectory:
    """The WAL files of one query's source: `<checkpointLocation>/mqd-source/`."""

    def __init__(self, checkpoint: str | os.PathLike, topic: str, channel: str) -> None:
        self.path = Path(checkpoint) / DIRECTORY
        self.topic = topic
        self.channel = channel
        self.path.mkdir(parents=True, exist_ok=True)
        identity = self.path / "source.json"
        mine = {"topic": topic, "channel": channel}
        try:
            theirs = json.loads(identity.read_bytes())
        except FileNotFoundError:
            _write_atomically(identity, json.dumps(mine).encode())
            theirs = mine
        except ValueError:
            raise WalError(f"mqd: {identity} is damaged") from None
        if theirs != mine:
            raise foreign_checkpoint(checkpoint, theirs, topic, channel)
        for stale in self.path.glob(".*.tmp"):  # a write cut short by a crash
            stale.unlink(missing_ok=True)

    def _file(self, start: int, end: int) -> Path:
        return self.path / f"batch-{start:020d}-{end:020d}.wal"

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of every batch file, in order."""
        found = []
        for entry in os.listdir(self.path):
            m = _NAME.match(entry)
            if m:
                found.append((int(m.group(1)), int(m.group(2))))
        return sorted(found)

    def write(self, start: int, messages: Sequence) -> int:
        """Write a batch of `messages` after offset `start`, durably; its end offset."""
        end = start + len(messages)
        _write_atomically(self._file(start, end),
                          encode_batch(self.topic, self.channel, start, messages))
        return end

    def read(self, start: int, end: int) -> WalBatch:
        path = self._file(start, end)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise WalError(
                f"mqd: the write-ahead log has no batch {start}-{end} under {self.path} "
                "(the checkpoint's mqd-source directory was lost or altered)") from None
        batch = decode_batch(data, str(path))
        if (batch.topic, batch.channel, batch.start, batch.end) != (self.topic, self.channel, start, end):
            raise WalError(f"mqd: {path} does not hold batch {start}-{end} of this topic/channel")
        return batch

    def remove(self, start: int, end: int) -> None:
        self._file(start, end).unlink(missing_ok=True)

    def committed(self) -> int:
        """The highest offset recorded as committed by Spark (0 if none)."""
        try:
            return int(json.loads((self.path / "committed").read_bytes())["offset"])
        except FileNotFoundError:
            return 0
        except (ValueError, KeyError, TypeError):
            raise WalError(f"mqd: {self.path / 'committed'} is damaged") from None

    def set_committed(self, offset: int) -> None:
        _write_atomically(self.path / "committed", json.dumps({"offset": offset}).encode())
