"""The client's reader under inputs nobody planned: hypothesis-chosen streams and splits.

A TCP read may end anywhere, and a compressed stream's chunks end
anywhere else again; whatever the cut, the client must see the same
frames in the same order. Garbage from a broken or hostile server must
close the connection with every caller told, never raise out of
dataReceived or leave a Deferred hanging.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.testing import StringTransport

from mqd.wire.compression import DeflateCodec, SnappyCodec
from mqd.wire.framing import HEARTBEAT, OK
from tests.support.client_conn import Conn, error, message_frame, server_json

_SETTINGS = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])

# One server frame after the handshake: (kind, frame bytes, what the client must make of it).
_frames = st.one_of(
    st.tuples(st.just("ok"), st.just(OK)),
    st.tuples(st.just("heartbeat"), st.just(HEARTBEAT)),
    st.builds(
        lambda body, attempts, n: ("message", message_frame(body, attempts, n.to_bytes(16, "big"))),
        st.binary(max_size=300), st.integers(1, 65535), st.integers(0, 2**64)),
    st.tuples(st.just("fin_failed"), st.just(error(b"E_FIN_FAILED FIN 0123456789abcdef failed ID not in flight"))),
)


def _handshaken(compression: str | None) -> tuple[Conn, object]:
    """A connection past its handshake; the server-side codec when compressed."""
    if compression is None:
        return Conn().handshake(), None
    codec = SnappyCodec() if compression == "snappy" else DeflateCodec(6)
    conn = Conn(**{compression: True})
    conn.written()
    conn.feed(server_json(**{compression: True}) + codec.compress(OK))
    assert conn.results == [conn.proto]
    return conn, codec


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the given offsets (taken modulo its length), no empty piece."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


def _run(frames, compression, cuts):
    """Feed the frames cut at `cuts`; return what the client saw and the PUB results."""
    conn, codec = _handshaken(compression)
    n_pubs = sum(1 for kind, _ in frames if kind == "ok")
    results: list = []
    for _ in range(n_pubs):
        conn.proto.pub("t", b"x").addBoth(results.append)
    conn.written()
    stream = b"".join(f for _, f in frames)
    if codec is not None:
        # The server compresses per write: cut the plaintext into a few writes too.
        stream = b"".join(codec.compress(p) for p in _pieces(stream, cuts))
    for piece in _pieces(stream, cuts):
        conn.feed(piece)
    seen = [(e[0], e[1].id, e[1].body, e[1].attempts) if e[0] == "message" else
            (e[0], e[1].code) if e[0] == "error" else (e[0],)
            for e in conn.delegate.events]
    return seen, results, conn


@_SETTINGS
@given(frames=st.lists(_frames, max_size=30),
       compression=st.sampled_from([None, "snappy", "deflate"]),
       cuts=st.lists(st.integers(0, 20000), max_size=12))
def test_any_split_of_any_stream_gives_the_same_frames(frames, compression, cuts):
    whole, whole_results, _ = _run(frames, compression, [])
    split, split_results, conn = _run(frames, compression, cuts)
    assert split == whole
    # [size][type][timestamp][attempts] then the 16-byte id.
    expected = [("message", f[1][18:34]) for f in frames if f[0] == "message"]
    assert [(e[0], e[1]) for e in split if e[0] == "message"] == expected
    assert split_results == whole_results == [b"OK"] * sum(1 for f in frames if f[0] == "ok")
    # Each heartbeat answered with one NOP, nothing else written.
    nops = sum(1 for f in frames if f[0] == "heartbeat")
    written = conn.written()
    if compression is None:
        assert written == b"NOP\n" * nops
    assert conn.proto.connected
    assert sum(1 for e in split if e[0] == "error") == sum(1 for f in frames if f[0] == "fin_failed")


@_SETTINGS
@given(garbage=st.binary(min_size=1, max_size=400),
       compression=st.sampled_from([None, "snappy", "deflate"]),
       pending=st.integers(0, 3))
def test_garbage_from_the_server_closes_cleanly_and_settles_every_command(garbage, compression,
                                                                          pending):
    conn, _codec = _handshaken(compression)
    results: list = []
    for _ in range(pending):
        conn.proto.pub("t", b"x").addBoth(results.append)
    conn.feed(garbage)  # must not raise
    transport: StringTransport = conn.transport
    if transport.disconnecting or getattr(transport, "disconnected", False):
        assert not conn.proto.connected
    conn.lose()
    # Whatever the garbage did (answers, an error frame, a bad frame), every
    # command is answered or failed once the connection is gone.
    assert len(results) == pending
    for r in results:
        assert r == b"OK" or hasattr(r, "value")
    assert conn.delegate.kinds().count("closed") == 1
