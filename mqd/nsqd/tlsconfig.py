"""The server TLS context nsqd builds from its --tls-* flags, for TCP upgrades and HTTPS.

One OpenSSL context serves every TLS connection of a broker: the V2
protocol's IDENTIFY upgrade (`transport.startTLS`) and the HTTPS listener.
It is built once at start-up so a bad certificate, key or CA file stops
the broker with one line instead of failing each handshake.
"""

from __future__ import annotations

from twisted.internet.interfaces import IOpenSSLContextFactory
from zope.interface import implementer

from mqd.options import ConfigError

__all__ = ["ServerTLS", "go_cipher_order", "server_tls"]


@implementer(IOpenSSLContextFactory)
class ServerTLS:
    """A Twisted context factory (getContext) around one shared OpenSSL context.

    It declares `IOpenSSLContextFactory`, which is how Twisted's TLS
    wrapper (the HTTPS listener's `TLSMemoryBIOFactory`) knows it for a
    context factory rather than guessing from its methods and warning.
    """

    def __init__(self, context, required: str) -> None:
        self._context = context
        # "true", "tcp-https" or "false", as --tls-required resolved.
        self.required = required

    def getContext(self):
        return self._context

    @property
    def tcp_required(self) -> bool:
        return self.required in ("true", "tcp-https")

    @property
    def http_required(self) -> bool:
        return self.required == "true"


def _verify_any(conn, cert, errno, depth, ok) -> bool:
    """`require`: a client certificate must be sent, but it is not checked (nsqd's RequireAnyClientCert)."""
    return True


def _verify_chain(conn, cert, errno, depth, ok) -> bool:
    return bool(ok)


def _go_rank(name: str) -> tuple[int, int, int]:
    """Where Go's crypto/tls ranks a cipher suite, as far as reordering OpenSSL's list needs.

    Go puts forward-secret AEAD suites first, ECDHE before anything else,
    and among them AES-128-GCM, then AES-256-GCM, then ChaCha20-Poly1305
    (with AES in hardware, as on any server nsqd runs on). Everything else
    ranks after them, in OpenSSL's own order.
    """
    upper = name.upper()
    aead = any(tag in upper for tag in ("GCM", "CHACHA20", "CCM"))
    # TLS 1.3 suites (OpenSSL names them TLS_*) always use an ephemeral key exchange.
    forward_secret = upper.startswith(("ECDHE-", "DHE-", "TLS_")) and "PSK" not in upper
    if not (aead and forward_secret):
        return (1, 0, 0)
    exchange = 1 if upper.startswith("DHE-") else 0
    plain = upper.replace("_", "-")
    if "AES128-GCM" in plain or "AES-128-GCM" in plain:
        cipher = 0
    elif "AES256-GCM" in plain or "AES-256-GCM" in plain:
        cipher = 1
    elif "CHACHA20" in plain:
        cipher = 2
    else:
        cipher = 3
    return (0, exchange, cipher)


def go_cipher_order(names: list[str]) -> list[str]:
    """`names` (OpenSSL cipher names) reordered to Go's preference; the same names, none added or dropped."""
    return sorted(names, key=_go_rank)


def _prefer_like_go(ctx) -> None:
    """Reorder the context's default suites so the server picks what nsqd picks.

    The broker chooses (OP_CIPHER_SERVER_PREFERENCE), and OpenSSL's default
    order starts with AES-256-GCM where Go's starts with AES-128-GCM; the
    set of suites stays OpenSSL's default, only the order changes.
    """
    from OpenSSL import SSL

    # Read from a context of its own: pyOpenSSL freezes a context once a
    # connection has been made from it.
    names = SSL.Connection(SSL.Context(SSL.TLS_SERVER_METHOD), None).get_cipher_list()
    tls12 = [n for n in names if not n.startswith("TLS_")]
    tls13 = [n for n in names if n.startswith("TLS_")]
    if tls12:
        ctx.set_cipher_list(":".join(go_cipher_order(tls12)).encode())
    if tls13:
        ctx.set_tls13_ciphersuites(":".join(go_cipher_order(tls13)).encode())


def tls_required_of(settings) -> str:
    """`--tls-required` as the broker applies it: a client-auth policy makes it `true`.

    nsqd: a client-auth policy makes no sense over plaintext, so it
    requires TLS whatever `--tls-required` says (and /config shows that).
    """
    if settings.tls_client_auth_policy and settings.tls_required == "false":
        return "true"
    return settings.tls_required


def server_tls(settings) -> ServerTLS | None:
    """The broker's TLS, or None when --tls-cert/--tls-key are not both set.

    Raises ConfigError for what nsqd refuses at start-up: TLS required
    without a certificate, unreadable or mismatched cert/key, a bad CA file.
    """
    cert, key = settings.tls_cert, settings.tls_key
    required = tls_required_of(settings)
    policy = settings.tls_client_auth_policy
    if not (cert and key):
        if required != "false":
            raise ConfigError("cannot require TLS client connections without TLS key and cert")
        if cert or key:
            raise ConfigError("--tls-cert and --tls-key must be given together")
        return None

    from OpenSSL import SSL

    versions = {
        "tls1.0": SSL.TLS1_VERSION,
        "tls1.1": SSL.TLS1_1_VERSION,
        "tls1.2": SSL.TLS1_2_VERSION,
        "tls1.3": SSL.TLS1_3_VERSION,
    }
    ctx = SSL.Context(SSL.TLS_SERVER_METHOD)
    ctx.set_min_proto_version(versions[settings.tls_min_version])
    ctx.set_options(SSL.OP_NO_COMPRESSION | SSL.OP_CIPHER_SERVER_PREFERENCE)
    _prefer_like_go(ctx)
    try:
        ctx.use_certificate_chain_file(cert)
        ctx.use_privatekey_file(key)
        ctx.check_privatekey()
    except (SSL.Error, OSError) as e:
        raise ConfigError(f"failed to load TLS key pair ({cert}, {key}): {e}") from None
    if policy:
        # Session resumption with client certificates needs an id context.
        ctx.set_session_id(b"mqd")
        mode = SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT
        if policy == "require":
            ctx.set_verify(mode, _verify_any)
        else:
            ctx.set_verify(mode, _verify_chain)
            try:
                if settings.tls_root_ca_file:
                    ctx.load_verify_locations(settings.tls_root_ca_file)
                else:
                    ctx.set_default_verify_paths()
            except (SSL.Error, OSError) as e:
                raise ConfigError(f"failed to load --tls-root-ca-file {settings.tls_root_ca_file}: {e}") from None
    return ServerTLS(ctx, required)
