"""Finding a topic's producers by polling nsqlookupd, as go-nsq's Consumer does (`queryLookupd`).

A consumer given lookupd addresses must follow the cluster: connect to a
broker that starts producing the topic, drop one that lookupd stops
listing. `LookupdPoller` asks one lookupd per poll (round robin, so one
slow or dead lookupd costs one poll, not all of them), trying the next
one up to three times when a query fails, as go-nsq does. A failed poll
changes nothing: the consumer keeps its connections rather than tearing
them down because a lookupd was briefly unreachable.

The first query goes out at once (a consumer should not wait a minute
for its first producers); the periodic loop then starts after a random
fraction (`jitter`) of the interval, so consumers restarted together do
not all hit lookupd, and then the brokers, in the same instant.

Both answer shapes are read: nsqlookupd ≥ 1.0's flat
`{"channels": [...], "producers": [...]}` (what the `Accept:
application/vnd.nsq; version=1.0` header asks for) and the old
`{"status_code": 200, "status_txt": "OK", "data": {...}}` envelope.
A `404` (lookupd has never heard of the topic, or every producer left)
means no producer, not an error.

A lookupd that answers garbage is a failed query like an unreachable one
(one logged line, the next lookupd tried): a body over
`MAX_RESPONSE_SIZE` is cut off as it arrives (go-nsq reads it all), JSON
nested too deep for Python's decoder or of the wrong shape is a
`LookupdError`, and the whole query is bounded by `timeout`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from treq.client import HTTPClient
from twisted.internet import defer, task
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool

from mqd.client.errors import ClientConfigError
from mqd.endpoints import join_host_port
from mqd.http_body import read_bounded
from mqd.logs import get_logger

__all__ = ["LookupdPoller", "lookup_answer", "lookup_url", "producer_addresses", "ACCEPT"]

log = get_logger("mqd.client")

# What nsq's clients send so that lookupd answers the flat (V1) document.
ACCEPT = b"application/vnd.nsq; version=1.0"
# go-nsq tries this many lookupds (the next one each time) before giving a poll up.
QUERY_ATTEMPTS = 3
# A /lookup answer is a few hundred bytes per producer: 16 MiB is tens of thousands of them.
MAX_RESPONSE_SIZE = 16 * 1024 * 1024


class LookupdError(Exception):
    """A lookupd answered something other than a usable `/lookup` document."""


def lookup_url(address: str, topic: str) -> str:
    """The `/lookup` URL for a lookupd address, as go-nsq's buildLookupAddr makes it.

    `host:port` gets `http://`; a URL keeps its scheme and its path (an
    empty or `/` path becomes `/lookup`, so a lookupd behind a proxy path
    works); `topic=` is added to whatever query it had.
    """
    text = address.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ClientConfigError(f"lookupd address {address!r}: missing port")
    path = parts.path if parts.path not in ("", "/") else "/lookup"
    query = urlencode([*parse_qsl(parts.query, keep_blank_values=True), ("topic", topic)])
    return urlunsplit((parts.scheme, parts.netloc, path, query, ""))


def lookup_answer(body: bytes) -> set[str]:
    """`producer_addresses` of a lookupd's answer as it came (an empty one lists nobody); LookupdError if not JSON."""
    try:
        document = json.loads(body or b"{}")
    except RecursionError:
        raise LookupdError("invalid JSON: nested too deep") from None
    except ValueError:
        raise LookupdError(f"invalid JSON {body[:200]!r}") from None
    return producer_addresses(document)


def producer_addresses(document: Any) -> set[str]:
    """The `broadcast_address:tcp_port` of every producer in a `/lookup` answer (either shape).

    Raises LookupdError for a document that is not a lookup answer at all;
    a producer row without an address or port is skipped (logged): there
    is nothing to connect to.
    """
    if isinstance(document, dict) and "data" in document and "status_code" in document:
        document = document["data"]
    if not isinstance(document, dict):
        raise LookupdError(f"not a lookup answer: {document!r:.200}")
    producers = document.get("producers") or []
    if not isinstance(producers, list):
        raise LookupdError(f"producers is not a list: {producers!r:.200}")
    found: set[str] = set()
    for row in producers:
        host = row.get("broadcast_address") if isinstance(row, dict) else None
        port = row.get("tcp_port") if isinstance(row, dict) else None
        if (not host or not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool)
                or not 0 < port < 65536):
            log.warn("lookupd listed a producer without an address: {row!r}", row=row)
            continue
        found.add(join_host_port(host, port))
    return found


def _describe(error: BaseException) -> str:
    """One line for a failed query: twisted.web's wrapper exceptions say why in `.reasons`."""
    reasons = getattr(error, "reasons", None)
    if reasons:
        return "; ".join(str(r.value) or type(r.value).__name__ for r in reasons)
    return str(error) or type(error).__name__


