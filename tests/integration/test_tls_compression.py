"""TLS and compression negotiated by IDENTIFY, against a running broker.

pynsq drives every combination end to end (TLS, TLS with a client
certificate, snappy, deflate, TLS + either). A raw client (zlib / cramjam's
snappy) repeats the compressed ones byte by byte, so the tests also show
what pynsq hides: the exact upgrade order, messages spanning snappy chunks,
and that corrupt input closes only the offending connection.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import pytest

from tests.support.certs import client_context, tls_flags
from tests.support.processes import NO_PROXY
from tests.support.pynsq_loop import Collector
from tests.support.raw_conn import FRAME_ERROR, FRAME_RESPONSE, RawConn, UpgradingConn, command


def pynsq_tls(certs, **options: str) -> dict:
    """pynsq's keyword arguments for TLS verified against the test CA."""
    return {"tls_v1": True,
            "tls_options": {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": str(certs.ca), **options}}


def pub_and_consume(broker, name, **upgrade) -> dict:
    """Publish through one upgraded connection and consume through another; the IDENTIFY answer."""
    topic = name()
    with UpgradingConn(broker) as pub, UpgradingConn(broker) as sub:
        answer = pub.negotiate(**upgrade)
        sub.negotiate(**upgrade)
        sub.send(command(f"SUB {topic} ch") + command("RDY 10"))
        assert sub.read_frame() == (FRAME_RESPONSE, b"OK")
        bodies = [b"small", bytes(range(256)) * 300]  # one over snappy's 64 KiB chunk
        for body in bodies:
            pub.send(command(f"PUB {topic}", body))
            assert pub.read_frame() == (FRAME_RESPONSE, b"OK")
        got = []
        for _ in bodies:
            _, _, msg_id, body = sub.read_message()
            sub.send(command(f"FIN {msg_id.decode()}"))
            got.append(body)
        assert got == bodies
    return answer


# -- TLS with pynsq ----------------------------------------------------------------------


def test_tls_with_pynsq(start_broker, loop, name, certs):
    broker = start_broker(*tls_flags(certs))
    topic = name()
    collector = Collector()
    loop.reader(broker, topic, "ch", collector, **pynsq_tls(certs))
    writer = loop.writer(broker, **pynsq_tls(certs))
    assert loop.publish(writer, "pub", topic, b"secret") == b"OK"
    loop.run_until(lambda: collector.bodies == [b"secret"], what="the message over TLS")
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200
    clients = stats["topics"][0]["channels"][0]["clients"]
    assert clients[0]["tls"] is True
    # Named as nsqd names them (pynsq's tornado settles on TLS 1.2 or 1.3,
    # depending on its version), and AES-128-GCM picked as nsqd picks it.
    version, suite = clients[0]["tls_version"], clients[0]["tls_cipher_suite"]
    assert version in ("TLS1.2", "TLS1.3"), version
    assert suite == "TLS_AES_128_GCM_SHA256" if version == "TLS1.3" else (
        suite.startswith("TLS_ECDHE_") and suite.endswith("_WITH_AES_128_GCM_SHA256")), suite


@pytest.mark.parametrize("offer, expected", [
    ("ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-ECDSA-AES128-GCM-SHA256", "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"),
    ("ECDHE-ECDSA-CHACHA20-POLY1305", "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256"),
], ids=["aes128-gcm-preferred", "chacha-only"])
def test_tls12_stats_names_as_nsqd(start_broker, certs, name, offer, expected):
    broker = start_broker(*tls_flags(certs))
    topic = name()
    ctx = client_context(certs)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(offer)
    with UpgradingConn(broker) as conn:
        conn.negotiate(tls=ctx)
        conn.send(command(f"SUB {topic} ch"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200
    [client] = stats["topics"][0]["channels"][0]["clients"]
    assert (client["tls_version"], client["tls_cipher_suite"]) == ("TLS1.2", expected)


def test_tls_client_cert_require_verify(start_broker, loop, name, certs):
    broker = start_broker(*tls_flags(certs, "--tls-client-auth-policy=require-verify",
                                     f"--tls-root-ca-file={certs.ca}"))
    topic = name()
    writer = loop.writer(broker, **pynsq_tls(certs, certfile=str(certs.client_cert),
                                             keyfile=str(certs.client_key)))
    assert loop.publish(writer, "pub", topic, b"verified") == b"OK"
    # Without a certificate, and with one from a CA the broker does not
    # trust, the handshake fails; the broker carries on.
    for ctx in (client_context(certs), client_context(certs, other=True)):
        with UpgradingConn(broker) as conn, pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            conn.negotiate(tls=ctx)
            conn.send(command("NOP"))
            conn.read_frame()
    assert loop.publish(writer, "pub", topic, b"still fine") == b"OK"
    # The policy forces --tls-required: plaintext commands are refused.
    with RawConn(broker) as plain:
        plain.send(command(f"PUB {topic}", b"x"))
        assert plain.read_frame() == (FRAME_ERROR, b"E_INVALID cannot PUB in current state (TLS required)")
        plain.expect_closed()


def test_tls_require_policy_accepts_any_client_cert(start_broker, certs, name):
    broker = start_broker(*tls_flags(certs, "--tls-client-auth-policy=require"))
    with UpgradingConn(broker) as conn:
        conn.negotiate(tls=client_context(certs, other=True))
        conn.send(command(f"PUB {name()}", b"x"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_compression_with_pynsq(start_broker, loop, name, certs, kind, tls):
    broker = start_broker(*tls_flags(certs))
    topic = name()
    kwargs = {kind: True, **(pynsq_tls(certs) if tls else {})}
    collector = Collector()
    loop.reader(broker, topic, "ch", collector, **kwargs)
    writer = loop.writer(broker, **kwargs)
    bodies = [b"first", bytes(range(256)) * 1000]
    for body in bodies:
        assert loop.publish(writer, "pub", topic, body) == b"OK"
    loop.run_until(lambda: collector.bodies == bodies, what=f"the messages over {kind}")
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200
    [client] = stats["topics"][0]["channels"][0]["clients"]
    assert (client[kind], client["tls"]) == (True, tls)


# -- tls-required and HTTPS ---------------------------------------------------------------


def test_tls_required_tcp_and_http(start_broker, certs, name):
    broker = start_broker(*tls_flags(certs, "--tls-required"))
    with RawConn(broker) as plain:
        plain.send(command("NOP"))
        assert plain.read_frame() == (FRAME_ERROR, b"E_INVALID cannot NOP in current state (TLS required)")
        plain.expect_closed()
    with UpgradingConn(broker) as conn:
        assert conn.negotiate(tls=client_context(certs))["tls_v1"] is True
        conn.send(command(f"PUB {name()}", b"x"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
    assert broker.https_port
    with pytest.raises(urllib.error.HTTPError) as refused:
        NO_PROXY.open(f"http://{broker.http_address}/ping", timeout=5)
    assert refused.value.code == 403
    assert json.loads(refused.value.read()) == {"message": "TLS_REQUIRED", "https_port": broker.https_port}
    https = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                        urllib.request.HTTPSHandler(context=client_context(certs)))
    with https.open(f"https://127.0.0.1:{broker.https_port}/ping", timeout=5) as response:
        assert response.read() == b"OK"


def test_tcp_https_keeps_plain_http(start_broker, certs):
    broker = start_broker(*tls_flags(certs, "--tls-required=tcp-https"))
    with NO_PROXY.open(f"http://{broker.http_address}/ping", timeout=5) as response:
        assert response.read() == b"OK"


# -- compression, with and without TLS -------------------------------------------------------


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_compression(twistd_broker, name, kind):
    answer = pub_and_consume(twistd_broker, name, **{kind: True})
    assert (answer["snappy"], answer["deflate"], answer["tls_v1"]) == (kind == "snappy", kind == "deflate", False)


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_tls_plus_compression(start_broker, certs, name, kind):
    broker = start_broker(*tls_flags(certs))
    answer = pub_and_consume(broker, name, tls=client_context(certs), **{kind: True})
    assert (answer["tls_v1"], answer[kind]) == (True, True)


def test_compression_off_by_flag(start_broker, name):
    broker = start_broker("--snappy=false", "--deflate=false")
    answer = pub_and_consume(broker, name, snappy=True)
    assert (answer["snappy"], answer["deflate"]) == (False, False)


# -- bad input closes only the offending connection ------------------------------------------


def test_bad_tls_and_compressed_input_close_only_that_connection(start_broker, certs, name):
    broker = start_broker(*tls_flags(certs))
    topic = name()
    with UpgradingConn(broker) as bystander:
        bystander.negotiate(tls=client_context(certs), deflate=True)
        bystander.send(command(f"SUB {topic} ch") + command("RDY 5"))
        assert bystander.read_frame() == (FRAME_RESPONSE, b"OK")

        # Garbage where the TLS handshake should be.
        with UpgradingConn(broker) as garbage:
            garbage.send(command("IDENTIFY", json.dumps({"feature_negotiation": True, "tls_v1": True}).encode()))
            assert garbage.read_frame()[0] == FRAME_RESPONSE
            garbage.send_raw(b"\x16\x03\x01\x00\x05hello, this is not TLS" * 10)
            # The broker answers with a TLS alert record, then closes.
            got = b""
            while chunk := garbage.sock.recv(65536):
                got += chunk
            assert got[:1] in (b"", b"\x15"), got

        # A corrupt stream after snappy / deflate was negotiated.
        for kind, junk in (("snappy", b"\x00\x10\x00\x00" + b"\xee" * 16), ("deflate", b"\xff" * 64)):
            with UpgradingConn(broker) as corrupt:
                corrupt.negotiate(**{kind: True})
                corrupt.send_raw(junk)
                corrupt.expect_closed()

        with UpgradingConn(broker) as publisher:
            publisher.negotiate(snappy=True)
            publisher.send(command(f"PUB {topic}", b"after the bad ones"))
            assert publisher.read_frame() == (FRAME_RESPONSE, b"OK")
        _, _, _, body = bystander.read_message()
        assert body == b"after the bad ones"
    assert "Traceback" not in broker.log() and "Unhandled" not in broker.log(), broker.describe()


def test_both_compressions_refused(twistd_broker):
    with RawConn(twistd_broker) as conn:
        conn.send(command("IDENTIFY", json.dumps(
            {"feature_negotiation": True, "snappy": True, "deflate": True}).encode()))
        assert conn.read_frame() == (
            FRAME_ERROR, b"E_IDENTIFY_FAILED cannot enable both deflate and snappy compression")
        conn.expect_closed()

