"""Errors that cross the protocol boundary, carrying nsqd's code and fatality.

Commands raise them wherever they find a problem; the protocol turns them
into an error frame (and, when fatal, a closed connection) in one place.
Also here: reading client input the way nsqd's Go does, so that the same
input is an error (and the same error) in both (`go_quote`, `GoStruct`).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, cast

__all__ = ["GO_REPLACE", "ProtocolError", "fatal", "nonfatal", "go_fold", "go_int_literal", "go_quote", "go_refused",
           "go_string", "GoStruct"]


class ProtocolError(Exception):
    def __init__(self, code: str, description: str = "", is_fatal: bool = True) -> None:
        super().__init__(code, description)
        self.code = code
        self.description = description
        self.fatal = is_fatal

    @property
    def payload(self) -> bytes:
        """The error frame's text: 'CODE description', as nsqd's ClientErr prints."""
        text = f"{self.code} {self.description}" if self.description else self.code
        return text.encode("utf-8", "surrogateescape")

    def __str__(self) -> str:
        return self.payload.decode("utf-8", "replace")


def fatal(code: str, description: str = "") -> ProtocolError:
    return ProtocolError(code, description, True)


def nonfatal(code: str, description: str = "") -> ProtocolError:
    return ProtocolError(code, description, False)


_GO_ESCAPES = {
    0x07: "\\a", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n",
    0x0D: "\\r", 0x09: "\\t", 0x0B: "\\v", 0x5C: "\\\\", 0x22: '\\"',
}


def go_refused(address: str) -> str:
    """Go's error for a TCP connection refused at `address` (`host:port`, IPv6 bracketed), as NSQ's tools print it."""
    return f"dial tcp {address}: connect: connection refused"


def go_quote(raw: bytes) -> str:
    """Go's %q of a byte string, which nsqd uses to echo bad topic and channel names."""
    out = ['"']
    text = raw.decode("utf-8", "surrogateescape")
    for ch in text:
        code = ord(ch)
        if code in _GO_ESCAPES:
            out.append(_GO_ESCAPES[code])
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that was not valid UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif code < 0x80 or ch.isprintable():
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


# -- JSON as Go's encoding/json decodes it into a struct ------------------------------------

_INT_RANGES = {"int": (-(1 << 63), (1 << 63) - 1), "int32": (-(1 << 31), (1 << 31) - 1)}
_GO_ZERO = {"string": "", "bool": False, "int": 0, "int32": 0}
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Go's foldName: ASCII letters upper-cased, other runes to the smallest of their
# case-fold orbit; only these two non-ASCII runes fold onto an ASCII letter.
_GO_FOLD: dict[int, int | str] = {**{c: c - 32 for c in range(ord("a"), ord("z") + 1)}, 0x017F: "S", 0x212A: "K"}


class _Object(list[Any]):
    """A decoded JSON object: its (key, value) members in order, repeats kept, as Go walks them."""

    __slots__ = ()


def go_string(value: str) -> str:
    """`value` as a Go string decoded from JSON holds it: each lone surrogate is U+FFFD.

    Python's JSON decoder keeps an unpaired `\\ud800` escape as a surrogate,
    which no UTF-8 encoder writes: one in a client's or auth server's string
    made /stats fail for everyone. Go's decoder replaces it, so nsqd shows
    U+FFFD. ASCII, nearly every string here, is returned as is.
    """
    return value if value.isascii() else _LONE_SURROGATE.sub("\ufffd", value)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def go_fold(key: str) -> str:
    """A JSON key as Go's decoder compares it with a field's name when no name matches exactly."""
    return key.translate(_GO_FOLD)


def go_int_literal(text: str) -> int | float:
    """A JSON integer literal: an int, or a float (as Go's float64 takes it) past int64's 20 characters.

    JSON has no leading zeros, so a longer literal fits no Go integer; as an
    int it would cost Python's 4300-digit limit (a ValueError out of the
    decoder) for a value Go only skips when no field takes it.
    """
    return int(text) if len(text) <= 20 else float(text)


def _go_replace(error: UnicodeDecodeError) -> tuple[str, int]:
    """Go's decoder turns each byte that is not UTF-8 into one U+FFFD."""
    return "\ufffd" * (error.end - error.start), error.end


# The error handler to decode JSON bytes with, as Go reads them (`raw.decode("utf-8", GO_REPLACE)`).
GO_REPLACE = "mqd.go_replace"
# cast: typeshed types every error handler for UnicodeError; this one decodes only.
codecs.register_error(GO_REPLACE, cast(Callable[[UnicodeError], tuple[str, int]], _go_replace))

_DECODER = json.JSONDecoder(object_pairs_hook=_Object, parse_int=go_int_literal,
                            parse_constant=_reject_constant)


class GoStruct:
    """The JSON fields of a Go struct, decoded as json.Unmarshal fills it.

    `fields` maps each JSON name to its Go kind: "string", "bool", "int"
    (int64) or "int32". What Go rejects raises ValueError: invalid JSON
    (NaN, a byte order mark, nesting too deep for Python), a top level that
    is neither an object nor null, a value of the wrong kind for a field (a
    float literal such as 1000.0 or 1e3 for an int, a number out of range).
    Other keys are skipped, keys match case-insensitively (the last match
    wins), and null leaves a field alone; the result is the whole struct,
    a field not set holding its Go zero value, as in a fresh struct.
    """

    __slots__ = ("_by_folded", "_zero")

    def __init__(self, fields: Mapping[str, str]) -> None:
        self._by_folded = {go_fold(name): (name, kind) for name, kind in fields.items()}
        self._zero = {name: _GO_ZERO[kind] for name, kind in fields.items()}

    def unmarshal(self, raw: bytes) -> dict[str, Any]:
        try:
            decoded = _DECODER.decode(raw.decode("utf-8", GO_REPLACE))
        except RecursionError:
            # Go gives up at 10000 levels; Python's limit comes first.
            raise ValueError("JSON nested too deep") from None
        fields = dict(self._zero)
        if decoded is None:
            return fields
        if not isinstance(decoded, _Object):
            raise ValueError("not a JSON object")
        by_folded = self._by_folded
        for key, value in decoded:
            field = by_folded.get(go_fold(key))
            if field is None or value is None:
                continue
            name, kind = field
            fields[name] = _go_value(name, kind, value)
        return fields


def _go_value(name: str, kind: str, value: Any) -> Any:
    if kind == "string":
        if not isinstance(value, str):
            raise ValueError(f"{name}: not a string")
        return go_string(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name}: not a bool")
        return value
    low, high = _INT_RANGES[kind]
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name}: not an {kind}")
    return value
