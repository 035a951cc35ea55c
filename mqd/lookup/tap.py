"""`twistd mqlookupd`: command-line options and the service tree of a lookup daemon.

The options come from the same machinery as the broker's (mqd.tap), so
flags, the YAML file and their precedence (flag > file > default) work the
same way; only the table differs (nsqlookupd's, LOOKUPD_OPTIONS).
"""

from __future__ import annotations

import sys

from twisted.application import service
from twisted.python import usage

from mqd.http.auth import AuthClient
from mqd.http.authorization import AuthCache
from mqd.logs import set_log_level
from mqd.lookup.http import LookupdSite
from mqd.lookup.protocol import LookupdFactory
from mqd.lookup.registry import RegistrationDB
from mqd.options import LOOKUPD_OPTIONS, ConfigError, Settings, check_http_auth
from mqd.service import ListeningService, listen_endpoint
from mqd.tap import make_options_class, settings_from

__all__ = ["LookupdService", "Options", "build_service", "makeService"]

Options = make_options_class(LOOKUPD_OPTIONS, "mqlookupd")


class LookupdService(service.MultiService):
    """A lookup daemon's service tree, with its registration DB and bound ports for tests."""

    db: RegistrationDB
    ports: dict[str, int]


def build_service(settings: Settings, reactor=None) -> LookupdService:
    """The two listeners over one in-memory registration DB (nothing is persisted).

    The DB is reachable as `.db` for tests; the bound ports fill `.ports`
    ("TCP", "HTTP") once listening, and IDENTIFY reports them.
    """
    if reactor is None:
        from twisted.internet import reactor
    set_log_level(settings.log_level)
    try:
        check_http_auth(settings)
    except ConfigError as e:
        print(f"mqlookupd: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    # --http-auth-required: the auth server's answers for bearer secrets, as the broker keeps them.
    auth = AuthCache(AuthClient(settings, reactor), reactor) if settings.http_auth_required else None
    db = RegistrationDB(reactor, settings.inactive_producer_timeout, settings.tombstone_lifetime)
    ports: dict[str, int] = {}
    top = LookupdService()
    top.db = db
    top.ports = ports
    tcp = listen_endpoint(reactor, settings.tcp_address, settings.listen_backlog)
    factory = LookupdFactory(db, settings.broadcast_address, ports)
    ListeningService("TCP", tcp, factory, ports, reactor,
                     settings.tcp_address).setServiceParent(top)
    http = listen_endpoint(reactor, settings.http_address, settings.listen_backlog)
    ListeningService("HTTP", http, LookupdSite(db, reactor, auth=auth), ports, reactor,
                     settings.http_address).setServiceParent(top)
    return top


def makeService(options: usage.Options) -> service.MultiService:
    return build_service(settings_from(options, LOOKUPD_OPTIONS, "mqlookupd"))
