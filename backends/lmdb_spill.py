"""A shutdown on a full disk: what LMDB cannot take goes to a spill file, taken back at the next start.

A clean shutdown writes everything pending in one transaction. When the
disk is full that fails, so the writes are retried in ever smaller
transactions (what matters most first), and whatever still does not fit
is written, with a checksum, to `mqd.lmdb.spill` next to the environment.
The next start stages the file's records for its first commit and removes
the file once that commit has written them.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lmdb
from twisted.internet.defer import Deferred

from backends.interface import StoreOpenError
from backends.lmdb_records import KEY, QID, RECORD_SIZE, decode_record, drop_range, encode_record
from mqd.logs import get_logger

if TYPE_CHECKING:
    from backends.lmdb_pending import PendingWrites, Stager
    from mqd.message import Message

__all__ = ["SPILL_FILE", "SpillingShutdown", "parse_spill", "spill_bytes"]

# The store speaks for its shutdown: one namespace for every LMDB log line.
log = get_logger("backends.lmdb")

# What a clean shutdown could not write into LMDB (a full disk), next to the
# environment; the next start writes it back (see LmdbStore.close).
SPILL_FILE = "mqd.lmdb.spill"
SPILL_MAGIC = b"mqd-spill-1\n"
SPILL_ENTRY = struct.Struct(">BII")  # kind, key length, value length
SPILL_END = struct.Struct(">BII")  # 0xFF, entry count, CRC-32 of the entries
SPILL_REGISTRY, SPILL_RECORD, SPILL_DONE = 1, 2, 0xFF
# A shutdown whose one-transaction commit failed writes in transactions of
# at most this many changes (halved on each failure down to one), so what
# fits on the disk is kept.
_CLOSE_CHUNK = 1024
_CLOSE_CHUNK_BYTES = 4 << 20
# Write operations of a bounded commit, in the order they are applied.
_META, _DROP, _DEL, _REG_DEL, _REG_PUT, _PUT = range(6)


class SpillingShutdown:
    """LmdbStore's shutdown and start-up on a full disk (a mixin: it works on the store's state)."""

    # The store's state this works on, set by LmdbStore (see there).
    RETRY_AFTER: float
    clock: Any
    spill_path: str
    failure: str | None
    env: lmdb.Environment
    meta_db: Any  # py-lmdb's database handles (backends.lmdb_env.Environment)
    registry_db: Any
    data_db: Any
    _known: dict[str, int]
    _next_qid: int
    _writes: PendingWrites[Stager]
    _spilled: dict[int, list[Message]]
    _spill_loaded: bool

    if TYPE_CHECKING:
        # The store's own, called from here.
        def _grow(self) -> None: ...

        def sync(self) -> None: ...

    def _load_spill(self) -> None:
        """Take back what the last shutdown could not write (see close): it is staged for the next commit.

        The records keep their keys, so each queue gets them back in place,
        after what LMDB holds; they are served from memory until the commit
        writes them, and the file goes once a commit has.
        """
        try:
            with open(self.spill_path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            raise StoreOpenError(f"{self.spill_path}: cannot read the spill file: {e.strerror}") from None
        try:
            entries = parse_spill(raw)
        except ValueError as e:
            raise StoreOpenError(
                f"{self.spill_path}: corrupt spill file ({e}); move it away to start without "
                f"the messages it holds") from None
        records = 0
        with self.env.begin(db=self.data_db, buffers=False) as txn:
            for kind, key, value in entries:
                if kind == SPILL_REGISTRY:
                    name = key.decode()
                    if name not in self._known:
                        self._known[name] = QID.unpack(value)[0]
                        self._writes.register(key, value)
                    continue
                msg = decode_record(key, value)
                records += 1
                if txn.get(key) is not None:
                    self._writes.restore(key, msg, stored=True)  # a rewrite of a record LMDB has
                else:
                    self._writes.restore(key, msg, stored=False)
                    self._spilled.setdefault(QID.unpack_from(key)[0], []).append(msg)
        self._next_qid = max(self._known.values(), default=0) + 1
        self._spill_loaded = True
        log.warn("{spill}: {n} messages the last shutdown could not write to LMDB are back; "
                 "the file is removed once they are written", spill=self.spill_path, n=records)
        self._writes.schedule()

    # -- a shutdown on a full disk ----------------------------------------------------------

    def _ordered_ops(self) -> list[tuple[int, Any, Any]]:
        """Everything pending as write operations, what matters most first.

        Deletions first: they free pages, and FINished messages must not come
        back. Then the registry (records of an unregistered queue are never
        read), then new messages, each queue's oldest first so what is kept of
        a queue is its head, and last the rewrites of stored records (their
        attempts and deferral), whose messages LMDB already holds. Before
        all, `meta` keys written (a retained log's offset floor must land
        no later than the drop of its expired head); those deleted go
        with the registry's deletions. Neither is spilled.
        """
        writes = self._writes
        meta = writes.meta_puts
        ops: list[tuple[int, Any, Any]] = [(_META, key, value) for key, value in meta.items() if value is not None]
        ops += [(_DROP, qid, bound) for qid, bound in writes.drops]
        ops += [(_DEL, key, None) for key in sorted(writes.dels)]
        ops += [(_REG_DEL, name, None) for name in sorted(writes.registry_dels)]
        ops += [(_META, key, None) for key, value in meta.items() if value is None]
        ops += [(_REG_PUT, name, qid) for name, qid in sorted(writes.registry_puts.items())]
        ops += [(_PUT, key, encode_record(msg)) for key, msg in sorted(writes.puts.items())]
        ops += [(_PUT, key, encode_record(msg)) for key, msg in sorted(writes.updates.items())]
        return ops

    def _write_ops(self, ops: Sequence[tuple[int, Any, Any]]) -> None:
        """Apply write operations in one transaction."""
        with self.env.begin(write=True, db=self.data_db) as txn:
            for op, key, value in ops:
                if op == _PUT:
                    txn.put(key, value)
                elif op == _DEL:
                    txn.delete(key)
                elif op == _REG_PUT:
                    txn.put(key, value, db=self.registry_db)
                elif op == _REG_DEL:
                    txn.delete(key, db=self.registry_db)
                elif op == _META:
                    if value is None:
                        txn.delete(key, db=self.meta_db)
                    else:
                        txn.put(key, value, db=self.meta_db)
                else:
                    drop_range(txn, key, value)

    def _write_bounded(self, ops: Sequence[tuple[int, Any, Any]]) -> tuple[int, str | None]:
        """Write `ops` in order in bounded transactions; (how many were written, the last error).

        A transaction that does not fit is retried at half its size, down to
        one operation: the first single operation that does not fit ends it.
        """
        done, limit, error = 0, _CLOSE_CHUNK, None
        while done < len(ops):
            end, size = done, 0
            while end < len(ops) and end - done < limit and size < _CLOSE_CHUNK_BYTES:
                value = ops[end][2]
                size += len(value) if isinstance(value, bytes) else 16
                end += 1
            try:
                self._write_ops(ops[done:end])
            except lmdb.MapFullError:
                self._grow()
                continue
            except lmdb.Error as e:
                error = str(e)
                if end - done == 1:
                    break
                limit = (end - done) // 2
                continue
            done = end
        return done, error

    def _close_bounded(self) -> Deferred[None] | None:
        """The shutdown's commit failed: keep what fits, spill the rest, say so in one line.

        Returns a Deferred when not even the spill file could be written:
        the store then retries both every second until one works.
        """
        ops = self._ordered_ops()
        total = sum(1 for op in ops if op[0] == _PUT)
        done, error = self._write_bounded(ops)
        left = ops[done:]
        if not left:
            self._finish_close(True, False)
            log.warn("closing LMDB: the shutdown's commit failed ({error}); written in smaller "
                     "transactions instead", error=self.failure)
            return None
        spill = [op for op in left if op[0] in (_PUT, _REG_PUT)]
        unwritten = sum(1 for op in spill if op[0] == _PUT)
        deletions = sum(1 for op in left if op[0] in (_DROP, _DEL, _REG_DEL))
        also = (f"; {deletions} deletions not written either (FINished messages may be delivered again)"
                if deletions else "")
        try:
            self._write_spill(spill)
        except OSError as e:
            log.error("closing LMDB: {n} of {total} messages could not be written ({error}) nor saved "
                      "to {spill} ({spill_error}): waiting for free space under {path}, retrying every "
                      "{s:g}s (killing the broker now loses them){also}", n=unwritten, total=total,
                      error=error, spill=self.spill_path, spill_error=e.strerror,
                      path=os.path.abspath(os.path.dirname(self.spill_path) or "."), s=self.RETRY_AFTER,
                      also=also)
            closed: Deferred[None] = Deferred()
            self.clock.callLater(self.RETRY_AFTER, self._retry_close, spill, closed)
            return closed
        self._finish_close(False, False)
        log.error("closing LMDB: {n} of {total} messages could not be written ({error}); saved to "
                  "{spill}, written back at the next start{also}", n=unwritten, total=total,
                  error=error, spill=self.spill_path, also=also)
        return None

    def _retry_close(self, ops: Sequence[tuple[int, Any, Any]], closed: Deferred[None]) -> None:
        """Waiting at shutdown for room: write into LMDB what fits now, else try the spill file again."""
        try:
            done, _ = self._write_bounded(ops)
            ops = ops[done:]
            spilled = False
            if ops:
                try:
                    self._write_spill(ops)
                    spilled = True
                except OSError:
                    self.clock.callLater(self.RETRY_AFTER, self._retry_close, ops, closed)
                    return
            self._finish_close(not spilled, True)
        except Exception:
            # A bug, not the disk: say so and let the shutdown finish rather than hang.
            log.failure("closing LMDB: {n} messages left unwritten", n=len(ops))
            self.env.close()
            closed.callback(None)
            return
        log.info("closing LMDB: there is room again; the messages left are {where}",
                 where=f"saved to {self.spill_path}" if spilled else "written")
        closed.callback(None)

    def _finish_close(self, all_in_lmdb: bool, close_env: bool) -> None:
        """Everything is in LMDB or the spill file: sync, drop a spill file now written back."""
        try:
            self.sync()
        except lmdb.Error:
            pass  # what was written is in the page cache; nothing better to do at exit
        if all_in_lmdb and self._spill_loaded:
            self._remove_spill()
        if close_env:
            self.env.close()

    def _write_spill(self, ops: Sequence[tuple[int, Any, Any]]) -> None:
        """Save registry entries and records atomically (temp file, fsync, rename); raises OSError."""
        entries = [(SPILL_REGISTRY if op == _REG_PUT else SPILL_RECORD, key, value)
                   for op, key, value in ops]
        tmp = self.spill_path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(spill_bytes(entries))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.spill_path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fsync_dir(self.spill_path)

    def _remove_spill(self) -> None:
        """The spilled records are committed: sync them, then let the file go.

        A queue not opened yet now finds its records in LMDB (_scan): handing
        them over again from _spilled would count them twice.
        """
        self._spill_loaded = False
        self._spilled.clear()
        try:
            self.sync()
            os.unlink(self.spill_path)
            fsync_dir(self.spill_path)
        except FileNotFoundError:
            pass
        except (OSError, lmdb.Error) as e:
            # Harmless: written back again at the next start, as rewrites.
            log.warn("{spill}: cannot remove it ({error})", spill=self.spill_path, error=e)
        else:
            log.info("{spill}: its messages are in LMDB again; removed", spill=self.spill_path)


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in `path`'s directory durable."""
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def spill_bytes(entries: Sequence[tuple[int, bytes, bytes]]) -> bytes:
    """The spill file: a magic line, (kind, key, value) entries, then their count and CRC-32."""
    parts: list[bytes] = []
    for kind, key, value in entries:
        parts += (SPILL_ENTRY.pack(kind, len(key), len(value)), key, value)
    body = b"".join(parts)
    return SPILL_MAGIC + body + SPILL_END.pack(SPILL_DONE, len(entries), zlib.crc32(body))


