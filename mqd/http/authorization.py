"""Bearer secrets on the HTTP APIs of the broker and mqlookupd, checked as AUTH is.

nsqd's HTTP API has no authentication, and mqd keeps it so for every
endpoint nsqd has unless `--http-auth-required` is given. But mqd adds
endpoints that reveal message bodies (`/channel/peek`, `/topic/peek`) or
write them to disk (`/snapshot`): with `--auth-http-address` set, a TCP
client must AUTH before it may SUB, and these must not hand the same
bodies to anyone who reaches the HTTP port. So, when auth is configured,
they take the secret a TCP client would send with AUTH as
`Authorization: Bearer <secret>`; with `--http-auth-required` every
endpoint but `/ping` and `/info` does (`Guarded`, given the grant its
route needs: see docs/security.md). The auth server is asked about the
secret exactly as AUTH asks it (mqd.http.auth.AuthClient:
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
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime, ISSLTransport
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from mqd.http.args import query_of, topic_arg, topic_channel_args
from mqd.http.endpoint import Endpoint, client_gone
from mqd.http.response import ApiError, respond_v1
from mqd.logs import get_logger
from mqd.peers import peer_host

if TYPE_CHECKING:
    from OpenSSL.crypto import X509

    from mqd.http.auth import AuthClient, AuthState

__all__ = [
    "AuthCache",
    "CACHE_SIZE",
    "Guarded",
    "OPEN",
    "Rule",
    "admin_everywhere",
    "admin_on_channel",
    "admin_on_topic",
    "any_grant",
    "bearer_secret",
    "guard_routes",
    "publish_on_topic",
    "require_grant",
    "reads_topic",
]

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


def require_grant(allowed: bool) -> None:
    """403 UNAUTHORIZED unless the grant the endpoint needs was found."""
    if not allowed:
        raise ApiError(403, "UNAUTHORIZED")


class AuthCache:
    """The auth server's answers for bearer secrets, cached until their TTL; see the module doc."""

    def __init__(self, client: AuthClient, clock: IReactorTime, size: int = CACHE_SIZE) -> None:
        self.client = client
        self.clock = clock
        self.size = size
        self._answers: OrderedDict[Key, AuthState] = OrderedDict()
        self._asking: dict[Key, list[Deferred[AuthState]]] = {}

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

    def authenticate(self, request: Request) -> Deferred[AuthState]:
        """Deferred firing with the AuthState of the request's secret, or failing with a 401 ApiError."""
        try:
            secret = bearer_secret(request)
        except ApiError:
            return fail()
        key = (secret, _remote_ip(request), bool(request.isSecure()), _common_name(request))
        d = self.state(key)
        d.addErrback(self._refused, request)
        return d

    def state(self, key: Key) -> Deferred[AuthState]:
        """The AuthState for `key`: cached while its TTL lasts, else asked once for every waiter."""
        answers = self._answers
        cached = answers.get(key)
        if cached is not None:
            if self.clock.seconds() < cached.expires:
                return succeed(cached)
            del answers[key]
        d: Deferred[AuthState] = Deferred()
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

    def _answered(self, result: AuthState | Failure, key: Key) -> None:
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


# -- every endpoint behind a secret (--http-auth-required) ---------------------------------

# Whether the request's AuthState grants what its route needs. A rule reads
# the request's arguments as the endpoint does (the same mqd.http.args
# helpers, so the same 400 for a missing or malformed one: a rule can never
# judge a name other than the one the endpoint then acts on).
Rule = Callable[[Request, "AuthState"], bool]


def any_grant(request: Request, state: AuthState) -> bool:
    """Any secret the auth server accepts, whatever its grants (a reading endpoint without bodies)."""
    return True


def publish_on_topic(request: Request, state: AuthState) -> bool:
    """`publish` on the `topic` argument (AUTH's rule for PUB)."""
    return state.allows(topic_arg(query_of(request)), "")


