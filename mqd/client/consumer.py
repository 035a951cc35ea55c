"""The consumer: one topic/channel over every nsqd that has it (go-nsq's Consumer).

Each nsqd address gets a Twisted `ClientService` (reconnect with backoff);
a connection takes part once its handshake is done and SUB answered OK.
Addresses come from `nsqd_tcp_addresses` (kept for the consumer's life)
and from polling lookupd (`LookupdPoller`: connected when listed,
dropped when no longer listed). RDY and backoff are `ReadyController`'s.

A handler is called for each message as it arrives (Twisted's model:
concurrency is `max_in_flight`, not a number of goroutines). It returns a
value (success), raises (failure), or returns a Deferred or a coroutine
that fires later; success FINs, failure REQs with backoff, unless the
handler disabled the automatic response or answered itself. A
synchronous handler costs no Deferred at all.

`stop()` is go-nsq's graceful stop: CLS on every connection, then each
connection closes once nsqd answered CLOSE_WAIT and its in-flight
messages are answered, and the Deferred fires once every connection is
closed and every running handler has returned (30 s at most).

Failures are logged once each, here: a failed dial, a failed handshake
or SUB, a lost connection (the protocol only says why). An nsqd whose
handshake ends the first connection in a way retrying cannot mend
(`HandshakeRefusedError`: its AUTH refused, a wrong secret or none given;
its IDENTIFY refused; or an answer the client cannot use, such as a
`max_rdy_count` out of range) is not dialed again, as go-nsq's
ConnectToNSQD gives up and returns the error: `on_fatal(address, error)`
hears it for an address given in `nsqd_tcp_addresses`, and one lookupd
listed is tried again when a later poll lists it. A connection
that had subscribed before is retried whatever the reason, as go-nsq
retries after losing one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from inspect import iscoroutine
from typing import Any, NamedTuple

from twisted.application import service
from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet import defer
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.logger import LogLevel
from twisted.python.failure import Failure
from zope.interface import implementer

from mqd.client.config import Config
from mqd.client.discovery import LookupdPoller
from mqd.client.errors import (
    ClientConfigError,
    ConnectionClosed,
    HandshakeRefusedError,
    NSQError,
    StoppedError,
)
from mqd.client.message import Message
from mqd.client.protocol import (
    ConnectionDelegate,
    ConnectionFactory,
    NSQClientProtocol,
    client_endpoint,
)
from mqd.client.ready import ReadyController
from mqd.logs import get_logger
from mqd.names import is_valid_name

__all__ = ["Consumer", "ConsumerStats", "STOP_TIMEOUT"]

log = get_logger("mqd.client")

# go-nsq gives a stopping consumer 30 s before it stops waiting for handlers.
STOP_TIMEOUT = 30.0
# Reconnection: quick after a blip, at most 30 s apart, a little jitter.
RETRY_INITIAL = 0.1
RETRY_MAX = 30.0
RETRY_JITTER = 0.25


class ConsumerStats(NamedTuple):
    messages_received: int
    messages_finished: int
    messages_requeued: int
    connections: int


@implementer(IStreamClientEndpoint)
class _ReportingEndpoint:
    """Tells the link about failed dials (ClientService keeps them to itself)."""

    def __init__(self, endpoint, link: _Link) -> None:
        self._endpoint = endpoint
        self._link = link

    def connect(self, factory):
        return self._endpoint.connect(factory).addErrback(self._link.attempt_failed)


class _LinkFactory(ConnectionFactory):
    """Remembers which link each connection belongs to (an address may be
    dropped and added again while its old connection still drains)."""

    noisy = False

    def __init__(self, link: _Link) -> None:
        consumer = link.consumer
        super().__init__(consumer.config, consumer, link.address, clock=consumer.clock)
        self.link = link

    def buildProtocol(self, addr) -> NSQClientProtocol:
        proto = super().buildProtocol(addr)
        self.link.consumer.link_connection(proto, self.link)
        # The handshake's outcome reaches the consumer as connection_ready or
        # connection_closed; `ready` failing unheard would be an "Unhandled
        # error in Deferred" at every failed attempt.
        proto.ready.addErrback(_reported_elsewhere)
        return proto


def _reported_elsewhere(_failure: Failure) -> None:
    return None


class _Link:
    """One nsqd address: its reconnecting service and its subscribed connection."""

    def __init__(self, consumer: Consumer, address: str, discovered: bool, endpoint) -> None:
        self.consumer = consumer
        self.address = address
        self.discovered = discovered
        self.conn: NSQClientProtocol | None = None  # the subscribed connection
        self.ever_subscribed = False  # a refused handshake is fatal only before the first SUB
        # Handshakes/SUBs failed in a row: ClientService forgets failures
        # once TCP connects, the retry delay must not.
        self.failures = 0
        self.removed = False  # being closed for good: never reconnect
        self.close_wait = False  # CLS answered: close once nothing is in flight
        self.closed = False
        self._stopping_service = False
        self._close_timer = None
        self._waiters: list[defer.Deferred] = []
        self._closed_waiters: list[defer.Deferred] = []
        self._retry = backoffPolicy(initialDelay=RETRY_INITIAL, maxDelay=RETRY_MAX, factor=2.0,
                                    jitter=lambda: random.random() * RETRY_JITTER)
        self.service = ClientService(
            _ReportingEndpoint(endpoint, self),
            _LinkFactory(self),
            retryPolicy=lambda attempt: self._retry(attempt + self.failures),
            clock=consumer.clock,
        )

    def __repr__(self) -> str:
        return f"<_Link {self.address}>"

    # -- connect_to_nsqd's Deferreds

    def wait(self) -> defer.Deferred:
        if self.conn is not None:
            return defer.succeed(self.conn)
        d: defer.Deferred[NSQClientProtocol] = defer.Deferred()
        self._waiters.append(d)
        return d

    def _fire(self, result) -> None:
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)

    def subscribed(self, conn: NSQClientProtocol) -> None:
        self.failures = 0
        self.ever_subscribed = True
        self.conn = conn
        self._fire(conn)

    def attempt_failed(self, failure: Failure) -> Failure:
        if not self.removed:
            log.warn("({address}) connecting failed: {error}", address=self.address,
                     error=str(failure.value) or type(failure.value).__name__)
        self._fire(failure)
        return failure

    def handshake_failed(self, failure: Failure) -> None:
        self.failures += 1
        self._fire(failure)

    # -- closing

    def close(self) -> defer.Deferred:
        """go-nsq's graceful close: CLS, CLOSE_WAIT, in-flight answered, then close."""
        d: defer.Deferred[None] = defer.Deferred()
        if self.closed:
            d.callback(None)
            return d
        self._closed_waiters.append(d)
        if self.removed:
            return d
        self.removed = True
        conn = self.conn
        if conn is None or not conn.connected:
            self.stop_service()
        elif not conn.closing:
            # a message its handler never answers must not keep it open forever
            self._close_timer = self.consumer.clock.callLater(STOP_TIMEOUT, self.stop_service)
            conn.cls().addCallbacks(self._close_wait, self._cls_failed)
        return d

    def _close_wait(self, _answer: bytes) -> None:
        log.info("({address}) received CLOSE_WAIT from nsqd", address=self.address)
        self.close_wait = True
        self.maybe_finish()

    def _cls_failed(self, failure: Failure) -> None:
        log.warn("({address}) CLS failed: {error}", address=self.address, error=str(failure.value))
        self.stop_service()

    def maybe_finish(self) -> None:
        """After CLOSE_WAIT, close once every in-flight message is answered."""
        if self.close_wait and (self.conn is None or self.conn.in_flight <= 0):
            self.stop_service()

    def stop_service(self) -> None:
        """Stop reconnecting and close the connection now."""
        self.removed = True
        if self._stopping_service:
            return
        self._stopping_service = True
        if self._close_timer is not None and self._close_timer.active():
            self._close_timer.cancel()
        self._close_timer = None
        self._fire(Failure(StoppedError(f"disconnected from {self.address}")))
        self.service.stopService().addBoth(self._service_stopped)

    def _service_stopped(self, _result) -> None:
        self.closed = True
        waiters, self._closed_waiters = self._closed_waiters, []
        for d in waiters:
            d.callback(None)
        self.consumer.link_closed(self)


