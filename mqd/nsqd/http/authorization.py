"""Bearer secrets for the HTTP endpoints that show message bodies, checked as AUTH is.

nsqd's HTTP API has no authentication, and mqd keeps it so for every
endpoint nsqd has. But mqd adds endpoints that reveal message bodies
(`/channel/peek`, `/topic/peek`) or write them to disk (`/snapshot`):
with `--auth-http-address` set, a TCP client must AUTH before it may
SUB, and these must not hand the same bodies to anyone who reaches the
HTTP port. So, only when auth is configured, they take the secret a TCP
client would send with AUTH as `Authorization: Bearer <secret>` and ask
the auth server about it exactly as AUTH does (mqd.nsqd.auth.AuthClient:
`remote_ip` the HTTP client's address, `tls` whether the request came
over HTTPS, `common_name` from its TLS client certificate, if any), then
check the answer's grants with the same `AuthState` rules.

Answers, in nsqd's JSON error style:

* no `Authorization` header, or not one `Bearer <secret>`:
  `401 {"message":"AUTH_REQUIRED"}`, with `WWW-Authenticate: Bearer`;
* a secret the auth server refuses, or an auth server that cannot be
  asked or answers what nsqd would refuse: `401 {"message":"AUTH_FAILED"}`
  (the reason is logged, never sent, as for AUTH);
* a secret without the grant the endpoint needs: `403 {"message":"UNAUTHORIZED"}`.

An answer is cached per (secret, remote_ip, tls, common_name) until its
`ttl` runs out, at most CACHE_SIZE of them (the oldest is dropped first),
so neither a burst of requests nor many secrets make the broker ask the
auth server once per request or keep answers without bound; requests
with the same key while it is being asked wait for that one query. A
refusal is not cached (as AUTH, the next attempt asks again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import ISSLTransport
from twisted.python.failure import Failure
from twisted.web.server import Request

from mqd.http.response import ApiError
from mqd.logs import get_logger
from mqd.peers import peer_host

if TYPE_CHECKING:
    from OpenSSL.crypto import X509

    from mqd.nsqd.auth import AuthClient, AuthState
    from mqd.nsqd.topic import Topic

__all__ = ["AuthCache", "CACHE_SIZE", "bearer_secret", "require_grant", "sees_every_queue"]

log = get_logger(__name__)

CACHE_SIZE = 1024

# (secret, remote_ip, tls, common_name): what the auth server is asked about.
Key = tuple[str, str, bool, str]

_SCHEME = b"bearer"


def bearer_secret(request: Request) -> str:
    """The secret of the request's one `Authorization: Bearer <secret>` header, else 401 AUTH_REQUIRED.

    The scheme's case does not matter (RFC 7235); the secret is what
    follows it and the spaces after it, printable ASCII without spaces.
    """
    values = request.requestHeaders.getRawHeaders(b"authorization") or []
    if len(values) == 1:
        scheme, _, secret = values[0].partition(b" ")
        secret = secret.lstrip(b" ").rstrip(b" \t")
        if scheme.lower() == _SCHEME and secret and all(0x21 <= c <= 0x7E for c in secret):
            return secret.decode("ascii")
    request.setHeader(b"WWW-Authenticate", b"Bearer")
    raise ApiError(401, "AUTH_REQUIRED")


def _remote_ip(request: Request) -> str:
    """The client's IP as AUTH reports it; "" for a unix socket peer."""
    address = request.getClientAddress()
    return peer_host(address) if hasattr(address, "host") else ""


def _common_name(request: Request) -> str:
    """The CN of the TLS client certificate the request came with, or ""."""
    transport = getattr(request.channel, "transport", None)
    if transport is None or not ISSLTransport.providedBy(transport):
        return ""
    try:
        # Twisted's TLS transport hands pyOpenSSL's certificate (typed `object` by its interface).
        cert = cast("X509 | None", transport.getPeerCertificate())
        return (cert.get_subject().CN or "") if cert is not None else ""
    except Exception as e:  # noqa: BLE001 - no name is what the auth server is then told
        log.debug("no TLS client certificate name: {error}", error=str(e))
        return ""


