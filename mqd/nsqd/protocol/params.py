"""Command parameters read as nsqd reads them, and what a command handler returns.

Shared by the V2 protocol's modules; no state but a bounded cache of valid
topic and channel names.
"""

from __future__ import annotations

from mqd.names import is_valid_name

__all__ = ["MAX_LINE", "NEED_MORE", "PAUSED", "base10", "echo", "int64", "ms_duration_ns", "valid_name"]

# A line longer than this without a newline is not a command; nsqd's reader
# gives up at its buffer size the same way (it closes without a frame).
MAX_LINE = 64 * 1024

# A command handler returns where the next command starts, or one of these:
# NEED_MORE once it has set the connection's `_need` to the index it waits
# for; PAUSED when parsing must stop until something answers (an auth
# server, a big MPUB published over turns). Negative, so never an offset.
NEED_MORE = -1
PAUSED = -2

_UINT64 = (1 << 64) - 1


def base10(raw: bytes) -> int | None:
    """nsqd's ByteToBase10: decimal digits only, no sign; empty is 0.

    Go adds the digits up in a uint64 that wraps, so any number of digits
    parses. 10**64 is a multiple of 2**64: the last 64 digits give the
    same value, and never hit Python's limit on int() of long strings.
    """
    if raw and not raw.isdigit():
        return None
    return int(raw[-64:]) & _UINT64 if raw else 0


def echo(raw: bytes) -> str:
    """Wire bytes for an error text, given back byte for byte as nsqd's %s does (see ProtocolError.payload)."""
    return raw.decode("utf-8", "surrogateescape")


def int64(value: int) -> int:
    """Go's int64 of a uint64 (or of a product that overflowed): two's complement wrap."""
    value &= _UINT64
    return value - (1 << 64) if value >> 63 else value


def ms_duration_ns(ms: int) -> int:
    """nsqd's time.Duration(ms) * time.Millisecond, overflow and all."""
    return int64(ms * 1_000_000)


_valid_names: dict[bytes, str] = {}


def valid_name(raw: bytes) -> str | None:
    """A topic/channel name from the wire if it is valid, else None.

    Valid names are remembered (a bounded cache): a publisher names the same
    topic in every PUB, and the regex would otherwise run every time.
    """
    name = _valid_names.get(raw)
    if name is not None:
        return name
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not is_valid_name(name):
        return None
    if len(_valid_names) >= 4096:
        _valid_names.clear()
    _valid_names[raw] = name
    return name
