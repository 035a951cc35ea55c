"""`GET /config/:opt` and `PUT /config/:opt`: read any option, change the run-time ones.

Options are named as in nsqd's config file: the flag name with `-` → `_`,
or the option's nsqd config-file spelling where it has one (`id` for
`--node-id`, `nsqlookupd_tcp_addresses`). Values are shown as nsqd shows
them, because tools compare them with nsqd's: durations as integer
nanoseconds, lists as arrays, the log level as nsqd's number (1 debug ..
5 fatal), and a string option as raw text (nsqd's V1 answer sends any
string result unquoted, so `GET /config/broadcast_address` is `host`, not
`"host"`).

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
from mqd.options import MQD_OPTIONS

__all__ = ["Config"]

_BY_CONFIG_NAME = {config_name(opt): opt for opt in MQD_OPTIONS}


class Config(Endpoint):
    """`/config/:opt`; unknown names answer `400 INVALID_OPTION`."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        return self.value(params["opt"])

    def handle_PUT(self, request: Request, params: Mapping[str, str]) -> Any:
        name = params["opt"]
        # Body limits first, whatever the option: nsqd reads the body before the switch.
        limit = self.broker.options.max_msg_size + 1
        body = read_body(request, limit)
        if not body or len(body) == limit:
            raise ApiError(413, "INVALID_VALUE")
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
        return option_value(opt, self.broker.options)