def sees_every_queue(state: AuthState, topics: Mapping[str, Topic]) -> bool:
    """Whether `state` grants `subscribe` on every topic and channel in `topics` (what a snapshot writes).

    A topic without channels needs a subscribe grant on some channel of it
    (AuthState.allows_topic), as /topic/peek does.
    """
    for name, topic in topics.items():
        channels = topic.channels
        if channels:
            if not all(state.allows(name, channel) for channel in channels):
                return False
        elif not state.allows_topic(name):
            return False
    return True


def require_grant(allowed: bool) -> None:
    """403 UNAUTHORIZED unless the grant the endpoint needs was found."""
    if not allowed:
        raise ApiError(403, "UNAUTHORIZED")


class AuthCache:
    """The auth server's answers for bearer secrets, cached until their TTL; see the module doc."""

    def __init__(self, client: AuthClient, clock, size: int = CACHE_SIZE) -> None:
        self.client = client
        self.clock = clock
        self.size = size
        self._answers: OrderedDict[Key, AuthState] = OrderedDict()
        self._asking: dict[Key, list[Deferred]] = {}

    @property
    def enabled(self) -> bool:
        """Whether auth is configured: without it the endpoints answer as if this did not exist."""
        return self.client.enabled

    def guard(self, request: Request, handler: Callable[[AuthState | None], Any]) -> Any:
        """What `handler(auth)` answers once the request is authenticated.

        Without auth configured, `handler(None)` at once (the endpoint
        answers as it would without this module); else a Deferred of
        `handler(state)` for the request's AuthState, which checks the
        grants it needs (require_grant), or of the 401.
        """
        if not self.enabled:
            return handler(None)
        return self.authenticate(request).addCallback(handler)

    def authenticate(self, request: Request) -> Deferred:
        """Deferred firing with the AuthState of the request's secret, or failing with a 401 ApiError."""
        try:
            secret = bearer_secret(request)
        except ApiError:
            return fail()
        key = (secret, _remote_ip(request), bool(request.isSecure()), _common_name(request))
        d = self.state(key)
        d.addErrback(self._refused, request)
        return d

    def state(self, key: Key) -> Deferred:
        """The AuthState for `key`: cached while its TTL lasts, else asked once for every waiter."""
        answers = self._answers
        cached = answers.get(key)
        if cached is not None:
            if self.clock.seconds() < cached.expires:
                return succeed(cached)
            del answers[key]
        d: Deferred = Deferred()
        waiting = self._asking.get(key)
        if waiting is not None:
            waiting.append(d)
            return d
        self._asking[key] = [d]
        query = self.client.query(key[1], key[2], key[0], key[3])
        query.addBoth(self._answered, key)
        return d

    def __len__(self) -> int:
        return len(self._answers)

    def _answered(self, result, key: Key) -> None:
        waiting = self._asking.pop(key)
        if not isinstance(result, Failure):
            answers = self._answers
            answers[key] = result
            while len(answers) > self.size:
                answers.popitem(last=False)
        for d in waiting:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)

    @staticmethod
    def _refused(failure: Failure, request: Request) -> Failure:
        """A refused or unaskable secret: logged as AUTH logs it, answered 401 AUTH_FAILED."""
        if failure.check(ApiError):
            return failure
        log.warn("HTTP client {remote}: AUTH failed for {method} {path} - {error}",
                 remote=_remote_ip(request) or "unix", method=request.method.decode("ascii", "replace"),
                 path=request.path.decode("ascii", "replace"), error=failure.getErrorMessage())
        request.setHeader(b"WWW-Authenticate", b'Bearer error="invalid_token"')
        raise ApiError(401, "AUTH_FAILED")
