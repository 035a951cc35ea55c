"""The HTTP auth secret of brokers' and lookupds' callers: `Authorization: Bearer <secret>`.

A broker or lookupd run with `--http-auth-required` answers every HTTP
endpoint but /ping and /info only to a request carrying the secret a TCP
client would send with AUTH, as `Authorization: Bearer <secret>`, and
asks the NSQ auth server about it as AUTH does. Its refusals are
`401 {"message":"AUTH_REQUIRED"}` (no secret), `401 {"message":"AUTH_FAILED"}`
(a secret the auth server refused) and `403 {"message":"UNAUTHORIZED"}`
(a secret without the grant). mqadmin, mq-stat, mq-tail, mq-to-file and
the Spark source and sink send their secret with what is here, and word
a refusal the same way: `nsqd 10.0.0.1:4151 answered 401 Unauthorized
(AUTH_REQUIRED)`.

The secret goes in a header, so it must be what a header can carry and
the broker reads back: printable ASCII without spaces (the broker's rule).
`check_secret` says so once, at start-up, rather than the broker
refusing every request later. A secret is never logged nor shown: error
lines name the node and the answer, never what was sent.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from twisted.internet import defer

from mqd.endpoints import join_host_port
from mqd.wire.go_json import error_message

__all__ = ["REFUSALS", "SECRET_ENV", "BearerHTTP", "HTTPRefusedError", "bearer_headers", "check_secret", "env_secret",
           "node_of", "read_secret_file", "refusal_hint", "refusal_text"]

# Read by the tools and the snapshot command when no secret flag is given: a
# flag shows in `ps` and in the shell's history.
SECRET_ENV = "MQ_HTTP_AUTH_SECRET"

# The statuses of a refused secret: none given or refused (401), or without the grant (403).
REFUSALS = (401, 403)


def check_secret(secret: str, what: str) -> str:
    """`secret` if a header can carry it as the broker reads it back; else ValueError naming `what` (never the secret)."""
    if not all(0x21 <= ord(c) <= 0x7E for c in secret):
        raise ValueError(f"{what}: an HTTP auth secret must be printable ASCII without spaces")
    return secret


def bearer_headers(secret: str) -> dict[bytes, list[bytes]]:
    """`{b"Authorization": [b"Bearer <secret>"]}` for a checked secret; `{}` for none."""
    if not secret:
        return {}
    return {b"Authorization": [b"Bearer " + check_secret(secret, "secret").encode("ascii")]}


def read_secret_file(path: str, what: str) -> str:
    """The secret a file holds (a mounted secret), without its trailing newline; ValueError if unreadable.

    Only the ends are stripped: a file of one line written by `echo` or an
    editor holds the secret and a newline.
    """
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: an HTTP auth secret must be printable ASCII") from None
    secret = text.strip()
    if not secret:
        raise ValueError(f"{what} {path}: the file is empty")
    return check_secret(secret, f"{what} {path}")


def env_secret(name: str) -> str:
    """The secret in environment variable `name` ("" when unset), for tools run where a flag would show in `ps`."""
    return os.environ.get(name, "").strip()


def node_of(url: str) -> str:
    """`host:port` of a URL, as NSQ names a node (the scheme's default port when none is given)."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return join_host_port(parts.hostname or "", port)


def refusal_text(kind: str, url: str, code: int, body: bytes = b"") -> str:
    """`nsqd 10.0.0.1:4151 answered 401 Unauthorized (AUTH_REQUIRED)`: one refused request, in a line."""
    message = error_message(body, 100)
    return f"{kind} {node_of(url)} answered {code} {HTTPStatus(code).phrase}" + (f" ({message})" if message else "")


def refusal_hint(code: int, body: bytes, flag: str) -> str:
    """What to do about a refusal, for a tool's error line: give `flag`, check the secret, or its grants."""
    message = error_message(body, 100)
    if code == 403:
        return "the secret has no grant for this request"
    if message == "AUTH_FAILED":
        return "the auth server refused the secret"
    return f"it requires a secret ({flag})"


class HTTPRefusedError(Exception):
    """A lookupd or broker refused the secret (401/403); str() is `refusal_text`'s line."""

    def __init__(self, kind: str, url: str, code: int, body: bytes = b"") -> None:
        super().__init__(refusal_text(kind, url, code, body))
        self.kind = kind
        self.url = url
        self.code = code
        self.body = body


class BearerHTTP:
    """A treq-like client (`get(url, headers=)`) that sends the secret, and reports a refusal.

    For the client library's lookupd polling (`Consumer(lookupd_http=)`),
    which knows no secret: every request gets `Authorization: Bearer`
    when a secret is given, and an answer of 401 or 403 calls
    `on_refused(HTTPRefusedError)` and fails the query with that error (a
    wrong secret will not get better by asking again; the caller decides
    whether that ends it). `http` is the client asked (by default treq
    over a fresh connection per request, as the poller's own, created on
    first use on `reactor`).
    """

    def __init__(self, secret: str = "", on_refused: Callable[[HTTPRefusedError], Any] | None = None,
                 http: Any = None, reactor: Any = None, kind: str = "nsqlookupd") -> None:
        self.headers = bearer_headers(secret)
        self.on_refused = on_refused
        self.kind = kind
        self._http = http
        self._reactor = reactor

    @property
    def http(self) -> Any:
        if self._http is None:
            from treq.client import HTTPClient
            from twisted.web.client import Agent, HTTPConnectionPool

            reactor = self._reactor
            if reactor is None:
                from twisted.internet import reactor
            self._http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        return self._http

    @defer.inlineCallbacks
    def get(self, url: str, headers: Mapping[bytes, list[bytes]] | None = None,
            **kwargs: Any) -> Generator[defer.Deferred[Any], Any, Any]:
        """The answer to a GET of `url` with the secret (treq's response), or HTTPRefusedError for a 401/403."""
        sent = {**(headers or {}), **self.headers}
        response = yield self.http.get(url, headers=sent, **kwargs)
        if response.code in REFUSALS:
            from mqd.http_body import read_bounded

            try:
                body = yield read_bounded(response, 4096, ValueError)
            except Exception:  # noqa: BLE001 - the status says it all; the body only adds its message
                body = b""
            error = HTTPRefusedError(self.kind, url, response.code, body)
            if self.on_refused is not None:
                self.on_refused(error)
            raise error
        return response
