"""Throwaway certificates for the TLS tests, made by the test run itself (never committed).

A CA, a server certificate for 127.0.0.1/localhost signed by it, and a
client certificate signed by it; plus a second, unrelated CA whose client
certificate the broker must refuse under require-verify.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_client_cert: Path  # signed by a CA the broker does not trust
    other_client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _issue(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False,
           server: bool = False, client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                          crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                        critical=False)
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                                        critical=False)
    if client:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
                                        critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM

    def new_key():
        return ec.generate_private_key(ec.SECP256R1())

    ca_key = new_key()
    ca_cert = _issue("mqd test CA", ca_key, _name("mqd test CA"), ca_key, ca=True)
    (directory / "ca.pem").write_bytes(ca_cert.public_bytes(pem))

    paths = {}
    for label, kw in (("server", {"server": True}), ("client", {"client": True})):
        key = new_key()
        cert = _issue(f"mqd-test-{label}", key, ca_cert.subject, ca_key, **kw)
        (directory / f"{label}.pem").write_bytes(cert.public_bytes(pem))
        _write_key(directory / f"{label}.key", key)
        paths[label] = (directory / f"{label}.pem", directory / f"{label}.key")

    other_ca_key = new_key()
    other_ca = _issue("untrusted CA", other_ca_key, _name("untrusted CA"), other_ca_key, ca=True)
    other_key = new_key()
    other = _issue("mqd-test-stranger", other_key, other_ca.subject, other_ca_key, client=True)
    (directory / "other.pem").write_bytes(other.public_bytes(pem))
    _write_key(directory / "other.key", other_key)

    return Certs(
        ca=directory / "ca.pem",
        server_cert=paths["server"][0], server_key=paths["server"][1],
        client_cert=paths["client"][0], client_key=paths["client"][1],
        other_client_cert=directory / "other.pem", other_client_key=directory / "other.key",
    )


def tls_flags(certs, *extra: str) -> tuple[str, ...]:
    return (f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}",
            "--https-address=127.0.0.1:0", *extra)


def client_context(certs, *, client_cert: bool = False, other: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if client_cert:
        ctx.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    if other:
        ctx.load_cert_chain(str(certs.other_client_cert), str(certs.other_client_key))
    return ctx
