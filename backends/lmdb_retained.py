"""A topic's retained log in the LMDB store: a key range of `messages`, one record per batch, staged like a queue's puts.

The log is one more queue id of the store's one `messages` database,
registered as "<topic>/log" (backends.lmdb_records). It is stored as
batches (backends.retained_index), as Kafka stores its logs: what one
append (one publish) gave, split only past 65,536 records or 4 MiB. A
batch is ONE record, keyed by its first offset (so keys have gaps: a
read seeks the batch holding an offset with `set_range` and one step
back), holding one pseudo message (backends.lmdb_batches: the records'
timestamps, lengths and data). A publish of a hundred messages then
costs one key, one staged write, one LMDB put and one time-index entry
instead of a hundred of each (the channel's overflow already costs a
record per message). The pseudo message is staged in the store's write
set (backends.lmdb_pending) as a queue stages its puts, so the commit,
the publish log's chunks, crash replay, a failed commit's drop and the
spill file take it as any record.

- Default mode: a batch is readable at once; until a checkpoint writes
  it, it is read from the log's `tail` in memory.
- Durable: a batch is readable once the commit (or the chunk of the
  publish log) that holds it succeeded; the store tells the log through
  `committed`, `fly`, `landed`, `unfly` and `roll_back`, as it tells its
  queues. Every batch appended in durable mode is a new publish by
  nature: a failed commit drops it, and the batches staged after it are
  keyed down so the offsets have no gap (nobody saw any of them).
- Expiry goes a whole batch at a time where every record of it must go;
  the batch where it stops may keep only its newer records: `earliest`
  is then inside it, and the batch stays stored whole until all of it
  goes. The batches gone are deleted (`drop_below` their key range)
  with, in the same transaction, the new `earliest` (the offset floor,
  with the epoch in `meta`): a restart serves from the same earliest,
  and a log whose records all expired goes on from the same offset.
- In memory: the counters, the time index (a few bytes per 256 offsets)
  and the batches not written yet; reads go to LMDB for the rest.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from zope.interface import implementer

from backends.interface import BackendError, IRetainedLog, OffsetOutOfRange
from backends.lmdb_batches import (
    BATCH_HEAD,
    BatchView,
    FrameReader,
    FrameSizes,
    HeadCut,
    RecordReader,
    frames_size,
    make_batch,
    seek_batch,
    stored_count,
)
from backends.lmdb_records import KEY, QID, RECORD_HEAD, RETAINED, RETAINED_META, record_seq
from backends.retained_index import TimeIndex, new_epoch, record_columns, split_columns
from mqd.logs import get_logger
from mqd.message import Message, Run
from mqd.wire.log_frames import FRAME_OVERHEAD

if TYPE_CHECKING:
    from backends.lmdb_pending import PendingWrites, Stager

__all__ = ["EXPIRE_RECORDS", "LmdbLog", "LogState", "load_log", "scan_log"]

log = get_logger("backends.lmdb")

# At most this many records go per `expire` call (whole batches, but a
# first one bigger than that): a retention made much shorter on a big log
# takes a few calls (the broker's expiry runs every second) instead of one
# long reactor turn and one huge transaction.
EXPIRE_RECORDS = 65536

_HEAD = RECORD_HEAD.size
_TS = struct.Struct(">q")
# A stored value's timestamp, RECORD_HEAD's rest, and the batch's head (BATCH_HEAD): what a scan reads.
_SCAN = struct.Struct(">q10x" + BATCH_HEAD.format.lstrip(">"))

# visit(batch): False to stop.
Visit = Callable[[BatchView], bool]


def _view(batch: Message) -> BatchView:
    """A staged batch's records, read in place."""
    return BatchView(record_seq(batch), batch.timestamp, memoryview(batch.data))


class LogState:
    """What a scan of a stored log found: its bounds, bytes, oldest timestamp, time index, and its first batch's offset."""

    __slots__ = ("earliest", "latest", "bytes", "oldest", "index", "head")

    def __init__(self, earliest: int, latest: int, size: int, oldest: int | None, index: TimeIndex,
                 head: int) -> None:
        self.earliest = earliest
        self.latest = latest
        self.bytes = size
        self.oldest = oldest
        self.index = index
        # The first offset of the batch holding `earliest` (`earliest` when empty).
        self.head = head


