"""Request bodies read as Go's json.Decoder reads them, so mqadmin answers bad JSON with nsqadmin's texts."""

from __future__ import annotations

import json
import string
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


_LITERALS = {"n": "null", "t": "true", "f": "false"}


def _value_error(text: str, pos: int) -> str | None:
    """Go's scanner error for a value that starts like a literal or a number and goes wrong, or None.

    Python's decoder names the value's first character; Go's scanner reads
    on and names the first character that cannot continue it (`not` is
    `invalid character 'o' in literal null (expecting 'u')`), or says
    `unexpected EOF` when the input ends inside it.
    """
    first = text[pos]
    literal = _LITERALS.get(first)
    if literal is not None:
        for expected, got in zip(literal, text[pos:], strict=False):  # the text may end early
            if got != expected:
                return f"invalid character {_go_char(got)} in literal {literal} (expecting {_go_char(expected)})"
        return "unexpected EOF" if len(text) - pos < len(literal) else None
    if first == "-":
        after = text[pos + 1:pos + 2]
        if not after:
            return "unexpected EOF"
        if not after.isdigit():
            return f"invalid character {_go_char(after)} in numeric literal"
    return None


_DIGITS = "0123456789"


def _number_tail_error(text: str, pos: int) -> str | None:
    """Go's error for a number whose `.` or exponent at `pos` is not followed by digits, or None.

    Python's decoder ends the number before such a tail (`1.` is 1, then a
    stray `.`); Go's scanner reads into it: `1.` is `unexpected EOF`, `1.x`
    `invalid character 'x' after decimal point in numeric literal`, `1e+x`
    `... in exponent of numeric literal`.
    """
    if pos == 0 or text[pos - 1] not in _DIGITS or pos >= len(text):
        return None
    if text[pos] == ".":
        nxt, where = text[pos + 1:pos + 2], "after decimal point in"
    elif text[pos] in "eE":
        i = pos + 2 if text[pos + 1:pos + 2] in ("+", "-") else pos + 1
        nxt, where = text[i:i + 1], "in exponent of"
    else:
        return None
    if not nxt:
        return "unexpected EOF"
    if nxt not in _DIGITS:
        return f"invalid character {_go_char(nxt)} {where} numeric literal"
    return None


def _innermost(text: str, pos: int) -> str | None:
    """The kind of container (`[` or `{`) open at `pos` in `text`, strings skipped."""
    stack: list[str] = []
    in_string = escaped = False
    for c in text[:pos]:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            stack.append(c)
        elif c in "]}" and stack:
            stack.pop()
    return stack[-1] if stack else None


def _scan_error(text: str, error: json.JSONDecodeError) -> str:
    """Go's json error text for what Python's decoder refused in `text`."""
    pos = error.pos
    if pos >= len(text) or error.msg.startswith("Unterminated"):
        return "unexpected EOF"
    tail = _number_tail_error(text, pos)
    if tail is not None:
        return tail
    if error.msg.startswith("Expecting value"):
        go_error = _value_error(text, pos)
        if go_error is not None:
            return go_error
    if error.msg.startswith("Invalid \\uXXXX"):
        # Go names the first character of the four that is not hex.
        bad = next((c for c in text[pos + 1:pos + 5] if c not in string.hexdigits), None)
        if bad is None:
            return "unexpected EOF"
        return f"invalid character {_go_char(bad)} in \\u hexadecimal character escape"
    if error.msg.startswith("Invalid \\escape") and pos + 1 < len(text):
        pos += 1  # Go names the character after the backslash
    context = next((c for m, c in _CONTEXTS.items() if error.msg.startswith(m)), _CONTEXTS["Expecting value"])
    if error.msg.startswith("Expecting ',' delimiter") and _innermost(text, pos) == "[":
        context = "after array element"
    return f"invalid character {_go_char(text[pos])} {context}"


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
        value, end = decoder.raw_decode(text)
    except json.JSONDecodeError as e:
        raise GoJSONError(_scan_error(text, e)) from None
    if isinstance(value, int | float) and not isinstance(value, bool):
        tail = _number_tail_error(text, end)  # Go reads a top-level number to its real end
        if tail is not None:
            raise GoJSONError(tail)
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
