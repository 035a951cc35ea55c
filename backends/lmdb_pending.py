"""The LMDB store's pending write set: everything changed since LMDB last took it, and when it will.

The store's queues (and retained logs) stage here what they put,
finish, rewrite and drop; the store writes it into LMDB at a checkpoint
(one transaction, or a few bounded ones) and, durable with a publish
log, takes what changed since the last chunk of the log as the next
chunk. Nothing here knows LMDB:
this is the bookkeeping both read, changed only through these methods.

- new records (`puts`) and rewrites of stored ones (`updates`), by key;
  deleted keys (`dels`), emptied queues' key ranges (`drops`, also the
  expired head of a retained log), the queue registry's changes, and
  `meta` keys (a retained log's epoch and offset floor);
- the new publishes among the puts (`fresh`): a commit that fails drops
  them, as their publishers are answered with the error;
- the queues with messages waiting for the next checkpoint, and for the
  next chunk of the publish log (they become readable once it lands);
- what changed since the last chunk was taken (batches of new and of
  rewritten messages, deleted keys), when there is a publish log;
- who waits for the next commit (`when_durable`), and the commit itself:
  one `callLater` at a time calls the store's commit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence, Set
from typing import Any, Generic, Protocol, TypeVar

from backends.lmdb_records import KEY, QID
from mqd.message import Message

__all__ = ["Chunk", "PendingWrites", "Stager", "Waiter"]

Q = TypeVar("Q", bound=Hashable)
# Called once what was gathered before is durable (None) or failed (the error).
Waiter = Callable[[str | None], Any]


class Stager(Protocol):
    """What stages records here and is told by the store what became of them: a queue, or a retained log.

    `committed` after a checkpoint, `fly` when a chunk of the publish log
    takes what it staged, `landed` when that chunk is synced, `unfly` when
    chunks failed, `roll_back` with the keys of the new publishes a failed
    commit dropped (backends.lmdb_queue.LmdbQueue has the details).
    """

    name: str
    on_stored: Callable[[list[Message]], Any] | None

    def committed(self) -> list[Message] | None: ...

    def fly(self) -> bool: ...

    def landed(self) -> list[Message] | None: ...

    def unfly(self) -> None: ...

    def roll_back(self, keys: list[bytes]) -> None: ...

    def __hash__(self) -> int: ...


class Chunk(Generic[Q]):
    """What changed since the last chunk of the publish log was taken, for the next one (`PendingWrites.take_chunk`)."""

    __slots__ = ("waiters", "fresh", "puts", "updates", "dels", "staging")

    def __init__(self, waiters: list[Waiter], fresh: list[tuple[Q, Sequence[Message]]],
                 puts: list[Sequence[Message]], updates: list[Sequence[Message]], dels: list[bytes],
                 staging: set[Q]) -> None:
        self.waiters = waiters
        self.fresh = fresh
        self.puts = puts
        self.updates = updates
        self.dels = dels
        # The queues with messages staged since the last chunk was taken.
        self.staging = staging


class PendingWrites(Generic[Q]):
    """Everything a commit has yet to write, staged by the store's queues (`Q`); see the module's text.

    `logged`: the store has a publish log, so what changes is also kept
    for its next chunk. `commit` is the store's, called on `clock` when
    `schedule`d.
    """

    __slots__ = ("_clock", "_commit", "_commit_call", "_puts", "_updates", "_dels", "_drops",
                 "_registry_puts", "_registry_dels", "_meta", "_probe", "_fresh", "_touched", "_staging",
                 "_log_puts", "_log_updates", "_log_dels", "_waiters")

    def __init__(self, clock: Any, commit: Callable[[], None], logged: bool) -> None:
        self._clock = clock
        self._commit = commit
        self._commit_call: Any = None
        self._puts: dict[bytes, Message] = {}
        self._updates: dict[bytes, Message] = {}
        self._dels: set[bytes] = set()
        self._drops: list[tuple[int, int]] = []
        self._registry_puts: dict[bytes, bytes] = {}
        self._registry_dels: set[bytes] = set()
        # meta keys to write (None: to delete), with the registry.
        self._meta: dict[bytes, bytes | None] = {}
        # A commit must write something even with nothing pending: a write
        # failed, and only a commit that succeeds shows there is room again.
        self._probe = False
        # The new publishes staged since the last commit (or chunk), with their queue.
        self._fresh: list[tuple[Q, Sequence[Message]]] = []
        # Queues with messages a checkpoint makes readable; queues with
        # messages staged since the last chunk of the publish log.
        self._touched: set[Q] = set()
        self._staging: set[Q] = set()
        # What changed since the last chunk was taken (None without a log):
        # batches of new and of rewritten messages, and deleted keys.
        self._log_puts: list[Sequence[Message]] | None = [] if logged else None
        self._log_updates: list[Sequence[Message]] = []
        self._log_dels: list[bytes] | None = [] if logged else None
        self._waiters: list[Waiter] = []

    # -- what is pending (read only) ---------------------------------------------------

    @property
    def puts(self) -> Mapping[bytes, Message]:
        """New records by key: their messages as they are now."""
        return self._puts

    @property
    def updates(self) -> Mapping[bytes, Message]:
        """Rewrites of stored records by key: each stands in for its stored record."""
        return self._updates

    @property
    def dels(self) -> Set[bytes]:
        """Keys of stored records to delete."""
        return self._dels

    @property
    def drops(self) -> Sequence[tuple[int, int]]:
        """(queue id, bound): every record of the queue below the bound goes (an emptied queue)."""
        return self._drops

    @property
    def registry_puts(self) -> Mapping[bytes, bytes]:
        """Queue names to register, with their packed ids."""
        return self._registry_puts

    @property
    def registry_dels(self) -> Set[bytes]:
        """Queue names to unregister."""
        return self._registry_dels

    @property
    def meta_puts(self) -> Mapping[bytes, bytes | None]:
        """`meta` keys to write, with their values (None: delete the key)."""
        return self._meta

    @property
    def probing(self) -> bool:
        """The next commit writes something even with nothing pending (`probe`)."""
        return self._probe

    @property
    def commit_call(self) -> Any:
        """The scheduled commit (an IDelayedCall), or None."""
        return self._commit_call

    def pending(self) -> bool:
        """Anything for LMDB to take."""
        return bool(self._puts or self._updates or self._dels or self._drops
                    or self._registry_puts or self._registry_dels or self._meta or self._probe)

    def structural(self) -> bool:
        """A queue emptied, registered or unregistered, a meta key, or a probe: LMDB must take it at once."""
        return bool(self._drops or self._registry_puts or self._registry_dels or self._meta or self._probe)

    def records(self) -> int:
        """How many records a commit would write or delete now."""
        return len(self._puts) + len(self._updates) + len(self._dels)

    def chunk_wanted(self) -> bool:
        """Somebody waits for the next commit, or new messages were staged since the last chunk."""
        return bool(self._waiters or self._log_puts)

    # -- staging, by the queues -----------------------------------------------------------

    def add(self, queue: Q, qid: int, seq: int, messages: Sequence[Message], fresh: bool) -> int:
        """Give the messages the keys of `queue` (`qid`) from `seq` on and stage them; the next free sequence.

        `fresh`: they are new publishes (see `take_fresh`).
        """
        puts = self._puts
        pack = KEY.pack
        for msg in messages:
            msg.key = key = pack(qid, seq)
            puts[key] = msg
            seq += 1
        self._staged(queue, messages, fresh)
        return seq

    def _staged(self, queue: Q, messages: Sequence[Message], fresh: bool) -> None:
        """`queue` staged `messages` (keyed already): for the next chunk, the next checkpoint, a failed commit."""
        if self._log_puts is not None:
            self._log_puts.append(messages)
            self._staging.add(queue)
        self._touched.add(queue)
        if fresh:
            self._fresh.append((queue, messages))
        self.schedule()

    def add_spans(self, queue: Q, qid: int, seq: int, messages: Sequence[Message], spans: Sequence[int],
                  fresh: bool) -> int:
        """`add` for records that each stand for `spans[i]` sequences (a retained log's batches of offsets).

        Record i gets the key of its first sequence; the next free
        sequence is returned.
        """
        seq = self._key_spans(qid, seq, messages, spans)
        self._staged(queue, messages, fresh)
        return seq

    def _key_spans(self, qid: int, seq: int, messages: Sequence[Message], spans: Sequence[int]) -> int:
        """Key record i of `messages` at its first sequence from `seq` on (`spans[i]` each) and stage it; the next free sequence."""
        puts = self._puts
        pack = KEY.pack
        for msg, span in zip(messages, spans, strict=True):
            msg.key = key = pack(qid, seq)
            puts[key] = msg
            seq += span
        return seq

    def finish(self, keys: list[bytes]) -> None:
        """These records are done for good: one never written is forgotten, a written one deleted."""
        updates = self._updates
        if updates:
            for key in keys:
                updates.pop(key, None)
        pop = self._puts.pop
        written = [key for key in keys if pop(key, None) is None]
        if written:
            self._dels.update(written)
        if self._log_dels is not None:
            self._log_dels += keys
        self.schedule()

    def update(self, messages: Sequence[Message]) -> None:
        """Rewrite these messages' records (a new one is written as it is now anyway)."""
        puts = self._puts
        updates = self._updates
        for msg in messages:
            key = msg.key
            if key is None:
                continue
            if key not in puts:
                updates[key] = msg
        if self._log_puts is not None:
            self._log_updates.append(messages)
        self.schedule()

    def drop_queue(self, qid: int, bound: int) -> None:
        """Every record of queue `qid` below sequence `bound` goes, written or not; their messages lose their keys."""
        self._drop(qid, bound, every=True)

    def drop_below(self, qid: int, bound: int) -> None:
        """Every record of queue `qid` below sequence `bound` goes, written or not (a retained log's expired head).

        Pending records from `bound` on stay, to be written after the
        range is deleted; those below lose their keys.
        """
        self._drop(qid, bound, every=False)

    def _drop(self, qid: int, bound: int, every: bool) -> None:
        """Stage the drop of queue `qid`'s records below `bound`; unstage its pending ones (`every`: all of them)."""
        prefix = QID.pack(qid)
        stop = KEY.pack(qid, bound)
        self._drops.append((qid, bound))
        for table in (self._puts, self._updates):
            for key in [k for k in table if k.startswith(prefix) and (every or k < stop)]:
                table[key].key = None
                del table[key]
        self.schedule()

    def rekey(self, qid: int, seq: int, messages: Sequence[Message], spans: Sequence[int] | None = None) -> int:
        """Give staged new records of queue `qid` the keys from `seq` on, in order; the next free sequence.

        A retained log closes the gap a failed commit's dropped records
        left: nobody saw the records renumbered, as none was readable.
        `spans`: the sequences each record stands for (one each if None).
        """
        puts = self._puts
        for msg in messages:
            if msg.key is not None:
                puts.pop(msg.key, None)
        return self._key_spans(qid, seq, messages, spans if spans is not None else [1] * len(messages))

    # -- staging, by the store ----------------------------------------------------------

    def put_meta(self, key: bytes, value: bytes | None) -> None:
        """Write `value` under `key` in the `meta` database with the next checkpoint (None: delete the key)."""
        self._meta[key] = value
        self.schedule()

    def register(self, name: bytes, qid: bytes) -> None:
        """Register queue `name` under the packed id `qid`."""
        self._registry_puts[name] = qid
        self._registry_dels.discard(name)
        self.schedule()

    def unregister(self, name: bytes, queue: Q) -> None:
        """Unregister queue `name` (deleted): its staged messages are nobody's to hand over."""
        self._registry_puts.pop(name, None)
        self._registry_dels.add(name)
        self._touched.discard(queue)
        self.schedule()

    def restore(self, key: bytes, msg: Message, stored: bool) -> None:
        """A record read back from a spill file: a rewrite if LMDB has it (`stored`), else a new record."""
        if stored:
            self._updates[key] = msg
        else:
            self._puts[key] = msg

    def touch(self, queue: Q) -> None:
        """`queue` holds messages the next checkpoint hands over (`committed`)."""
        self._touched.add(queue)

    def probe(self) -> None:
        """Make the next commit write something even with nothing pending."""
        self._probe = True

    # -- the commit ------------------------------------------------------------------------

    def schedule(self) -> None:
        """Commit at the start of the next reactor turn, unless a commit is scheduled already."""
        if self._commit_call is None:
            self._commit_call = self._clock.callLater(0, self._commit)

    def retry_in(self, delay: float) -> None:
        """Commit in `delay` seconds (a retry), instead of any commit scheduled."""
        if self._commit_call is not None and self._commit_call.active():
            self._commit_call.cancel()
        self._commit_call = self._clock.callLater(delay, self._commit)

    def unschedule(self) -> None:
        """The commit runs now (or never, at close): no other is scheduled."""
        if self._commit_call is not None and self._commit_call.active():
            self._commit_call.cancel()
        self._commit_call = None

    def wait(self, callback: Waiter) -> None:
        """Call `callback` once the next commit is over, and schedule it."""
        self._waiters.append(callback)
        self.schedule()

    def take_waiters(self) -> list[Waiter]:
        """Who waits for the commit starting now."""
        waiters, self._waiters = self._waiters, []
        return waiters

    def return_waiters(self, waiters: list[Waiter]) -> None:
        """The commit did not happen: `waiters` wait for the next one, ahead of those since."""
        self._waiters[:0] = waiters

    def take_fresh(self) -> list[tuple[Q, Sequence[Message]]]:
        """The new publishes staged since the last commit (and the queues they went to), for a failed commit to drop."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def fresh_keys(self) -> set[bytes | None]:
        """The keys of the new publishes staged since the last commit."""
        return {m.key for _, msgs in self._fresh for m in msgs}

    def drop_fresh(self, fresh: list[tuple[Q, Sequence[Message]]]) -> dict[Q, list[bytes]]:
        """Unstage the new publishes of a failed commit: no record, no key; the keys they had, by queue."""
        puts = self._puts
        dropped: dict[Q, list[bytes]] = {}
        for queue, messages in fresh:
            keys = dropped.setdefault(queue, [])
            for msg in messages:
                key = msg.key
                if key is None:  # its queue was emptied meanwhile
                    continue
                msg.key = None
                puts.pop(key, None)
                keys.append(key)
        return dropped

    def written(self, records: Iterable[tuple[bytes, Message]]) -> None:
        """Part of a big commit is written: these (key, message) pairs are pending no more."""
        puts, updates = self._puts, self._updates
        for key, _ in records:
            if puts.pop(key, None) is None:
                updates.pop(key, None)

    def records_written(self) -> None:
        """Every new and rewritten record is written."""
        self._puts.clear()
        self._updates.clear()

    def meta_written(self) -> None:
        """Deletions, drops, the registry, meta keys and the probe are written."""
        self._dels.clear()
        self._drops.clear()
        self._registry_puts.clear()
        self._registry_dels.clear()
        self._meta.clear()
        self._probe = False

    def checkpointed(self) -> set[Q]:
        """LMDB holds everything: nothing is left to drop nor to log; the queues whose messages it made readable."""
        self._fresh.clear()
        if self._log_puts is not None and self._log_dels is not None:
            self._log_puts.clear()
            self._log_updates.clear()
            self._log_dels.clear()
        touched, self._touched = self._touched, set()
        return touched

    def forget_fresh(self) -> None:
        """Nothing was left to write: the new publishes (of emptied queues, if any) need no dropping."""
        self._fresh.clear()

    # -- chunks of the publish log ----------------------------------------------------------

    def take_chunk(self) -> Chunk[Q]:
        """What changed since the last chunk was taken, and who waits for it; gathered anew from here."""
        chunk = Chunk(self._waiters, self._fresh, self._log_puts or [], self._log_updates,
                      self._log_dels or [], self._staging)
        self._waiters, self._fresh = [], []
        self._log_puts, self._log_updates, self._log_dels = [], [], []
        self._staging = set()
        return chunk

    def put_back(self, chunks: list[Chunk[Q]], queues: set[Q]) -> None:
        """The chunks failed: what they held goes into the next one again, in order, ahead of what came since.

        `queues` had messages in them, staged again. Their waiters and
        new publishes are not taken back: the caller answers and drops those.
        """
        assert self._log_puts is not None and self._log_dels is not None
        self._staging |= queues
        self._log_puts[:0] = [batch for chunk in chunks for batch in chunk.puts]
        self._log_updates[:0] = [batch for chunk in chunks for batch in chunk.updates]
        self._log_dels[:0] = [key for chunk in chunks for key in chunk.dels]
