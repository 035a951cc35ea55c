"""One queue of the LMDB store: its key range, its read position, what a commit has not written yet.

A queue is built by the store (backends.lmdb.LmdbStore) with what it
uses: the environment and its `messages` database to read from, the
store's pending write set (backends.lmdb_pending) to stage its changes
in, and the store's callbacks. The store tells it, through `committed`,
`fly`, `landed`, `unfly` and `roll_back`, what became of what it staged.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import chain, islice
from typing import TYPE_CHECKING, Any, cast

from zope.interface import implementer

from backends.interface import IBackendQueue, IPiecewisePeek
from backends.lmdb_records import KEY, RECORD, RECORD_SIZE, decode_record, record_seq
from mqd.logs import get_logger
from mqd.message import Message

if TYPE_CHECKING:
    from backends.lmdb_pending import PendingWrites, Stager

__all__ = ["LmdbQueue", "PEEK_PIECE_BYTES", "PEEK_PIECE_COUNT", "READ_CACHE"]

# The store speaks for its queues: one namespace for every LMDB log line.
log = get_logger("backends.lmdb")

# Messages a durable queue keeps decoded in memory past its read position,
# so reads right after a publish need no decoding (bounded per queue).
READ_CACHE = 10000
# A piecewise peek (GET /channel/peek) reads at most this many records, and
# this many bytes of their bodies, per piece: one reactor turn's worth.
PEEK_PIECE_COUNT = 256
PEEK_PIECE_BYTES = 256 << 10


@implementer(IBackendQueue, IPiecewisePeek)
class LmdbQueue:
    """One queue's key range, its read position, and what a commit has not written yet.

    Records `first_seq` to `next_seq` of queue `qid` hold `depth`
    messages (what LMDB holds, then `restored`: messages a shutdown on a
    full disk spilled). The queue reads `env`'s `data_db`, stages its
    changes in `writes`, and calls the store's `check_writable` before
    taking messages (it raises BackendError while the store is failing),
    `read_records(n)` after reading records, `forget(self)` when deleted
    and `sync()` for `sync`. `durable`: reads keep records until FIN, and
    what is put is readable only once committed.
    """

    __slots__ = ("name", "qid", "_env", "_data_db", "_writes", "_durable", "_check_writable",
                 "_read_records", "_forget", "_sync", "_next_seq", "_read_seq", "_depth", "_tail",
                 "_held", "_staged", "_staged_held", "_flying", "on_stored")

    def __init__(self, name: str, qid: int, first_seq: int, next_seq: int, depth: int, *,
                 env: Any, data_db: Any, writes: PendingWrites[Stager], durable: bool,
                 check_writable: Callable[[], None], read_records: Callable[[int], None],
                 forget: Callable[[LmdbQueue], None], sync: Callable[[], None],
                 restored: Sequence[Message] = ()) -> None:
        self.name = name
        self.qid = qid
        self._env = env
        self._data_db = data_db
        self._writes = writes
        self._durable = durable
        self._check_writable = check_writable
        self._read_records = read_records
        self._forget = forget
        self._sync = sync
        self._next_seq = next_seq
        self._read_seq = first_seq
        self._depth = depth
        # Unread messages this process put, oldest first: default mode, every
        # one not yet committed; durable, up to READ_CACHE committed ones.
        self._tail: deque[Message] = deque(restored)
        # Durable: messages put (then held) and not committed yet, oldest
        # first. Not readable until their commit succeeds: they count in the
        # depth, and follow the tail.
        self._staged: list[Message] = []
        self._staged_held: list[Message] = []
        # Durable with a publish log: the staged and held messages of each
        # chunk being written (backends.lmdb_log), oldest first; they come
        # between the tail and the staged ones.
        self._flying: deque[tuple[list[Message], list[Message]]] = deque()
        # Durable: called after a commit made staged messages readable, with
        # the held ones among them (their owner keeps those outside the
        # queue, from then on). Set by the queue's owner (mqd.nsqd.channel, mqd.nsqd.topic).
        self.on_stored: Callable[[list[Message]], Any] | None = None
        # Keys of records stored by `hold` (deferred messages), so past the
        # read position while their messages live outside the queue: in the
        # deferred queue, then in memory or in flight once due or requeued.
        # Reads pass over them until they are FINished (or the queue is
        # emptied); releasing one earlier would let a read return it twice.
        self._held: set[bytes] = set()

    def _tail_start(self) -> int:
        # Every message the queue has put (tail, flying, staged) has its record's key.
        if self._tail:
            return record_seq(self._tail[0])
        for staged, _ in self._flying:
            if staged:
                return record_seq(staged[0])
        if self._staged:
            return record_seq(self._staged[0])
        return self._next_seq

    def put(self, messages: Sequence[Message], fresh: bool = False) -> None:
        """Store the messages at the end of the queue; `fresh`: new publishes (IBackendQueue.put).

        Durable, a commit that fails drops the fresh ones, as their
        publishers are answered with its error.
        """
        self._check_writable()
        durable = self._durable
        self._next_seq = self._writes.add(self, self.qid, self._next_seq, messages, fresh and durable)
        self._depth += len(messages)
        if durable:
            self._staged.extend(messages)
        else:
            self._tail.extend(messages)

    def hold(self, messages: Sequence[Message], fresh: bool = False) -> bool:
        """Durable: store them, and give them back through `on_stored` once committed (True)."""
        if not self._durable:
            return False
        self._check_writable()
        self._next_seq = self._writes.add(self, self.qid, self._next_seq, messages, fresh)
        # `add` gave every message its record's key.
        self._held.update(cast("list[bytes]", [m.key for m in messages]))
        self._staged_held.extend(messages)
        return True

    def read(self, count: int) -> list[Message]:
        out: list[Message] = []
        tail_start = self._tail_start()
        if self._read_seq < tail_start:
            out = self._read_stored(count, tail_start)
        tail = self._tail
        while tail and len(out) < count:
            out.append(tail.popleft())
        if out:
            self._read_seq = record_seq(out[-1]) + 1
            depth = self._depth - len(out)
            if depth < 0:
                # More read than the queue held: a record was read twice. Say
                # so, and keep the depth sane for everything sizing by it.
                log.error("queue {name}: read {n} messages with depth {depth}; depth reset to 0",
                          name=self.name, n=len(out), depth=self._depth)
                depth = 0
            self._depth = depth
            if not self._durable:
                # Without durability a read removes the records (one never
                # written is just dropped), exactly what a FIN does.
                self.finish(out)
        return out

    def _stored(self, count: int, tail_start: int) -> list[Message]:
        """Up to `count` committed records from the read position to the tail, decoded, moving nothing.

        Held and deleted keys are passed over, a pending rewrite stands in
        for its record: what `read` hands out, and what `peek` shows.
        """
        start = KEY.pack(self.qid, self._read_seq)
        stop = KEY.pack(self.qid, tail_start)
        held = self._held
        out: list[Message] = []
        writes = self._writes
        dels = writes.dels
        updates = writes.updates
        with self._env.begin(db=self._data_db, buffers=False) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start):
                return out
            for key, value in cursor:
                if key >= stop or len(out) >= count:
                    break
                if (held and key in held) or key in dels:
                    continue
                msg = updates.get(key)
                out.append(msg if msg is not None else decode_record(key, value))
        return out

    def _read_stored(self, count: int, tail_start: int) -> list[Message]:
        """Decode up to `count` committed records from the read position."""
        out = self._stored(count, tail_start)
        if not out:
            # Only held or deleted records before the cached tail.
            self._read_seq = tail_start
        self._read_records(len(out))
        return out

    def peek(self, count: int) -> list[Message]:
        """What `read(count)` would return now, decoded in a read transaction of its own.

        The same records in the same order as `read`, then the tail, but
        nothing moves: not the read position (which `read` also advances
        past held records), the depth, the tail nor the store's pending
        changes, so a peek cannot change a later read.
        """
        if count <= 0:
            return []
        tail_start = self._tail_start()
        out = self._stored(count, tail_start) if self._read_seq < tail_start else []
        if len(out) < count:
            out += islice(self._tail, count - len(out))
        return out

    def peek_pieces(self, count: int, body_limit: int) -> Iterator[list[tuple[Message, int]]]:
        """IPiecewisePeek: `peek(count)` a piece at a time, record bodies cut at `body_limit`.

        A piece is at most PEEK_PIECE_COUNT records and PEEK_PIECE_BYTES
        of body, read in a transaction of its own from past the last
        sequence number handed out (or the read position, if reads went
        further meanwhile), so what was read away in between is skipped.
        """
        per_piece = max(1, min(PEEK_PIECE_COUNT, PEEK_PIECE_BYTES // (body_limit + RECORD_SIZE)))
        after = -1
        while count > 0:
            piece, after = self._peek_piece(after, min(count, per_piece), body_limit)
            if not piece:
                return
            count -= len(piece)
            yield piece

    def _peek_piece(self, after: int, count: int, body_limit: int) -> tuple[list[tuple[Message, int]], int]:
        """Up to `count` (message, size) past sequence number `after`, and the last one's number."""
        start = max(self._read_seq, after + 1)
        tail_start = self._tail_start()
        out, last = self._peek_stored(start, tail_start, count, body_limit) if start < tail_start else ([], after)
        tail = self._tail
        if len(out) < count and tail:
            first = bisect_left(tail, start, key=record_seq)
            for msg in islice(tail, first, None):
                if msg.key is None:  # finished meanwhile: gone
                    continue
                out.append((msg, msg.body_size))
                last = record_seq(msg)
                if len(out) >= count:
                    break
        return out, last

    def _peek_stored(self, start: int, stop: int, count: int,
                     body_limit: int) -> tuple[list[tuple[Message, int]], int]:
        """As `_stored` from sequence number `start`, only `body_limit` bytes of each body copied.

        Returns the (message, size) pairs and the sequence number of the last.
        """
        start_key = KEY.pack(self.qid, start)
        stop_key = KEY.pack(self.qid, stop)
        held = self._held
        writes = self._writes
        dels = writes.dels
        updates = writes.updates
        out: list[tuple[Message, int]] = []
        last = start - 1
        with self._env.begin(db=self._data_db, buffers=True) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start_key):
                return out, last
            for raw_key, value in cursor:
                key = bytes(raw_key)
                if key >= stop_key or len(out) >= count:
                    break
                if (held and key in held) or key in dels:
                    continue
                last = KEY.unpack(key)[1]
                msg = updates.get(key)
                if msg is None:
                    timestamp, attempts, deferred_until, msg_id = RECORD.unpack_from(value)
                    body = bytes(value[RECORD_SIZE:RECORD_SIZE + body_limit])
                    msg = Message(msg_id, body, timestamp, attempts, deferred_until)
                    msg.key = key
                    out.append((msg, len(value) - RECORD_SIZE))
                else:
                    out.append((msg, msg.body_size))
        return out, last

    def finish(self, messages: Sequence[Message]) -> None:
        """The messages are done for good: forget their records, written or not.

        A reader FINs every message, so this runs once per run of FINs and
        works a step at a time over the whole run rather than message by
        message: most records are not in LMDB yet (a checkpoint comes
        every so often), and leave the pending puts without being written.
        """
        keys = [msg.key for msg in messages]
        if None in keys:
            keys = [key for key in keys if key is not None]
            if not keys:
                return
        for msg in messages:
            msg.key = None
        if self._held:
            self._held.difference_update(keys)
        self._writes.finish(cast("list[bytes]", keys))  # no None left (filtered above)

    def update(self, messages: Sequence[Message]) -> None:
        """Rewrite the records; a held one stays held (its message is still outside the queue)."""
        self._writes.update(messages)

    def depth(self) -> int:
        return self._depth

    def empty(self) -> None:
        """Drop every record up to now, and everything not yet written."""
        self._writes.drop_queue(self.qid, self._next_seq)
        for msg in self._tail:
            msg.key = None
        for msg in chain(self._staged_held, *chain.from_iterable(self._flying)):
            msg.key = None
        self._tail.clear()
        self._staged.clear()
        self._staged_held.clear()
        # Chunks being written still land, one `landed` each, in order: each
        # keeps its place, with nothing in it to make readable.
        self._flying = deque(([], []) for _ in self._flying)
        self._held.clear()
        self._read_seq = self._next_seq
        self._depth = 0

    def delete(self) -> None:
        self.empty()
        self._forget(self)

    def close(self) -> None:
        """The store commits and closes everything at once."""

    def sync(self) -> None:
        self._sync()

    # -- what became of what was staged: told by the store ---------------------------------

    def committed(self) -> list[Message] | None:
        """After a commit: staged messages become readable; the read cache is trimmed.

        Returns the held messages just committed when the owner must hear
        of the commit (`on_stored`), else None.
        """
        staged = self._staged
        held = self._staged_held
        tail = self._tail
        if staged:
            tail.extend(staged)
            self._staged = []
        if held:
            self._staged_held = []
        limit = READ_CACHE if self._durable else 0
        puts = self._writes.puts
        while len(tail) > limit and tail[0].key not in puts:
            tail.popleft()
        return held if (staged or held) and self.on_stored is not None else None

    def fly(self) -> bool:
        """A chunk of the publish log is taken: the staged messages are in it (True if any)."""
        if not (self._staged or self._staged_held):
            return False
        self._flying.append((self._staged, self._staged_held))
        self._staged, self._staged_held = [], []
        return True

    def landed(self) -> list[Message] | None:
        """The oldest chunk is synced: its messages are readable; the held ones for `on_stored`, as `committed`."""
        flying, held = self._flying.popleft()
        if flying:
            self._tail.extend(flying)
        return held if (flying or held) and self.on_stored is not None else None

    def unfly(self) -> None:
        """The chunks failed: their messages are staged again, in order, ahead of those staged since."""
        flying = self._flying
        self._staged[:0] = [m for staged, _ in flying for m in staged]
        self._staged_held[:0] = [m for _, held in flying for m in held]
        flying.clear()

    def roll_back(self, keys: list[bytes]) -> None:
        """After a failed commit: forget its new publishes, whose records (`keys`) the write set dropped.

        Their messages have no key any more; held ones are held no longer.
        """
        if keys and self._held:
            self._held.difference_update(keys)
        staged = self._staged
        kept = [m for m in staged if m.key is not None]
        if len(kept) != len(staged):
            self._depth -= len(staged) - len(kept)
            self._staged = kept
        if self._staged_held:
            self._staged_held = [m for m in self._staged_held if m.key is not None]
