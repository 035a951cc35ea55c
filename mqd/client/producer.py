"""The producer: publishes to one nsqd over one pipelined, reconnecting connection.

As go-nsq's Producer, answers are matched to commands in the order they
were sent (nsqd answers PUB, MPUB and DPUB in order on a connection), so
many publishes can be on the wire at once with nothing but a FIFO of
Deferreds (kept by the connection). Unlike go-nsq, which dials lazily on
the first publish, the connection is a Twisted `ClientService` that
reconnects with backoff after any loss, as the broker's own lookupd peers
do (`mqd.nsqd.lookup_peer`).

Memory stays bounded: at most `max_outstanding` commands are on the wire
and at most `max_queued` wait behind them (or for a connection); beyond
that a publish fails at once with `ProducerFullError`, the caller's cue to
slow down. Commands never hang: a waiting command is sent on the next
connection, or fails with the reason when the next connection attempt
fails; a command on the wire fails with `ConnectionClosed` when its
connection ends before the answer (a fatal error frame fails its own
command with the NSQError and closes the connection, as nsqd does).

The handshake (IDENTIFY, TLS, compression, AUTH) is not part of
`ClientService`'s notion of a connection (its `prepareConnection` cannot
fail a connection that later closes without upsetting its state machine),
so a handshake failure counts towards the backoff through the retry
policy instead.

Each failure is logged once, here (the protocol only says why): a failed
dial, a failed handshake, a lost connection, a fatal answer. A handshake
refused for good (`HandshakeRefusedError`: AUTH or IDENTIFY refused, an
answer the client cannot use) is retried like the rest, as go-nsq's
producer dials again at the next publish: the commands waiting meanwhile
fail with it, which is how mq-pub stops at once with go-nsq's message.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

from twisted.application import service
from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet import defer
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.python.failure import Failure
from zope.interface import implementer

from mqd.client.config import Config
from mqd.client.errors import NSQError, ProducerFullError, StoppedError, error_from_frame
from mqd.client.protocol import (
    ConnectionDelegate,
    ConnectionFactory,
    NSQClientProtocol,
    client_endpoint,
)
from mqd.logs import get_logger
from mqd.names import is_valid_name
from mqd.wire.errors import go_quote

__all__ = ["Producer"]

# The connection's encoders, called unbound on whichever connection is current.
_PUB = NSQClientProtocol.pub
_MPUB = NSQClientProtocol.mpub
_DPUB = NSQClientProtocol.dpub

log = get_logger("mqd.client")

# Reconnect quickly after a blip, never wait longer than 30 s; a little
# jitter so that producers restarted together do not dial in lockstep.
RETRY_INITIAL = 0.1
RETRY_MAX = 30.0
RETRY_JITTER = 0.25


def _jitter() -> float:
    return random.random() * RETRY_JITTER


def _check_body(body: Any) -> None:
    if not isinstance(body, (bytes, bytearray)):
        raise TypeError(f"a message body must be bytes, not {type(body).__name__}")


@implementer(IStreamClientEndpoint)
class _WatchedEndpoint:
    """An endpoint that tells the producer how each connection attempt went.

    ClientService keeps a failed attempt to itself (it only retries); the
    producer needs it to fail the commands waiting for that connection.
    """

    def __init__(self, endpoint, dialing: Callable[[], None],
                 dialed: Callable[[Any], Any], failed: Callable[[Failure], Any]) -> None:
        self._endpoint = endpoint
        self._dialing = dialing
        self._dialed = dialed
        self._failed = failed

    def connect(self, factory):
        self._dialing()
        d = self._endpoint.connect(factory)
        d.addCallbacks(self._dialed, self._failed)
        return d


class Producer(service.Service, ConnectionDelegate):
    """Publishes to the nsqd at `address`; a twisted Service (start it, or add it to a parent).

    `publish`, `multi_publish` and `deferred_publish` return a Deferred
    that fires with nsqd's answer (b"OK") or fails with the error frame's
    NSQError, `ConnectionClosed`, the reason a connection attempt failed,
    `ProducerFullError` or `StoppedError`. A bad topic name or a wrong
    body type fails before anything is sent.
    """

    def __init__(self, address: str, config: Config | None = None, *, reactor=None,
                 max_outstanding: int = 1000, max_queued: int = 10000, endpoint=None,
                 **options: Any) -> None:
        if reactor is None:
            from twisted.internet import reactor
        if config is None:
            config = Config(**options)
        elif options:
            config = config.copy(**options)
        config.validate()
        if max_outstanding < 1:
            raise ValueError("max_outstanding must be at least 1")
        if max_queued < 0:
            raise ValueError("max_queued must not be negative")
        self.address = address
        self.config = config
        self.reactor = reactor
        self.max_outstanding = max_outstanding
        self.max_queued = max_queued
        if endpoint is None:
            endpoint = client_endpoint(reactor, address, config.dial_timeout, config.local_addr)
        self._retry = backoffPolicy(initialDelay=RETRY_INITIAL, maxDelay=RETRY_MAX, factor=2.0,
                                    jitter=_jitter)
        self._client = ClientService(
            _WatchedEndpoint(endpoint, self._dial_started, self._dialed, self._dial_failed),
            ConnectionFactory(config, self, address, clock=reactor),
            retryPolicy=self._retry_delay,
            clock=reactor,
        )
        # The connection commands go to (handshake done, not failed), or None.
        self._conn: NSQClientProtocol | None = None
        # Commands sent on a connection and not answered yet.
        self._outstanding = 0
        # Commands waiting for room on the wire or for a connection:
        # (the connection's writer, its arguments, the caller's Deferred), oldest first.
        self._waiting: deque[tuple[Callable[..., defer.Deferred], tuple, defer.Deferred]] = deque()
        # A connection attempt (dial or handshake) is under way.
        self._dialing = False
        self._handshaking = False
        # Handshakes failed in a row: ClientService resets its count of
        # failures when TCP connects, the backoff must not.
        self._failed_handshakes = 0
        # stop(): _stopping refuses new commands; _stopped once drained and
        # closing; _closed_for_good once the connection is gone.
        self._stopping = False
        self._stopped = False
        self._closed_for_good = False
        self._stop_waiters: list[defer.Deferred] = []
        # ping()s waiting for the next connection attempt's outcome.
        self._pings: list[defer.Deferred] = []
        # Topic names seen valid, so the regex runs once per topic.
        self._valid_topics: set[str] = set()

    # -- state --------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """A connection is up and its handshake done: commands go straight to the wire."""
        return self._conn is not None

    @property
    def outstanding(self) -> int:
        """Commands on the wire waiting for their answer."""
        return self._outstanding

    @property
    def queued(self) -> int:
        """Commands waiting for room on the wire or for a connection."""
        return len(self._waiting)

    def __repr__(self) -> str:
        return f"<Producer {self.address} connected={self.connected}>"

    # -- publishing -----------------------------------------------------------------

    def publish(self, topic: str, body: bytes) -> defer.Deferred:
        """PUB one message; fires with b"OK"."""
        _check_body(body)
        if topic not in self._valid_topics and not self._check_topic(topic):
            return defer.fail(self._bad_topic("PUB", topic))
        return self._send(_PUB, (topic, body))

    def multi_publish(self, topic: str, bodies: Sequence[bytes]) -> defer.Deferred:
        """MPUB several messages at once (all or none are published); fires with b"OK"."""
        if isinstance(bodies, (bytes, bytearray, str)):
            raise TypeError("multi_publish takes a sequence of bodies, not one body")
        bodies = list(bodies)
        for body in bodies:
            _check_body(body)
        if topic not in self._valid_topics and not self._check_topic(topic):
            return defer.fail(self._bad_topic("MPUB", topic))
        return self._send(_MPUB, (topic, bodies))

    def deferred_publish(self, topic: str, body: bytes, delay_ms: int) -> defer.Deferred:
        """DPUB: the message reaches the channels `delay_ms` milliseconds from now; fires with b"OK"."""
        _check_body(body)
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, int):
            raise TypeError(f"delay_ms must be an int, not {type(delay_ms).__name__}")
        if topic not in self._valid_topics and not self._check_topic(topic):
            return defer.fail(self._bad_topic("DPUB", topic))
        return self._send(_DPUB, (topic, delay_ms, body))

    def _check_topic(self, topic: str) -> bool:
        if not isinstance(topic, str):
            raise TypeError(f"a topic name must be str, not {type(topic).__name__}")
        if not is_valid_name(topic):
            return False
        if len(self._valid_topics) < 4096:
            self._valid_topics.add(topic)
        return True

    @staticmethod
    def _bad_topic(verb: str, topic: str) -> NSQError:
        """nsqd's own answer to the command, without asking it."""
        prefix = "E_BAD_TOPIC " if verb == "MPUB" else ""  # nsqd's MPUB repeats the code
        text = f"E_BAD_TOPIC {prefix}{verb} topic name {go_quote(topic.encode())} is not valid"
        return error_from_frame(text.encode())

    def ping(self) -> defer.Deferred:
        """Fires once a connection is ready (at once if one is), or fails with why the attempt failed.

        go-nsq's Ping: a way to find a broker that cannot be reached, or
        refuses the handshake, before publishing anything. The failure is
        the dial's error (`ConnectionRefusedError`, ...) or the handshake's
        (an NSQError such as `E_AUTH_FAILED`). The producer must be started.
        """
        if self._stopping:
            return defer.fail(StoppedError(f"producer for {self.address} is stopped"))
        if self._conn is not None:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._pings.append(d)
        return d

    def _answer_pings(self, error: BaseException | None) -> None:
        pings, self._pings = self._pings, []
        for d in pings:
            if error is None:
                d.callback(None)
            else:
                d.errback(error)

    def _send(self, write: Callable[..., defer.Deferred], args: tuple) -> defer.Deferred:
        """Straight to the wire when there is room, else wait (bounded), else ProducerFullError."""
        if self._stopping:
            return defer.fail(StoppedError(f"producer for {self.address} is stopped"))
        conn = self._conn
        if conn is not None and self._outstanding < self.max_outstanding and not self._waiting:
            return self._write(conn, write, args)
        if len(self._waiting) >= self.max_queued:
            return defer.fail(ProducerFullError(
                f"{self._outstanding} commands outstanding and {len(self._waiting)} queued "
                f"for {self.address}"))
        d: defer.Deferred[Any] = defer.Deferred()
        self._waiting.append((write, args, d))
        return d

    def _write(self, conn: NSQClientProtocol, write: Callable[..., defer.Deferred],
               args: tuple) -> defer.Deferred:
        self._outstanding += 1
        d = write(conn, *args)
        d.addBoth(self._answered, conn)
        return d

    def _answered(self, result, conn: NSQClientProtocol):
        """One answer (or failure) of a command on `conn`: make room for the next one."""
        self._outstanding -= 1
        if conn is self._conn:
            if isinstance(result, Failure) and result.check(NSQError) and cast(NSQError, result.value).fatal:
                # nsqd closes the connection after a fatal error (and so does
                # the protocol): what is sent behind it would be lost, so the
                # next commands wait for the next connection.
                log.warn("producer {address}: {error}; reconnecting", address=self.address,
                         error=str(result.value))
                self._conn = None
            elif self._waiting:
                self._flush(conn)
        if self._stopping:
            self._check_drained()
        return result

    def _flush(self, conn: NSQClientProtocol) -> None:
        """Send waiting commands while there is room on the wire."""
        waiting = self._waiting
        while waiting and self._outstanding < self.max_outstanding and conn is self._conn:
            write, args, d = waiting.popleft()
            self._write(conn, write, args).chainDeferred(d)

    def _fail_waiting(self, error: BaseException | Failure) -> None:
        waiting, self._waiting = self._waiting, deque()
        for _write, _args, d in waiting:
            d.errback(error)

    # -- connections ------------------------------------------------------------------

    def _retry_delay(self, attempt: int) -> float:
        return self._retry(attempt + self._failed_handshakes)

    def _dial_started(self) -> None:
        self._dialing = True

    def _dialed(self, proto):
        """TCP is up; the handshake decides whether this connection is usable."""
        self._dialing = False
        self._handshaking = True
        proto.ready.addCallbacks(self._ready, self._handshake_failed)
        return proto

    def _dial_failed(self, failure: Failure) -> Failure:
        self._dialing = False
        if not self._stopped:
            log.warn("producer {address}: connecting failed: {error}", address=self.address,
                     error=str(failure.value) or type(failure.value).__name__)
            self._fail_waiting(cast(BaseException, failure.value))  # a Failure's value is set
            self._answer_pings(failure.value)
        if self._stopping:
            self._check_drained()
        return failure  # ClientService schedules the next attempt

    def _ready(self, conn: NSQClientProtocol) -> None:
        self._handshaking = False
        self._failed_handshakes = 0
        if self._stopped:
            return
        log.info("producer {address}: connected", address=self.address)
        self._conn = conn
        self._answer_pings(None)
        self._flush(conn)
        if self._stopping:
            self._check_drained()

    def _handshake_failed(self, failure: Failure) -> None:
        self._handshaking = False
        self._failed_handshakes += 1
        if not self._stopped:
            log.warn("producer {address}: handshake failed: {error}", address=self.address,
                     error=str(failure.value))
            self._fail_waiting(cast(BaseException, failure.value))  # a Failure's value is set
            self._answer_pings(failure.value)
        if self._stopping:
            self._check_drained()

    def connection_closed(self, conn: NSQClientProtocol, reason) -> None:
        if conn is self._conn:
            self._conn = None
            if not self._stopped:
                log.warn("producer {address}: connection lost: {reason}", address=self.address,
                         reason=getattr(reason, "value", reason))
        if self._stopping:
            self._check_drained()

    def connection_error(self, conn: NSQClientProtocol, err: NSQError) -> None:
        # Only FIN/REQ/TOUCH failures are non-fatal, and a producer sends none. A fatal
        # one closes the connection, and connection_closed reports it.
        if not err.fatal:
            log.warn("producer {address}: unexpected {error}", address=self.address, error=str(err))

    # -- service ------------------------------------------------------------------------

    def startService(self) -> None:
        if self._stopping:
            raise RuntimeError("a stopped Producer cannot be started again")
        super().startService()
        self._client.startService()

    def stopService(self) -> defer.Deferred:
        super().stopService()
        return self._stop()

    def stop(self) -> defer.Deferred:
        """Take no new commands, wait for every accepted one to be answered, then close.

        Commands still waiting when there is no connection and none being
        made fail with StoppedError (no retry is waited for). Fires once
        the connection is closed; calling it again gives the same outcome.
        """
        if self.running:
            return self.stopService()
        return self._stop()

    def _stop(self) -> defer.Deferred:
        d: defer.Deferred[None] = defer.Deferred()
        if self._closed_for_good:
            d.callback(None)
            return d
        self._stop_waiters.append(d)
        if not self._stopping:
            self._stopping = True
            log.info("producer {address}: stopping", address=self.address)
            self._answer_pings(StoppedError(f"producer for {self.address} is stopped"))
            self._check_drained()
        return d

    def _check_drained(self) -> None:
        """While stopping: once nothing is outstanding or waiting, close for good."""
        if self._stopped:
            return
        if self._waiting and self._conn is None and not (
                self._client.running and (self._dialing or self._handshaking)):
            self._fail_waiting(StoppedError(
                f"producer for {self.address} stopped before a connection was made"))
        if self._waiting or self._outstanding:
            return
        self._stopped = True
        self._conn = None
        d = defer.maybeDeferred(self._client.stopService) if self._client.running else defer.succeed(None)
        d.addBoth(self._closed)

    def _closed(self, result) -> None:
        if isinstance(result, Failure):
            log.failure("producer {address}: closing failed", result, address=self.address)
        log.info("producer {address}: stopped", address=self.address)
        self._closed_for_good = True
        waiters, self._stop_waiters = self._stop_waiters, []
        for d in waiters:
            d.callback(None)

