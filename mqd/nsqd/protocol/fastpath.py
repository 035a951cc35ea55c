"""The V2 parser's scan for a run of plain FINs.

A reader acks every message, so most of its reads are runs of FINs. The
parser (V2Protocol._parse) takes such a run in one pass instead of one
command at a time, and answers exactly as the general loop would: a line
the scan cannot take ends the run and is read again by the general loop,
for its error or to wait for more input. (A publisher's run of PUBs is
gathered by the parser itself, V2Protocol._pub_run.)
"""

from __future__ import annotations

__all__ = ["plain_fins"]

_FIN_LINE = 21  # b"FIN " + a 16-byte id + b"\n"
# What each line of a run of plain FINs has at these offsets.
_FIN_MARKS = ((0, b"F"), (1, b"I"), (2, b"N"), (3, b" "), (20, b"\n"))


def plain_fins(data: bytes, pos: int, end: int, ids: list[bytes]) -> int:
    """Append the ids of the plain FIN lines starting at `pos` to `ids`; where they stop.

    A reader acks every message, so a read is mostly lines of exactly
    b"FIN <16-byte id>\n": their ids are found with a few strided compares
    and sliced in one comprehension instead of a find and a split each.
    A line the general loop would read differently (a space or a newline
    inside the id, CRLF) ends the run here, and the caller reads it.
    """
    n = (end - pos) // _FIN_LINE
    if n < 2:
        return pos
    last = pos + n * _FIN_LINE
    for offset, mark in _FIN_MARKS:
        marks = data[pos + offset:last:_FIN_LINE]
        run = n - len(marks.lstrip(mark))
        if run < n:
            n = run
            last = pos + n * _FIN_LINE
    cr = data.find(b"\r", pos + 19, last)
    if cr >= 0:
        n = (cr - pos) // _FIN_LINE
        last = pos + n * _FIN_LINE
    if n < 1 or data.count(b" ", pos, last) != n or data.count(b"\n", pos, last) != n:
        return pos
    ids += [data[p:p + 16] for p in range(pos + 4, last, _FIN_LINE)]
    return last
