"""nsqd.dat's content kept topic by topic: the same bytes as encoding it whole, for a change's own cost.

`Listing.encoded()` must equal `encode_json(describe(topics))` after any
story of topics and channels created, deleted (and created again under the
same name), paused and unpaused, ephemeral ones among them, as long as
each change names its topic; and a change to one topic must encode that
topic alone, however many others there are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqd.nsqd import metadata_listing
from mqd.nsqd.metadata import describe
from mqd.nsqd.metadata_listing import Listing
from mqd.wire.json_encoding import encode_json
from tests.support.v2_client import Client


@dataclass(eq=False)
class FakeChannel:
    name: str
    paused: bool = False

    @property
    def ephemeral(self) -> bool:
        return self.name.endswith("#ephemeral")


@dataclass(eq=False)
class FakeTopic:
    name: str
    paused: bool = False
    channels: dict[str, FakeChannel] = field(default_factory=dict)

    @property
    def ephemeral(self) -> bool:
        return self.name.endswith("#ephemeral")


_NAMES = ["a", "b", "c", "d", "e#ephemeral"]
_CHANNELS = ["x", "y", "z#ephemeral"]
_STEP = st.one_of(
    st.tuples(st.just("create"), st.sampled_from(_NAMES)),
    st.tuples(st.just("delete"), st.sampled_from(_NAMES)),
    st.tuples(st.just("pause"), st.sampled_from(_NAMES), st.booleans()),
    st.tuples(st.just("channel"), st.sampled_from(_NAMES), st.sampled_from(_CHANNELS)),
    st.tuples(st.just("unchannel"), st.sampled_from(_NAMES), st.sampled_from(_CHANNELS)),
    st.tuples(st.just("pause channel"), st.sampled_from(_NAMES), st.sampled_from(_CHANNELS),
              st.booleans()),
    st.tuples(st.just("encode")),
    st.tuples(st.just("everything")),
)


def _apply(topics: dict[str, FakeTopic], listing: Listing, step: tuple) -> None:
    kind = step[0]
    if kind == "encode":
        assert listing.encoded() == encode_json(describe(topics))
        return
    if kind == "everything":
        listing.stale(None)
        return
    name = step[1]
    topic = topics.get(name)
    if kind == "create" and topic is None:
        topics[name] = FakeTopic(name)
    elif kind == "delete" and topic is not None:
        del topics[name]
    elif topic is None:
        return
    elif kind == "pause":
        topic.paused = step[2]
    elif kind == "channel":
        topic.channels.setdefault(step[2], FakeChannel(step[2]))
    elif kind == "unchannel":
        topic.channels.pop(step[2], None)
    elif kind == "pause channel" and step[2] in topic.channels:
        topic.channels[step[2]].paused = step[3]
    listing.stale(name)


@settings(max_examples=300, deadline=None)
@given(before=st.lists(_STEP, max_size=30), steps=st.lists(_STEP, max_size=60))
def test_the_bytes_are_those_of_the_whole_list_encoded_after_any_named_changes(before, steps):
    topics: dict[str, FakeTopic] = {}
    for step in before:  # the state the broker comes back with: nothing named
        _apply(topics, Listing(topics), step)
    listing = Listing(topics)
    for step in steps:
        _apply(topics, listing, step)
    assert listing.encoded() == encode_json(describe(topics))


def test_no_topic_lists_null_as_nsqd_does():
    assert Listing({}).encoded() == b'{"topics":null,"version":"1.3.0"}'


@pytest.fixture
def encodings(monkeypatch) -> list[str]:
    """The names of the topics encoded, in order."""
    seen: list[str] = []
    real = metadata_listing.topic_entry

    def counting(topic):
        seen.append(topic.name)
        return real(topic)

    monkeypatch.setattr(metadata_listing, "topic_entry", counting)
    return seen


@pytest.mark.parametrize("others", [0, 1000])
def test_a_channel_created_encodes_its_topic_alone_however_many_others(
        tmp_path, inproc_broker, clock, encodings, others):
    for i in range(others):
        inproc_broker.topic(f"other{i}").channel("c")
    inproc_broker.topic("t")
    clock.advance(0)  # the write of all those: the first one encodes every topic
    encodings.clear()
    Client(inproc_broker).sub("t", "new")
    clock.advance(0)
    assert encodings == ["t"]
    inproc_broker.topic("t").channel("new").pause()
    inproc_broker.metadata.written("t")  # /channel/pause says which topic
    assert encodings == ["t", "t"]


def test_a_new_topic_encodes_itself_alone_and_goes_last(tmp_path, inproc_broker, clock, encodings):
    for i in range(100):
        inproc_broker.topic(f"other{i}")
    clock.advance(0)
    encodings.clear()
    inproc_broker.topic("new")
    clock.advance(0)
    assert encodings == ["new"]
    assert inproc_broker.metadata._bytes() == encode_json(describe(inproc_broker.topics))
