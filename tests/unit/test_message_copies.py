"""A channel's copy of a message: the same message, with state of its own."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mqd.message import Message, channel_copies


def slots(msg: Message) -> dict:
    return {name: getattr(msg, name) for name in Message.__slots__}


@given(st.lists(st.tuples(st.binary(min_size=16, max_size=16), st.binary(max_size=64),
                          st.integers(min_value=0, max_value=2**63 - 1),
                          st.integers(min_value=0, max_value=65535),
                          st.floats(min_value=0, max_value=1e10)), max_size=20))
def test_channel_copies_are_what_copy_makes(fields):
    originals = [Message(*f) for f in fields]
    for m in originals:  # a delivered original: its own state must not be inherited
        m.client, m.delivered_at, m.pq_seq, m.key = object(), 5.0, 3, b"k"
    copies = channel_copies(originals)
    assert [slots(c) for c in copies] == [slots(m.copy()) for m in originals]
    assert all(c is not m and c.body is m.body for c, m in zip(copies, originals, strict=True))


def test_a_copy_counts_its_own_attempts():
    original = Message(b"0" * 16, b"body", 1, 0)
    (copy,) = channel_copies([original])
    copy.attempts += 1
    assert original.attempts == 0
