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

import json
from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from ..logs import LEVELS
from ..options import MQD_OPTIONS, Option
from .endpoint import Endpoint, read_body
from .response import ApiError
from .status import nanoseconds

__all__ = ["Config", "addresses_of", "config_name", "log_level_of", "option_value"]

# nsqd's lg.LogLevel numbers, which /config/log_level reports.
_LOG_LEVEL_NUMBERS = {name: i for i, name in enumerate(LEVELS, start=1)}


def config_name(opt: Option) -> str:
    """The name nsqd's config file (and /config) uses for an option."""
    return opt.aliases[0] if opt.aliases else opt.attr


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


def option_value(opt: Option, settings) -> Any:
    """An option's value as nsqd's (and nsqadmin's) /config JSON shows it.

    Durations in nanoseconds, lists as arrays, the log level as Go's
    number (1 debug .. 5 fatal).
    """
    value = getattr(settings, opt.attr)
    if opt.attr == "log_level":
        return _LOG_LEVEL_NUMBERS[value]
    if opt.kind == "duration":
        return nanoseconds(value)
    if opt.kind == "list":
        return list(value)
    return value


def addresses_of(body: bytes) -> list[str]:
    """A PUT of an address list: a JSON []string (null is empty), else 400 INVALID_VALUE."""
    try:
        addresses = json.loads(body)
    except (ValueError, RecursionError):
        # Go's decoder stops at 10000 levels, Python's before: either way not a []string.
        raise ApiError(400, "INVALID_VALUE") from None
    if addresses is None:
        return []
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        raise ApiError(400, "INVALID_VALUE")
    return addresses


def log_level_of(body: bytes) -> str:
    """A PUT /config/log_level body: Go's ParseLogLevel is case-insensitive and trims nothing."""
    level = body.decode("utf-8", "replace").lower()
    if level not in LEVELS:
        raise ApiError(400, "INVALID_VALUE")
    return level