class LookupdPoller:
    """Polls lookupd `/lookup?topic=` and reports the producers' TCP addresses; see the module docstring.

    `on_change(addresses)` is called with the whole set after every
    successful poll (also when it did not change: the consumer compares it
    with its connections, which may have changed meanwhile). `addresses`
    holds the last set (None before the first successful poll).
    `interval` and `timeout` are seconds; `jitter` is a fraction in [0, 1].
    `http` is treq or a treq-like client (`get(url, headers=)` answering a
    treq response), e.g. `treq.testing.StubTreq`; by default a treq
    HTTPClient on `clock`, which must then be a reactor.
    """

    def __init__(
        self,
        topic: str,
        addresses: Sequence[str],
        interval: float,
        jitter: float,
        on_change: Callable[[set[str]], Any],
        clock: Any = None,
        http: Any = None,
        *,
        timeout: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        if not addresses:
            raise ClientConfigError("no lookupd address to poll")
        if interval <= 0:
            raise ClientConfigError(f"lookupd poll interval must be positive, got {interval}")
        self.topic = topic
        # Duplicates removed, order kept: the round robin order is the caller's.
        self.urls = list(dict.fromkeys(lookup_url(a, topic) for a in addresses))
        self.interval = float(interval)
        self.jitter = float(jitter)
        self.timeout = float(timeout)
        self.on_change = on_change
        if clock is None:
            from twisted.internet import reactor as clock
        self.clock = clock
        if http is None:
            # treq over an Agent on our own reactor; a fresh connection per poll (a minute
            # apart, a kept one would be closed by lookupd anyway, and none outlives stop()).
            http = HTTPClient(Agent(clock, connectTimeout=self.timeout,
                                    pool=HTTPConnectionPool(clock, persistent=False)))
        self.http = http
        self._random = (rng or random).random
        self.addresses: set[str] | None = None
        self._next = 0
        self._loop: task.LoopingCall | None = None
        self._delayed: Any = None
        self._running: defer.Deferred | None = None
        self._waiters: list[defer.Deferred] = []
        # Bumped by stop(): a query started before it never reports.
        self._generation = 0
        self._started = False

    # -- life cycle ------------------------------------------------------------------

    def start(self) -> defer.Deferred:
        """Query at once, then poll every `interval` after a jittered delay.

        Returns the first poll's Deferred (fires with the set, or None if it
        failed; never errs), so a consumer can wait for its first producers.
        """
        if self._started:
            return self.poll()
        self._started = True
        first = self.poll()
        delay = self._random() * self.jitter * self.interval
        self._delayed = self.clock.callLater(delay, self._start_loop)
        return first

    def _start_loop(self) -> None:
        self._delayed = None
        self._loop = task.LoopingCall(self.poll)
        self._loop.clock = self.clock
        # The first tick one interval from now: the jitter delay was the offset, not a poll.
        self._loop.start(self.interval, now=False).addErrback(
            lambda f: log.failure("lookupd poll loop stopped", f))

    def stop(self) -> None:
        """No more polls; a query under way is cancelled and its answer ignored."""
        self._started = False
        self._generation += 1
        if self._delayed is not None and self._delayed.active():
            self._delayed.cancel()
        self._delayed = None
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        if self._running is not None:
            self._running.cancel()

    @property
    def running(self) -> bool:
        return self._started

    # -- one poll ----------------------------------------------------------------------

    def poll(self) -> defer.Deferred:
        """One poll now (go-nsq's lookupdRecheckChan: e.g. after a connection closed).

        A poll already under way is joined, not doubled: its answer is the
        newest anyway. Fires with the producer set, or None when every
        attempt failed; never errs.
        """
        waiter: defer.Deferred = defer.Deferred()
        self._waiters.append(waiter)
        if self._running is None:
            self._running = self._query(self._generation)
            self._running.addBoth(self._done)
        return waiter

    def _done(self, result: Any) -> None:
        self._running = None
        if isinstance(result, Failure):
            if not result.check(defer.CancelledError):
                log.failure("lookupd poll failed unexpectedly", result)
            result = None
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(result)

    def _next_url(self) -> str:
        if self._next >= len(self.urls):
            self._next = 0
        url = self.urls[self._next]
        self._next = (self._next + 1) % len(self.urls)
        return url

    @defer.inlineCallbacks
    def _query(self, generation: int):
        for attempt in range(QUERY_ATTEMPTS):
            url = self._next_url()
            log.debug("querying nsqlookupd {url}", url=url)
            try:
                found = yield self._fetch(url)
            except Exception as e:
                if generation != self._generation:
                    return None  # stop() cancelled it
                if isinstance(e, defer.TimeoutError):
                    log.error("error querying nsqlookupd ({url}) - no answer within {timeout}s",
                              url=url, timeout=self.timeout)
                else:
                    log.error("error querying nsqlookupd ({url}) - {error}", url=url,
                              error=_describe(e))
            else:
                if generation != self._generation:
                    return None
                self.addresses = found
                self._report(found)
                return found
            if attempt + 1 < QUERY_ATTEMPTS:
                log.info("retrying with next nsqlookupd")
        return None

    def _fetch(self, url: str) -> defer.Deferred:
        d = self._request(url)
        # treq reports a cancelled request as ResponseNeverReceived: whatever it says, it timed out.
        d.addTimeout(self.timeout, self.clock,
                     onTimeoutCancel=lambda result, timeout: Failure(defer.TimeoutError(timeout, url)))
        return d

    @defer.inlineCallbacks
    def _request(self, url: str):
        response = yield self.http.get(url, headers={b"Accept": [ACCEPT]})
        body = yield read_bounded(response, MAX_RESPONSE_SIZE, LookupdError)
        if response.code == 404:
            return set()
        if response.code != 200:
            raise LookupdError(f"got response {response.code} {body[:200]!r}")
        return lookup_answer(body)

    def _report(self, addresses: set[str]) -> None:
        try:
            result = self.on_change(set(addresses))
        except Exception:
            log.failure("lookupd on_change callback failed")
            return
        if isinstance(result, defer.Deferred):
            result.addErrback(lambda f: log.failure("lookupd on_change callback failed", f))
