"""The two stream compressions IDENTIFY can negotiate: snappy (framed) and raw deflate.

Once a connection has negotiated one, every byte after the server's `OK`
goes through it in both directions (on top of TLS when that is on too).
The protocol swaps its transport for a `CompressedTransport`, so every
write path (responses, messages, the durable-publish release) is
compressed without touching it, and a connection without compression
pays nothing. Incoming bytes go through the codec's `decompress` before
parsing; a corrupt stream raises `CompressionError`, which closes that
connection only.

A few compressed bytes can inflate to gigabytes, so decoding is done in
bounded steps: `decompress(data, max_length)` produces at most about
`max_length` bytes and keeps the rest of the input (`feed` only keeps
it); `has_more` says whether kept input may still produce output. The
protocol parses each step before asking for the next.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import cramjam

if TYPE_CHECKING:
    from twisted.internet.interfaces import ITransport

__all__ = ["CompressionError", "CompressedTransport", "DeflateCodec", "SnappyCodec"]

# The framing format's stream identifier chunk: type 0xff, length 6, "sNaPpY".
SNAPPY_STREAM_HEADER = b"\xff\x06\x00\x00sNaPpY"
# Go's snappy reader (nsqd's) reads each chunk into a buffer of
# maxEncodedLenOfMaxBlockSize (76490: the worst-case encoding of a 64 KiB
# block) plus the 4-byte checksum, and fails the stream at a longer chunk
# header; a chunk may decode to at most one 64 KiB block.
_SNAPPY_MAX_CHUNK = 76490 + 4
_SNAPPY_MAX_BLOCK = 65536
# Go's flate writer at level 1 sends a write up to this size as a stored block.
_GO_STORED_MAX = 16


class CompressionError(Exception):
    """The peer's compressed stream cannot be decoded."""


class DeflateCodec:
    """Raw DEFLATE (RFC 1951, no zlib header), as nsqd's flate reader/writer.

    Every write batch ends with a sync flush, as nsqd flushes its flate
    writer with each buffer flush: the client can decode everything it has
    been sent without waiting for more.
    """

    def __init__(self, level: int) -> None:
        self._level = level
        self._first = True
        self._compressor = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._decompressor = zlib.decompressobj(-15)
        self._input = b""  # compressed bytes not inflated yet (zlib's unconsumed_tail)
        self._full = False  # the last step stopped at its limit: zlib may hold more

    def compress(self, data: bytes) -> bytes:
        if self._first:
            self._first = False
            if len(data) <= _GO_STORED_MAX:
                return self._compress_as_go(data)
        c = self._compressor
        return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)

    def _compress_as_go(self, data: bytes) -> bytes:
        """A small first write (the upgrade's OK) in the bytes nsqd's Go flate writer sends.

        Go stores it at level 1 and, at higher levels, whose matches are 4
        bytes or longer, finds none in the OK frame and sends literals,
        where zlib would use a 3-byte match. The block ends sync-flushed,
        byte-aligned, so the main compressor's blocks follow as one stream
        (they do not refer back to these few bytes).
        """
        if self._level <= 1:
            c = zlib.compressobj(0, zlib.DEFLATED, -15)
        else:
            c = zlib.compressobj(self._level, zlib.DEFLATED, -15, 8, zlib.Z_HUFFMAN_ONLY)
        return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)

    @property
    def has_more(self) -> bool:
        return self._full or bool(self._input)

    def feed(self, data: bytes) -> None:
        """Keep `data` for a later `decompress` without inflating anything now."""
        if data:
            self._input += data

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        """Inflate kept input and `data`: at most `max_length` bytes of it (0: all)."""
        if self._input:
            data, self._input = self._input + data, b""
        d = self._decompressor
        try:
            out = d.decompress(data, max_length)
        except zlib.error as e:
            raise CompressionError(f"deflate: {e}") from None
        if d.eof:
            # A final block ends the stream; nothing the client can send
            # after it would be read by nsqd either.
            raise CompressionError("deflate: stream ended")
        self._input = d.unconsumed_tail
        self._full = 0 < max_length <= len(out)
        return out


