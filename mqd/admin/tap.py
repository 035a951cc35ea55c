"""`twistd mqadmin`: command-line options and the service tree of the cluster's web admin.

The options come from the same machinery as the other daemons' (mqd.tap):
nsqadmin's flag names, the YAML file, flag > file > default; only the
table differs (MQADMIN_OPTIONS). What no single option can say (lookupds
or brokers, not both; a client certificate with its key) is checked once
everything is resolved, with nsqadmin's words.
"""

from __future__ import annotations

import sys

from twisted.application import service
from twisted.python import usage

from mqd.admin.endpoint import Admin
from mqd.admin.history import History, sampler
from mqd.admin.notify import Notifier
from mqd.admin.web import AdminSite
from mqd.clusterinfo.bearer import bearer_headers
from mqd.clusterinfo.cluster import Cluster
from mqd.clusterinfo.upstream import Authorized, Upstream
from mqd.logs import set_log_level
from mqd.options import MQADMIN_OPTIONS, ConfigError, Settings, http_client_auth_secret
from mqd.service import ListeningService, listen_endpoint
from mqd.tap import make_options_class, settings_from

__all__ = ["AdminService", "Options", "UpstreamService", "auth_secret", "build_service", "check_settings",
           "makeService"]

Options = make_options_class(MQADMIN_OPTIONS, "mqadmin")


def check_settings(settings: Settings) -> None:
    """nsqadmin's start-up checks across options (`nsqadmin.New`), raising ConfigError with its text."""
    lookupds, nsqds = settings.lookupd_http_address, settings.nsqd_http_address
    if not lookupds and not nsqds:
        raise ConfigError("--nsqd-http-address or --lookupd-http-address required")
    if lookupds and nsqds:
        raise ConfigError("use --nsqd-http-address or --lookupd-http-address not both")
    if settings.http_client_tls_cert and not settings.http_client_tls_key:
        raise ConfigError("--http-client-tls-key must be specified with --http-client-tls-cert")
    if settings.http_client_tls_key and not settings.http_client_tls_cert:
        raise ConfigError("--http-client-tls-cert must be specified with --http-client-tls-key")
    if settings.stats_history < settings.stats_interval:
        raise ConfigError(f"--stats-history ({settings.stats_history:g}s) must be at least "
                          f"--stats-interval ({settings.stats_interval:g}s)")


def auth_secret(settings: Settings) -> str:
    """The secret for brokers and lookupds: --http-client-auth-secret, or the file of --http-client-auth-secret-file.

    Read once, at start-up: a missing file or a secret no header can carry
    stops mqadmin there, with a line that never shows the secret.
    """
    return http_client_auth_secret(settings)


class AdminService(service.MultiService):
    """mqadmin's service tree, with its `Admin` and bound port for tests."""

    admin: Admin
    ports: dict[str, int]


class UpstreamService(service.Service):
    """Closes the kept-alive connections to lookupds and brokers when mqadmin stops."""

    name = "upstream"

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def stopService(self):
        super().stopService()
        return self.upstream.close()


def build_service(settings: Settings, reactor=None) -> AdminService:
    """The upstream client, the history sampler, then the HTTP listener (so it stops first), over one `Admin`.

    The context is reachable as `.admin` and the bound port in
    `.ports["HTTP"]` once listening, for tests.
    """
    if reactor is None:
        from twisted.internet import reactor
    try:
        check_settings(settings)
        secret = auth_secret(settings)
        # Reads the TLS client files: a bad one stops start-up here.
        upstream = Upstream(reactor, settings)
    except ConfigError as e:
        print(f"mqadmin: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    set_log_level(settings.log_level)
    # Brokers and lookupds get the secret; the notification endpoint, a third party, never does.
    brokers = Authorized(upstream, bearer_headers(secret)) if secret else upstream
    cluster = Cluster(brokers, settings.lookupd_http_address, settings.nsqd_http_address)
    history = History(reactor, settings.stats_interval, settings.stats_history, sampler(cluster))
    admin = Admin(settings, reactor, upstream=brokers, cluster=cluster, history=history,
                  notifier=Notifier(upstream, settings, clock=reactor))
    ports: dict[str, int] = {}
    top = AdminService()
    top.admin = admin
    top.ports = ports
    # First, so it stops last: the cached upstream connections close once nothing uses them.
    UpstreamService(upstream).setServiceParent(top)
    history.setServiceParent(top)
    http = listen_endpoint(reactor, settings.http_address, settings.listen_backlog)
    ListeningService("HTTP", http, AdminSite(admin), ports, reactor,
                     settings.http_address).setServiceParent(top)
    return top


def makeService(options: usage.Options) -> service.MultiService:
    return build_service(settings_from(options, MQADMIN_OPTIONS, "mqadmin"))
