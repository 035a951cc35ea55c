"""HTTP from mqadmin to the lookupds and brokers it watches (treq over one connection pool).

Everything mqadmin knows comes from these requests, so each has to end: a
broker that accepts the connection and never answers must not hold a page
(or the stats poller) forever. `--http-client-connect-timeout` bounds the
TCP connect and `--http-client-request-timeout` the whole exchange, body
included, as nsqadmin's http_api client does. Any failure (refused, timed
out, an answer other than 2xx, a body that is not JSON) is one
`UpstreamError` naming the URL, so callers can report which broker failed
and carry on with the others.

Addresses are given as nsqadmin takes them (`host:port`, plain HTTP) or as
full URLs (`https://host:port`). Like nsq's own client, a `403` carrying
`https_port` (a broker run with `--tls-required`) is retried once over
HTTPS on that port; the `--http-client-tls-*` options set how HTTPS peers
are verified and which client certificate is shown.

Brokers and lookupds run with `--http-auth-required` want the caller's
secret as `Authorization: Bearer` (mqd.clusterinfo.bearer). `Upstream`
itself sends none, since it also posts mqadmin's notifications to a third
party; `Authorized` is the view of it that adds mqadmin's own secret (or a
user's, passed on) to every request to a broker or lookupd. A refusal
(401/403) is worded naming the node, so a page says which broker wants
what: `nsqd 10.0.0.1:4151: got response 401 Unauthorized "..."`.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from treq.client import HTTPClient
from twisted.internet import defer
from twisted.internet.error import ConnectError, ConnectionRefusedError, DNSLookupError
from twisted.internet.error import TimeoutError as ConnectTimeoutError
from twisted.internet.ssl import (
    Certificate,
    CertificateOptions,
    PrivateCertificate,
    optionsForClientTLS,
    trustRootFromCertificates,
)
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from mqd.clusterinfo.bearer import REFUSALS, HTTPRefusedError, node_of
from mqd.endpoints import join_host_port
from mqd.http_body import read_bounded
from mqd.logs import get_logger
from mqd.options import ConfigError
from mqd.wire.errors import go_quote, go_refused
from mqd.wire.go_json import GoJSONError, unmarshal

__all__ = ["Authorized", "ClientTLS", "ErrorLine", "Upstream", "UpstreamError", "base_url", "error_text", "go_line",
           "go_quote", "reason_of"]

log = get_logger(__name__)

# What nsq's http_api client sends, so a broker answers V1 (plain JSON).
ACCEPT = b"application/vnd.nsq; version=1.0"
USER_AGENT = b"mqadmin"
# Error bodies quoted in an UpstreamError are cut to this many bytes.
_QUOTE = 200

# Request headers by name: {b"Authorization": [b"Bearer ..."]}.
Headers = Mapping[bytes, list[bytes]]


def _status_line(code: int) -> str:
    """`404 Not Found`: a status as Go's http client reports it (Go's own servers' phrases)."""
    try:
        return f"{code} {HTTPStatus(code).phrase}"
    except ValueError:
        return f"{code} status code {code}"


# The most of any broker's or lookupd's answer that is read (a /stats of
# tens of thousands of clients is a few tens of MiB): one answering without
# end costs this much memory, not all of it.
UPSTREAM_ANSWER_MAX = 64 * 1024 * 1024

# Go's http.Client past its Timeout with no answer from a server that took
# the connection (one stopped, or overloaded), as nsqadmin quotes it.
_GO_HEADER_TIMEOUT = "net/http: timeout awaiting response headers (Client.Timeout exceeded while awaiting headers)"


