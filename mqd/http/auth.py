"""nsqd's client authorization: asking an auth server, and checking its answer.

With `--auth-http-address`, a client sends `AUTH <secret>` and nsqd asks an
HTTP auth server what that secret may do (`internal/auth/authorizations.go`).
The answer is cached on the connection for its `ttl` and fetched again
lazily on the next SUB/PUB after it expires. The query is made with
Twisted's Agent so that a slow or dead auth server never blocks the reactor
(every other client keeps being served while one waits for its answer).

Shared by the broker (TCP AUTH, its HTTP endpoints) and mqlookupd (its HTTP
endpoints under `--http-auth-required`), hence here rather than in mqd.nsqd.

The admin grant: mqd's HTTP endpoints that change or delete state ask for
one (`--http-auth-required`). nsqd refuses an answer whose `permissions`
hold anything but `subscribe` and `publish` (the whole AUTH fails), so an
auth server serving both nsqd and mqd cannot say "admin" there. It says
it with a key nsqd's JSON decoder ignores: an authorization with
`"admin": true` (and only the JSON value `true`) grants administering the
topics its `topic` pattern matches and, on channel endpoints, the channels
one of its `channels` patterns matches. An admin authorization whose
`topic` is one of EVERY_TOPIC administers the broker as a whole
(`/config`, `/snapshot`, `/stats` with client details). Its `permissions`
are read as always: admin does not imply publish or subscribe, nor they
admin.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any
from urllib.parse import urlencode

import re2
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorTime
from twisted.web.client import Agent, FileBodyProducer
from twisted.web.http_headers import Headers

from mqd.http_body import read_bounded
from mqd.logs import get_logger
from mqd.wire.errors import go_string

__all__ = ["EVERY_TOPIC", "AuthError", "AuthState", "AuthClient", "auth_urls", "compile_grant", "parse_auth_response"]

log = get_logger(__name__)

ACCEPT = b"application/vnd.nsq; version=1.0"
# The most of an auth server's answer that is read: its grants are a few
# hundred bytes a channel, and a server answering without end must not
# fill the broker's memory.
AUTH_ANSWER_MAX = 16 * 1024 * 1024

# RE2 is Go's regexp engine: linear-time matching (a grant like
# `^([a-z0-9]+[-_.]?)+$` cannot stall the reactor as backtracking `re` did on
# a near-miss name) and the syntax nsqd accepts. Parse errors are ours to
# report, not RE2's to print on stderr.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False

# re2's compiled regex (its class is private to the binding).
Regex = Any

# The `topic` patterns of an admin authorization that administer the broker
# as a whole: written out rather than judged by what a regex matches (which
# of all topic names a pattern matches is not a question to settle per request).
EVERY_TOPIC = frozenset({".*", "^.*$", ".+", "^.+$"})


class AuthError(Exception):
    """The auth server could not be asked or gave an unusable answer (logged, never sent to the client)."""


def auth_urls(addresses: list[str]) -> list[str]:
    """nsqd's endpoint rule: a value with `://` is a URL, else `http://<addr>/auth`."""
    return [a if "://" in a else f"http://{a}/auth" for a in addresses]


def compile_grant(pattern: str) -> Regex:
    """A grant's regex as Go's regexp.Compile would take it, or AuthError.

    RE2 (C++) accepts `\\C` (any byte), which Go's regexp refuses, so it is
    refused here too unless quoted by `\\Q...\\E`. A lone surrogate (a
    `\\ud800` escape in the answer's JSON) is U+FFFD, as Go's JSON decoder
    makes it.
    """
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            if nxt == "C":
                raise AuthError(f"unable to compile {pattern!r}: invalid escape sequence \\C")
            if nxt == "Q":
                end = pattern.find("\\E", i + 2)
                i = n if end < 0 else end + 2
                continue
            i += 2
            continue
        i += 1
    try:
        return re2.compile(go_string(pattern), _RE2_OPTIONS)
    except re2.error as e:
        raise AuthError(f"unable to compile {pattern!r}: {e}") from None


