"""JSON read as Go's encoding/json reads it, so bad JSON is answered with NSQ's own texts.

mqadmin reads a request's body as nsqadmin's json.Decoder does
(`decode_go_object`) and a broker's or lookupd's answer as its
json.Unmarshal does (`unmarshal`); what they refuse is a GoJSONError
whose text is Go's.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from mqd.wire.errors import GO_REPLACE, go_fold, go_int_literal, go_quote, go_string

__all__ = ["error_message", "ANY", "BOOL", "FLOAT64", "INT", "INT32", "INT64", "STRING", "GoJSONError", "GoType", "check_go",
           "decode_go_object", "go_kind", "unmarshal"]


class GoJSONError(ValueError):
    """JSON that Go's encoding/json refuses; str() is Go's error text, which nsqadmin answers."""


_GO_SPACE = " \t\r\n"
# A json.Decoder's text for input that ends too soon (Unmarshal words it otherwise: `unmarshal`).
_CUT_SHORT = "unexpected EOF"
_LEADING_SPACE = re.compile(f"[{_GO_SPACE}]*")
# Go's scanner refuses to nest deeper than this (its maxNestingDepth).
_GO_MAX_DEPTH = 10000
_CONTEXTS = {
    "Expecting value": "looking for beginning of value",
    "Expecting property name enclosed in double quotes": "looking for beginning of object key string",
    "Expecting ':' delimiter": "after object key",
    "Expecting ',' delimiter": "after object key:value pair",
    "Invalid control character at": "in string literal",
    "Invalid \\escape": "in string escape code",
}


def _go_char(c: str) -> str:
    """Go's quoteChar: how a json syntax error names the character.

    Go's scanner reads bytes, so it names the first byte of a character
    (or an invalid byte, held here as a surrogate escape) as the rune of
    that value: `é` is named `'Ã'`, the byte 0xff `'ÿ'`.
    """
    if c == "'":
        return "'\\''"
    if c == '"':
        return "'\"'"
    first = c.encode("utf-8", "surrogateescape")[0]
    return "'" + go_quote(chr(first).encode())[1:-1] + "'"


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
        return _CUT_SHORT if len(text) - pos < len(literal) else None
    if first == "-":
        after = text[pos + 1:pos + 2]
        if not after:
            return _CUT_SHORT
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
        return _CUT_SHORT
    if nxt not in _DIGITS:
        return f"invalid character {_go_char(nxt)} {where} numeric literal"
    return None


def _brackets(text: str) -> Iterator[str]:
    """The brackets of `text` (`[`, `]`, `{`, `}`) in order, those inside strings skipped."""
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[]{}":
            yield c


def _innermost(text: str, pos: int) -> str | None:
    """The kind of container (`[` or `{`) open at `pos` in `text`."""
    stack: list[str] = []
    for c in _brackets(text[:pos]):
        if c in "[{":
            stack.append(c)
        elif stack:
            stack.pop()
    return stack[-1] if stack else None


def _scan_error(text: str, error: json.JSONDecodeError) -> str:
    """Go's json error text for what Python's decoder refused in `text`."""
    pos = error.pos
    if pos >= len(text) or error.msg.startswith("Unterminated"):
        return _CUT_SHORT
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
            return _CUT_SHORT
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
    """NaN, Infinity and -Infinity, which Python's decoder takes and Go's scanner refuses."""
    if name.startswith("-"):
        raise GoJSONError(f"invalid character {_go_char(name[1])} in numeric literal")
    raise GoJSONError(f"invalid character {_go_char(name[0])} looking for beginning of value")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
# For a document Python's int conversion refuses (a literal past 4,300 digits): integers as the
# broker's own Go-struct reader takes them. Not the first choice: a call per integer costs.
_HUGE_INT_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_int=go_int_literal)
# A \uD800-\uDFFF escape: the only way a JSON text holds a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _exact(raw: bytes) -> str:
    """`raw` with its invalid UTF-8 bytes kept (as surrogate escapes), for naming them in an error.

    Values are decoded with each such byte replaced by U+FFFD instead
    (GO_REPLACE), as Go puts them into strings; the two decodings fail alike.
    """
    return raw.decode("utf-8", "surrogateescape")


def _decode_first(text: str, start: int = 0) -> tuple[Any, int]:
    """The first JSON value of `text` from `start` and where it ends; GoJSONError with a json.Decoder's text."""
    try:
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            raise
        except ValueError:  # an integer literal too long for int()
            value, end = _HUGE_INT_DECODER.raw_decode(text, start)
    except json.JSONDecodeError as e:
        raise GoJSONError(_scan_error(text, e)) from None
    except RecursionError:
        raise GoJSONError(_too_deep(text)) from None
    if isinstance(value, int | float) and not isinstance(value, bool):
        tail = _number_tail_error(text, end)  # Go reads a top-level number to its real end
        if tail is not None:
            raise GoJSONError(tail)
    return value, end


