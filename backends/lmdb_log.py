"""The durable store's publish log: what LMDB has not taken yet, synced off the reactor.

A durable publish is acknowledged once it is on disk. Syncing an LMDB
commit for every group of publishes blocks the reactor for the whole
fsync, and LMDB cannot commit from another thread cheaply (py-lmdb gives
the GIL up in every call, so a thread doing B-tree work waits for the
reactor after each record). So a durable store appends what changed to
this log instead, one chunk per reactor turn, and a thread writes and
fsyncs the chunk (two calls, the GIL given up once each) while the
reactor gathers the next. LMDB takes everything in a checkpoint every so
often, synced as before; the checkpoint records the last chunk it covers,
so the log can be emptied, and only later chunks are replayed after a
crash.

The file is preallocated with zeros (when the disk has room to spare) and
written in place from the start again after each checkpoint: an fdatasync
of blocks the file already owns writes only the data, where one that
grows the file must commit the filesystem's journal too (about twice the
time on the disks measured). What an earlier round left behind the
current end is older: its epochs are lower, which is where replay stops.

A chunk is a header (magic, epoch, payload length, CRC-32 of the payload)
and a payload of operations, each ``P`` key length record (a record
written, new or rewritten) or ``D`` key (a record deleted). A crash may
leave a torn last chunk; replay stops at the first chunk whose header,
length or checksum is wrong.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

from backends.lmdb_records import KEY, RECORD, RECORD_HEAD
from mqd.message import Message

__all__ = ["LOG_FILE", "PublishLog", "encode_chunk", "parse_chunks"]

LOG_FILE = "publish.log"
CHUNK = struct.Struct(">4sQII")  # magic, epoch, payload length, CRC-32 of the payload
MAGIC = b"MQL1"
# A put: op, key, record length (PUT_HEAD), then the record (RECORD's fields, then the body).
PUT_HEAD = struct.Struct(f">c{KEY.size}sI")
# A put up to the message's id: its data (id and body) follows.
PUT = struct.Struct(PUT_HEAD.format + RECORD_HEAD.format.lstrip(">"))
DEL = struct.Struct(f">c{KEY.size}s")
_P, _D = b"P", b"D"
_RECORD_SIZE = RECORD.size
_HEAD_SIZE = RECORD_HEAD.size
# Buffers per pwritev call: the kernel takes at most IOV_MAX (1024 on Linux).
_IOV_MAX = 1024


def encode_chunk(epoch: int, puts: Iterable[Iterable[Message]], updates: Iterable[Iterable[Message]],
                 dels: Iterable[bytes]) -> tuple[bytes, bytes]:
    """One chunk, as its header and its payload: every message of `puts` and `updates` still stored (its current state), then the deletions.

    Records are written in the state their messages are in now, so a
    rewrite made before the chunk is taken needs no entry of its own;
    messages whose key is gone (finished, or their queue emptied) are
    left out. The header and payload are written side by side
    (`PublishLog.append`) rather than joined: a chunk is often hundreds of
    kilobytes, and joining them would copy the payload once more on the
    reactor.
    """
    pieces: list[bytes] = []
    append = pieces.append
    put = PUT.pack
    for batch in chain(puts, updates):
        for m in batch:
            key = m.key
            if key is not None:
                data = m.data
                # m.state is a deferred message's due time (a float); None or
                # a delivery's tuple mean 0.0 (Message.deferred_until, inline).
                state = m.state
                append(put(_P, key, _HEAD_SIZE + len(data), m.timestamp, m.attempts & 0xFFFF,
                           0.0 if state is None or state.__class__ is tuple else state))
                append(data)
    pieces += [_D + key for key in dels]
    payload = b"".join(pieces)
    return CHUNK.pack(MAGIC, epoch, len(payload), zlib.crc32(payload)), payload


def parse_chunks(raw: bytes) -> Iterator[tuple[int, list[tuple[bytes, bytes | None]]]]:
    """(epoch, operations) of each whole chunk, in order, up to the end of the log.

    The log ends at a torn or damaged chunk, at zeros, or at a chunk no
    newer than the one before it (left by an earlier round). An operation
    is (key, record) for a record written and (key, None) for one deleted.
    """
    pos = 0
    head = CHUNK.size
    last = -1
    while pos + head <= len(raw):
        magic, epoch, length, crc = CHUNK.unpack_from(raw, pos)
        payload = raw[pos + head:pos + head + length]
        if (magic != MAGIC or epoch <= last or len(payload) != length
                or zlib.crc32(payload) != crc):
            return
        last = epoch
        ops = _parse_ops(payload)
        if ops is None:
            return
        yield epoch, ops
        pos += head + length


def _parse_ops(payload: bytes) -> list[tuple[bytes, bytes | None]] | None:
    ops: list[tuple[bytes, bytes | None]] = []
    pos, end = 0, len(payload)
    head = PUT_HEAD.size
    while pos < end:
        op = payload[pos:pos + 1]
        if op == _P:
            if pos + head > end:
                return None
            _, key, length = PUT_HEAD.unpack_from(payload, pos)
            start = pos + head
            if length < _RECORD_SIZE or start + length > end:
                return None
            ops.append((key, payload[start:start + length]))
            pos = start + length
        elif op == _D:
            if pos + DEL.size > end:
                return None
            ops.append((payload[pos + 1:pos + DEL.size], None))
            pos += DEL.size
        else:
            return None
    return ops


class PublishLog:
    """The log file: written and synced by one thread at a time, started again by the reactor between.

    The store never has two writes running, and starts the file again
    only while none is, so the file needs no lock.
    """

    def __init__(self, path: str, preallocate: int = 0) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        # Where the next chunk goes: the live part of the file ends here.
        self.size = 0
        if preallocate:
            self._preallocate(preallocate)

    def _preallocate(self, size: int) -> None:
        """Fill the file with zeros up to `size` bytes, if the filesystem has ten times that free."""
        fd = self._fd
        have = os.fstat(fd).st_size
        if have >= size:
            return
        try:
            free = os.statvfs(self.path)
            if free.f_bavail * free.f_frsize < 10 * size:
                return
            zeros = bytes(1 << 20)
            for offset in range(have, size, len(zeros)):
                os.pwrite(fd, zeros[:size - offset], offset)
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, have)  # no room after all: the file grows as it is written

    def append(self, buffers: Sequence[bytes]) -> None:
        """Write `buffers` (chunks' headers and payloads, in order) at the end of the live part, and fdatasync; raises OSError.

        Called in a thread: `pwritev` gathers them in the kernel, with the
        GIL given up, instead of a join that copies them first. On an error
        the live part is as it was: what was written past it is a torn
        chunk, where replay stops.
        """
        fd = self._fd
        offset = self.size
        for start in range(0, len(buffers), _IOV_MAX):
            group = buffers[start:start + _IOV_MAX]
            size = sum(map(len, group))
            written = os.pwritev(fd, group, offset)
            if written < size:
                # A short write: the rest a call at a time.
                rest = memoryview(b"".join(group))[written:]
                while rest:
                    n = os.pwrite(fd, rest, offset + size - len(rest))
                    rest = rest[n:]
            offset += size
        os.fdatasync(fd)
        self.size = offset

    def empty(self) -> None:
        """Everything logged is in LMDB, synced: the next chunk goes at the start (replay skips by epoch)."""
        self.size = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
