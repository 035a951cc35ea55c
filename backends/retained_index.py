"""What every store's retained log shares: batches, their time index, and new epochs.

Both stores keep a log as batches, as Kafka does: what one `append`
(one publish) gives becomes one batch, split only past `MAX_BATCH_RECORDS`
records or `MAX_BATCH_BYTES` bytes of frames, so a stored value, a commit,
a chunk of the publish log and an entry of the spill file stay bounded.
A publish then costs one stored record, one staged write and one index
entry, however many messages it holds; a record is never an object of
its own.

The time index answers `offset_for_timestamp(T)`: the first record, in
log order from the oldest kept, whose timestamp is at or after T, exact
when the clock stepped back. Timestamps are the broker's clock at
publish, which mostly goes up but may step back (an NTP correction), so
a binary search over the records is wrong, and a running maximum kept
from the log's start is wrong too once the head expires (a maximum of
expired records hides the kept ones under it).

So the index keeps, for each block of FANOUT offsets, the largest
timestamp of the batches that START in it (a block where none starts
has none), the maximum of each FANOUT such entries, and so on up to a
level of at most FANOUT entries. A search walks up from the block of its
start while the blocks and groups after it are all older than T, then
down into the first one that is not: at most FANOUT entries per level
and the batches starting in one block (read from wherever the log keeps
them), whatever the timestamps do. Its answer is a batch whose largest
timestamp is at or after T; the log then walks that batch's records for
the first one that is. The batch holding the search's start (which may
start before it) is the log's to walk first: the index only finds
batches starting at or after a given offset. Adding a batch updates one
entry per level; the head expiring drops whole blocks now and then. The
index costs a few bytes per FANOUT offsets, whatever the batches' sizes,
which is all the LMDB store keeps in memory of what it has written.

An epoch names one life of a log: random, so a reader that kept an
offset can tell a log deleted and made again (offsets from 0 again)
from the one it read.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from mqd.message import Run
from mqd.wire.log_frames import FRAME_OVERHEAD

if TYPE_CHECKING:
    from mqd.message import Message

__all__ = ["FANOUT", "MAX_BATCH_BYTES", "MAX_BATCH_RECORDS", "Stamps", "TimeIndex", "batch_bounds", "new_epoch",
           "record_columns", "split_columns"]

# An append's timestamps: one for every record (a publish's share it), or one each.
Stamps = int | list[int]

# Offsets per block, and entries per group at each level above.
FANOUT = 256

# A batch holds at most this many records and this many bytes of frames
# (record frames, mqd.wire.log_frames), unless one record alone is bigger.
MAX_BATCH_RECORDS = 65536
MAX_BATCH_BYTES = 4 << 20

# The entry of a block where no batch starts: below every timestamp.
_NONE = -(1 << 64)


def new_epoch() -> int:
    """A random 63-bit epoch for a new log, never 0 (0 names a store that keeps nothing)."""
    while True:
        epoch = secrets.randbits(63)
        if epoch:
            return epoch


def record_columns(records: Sequence[Message] | Run) -> tuple[list[bytes], Stamps]:
    """An append's records as what a log keeps of them: their data (id and body) and their timestamps.

    A run (one publish held compactly) gives its own list and timestamp,
    with nothing built per record; messages give one timestamp when they
    all share it.
    """
    if isinstance(records, Run):
        return records.datas, records.timestamp
    datas = [m.data for m in records]
    stamps = [m.timestamp for m in records]
    top = stamps[0]
    return datas, (top if stamps.count(top) == len(stamps) else stamps)


def batch_bounds(datas: Sequence[bytes]) -> list[tuple[int, int]]:
    """Where an append's records (their data) split into batches: (start, stop) indexes, one pair unless past the bounds."""
    n = len(datas)
    if n <= MAX_BATCH_RECORDS and sum(map(len, datas)) + FRAME_OVERHEAD * n <= MAX_BATCH_BYTES:
        return [(0, n)]
    out: list[tuple[int, int]] = []
    start = size = 0
    for i, data in enumerate(datas):
        frame = FRAME_OVERHEAD + len(data)
        if i > start and (i - start >= MAX_BATCH_RECORDS or size + frame > MAX_BATCH_BYTES):
            out.append((start, i))
            start, size = i, 0
        size += frame
    out.append((start, n))
    return out


def split_columns(datas: list[bytes], stamps: Stamps) -> list[tuple[list[bytes], Stamps]]:
    """An append's columns cut into its batches (`batch_bounds`): itself when it is one."""
    bounds = batch_bounds(datas)
    if len(bounds) == 1:
        return [(datas, stamps)]
    if isinstance(stamps, int):
        return [(datas[start:stop], stamps) for start, stop in bounds]
    return [(datas[start:stop], stamps[start:stop]) for start, stop in bounds]


