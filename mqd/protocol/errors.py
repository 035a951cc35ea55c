"""Errors that cross the protocol boundary, carrying nsqd's code and fatality.

Commands raise them wherever they find a problem; the protocol turns them
into an error frame (and, when fatal, a closed connection) in one place.
"""

from __future__ import annotations

__all__ = ["ProtocolError", "fatal", "nonfatal", "go_quote"]


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