class UpstreamError(Exception):
    """A request to a lookupd or broker that did not give a usable answer.

    `code` is the HTTP status when one came back (None for a connection
    failure or timeout), `body` its body, `method` the request's (`GET`,
    `POST`). str() is mqd's line (`URL: reason`); `go_text` is the line
    nsq's Go clients write for the same failure, which nsqadmin's and
    nsq_stat's messages quote.
    """

    def __init__(self, url: str, reason: str, code: int | None = None, body: bytes = b"",
                 method: str = "GET", json_error: str | None = None) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.code = code
        self.body = body
        self.method = method
        self.json_error = json_error

    @property
    def go_text(self) -> str:
        """nsq's http_api wording: `got response 404 Not Found "{...}"`, Go's `Get "URL": ...` error,
        or, for an answer that is not JSON, Go's json error alone (`unexpected end of JSON input`)."""
        if self.json_error is not None:
            return self.json_error
        if self.code is not None and self.code != 200:
            return f"got response {_status_line(self.code)} {go_quote(self.body)}"
        reason = self.reason
        if reason in ("connection refused", "connect timed out"):
            parts = urlsplit(self.url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            address = join_host_port(parts.hostname or "", port)
            reason = go_refused(address) if reason == "connection refused" else f"dial tcp {address}: i/o timeout"
        elif reason == "request timed out":
            reason = _GO_HEADER_TIMEOUT
        return f'{self.method.capitalize()} "{self.url}": {reason}'

    @property
    def refused(self) -> bool:
        """Whether the answer refused the secret (401: none or a wrong one; 403: without the grant)."""
        return self.code in REFUSALS

    def refusal(self, kind: str) -> HTTPRefusedError | None:
        """The refusal (`nsqd 10.0.0.1:4151 answered 401 Unauthorized (AUTH_REQUIRED)`) of a 401/403, else None."""
        if self.code is None or not self.refused:
            return None
        return HTTPRefusedError(kind, self.url, self.code, self.body)


def go_line(error: UpstreamError, kind: str) -> str:
    """The error's line as nsqadmin's pages quote it; a refusal names the node (`nsqd HOST:PORT: got response 401 ...`).

    nsq's Go client names no node in `got response ...`; a broker down is
    found by its URL in Go's connection error, a refused secret only so.
    """
    text = error.go_text
    return f"{kind} {node_of(error.url)}: {text}" if error.refused else text


class ErrorLine(str):
    """One failure as the cluster queries report it: mqd's line, with nsq's wording and source kind.

    The string is mqd's (`URL: reason`, what mq-stat prints); `go` is the
    Go client's line nsqadmin quotes, `kind` what was asked (`nsqlookupd`
    or `nsqd`, for nsqadmin's `failed to query any <kind>: ...`) and `code`
    the HTTP status of the answer, if one came; `refusal` the secret's
    refusal (a 401 or 403: mqd.clusterinfo.bearer.HTTPRefusedError), else None.
    """

    go: str
    kind: str
    code: int | None
    refusal: HTTPRefusedError | None

    def __new__(cls, text: str, go: str | None = None, kind: str = "", code: int | None = None,
                refusal: HTTPRefusedError | None = None) -> ErrorLine:
        line = super().__new__(cls, text)
        line.go = text if go is None else go
        line.kind = kind
        line.code = code
        line.refusal = refusal
        return line


def base_url(address: str) -> str:
    """`host:port` → `http://host:port`; a full URL is kept (without a trailing slash)."""
    address = address.strip()
    if "://" not in address:
        address = "http://" + address
    return address.rstrip("/")


def _read_pems(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None


def _pem_blocks(data: bytes) -> list[bytes]:
    end = b"-----END CERTIFICATE-----"
    return [part + end for part in data.split(end) if b"-----BEGIN CERTIFICATE-----" in part]


@implementer(IPolicyForHTTPS)
class ClientTLS:
    """How mqadmin checks HTTPS brokers: nsqadmin's `--http-client-tls-*` options.

    Verification is on by default (the platform's trust store, or only the
    CAs of `root_ca_file`), with the host name checked as a browser would;
    `insecure_skip_verify` turns both off, for self-signed test clusters.
    Files are read once here so a bad path stops mqadmin at start-up.
    """

    def __init__(self, insecure_skip_verify: bool = False, root_ca_file: str = "",
                 cert_file: str = "", key_file: str = "") -> None:
        self.insecure = bool(insecure_skip_verify)
        self._trust = None
        if root_ca_file:
            blocks = _pem_blocks(_read_pems(root_ca_file, "--http-client-tls-root-ca-file"))
            if not blocks:
                raise ConfigError(f"--http-client-tls-root-ca-file {root_ca_file}: no certificate in it")
            try:
                self._trust = trustRootFromCertificates([Certificate.loadPEM(b) for b in blocks])
            except Exception as e:
                raise ConfigError(f"--http-client-tls-root-ca-file {root_ca_file}: {e}") from None
        self._client_cert = None
        if cert_file or key_file:
            if not (cert_file and key_file):
                raise ConfigError("--http-client-tls-cert and --http-client-tls-key must be given together")
            pem = _read_pems(cert_file, "--http-client-tls-cert") + b"\n" + _read_pems(
                key_file, "--http-client-tls-key")
            try:
                self._client_cert = PrivateCertificate.loadPEM(pem)
            except Exception as e:
                raise ConfigError(f"--http-client-tls-cert/--http-client-tls-key: {e}") from None

    @classmethod
    def from_settings(cls, settings: Any) -> ClientTLS:
        return cls(
            getattr(settings, "http_client_tls_insecure_skip_verify", False),
            getattr(settings, "http_client_tls_root_ca_file", "") or "",
            getattr(settings, "http_client_tls_cert", "") or "",
            getattr(settings, "http_client_tls_key", "") or "",
        )

    def creatorForNetloc(self, hostname: bytes, port: int):
        if self.insecure:
            kwargs = {}
            if self._client_cert is not None:
                kwargs = {"privateKey": self._client_cert.privateKey.original,
                          "certificate": self._client_cert.original}
            return CertificateOptions(verify=False, **kwargs)
        return optionsForClientTLS(hostname.decode("idna"), trustRoot=self._trust,
                                   clientCertificate=self._client_cert)


def _reason(failure) -> str:
    """A failure in one short phrase for an error line (the URL is added by UpstreamError)."""
    if failure.check(defer.TimeoutError, defer.CancelledError):
        return "request timed out"
    if failure.check(ConnectTimeoutError):
        return "connect timed out"
    if failure.check(ConnectionRefusedError):
        return "connection refused"
    if failure.check(DNSLookupError):
        return "host not found"
    if failure.check(ConnectError):
        return f"cannot connect: {failure.value}"
    if failure.check(ResponseFailed):
        reasons = getattr(failure.value, "reasons", None) or []
        inner = "; ".join(r.getErrorMessage() for r in reasons) or "connection lost"
        return f"response failed: {inner}"
    return failure.getErrorMessage() or failure.type.__name__


def _timed_out(url: str, method: bytes = b"GET"):
    """addTimeout's onTimeoutCancel: whatever the cancelled request failed with, it timed out."""

    def convert(result, timeout):
        return Failure(UpstreamError(url, "request timed out", method=method.decode()))

    return convert


def _https_retry_url(url: str, body: bytes) -> str | None:
    """The HTTPS URL to retry a plain-HTTP `403` on, when the broker said which port (nsqd --tls-required)."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        return None
    try:
        port = unmarshal(body).get("https_port")
    except (GoJSONError, AttributeError):
        return None
    if not isinstance(port, int) or isinstance(port, bool):
        return None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return urlunsplit(("https", f"{host}:{port}", parts.path, parts.query, ""))


class Upstream:
    """One HTTP client for all of mqadmin's requests; see the module docstring.

    GET connections are kept (a persistent pool): mqadmin polls the same
    few brokers every few seconds. `close()` drops them at shutdown.
    """

    def __init__(self, reactor: Any, settings: Any, tls: ClientTLS | None = None) -> None:
        self.reactor = reactor
        self.connect_timeout = float(getattr(settings, "http_client_connect_timeout", 2.0))
        self.request_timeout = float(getattr(settings, "http_client_request_timeout", 5.0))
        self.tls = tls if tls is not None else ClientTLS.from_settings(settings)
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = 4
        self.pool.cachedConnectionTimeout = 60
        agent = Agent(reactor, contextFactory=self.tls, connectTimeout=self.connect_timeout, pool=self.pool)
        self.client = HTTPClient(agent)
        # Twisted retries an idempotent request whose kept connection the peer had closed (a
        # restarted broker), never a POST: actions get a fresh connection each, so none fails so.
        fresh = Agent(reactor, contextFactory=self.tls, connectTimeout=self.connect_timeout,
                      pool=HTTPConnectionPool(reactor, persistent=False))
        self.post_client = HTTPClient(fresh)

    def close(self) -> defer.Deferred:
        return self.pool.closeCachedConnections()

    # -- the three calls --------------------------------------------------------------

    def get(self, url: str, headers: Headers | None = None) -> defer.Deferred:
        """`(status, body)` of a GET, whatever the status (for /ping, /config/:opt)."""
        return self._request(b"GET", url, b"", headers=headers)

    @defer.inlineCallbacks
    def get_json(self, url: str, headers: Headers | None = None, max_bytes: int | None = None):
        """The JSON document of a 200 answer, read as Go's json.Unmarshal reads it; else an UpstreamError.

        `headers` are sent besides mqadmin's own (a browser's Authorization,
        passed on); an answer of more than `max_bytes` (UPSTREAM_ANSWER_MAX
        unless given) is not read further. An answer that is not JSON fails
        with Go's error for it (`json_error`), which nsqadmin quotes.
        """
        code, body = yield self._request(b"GET", url, b"", headers=headers, max_bytes=max_bytes)
        if code != 200:
            raise UpstreamError(url, f"got response {code} {body[:_QUOTE]!r}", code, body)
        try:
            return unmarshal(body)
        except GoJSONError as e:
            raise UpstreamError(url, f"invalid JSON in response ({e}): {body[:_QUOTE]!r}", code, body,
                                json_error=str(e)) from None

    @defer.inlineCallbacks
    def post(self, url: str, body: bytes = b"", content_type: bytes = b"application/json",
             timeout: float | None = None, headers: Headers | None = None):
        """`(status, body)` of a 2xx answer to a POST (nsqd's and lookupd's actions); else UpstreamError.

        A body (mqadmin only sends JSON: notifications) goes with `content_type`.
        `timeout` replaces --http-client-request-timeout for a request known
        to take long (a broker's snapshot copies its whole store); `headers`
        are sent besides mqadmin's own.
        """
        code, answer = yield self._request(b"POST", url, body, content_type if body else None, timeout,
                                           headers)
        if not 200 <= code < 300:
            raise UpstreamError(url, f"got response {code} {answer[:_QUOTE]!r}", code, answer, "POST")
        return code, answer

    # -- machinery ----------------------------------------------------------------------

    def _request(self, method: bytes, url: str, body: bytes, content_type: bytes | None = None,
                 timeout: float | None = None, headers: Headers | None = None,
                 max_bytes: int | None = None) -> defer.Deferred:
        sent = {b"Accept": [ACCEPT], b"User-Agent": [USER_AGENT]}
        if content_type:
            sent[b"Content-Type"] = [content_type]
        sent.update(headers or {})
        d = self._exchange(method, url, body, sent, max_bytes)
        # The whole exchange (connect, headers, body, an HTTPS retry) within the request timeout.
        d.addTimeout(self.request_timeout if timeout is None else timeout, self.reactor,
                     onTimeoutCancel=_timed_out(url, method))
        d.addErrback(self._as_upstream_error, url, method)
        return d

    @defer.inlineCallbacks
    def _exchange(self, method: bytes, url: str, body: bytes, headers: Headers, max_bytes: int | None):
        code, answer = yield self._once(method, url, body, headers, max_bytes)
        if code == 403:
            retry = _https_retry_url(url, answer)
            if retry is not None:
                log.debug("{url} wants TLS: retrying on {retry}", url=url, retry=retry)
                code, answer = yield self._once(method, retry, body, headers, max_bytes)
        return code, answer

    @defer.inlineCallbacks
    def _once(self, method: bytes, url: str, body: bytes, headers: Headers, max_bytes: int | None):
        client = self.post_client if method == b"POST" else self.client
        # treq types headers as dicts keyed by `bytes | str` (invariant): no Mapping[bytes, ...].
        response = yield client.request(method.decode(), url,
                                        headers=headers,  # type: ignore[arg-type]
                                        data=body if method == b"POST" else None, allow_redirects=False)
        limit = UPSTREAM_ANSWER_MAX if max_bytes is None else max_bytes
        answer = yield read_bounded(response, limit, lambda why: UpstreamError(url, why))
        return response.code, answer

    @staticmethod
    def _as_upstream_error(failure, url: str, method: bytes = b"GET"):
        if failure.check(UpstreamError):
            return failure
        raise UpstreamError(url, _reason(failure), method=method.decode())


class Authorized:
    """`Upstream`'s calls with an `Authorization` header added: the secret brokers and lookupds ask for.

    `headers` (mqd.clusterinfo.bearer.bearer_headers) go with every
    request, unless the call gives an `Authorization` of its own. mqadmin
    makes one over its Upstream with `--http-client-auth-secret` for its
    cluster queries and actions, and one per page request that carries a
    user's `Authorization: Bearer` (passed on instead of mqadmin's).
    """

    def __init__(self, upstream: Any, headers: Headers) -> None:
        self.upstream = upstream
        self.headers = dict(headers)

    def _with(self, headers: Headers | None) -> dict[bytes, list[bytes]]:
        sent = dict(self.headers)
        sent.update(headers or {})
        return sent

    def get(self, url: str, headers: Headers | None = None) -> defer.Deferred:
        return self.upstream.get(url, headers=self._with(headers))

    def get_json(self, url: str, headers: Headers | None = None, max_bytes: int | None = None) -> defer.Deferred:
        return self.upstream.get_json(url, headers=self._with(headers), max_bytes=max_bytes)

    def post(self, url: str, body: bytes = b"", *args: Any, headers: Headers | None = None,
             **kwargs: Any) -> defer.Deferred:
        return self.upstream.post(url, body, *args, headers=self._with(headers), **kwargs)

    def close(self) -> defer.Deferred:
        return self.upstream.close()


def reason_of(error: BaseException) -> str:
    """What went wrong with one upstream request, in a line: `404 TOPIC_NOT_FOUND`, `connection refused`."""
    code = getattr(error, "code", None)
    if code is not None:
        return error_text(code, getattr(error, "body", b"") or b"")
    reason = getattr(error, "reason", None)
    return str(reason if reason is not None else error) or type(error).__name__


def error_text(status: int, body: bytes) -> str:
    """`404 TOPIC_NOT_FOUND`: the status and the V1 error text of a broker's or lookupd's answer."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = unmarshal(body)
    except GoJSONError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        text = data["message"]
    return f"{status} {text[:200]}".rstrip()
