"""A channel's copy of a message: the same message, with state of its own."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mqd.message import Message, channel_copies, new_messages


def slots(msg: Message) -> dict:
    """A message's fields, but for the id key its channel copies share (see below)."""
    return {name: getattr(msg, name) for name in Message.__slots__ if name != "id_key"}


@given(st.lists(st.tuples(st.binary(min_size=16, max_size=16), st.binary(max_size=64),
                          st.integers(min_value=0, max_value=2**63 - 1),
                          st.integers(min_value=0, max_value=65535),
                          st.floats(min_value=0, max_value=1e10)), max_size=20))
def test_channel_copies_are_what_copy_makes(fields):
    originals = [Message(*f) for f in fields]
    for m in originals:  # a delivered original: its own state must not be inherited
        m.state, m.key = (object(), 5.0), b"k"
    copies = channel_copies(originals)
    assert [slots(c) for c in copies] == [slots(m.copy()) for m in originals]
    assert all(c is not m and c.data is m.data for c, m in zip(copies, originals, strict=True))


def test_a_message_and_its_channel_copies_share_one_id_key():
    original = Message(b"0123456789abcdef", b"body", 1, 0)
    assert original.id_key is None  # one channel: nothing is made for it
    first = channel_copies([original])
    second = channel_copies([original])
    key = original.id_key
    assert key == original.id
    assert first[0].id_key is key and second[0].id_key is key


def test_a_copy_counts_its_own_attempts():
    original = Message(b"0" * 16, b"body", 1, 0)
    (copy,) = channel_copies([original])
    copy.attempts += 1
    assert original.attempts == 0


@given(st.lists(st.tuples(st.binary(min_size=16, max_size=16), st.binary(max_size=64)), max_size=20),
       st.integers(min_value=0, max_value=2**63 - 1))
def test_a_publish_builds_what_the_constructor_builds(pairs, timestamp):
    ids = [i for i, _ in pairs]
    bodies = [b for _, b in pairs]
    built = new_messages(ids, bodies, timestamp)
    assert [slots(m) for m in built] == [slots(Message(i, b, timestamp)) for i, b in pairs]
    assert [(m.id, m.body, m.deferred_until, m.client, m.delivered_at) for m in built] == [
        (i, b, 0.0, None, 0.0) for i, b in pairs]


def test_a_message_in_flight_reads_its_delivery_and_is_not_deferred():
    msg = Message(b"1" * 16, b"body", 7, 0, deferred_until=12.5)
    assert (msg.deferred_until, msg.client) == (12.5, None)
    owner = object()
    msg.state = (owner, 3.0)
    assert (msg.client, msg.delivered_at, msg.deferred_until) == (owner, 3.0, 0.0)
    msg.deferred_until = 0.0
    assert msg.state is None and msg.body_size == 4
