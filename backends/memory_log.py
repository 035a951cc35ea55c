"""A topic's retained log kept in RAM (the memory store's): gone when the process ends.

The log is a list of batches (backends.retained_index): what one append
gave, kept as cheaply as it can be taken, in three parallel lists:

- the batch's first offset;
- the messages' `data` (id and body), the very objects the channels
  hold, so a record costs a list slot while a channel still has its
  message (one `bytes` for a batch of one message, no list);
- the batch's timestamp when all its records share one (a publish's
  do), else the list of them.

Frames (mqd.wire.log_frames) are built when read, one struct call per
record: building them at append cost four times what the rest of an
append does, and a frame kept per record doubled the RAM of what the
channels still held. A read finds its first batch by bisection and
slices from there. Expiry moves the head a record at a time only inside
one batch: a batch goes whole once every record in it must; a batch
partly expired keeps the rest readable from the logical `earliest`
inside it. Dropped batches release their data at once; their list slots
go once they are half the lists. The broker bounds the log with `expire`
(its retention bytes, which `--backend memory` requires); the time index
is backends.retained_index's.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from zope.interface import implementer

from backends.interface import BackendError, IRetainedLog, OffsetOutOfRange
from backends.retained_index import Stamps, TimeIndex, new_epoch, record_columns, split_columns
from mqd.wire.log_frames import FRAME_HEAD, FRAME_OVERHEAD

if TYPE_CHECKING:
    from mqd.message import Message, Run

__all__ = ["MemoryLog"]

# What a frame's size field counts besides the id and body.
_SIZED = FRAME_OVERHEAD - 4
# The slots of dropped batches go once there are this many and they are half the lists.
_COMPACT_AFTER = 4096

# A batch's data: one message's, or a list (its timestamps: backends.retained_index.Stamps).
_Datas = bytes | list[bytes]


@implementer(IRetainedLog)
class MemoryLog:
    """A retained log in RAM: batches `_head` on hold offsets `earliest` to `latest`; see the module."""

    __slots__ = ("name", "epoch", "_starts", "_datas", "_stamps", "_head", "_skip", "_earliest", "_end",
                 "_bytes", "_index", "_forget", "_deleted")

    kept = True

    def __init__(self, name: str, forget: Callable[[MemoryLog], None] | None = None) -> None:
        self.name = name
        self.epoch = new_epoch()
        self._starts: list[int] = []
        self._datas: list[_Datas] = []
        self._stamps: list[Stamps] = []
        # The index of the batch holding `earliest`, and how many of its records expired.
        self._head = 0
        self._skip = 0
        self._earliest = 0
        self._end = 0
        self._bytes = 0
        self._index = TimeIndex(0)
        self._forget = forget
        self._deleted = False

    def append(self, records: Sequence[Message] | Run, fresh: bool = False) -> None:
        if self._deleted:
            raise BackendError(f"the retained log of {self.name} was deleted")
        if len(records):
            for datas, stamps in split_columns(*record_columns(records)):
                self._add(datas, stamps)

    def _add(self, datas: list[bytes], stamps: Stamps) -> None:
        """One batch of the next offsets: the records' data and timestamps, nothing else of them."""
        n = len(datas)
        at = self._end
        top = stamps if isinstance(stamps, int) else max(stamps)
        self._stamps.append(stamps)
        if n == 1:
            data = datas[0]
            self._datas.append(data)
            size = len(data)
        else:
            # The list itself: a run's is never changed, so the log and the channels share it.
            self._datas.append(datas)
            size = sum(map(len, datas))
        self._starts.append(at)
        self._bytes += size + FRAME_OVERHEAD * n
        self._index.add(at, n, top)
        self._end = at + n

    def earliest(self) -> int:
        return self._earliest

    def latest(self) -> int:
        return self._end

    def retained_bytes(self) -> int:
        return self._bytes

    def oldest_timestamp(self) -> int | None:
        if self._earliest == self._end:
            return None
        stamps = self._stamps[self._head]
        return stamps if isinstance(stamps, int) else stamps[self._skip]

    def offset_for_timestamp(self, timestamp_ns: int) -> int:
        if self._earliest == self._end:
            return self._end
        head = self._head
        found = _first_at_or_after(self._stamps[head], self._skip, timestamp_ns)
        if found is not None:
            return self._starts[head] + found
        after = self._index.find(self._starts[head] + _count(self._datas[head]), timestamp_ns, self._tops)
        if after is None:
            return self._end
        i = bisect_left(self._starts, after, head)
        found = _first_at_or_after(self._stamps[i], 0, timestamp_ns)
        if found is None:  # the index says this batch reaches it
            raise AssertionError(f"retained log {self.name}: batch {after} has no timestamp >= {timestamp_ns}")
        return after + found

    def read(self, offset: int, max_messages: int, max_bytes: int) -> list[tuple[int, int, bytes]]:
        out: list[tuple[int, int, bytes]] = []
        for first, datas, stamps, lo, hi in self._pieces(offset, max_messages, max_bytes):
            if isinstance(stamps, int):
                out += [(first + k, stamps, datas[k]) for k in range(lo, hi)]
            else:
                out += [(first + k, stamps[k], datas[k]) for k in range(lo, hi)]
        return out

    def read_frames(self, offset: int, max_messages: int, max_bytes: int) -> tuple[bytes, int]:
        """`read` framed (mqd.wire.log_frames): one struct call and the shared data per record."""
        parts: list[bytes] = []
        append = parts.append
        pack = FRAME_HEAD.pack
        at = offset
        for first, datas, stamps, lo, hi in self._pieces(offset, max_messages, max_bytes):
            if isinstance(stamps, int):
                for k in range(lo, hi):
                    data = datas[k]
                    append(pack(_SIZED + len(data), first + k, stamps, 0))
                    append(data)
            else:
                for k in range(lo, hi):
                    data = datas[k]
                    append(pack(_SIZED + len(data), first + k, stamps[k], 0))
                    append(data)
            at = first + hi
        return b"".join(parts), at

    def frames_extent(self, offset: int, max_messages: int, max_bytes: int) -> tuple[int, int]:
        """`read_frames` measured, not built: one sum of lengths per batch."""
        size = 0
        at = offset
        for first, datas, _stamps, lo, hi in self._pieces(offset, max_messages, max_bytes):
            size += sum(map(len, datas[lo:hi])) + FRAME_OVERHEAD * (hi - lo)
            at = first + hi
        return size, at

    def expire(self, before_ns: int, max_bytes: int) -> int:
        """Drop head records a bound says must go: whole batches where every record must, then records of one."""
        if self._earliest == self._end:
            return 0
        oldest = self.oldest_timestamp()
        old = before_ns > 0 and oldest is not None and oldest < before_ns
        if not old and not (max_bytes > 0 and self._bytes > max_bytes):
            return 0
        starts, all_datas, all_stamps = self._starts, self._datas, self._stamps
        size = self._bytes
        head = i = self._head
        skip = self._skip
        gone = 0
        while i < len(starts):
            datas = _listed(all_datas[i])
            stamps = all_stamps[i]
            n = len(datas)
            rest = sum(map(len, datas[skip:])) + FRAME_OVERHEAD * (n - skip)
            top = stamps if isinstance(stamps, int) else max(stamps[skip:])
            if (before_ns > 0 and top < before_ns) or (max_bytes > 0 and size - rest >= max_bytes):
                size -= rest
                gone += n - skip
            else:
                k = skip
                while k < n:
                    ts = stamps if isinstance(stamps, int) else stamps[k]
                    if not ((before_ns > 0 and ts < before_ns) or (max_bytes > 0 and size > max_bytes)):
                        break
                    size -= FRAME_OVERHEAD + len(datas[k])
                    k += 1
                gone += k - skip
                if k < n:
                    skip = k
                    break
            i += 1
            skip = 0
        if not gone:
            return 0
        self._bytes = size
        if i == len(starts):
            # Everything went: nothing kept, the offsets go on.
            starts.clear()
            all_datas.clear()
            all_stamps.clear()
            self._head = self._skip = 0
            self._earliest = self._end
            self._index.reset(self._end)
            return gone
        # The data of the batches gone is released now, their slots later.
        all_datas[head:i] = [b""] * (i - head)
        all_stamps[head:i] = [0] * (i - head)
        if i >= _COMPACT_AFTER and 2 * i >= len(starts):
            del starts[:i], all_datas[:i], all_stamps[:i]
            i = 0
        self._head, self._skip = i, skip
        self._earliest = starts[i] + skip
        self._index.trim(self._earliest)
        return gone

    def delete(self) -> None:
        """Drop every record and leave the store: opened again, the log is a new one."""
        self._starts = []
        self._datas = []
        self._stamps = []
        self._head = self._skip = self._earliest = self._end = 0
        self._bytes = 0
        self._index.reset(0)
        self._deleted = True
        if self._forget is not None:
            self._forget(self)

    def close(self) -> None:
        """Nothing to release; the records die with the process."""

    # -- reading ------------------------------------------------------------------------

    def _pieces(self, offset: int, max_messages: int,
                max_bytes: int) -> Iterator[tuple[int, list[bytes], Stamps, int, int]]:
        """What a read from `offset` returns, a piece per batch: (first offset, data, timestamps, lo, hi).

        Records `lo` to `hi - 1` of the batch; at most `max_messages` in
        all and, past the first record, `max_bytes` of data.
        """
        if offset < self._earliest or offset > self._end:
            raise OffsetOutOfRange(offset, self._earliest, self._end)
        if max_messages <= 0 or offset == self._end:
            return
        starts, all_datas, all_stamps = self._starts, self._datas, self._stamps
        i = bisect_right(starts, offset, self._head) - 1
        left = max_messages
        size = 0
        at = offset
        first_record = True
        while left > 0 and i < len(starts):
            first = starts[i]
            datas = _listed(all_datas[i])
            lo = at - first
            hi = min(len(datas), lo + left)
            taken = sum(map(len, datas[lo:hi]))
            if size + taken > max_bytes:
                # Not all of them: the first record always, then what fits.
                stop = lo
                if first_record:
                    size += len(datas[lo])
                    stop += 1
                while stop < hi:
                    n = len(datas[stop])
                    if size + n > max_bytes:
                        break
                    size += n
                    stop += 1
                if stop > lo:
                    yield first, datas, all_stamps[i], lo, stop
                return
            size += taken
            yield first, datas, all_stamps[i], lo, hi
            first_record = False
            left -= hi - lo
            at = first + hi
            i += 1

    def _tops(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(first offset, largest timestamp) of the batches starting at `lo` to `hi - 1` (the time index's scan)."""
        starts = self._starts
        out = []
        for i in range(bisect_left(starts, lo, self._head), bisect_left(starts, hi, self._head)):
            stamps = self._stamps[i]
            out.append((starts[i], stamps if isinstance(stamps, int) else max(stamps)))
        return out


def _listed(datas: _Datas) -> list[bytes]:
    return [datas] if isinstance(datas, bytes) else datas


def _count(datas: _Datas) -> int:
    return 1 if isinstance(datas, bytes) else len(datas)


def _first_at_or_after(stamps: Stamps, start: int, timestamp: int) -> int | None:
    """The first record of a batch from `start` whose timestamp is >= `timestamp`, or None."""
    if isinstance(stamps, int):
        return start if stamps >= timestamp else None
    return next((k for k in range(start, len(stamps)) if stamps[k] >= timestamp), None)
