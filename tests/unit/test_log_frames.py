"""The retained log's record framing: what frame_records writes, iter_frames reads back, and nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mqd.wire.log_frames import FRAME_HEAD, FrameError, frame_records, iter_frames

records = st.lists(
    st.tuples(st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1),
              st.binary(min_size=16, max_size=16).map(lambda b: b.hex()[:16].encode()), st.binary(max_size=300)),
    max_size=20)


@given(records)
def test_frames_read_back_as_the_records_written_with_attempts_zero(recs):
    data = frame_records([(o, t, i + b) for o, t, i, b in recs])
    assert list(iter_frames(data)) == [(o, t, 0, i, b) for o, t, i, b in recs]


def test_a_frame_is_size_offset_timestamp_attempts_id_body_big_endian():
    data = frame_records([(7, 1_700_000_000_000_000_000, b"0123456789abcdef" + b"hi")])
    assert data == (bytes.fromhex("00000024") + (7).to_bytes(8, "big")
                    + (1_700_000_000_000_000_000).to_bytes(8, "big") + b"\x00\x00" + b"0123456789abcdefhi")
    assert FRAME_HEAD.size == 22


@given(records.filter(bool), st.data())
def test_bytes_cut_anywhere_inside_a_frame_are_refused_not_misread(recs, data):
    whole = frame_records([(o, t, i + b) for o, t, i, b in recs])
    cut = data.draw(st.integers(1, len(whole) - 1))
    ends = set()
    pos = 0
    while pos < len(whole):
        pos += 4 + int.from_bytes(whole[pos:pos + 4], "big")
        ends.add(pos)
    if cut in ends:
        assert len(list(iter_frames(whole[:cut]))) < len(recs)
    else:
        with pytest.raises(FrameError):
            list(iter_frames(whole[:cut]))


def test_a_size_too_small_for_an_id_is_refused():
    bad = FRAME_HEAD.pack(10, 0, 0, 0) + b"x" * 40
    with pytest.raises(FrameError):
        list(iter_frames(bad))
