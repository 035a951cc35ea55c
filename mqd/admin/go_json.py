"""Request bodies read as Go's json.Decoder reads them, so mqadmin answers bad JSON with nsqadmin's texts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["GoJSONError", "decode_go_object", "go_kind"]


class GoJSONError(ValueError):
    """A body Go's json.Decoder refuses; str() is Go's error text, which nsqadmin answers."""


_GO_SPACE = " \t\r\n"
_CONTEXTS = {
    "Expecting value": "looking for beginning of value",
    "Expecting property name enclosed in double quotes": "looking for beginning of object key string",
    "Expecting ':' delimiter": "after object key",
    "Expecting ',' delimiter": "after object key:value pair",
    "Invalid control character at": "in string literal",
    "Invalid \\escape": "in string escape code",
}


def _go_char(c: str) -> str:
    """Go's quoteChar: how a json syntax error names the character."""
    if c == "'":
        return "'\\''"
    if c == '"':
        return "'\"'"
    return "'" + json.dumps(c)[1:-1] + "'"


def go_kind(value: Any) -> str:
    """What Go's encoding/json calls a decoded JSON value's kind in its errors (null aside)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _reject_constant(name: str) -> Any:
    raise GoJSONError(f"invalid character {_go_char(name[0])} looking for beginning of value")


def decode_go_object(raw: bytes, fields: Sequence[str]) -> dict[str, str]:
    """`fields` (all Go strings) of the first JSON value in `raw`, read as Go's json.Decoder reads a struct.

    Keys match exactly or, failing that, case-insensitively; unknown keys and
    what follows the first value are ignored; a missing field or a null is
    "". Raises GoJSONError with Go's text (`EOF`, `unexpected EOF`,
    `invalid character 'x' looking for beginning of value`, `json: cannot
    unmarshal number into Go struct field .topic of type string`) otherwise.
    """
    text = raw.decode("utf-8", "replace").lstrip(_GO_SPACE)
    if not text:
        raise GoJSONError("EOF")
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    try:
        value, _ = decoder.raw_decode(text)
    except json.JSONDecodeError as e:
        if e.pos >= len(text) or e.msg.startswith("Unterminated"):
            raise GoJSONError("unexpected EOF") from None
        context = next((c for m, c in _CONTEXTS.items() if e.msg.startswith(m)), _CONTEXTS["Expecting value"])
        raise GoJSONError(f"invalid character {_go_char(text[e.pos])} {context}") from None
    out = dict.fromkeys(fields, "")
    if value is None:
        return out
    if not isinstance(value, dict):
        struct = "; ".join(f'{f.capitalize()} string "json:\\"{f}\\""' for f in fields)
        raise GoJSONError(f"json: cannot unmarshal {go_kind(value)} into Go value of type struct {{ {struct} }}")
    first_error = None
    for key, item in value.items():
        name = key if key in out else next((f for f in fields if f.lower() == key.lower()), None)
        if name is None or item is None:
            continue
        if not isinstance(item, str):
            first_error = first_error or GoJSONError(
                f"json: cannot unmarshal {go_kind(item)} into Go struct field .{name} of type string")
            continue
        out[name] = item
    if first_error is not None:
        raise first_error
    return out