@dataclass
class _Grant:
    topic: Regex
    channels: list[Regex]
    permissions: frozenset[str]
    # `"admin": true` in the authorization (see the module doc), and its topic pattern as written.
    admin: bool = False
    pattern: str = ""

    def allows(self, topic: str, channel: str) -> bool:
        # nsqd decides the permission from the channel: "" is a publish.
        if ("subscribe" if channel else "publish") not in self.permissions:
            return False
        if self.topic.search(topic) is None:
            return False
        return any(c.search(channel) is not None for c in self.channels)

    def allows_topic(self, topic: str) -> bool:
        """Subscribing to some channel of `topic`: the permission, the topic, and a channel pattern."""
        return "subscribe" in self.permissions and bool(self.channels) and self.topic.search(topic) is not None

    def administers(self, topic: str, channel: str | None) -> bool:
        """Admin on `topic` (and, unless None, on `channel`): the flag, the topic, a channel pattern."""
        if not self.admin or self.topic.search(topic) is None:
            return False
        return channel is None or any(c.search(channel) is not None for c in self.channels)


@dataclass
class AuthState:
    """One auth server answer: who the client is, what it may do, until when."""

    identity: str
    identity_url: str
    grants: list[_Grant]
    expires: float
    # (topic, channel) -> allowed, so a publisher's every PUB costs one dict lookup.
    _cache: dict[tuple[str, str], bool] = field(default_factory=dict)

    @property
    def permission_count(self) -> int:
        return len(self.grants)

    def allows(self, topic: str, channel: str) -> bool:
        key = (topic, channel)
        hit = self._cache.get(key)
        if hit is None:
            topic, channel = go_string(topic), go_string(channel)  # see allows_topic
            hit = any(g.allows(topic, channel) for g in self.grants)
            if len(self._cache) < 1024:
                self._cache[key] = hit
        return hit

    def allows_topic(self, topic: str) -> bool:
        """Whether some grant lets the client subscribe to a channel of `topic` (any channel).

        What a look at the topic's own queue needs (`GET /topic/peek`, a
        snapshot of a topic without channels): whoever may subscribe to any
        channel of a topic receives every message the topic holds.

        A name from a request's undecodable bytes holds lone surrogates, which
        re2 cannot take: it is matched as Go's regexp reads those bytes, each
        one U+FFFD (go_string), so `.*` still matches it and `^t$` does not.
        """
        topic = go_string(topic)
        return any(g.allows_topic(topic) for g in self.grants)

    def allows_admin(self, topic: str, channel: str | None = None) -> bool:
        """Whether an admin authorization covers `topic` (and `channel`, for a channel endpoint); see allows_topic."""
        topic, channel = go_string(topic), None if channel is None else go_string(channel)
        return any(g.administers(topic, channel) for g in self.grants)

    def allows_admin_everywhere(self) -> bool:
        """Whether an admin authorization's topic pattern is one of EVERY_TOPIC (the broker as a whole)."""
        return any(g.admin and g.pattern in EVERY_TOPIC for g in self.grants)


