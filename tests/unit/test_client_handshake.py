"""The client protocol's connection set-up on StringTransports: IDENTIFY, TLS, compression, AUTH.

Server frames are built with the broker's framing (and, compressed, the
broker's codecs); what the client wrote compressed is decoded with the
independent test codecs of tests/support/codec_clients.py.
"""

from __future__ import annotations

import json
import struct

import pytest
from twisted.internet import ssl
from twisted.internet.error import ConnectionLost

from mqd.client import errors
from mqd.client.errors import ConnectionClosed
from mqd.wire.compression import DeflateCodec, SnappyCodec
from mqd.wire.framing import HEARTBEAT, OK
from tests.support.client_conn import (
    MSG_ID,
    Conn,
    TLSTransport,
    error,
    message_frame,
    outcome,
    response,
    server_json,
)
from tests.support.codec_clients import DeflateClient, SnappyClient
from tests.support.v2_frames import sized

# -- the handshake ------------------------------------------------------------------


def test_handshake_bytes():
    conn = Conn(user_agent="ua/1", heartbeat_interval=20, msg_timeout="45s", sample_rate=5)
    data = conn.written()
    assert data.startswith(b"  V2IDENTIFY\n")
    (size,) = struct.unpack_from(">i", data, 13)
    body = data[17:]
    assert size == len(body)
    assert json.loads(body) == {
        "client_id": "cid", "hostname": "host.example", "user_agent": "ua/1",
        "feature_negotiation": True, "heartbeat_interval": 20000, "output_buffer_size": 16384,
        "output_buffer_timeout": 250, "msg_timeout": 45000, "tls_v1": False, "snappy": False,
        "deflate": False, "deflate_level": 6, "sample_rate": 5,
    }
    assert conn.results == []
    assert not conn.proto.connected


def test_feature_negotiation_answer_parsed():
    conn = Conn()
    conn.written()
    conn.feed(server_json(max_rdy_count=200, msg_timeout=30000))
    assert conn.results == [conn.proto]
    assert conn.proto.connected
    assert conn.proto.server["max_rdy_count"] == 200
    assert conn.proto.server["msg_timeout"] == 30000
    assert conn.proto.max_rdy_count == 200
    assert conn.delegate.kinds() == ["ready"]
    assert conn.written() == b""
    assert conn.proto.auth is None


def test_answer_split_byte_by_byte():
    conn = Conn()
    for i, byte in enumerate(server_json()):
        assert not conn.proto.connected, i
        conn.feed(bytes([byte]))
    assert conn.results == [conn.proto]


def test_old_server_ok_accepted():
    conn = Conn()
    conn.written()
    conn.feed(OK)
    assert conn.results == [conn.proto]
    assert conn.proto.server == {}
    assert conn.proto.max_rdy_count == 2500


def test_tls_refused_by_server_fails_the_handshake():
    conn = Conn(TLSTransport, tls_v1=True)
    conn.feed(server_json(tls_v1=False))
    assert isinstance(conn.results[0].value, ConnectionClosed)
    assert "tls_v1" in str(conn.results[0].value)
    assert conn.transport.disconnecting
    assert conn.transport.tls_started == []


def test_identify_error_fails_the_handshake():
    conn = Conn()
    conn.feed(error(b"E_BAD_BODY IDENTIFY heartbeat interval (300001) is invalid"))
    err = conn.results[0].value
    assert isinstance(err, errors.BadBodyError)
    assert err.detail == "IDENTIFY heartbeat interval (300001) is invalid"
    assert conn.transport.disconnecting
    conn.lose()
    assert conn.delegate.kinds() == ["closed"]
    assert conn.delegate.events[0][1].value is err


def test_bad_identify_answer_fails_the_handshake():
    conn = Conn()
    conn.feed(response(b"[1, 2]"))
    assert isinstance(conn.results[0].value, ConnectionClosed)
    assert conn.transport.disconnecting


def test_commands_before_the_handshake_wait_for_it():
    conn = Conn()
    conn.written()
    d1 = conn.proto.pub("t", b"a")
    d2 = conn.proto.pub("t", b"b")
    assert conn.written() == b""
    conn.feed(server_json())
    assert conn.written() == b"PUB t\n" + sized(b"a") + b"PUB t\n" + sized(b"b")
    conn.feed(OK + OK)
    assert (outcome(d1), outcome(d2)) == (b"OK", b"OK")