class Consumer(service.Service, ConnectionDelegate):
    """Consumes `topic`/`channel`; a twisted Service (start it, or add it to a parent).

    `handler(message)` returns a value, raises, or returns a Deferred (or
    a coroutine). `giving_up(message)` (default: `handler.giving_up` if it
    has one) is called instead of the handler for a message delivered more
    than `max_attempts` times, which is then FINed. `endpoint_factory`
    (address → IStreamClientEndpoint) and `lookupd_http` (treq-like) are
    for tests and special transports. `on_fatal(address, error)` is called
    when an nsqd of `nsqd_tcp_addresses` (or `connect_to_nsqd`) refuses the
    consumer for good, and is no longer dialed: a `HandshakeRefusedError`
    (AUTH or IDENTIFY refused, or an answer the client cannot use) on its
    first connection. The tools exit 1 on it, as nsq_tail does.
    """

    def __init__(self, topic: str, channel: str, handler: Callable[[Message], Any], *,
                 nsqd_tcp_addresses: Iterable[str] = (),
                 lookupd_http_addresses: Sequence[str] = (),
                 config: Config | None = None,
                 giving_up: Callable[[Message], Any] | None = None,
                 reactor=None,
                 endpoint_factory: Callable[[str], Any] | None = None,
                 lookupd_http=None,
                 rng: random.Random | None = None,
                 on_fatal: Callable[[str, Exception], Any] | None = None,
                 **options: Any) -> None:
        if reactor is None:
            from twisted.internet import reactor
        if config is None:
            config = Config(**options)
        elif options:
            config = config.copy(**options)
        config.validate()
        if not is_valid_name(topic):
            raise ClientConfigError(f"invalid topic name {topic!r}")
        if not is_valid_name(channel):
            raise ClientConfigError(f"invalid channel name {channel!r}")
        if not callable(handler):
            handle = getattr(handler, "handle_message", None)
            if handle is None:
                raise TypeError("handler must be callable or have handle_message()")
            if giving_up is None:
                giving_up = getattr(handler, "giving_up", None)
            handler = handle
        elif giving_up is None:
            giving_up = getattr(handler, "giving_up", None)
        self.topic = topic
        self.channel = channel
        self.config = config
        self.clock = reactor
        self.reactor = reactor
        self._handler = handler
        self._giving_up = giving_up
        self._on_fatal = on_fatal
        if endpoint_factory is None:
            def endpoint_factory(address: str):
                return client_endpoint(reactor, address, config.dial_timeout, config.local_addr)
        self._endpoint_factory = endpoint_factory
        self._nsqd_addresses: list[str] = list(dict.fromkeys(nsqd_tcp_addresses))
        self._lookupd_addresses = list(lookupd_http_addresses)
        self._lookupd_http = lookupd_http
        self._poller: LookupdPoller | None = None
        # Subscribed connections, by address: what RDY is spread over.
        self.connections: dict[str, NSQClientProtocol] = {}
        # Addresses consumed from, and links closing for good (CLS sent).
        self._links: dict[str, _Link] = {}
        self._closing: set[_Link] = set()
        self._conn_links: dict[NSQClientProtocol, _Link] = {}
        self.ready = ReadyController(config, reactor, self.connections.values, rng=rng)
        self._received = 0
        self._finished = 0
        self._requeued = 0
        self._running_handlers = 0
        self._stopping = False
        self._stopped = False
        self._stop_timer = None
        self._stop_waiters: list[defer.Deferred] = []

    def __repr__(self) -> str:
        return f"<Consumer {self.topic}/{self.channel} connections={len(self.connections)}>"

    # -- state --------------------------------------------------------------------

    @property
    def stats(self) -> ConsumerStats:
        return ConsumerStats(self._received, self._finished, self._requeued,
                             len(self.connections))

    @property
    def max_in_flight(self) -> int:
        return self.ready.max_in_flight

    def is_starved(self) -> bool:
        """Some connection has (nearly) all its RDY in flight: the handler is the bottleneck."""
        return self.ready.is_starved()

    def change_max_in_flight(self, max_in_flight: int) -> None:
        """Re-spread RDY over the connections; 0 pauses the flow (RDY 0 everywhere)."""
        if max_in_flight < 0:
            raise ClientConfigError(f"max_in_flight must not be negative, got {max_in_flight}")
        self.ready.change_max_in_flight(max_in_flight)

    # -- service ------------------------------------------------------------------------

    def startService(self) -> None:
        if self._stopping:
            raise RuntimeError("a stopped Consumer cannot be started again")
        super().startService()
        self.ready.start()
        for address in self._nsqd_addresses:
            self._link(address, discovered=False)
        for address, link in self._links.items():
            if not link.service.running:
                log.info("({address}) connecting to nsqd", address=address)
                link.service.startService()
        if self._lookupd_addresses:
            config = self.config
            self._poller = LookupdPoller(
                self.topic, self._lookupd_addresses, config.lookupd_poll_interval,
                config.lookupd_poll_jitter, self._lookupd_changed, clock=self.clock,
                http=self._lookupd_http)
            self._poller.start()

    def stopService(self) -> defer.Deferred:
        super().stopService()
        return self._stop()

    # -- connections ----------------------------------------------------------------------

    def connect_to_nsqd(self, address: str) -> defer.Deferred:
        """Consume from the nsqd at `address` too, reconnecting whenever it is lost.

        Fires with the connection once subscribed, or fails with the reason
        an attempt failed (the attempts go on regardless). Before
        startService the connection waits for the start.
        """
        if self._stopping:
            return defer.fail(StoppedError("consumer stopped"))
        if address not in self._nsqd_addresses:
            self._nsqd_addresses.append(address)
        link = self._links.get(address)
        if link is None:
            link = self._link(address, discovered=False)
        else:
            link.discovered = False  # named explicitly: lookupd no longer decides
        return link.wait()

    def disconnect_from_nsqd(self, address: str) -> defer.Deferred:
        """Stop consuming from `address`: CLS, drain, close, no reconnection."""
        if address in self._nsqd_addresses:
            self._nsqd_addresses.remove(address)
        link = self._links.get(address)
        if link is None:
            return defer.succeed(None)
        return self._close_link(link)

    def _link(self, address: str, discovered: bool) -> _Link:
        link = self._links.get(address)
        if link is not None:
            return link
        link = _Link(self, address, discovered, self._endpoint_factory(address))
        self._links[address] = link
        if self.running:
            log.info("({address}) connecting to nsqd", address=address)
            link.service.startService()
        return link

    def _close_link(self, link: _Link) -> defer.Deferred:
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self._closing.add(link)
        return link.close()

    def link_connection(self, conn: NSQClientProtocol, link: _Link) -> None:
        """A link's factory built `conn`: the delegate's calls for it are the link's."""
        self._conn_links[conn] = link

    def link_closed(self, link: _Link) -> None:
        """A link closed for good: the consumer may have stopped with it."""
        self._closing.discard(link)
        self._check_stopped()

    def _lookupd_changed(self, addresses: set[str]) -> None:
        if self._stopping:
            return
        for address in sorted(addresses):
            if address not in self._links:
                self._link(address, discovered=True)
        for address, link in list(self._links.items()):
            if link.discovered and address not in addresses:
                log.info("({address}) no longer listed by lookupd, disconnecting",
                         address=address)
                self._close_link(link)

    # -- connection delegate ---------------------------------------------------------------

    def connection_ready(self, conn: NSQClientProtocol) -> None:
        link = self._conn_links.get(conn)
        if link is None or link.removed or self._stopping:
            conn.close()
            return
        if conn.last_message_at == 0.0:
            # go-nsq counts a connection's idleness from its creation
            conn.last_message_at = self.clock.seconds()
        conn.sub(self.topic, self.channel).addCallbacks(
            self._subscribed, self._sub_failed, callbackArgs=(conn, link),
            errbackArgs=(conn, link))

    def _subscribed(self, _answer: bytes, conn: NSQClientProtocol, link: _Link) -> None:
        if link.removed or self._stopping or not conn.connected:
            conn.close()
            return
        log.info("({address}) subscribed to {topic}/{channel}", address=conn.address,
                 topic=self.topic, channel=self.channel)
        old = self.connections.get(conn.address)
        if old is not None:
            # the address was dropped and added again while its old
            # connection still drains: that one gives up its RDY share now
            del self.connections[conn.address]
            self.ready.connection_removed(old)
        self.connections[conn.address] = conn
        link.subscribed(conn)
        self.ready.connection_added(conn)

    def _sub_failed(self, failure: Failure, conn: NSQClientProtocol, link: _Link) -> None:
        if not link.removed and not self._stopping:
            log.error("({address}) failed to subscribe to {topic}/{channel}: {error}",
                      address=conn.address, topic=self.topic, channel=self.channel,
                      error=str(failure.value))
        conn.close()

    def connection_closed(self, conn: NSQClientProtocol, reason) -> None:
        """The one report of a connection's end (the protocol logs none of its own)."""
        address = conn.address
        error = getattr(reason, "value", reason)
        if self.connections.get(address) is conn:
            del self.connections[address]
            self.ready.connection_removed(conn)
            link = self._conn_links.get(conn)
            if self._stopping or link is None or link.removed:
                log.info("({address}) connection closed; {left} left", address=address,
                         left=len(self.connections))
            else:
                log.warn("({address}) connection closed: {reason}; {left} left", address=address,
                         reason=error, left=len(self.connections))
        link = self._conn_links.pop(conn, None)
        if link is None:
            return
        if link.conn is conn:
            link.conn = None
        elif not link.removed:
            if isinstance(error, (NSQError, ConnectionClosed)):
                failure = reason if isinstance(reason, Failure) else Failure(reason)
            else:  # the transport's reason: connect_to_nsqd fails with the library's type
                failure = Failure(ConnectionClosed(reason))
            if isinstance(error, HandshakeRefusedError) and not link.ever_subscribed:
                link.handshake_failed(failure)
                self._refused(link, error)
                return
            if not conn.handshake_done:  # a failed SUB was reported by _sub_failed
                log.warn("({address}) handshake failed: {error}", address=address, error=error)
            link.handshake_failed(failure)
        if link.removed:
            link.stop_service()

    def _refused(self, link: _Link, error: HandshakeRefusedError) -> None:
        """go-nsq's ConnectToNSQD failing: this address is not dialed again (see the module)."""
        if link.discovered:
            log.error("({address}) {error}; tried again when lookupd lists it next",
                      address=link.address, error=error.nsq_text)
        else:
            log.error("({address}) {error}; not reconnecting", address=link.address,
                      error=error.nsq_text)
        self._close_link(link)
        if not link.discovered and self._on_fatal is not None:
            try:
                self._on_fatal(link.address, error)
            except Exception:
                log.failure("on_fatal callback failed")

    def connection_error(self, conn: NSQClientProtocol, err) -> None:
        if err.fatal:
            return  # the connection closes with it: connection_closed reports it
        log.error("({address}) protocol error - {error}", address=conn.address, error=str(err))

    def message_finished(self, conn: NSQClientProtocol, msg: Message) -> None:
        self._finished += 1
        self.ready.on_success()
        if conn.closing:
            self._drained(conn)

    def messages_finished(self, conn: NSQClientProtocol, count: int) -> None:
        self._finished += count
        self.ready.on_success()
        if conn.closing:
            self._drained(conn)

    def message_requeued(self, conn: NSQClientProtocol, msg: Message, backoff: bool) -> None:
        self._requeued += 1
        if backoff:
            self.ready.on_failure()
        else:
            self.ready.on_continue()
        if conn.closing:
            self._drained(conn)

    def _drained(self, conn: NSQClientProtocol) -> None:
        link = self._conn_links.get(conn)
        if link is not None:
            link.maybe_finish()

    # -- messages -------------------------------------------------------------------------------

    def message_received(self, conn: NSQClientProtocol, msg: Message) -> None:
        self._received += 1
        max_attempts = self.config.max_attempts
        if max_attempts > 0 and msg.attempts > max_attempts:
            self._give_up(msg)
            return
        try:
            result = self._handler(msg)
        except Exception:
            self._handler_failed(Failure(), msg)
            return
        # `result is not None` first: asyncio.iscoroutine(None) is an ABC check (~1 us), and
        # most handlers return None.
        if result is not None and (isinstance(result, defer.Deferred) or iscoroutine(result)):
            if not isinstance(result, defer.Deferred):
                result = defer.Deferred.fromCoroutine(result)
            self._running_handlers += 1
            result.addCallbacks(self._handler_done, self._handler_failed,
                                callbackArgs=(msg,), errbackArgs=(msg,))
            result.addBoth(self._handler_exited)
            return
        if not msg.is_auto_response_disabled():
            msg.finish()

    def _handler_done(self, _result, msg: Message) -> None:
        if not msg.is_auto_response_disabled():
            msg.finish()

    def _handler_failed(self, failure: Failure, msg: Message) -> None:
        log.failure("Handler returned error ({error}) for msg {id}", failure, LogLevel.error,
                    error=failure.value, id=msg.id.decode("ascii", "replace"))
        if not msg.is_auto_response_disabled():
            msg.requeue(None)

    def _handler_exited(self, _result) -> None:
        self._running_handlers -= 1
        if self._stopping:
            self._check_stopped()

    def _give_up(self, msg: Message) -> None:
        log.warn("msg {id} attempted {attempts} times, giving up",
                 id=msg.id.decode("ascii", "replace"), attempts=msg.attempts)
        giving_up = self._giving_up
        if giving_up is None:
            msg.finish()
            return
        try:
            result = giving_up(msg)
        except Exception:
            log.failure("giving_up hook failed for msg {id}", id=msg.id.decode("ascii", "replace"))
            msg.finish()
            return
        if iscoroutine(result):
            result = defer.Deferred.fromCoroutine(result)
        if isinstance(result, defer.Deferred):
            self._running_handlers += 1
            result.addErrback(lambda f: log.failure("giving_up hook failed", f))
            result.addCallback(lambda _: msg.finish())
            result.addBoth(self._handler_exited)
        else:
            msg.finish()

    # -- stopping --------------------------------------------------------------------------------

    def stop(self) -> defer.Deferred:
        """CLS everywhere, wait for CLOSE_WAIT, in-flight answers and running handlers, close.

        Fires once everything is closed, or after STOP_TIMEOUT seconds (the
        connections are then closed regardless). Calling it again waits
        for the same end. The same as stopService: the service is no
        longer `running` afterwards.
        """
        if self.running:
            return self.stopService()
        return self._stop()

    def _stop(self) -> defer.Deferred:
        d: defer.Deferred[None] = defer.Deferred()
        if self._stopped:
            d.callback(None)
            return d
        self._stop_waiters.append(d)
        if self._stopping:
            return d
        self._stopping = True
        log.info("stopping consumer {topic}/{channel}", topic=self.topic, channel=self.channel)
        if self._poller is not None:
            self._poller.stop()
        self.ready.stop()
        self._stop_timer = self.clock.callLater(STOP_TIMEOUT, self._stop_timeout)
        for link in list(self._links.values()):
            self._close_link(link)
        self._check_stopped()
        return d

    def _stop_timeout(self) -> None:
        self._stop_timer = None
        log.warn("consumer {topic}/{channel}: still busy after {timeout} s, closing anyway",
                 topic=self.topic, channel=self.channel, timeout=STOP_TIMEOUT)
        for link in list(self._closing):
            link.stop_service()
        self._stopped_now()

    def _check_stopped(self) -> None:
        if (self._stopping and not self._stopped and not self._links and not self._closing
                and self._running_handlers <= 0):
            self._stopped_now()

    def _stopped_now(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._stop_timer is not None and self._stop_timer.active():
            self._stop_timer.cancel()
        self._stop_timer = None
        log.info("consumer {topic}/{channel} stopped", topic=self.topic, channel=self.channel)
        waiters, self._stop_waiters = self._stop_waiters, []
        for d in waiters:
            d.callback(None)
