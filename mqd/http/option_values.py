"""Options as nsqd's /config shows and takes them, for the broker and for mqadmin.

The broker answers `/config/:opt` with these values; mqadmin shows a
broker's options and sends it changes in the same forms, so both use the
one set of conversions: durations as integer nanoseconds, lists as
arrays, the log level as nsqd's number (1 debug .. 5 fatal).
"""

from __future__ import annotations

import json
from typing import Any

from mqd.http.response import ApiError, nanoseconds
from mqd.logs import LEVELS
from mqd.options import Option

__all__ = ["addresses_of", "config_name", "log_level_of", "option_value"]

# nsqd's lg.LogLevel numbers, which /config/log_level reports.
_LOG_LEVEL_NUMBERS = {name: i for i, name in enumerate(LEVELS, start=1)}


def config_name(opt: Option) -> str:
    """The name nsqd's config file (and /config) uses for an option."""
    return opt.aliases[0] if opt.aliases else opt.attr


def option_value(opt: Option, settings: object) -> Any:
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