def parse_spill(raw: bytes) -> list[tuple[int, bytes, bytes]]:
    """The entries of a spill file; ValueError if it is not one, or not whole."""
    if not raw.startswith(SPILL_MAGIC):
        raise ValueError("not an mqd spill file")
    if len(raw) < len(SPILL_MAGIC) + SPILL_END.size:
        raise ValueError("truncated")
    body = raw[len(SPILL_MAGIC):-SPILL_END.size]
    done, count, crc = SPILL_END.unpack(raw[-SPILL_END.size:])
    if done != SPILL_DONE or zlib.crc32(body) != crc:
        raise ValueError("truncated or damaged (checksum mismatch)")
    entries = []
    pos = 0
    while pos < len(body):
        if pos + SPILL_ENTRY.size > len(body):
            raise ValueError(f"entry header cut at byte {pos}")
        kind, klen, vlen = SPILL_ENTRY.unpack_from(body, pos)
        pos += SPILL_ENTRY.size
        key, value = body[pos:pos + klen], body[pos + klen:pos + klen + vlen]
        pos += klen + vlen
        if kind == SPILL_RECORD:
            good = len(key) == KEY.size and len(value) == vlen >= RECORD_SIZE
        else:
            good = kind == SPILL_REGISTRY and len(value) == vlen == QID.size and _is_utf8(key)
        if not good:
            raise ValueError(f"bad entry ending at byte {pos}")
        entries.append((kind, key, value))
    if len(entries) != count:
        raise ValueError(f"{len(entries)} entries, the trailer says {count}")
    return entries


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
