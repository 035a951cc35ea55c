"""The client side of NSQ's compressed streams, for tests of the broker's codecs.

Written apart from mqd/wire/compression.py on purpose, the way pynsq's
DeflateSocket and SnappySocket are: a test client must not share the code
it checks.
"""

from __future__ import annotations

import zlib

import cramjam

# The framed-snappy stream identifier that opens every stream.
SNAPPY_HEADER = b"\xff\x06\x00\x00sNaPpY"


class DeflateClient:
    """Raw DEFLATE (no zlib header), sync-flushed after every write, as pynsq does."""

    def __init__(self) -> None:
        self.c = zlib.compressobj(6, zlib.DEFLATED, -15)
        self.d = zlib.decompressobj(-15)

    def compress(self, data: bytes) -> bytes:
        return self.c.compress(data) + self.c.flush(zlib.Z_SYNC_FLUSH)

    def decompress(self, data: bytes) -> bytes:
        return self.d.decompress(data)


class SnappyClient:
    """Framed snappy; incoming bytes are cut at chunk boundaries before decoding."""

    def __init__(self) -> None:
        self.sent_header = False
        self.buf = b""

    def compress(self, data: bytes) -> bytes:
        out = bytes(cramjam.snappy.compress(data))
        if self.sent_header:
            out = out[len(SNAPPY_HEADER):]
        self.sent_header = True
        return out

    def decompress(self, data: bytes) -> bytes:
        buf = self.buf + data
        end = 0
        while end + 4 <= len(buf):
            length = int.from_bytes(buf[end + 1:end + 4], "little")
            if end + 4 + length > len(buf):
                break
            end += 4 + length
        self.buf = buf[end:]
        return bytes(cramjam.snappy.decompress(SNAPPY_HEADER + buf[:end])) if end else b""
