"""A retained log's batch as the LMDB store keeps it: one record for what one append gave.

A batch (backends.retained_index) is staged and stored as one pseudo
message, whose timestamp is the batch's largest (so it is the stored
record's RECORD_HEAD timestamp) and whose data is:

    [4-byte record count n, uint32][1-byte kind: 0 = every record has
        the batch's timestamp (a publish's do), 1 = each its own]
    kind 1 only: n 8-byte timestamps (int64, ns)
    n 4-byte lengths of the records' data (uint32)
    the records' data (id and body), one after the other

Offsets are not stored: the record's key holds the first, and the rest
follow, so a batch given other offsets (a failed commit's gap closed) is
only keyed again. Building it is one struct call for the lengths and
one join (a publish held as a run gives its list of data as it is): measured 2.5 times cheaper per message
than building each record's wire frame (mqd.wire.log_frames) at append,
which is what publishing with retention on paid most for; the frames
are built when read instead (one struct call per record), still
millions of records a second. A record costs 4 bytes besides its data
(and 8 more for its own timestamp), against 22 for a stored frame.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

from backends.lmdb_records import KEY, QID, RECORD_HEAD
from backends.retained_index import Stamps
from mqd.message import Message
from mqd.wire.log_frames import FRAME_HEAD, FRAME_OVERHEAD

__all__ = ["BATCH_HEAD", "BatchView", "FrameReader", "FrameSizes", "HeadCut", "RecordReader", "frames_size", "make_batch",
           "seek_batch", "stored_count"]

BATCH_HEAD = struct.Struct(">IB")
_HEAD = BATCH_HEAD.size
# A stored value: RECORD_HEAD (the batch's largest timestamp, attempts and deferral 0), then the data.
_VALUE_HEAD = RECORD_HEAD.size
# What a frame's size field counts besides the id and body.
_SIZED = FRAME_OVERHEAD - 4


def make_batch(datas: Sequence[bytes], stamps: Stamps) -> Message:
    """The pseudo message of a batch: its records' data and timestamps (backends.retained_index) in one bytes object."""
    n = len(datas)
    if isinstance(stamps, int):
        top = stamps
        parts = [BATCH_HEAD.pack(n, 0), struct.pack(f">{n}I", *map(len, datas)), *datas]
    else:
        top = max(stamps)
        parts = [BATCH_HEAD.pack(n, 1), struct.pack(f">{n}q", *stamps), struct.pack(f">{n}I", *map(len, datas)),
                 *datas]
    return Message.of(b"".join(parts), top)


def stored_count(data: bytes | memoryview) -> int:
    """How many records a batch's data holds."""
    count: int = BATCH_HEAD.unpack_from(data)[0]
    return count


def frames_size(data: bytes | memoryview) -> int:
    """The bytes of a batch's records as frames (what `retained_bytes` counts), from its data's length alone."""
    n, kind = BATCH_HEAD.unpack_from(data)
    return len(data) - _HEAD - (12 if kind else 4) * n + FRAME_OVERHEAD * n


def seek_batch(cursor: Any, qid: int, offset: int) -> bool:
    """Put `cursor` on log `qid`'s batch holding `offset`, else its first batch after it; False if it has none.

    Batches are keyed by their first offset: `set_range`, and one step
    back when it lands past `offset`.
    """
    key = KEY.pack(qid, offset)
    prefix = QID.pack(qid)
    if cursor.set_range(key):
        if bytes(cursor.key()) == key:
            return True
        back = cursor.prev()
    else:
        back = cursor.last()
    if back and bytes(cursor.key()[:4]) == prefix:
        if KEY.unpack(cursor.key())[1] + stored_count(cursor.value()[_VALUE_HEAD:]) > offset:
            return True
        return bool(cursor.next()) and bytes(cursor.key()[:4]) == prefix
    return bool(cursor.set_range(key)) and bytes(cursor.key()[:4]) == prefix


class BatchView:
    """A batch's records read in place: `data` is its data (a stored value's view, or a staged batch's bytes)."""

    __slots__ = ("first", "count", "top", "stamps", "lengths", "data", "start")

    def __init__(self, first: int, top: int, data: bytes | memoryview) -> None:
        n, kind = BATCH_HEAD.unpack_from(data)
        pos = _HEAD
        self.first = first
        self.count = n
        self.top = top
        # Each record's timestamp, or None: every one is `top`.
        self.stamps: tuple[int, ...] | None = None
        if kind:
            self.stamps = struct.unpack_from(f">{n}q", data, pos)
            pos += 8 * n
        self.lengths: tuple[int, ...] = struct.unpack_from(f">{n}I", data, pos)
        self.data = data
        # Where record 0's data starts.
        self.start = pos + 4 * n

    @property
    def end(self) -> int:
        """The offset after the batch's last record."""
        return self.first + self.count

    def timestamp(self, k: int) -> int:
        """Record `k`'s timestamp."""
        return self.top if self.stamps is None else self.stamps[k]

    def position(self, k: int) -> int:
        """Where record `k`'s data starts in `data`."""
        return self.start + sum(self.lengths[:k]) if k else self.start

    def frames_size(self, k: int) -> int:
        """The bytes of records `k` on as frames."""
        return sum(self.lengths[k:]) + FRAME_OVERHEAD * (self.count - k)

    def first_at_or_after(self, k: int, timestamp: int) -> int | None:
        """The offset of the first record from `k` on whose timestamp is >= `timestamp`, or None."""
        stamps = self.stamps
        if stamps is None:
            return self.first + k if self.top >= timestamp and k < self.count else None
        return next((self.first + i for i in range(k, self.count) if stamps[i] >= timestamp), None)


