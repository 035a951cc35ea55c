"""The binary framing of retained-log records, as `GET /topic/read` answers and `mq-tail --offset` reads.

A read answer is a sequence of records, each:

    [4-byte size, big-endian uint32: the bytes after this field]
    [8-byte offset, uint64]
    [8-byte timestamp, int64: nanoseconds since the Unix epoch, as a message frame's]
    [2-byte attempts, uint16: always 0 for a record]
    [16-byte message id, ASCII hex]
    [body: size - 34 bytes]

All integers big-endian, as NSQ's frames. No base64 and no separators: a
reader takes the size, then that many bytes, and so on to the end of the
answer. The offset after an answer's last record is the next one to ask
for (also sent as the `X-Mqd-Next-Offset` header).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

__all__ = ["FRAME_HEAD", "FRAME_OVERHEAD", "frame_records", "iter_frames", "FrameError"]

# size, offset, timestamp, attempts; the id and body follow.
FRAME_HEAD = struct.Struct(">IQqH")
# Bytes a frame has besides its id and body (the size field included).
FRAME_OVERHEAD = FRAME_HEAD.size
# What the size field counts besides the id and body.
_SIZED = FRAME_HEAD.size - 4
_ID = 16


class FrameError(ValueError):
    """Bytes that are not a whole sequence of record frames."""


def frame_records(records: Iterable[tuple[int, int, bytes]]) -> bytes:
    """The frames of (offset, timestamp ns, data = id + body) records, in one bytes object."""
    pack = FRAME_HEAD.pack
    parts: list[bytes] = []
    append = parts.append
    for offset, timestamp, data in records:
        append(pack(_SIZED + len(data), offset, timestamp, 0))
        append(data)
    return b"".join(parts)


def iter_frames(buf: bytes | bytearray | memoryview) -> Iterator[tuple[int, int, int, bytes, bytes]]:
    """(offset, timestamp ns, attempts, id, body) of each whole frame in `buf`; FrameError on a cut or bad one."""
    view = memoryview(buf)
    pos = 0
    end = len(view)
    unpack = FRAME_HEAD.unpack_from
    while pos < end:
        if end - pos < FRAME_OVERHEAD + _ID:
            raise FrameError(f"a frame cut short at byte {pos} ({end - pos} bytes left)")
        size, offset, timestamp, attempts = unpack(view, pos)
        stop = pos + 4 + size
        if size < _SIZED + _ID or stop > end:
            raise FrameError(f"a frame of size {size} at byte {pos} does not fit the {end - pos} bytes left")
        body_at = pos + FRAME_OVERHEAD + _ID
        yield offset, timestamp, attempts, bytes(view[pos + FRAME_OVERHEAD:body_at]), bytes(view[body_at:stop])
        pos = stop
