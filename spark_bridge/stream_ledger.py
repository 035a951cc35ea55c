"""What the streaming source knows about every message it holds: the rules of exactly-once.

NSQ identifies a delivery by (broker, message id), and delivers a message
again when it is not FINished in time, when the consumer's connection ends,
or when a broker restarts with it still in flight. The ledger decides what
each delivery means, given what the write-ahead log holds:

- a message no batch holds is *new*: it waits in `pending` for the next
  batch (a second delivery before then replaces the first, so the batch
  holds it once, with the delivery that can still be FINished);
- a message an uncommitted batch holds is *held*: it is that batch's row
  already, so it is not emitted again; the newest delivery is kept so
  that it can be TOUCHed and FINished when Spark commits the batch;
- a message a committed batch holds is *finished* at once: Spark has it,
  and the broker only redelivered it because the FIN never reached it.

A committed batch is forgotten (its WAL file removed) once every one of
its messages has a FIN that the broker surely read (`confirm`); until
then a redelivery is still recognised. `expire` forgets committed batches
older than a retention limit even so, which bounds the log when a broker
never redelivers what it lost.

Nothing here does I/O or reads a clock, so the rules can be tested on
every order of events (tests/unit/test_stream_ledger.py); the source
(stream_source.py) feeds it deliveries and carries out its answers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["FINISH", "HELD", "NEW", "Ledger", "LedgerBatch"]

Key = tuple[str, bytes]  # (broker address, message id)

NEW = "new"
HELD = "held"
FINISH = "finish"


class LedgerBatch:
    """One batch of the WAL: its offsets, its messages' keys, and what is still to settle."""

    __slots__ = ("start", "end", "keys", "committed", "unconfirmed", "since")

    def __init__(self, start: int, end: int, keys: list[Key], committed: bool, since: float) -> None:
        self.start = start
        self.end = end
        self.keys = keys
        self.committed = committed
        self.unconfirmed = set(keys)  # no FIN the broker surely read yet
        self.since = since  # when it was written or recovered (retention)

    def __repr__(self) -> str:
        state = "committed" if self.committed else "open"
        return f"<LedgerBatch {self.start}-{self.end} {state} unconfirmed={len(self.unconfirmed)}>"


class Ledger:
    """Pending deliveries, the WAL's batches, and which delivery of each held message is live."""

    def __init__(self) -> None:
        self.pending: dict[Key, Any] = {}
        self.batches: dict[int, LedgerBatch] = {}  # by end offset, in offset order
        self.batch_of: dict[Key, LedgerBatch] = {}
        self.live: dict[Key, Any] = {}  # newest delivery of a message an open batch holds
        self.end = 0  # the highest offset written
        self.committed = 0

    # -- deliveries ------------------------------------------------------------

    def delivered(self, key: Key, delivery: Any) -> str:
        """NEW (now pending), HELD (an open batch has it) or FINISH (a committed batch has it)."""
        batch = self.batch_of.get(key)
        if batch is None:
            self.pending[key] = delivery
            return NEW
        if batch.committed:
            return FINISH
        self.live[key] = delivery
        return HELD

    def take(self, limit: int | None) -> list[tuple[Key, Any]]:
        """Up to `limit` pending deliveries, oldest first, removed from pending for a batch."""
        pending = self.pending
        if limit is None or limit >= len(pending):
            taken = list(pending.items())
            pending.clear()
            return taken
        # Rebuilt rather than popped from the front: a dict iterated after deleting its first
        # entries walks over their holes, which made taking n messages cost O(n^2).
        items = list(pending.items())
        self.pending = dict(items[limit:])
        return items[:limit]

    def give_back(self, taken: list[tuple[Key, Any]]) -> None:
        """Undo `take` (the batch could not be written): those messages are pending again, first.

        A message redelivered while the batch was being written keeps its
        newer delivery (the one that can still be FINished).
        """
        rest = self.pending
        self.pending = {key: rest.pop(key, delivery) for key, delivery in taken}
        self.pending.update(rest)

    # -- batches -----------------------------------------------------------------

    def add_batch(self, start: int, end: int, keys: list[Key], deliveries: Iterable[Any] = (),
                  *, since: float = 0.0) -> LedgerBatch:
        """A batch now in the WAL: written from `take`'s deliveries, or recovered (no deliveries)."""
        if start < self.end and self.batches:
            raise ValueError(f"batch {start}-{end} overlaps offsets up to {self.end}")
        # A gap is fine: batches are forgotten one by one, so a recovered WAL may have holes.
        batch = LedgerBatch(start, end, keys, end <= self.committed, since)
        self.batches[end] = batch
        deliveries = list(deliveries)
        pending = self.pending
        for i, key in enumerate(keys):
            self.batch_of[key] = batch
            # Redelivered while the batch was being written: that delivery is the live one.
            newer = pending.pop(key, None)
            if not batch.committed:
                delivery = newer if newer is not None else (deliveries[i] if i < len(deliveries) else None)
                if delivery is not None:
                    self.live[key] = delivery
        self.end = max(self.end, end)
        return batch

    def open_batches(self, start: int) -> list[LedgerBatch]:
        """The uncommitted batches from offset `start` on, contiguous and in order."""
        out = []
        at = start
        for batch in self.batches.values():
            if batch.start == at and not batch.committed:
                out.append(batch)
                at = batch.end
        return out

    def commit(self, offset: int) -> list[tuple[LedgerBatch, Key, Any]]:
        """Spark has committed every batch up to `offset`: the live deliveries to FINish now."""
        if offset <= self.committed:
            return []
        self.committed = offset
        finish = []
        for batch in self.batches.values():
            if batch.end > offset:
                break
            if batch.committed:
                continue
            batch.committed = True
            live = self.live
            for key in batch.keys:
                delivery = live.pop(key, None)
                if delivery is not None:
                    finish.append((batch, key, delivery))
        return finish

    # -- forgetting --------------------------------------------------------------

    def confirm(self, keys: Iterable[Key]) -> list[LedgerBatch]:
        """The broker surely read the FINs of `keys`: the committed batches now fully settled."""
        done = []
        batch_of = self.batch_of
        for key in keys:
            batch = batch_of.get(key)
            if batch is None or not batch.committed:
                continue
            batch.unconfirmed.discard(key)
            if not batch.unconfirmed and batch.end in self.batches:
                done.append(batch)
                self._forget(batch)
        return done

    def expire(self, before: float) -> list[LedgerBatch]:
        """Forget committed batches written before `before`, settled or not."""
        old = [b for b in self.batches.values() if b.committed and b.since < before]
        for batch in old:
            self._forget(batch)
        return old

    def _forget(self, batch: LedgerBatch) -> None:
        del self.batches[batch.end]
        batch_of = self.batch_of
        for key in batch.keys:
            if batch_of.get(key) is batch:
                del batch_of[key]

    # -- state -------------------------------------------------------------------

    def in_flight(self) -> int:
        """Deliveries the source holds unanswered: pending and in open batches."""
        return len(self.pending) + len(self.live)
