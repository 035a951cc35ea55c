"""`GET /config/:opt` and `PUT /config/:opt`: read any option, change the run-time ones.

Options are named as in nsqd's config file: the flag name with `-` → `_`,
or the option's nsqd config-file spelling where it has one (`id` for
`--node-id`, `nsqlookupd_tcp_addresses`). Values are shown as nsqd shows
them, because tools compare them with nsqd's: durations as integer
nanoseconds, lists as arrays, the log level as nsqd's number (1 debug ..
5 fatal), and a string option as raw text (nsqd's V1 answer sends any
string result unquoted, so `GET /config/broadcast_address` is `host`, not
`"host"`).

A few options nsqd resolves at start-up, and its /config shows resolved:
`broadcast_tcp_port` and `broadcast_http_port` left at 0 are the bound
ports, `statsd_prefix` has its `%s` filled in (and a trailing `.`),
`tls_required` is Go's number (0 not required, 1 all but HTTPS, 2 all;
a client-auth policy makes it 2) and `tls_min_version` Go's constant
(769 for TLS 1.0 .. 772 for TLS 1.3).

`http_client_auth_secret` is not shown (400 `INVALID_OPTION`, as for an
unknown name); its `_file` is, being a path.

Only `nsqlookupd_tcp_addresses` (a JSON array) and `log_level` (a level
name as plain text) can be changed; the change goes through
`Broker.update_options`, the one place run-time changes are made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from mqd.http.endpoint import Endpoint, read_body
from mqd.http.option_values import addresses_of, config_name, log_level_of, option_value
from mqd.http.response import ApiError
from mqd.nsqd.lookup_peer import broadcast_port
from mqd.nsqd.statsd import prefix_of
from mqd.nsqd.tlsconfig import tls_required_of
from mqd.options import MQD_OPTIONS

__all__ = ["Config"]

# A secret is not an option /config shows (nor sets): asking for it is 400 INVALID_OPTION.
_BY_CONFIG_NAME = {config_name(opt): opt for opt in MQD_OPTIONS if not opt.attr.endswith("_secret")}

# Go's tls.VersionTLS10 .. VersionTLS13, and nsqd's TLSNotRequired,
# TLSRequiredExceptHTTP, TLSRequired.
_TLS_VERSIONS = {"tls1.0": 0x0301, "tls1.1": 0x0302, "tls1.2": 0x0303, "tls1.3": 0x0304}
_TLS_REQUIRED = {"false": 0, "tcp-https": 1, "true": 2}


class Config(Endpoint):
    """`/config/:opt`; unknown names answer `400 INVALID_OPTION`."""

    def __init__(self, broker: Any, ports: Mapping[str, int]) -> None:
        super().__init__(broker)
        # Bound ports, filled in once the listeners are up (port 0 picks one).
        self.ports = ports

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        return self.value(params["opt"])

    def handle_PUT(self, request: Request, params: Mapping[str, str]) -> Any:
        name = params["opt"]
        # Body limits first, whatever the option: nsqd reads the body before the switch.
        limit = self.broker.options.max_msg_size + 1
        body = read_body(request, limit)
        if not body or len(body) == limit:
            raise ApiError(413, "INVALID_VALUE")
        changes: dict[str, Any]
        if name == "nsqlookupd_tcp_addresses":
            changes = {"lookupd_tcp_address": addresses_of(body)}
        elif name == "log_level":
            changes = {"log_level": log_level_of(body)}
        else:
            raise ApiError(400, "INVALID_OPTION")
        try:
            self.broker.update_options(**changes)
        except ValueError:
            raise ApiError(400, "INVALID_VALUE") from None
        return self.value(name)

    def value(self, name: str) -> Any:
        """The option's current value, as nsqd's JSON shows it."""
        opt = _BY_CONFIG_NAME.get(name)
        if opt is None:
            raise ApiError(400, "INVALID_OPTION")
        options = self.broker.options
        if name == "broadcast_tcp_port":
            return broadcast_port(options, self.ports, "TCP")
        if name == "broadcast_http_port":
            return broadcast_port(options, self.ports, "HTTP")
        if name == "statsd_prefix":
            return prefix_of(options, self.ports)
        if name == "tls_required":
            return _TLS_REQUIRED[tls_required_of(options)]
        if name == "tls_min_version":
            return _TLS_VERSIONS[options.tls_min_version]
        return option_value(opt, options)
