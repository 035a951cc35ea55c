"""/stats names a TLS connection's version and cipher suite as nsqd does, and the broker picks what nsqd picks.

The expectations come from nsqd 1.3.0's /stats rows over real TLS
handshakes (tests/fixtures/nsq_tools/nsqd_stats_tls.json); the handshakes
here run pyOpenSSL in memory, client and server, with no sockets.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from OpenSSL import SSL
from twisted.internet.interfaces import IOpenSSLContextFactory
from twisted.protocols.tls import TLSMemoryBIOFactory
from zope.interface.verify import verifyObject

from mqd.nsqd.tls_names import IANA_CIPHER_NAMES, iana_cipher_name, tls_version_name
from mqd.nsqd.tlsconfig import go_cipher_order, server_tls
from tests.support.inprocess_broker import settings
from tests.support.v2_client import tls_client
from tests.support.v2_frames import identify

FIXTURE = Path(__file__).parent.parent / "fixtures" / "nsq_tools" / "nsqd_stats_tls.json"
OBSERVED = [o for o in json.loads(FIXTURE.read_text())["observations"] if not o.get("handshake_failed")]
# IANA code points of the suites nsqd 1.3.0 prints as `Unknown <code>`.
IANA_CODES = {
    4865: "TLS_AES_128_GCM_SHA256",
    156: "TLS_RSA_WITH_AES_128_GCM_SHA256",
    49196: "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
    49200: "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
    52392: "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
    52393: "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
}


def default_suites() -> list[str]:
    return SSL.Connection(SSL.Context(SSL.TLS_SERVER_METHOD), None).get_cipher_list()


@pytest.mark.parametrize("seen", OBSERVED, ids=lambda o: f"{o['certificate']}-{o['case']}")
def test_names_match_what_nsqd_reported(seen):
    # Python's ssl names versions and suites as OpenSSL does.
    assert tls_version_name(seen["client_version"]) == seen["tls_version"]
    nsqd = seen["tls_cipher_suite"]
    if nsqd.startswith("Unknown "):
        # nsqd prints the code point of a suite it has no name for; the IANA name is given instead.
        nsqd = IANA_CODES[int(nsqd.split()[1])]
    assert iana_cipher_name(seen["client_cipher"]) == nsqd


def test_tls13_suites_keep_their_iana_names():
    for name in ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"):
        assert iana_cipher_name(name) == name


def test_every_suite_the_broker_can_negotiate_has_an_iana_name():
    # PSK and SRP suites need callbacks the broker never sets, so they cannot be negotiated.
    negotiable = [n for n in default_suites() if "PSK" not in n and "SRP" not in n]
    assert negotiable
    assert [n for n in negotiable if not iana_cipher_name(n).startswith("TLS_")] == []


def test_unknown_names_pass_through():
    assert iana_cipher_name("SOME-FUTURE-SUITE") == "SOME-FUTURE-SUITE"
    assert iana_cipher_name("") == ""
    assert tls_version_name("TLSv1.4") == "TLS1.4"


def test_table_values_are_iana_names():
    assert all(v.startswith("TLS_") and "_WITH_" in v for v in IANA_CIPHER_NAMES.values())
    assert len(set(IANA_CIPHER_NAMES.values())) == len(IANA_CIPHER_NAMES)


class FakeHandle:
    """What handshakeCompleted reads from the TLS connection."""

    def __init__(self, version: str, cipher: str) -> None:
        self.version, self.cipher = version, cipher

    def get_protocol_version_name(self) -> str:
        return self.version

    def get_cipher_name(self) -> str:
        return self.cipher

    def get_peer_certificate(self):
        return None


@pytest.mark.parametrize("version, cipher, want_version, want_cipher", [
    ("TLSv1.2", "ECDHE-RSA-AES128-GCM-SHA256", "TLS1.2", "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"),
    ("TLSv1", "ECDHE-ECDSA-AES128-SHA", "TLS1.0", "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA"),
    ("TLSv1.3", "TLS_AES_128_GCM_SHA256", "TLS1.3", "TLS_AES_128_GCM_SHA256"),
])
def test_handshake_records_nsqd_names_for_stats(inproc_broker, version, cipher, want_version, want_cipher):
    c = tls_client(inproc_broker)
    c.send(identify(feature_negotiation=True, tls_v1=True))
    c.transport.getHandle = lambda: FakeHandle(version, cipher)
    c.proto.handshakeCompleted()
    assert (c.proto.tls_version, c.proto.tls_cipher_suite) == (want_version, want_cipher)


# -- the broker's choice -------------------------------------------------------------


def test_go_order_keeps_the_same_suites_and_puts_aes128_gcm_first():
    names = default_suites()
    ordered = go_cipher_order(names)
    assert sorted(ordered) == sorted(names)
    tls12 = [n for n in ordered if not n.startswith("TLS_")]
    assert tls12[:4] == ["ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
                         "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384"]
    assert [n for n in ordered if n.startswith("TLS_")][0] == "TLS_AES_128_GCM_SHA256"


def handshake(server_ctx, client_ctx) -> SSL.Connection:
    """Run a TLS handshake between two in-memory connections; the server's side."""
    server = SSL.Connection(server_ctx, None)
    server.set_accept_state()
    client = SSL.Connection(client_ctx, None)
    client.set_connect_state()
    for _ in range(20):
        for a, b in ((client, server), (server, client)):
            try:
                a.do_handshake()
            except SSL.WantReadError:
                pass
            try:
                b.bio_write(a.bio_read(65536))
            except SSL.WantReadError:
                pass
        if server.get_cipher_name() and client.get_cipher_name():
            try:
                server.do_handshake()
                return server
            except SSL.WantReadError:
                continue
    raise AssertionError("handshake did not finish")


