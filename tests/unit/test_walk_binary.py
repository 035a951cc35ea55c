"""walk_binary's equal-size fast path against the general walk, on any batch."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from mqd.nsqd.batches import BatchError, walk_binary


def _batch(sizes: list[int]) -> bytes:
    return b"".join(struct.pack(">i", n) + bytes([65 + i % 26]) * n for i, n in enumerate(sizes))


def _outcome(walk, *args):
    out: list[bytes] = []
    try:
        return walk(*args, out), out
    except BatchError as e:
        return ("error", e.reason, e.index, e.size), []


def _one_at_a_time(data, pos, end, first, count, max_msg, stop_after, partial, out):
    """The general walk only: count=1 per call never takes the fast path."""
    done = 0
    while done < count:
        pos, n = walk_binary(data, pos, end, first + done, 1, max_msg, out, stop_after, partial)
        done += n
        if n == 0 or (0 <= stop_after <= pos):
            break
    return pos, done


def _fast(data, pos, end, first, count, max_msg, stop_after, partial, out):
    return walk_binary(data, pos, end, first, count, max_msg, out, stop_after, partial)


@settings(max_examples=400, deadline=None)
@given(
    size=st.integers(1, 40),
    count=st.integers(2, 30),
    varied=st.one_of(st.none(), st.lists(st.integers(-2, 45), min_size=2, max_size=30)),
    cut=st.integers(0, 60),
    stop=st.one_of(st.just(-1), st.integers(0, 1500)),
    max_msg=st.sampled_from([1, 20, 40, 1000]),
    partial=st.booleans(),
)
def test_fast_path_matches_the_walk(size, count, varied, cut, stop, max_msg, partial):
    sizes = varied if varied is not None else [size] * count
    raw = _batch([max(n, 0) for n in sizes])
    if varied is not None and min(varied) <= 0:
        # A size field of 0 or less, as a broken client sends it.
        first_bad = next(i for i, n in enumerate(varied) if n <= 0)
        offset = sum(4 + max(n, 0) for n in varied[:first_bad])
        raw = raw[:offset] + struct.pack(">i", varied[first_bad]) + raw[offset + 4:]
    data = b"xy" + raw
    end = max(2, len(data) - cut)
    args = (data, 2, end, 3, len(sizes), max_msg, stop, partial)
    assert _outcome(_fast, *args) == _outcome(_one_at_a_time, *args)
