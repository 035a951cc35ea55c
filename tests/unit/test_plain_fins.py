"""The parser's plain-FIN fast path (`_plain_fins`) against its general line loop, on any input."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mqd.nsqd.protocol.fastpath import plain_fins as _plain_fins


def _general(data: bytes, pos: int, end: int) -> tuple[int, list[bytes]]:
    """What the FIN-run loop reads line by line: FINs with one 16-byte id, until another line."""
    ids = []
    while True:
        eol = data.find(b"\n", pos, end)
        if eol < 0 or data[pos:pos + 4] != b"FIN ":
            return pos, ids
        line_end = eol - 1 if eol > pos and data[eol - 1] == 13 else eol
        params = data[pos:line_end].split(b" ")
        if len(params) != 2 or len(params[1]) != 16:
            return pos, ids
        ids.append(params[1])
        pos = eol + 1


_ID = st.one_of(
    st.binary(min_size=16, max_size=16),  # any bytes: spaces, CR, LF inside
    st.text("0123456789abcdef", min_size=16, max_size=16).map(str.encode),
)
_LINE = st.one_of(
    _ID.map(lambda i: b"FIN " + i + b"\n"),
    _ID.map(lambda i: b"FIN " + i[:15] + b"\r\n"),  # CRLF: the general loop's 15-byte id
    _ID.map(lambda i: b"FIN " + i + b"\r\n"),
    st.sampled_from([b"NOP\n", b"RDY 10\n", b"FIN short\n", b"FIN  0123456789abcdef\n", b"TOUCH 0123456789abcdef\n"]),
    st.binary(max_size=30),
)


@settings(max_examples=500, deadline=None)
@given(lines=st.lists(_LINE, max_size=12), lead=st.binary(max_size=3), cut=st.integers(0, 25))
def test_takes_only_what_the_general_loop_reads_the_same_way(lines, lead, cut):
    data = lead + b"".join(lines)
    pos = len(lead)
    end = max(pos, len(data) - cut)
    ids: list[bytes] = []
    stop = _plain_fins(data, pos, end, ids)
    assert pos <= stop <= end
    general_stop, general_ids = _general(data, pos, stop)
    # Everything it took, the general loop reads as the same FINs, ending at the same place.
    assert (general_stop, general_ids) == (stop, ids)
    # And from where it stopped, the general loop carries on as it would have.
    rest_stop, rest_ids = _general(data, stop, end)
    assert _general(data, pos, end) == (rest_stop, ids + rest_ids)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.text("0123456789abcdef", min_size=16, max_size=16).map(str.encode), min_size=2, max_size=50),
       tail=st.sampled_from([b"", b"FIN 0123", b"RDY 5\n", b"FIN 0123456789abcdef\r\n"]))
def test_a_run_of_plain_fins_is_taken_whole(ids, tail):
    data = b"".join(b"FIN " + i + b"\n" for i in ids) + tail
    out: list[bytes] = []
    assert _plain_fins(data, 0, len(data), out) == 21 * len(ids)
    assert out == ids