def client_ctx(max_version: int, ciphers: bytes | None = None) -> SSL.Context:
    ctx = SSL.Context(SSL.TLS_CLIENT_METHOD)
    ctx.set_max_proto_version(max_version)
    if ciphers:
        ctx.set_cipher_list(ciphers)
    return ctx


@pytest.mark.parametrize("max_version, ciphers, want", [
    # A client listing AES-256-GCM first still gets AES-128-GCM, as from nsqd.
    (SSL.TLS1_2_VERSION, b"ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-ECDSA-AES128-GCM-SHA256",
     ("TLSv1.2", "ECDHE-ECDSA-AES128-GCM-SHA256")),
    (SSL.TLS1_2_VERSION, None, ("TLSv1.2", "ECDHE-ECDSA-AES128-GCM-SHA256")),
    (SSL.TLS1_3_VERSION, None, ("TLSv1.3", "TLS_AES_128_GCM_SHA256")),
    # What the client alone offers is still accepted: nothing was taken away.
    (SSL.TLS1_2_VERSION, b"ECDHE-ECDSA-AES256-GCM-SHA384", ("TLSv1.2", "ECDHE-ECDSA-AES256-GCM-SHA384")),
], ids=["aes256-listed-first", "tls12-defaults", "tls13-defaults", "aes256-only"])
def test_broker_picks_the_suite_nsqd_picks(tmp_path, certs, max_version, ciphers, want):
    tls = server_tls(settings(tmp_path, tls_cert=str(certs.server_cert), tls_key=str(certs.server_key)))
    server = handshake(tls.getContext(), client_ctx(max_version, ciphers))
    assert (server.get_protocol_version_name(), server.get_cipher_name()) == want


def test_broker_tls_is_a_declared_context_factory(tmp_path, certs):
    """Twisted's TLS wrapper takes it as a context factory, with no legacy-factory warning."""
    tls = server_tls(settings(tmp_path, tls_cert=str(certs.server_cert), tls_key=str(certs.server_key)))
    assert verifyObject(IOpenSSLContextFactory, tls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TLSMemoryBIOFactory(tls, False, None)
    assert [str(w.message) for w in caught] == []