class FrameReader:
    """What a read takes, a batch at a time (`take`): the records' frames, within the read's bounds.

    Each frame is its head (one struct call) and a slice of the batch's
    data: `parts` are joined while the data is valid (an LMDB value's
    view is, in its transaction only).
    """

    __slots__ = ("at", "left", "room", "whole", "parts")

    def __init__(self, offset: int, max_messages: int, max_bytes: int) -> None:
        self.at = offset  # the next offset to take
        self.left = max_messages
        self.room = max_bytes  # data bytes left; the first record is taken whatever its size
        self.whole = True  # nothing taken yet
        self.parts: list[bytes | memoryview] = []

    def take(self, batch: BatchView) -> bool:
        """Take what the read wants of `batch` (from `at`); whether to go on to the next one."""
        first = batch.first
        lo = self.at - first
        lengths = batch.lengths
        hi = min(batch.count, lo + self.left)
        room = self.room
        size = sum(lengths[lo:hi])
        if size <= room:
            stop = hi
            room -= size
        else:
            stop = lo
            if self.whole:  # the first record, whatever its size
                room -= lengths[lo]
                stop += 1
            while stop < hi and lengths[stop] <= room:
                room -= lengths[stop]
                stop += 1
        if stop > lo:
            self._frames(batch, lo, stop)
            self.whole = False
        self.room = room
        self.left -= stop - lo
        self.at = first + stop
        return stop == batch.count and self.left > 0

    def _frames(self, batch: BatchView, lo: int, hi: int) -> None:
        parts = self.parts
        append = parts.append
        pack = FRAME_HEAD.pack
        data = batch.data
        lengths = batch.lengths
        pos = batch.position(lo)
        offset = batch.first + lo
        stamps = batch.stamps
        if stamps is None:
            ts = batch.top
            for n in lengths[lo:hi]:
                append(pack(_SIZED + n, offset, ts, 0))
                end = pos + n
                append(data[pos:end])
                pos = end
                offset += 1
        else:
            for k in range(lo, hi):
                n = lengths[k]
                append(pack(_SIZED + n, offset, stamps[k], 0))
                end = pos + n
                append(data[pos:end])
                pos = end
                offset += 1

    def joined(self) -> bytes:
        return b"".join(self.parts)


class FrameSizes(FrameReader):
    """`FrameReader` that only counts (`size`): the bytes its frames would take, none built.

    What a binary read's measuring pass needs (its Content-Length): a sum
    over each batch's lengths, no Python per record.
    """

    __slots__ = ("size",)

    def __init__(self, offset: int, max_messages: int, max_bytes: int) -> None:
        super().__init__(offset, max_messages, max_bytes)
        self.size = 0

    def _frames(self, batch: BatchView, lo: int, hi: int) -> None:
        self.size += sum(batch.lengths[lo:hi]) + FRAME_OVERHEAD * (hi - lo)


class RecordReader(FrameReader):
    """`FrameReader` taking records as (offset, timestamp, data) instead of frames (`records`), for `read`."""

    __slots__ = ("records",)

    def __init__(self, offset: int, max_messages: int, max_bytes: int) -> None:
        super().__init__(offset, max_messages, max_bytes)
        self.records: list[tuple[int, int, bytes]] = []

    def _frames(self, batch: BatchView, lo: int, hi: int) -> None:
        append = self.records.append
        data = batch.data
        lengths = batch.lengths
        pos = batch.position(lo)
        for k in range(lo, hi):
            end = pos + lengths[k]
            append((batch.first + k, batch.timestamp(k), bytes(data[pos:end])))
            pos = end


class HeadCut:
    """Where the head of a log stops expiring, found a batch at a time (`visit`), oldest first.

    A record goes while it is below `until`, older than `before`, or the
    log is past `max_bytes` (0: those bounds off). A batch goes whole,
    without looking at its records one by one, when all of it is below
    `until`, its largest timestamp is older than `before`, or the log is
    still at or past `max_bytes` without it; otherwise its records are
    walked, and the first one kept is the new earliest. At most `limit`
    records go (but all of a first batch bigger than that): the head
    stops at the batch that would take it past.
    """

    __slots__ = ("at", "size", "before", "max_bytes", "until", "limit", "gone", "first_head", "head",
                 "oldest")

    def __init__(self, earliest: int, size: int, before: int, max_bytes: int, until: int, limit: int) -> None:
        self.at = earliest
        self.size = size
        self.before = before
        self.max_bytes = max_bytes
        self.until = until
        self.limit = limit
        self.gone = 0
        self.first_head = -1  # the batch that held `earliest`
        self.head = -1  # the batch that holds the new earliest (-1: every record went)
        self.oldest: int | None = None

    def visit(self, batch: BatchView) -> bool:
        if self.first_head < 0:
            self.first_head = batch.first
        k = self.at - batch.first
        end = batch.end
        if self.gone and self.gone + end - self.at > self.limit:  # enough for one call: the rest later
            return self._stop(batch, k)
        before, max_bytes = self.before, self.max_bytes
        rest = batch.frames_size(k)
        if (end <= self.until or (before > 0 and batch.top < before)
                or (max_bytes > 0 and self.size - rest >= max_bytes)):
            self.size -= rest
            self.gone += end - self.at
            self.at = end
            return True
        lengths = batch.lengths
        timestamp: Callable[[int], int] = batch.timestamp
        while k < batch.count:
            if not (self.at < self.until or (before > 0 and timestamp(k) < before)
                    or (max_bytes > 0 and self.size > max_bytes)):
                return self._stop(batch, k)
            self.size -= FRAME_OVERHEAD + lengths[k]
            self.gone += 1
            self.at += 1
            k += 1
        return True

    def _stop(self, batch: BatchView, k: int) -> bool:
        self.head = batch.first
        self.oldest = batch.timestamp(k)
        return False
