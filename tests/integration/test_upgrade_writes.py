"""IDENTIFY's upgrade reaches the client in nsqd's separate writes, seen from a raw socket.

nsqd flushes the plain JSON answer, then (after the TLS handshake) the OK,
then the compressed OK, each in a write of its own. Clients such as
asyncnsq read the JSON answer and switch their decoder at the end of that
read: compressed bytes in the same read are taken for plain ones and the
connection fails. These clients read exactly the frame they are owed,
take what has arrived past it without waiting, and only then switch.

Whether the next write has arrived by that time is a race, on nsqd too
(the broker writes the compressed OK two reactor turns after the plain
frame: tens of microseconds, about what a Python client takes to look;
37 to 94 of 100 reads saw the JSON answer alone here, 0 of 100 when the
OK went one turn later, in that turn's timed calls before its I/O). What
the tests assert is what no race changes: the number of TCP segments
with data the client received (each write of the broker, which sets
TCP_NODELAY, to an idle loopback connection is a segment of its own).
"""

from __future__ import annotations

import json
import socket
import ssl

import pytest

from tests.support.certs import client_context, tls_flags
from tests.support.codec_clients import DeflateClient, SnappyClient
from tests.support.raw_conn import FRAME_RESPONSE, UpgradingConn, command

CONNECTIONS = 20
CODECS = {"snappy": SnappyClient, "deflate": DeflateClient}


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """Read n bytes and not one more, as a client's frame reader does."""
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise ConnectionError(f"closed after {len(got)}/{n} bytes")
        got += chunk
    return got


def read_frame_exactly(sock: socket.socket) -> tuple[int, bytes]:
    size = int.from_bytes(recv_exactly(sock, 4), "big")
    data = recv_exactly(sock, size)
    return int.from_bytes(data[:4], "big"), data[4:]


def already_there(sock: socket.socket) -> bytes:
    """What has arrived past the frame just read, without waiting (b"" on EAGAIN)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return sock.recv(sock.pending())
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except (BlockingIOError, ssl.SSLWantReadError):
        return b""
    finally:
        sock.settimeout(5.0)


def data_segments_in(sock: socket.socket) -> int:
    """Linux's tcpi_data_segs_in: segments with data this socket received.

    With TCP_NODELAY (nsqd's and mqd's) each of the broker's writes to an
    idle loopback connection is a segment of its own, so this counts writes
    where a read cannot tell them apart.
    """
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 160)
    return int.from_bytes(info[152:156], "little")


def upgrade(conn: UpgradingConn, kind: str, *, tls: ssl.SSLContext | None = None,
            after: bytes = b"") -> int:
    """IDENTIFY (with `after` compressed in the same write) as such a client does it.

    The compressed OK must decode with the decoder switched at the end of
    the last plain frame (early bytes are decoded by it, not parsed).
    Returns the data segments received on the connection: one more
    than without compression when the compressed OK was a write of its own.
    """
    body = {"feature_negotiation": True, kind: True, "tls_v1": tls is not None}
    codec = CODECS[kind]()
    conn.sock.sendall(command("IDENTIFY", json.dumps(body).encode()) + (codec.compress(after) if after else b""))
    frame_type, payload = read_frame_exactly(conn.sock)
    assert frame_type == FRAME_RESPONSE, payload
    answer = json.loads(payload)
    assert answer[kind] is True and answer["tls_v1"] is (tls is not None)
    if tls is not None:
        assert already_there(conn.sock) == b""  # the handshake's first byte is the client's
        conn.sock = tls.wrap_socket(conn.sock, server_hostname="127.0.0.1")
        assert read_frame_exactly(conn.sock) == (FRAME_RESPONSE, b"OK")
    early = already_there(conn.sock)
    conn.codec = codec
    conn._buf = codec.decompress(early)
    assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
    return data_segments_in(conn.sock)


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_compressed_ok_is_a_later_write(start_broker, name, kind):
    broker = start_broker()
    topic = name()
    for _ in range(CONNECTIONS):
        with UpgradingConn(broker) as conn:
            assert upgrade(conn, kind) == 2  # the JSON answer, then the compressed OK
            conn.send(command(f"PUB {topic}", b"after the upgrade"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200 and stats["topics"][0]["message_count"] == CONNECTIONS


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_commands_pipelined_after_identify_wait_for_the_codec(start_broker, name, kind):
    """Compressed commands in IDENTIFY's own write are decoded once the codec is on, in order."""
    broker = start_broker()
    topic = name()
    with UpgradingConn(broker) as conn:
        upgrade(conn, kind, after=command(f"PUB {topic}", b"one") + command(f"PUB {topic}", b"two"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        conn.send(command(f"SUB {topic} ch") + command("RDY 2"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        assert [conn.read_message()[3] for _ in range(2)] == [b"one", b"two"]


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_tls_ok_and_compressed_ok_are_separate_writes(start_broker, certs, kind):
    broker = start_broker(*tls_flags(certs))
    ctx = client_context(certs)
    with UpgradingConn(broker) as conn:
        conn.negotiate(tls=ctx)
        tls_only = data_segments_in(conn.sock)  # the JSON answer, the handshake, the OK
    for _ in range(CONNECTIONS):
        with UpgradingConn(broker) as conn:
            assert upgrade(conn, kind, tls=ctx) == tls_only + 1  # and the compressed OK
            conn.send(command("NOP") + command("PUB t", b"x"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