def decode_go_object(raw: bytes, fields: Sequence[str]) -> dict[str, str]:
    """`fields` (all Go strings) of the first JSON value in `raw`, read as Go's json.Decoder reads a struct.

    Keys match exactly or, failing that, case-insensitively; unknown keys and
    what follows the first value are ignored; a missing field or a null is
    "". Raises GoJSONError with Go's text (`EOF`, `unexpected EOF`,
    `invalid character 'x' looking for beginning of value`, `json: cannot
    unmarshal number into Go struct field .topic of type string`) otherwise.
    """
    text = raw.decode("utf-8", GO_REPLACE).lstrip(_GO_SPACE)
    if not text:
        raise GoJSONError("EOF")
    try:
        value, _ = _decode_first(text)
    except GoJSONError:
        # The same error, named from the bytes as they came (see _go_char).
        _decode_first(_exact(raw).lstrip(_GO_SPACE))
        raise
    out = dict.fromkeys(fields, "")
    if value is None:
        return out
    if not isinstance(value, dict):
        struct = "; ".join(f'{f.capitalize()} string "json:\\"{f}\\""' for f in fields)
        raise GoJSONError(f"json: cannot unmarshal {go_kind(value)} into Go value of type struct {{ {struct} }}")
    first_error = None
    for key, item in value.items():
        name = key if key in out else next((f for f in fields if go_fold(f) == go_fold(key)), None)
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


def _too_deep(text: str) -> str:
    """Go's text for a document Python's decoder gave up on for its depth (RecursionError).

    Go's scanner goes on to 10,000 levels: deeper, it names the bracket
    that went past them; a document that ends inside its containers is
    cut short. A well-formed document nested between Python's limit and
    Go's is read by Go but not here, and says so.
    """
    depth = 0
    for c in _brackets(text):
        if c in "[{":
            depth += 1
            if depth > _GO_MAX_DEPTH:
                return f"invalid character {_go_char(c)} exceeded max depth"
        else:
            depth -= 1
    if depth > 0:
        return _CUT_SHORT
    return "JSON nested deeper than this reader follows"


def _decode_whole(text: str) -> Any:
    """`text` as one JSON document, or GoJSONError (`unexpected EOF` when it ends too soon)."""
    start = cast("re.Match[str]", _LEADING_SPACE.match(text)).end()  # `*` always matches
    if start == len(text):
        raise GoJSONError(_CUT_SHORT)
    value, end = _decode_first(text, start)
    rest = text[end:].lstrip(_GO_SPACE)
    if rest:
        raise GoJSONError(f"invalid character {_go_char(rest[0])} after top-level value")
    return value


def _go_strings(value: Any) -> Any:
    """`value` with each lone surrogate in its strings and keys as U+FFFD, as Go decodes the escape."""
    if isinstance(value, str):
        return go_string(value)
    if isinstance(value, list):
        return [_go_strings(item) for item in value]
    if isinstance(value, dict):
        return {go_string(key): _go_strings(item) for key, item in value.items()}
    return value


