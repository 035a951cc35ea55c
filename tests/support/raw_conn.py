"""A raw V2 connection to a real broker: a blocking socket speaking the protocol by hand.

For what pynsq cannot show: exact bytes, frame by frame, and how the broker closes.
"""

from __future__ import annotations

import json
import selectors
import socket
import ssl
import struct
import time
from collections.abc import Iterable

from tests.support.codec_clients import DeflateClient, SnappyClient
from tests.support.processes import BrokerProcess

FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2
MAGIC_V2 = b"  V2"


def command(line: str | bytes, body: bytes | None = None) -> bytes:
    if isinstance(line, str):
        line = line.encode()
    data = line + b"\n"
    if body is not None:
        data += struct.pack(">i", len(body)) + body
    return data


class FrameReader:
    """Reading V2 frames from whatever `_read_exactly` and `send` are (a socket, a StringTransport)."""

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def _read_exactly(self, n: int) -> bytes:
        raise NotImplementedError

    def read_frame(self, skip_heartbeats: bool = True) -> tuple[int, bytes]:
        while True:
            size, frame_type = struct.unpack(">ii", self._read_exactly(8))
            payload = self._read_exactly(size - 4)
            if skip_heartbeats and frame_type == FRAME_RESPONSE and payload == b"_heartbeat_":
                self.send(b"NOP\n")
                continue
            return frame_type, payload

    def read_message(self) -> tuple[int, int, bytes, bytes]:
        """(timestamp, attempts, id, body) of the next frame, which must be a message."""
        frame_type, payload = self.read_frame()
        assert frame_type == FRAME_MESSAGE, (frame_type, payload)
        ts, attempts = struct.unpack(">qH", payload[:10])
        return ts, attempts, payload[10:26], payload[26:]


class RawConn(FrameReader):
    """A blocking socket speaking V2 by hand, for what pynsq cannot show."""

    def __init__(self, broker: BrokerProcess, magic: bytes | None = MAGIC_V2,
                 timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((broker.tcp_host, broker.tcp_port), timeout=timeout)
        self.timeout = timeout
        self._buf = b""
        if magic is not None:
            self.sock.sendall(magic)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _decode(self, chunk: bytes) -> bytes:
        """What arrived, as protocol bytes (a subclass that negotiates compression decodes)."""
        return chunk

    def _read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"connection closed with {len(self._buf)}/{n} bytes read")
            self._buf += self._decode(chunk)
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def expect_closed(self) -> None:
        """The broker closes the connection (EOF, or a reset) within the timeout."""
        assert not self._buf, f"unread bytes before close: {self._buf!r}"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return
            except TimeoutError:
                break
            if not chunk:
                return
            raise AssertionError(f"expected the broker to close, got {chunk!r}")
        raise AssertionError("the broker left the connection open")

    def expect_silence(self, seconds: float) -> None:
        """Nothing but heartbeats arrives for `seconds`, and the connection stays open."""
        self.sock.settimeout(seconds)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return
        finally:
            self.sock.settimeout(self.timeout)
        raise AssertionError(f"expected silence, got {chunk!r}")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def select_sockets(readers: Iterable[socket.socket], writers: Iterable[socket.socket],
                   timeout: float) -> tuple[list[socket.socket], list[socket.socket]]:
    """select.select's answer for sockets, through epoll: a long test session can hold
    file descriptors past select()'s limit of 1024."""
    events: dict[socket.socket, int] = {}
    for sock in readers:
        events[sock] = selectors.EVENT_READ
    for sock in writers:
        events[sock] = events.get(sock, 0) | selectors.EVENT_WRITE
    with selectors.DefaultSelector() as selector:
        for sock, mask in events.items():
            selector.register(sock, mask)
        ready = selector.select(timeout)
    readable = [key.fileobj for key, mask in ready if mask & selectors.EVENT_READ]
    writable = [key.fileobj for key, mask in ready if mask & selectors.EVENT_WRITE]
    return readable, writable


class UpgradingConn(RawConn):
    """A raw V2 client that negotiates TLS and/or compression as pynsq/go-nsq do."""

    codec = None

    def negotiate(self, *, tls: ssl.SSLContext | None = None, snappy: bool = False,
                  deflate: bool = False, **fields) -> dict:
        body = dict(feature_negotiation=True, tls_v1=tls is not None, snappy=snappy,
                    deflate=deflate, **fields)
        self.send(command("IDENTIFY", json.dumps(body).encode()))
        frame_type, payload = self.read_frame()
        assert frame_type == FRAME_RESPONSE, payload
        answer = json.loads(payload)
        if tls is not None and answer["tls_v1"]:
            assert not self._buf, "the broker sent bytes before the TLS handshake"
            self.sock = tls.wrap_socket(self.sock, server_hostname="127.0.0.1")
            assert self.read_frame() == (FRAME_RESPONSE, b"OK")
        if answer["snappy"] or answer["deflate"]:
            self.codec = SnappyClient() if answer["snappy"] else DeflateClient()
            self._buf = self.codec.decompress(self._buf)
            assert self.read_frame() == (FRAME_RESPONSE, b"OK")
        return answer

    def send(self, data: bytes) -> None:
        self.sock.sendall(self.codec.compress(data) if self.codec else data)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _decode(self, chunk: bytes) -> bytes:
        return self.codec.decompress(chunk) if self.codec else chunk
