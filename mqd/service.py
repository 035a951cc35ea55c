"""The services a broker is composed of under twistd."""

from __future__ import annotations

import errno
import re
import socket
import sys

from twisted.application import service
from twisted.internet import endpoints, tcp
from twisted.internet.defer import DeferredList, fail, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.internet.posixbase import PosixReactorBase
from twisted.python.failure import Failure
from zope.interface import implementer

from mqd.endpoints import join_host_port
from mqd.logs import get_logger
from mqd.options import ConfigError, to_endpoint, wildcard_port

__all__ = ["AnyInterfaceEndpoint", "BrokerService", "ListeningService", "listen_endpoint", "with_backlog"]

log = get_logger(__name__)

# Endpoint types whose listeners take a `backlog` argument (systemd adopts a
# socket already listening, with the backlog its unit gave it).
_BACKLOG_TYPES = ("tcp", "tcp6", "ssl", "unix")
_HAS_BACKLOG = re.compile(r"(?:^|(?<!\\):)backlog=")


def with_backlog(description: str, backlog: int) -> str:
    """The endpoint string with `backlog=` added, unless it names one itself or cannot take one."""
    kind = description.split(":", 1)[0]
    if kind not in _BACKLOG_TYPES or _HAS_BACKLOG.search(description):
        return description
    return f"{description}:backlog={backlog}"


# What socket() or bind() on "::" fails with on a host without IPv6.
_NO_IPV6 = (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT)


class _DualStackPort(tcp.Port):
    """A TCP port on "::" that takes IPv4 connections too, whatever the host's net.ipv6.bindv6only says."""

    def createInternetSocket(self):
        skt = super().createInternetSocket()
        skt.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        return skt


@implementer(IStreamServerEndpoint)
class AnyInterfaceEndpoint:
    """Every interface, IPv6 and IPv4, on one socket: what nsqd's `0.0.0.0:PORT` and `:PORT` listen on.

    Go listens on a wildcard address with one IPv6 socket that also takes
    IPv4 (IPV6_V6ONLY off), and reports it as `[::]:4150`; so does this
    endpoint, so that a client dialing `[::1]:4150` or a `localhost` that
    resolves to ::1 reaches mqd as it reaches nsqd. On a host without IPv6
    it listens on IPv4 alone (`0.0.0.0:4150`), as Go does. A reactor that
    is not a real one (the tests' MemoryReactor) gets `listenTCP` on "::".
    """

    def __init__(self, reactor, port: int, backlog: int) -> None:
        self._reactor = reactor
        self._port = port
        self._backlog = backlog

    def listen(self, factory):
        reactor = self._reactor
        if not isinstance(reactor, PosixReactorBase):
            return succeed(reactor.listenTCP(self._port, factory, self._backlog, "::"))
        port = _DualStackPort(self._port, factory, self._backlog, "::", reactor)
        try:
            port.startListening()
        except CannotListenError as e:
            if getattr(e.socketError, "errno", None) not in _NO_IPV6:
                return fail()
            try:
                return succeed(reactor.listenTCP(self._port, factory, self._backlog, ""))
            except CannotListenError:
                return fail()
        return succeed(port)

    def __repr__(self) -> str:
        return f"AnyInterfaceEndpoint(port={self._port})"


def listen_endpoint(reactor, address: str, backlog: int):
    """The server endpoint for a configured address (nsqd's or Twisted's form) with the listen backlog.

    Twisted listens with a backlog of 50 by default: a burst of connections
    beyond it is dropped by the kernel, where nsqd queues up to somaxconn.
    nsqd's every-interface forms listen on IPv6 and IPv4 at once
    (`AnyInterfaceEndpoint`).
    """
    port = wildcard_port(address)
    if port is not None:
        return AnyInterfaceEndpoint(reactor, port, backlog)
    return endpoints.serverFromString(reactor, with_backlog(to_endpoint(address), backlog))


class ListeningService(service.Service):
    """Listens on an endpoint and logs the bound address as nsqd does.

    `TCP: listening on 127.0.0.1:4150` is the line scripts look for to
    find a port chosen at start-up (port 0). It is logged once the reactor
    runs, so that when a script sees it the broker also handles SIGTERM
    cleanly (twistd installs its signal handlers as the reactor starts).
    A port that cannot be bound stops start-up with the error, before the
    reactor runs.
    """

    def __init__(self, label: str, endpoint, factory, ports: dict | None = None, reactor=None,
                 description: str = "") -> None:
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        self.label = label
        self.endpoint_description = description or repr(endpoint)
        self.endpoint = endpoint
        self.factory = factory
        self.ports = ports if ports is not None else {}
        self.port = None

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        failures: list[Failure] = []
        self.endpoint.listen(self.factory).addCallbacks(self._listening, failures.append)
        if failures:
            # One clear line and a non-zero exit, as nsqd stops on a listen
            # failure; a traceback would bury the reason.
            print(f"mqd: {self.label}: cannot listen on {self.endpoint_description}: "
                  f"{failures[0].getErrorMessage()}", file=sys.stderr)
            raise SystemExit(1)

    def _listening(self, port) -> None:
        self.port = port
        host = port.getHost()
        if hasattr(host, "port"):
            address = join_host_port(host.host, host.port)
            self.ports[self.label] = host.port
        else:
            address = str(getattr(host, "name", host))
        self.reactor.callWhenRunning(
            log.info, "{label}: listening on {address}", label=self.label, address=address
        )

    def stopService(self):
        super().stopService()
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()
        return None


class BrokerService(service.Service):
    """Opens the broker's storage at start-up and shuts it down cleanly.

    It is the first child of the broker's MultiService, so it opens before
    the listeners bind and, stopping in reverse order, closes after they
    have stopped accepting: clients off, metadata saved, queues flushed.
    """

    name = "broker"

    def __init__(self, broker) -> None:
        self.broker = broker

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        try:
            self.broker.open()
        except ConfigError as e:
            print(f"mqd: {e}", file=sys.stderr)
            raise SystemExit(1) from None

    def stopService(self):
        super().stopService()
        running = list(self.broker.background)
        if not running:
            # A Deferred when the store waits for disk space to write what it holds.
            return self.broker.close()
        # A snapshot thread still reads the LMDB environment: closing it
        # under the copy would crash the process, so wait (a copy is short).
        d = DeferredList(running, consumeErrors=True)
        d.addCallback(lambda _: self.broker.close())
        return d
