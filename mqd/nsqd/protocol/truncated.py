"""nsqd's answer to a command whose body the client never finished sending.

A client that half-closes (`nc -N`, a script's `shutdown(SHUT_WR)`) in the
middle of a command's body gets from nsqd the fatal error its reader met at
the end of the input, such as `E_BAD_MESSAGE PUB failed to read message
body`, before the close. Which error depends on how far the input got: into
the body's size, or into the body (for MPUB, into which message). A command
line the input ends inside gets no answer: nsqd takes that end of input for
the end of the connection.
"""

from __future__ import annotations

from mqd.wire.errors import ProtocolError, fatal
from mqd.wire.framing import INT32

__all__ = ["cut_short"]

_unpack_int32 = INT32.unpack_from

# (code, the size cut short, the body cut short) per command with a body.
_BODY_ERRORS = {
    b"PUB": ("E_BAD_MESSAGE", "PUB failed to read message body size", "PUB failed to read message body"),
    b"DPUB": ("E_BAD_MESSAGE", "DPUB failed to read message body size", "DPUB failed to read message body"),
    b"IDENTIFY": ("E_BAD_BODY", "IDENTIFY failed to read body size", "IDENTIFY failed to read body"),
    b"AUTH": ("E_BAD_BODY", "AUTH failed to read body size", "AUTH failed to read body"),
}


def cut_short(rest: bytes, mpub_walk: tuple[int, int] | None) -> ProtocolError | None:
    """The error for the input left unparsed at its end, or None when nsqd sends none.

    `rest` starts at the command waiting for more; the parser keeps only a
    command whose checks before its body passed, so what is left to tell
    is where the input stopped. `mpub_walk` is the MPUB parse's progress
    (offset from the body size, messages read), when it had begun.
    """
    eol = rest.find(b"\n")
    if eol < 0:
        return None
    verb = rest[:eol].rstrip(b"\r").split(b" ", 1)[0]
    start = eol + 1
    if verb == b"MPUB":
        return _mpub_cut_short(rest, start, mpub_walk)
    errors = _BODY_ERRORS.get(verb)
    if errors is None:
        return None
    code, no_size, no_body = errors
    return fatal(code, no_size if len(rest) - start < 4 else no_body)


def _mpub_cut_short(rest: bytes, start: int, walk: tuple[int, int] | None) -> ProtocolError:
    """MPUB's: the body size, the count, a message's size or a message's body, as nsqd reads them."""
    end = len(rest)
    if end - start < 4:
        return fatal("E_BAD_BODY", "MPUB failed to read body size")
    if end - start < 8:
        return fatal("E_BAD_BODY", "MPUB failed to read message count")
    pos, index = (start + 8, 0) if walk is None else (start + walk[0], walk[1])
    while end - pos >= 4:
        # The sizes here passed the parser's checks (positive); max() only
        # keeps the walk moving forward whatever the bytes.
        pos += 4 + max(_unpack_int32(rest, pos)[0], 0)
        if pos > end:
            return fatal("E_BAD_MESSAGE", "MPUB failed to read message body")
        index += 1
    return fatal("E_BAD_MESSAGE", f"MPUB failed to read message({index}) body size")
