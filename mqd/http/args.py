"""Query-string arguments, read the way nsqd reads them.

nsqd parses the query with Go's `url.ParseQuery` and answers
`400 INVALID_REQUEST` when that fails, so a request Python's parser would
accept (`?topic=a;b`, `?topic=%zz`) must fail here too. A parameter given
twice counts by its first value, as Go's `Values.Get` does.
"""

from __future__ import annotations

import re
from typing import overload
from urllib.parse import unquote_to_bytes

from twisted.web.server import Request

from mqd.http.response import ApiError
from mqd.names import is_valid_name

__all__ = [
    "BAD_ESCAPE",
    "DEFAULT_PEEK",
    "MAX_PEEK",
    "Query",
    "count_arg",
    "go_parse_bool",
    "max_body_arg",
    "parse_query",
    "positive_arg",
    "query_of",
    "state_arg",
    "topic_arg",
    "topic_channel_args",
]

# A `%` not followed by two hex digits: what Go refuses to unescape.
BAD_ESCAPE = re.compile(rb"%(?![0-9a-fA-F]{2})")

# strconv.ParseBool's spellings.
_GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


class Query(dict[str, list[str]]):
    """Parsed query parameters: name → every value, in order."""

    def first(self, key: str) -> str | None:
        """The first value of `key`, or None when it is absent (Go's `Values.Get` with `ok`)."""
        values = self.get(key)
        return values[0] if values else None


def _unescape(raw: bytes) -> str:
    """Go's QueryUnescape: '+' is a space; a '%' without two hex digits is an error."""
    if BAD_ESCAPE.search(raw):
        raise ValueError(f"invalid URL escape in {raw!r}")
    # Go strings are bytes: keep any byte, names with odd ones fail validation later.
    return unquote_to_bytes(raw.replace(b"+", b" ")).decode("utf-8", "surrogateescape")


def parse_query(raw: bytes) -> Query:
    """Go's url.ParseQuery: fields split on '&', a ';' in a field is an error."""
    query = Query()
    error = None
    for field in raw.split(b"&"):
        if b";" in field:
            error = error or ValueError("invalid semicolon separator in query")
            continue
        if not field:
            continue
        key, _, value = field.partition(b"=")
        try:
            query.setdefault(_unescape(key), []).append(_unescape(value))
        except ValueError as e:
            error = error or e
    if error is not None:
        raise error
    return query


def query_of(request: Request) -> Query:
    """The request's query, or `400 INVALID_REQUEST` if Go could not parse it."""
    _, _, raw = request.uri.partition(b"?")
    try:
        return parse_query(raw)
    except ValueError:
        raise ApiError(400, "INVALID_REQUEST") from None


def go_parse_bool(value: str) -> bool | None:
    """strconv.ParseBool, None where Go returns an error."""
    if value in _GO_TRUE:
        return True
    if value in _GO_FALSE:
        return False
    return None


def topic_arg(query: Query, invalid: str | None = "INVALID_TOPIC") -> str:
    """`topic`: 400 MISSING_ARG_TOPIC when absent, 400 `invalid` when not a valid name.

    `invalid=None` skips the name check, as nsqd's delete and pause handlers
    do (an invalid name is then simply not found).
    """
    name = query.first("topic")
    if name is None:
        raise ApiError(400, "MISSING_ARG_TOPIC")
    if invalid is not None and not is_valid_name(name):
        raise ApiError(400, invalid)
    return name


def topic_channel_args(query: Query, invalid_topic: str = "INVALID_ARG_TOPIC",
                       invalid_channel: str = "INVALID_ARG_CHANNEL") -> tuple[str, str]:
    """`topic` and `channel` for the /channel/* endpoints (nsqd's GetTopicChannelArgs).

    Their error texts differ from /pub's and /topic/*'s: INVALID_ARG_TOPIC,
    not INVALID_TOPIC (mqd's own /channel/replay passes the latter).
    """
    topic = topic_arg(query, invalid_topic)
    channel = query.first("channel")
    if channel is None:
        raise ApiError(400, "MISSING_ARG_CHANNEL")
    if not is_valid_name(channel):
        raise ApiError(400, invalid_channel)
    return topic, channel


# Peek arguments (the broker's /channel/peek and /topic/peek, and mqadmin's
# proxy of them, which checks them the same way before asking any broker).
DEFAULT_PEEK = 20
MAX_PEEK = 1000
_DIGITS = re.compile(r"[0-9]+")


def _digits_value(raw: str) -> int:
    """The value of a string of digits, at most 10**18: more is "beyond any bound" here.

    Python refuses to convert strings of over 4,300 digits (and a long one
    costs quadratic time), so a number that long is not converted at all.
    """
    digits = raw.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else 10**18


def positive_arg(query: Query, key: str, default: int, cap: int, invalid: str) -> int:
    """A positive integer argument, `default` when absent, at most `cap`; 400 `invalid` otherwise."""
    raw = query.first(key)
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw) or _digits_value(raw) <= 0:
        raise ApiError(400, invalid)
    return min(_digits_value(raw), cap)


def count_arg(query: Query) -> int:
    """`n`: how many to answer, at most MAX_PEEK; 400 INVALID_N unless a positive integer."""
    return positive_arg(query, "n", DEFAULT_PEEK, MAX_PEEK, "INVALID_N")


def state_arg(query: Query, allowed: tuple[str, ...]) -> str:
    state = query.first("state")
    if state is None:
        return "queued"
    if state not in allowed:
        raise ApiError(400, "INVALID_STATE")
    return state


@overload
def max_body_arg(query: Query, cap: int) -> int: ...
@overload
def max_body_arg(query: Query, cap: None) -> int | None: ...
def max_body_arg(query: Query, cap: int | None) -> int | None:
    """`max_body`: bytes of each body to show, at most `cap`; 400 INVALID_MAX_BODY unless a number.

    Absent, it is `cap` (None when the caller has none: mqadmin passes the
    brokers' own cap on by saying nothing).
    """
    raw = query.first("max_body")
    if raw is None:
        return cap
    if not _DIGITS.fullmatch(raw):
        raise ApiError(400, "INVALID_MAX_BODY")
    value = _digits_value(raw)
    return value if cap is None else min(value, cap)
