"""IDENTIFY's upgrades: negotiation answers, snappy/deflate streams, the TLS switch and policy."""

from __future__ import annotations

import json
import struct

import pytest

from mqd.nsqd.protocol.upgrades import UPGRADE_GAP
from mqd.nsqd.tap import Options
from mqd.nsqd.tlsconfig import server_tls
from mqd.options import MQD_OPTIONS, ConfigError, resolve
from mqd.wire.compression import DeflateCodec, SnappyCodec
from tests.support.codec_clients import DeflateClient, SnappyClient
from tests.support.inprocess_broker import settings
from tests.support.v2_client import Client, tls_client
from tests.support.v2_frames import cmd, err, identify, ok, parse_frames, pub


def split_first_frame(data: bytes) -> tuple[dict, bytes]:
    """The plaintext JSON answer to IDENTIFY, and the bytes after it."""
    size = struct.unpack(">i", data[:4])[0]
    frame_type = struct.unpack(">i", data[4:8])[0]
    assert frame_type == 0, data
    return json.loads(data[8:4 + size]), data[4 + size:]


def compressed_start(c: Client) -> bytes:
    """What the connection writes once its compression starts, UPGRADE_GAP after the answer."""
    c.broker.clock.advance(UPGRADE_GAP)
    return c.raw()


def test_both_compressions_fail(connect):
    c = connect()
    assert c.request(identify(feature_negotiation=True, snappy=True, deflate=True)) == [
        err("E_IDENTIFY_FAILED cannot enable both deflate and snappy compression")
    ]
    assert c.closed


def test_both_compressions_without_feature_negotiation_are_ok_and_upgrade_nothing(connect):
    c = connect()
    assert c.request(identify(snappy=True, deflate=True)) == [ok()]
    assert c.request(cmd("NOP")) == []
    assert not c.closed and not c.proto.snappy and not c.proto.deflate


def test_no_upgrade_without_feature_negotiation(connect):
    c = connect()
    assert c.request(identify(snappy=True)) == [ok()]
    assert c.request(cmd("NOP")) == []
    assert not c.closed and not c.proto.snappy


@pytest.mark.parametrize("kind, client_codec", [("snappy", SnappyClient), ("deflate", DeflateClient)])
def test_compressed_stream_both_ways(connect, kind, client_codec):
    c = connect()
    c.send(identify(feature_negotiation=True, **{kind: True}))
    answer, rest = split_first_frame(c.raw())
    assert answer[kind] is True
    assert answer["snappy" if kind == "deflate" else "deflate"] is False
    assert rest == b""  # the JSON answer goes out alone, as nsqd flushes it
    codec = client_codec()
    # The second OK comes compressed, in a later write.
    assert parse_frames(codec.decompress(compressed_start(c))) == [ok()]
    c.send(codec.compress(pub("t", b"hello") + pub("t", b"world")))
    assert parse_frames(codec.decompress(c.raw())) == [ok(), ok()]
    # A read may stop in the middle of a compressed chunk.
    data = codec.compress(pub("t", b"x" * 1000))
    c.send(data[:7])
    c.send(data[7:])
    assert parse_frames(codec.decompress(c.raw())) == [ok()]
    assert getattr(c.proto, kind) is True


def test_compressed_bytes_in_the_identify_read(connect):
    """Bytes after IDENTIFY in the same read are compressed already: they are decoded, not parsed."""
    c = connect()
    codec = SnappyClient()
    c.send(identify(feature_negotiation=True, snappy=True) + codec.compress(pub("t", b"early")))
    _, rest = split_first_frame(c.raw())
    assert rest == b""
    c.send(codec.compress(pub("t", b"later")))  # before the compression starts: kept
    assert c.raw() == b"" and c.proto._gate.reading_paused
    assert parse_frames(codec.decompress(compressed_start(c))) == [ok(), ok(), ok()]
    assert not c.proto._gate.reading_paused
    assert c.broker.topics["t"].message_count == 2
    assert not c.closed


def test_deflate_level_capped(make_broker):
    broker = make_broker(max_deflate_level=3)
    c = Client(broker)
    c.send(identify(feature_negotiation=True, deflate=True, deflate_level=9))
    answer, _ = split_first_frame(c.raw())
    assert (answer["deflate"], answer["deflate_level"], answer["max_deflate_level"]) == (True, 3, 3)


@pytest.mark.parametrize("flag", ["snappy", "deflate"])
def test_compression_disabled_by_flag(make_broker, flag):
    broker = make_broker(**{flag: False})
    c = Client(broker)
    c.send(identify(feature_negotiation=True, **{flag: True}))
    answer, rest = split_first_frame(c.raw())
    assert answer[flag] is False
    assert rest == b""
    assert c.request(cmd("NOP")) == [] and not c.closed


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_corrupt_compressed_input_closes_only_that_connection(connect, kind):
    bad, good = connect(), connect()
    bad.send(identify(feature_negotiation=True, **{kind: True}))
    bad.raw()
    compressed_start(bad)
    garbage = b"\x00\x05\x00\x00garbage-garbage" if kind == "snappy" else b"\xff" * 32
    bad.send(garbage)
    assert bad.closed
    assert good.request(pub("t", b"still here")) == [ok()]
    assert not good.closed


def test_codecs_round_trip_large_batches():
    for server, client in ((SnappyCodec(), SnappyClient()), (DeflateCodec(6), DeflateClient())):
        payload = bytes(range(256)) * 2000  # over snappy's 64 KiB chunk size
        assert client.decompress(server.compress(payload)) == payload
        assert server.decompress(client.compress(payload)) == payload


# -- TLS ---------------------------------------------------------------------------------