def reads_topic(request: Request, state: AuthState) -> bool:
    """`publish` on the `topic` argument or `subscribe` on some channel of it (who may use the topic)."""
    topic = topic_arg(query_of(request), invalid=None)
    return state.allows(topic, "") or state.allows_topic(topic)


def admin_on_topic(request: Request, state: AuthState) -> bool:
    """An admin authorization whose topic pattern matches the `topic` argument.

    The name is not checked here (the endpoint checks it as it always has,
    with its own error text); only a missing one is refused first.
    """
    return state.allows_admin(topic_arg(query_of(request), invalid=None))


def admin_on_channel(request: Request, state: AuthState) -> bool:
    """An admin authorization matching the `topic` argument and, by one of its channel patterns, `channel`."""
    topic, channel = topic_channel_args(query_of(request))
    return state.allows_admin(topic, channel)


def admin_everywhere(request: Request, state: AuthState) -> bool:
    """An admin authorization over every topic (mqd.http.auth.EVERY_TOPIC): the daemon as a whole."""
    return state.allows_admin_everywhere()


class Guarded(Endpoint):
    """An endpoint answered only for a secret whose grants `rule` accepts (`--http-auth-required`).

    In order: 401 AUTH_REQUIRED without a bearer secret, 401 AUTH_FAILED
    for one the auth server refuses (or when it cannot be asked), 400 for
    a missing or malformed argument the rule reads, 403 UNAUTHORIZED
    without the grant; only then does the endpoint see the request, so a
    refused one changes nothing. The cache's answers are the ones peek
    and snapshot use (an endpoint that checks more itself asks again and
    finds the same answer). A cached answer is checked in the same turn,
    so the endpoint answers as it would unguarded.
    """

    def __init__(self, inner: Endpoint, cache: AuthCache, rule: Rule) -> None:
        super().__init__(inner.broker)
        self.inner = inner
        self.cache = cache
        self.rule = rule

    @cached_property
    def methods(self) -> tuple[str, ...]:
        return self.inner.methods

    def render(self, request: Request, params: Mapping[str, str]) -> Any:
        d = self.cache.authenticate(request)
        d.addCallback(self._check, request)
        if d.called:
            outcome: list[Any] = []
            d.addBoth(outcome.append)
            return self._answer(request, params, outcome[0])
        d.addBoth(self._answer_later, request, params)
        return NOT_DONE_YET

    def _check(self, state: AuthState, request: Request) -> AuthState:
        require_grant(self.rule(request, state))
        return state

    def _answer(self, request: Request, params: Mapping[str, str], outcome: Any) -> Any:
        """The endpoint's own answer once allowed, else the refusal's."""
        if isinstance(outcome, Failure):
            if outcome.check(ApiError):
                error = cast(ApiError, outcome.value)
                return respond_v1(request, error.code, error.message)
            log.failure("{method} {uri} failed", outcome, method=request.method, uri=request.uri)
            return respond_v1(request, 500, "INTERNAL_ERROR")
        return self.inner.render(request, params)

    def _answer_later(self, outcome: Any, request: Request, params: Mapping[str, str]) -> None:
        """As `_answer`, once the auth server answered: the body is written here unless the endpoint does it."""
        if client_gone(request):
            return
        body = self._answer(request, params, outcome)
        if body is NOT_DONE_YET or client_gone(request):
            return
        request.setHeader(b"Content-Length", b"%d" % len(body))
        request.write(body)
        request.finish()


# Health checks: answered without a secret under --http-auth-required too.
OPEN = frozenset({"/ping", "/info"})


def guard_routes(routes: Mapping[str, Endpoint], auth: AuthCache,
                 grants: Mapping[str, Rule]) -> dict[str, Endpoint]:
    """Every route but OPEN's behind its grant in `grants` (one it forgot: the broker-wide admin's)."""
    return {path: endpoint if path in OPEN else Guarded(endpoint, auth, grants.get(path, admin_everywhere))
            for path, endpoint in routes.items()}