def scan_log(env: Any, data_db: Any, qid: int, floor: int) -> LogState:
    """One pass over a stored log's batches from the one holding `floor`: bounds, bytes, oldest timestamp, time index.

    Only each batch's key and head are read, but for the first batch,
    whose records below `floor` expired (they are not counted). Batches
    wholly below `floor` are an expired head whose deletion did not land
    (the caller drops them). The offsets run on from batch to batch; a
    gap cannot happen, but if one is found, the batches before it are
    left out, so the log stays contiguous.
    """
    index = TimeIndex(floor)
    head = expect = -1
    size = 0
    head_value = b""
    with env.begin(db=data_db, buffers=True) as txn:
        cursor = txn.cursor()
        if not seek_batch(cursor, qid, floor):
            return new_state(floor)
        unpack_key = KEY.unpack
        unpack_head = _SCAN.unpack_from
        for key, value in cursor.iternext():
            owner, first = unpack_key(key)
            if owner != qid:
                break
            top, count, kind = unpack_head(value)
            if first + count <= floor:
                continue
            if first != expect:
                if head >= 0:
                    log.error("retained log {qid}: offsets {a} to {b} are missing; the log starts after them",
                              qid=qid, a=expect, b=first - 1)
                head, size = first, 0
                index = TimeIndex(first)
                head_value = bytes(value)
            index.add(first, count, top)
            # frames_size, from the value's length
            size += len(value) - _SCAN.size - (12 if kind else 4) * count + FRAME_OVERHEAD * count
            expect = first + count
    if head < 0:
        return new_state(floor)
    earliest = max(floor, head)
    batch = BatchView(head, _TS.unpack_from(head_value)[0], memoryview(head_value)[_HEAD:])
    skipped = earliest - head
    size -= batch.frames_size(0) - batch.frames_size(skipped)
    return LogState(earliest, expect, size, batch.timestamp(skipped), index, head)


def load_log(name: str, qid: int, new: bool, env: Any, meta_db: Any, data_db: Any, writes: PendingWrites[Stager],
             *, spilled: list[Message], durable: bool, check_writable: Callable[[], None],
             read_records: Callable[[int], None], forget: Callable[[LmdbLog], None]) -> LmdbLog:
    """The retained log of topic `name` under queue id `qid` (registered by the store; `new`: just now).

    A new log gets a new epoch, staged in `meta` with the registry entry.
    A stored one gets its epoch and floor (its earliest) from `meta` and
    the rest from a scan of its batches (`scan_log`); an expired head
    still in LMDB is dropped again. `spilled`: its batches a shutdown on
    a full disk saved, staged again by the store (they follow what LMDB
    holds).
    """
    meta_key = RETAINED_META + name.encode()
    stored = None
    if not new:
        with env.begin(db=meta_db) as txn:
            stored = txn.get(meta_key)
    if stored is not None and len(stored) == RETAINED.size:
        epoch, floor = RETAINED.unpack(stored)
    else:
        if not new:
            log.warn("retained log {name}: no epoch stored; its records start a new epoch", name=name)
        epoch, floor = new_epoch(), 0
        writes.put_meta(meta_key, RETAINED.pack(epoch, floor))
    state = new_state(floor) if new else scan_log(env, data_db, qid, floor)
    if not new and _stored_below(env, data_db, qid, state.head):
        writes.drop_below(qid, state.head)
    spilled.sort(key=lambda m: cast(bytes, m.key))
    if spilled and state.earliest == state.latest:
        state = new_state(record_seq(spilled[0]))
    retained = LmdbLog(name, qid, epoch, state, env=env, data_db=data_db, writes=writes, durable=durable,
                       check_writable=check_writable, read_records=read_records, forget=forget)
    if spilled:
        retained.restore(spilled)
        writes.touch(retained)  # the commit writing them takes them off the log's memory
        retained.skip_to(floor)  # what expired of a batch spilled whole
    return retained


def new_state(offset: int) -> LogState:
    """An empty log going on from `offset`."""
    return LogState(offset, offset, 0, None, TimeIndex(offset), offset)


def _stored_below(env: Any, data_db: Any, qid: int, bound: int) -> bool:
    """Whether LMDB holds a record of queue `qid` below sequence `bound`."""
    with env.begin(db=data_db) as txn:
        cursor = txn.cursor()
        return bool(cursor.set_range(QID.pack(qid))) and bytes(cursor.key()) < KEY.pack(qid, bound)


