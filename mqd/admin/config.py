"""mqadmin's `GET/PUT /config/:opt`, as nsqadmin's, for clients in --allow-config-from-cidr only."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from mqd.admin.endpoint import AdminEndpoint, ApiError
from mqd.http.endpoint import read_body
from mqd.http.option_values import addresses_of, config_name, log_level_of, option_value
from mqd.logs import get_logger, set_log_level
from mqd.options import MQADMIN_OPTIONS
from mqd.peers import peer_host

__all__ = ["AdminConfig"]

log = get_logger(__name__)

# nsqadmin reads at most this much of a PUT /config body (1 MiB, plus one byte to tell "more").
_CONFIG_READ_MAX = 1024 * 1024 + 1

# A secret is not an option /config shows (nor sets): asking for it is 400 INVALID_OPTION.
_OPTIONS = {config_name(opt): opt for opt in MQADMIN_OPTIONS if not opt.attr.endswith("_secret")}


def _client_ip(request: Request) -> str:
    """The client's IP as nsqadmin parses it from req.RemoteAddr: IPv4 clients of a dual-stack listener as IPv4."""
    return peer_host(request.getClientAddress())


class AdminConfig(AdminEndpoint):
    """nsqadmin's `GET/PUT /config/:opt`, for clients in --allow-config-from-cidr only.

    GET answers any option by its config-file name, as nsqd's /config does
    (durations in nanoseconds, lists as arrays, log_level as a number);
    PUT changes `nsqlookupd_http_addresses` (a JSON array: the lookupds
    asked from the next request on) or `log_level` (a level name).
    """

    def allowed(self, request: Request) -> None:
        cidr = self.admin.settings.allow_config_from_cidr
        if not cidr:
            return
        host = _client_ip(request)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            log.error("failed to parse RemoteAddr {addr}", addr=request.getClientAddress())
            raise ApiError(400, "INVALID_REMOTE_ADDR") from None
        network = ipaddress.ip_network(cidr, strict=False)
        if ip not in network:
            raise ApiError(403, "FORBIDDEN")

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        self.allowed(request)
        return self.value(params["opt"])

    def handle_PUT(self, request: Request, params: Mapping[str, str]) -> Any:
        self.allowed(request)
        name = params["opt"]
        body = read_body(request, _CONFIG_READ_MAX)
        declared = request.getHeader(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) >= _CONFIG_READ_MAX
        if not body or too_big or len(body) >= _CONFIG_READ_MAX:
            raise ApiError(413, "INVALID_VALUE")
        admin = self.admin
        if name == "nsqlookupd_http_addresses":
            try:
                addresses = _OPTIONS[name].parse(addresses_of(body))
            except ValueError:
                raise ApiError(400, "INVALID_VALUE") from None
            admin.settings = admin.settings.replace(lookupd_http_address=addresses)
            if admin.cluster is not None:
                admin.cluster.lookupds = list(addresses)
            log.info("lookupd HTTP addresses now {addresses}", addresses=addresses)
        elif name == "log_level":
            level = log_level_of(body)
            set_log_level(level)
            admin.settings = admin.settings.replace(log_level=level)
        else:
            raise ApiError(400, "INVALID_OPTION")
        return self.value(name)

    def value(self, name: str) -> Any:
        opt = _OPTIONS.get(name)
        if opt is None:
            raise ApiError(400, "INVALID_OPTION")
        return option_value(opt, self.admin.settings)