def unmarshal(raw: bytes) -> Any:
    """The JSON document `raw` as Go's json.Unmarshal reads it into an interface{}; GoJSONError otherwise.

    Unlike a json.Decoder, Unmarshal takes the whole input as one value:
    anything after it is `invalid character 'x' after top-level value`,
    and at the end of the input Go's scanner takes one more step with a
    space, so a document cut inside a number, literal or escape names that
    space (`1.` is `invalid character ' ' after decimal point in numeric
    literal`) and any other is `unexpected end of JSON input`. NaN and
    Infinity are refused, as Go has no such literals.
    """
    try:
        value = _decode_whole(raw.decode("utf-8", GO_REPLACE))
    except GoJSONError:
        pass
    else:
        return _go_strings(value) if _SURROGATE_ESCAPE.search(raw) else value
    exact = _exact(raw)
    for text in (exact, exact + " "):
        try:
            _decode_whole(text)
        except GoJSONError as e:
            if str(e) != _CUT_SHORT:
                raise
    raise GoJSONError("unexpected end of JSON input")


# -- a decoded document checked against the Go struct it would be decoded into ----------------

_INT_RANGES = {"int": 64, "int64": 64, "int32": 32}
# What a null leaves in a field of each kind: Go's zero value (a struct's as an empty
# object, to be read like any other); slices, maps and interfaces stay nil (None).
_ZERO: dict[str, Any] = {"string": "", "bool": False, "float64": 0.0, "int": 0, "int64": 0, "int32": 0}
_NUMBERS = frozenset(("float64", "int", "int64", "int32"))


@dataclass(frozen=True)
class GoType:
    """A Go type as encoding/json fills it, for checking a decoded document (`check_go`).

    `kind` is `string`, `bool`, `float64`, `int`, `int64`, `int32`,
    `slice` or `map` (of `elem`, a map's keys being strings), `ptr` (to
    `elem`), `struct` (its `fields`: JSON name, Go name, type), `custom`
    (a type with its own UnmarshalJSON, which decodes into `elem`: its
    errors keep the context of the field that holds it, as Go reports
    them) or `any` (not checked). `name` and `package` name a named type.
    str() is Go's name of the type, as its errors print it.
    """

    kind: str
    elem: GoType | None = None
    fields: tuple[tuple[str, str, GoType], ...] = ()
    name: str = ""
    package: str = ""

    if TYPE_CHECKING:
        # Set by __post_init__: a struct's fields by JSON name and by folded name,
        # each as (JSON name, type, `_plain`'s class and range).
        index: tuple[dict[str, _Field], dict[str, _Field]] = field(init=False)

    def __post_init__(self) -> None:
        # A struct's fields by JSON name, and by its lower case (the first such field wins, as in
        # Go), each with the one class (and range) of value that needs no further look: _fill_struct.
        by_key = {key: (key, ft, _plain(ft)) for key, _, ft in self.fields}
        by_folded = {go_fold(key): entry for key, entry in reversed(by_key.items())}
        object.__setattr__(self, "index", (by_key, by_folded))

    def __str__(self) -> str:
        if self.name:
            return f"{self.package}.{self.name}"
        if self.kind == "slice":
            return f"[]{self.elem}"
        if self.kind == "map":
            return f"map[string]{self.elem}"
        if self.kind == "ptr":
            return f"*{self.elem}"
        if self.kind == "any":
            return "interface {}"
        if self.kind != "struct":
            return self.kind
        tags = "; ".join(f'{go} {t} "json:\\"{key}\\""' for key, go, t in self.fields)
        return f"struct {{ {tags} }}"


STRING, BOOL, FLOAT64, INT, INT64, INT32, ANY = (
    GoType(k) for k in ("string", "bool", "float64", "int", "int64", "int32", "any"))


_Field = tuple[str, GoType, "tuple[type[Any], int | None, int | None] | None"]


def _plain(t: GoType) -> tuple[type[Any], int | None, int | None] | None:
    """The class of value a field of type `t` takes as it is (an int's range with it), or None."""
    if t.kind == "string":
        return str, None, None
    if t.kind == "bool":
        return bool, None, None
    bits = _INT_RANGES.get(t.kind)
    if bits is not None:
        return int, -(1 << (bits - 1)), 1 << (bits - 1)
    return None