def test_tls_upgrade_order(inproc_broker):
    c = tls_client(inproc_broker)
    c.send(identify(feature_negotiation=True, tls_v1=True, deflate=True))
    data = c.transport.value()
    answer, _ = split_first_frame(data)
    assert (answer["tls_v1"], answer["deflate"]) == (True, True)
    # JSON in plaintext, then TLS, then OK (through TLS), then the compressed OK.
    at = c.transport.tls_started_at
    assert data[:at].endswith(b"}")  # nothing but the JSON before the handshake
    after = data[at:]
    assert after == struct.pack(">ii", 6, 0) + b"OK"  # this OK goes out encrypted
    # The compression starts once the handshake is done and that OK sent.
    c.broker.clock.advance(UPGRADE_GAP)
    assert c.transport.value() == data and not c.proto.deflate
    c.proto.handshakeCompleted()
    assert c.transport.value() == data
    codec = DeflateClient()
    assert parse_frames(codec.decompress(compressed_start(c)[len(data):])) == [ok()]
    assert c.proto.tls and c.proto.deflate


def test_tls_required_rejects_commands_before_upgrade(inproc_broker):
    c = tls_client(inproc_broker, required="true")
    assert c.request(pub("t", b"x")) == [err("E_INVALID cannot PUB in current state (TLS required)")]
    assert c.closed


def test_tls_required_rejects_unknown_commands_alike(inproc_broker):
    c = tls_client(inproc_broker, required="tcp-https")
    assert c.request(cmd("BOGUS")) == [err("E_INVALID cannot BOGUS in current state (TLS required)")]


def test_tls_required_allows_identify_then_commands_after_upgrade(inproc_broker):
    c = tls_client(inproc_broker, required="true")
    c.send(identify(feature_negotiation=True, tls_v1=True))
    c.raw()
    assert c.request(pub("t", b"x")) == [ok()]


def test_tls_required_identify_without_tls_then_fails(inproc_broker):
    c = tls_client(inproc_broker, required="true")
    c.send(identify(feature_negotiation=True))
    answer, _ = split_first_frame(c.raw())
    assert answer["tls_v1"] is False
    assert c.request(cmd("NOP")) == [err("E_INVALID cannot NOP in current state (TLS required)")]


# -- options -----------------------------------------------------------------------------


def test_tls_required_without_certificate_is_a_startup_error(tmp_path):
    with pytest.raises(ConfigError, match="without TLS key and cert"):
        server_tls(settings(tmp_path, tls_required="true"))
    with pytest.raises(ConfigError, match="without TLS key and cert"):
        server_tls(settings(tmp_path, tls_client_auth_policy="require"))
    assert server_tls(settings(tmp_path)) is None


@pytest.mark.parametrize("args, expected", [
    (["--tls-required"], "true"),
    (["--tls-required=false"], "false"),
    (["--tls-required=tcp-https"], "tcp-https"),
    (["-tls-required=1"], "true"),
    ([], "false"),
])
def test_tls_required_flag_forms(tmp_path, args, expected):
    opts = Options()
    opts.parseOptions(args)
    values = opts.flag_values()
    values["data-path"] = str(tmp_path)
    assert resolve(MQD_OPTIONS, values).tls_required == expected


def test_bad_tls_required_value(tmp_path):
    with pytest.raises(ConfigError, match="true, false or tcp-https"):
        settings(tmp_path, tls_required="maybe")


# -- the compression's start: a write of its own ---------------------------------------


def test_tls_with_compression_waits_for_the_handshake_keeping_input(inproc_broker):
    """Reading goes on for the handshake; input decrypted before the codec is on waits for it."""
    c = tls_client(inproc_broker)
    c.send(identify(feature_negotiation=True, tls_v1=True, snappy=True))
    data = c.raw()
    assert not c.proto._gate.reading_paused  # the TLS handshake needs reading
    c.proto.handshakeCompleted()
    assert c.proto._gate.reading_paused and not c.proto.snappy
    codec = SnappyClient()
    c.send(codec.compress(pub("t", b"pipelined")))  # what the TLS layer decrypted meanwhile
    assert c.raw() == b""
    assert parse_frames(codec.decompress(compressed_start(c))) == [ok(), ok()]
    assert c.proto.snappy and not c.proto._gate.reading_paused
    assert data.endswith(struct.pack(">ii", 6, 0) + b"OK")


def test_connection_lost_before_compression_starts(connect):
    c = connect()
    c.send(identify(feature_negotiation=True, deflate=True))
    c.raw()
    c.lose()
    assert compressed_start(c) == b""
    assert c.proto._upgrades.codec is None and not c.proto.deflate


# What nsqd (Go 1.19's compress/flate, Write then Flush) sends for the
# upgrade's OK frame as the stream's first bytes: stored at level 1,
# literals at 2 to 9 (no match of Go's 4-byte minimum).
GO_DEFLATE_OK = {
    1: "000a00f5ff00000006000000004f4b000000ffff",
    **{level: "6260606063606060f0f706000000ffff" for level in range(2, 10)},
}


@pytest.mark.parametrize("level", range(1, 10))
def test_deflate_ok_bytes_as_nsqd_sends_them(make_broker, level):
    broker = make_broker(max_deflate_level=9)
    c = Client(broker)
    c.send(identify(feature_negotiation=True, deflate=True, deflate_level=level))
    c.raw()
    assert compressed_start(c).hex() == GO_DEFLATE_OK[level]
    # The stream goes on decodable after those blocks.
    codec = DeflateClient()
    codec.decompress(bytes.fromhex(GO_DEFLATE_OK[level]))
    c.send(codec.compress(pub("t", b"OK") + pub("t", b"x" * 100)))
    assert parse_frames(codec.decompress(c.raw())) == [ok(), ok()]
