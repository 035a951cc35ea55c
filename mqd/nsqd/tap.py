"""`twistd mqd`: command-line options and the service tree of a broker."""

from __future__ import annotations

import os
import sys

from twisted.application import service
from twisted.python import usage

from mqd.logs import set_log_level
from mqd.nsqd.broker import Broker
from mqd.nsqd.gcpolicy import GCPolicy
from mqd.nsqd.http.site import NsqdSite
from mqd.nsqd.http.state import HttpState
from mqd.nsqd.lookup_peer import LookupService
from mqd.nsqd.protocol.v2 import V2Factory
from mqd.nsqd.queuescan import QueueScanner
from mqd.nsqd.statsd import StatsdService
from mqd.nsqd.tlsconfig import server_tls
from mqd.options import MQD_OPTIONS, ConfigError, Settings, check_http_auth, http_client_auth_secret
from mqd.service import BrokerService, ListeningService, listen_endpoint
from mqd.tap import make_options_class, settings_from

__all__ = ["Options", "build_service", "makeService"]


Options = make_options_class(MQD_OPTIONS, "mqd")


def build_service(settings: Settings, reactor=None) -> service.MultiService:
    """The broker's services: storage first, listeners last (so they stop first)."""
    if reactor is None:
        from twisted.internet import reactor
    set_log_level(settings.log_level)
    try:
        check_http_auth(settings)
        # Read once (its file too): the lookupd /channels queries' bearer secret.
        secret = http_client_auth_secret(settings)
        tls = server_tls(settings)
    except ConfigError as e:
        print(f"mqd: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    broker = Broker(settings, clock=reactor)
    top = service.MultiService()
    BrokerService(broker).setServiceParent(top)
    QueueScanner(broker).setServiceParent(top)
    # Keeps the cyclic GC from traversing the whole backlog at every 25% of growth.
    GCPolicy(reactor).setServiceParent(top)
    # Bound ports by listener, filled in as they start: the broker's own (IDENTIFY names its HTTP port).
    ports = broker.ports
    backlog = settings.listen_backlog
    # What the HTTP API keeps between requests: one for both sites, so
    # their bounds (peek memory, snapshot admissions) are the broker's.
    http_state = HttpState(broker.auth, reactor)
    tcp = listen_endpoint(reactor, settings.tcp_address, backlog)
    ListeningService("TCP", tcp, V2Factory(broker, tls=tls), ports, reactor,
                     settings.tcp_address).setServiceParent(top)
    if settings.http_address:
        http = listen_endpoint(reactor, settings.http_address, backlog)
        site = NsqdSite(broker, ports, reactor, state=http_state,
                        tls_required=tls is not None and tls.http_required)
        ListeningService("HTTP", http, site, ports, reactor,
                         settings.http_address).setServiceParent(top)
    if tls is not None and settings.https_address:
        # The same API over TLS; the TLS layer wraps the site's factory, so
        # any endpoint form (host:port, unix socket) works as for HTTP.
        from twisted.protocols.tls import TLSMemoryBIOFactory

        https = listen_endpoint(reactor, settings.https_address, backlog)
        https_site = TLSMemoryBIOFactory(tls, False, NsqdSite(broker, ports, reactor, state=http_state))
        https_site.noisy = False
        ListeningService("HTTPS", https, https_site, ports, reactor,
                         settings.https_address).setServiceParent(top)
    # After the listeners, so IDENTIFY can announce the ports they bound;
    # always present, as lookupds can be added at run time (PUT /config).
    LookupService(broker, ports, reactor, secret=secret).setServiceParent(top)
    if settings.statsd_address:
        # Last, so it stops first: its final datagrams go out before the broker closes.
        StatsdService(broker, ports, reactor).setServiceParent(top)
    return top


# Test-only (docs/testing.md), not an operator setting: the broker's clock moved by this
# many seconds (the reactor's time, which message ids and timestamps are
# made of), so the suite can restart a real broker with its clock stepped
# back, as NTP or a VM migration would (faketime is not available
# everywhere).
CLOCK_OFFSET_ENV = "MQD_TEST_CLOCK_OFFSET"


def offset_clock(reactor) -> None:
    """Move the reactor's time by $MQD_TEST_CLOCK_OFFSET seconds, if set (tests only)."""
    offset = float(os.environ.get(CLOCK_OFFSET_ENV) or 0)
    if offset:
        real = reactor.seconds
        reactor.seconds = lambda: real() + offset


def makeService(options: usage.Options) -> service.MultiService:
    from twisted.internet import reactor

    offset_clock(reactor)
    return build_service(settings_from(options, MQD_OPTIONS, "mqd"), reactor)