class SnappyCodec:
    """Snappy's framed stream format (Go `snappy.NewWriter`/`NewReader`).

    cramjam's one-shot framed functions do the chunk encoding and the CRC
    checks; this class only cuts the incoming stream at chunk boundaries
    (a read may end mid-chunk) and sends the stream identifier once.
    """

    def __init__(self) -> None:
        self._header_sent = False
        self._buffer = b""
        self._more = False  # the buffer holds a whole chunk not decoded yet

    def compress(self, data: bytes) -> bytes:
        out = bytes(cramjam.snappy.compress(data))
        if self._header_sent:
            return out[len(SNAPPY_STREAM_HEADER):]
        self._header_sent = True
        return out

    @property
    def has_more(self) -> bool:
        return self._more

    def feed(self, data: bytes) -> None:
        """Keep `data` for a later `decompress` without decoding anything now."""
        if data:
            self._buffer += data
            self._more = True  # perhaps: the next decompress tells

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        """Decode the whole chunks buffered: at least one, then no more than
        `max_length` bytes' worth (0: all of them).

        Chunk sizes are checked from their headers as Go's reader checks
        them, so an oversize chunk fails the stream before its bytes arrive.
        """
        buf = self._buffer + data if self._buffer else data
        end = 0
        size = len(buf)
        out_len = 0
        more = False
        while end + 4 <= size:
            kind = buf[end]
            length = int.from_bytes(buf[end + 1:end + 4], "little")
            if length > _SNAPPY_MAX_CHUNK:
                raise CompressionError("snappy: chunk too large")
            if end + 4 + length > size:
                break
            if kind == 0x00:  # compressed: a varint of the block's length after the checksum
                n = _uvarint(buf, end + 8, end + 4 + length)
            elif kind == 0x01:  # uncompressed: the checksum, then the data
                n = length - 4
            elif kind < 0x80:
                raise CompressionError("snappy: unsupported chunk type")
            else:  # stream identifier, padding, skippable
                n = 0
            if n < 0 or n > _SNAPPY_MAX_BLOCK:
                raise CompressionError("snappy: corrupt chunk")
            if max_length and out_len and out_len + n > max_length:
                more = True
                break
            out_len += n
            end += 4 + length
        self._buffer = buf[end:]
        self._more = more
        if not end:
            return b""
        # Prefixing the identifier lets cramjam decode chunks from the
        # middle of the stream; a repeated identifier is legal in the format.
        try:
            return bytes(cramjam.snappy.decompress(SNAPPY_STREAM_HEADER + buf[:end]))
        except Exception as e:  # cramjam.DecompressionError and its kin
            raise CompressionError(f"snappy: {e}") from None


def _uvarint(buf: bytes, pos: int, end: int) -> int:
    """The unsigned varint at `pos` (a snappy block's decoded length), or -1 if malformed."""
    value = shift = 0
    while pos < end and shift < 35:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value
        pos += 1
        shift += 7
    return -1


class CompressedTransport:
    """The connection's transport seen through a codec: writes are compressed.

    Everything else (loseConnection, getPeer, TLS details) is the wrapped
    transport's, the producer calls too: pausing reads the socket's own
    state, and the write buffer whose size pauses the protocol holds the
    compressed bytes. writeSequence compresses the batch as one piece so a
    batch of frames costs one deflate flush / one snappy chunk.
    """

    def __init__(self, transport: ITransport, codec: SnappyCodec | DeflateCodec) -> None:
        self._transport = transport
        self._codec = codec

    def write(self, data: bytes) -> None:
        if data:
            self._transport.write(self._codec.compress(data))

    def writeSequence(self, seq: Iterable[bytes]) -> None:
        self.write(b"".join(seq))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