@implementer(IRetainedLog)
class LmdbLog:
    """A topic's retained log: offsets `earliest` to `latest`, as batches in LMDB and (not written yet) in memory.

    Built by the store (LmdbStore.open_log) with the key range's queue id
    `qid`, what a scan found (`state`), the environment and `data_db` to
    read, the store's write set `writes` to stage in, and the store's
    callbacks: `check_writable` before taking records (BackendError while
    the store is failing), `read_records(n)` after reading from LMDB,
    `forget(self)` when deleted.
    """

    __slots__ = ("name", "qid", "epoch", "meta_key", "_env", "_data_db", "_writes", "_durable",
                 "_check_writable", "_read_records", "_forget", "_earliest", "_latest", "_next", "_bytes",
                 "_oldest", "_index", "_tail", "_staged", "_flying", "_deleted")

    kept = True
    # Stager: a log has nothing to hand over once committed.
    on_stored: Callable[[list[Message]], Any] | None = None

    def __init__(self, name: str, qid: int, epoch: int, state: LogState, *, env: Any, data_db: Any,
                 writes: PendingWrites[Stager], durable: bool, check_writable: Callable[[], None],
                 read_records: Callable[[int], None], forget: Callable[[LmdbLog], None]) -> None:
        self.name = name
        self.qid = qid
        self.epoch = epoch
        self.meta_key = RETAINED_META + name.encode()
        self._env = env
        self._data_db = data_db
        self._writes = writes
        self._durable = durable
        self._check_writable = check_writable
        self._read_records = read_records
        self._forget = forget
        self._earliest = state.earliest
        # One past the newest readable record; `_next`: the next offset to give.
        self._latest = self._next = state.latest
        self._bytes = state.bytes
        self._oldest = state.oldest
        self._index = state.index
        # Readable batches not written to LMDB yet (pseudo messages, keyed
        # by the write set), oldest first, up to `latest`.
        self._tail: list[Message] = []
        # Durable: batches staged and not committed yet (not readable), and
        # with a publish log, those of each chunk being written, oldest first.
        self._staged: list[Message] = []
        self._flying: deque[list[Message]] = deque()
        self._deleted = False

    # -- IRetainedLog -------------------------------------------------------------------

    def append(self, records: Sequence[Message] | Run, fresh: bool = False) -> None:
        """Stage the records as the next batch (two or more past the bounds); readable now, or (durable) once committed."""
        if self._deleted:
            raise BackendError(f"the retained log of {self.name} was deleted")
        self._check_writable()
        if not len(records):
            return
        columns = split_columns(*record_columns(records))
        batches = [make_batch(datas, stamps) for datas, stamps in columns]
        spans = [len(datas) for datas, _ in columns]
        durable = self._durable
        self._next = self._writes.add_spans(self, self.qid, self._next, batches, spans, durable)
        if durable:
            self._staged += batches
        else:
            self._readable(batches)

    def earliest(self) -> int:
        return self._earliest

    def latest(self) -> int:
        return self._latest

    def retained_bytes(self) -> int:
        return self._bytes

    def oldest_timestamp(self) -> int | None:
        return self._oldest

    def offset_for_timestamp(self, timestamp_ns: int) -> int:
        """The head batch's records from `earliest`, then the first later batch reaching the time (the index), walked."""
        if self._earliest == self._latest:
            return self._latest
        found: list[int | None] = []
        after = [self._latest]
        start = self._earliest

        def head(batch: BatchView) -> bool:
            after[0] = batch.end
            found.append(batch.first_at_or_after(start - batch.first, timestamp_ns))
            return False

        def inside(batch: BatchView) -> bool:
            found.append(batch.first_at_or_after(0, timestamp_ns))
            return False

        self._walk(start, head)
        if found[0] is not None:
            return found[0]
        first = self._index.find(after[0], timestamp_ns, self._tops)
        if first is None:
            return self._latest
        self._walk(first, inside)
        if found[1] is None:  # the index says this batch reaches it
            raise AssertionError(f"retained log {self.name}: batch {first} has no timestamp >= {timestamp_ns}")
        return found[1]

    def read(self, offset: int, max_messages: int, max_bytes: int) -> list[tuple[int, int, bytes]]:
        reader = RecordReader(offset, max_messages, max_bytes)
        self._read(reader)
        return reader.records

    def read_frames(self, offset: int, max_messages: int, max_bytes: int) -> tuple[bytes, int]:
        """`read` framed (mqd.wire.log_frames): built from the batches' records in place, one struct call each."""
        reader = FrameReader(offset, max_messages, max_bytes)
        return self._read(reader), reader.at

    def frames_extent(self, offset: int, max_messages: int, max_bytes: int) -> tuple[int, int]:
        """`read_frames` measured, not built: a sum of the batches' lengths each."""
        reader = FrameSizes(offset, max_messages, max_bytes)
        self._read(reader)
        return reader.size, reader.at

    def _read(self, reader: FrameReader) -> bytes:
        """What `reader` takes from its offset on, LMDB's batches then the tail's; the frames it took, joined."""
        offset = reader.at
        self._check(offset)
        if reader.left <= 0 or offset == self._latest:
            return b""
        tail_start = self._tail_start()
        if offset < tail_start:
            with self._env.begin(db=self._data_db, buffers=True) as txn:
                more = self._stored(txn.cursor(), offset, tail_start, reader.take)
                # The stored values are valid only in the transaction: copied out now.
                framed = reader.joined()
            if not more:
                return framed
            reader.parts = [framed]
        for batch in self._tail_from(reader.at):
            if not reader.take(_view(batch)):
                break
        return reader.joined()

    def expire(self, before_ns: int, max_bytes: int) -> int:
        """Drop head records a bound says must go (at most EXPIRE_RECORDS a call); how many went."""
        if self._deleted or self._latest == self._earliest:
            return 0
        old = before_ns > 0 and self._oldest is not None and self._oldest < before_ns
        if not old and not (max_bytes > 0 and self._bytes > max_bytes):
            return 0
        return self._cut(before_ns, max_bytes, 0)

    def skip_to(self, floor: int) -> None:
        """Records below `floor` expired: a floor stored with batches that a full disk's shutdown spilled whole."""
        while self._earliest < min(floor, self._latest) and self._cut(0, 0, floor):
            pass

    def delete(self) -> None:
        """Drop every record, written or staged, the epoch and the registry entry: a new log starts over."""
        if self._deleted:
            return
        self._writes.drop_queue(self.qid, self._next)
        self._writes.put_meta(self.meta_key, None)
        self._forget(self)
        self._deleted = True
        self._tail.clear()
        self._staged = []
        self._flying.clear()
        self._earliest = self._latest = self._next = 0
        self._bytes = 0
        self._oldest = None
        self._index.reset(0)

    def close(self) -> None:
        """The store writes and closes everything at once."""

    # -- reading ------------------------------------------------------------------------

    def _check(self, offset: int) -> None:
        if offset < self._earliest or offset > self._latest:
            raise OffsetOutOfRange(offset, self._earliest, self._latest)

    def _tail_start(self) -> int:
        """The first offset held in memory, not in LMDB: `latest` when none is."""
        tail = self._tail
        # Every batch in the tail has its key (expiry takes them off the tail first).
        return record_seq(tail[0]) if tail else self._latest

    def _tail_from(self, offset: int) -> list[Message]:
        """The batches of the tail from the one holding `offset` on."""
        tail = self._tail
        return tail[max(bisect_right(tail, offset, key=record_seq) - 1, 0):]

    def _stored(self, cursor: Any, offset: int, stop: int, visit: Visit) -> bool:
        """`visit` each stored batch from the one holding `offset` up to offset `stop`; False if `visit` stopped.

        The views of the values `visit` gets are valid in the transaction
        only. The records of the batches visited count as read through
        the map (`read_records`).
        """
        qid = self.qid
        if not seek_batch(cursor, qid, offset) or KEY.unpack(cursor.key())[1] > offset:
            raise BackendError(f"retained log {self.name}: record {offset} is missing from LMDB")
        expect = start = -1
        ts_at = _TS.unpack_from
        try:
            for key, value in cursor.iternext():
                owner, first = KEY.unpack(key)
                if owner != qid or first >= stop:
                    break
                if start < 0:
                    start = first
                elif first != expect:
                    raise BackendError(f"retained log {self.name}: records {expect} to {first - 1} are missing "
                                       f"from LMDB")
                batch = BatchView(first, ts_at(value)[0], value[_HEAD:])
                expect = batch.end
                if not visit(batch):
                    return False
        finally:
            if start >= 0:
                self._read_records(expect - start)
        if expect < stop:
            raise BackendError(f"retained log {self.name}: records from {max(expect, offset)} are missing from LMDB")
        return True

    def _walk(self, offset: int, visit: Visit) -> None:
        """`visit` each batch from the one holding `offset` on, oldest first, until it returns False: LMDB's, then the tail's."""
        tail_start = self._tail_start()
        if offset < tail_start:
            with self._env.begin(db=self._data_db, buffers=True) as txn:
                more = self._stored(txn.cursor(), offset, tail_start, visit)
            if not more:
                return
        for batch in self._tail_from(max(offset, tail_start)):
            if not visit(_view(batch)):
                return

    def _tops(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(first offset, largest timestamp) of the batches starting at `lo` to `hi - 1` (the time index's scan)."""
        hi = min(hi, self._latest)
        tail_start = self._tail_start()
        out: list[tuple[int, int]] = []
        stop = min(hi, tail_start)
        if lo < stop:
            with self._env.begin(db=self._data_db, buffers=True) as txn:
                cursor = txn.cursor()
                if cursor.set_range(KEY.pack(self.qid, lo)):
                    for key, value in cursor.iternext():
                        owner, first = KEY.unpack(key)
                        if owner != self.qid or first >= stop:
                            break
                        out.append((first, _TS.unpack_from(value)[0]))
        lo = max(lo, tail_start)
        out += [(first, batch.timestamp) for batch in self._tail_from(lo) if lo <= (first := record_seq(batch)) < hi]
        return out

    # -- the head -----------------------------------------------------------------------

    def _cut(self, before_ns: int, max_bytes: int, until: int) -> int:
        """Expire the head records below `until`, older than `before_ns` or past `max_bytes`; how many went."""
        cut = HeadCut(self._earliest, self._bytes, before_ns, max_bytes, until, EXPIRE_RECORDS)
        self._walk(self._earliest, cut.visit)
        if not cut.gone:
            return 0
        if cut.head < 0:  # every record went
            head = earliest = self._latest
        else:
            head, earliest = cut.head, cut.at
        if head > cut.first_head:  # whole batches went: their records, written or not
            tail = self._tail
            k = 0
            while k < len(tail) and record_seq(tail[k]) < head:
                k += 1
            del tail[:k]
            self._writes.drop_below(self.qid, head)
        self._writes.put_meta(self.meta_key, RETAINED.pack(self.epoch, earliest))
        self._earliest = earliest
        self._bytes = cut.size
        self._oldest = cut.oldest
        self._index.trim(earliest)
        return cut.gone

    # -- what became of what was staged: told by the store ---------------------------------

    def restore(self, batches: list[Message]) -> None:
        """Batches a shutdown on a full disk spilled (staged again by the store, keyed, in order): readable now.

        They follow what LMDB holds; if they do not (which the store
        cannot write so), they are given the next offsets instead.
        """
        spans = [stored_count(b.data) for b in batches]
        at = self._latest
        if [record_seq(b) for b in batches] != [at + sum(spans[:i]) for i in range(len(spans))]:
            log.error("retained log {name}: spilled records do not follow offset {n}; renumbered",
                      name=self.name, n=self._latest)
            self._writes.rekey(self.qid, at, batches, spans)
        self._readable(batches)
        self._next = self._latest

    def _readable(self, batches: list[Message]) -> None:
        """`batches` (the next offsets) can be read from now on."""
        at = self._latest
        if at == self._earliest:
            self._oldest = BatchView(at, batches[0].timestamp, batches[0].data).timestamp(0)
        add = self._index.add
        size = 0
        for batch in batches:
            data = batch.data
            count = stored_count(data)
            add(at, count, batch.timestamp)
            size += frames_size(data)
            at += count
        self._bytes += size
        self._latest = at
        self._tail += batches

    def committed(self) -> list[Message] | None:
        """After a checkpoint: staged batches are readable; what LMDB holds now leaves the tail."""
        if self._staged:
            staged, self._staged = self._staged, []
            self._readable(staged)
        tail = self._tail
        puts = self._writes.puts
        k = 0
        while k < len(tail) and tail[k].key not in puts:
            k += 1
        del tail[:k]
        return None

    def fly(self) -> bool:
        """A chunk of the publish log takes the staged batches (True if any)."""
        if not self._staged:
            return False
        self._flying.append(self._staged)
        self._staged = []
        return True

    def landed(self) -> list[Message] | None:
        """The oldest chunk is synced: its batches are readable."""
        if self._flying:
            self._readable(self._flying.popleft())
        return None

    def unfly(self) -> None:
        """The chunks failed: their batches are staged again, ahead of those staged since."""
        flying = self._flying
        if flying:
            self._staged[:0] = [m for batch in flying for m in batch]
            flying.clear()

    def roll_back(self, keys: list[bytes]) -> None:
        """A failed commit dropped batches (their `keys`): the offsets go back, later staged batches renumbered down."""
        if self._deleted:
            return
        kept = [m for m in self._staged if m.key is not None]
        self._staged = kept
        # Nothing is in flight here (every chunk in flight failed with the
        # first), so what is staged comes right after what is readable.
        spans = [stored_count(m.data) for m in kept]
        self._next = self._writes.rekey(self.qid, self._latest, kept, spans) if kept else self._latest