def test_lost_during_handshake_fails_ready_and_held_commands():
    conn = Conn()
    d = conn.proto.pub("t", b"a")
    conn.lose(ConnectionLost())
    assert isinstance(conn.results[0].value, ConnectionClosed)
    assert isinstance(conn.results[0].value.reason.value, ConnectionLost)
    assert isinstance(outcome(d), ConnectionClosed)
    assert conn.delegate.kinds() == ["closed"]


# -- TLS ------------------------------------------------------------------------------


def test_tls_upgrade_then_ok_over_tls():
    conn = Conn(TLSTransport, tls_v1=True, tls_server_name="nsqd.example")
    conn.written()
    conn.feed(server_json(tls_v1=True))
    assert len(conn.transport.tls_started) == 1
    assert conn.transport.tls_started[0]._hostnameASCII == "nsqd.example"
    assert conn.proto.tls
    assert conn.results == [] and not conn.proto.connected
    conn.feed(OK)  # the TLS layer hands the decrypted OK
    assert conn.results == [conn.proto]
    assert conn.written() == b""


def test_tls_insecure_creator_used():
    conn = Conn(TLSTransport, tls_v1=True, tls_insecure_skip_verify=True)
    conn.feed(server_json(tls_v1=True))
    (creator,) = conn.transport.tls_started
    assert isinstance(creator, ssl.CertificateOptions) and creator.verify is False


def test_tls_unreadable_ca_fails_the_handshake(tmp_path):
    conn = Conn(TLSTransport, tls_v1=True, tls_root_ca_file=str(tmp_path / "nope.pem"))
    conn.feed(server_json(tls_v1=True))
    assert isinstance(conn.results[0].value, errors.ClientConfigError)
    assert conn.transport.disconnecting
    assert conn.transport.tls_started == []


def test_tls_on_a_transport_without_start_tls():
    conn = Conn(tls_v1=True)
    conn.feed(server_json(tls_v1=True))
    assert isinstance(conn.results[0].value, ConnectionClosed)


def test_tls_wrong_answer_fails():
    conn = Conn(TLSTransport, tls_v1=True)
    conn.feed(server_json(tls_v1=True))
    conn.feed(response(b"NOT OK"))
    assert isinstance(conn.results[0].value, ConnectionClosed)


# -- compression ---------------------------------------------------------------------


CODECS = {
    "snappy": (SnappyCodec, SnappyClient, {"snappy": True}),
    "deflate": (lambda: DeflateCodec(6), DeflateClient, {"deflate": True}),
}


def compressed_conn(kind: str, leftover: bool = False, **options):
    """A connection through its compression handshake; returns (conn, server codec, decoder)."""
    make_codec, client_cls, flags = CODECS[kind]
    conn = Conn(**flags, **options)
    conn.written()
    server = make_codec()
    answer = server_json(**flags)
    if leftover:
        conn.feed(answer + server.compress(OK))  # one read: plain JSON, then compressed OK
    else:
        conn.feed(answer)
        assert conn.results == [] and conn.proto.compression == kind
        conn.feed(server.compress(OK))
    assert conn.results == [conn.proto]
    assert conn.proto.compression == kind
    return conn, server, client_cls()


@pytest.mark.parametrize("kind", sorted(CODECS))
@pytest.mark.parametrize("leftover", [False, True])
def test_compression_both_directions(kind, leftover):
    conn, server, decoder = compressed_conn(kind, leftover)
    d = conn.proto.pub("t", b"body")
    conn.proto.rdy(10)
    assert decoder.decompress(conn.written()) == b"PUB t\n" + sized(b"body") + b"RDY 10\n"
    conn.feed(server.compress(OK + message_frame(b"m1")))
    assert outcome(d) == b"OK"
    msg = conn.delegate.events[-1][1]
    assert msg.body == b"m1"
    msg.finish()
    assert decoder.decompress(conn.written()) == b"FIN " + MSG_ID + b"\n"


@pytest.mark.parametrize("kind", sorted(CODECS))
def test_frames_after_the_upgrade_in_the_same_read(kind):
    make_codec, _client_cls, flags = CODECS[kind]
    conn = Conn(**flags)
    server = make_codec()
    conn.feed(server_json(**flags) + server.compress(OK + HEARTBEAT + message_frame(b"early")))
    assert conn.results == [conn.proto]
    assert conn.delegate.kinds() == ["ready", "heartbeat", "message"]
    assert conn.delegate.events[-1][1].body == b"early"


@pytest.mark.parametrize("kind", sorted(CODECS))
def test_compressed_stream_split_byte_by_byte(kind):
    conn, server, _ = compressed_conn(kind)
    data = server.compress(message_frame(b"x" * 1000) + message_frame(b"y"))
    for i in range(len(data)):
        conn.feed(data[i:i + 1])
    assert [e[1].body for e in conn.delegate.events if e[0] == "message"] == [b"x" * 1000, b"y"]