class TimeIndex:
    """The largest timestamps of the batches starting in each block of offsets from `base`, by level (see the module)."""

    __slots__ = ("base", "end", "_levels")

    def __init__(self, base: int = 0) -> None:
        # The offset where block 0 starts, and the one after the last batch indexed.
        self.base = base
        self.end = base
        # _levels[0][j]: the largest timestamp of the batches starting at
        # base + j*FANOUT to base + (j+1)*FANOUT - 1 (_NONE: none does);
        # _levels[k][j]: of _levels[k-1][j*FANOUT:(j+1)*FANOUT]. The top
        # level has at most FANOUT entries.
        self._levels: list[list[int]] = [[]]

    def add(self, offset: int, count: int, top: int) -> None:
        """Index the next batch: `count` records from `offset` (`end`), the largest of whose timestamps is `top`."""
        block = (offset - self.base) // FANOUT
        blocks = self._levels[0]
        while len(blocks) <= block:
            self._push(_NONE)
        if blocks[block] < top:
            self._raise(0, block, top)
        self.end = offset + count

    def _push(self, top: int) -> None:
        """A new block whose batches' largest timestamp is `top`: a new entry, and new groups above as needed."""
        levels = self._levels
        k = 0
        while True:
            level = levels[k]
            level.append(top)
            at = len(level) - 1
            if k + 1 == len(levels):
                if len(level) > FANOUT:
                    levels.append(_group_maxima(level))
                return
            if at % FANOUT:
                self._raise(k + 1, at // FANOUT, top)
                return
            k += 1  # the first entry of a new group: the group is new one level up

    def _raise(self, k: int, at: int, top: int) -> None:
        """Entry `at` of level `k` covers a timestamp `top`: raise it, and the groups above it, where lower."""
        levels = self._levels
        while k < len(levels):
            level = levels[k]
            if level[at] >= top:
                return
            level[at] = top
            k += 1
            at //= FANOUT

    def find(self, start: int, timestamp: int, scan: Callable[[int, int], Iterable[tuple[int, int]]]) -> int | None:
        """The first offset from `start` on where a batch starts whose largest timestamp is >= `timestamp`; None if none.

        `scan(lo, hi)` gives (first offset, largest timestamp) of the
        batches starting at `lo` to `hi - 1`, in order: at most one
        block's worth per call, at most two calls.
        """
        if start >= self.end:
            return None
        levels = self._levels
        block = max(start - self.base, 0) // FANOUT
        if block >= len(levels[0]):
            return None
        if levels[0][block] >= timestamp:
            # The block has one, maybe before `start` only.
            found = self._in_block(block, start, timestamp, scan)
            if found is not None:
                return found
        k, at = 0, block
        while True:
            level = levels[k]
            group_end = min((at // FANOUT + 1) * FANOUT, len(level))
            for later in range(at + 1, group_end):
                if level[later] >= timestamp:
                    return self._descend(k, later, timestamp, scan)
            if k + 1 == len(levels):
                return None
            k += 1
            at //= FANOUT

    def _descend(self, k: int, at: int, timestamp: int, scan: Callable[[int, int], Iterable[tuple[int, int]]]) -> int:
        """Entry `at` of level `k` covers a timestamp >= `timestamp` (all after the start): its first such batch."""
        levels = self._levels
        while k > 0:
            k -= 1
            level = levels[k]
            lo = at * FANOUT
            at = next(i for i in range(lo, min(lo + FANOUT, len(level))) if level[i] >= timestamp)
        found = self._in_block(at, self.base + at * FANOUT, timestamp, scan)
        if found is None:  # the maxima say otherwise: the batches changed under the index
            raise AssertionError(f"time index: block {at} has no batch reaching {timestamp}")
        return found

    def _in_block(self, block: int, start: int, timestamp: int,
                  scan: Callable[[int, int], Iterable[tuple[int, int]]]) -> int | None:
        """The first batch starting from `start` to the end of `block` whose largest timestamp is >= `timestamp`."""
        lo = max(start, self.base + block * FANOUT)
        hi = min(self.base + (block + 1) * FANOUT, self.end)
        for offset, top in scan(lo, hi):
            if top >= timestamp:
                return offset
        return None

    def trim(self, earliest: int) -> None:
        """Records below `earliest` are gone: forget whole blocks below its block once they are half the index (amortized).

        A batch holding `earliest` may start in a block forgotten here:
        searches start after it (see the module).
        """
        blocks = self._levels[0]
        if earliest >= self.end:
            self.reset(earliest)
            return
        gone = min((earliest - self.base) // FANOUT, len(blocks))
        if gone <= 0 or 2 * gone < len(blocks):
            return
        levels = [blocks[gone:]]
        while len(levels[-1]) > FANOUT:
            levels.append(_group_maxima(levels[-1]))
        self._levels = levels
        self.base += gone * FANOUT

    def reset(self, base: int) -> None:
        """Nothing indexed; the next batch starts at `base`."""
        self.base = self.end = base
        self._levels = [[]]


def _group_maxima(level: list[int]) -> list[int]:
    return [max(level[i:i + FANOUT]) for i in range(0, len(level), FANOUT)]