def parse_auth_response(body: bytes, now: float) -> AuthState:
    """An AuthState from the server's JSON, refusing what nsqd refuses.

    A ttl ≤ 0, an unknown permission or a regex that Go's regexp does not
    compile makes the whole answer a failure, as in nsqd (compile_grant).
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise AuthError(f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise AuthError("response is not a JSON object")
    ttl = data.get("ttl")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
        raise AuthError(f"invalid TTL {ttl!r}")
    identity = data.get("identity") or ""
    identity_url = data.get("identity_url") or ""
    if not isinstance(identity, str) or not isinstance(identity_url, str):
        raise AuthError("identity and identity_url must be strings")
    identity, identity_url = go_string(identity), go_string(identity_url)
    raw = data.get("authorizations") or []
    if not isinstance(raw, list):
        raise AuthError("authorizations must be a list")
    grants: list[_Grant] = []
    for entry in raw:
        if not isinstance(entry, dict):
            raise AuthError("authorization is not an object")
        perms = entry.get("permissions") or []
        channels = entry.get("channels") or []
        topic = entry.get("topic", "")
        if not isinstance(perms, list) or not isinstance(channels, list) or not isinstance(topic, str):
            raise AuthError("malformed authorization")
        for p in perms:
            if p not in ("subscribe", "publish"):
                raise AuthError(f"unknown permission {p}")
        if not all(isinstance(c, str) for c in channels):
            raise AuthError("channel regexes must be strings")
        topic_re = compile_grant(topic)
        channel_res = [compile_grant(c) for c in channels]
        # Only JSON `true` is admin: nsqd ignores the key whatever its value, so
        # no value of it may fail an answer nsqd accepts.
        admin = entry.get("admin") is True
        grants.append(_Grant(topic_re, channel_res, frozenset(perms), admin, topic))
    return AuthState(identity, identity_url, grants, now + ttl)


# fetch(url, method, params) -> Deferred firing with the response body;
# tests pass their own instead of running an HTTP server.
Fetch = Callable[[str, str, dict[str, str]], "Deferred[bytes]"]


class AuthClient:
    """Asks the configured auth servers, one after another from a random start, as nsqd does."""

    def __init__(self, options: Any, clock: IReactorTime, fetch: Fetch | None = None) -> None:
        self.urls = auth_urls(options.auth_http_address)
        self.method = options.auth_http_request_method
        self.clock = clock
        self.connect_timeout = options.http_client_connect_timeout
        self.request_timeout = options.http_client_request_timeout
        self.fetch_function = fetch
        self._agent: Agent | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.urls)

    @inlineCallbacks
    def query(self, remote_ip: str, tls: bool, secret: str,
              common_name: str) -> Generator[Deferred[Any], Any, AuthState]:
        """Deferred firing with an AuthState, or failing with AuthError."""
        params = {"remote_ip": remote_ip, "tls": "true" if tls else "false",
                  "secret": secret, "common_name": common_name}
        urls = self.urls
        start = random.randrange(len(urls))
        errors: list[str] = []
        for i in range(len(urls)):
            url = urls[(start + i) % len(urls)]
            try:
                body = yield self.fetch(url, self.method, params)
                state = parse_auth_response(body, self.clock.seconds())
            except Exception as e:  # any failure: try the next server
                log.warn("auth server {url} failed: {error}", url=url, error=str(e) or type(e).__name__)
                errors.append(f"{url}: {e}")
                continue
            return state
        raise AuthError("; ".join(errors))

    def fetch(self, url: str, method: str, params: dict[str, str],
              headers: Mapping[bytes, list[bytes]] | None = None) -> Deferred[bytes]:
        """The body of a 200 answer to `url`, asked with `params` (AuthError otherwise).

        `headers` go with the request's Accept (the bearer secret of a
        broker's lookupd /channels query); a test's fetch function, standing
        in for the auth server, is asked without them.
        """
        if self.fetch_function is not None:
            return self.fetch_function(url, method, params)
        return self._http(url, method, params, headers or {})

    @inlineCallbacks
    def _http(self, url: str, method: str, params: dict[str, str],
              extra: Mapping[bytes, list[bytes]]) -> Generator[Deferred[Any], Any, bytes]:
        from twisted.internet import reactor

        if self._agent is None:
            self._agent = Agent(reactor, connectTimeout=self.connect_timeout)
        headers = Headers({b"Accept": [ACCEPT]})
        for name, values in extra.items():
            headers.setRawHeaders(name, values)
        producer = None
        if method == "post":
            # Go marshals url.Values: every value is a list of strings.
            payload = json.dumps({k: [v] for k, v in params.items()}).encode()
            headers.addRawHeader(b"Content-Type", b"application/json")
            producer = FileBodyProducer(BytesIO(payload))
            d = self._agent.request(b"POST", url.encode(), headers, producer)
        else:
            sep = "&" if "?" in url else "?"
            full = url + sep + urlencode(sorted(params.items()))
            d = self._agent.request(b"GET", full.encode(), headers)
        d.addTimeout(self.request_timeout, reactor)
        response = yield d
        body_d = read_bounded(response, AUTH_ANSWER_MAX, AuthError)
        body_d.addTimeout(self.request_timeout, reactor)
        body: bytes = yield body_d
        if response.code != 200:
            raise AuthError(f"got response {response.code} {body[:200]!r}")
        return body
