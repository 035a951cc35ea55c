"""The two stream compressions IDENTIFY can negotiate: snappy (framed) and raw deflate.

Once a connection has negotiated one, every byte after the server's `OK`
goes through it in both directions (on top of TLS when that is on too).
The protocol swaps its transport for a `CompressedTransport`, so every
write path (responses, messages, the durable-publish release) is
compressed without touching it, and a connection without compression
pays nothing. Incoming bytes go through the codec's `decompress` before
parsing; a corrupt stream raises `CompressionError`, which closes that
connection only.
"""

from __future__ import annotations

import zlib

import cramjam

__all__ = ["CompressionError", "CompressedTransport", "DeflateCodec", "SnappyCodec"]

# The framing format's stream identifier chunk: type 0xff, length 6, "sNaPpY".
SNAPPY_STREAM_HEADER = b"\xff\x06\x00\x00sNaPpY"
_SNAPPY_MAX_CHUNK = 16 * 1024 * 1024  # 24-bit length field


class CompressionError(Exception):
    """The peer's compressed stream cannot be decoded."""


class DeflateCodec:
    """Raw DEFLATE (RFC 1951, no zlib header), as nsqd's flate reader/writer.

    Every write batch ends with a sync flush, as nsqd flushes its flate
    writer with each buffer flush: the client can decode everything it has
    been sent without waiting for more.
    """

    def __init__(self, level: int) -> None:
        self._compressor = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._decompressor = zlib.decompressobj(-15)

    def compress(self, data: bytes) -> bytes:
        c = self._compressor
        return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)

    def decompress(self, data: bytes) -> bytes:
        try:
            out = self._decompressor.decompress(data)
        except zlib.error as e:
            raise CompressionError(f"deflate: {e}") from None
        if self._decompressor.eof:
            # A final block ends the stream; nothing the client can send
            # after it would be read by nsqd either.
            raise CompressionError("deflate: stream ended")
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

    def compress(self, data: bytes) -> bytes:
        out = bytes(cramjam.snappy.compress(data))
        if self._header_sent:
            return out[len(SNAPPY_STREAM_HEADER):]
        self._header_sent = True
        return out

    def decompress(self, data: bytes) -> bytes:
        buf = self._buffer + data if self._buffer else data
        end = 0
        size = len(buf)
        while end + 4 <= size:
            length = int.from_bytes(buf[end + 1:end + 4], "little")
            if length > _SNAPPY_MAX_CHUNK:
                raise CompressionError("snappy: chunk too large")
            if end + 4 + length > size:
                break
            end += 4 + length
        self._buffer = buf[end:]
        if not end:
            return b""
        # Prefixing the identifier lets cramjam decode chunks from the
        # middle of the stream; a repeated identifier is legal in the format.
        try:
            return bytes(cramjam.snappy.decompress(SNAPPY_STREAM_HEADER + buf[:end]))
        except Exception as e:  # cramjam.DecompressionError and its kin
            raise CompressionError(f"snappy: {e}") from None


class CompressedTransport:
    """The connection's transport seen through a codec: writes are compressed.

    Everything else (loseConnection, getPeer, TLS details) is the wrapped
    transport's. writeSequence compresses the batch as one piece so a batch
    of frames costs one deflate flush / one snappy chunk.
    """

    def __init__(self, transport, codec) -> None:
        self._transport = transport
        self._codec = codec

    def write(self, data: bytes) -> None:
        if data:
            self._transport.write(self._codec.compress(data))

    def writeSequence(self, seq) -> None:
        self.write(b"".join(seq))

    def __getattr__(self, name):
        return getattr(self._transport, name)
