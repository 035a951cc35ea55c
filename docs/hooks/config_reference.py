"""MkDocs hook: the option reference page, written from mqd.options at build time.

`docs/config-reference.md` holds prose and one marker per daemon,
`<!-- options: MQD_OPTIONS -->`; this hook replaces each marker with a table
of that option tuple (flag, config-file name, type, default, description).
The tables are never written by hand, so they cannot drift from the code:
a new option, a changed default or help text shows on the next build.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

# mkdocs loads this file by path; make the checkout's packages importable
# whether mkdocs runs as `python -m mkdocs` from the root or as a script.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from mqd import options as _options  # noqa: E402

__all__ = ["on_page_markdown", "render_table", "format_default", "TABLES"]

# The option tuples a page may name in a marker.
TABLES = ("MQD_OPTIONS", "LOOKUPD_OPTIONS", "MQADMIN_OPTIONS")

_MARKER = re.compile(r"^<!-- options: (\w+) -->$", re.MULTILINE)

# What each kind of option takes, as a reader of the table needs it.
_KIND_NAMES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "bool",
    "duration": "duration",
    "list": "list",
    "address": "address",
}

# Characters that Markdown or HTML would read inside a table cell.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|#])")


def _cell(text: str) -> str:
    """Help text as literal table-cell text."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(text, quote=False))


def _code(text: str) -> str:
    """A value shown as code in a cell; `|` cannot appear inside a table's code span."""
    return "<code>" + html.escape(text, quote=False).replace("|", "&#124;") + "</code>"


def _duration(seconds: float) -> str:
    """Go's duration syntax as nsq's docs write defaults: 250ms, 60s, 300s, 15m, 1h.

    Whole hours in hours, whole minutes from ten minutes up in minutes,
    anything else in seconds or, under a second, milliseconds.
    """
    if seconds == 0:
        return "0"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds >= 600 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if seconds >= 1:
        return f"{seconds:g}s"
    return f"{seconds * 1000:g}ms"


def _bytes_note(name: str, value: int) -> str:
    """' (64 KiB)' for a byte size that is a whole number of KiB, MiB or GiB."""
    if not any(word in name for word in ("bytes", "msg-size", "body-size", "map-size", "buffer-size")):
        return ""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size and value % size == 0:
            return f" ({value // size} {unit})"
    return ""


def format_default(opt: Any) -> str:
    """An option's default as a table cell: the value as it is written in a flag or YAML."""
    value = opt.default
    if value is None:
        return "computed"
    if opt.kind == "duration":
        return _code(_duration(float(value)))
    if opt.kind == "bool":
        return _code("true" if value else "false")
    if opt.kind == "list":
        return _code(",".join(str(v) for v in value)) if value else "none"
    if opt.kind == "int":
        return _code(str(value)) + _bytes_note(opt.name, value)
    if value == "":
        return "empty"
    return _code(str(value))


def config_name(opt: Any) -> str:
    """The name nsqd's (nsqlookupd's, nsqadmin's) config file and `/config/` use."""
    return opt.aliases[0] if opt.aliases else opt.attr


def render_table(table_name: str) -> str:
    """The Markdown table of one of mqd.options' option tuples."""
    if table_name not in TABLES:
        raise ValueError(f"unknown option table {table_name!r}; expected one of {', '.join(TABLES)}")
    rows = [
        "| Flag | Config-file name | Type | Default | Description |",
        "|---|---|---|---|---|",
    ]
    for opt in getattr(_options, table_name):
        rows.append("| {flag} | {config} | {kind} | {default} | {help} |".format(
            flag=_code(f"--{opt.name}"),
            config=_code(config_name(opt)),
            kind=_KIND_NAMES.get(opt.kind, opt.kind),
            default=format_default(opt),
            help=_cell(opt.help),
        ))
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace every `<!-- options: NAME -->` marker with NAME's table."""
    return _MARKER.sub(lambda m: render_table(m.group(1)), markdown)