def check_go(value: Any, go_type: GoType) -> Any:
    """`value` (from `unmarshal`) as json.Unmarshal would fill `go_type` with it, or GoJSONError.

    The error is Go's first UnmarshalTypeError, in document order: `json:
    cannot unmarshal string into Go struct field respType.topics of type
    []string`, or `... into Go value of type clusterinfo.respType` at the
    top. Fields match by their JSON name, exactly or else ignoring case
    (kept under that name here); unknown keys and null are left alone.
    What comes back has each null replaced by Go's zero value for its field
    (`""`, 0, false; an empty object for a struct; None for a slice or
    map), so callers read it as nsqadmin's code sees it.
    """
    return _fill(value, go_type, "", ())


def _fill(value: Any, t: GoType, struct_name: str, path: tuple[str, ...]) -> Any:
    # A ptr, custom, slice or map type always has its `elem`.
    while t.kind == "ptr":
        t = cast(GoType, t.elem)  # Go fills what the pointer points to, and names that type in its errors
    kind = t.kind
    if kind == "custom":
        return _fill_custom(value, cast(GoType, t.elem), struct_name, path)
    if value is None:
        return {} if kind == "struct" else _ZERO.get(kind)
    cls = value.__class__
    if kind == "struct":
        if cls is dict:
            return _fill_struct(value, t, t.name, path, nested=True)
    elif kind == "slice":
        if cls is list:
            elem = cast(GoType, t.elem)
            filled = [_fill(item, elem, struct_name, path) for item in value]
            return value if all(a is b for a, b in zip(filled, value, strict=True)) else filled
    elif kind == "map":
        if cls is dict:
            elem = cast(GoType, t.elem)
            filled_map = {key: _fill(item, elem, struct_name, path) for key, item in value.items()}
            return value if all(filled_map[key] is item for key, item in value.items()) else filled_map
    elif kind == "any" or (kind == "string" and cls is str) or (kind == "bool" and cls is bool):
        return value
    elif (cls is int or cls is float) and kind in _NUMBERS:
        if kind == "float64":
            return value
        bits = _INT_RANGES[kind]
        if cls is int and -(1 << (bits - 1)) <= value < 1 << (bits - 1):
            return value
        raise _type_error(f"number {value!r}", t, struct_name, path)
    raise _type_error(go_kind(value), t, struct_name, path)


def _fill_custom(value: Any, inner: GoType, struct_name: str, path: tuple[str, ...]) -> Any:
    """A type whose own UnmarshalJSON decodes into `inner`: its errors carry the holder's context."""
    if value is None:
        return {} if inner.kind == "struct" else _ZERO.get(inner.kind)
    if inner.kind == "struct" and value.__class__ is dict:
        return _fill_struct(value, inner, struct_name, path, nested=False)
    return _fill(value, inner, struct_name, path)


def _fill_struct(value: dict[str, Any], t: GoType, struct_name: str, path: tuple[str, ...],
                 nested: bool) -> dict[str, Any]:
    """`value` as Go fills struct `t` from it; the same dict when nothing needed changing."""
    by_key, by_folded = t.index
    out = None
    for key, item in value.items():
        field = by_key.get(key)
        if field is None:
            field = by_folded.get(go_fold(key))
            if field is None:
                continue
        name, field_type, plain = field
        if plain is not None and item.__class__ is plain[0] and (plain[1] is None or plain[1] <= item < plain[2]):
            filled = item  # the common case: a string, bool or int in range where one belongs
        else:
            filled = _fill(item, field_type, struct_name, (*path, name) if nested else path)
        if out is None and (filled is not item or name != key):
            out = dict(value)
        if out is not None:
            # Kept under the field's JSON name; of two keys for one field, the later wins, as in Go.
            if name != key:
                del out[key]
            out[name] = filled
    return value if out is None else out


def _type_error(what: str, t: GoType, struct_name: str, path: tuple[str, ...]) -> GoJSONError:
    if struct_name or path:
        return GoJSONError(f"json: cannot unmarshal {what} into Go struct field {struct_name}.{'.'.join(path)}"
                           f" of type {t}")
    return GoJSONError(f"json: cannot unmarshal {what} into Go value of type {t}")


def error_message(body: bytes, limit: int = 200) -> str:
    """The V1 error text of an HTTP answer's body (`{"message": "TOPIC_NOT_FOUND"}`), at most `limit` characters; "" when it has none."""
    try:
        data = unmarshal(body)
    except GoJSONError:
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    return message[:limit] if isinstance(message, str) else ""