@pytest.mark.parametrize("kind", sorted(CODECS))
def test_large_compressed_input_is_inflated_in_steps(kind, monkeypatch):
    conn, server, _ = compressed_conn(kind)
    calls = []
    codec = conn.proto._codec
    original = codec.decompress

    def counting(data, max_length=0):
        calls.append(max_length)
        return original(data, max_length)

    monkeypatch.setattr(codec, "decompress", counting)
    bodies = [bytes([65 + i % 26]) * 100_000 for i in range(8)]
    conn.feed(server.compress(b"".join(message_frame(b) for b in bodies)))
    assert [e[1].body for e in conn.delegate.events if e[0] == "message"] == bodies
    assert len(calls) > 4 and all(n == 64 * 1024 for n in calls)


def test_corrupt_compressed_stream_closes():
    conn, _server, _ = compressed_conn("deflate")
    d = conn.proto.pub("t", b"x")
    conn.feed(b"\xff" * 64)
    assert conn.transport.disconnecting
    conn.lose()
    assert isinstance(outcome(d), ConnectionClosed)
    assert "compressed" in str(conn.delegate.events[-1][1].value)


def test_tls_then_snappy_with_both_oks_in_one_read():
    conn = Conn(TLSTransport, tls_v1=True, snappy=True, tls_insecure_skip_verify=True)
    server = SnappyCodec()
    conn.feed(server_json(tls_v1=True, snappy=True))
    assert conn.transport.tls_started and conn.proto._codec is None
    conn.feed(OK + server.compress(OK))
    assert conn.results == [conn.proto]
    assert conn.proto.tls and conn.proto.compression == "snappy"


def test_deflate_level_from_the_server_answer():
    conn = Conn(deflate=True, deflate_level=9)
    conn.feed(server_json(deflate=True, deflate_level=3))
    assert conn.proto._codec._level == 3


# -- AUTH ---------------------------------------------------------------------------


AUTH_ANSWER = {"identity": "bob", "identity_url": "https://auth.example/bob", "permission_count": 2}


def test_auth_sent_when_required_and_its_json_kept():
    conn = Conn(auth_secret="s3cret")
    conn.written()
    conn.feed(server_json(auth_required=True))
    assert conn.written() == b"AUTH\n" + sized(b"s3cret")
    assert conn.results == []
    conn.feed(HEARTBEAT)  # nsqd heartbeats while the auth server thinks
    assert conn.written() == b"NOP\n" and conn.results == []
    conn.feed(response(json.dumps(AUTH_ANSWER).encode()))
    assert conn.results == [conn.proto]
    assert conn.proto.auth == AUTH_ANSWER


def test_auth_not_sent_when_not_required():
    conn = Conn(auth_secret="s3cret")
    conn.written()
    conn.feed(server_json())
    assert conn.written() == b""
    assert conn.proto.auth is None and conn.results == [conn.proto]


def test_auth_over_snappy_is_compressed():
    conn = Conn(snappy=True, auth_secret="pw")
    conn.written()
    server = SnappyCodec()
    decoder = SnappyClient()
    conn.feed(server_json(snappy=True, auth_required=True) + server.compress(OK))
    assert decoder.decompress(conn.written()) == b"AUTH\n" + sized(b"pw")
    conn.feed(server.compress(response(json.dumps(AUTH_ANSWER).encode())))
    assert conn.proto.auth == AUTH_ANSWER and conn.results == [conn.proto]


def test_missing_auth_secret_fails_the_handshake():
    conn = Conn()
    conn.written()
    conn.feed(server_json(auth_required=True))
    err = conn.results[0].value
    assert isinstance(err, errors.AuthRequiredError) and err.code == "E_AUTH_REQUIRED"
    assert isinstance(err, errors.AuthRefusedError) and err.nsq_text == "Auth Required"
    assert conn.written() == b""
    assert conn.transport.disconnecting


@pytest.mark.parametrize(("text", "cls"), [
    (b"E_AUTH_FAILED AUTH failed", errors.AuthFailedError),
    (b"E_UNAUTHORIZED AUTH no authorizations found", errors.UnauthorizedError),
    (b"E_AUTH_DISABLED AUTH disabled", errors.AuthDisabledError),
])
def test_auth_error_fails_the_handshake(text, cls):
    conn = Conn(auth_secret="x")
    conn.feed(server_json(auth_required=True))
    conn.feed(error(text))
    assert isinstance(conn.results[0].value, cls)
    assert conn.transport.disconnecting
