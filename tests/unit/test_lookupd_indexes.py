"""The registration DB's indexes give the answers of a plain scan, after any history.

The DB answers from indexes kept in step by every change (see
mqd.lookup.registry); a missed update would show as a wrong or stale
answer only after some particular sequence. So a hypothesis state machine
applies random sequences of registrations, producers, removals,
disconnections, tombstones, PINGs and clock moves to the DB and to the
naive one of tests/support/lookupd_reference.py, and after every step
compares every query, and every HTTP answer byte for byte (answers are
streamed a couple of pieces per reactor turn, so the slicing is checked
too).

MQD_LOOKUPD_EXAMPLES and MQD_LOOKUPD_STEPS (steps per example) make a longer
hunt, e.g. MQD_LOOKUPD_EXAMPLES=2000 MQD_LOOKUPD_STEPS=80.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mqd.lookup.http import LookupdSite
from mqd.lookup.registry import PeerInfo, Producer, Registration, RegistrationDB
from tests.support.inprocess_broker import START_TIME
from tests.support.lookupd_reference import (
    NaiveRegistrationDB,
    StreamingClient,
    TurnClock,
    naive_channels,
    naive_debug,
    naive_lookup,
    naive_nodes,
    naive_topics,
)

EXAMPLES = int(os.environ.get("MQD_LOOKUPD_EXAMPLES", "100"))
STEPS = int(os.environ.get("MQD_LOOKUPD_STEPS", "30"))

CATEGORIES = ("client", "topic", "channel")
KEYS = ("", "t1", "t2#ephemeral")
SUBKEYS = ("", "c1", "c2#ephemeral")
TOPICS = [k for k in KEYS if k]

# What brokers and the HTTP API create, and (rarely) any other combination.
registrations = st.one_of(
    st.just(Registration("client", "", "")),
    st.builds(Registration, st.just("topic"), st.sampled_from(TOPICS), st.just("")),
    st.builds(Registration, st.just("channel"), st.sampled_from(TOPICS), st.just("c1")),
    st.builds(Registration, st.sampled_from(CATEGORIES), st.sampled_from(KEYS), st.sampled_from(SUBKEYS)),
)


def _peer(n: int, peer_id: str) -> PeerInfo:
    return PeerInfo(id=peer_id, remote_address=peer_id, broadcast_address=f"b{n}", tcp_port=4150,
                    http_port=4151, version="1.3.0", hostname=f"h{n}", last_update=START_TIME)


class IndexedMatchesNaive(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = TurnClock()
        self.clock.advance(START_TIME)
        self.db = RegistrationDB(self.clock, inactive_producer_timeout=300, tombstone_lifetime=45)
        self.naive = NaiveRegistrationDB(self.clock, inactive_producer_timeout=300,
                                         tombstone_lifetime=45)
        self.http = StreamingClient(LookupdSite(self.db, self.clock, slice_size=2), self.clock)
        # Broker 2 has broker 0's id but is another PeerInfo (a reconnection from the same port).
        self.peers = [_peer(n, f"10.0.0.{n % 2}:5000") for n in range(3)]

    peer = st.integers(0, 2)

    def _both(self, method: str, *args):
        """The same change to both DBs; they must answer it alike."""
        answer = getattr(self.db, method)(*args)
        assert answer == getattr(self.naive, method)(*args), (method, args)
        return answer

    @initialize()
    def a_cluster(self) -> None:
        """Two brokers producing a topic, so that every change has something to change."""
        for n in (0, 1):
            self.identify(n)
            self.register(n, TOPICS[0], SUBKEYS[1])

    # What brokers do over the V1 protocol (as mqd.lookup.protocol does it) ...

    @rule(n=peer)
    def identify(self, n: int) -> None:
        self._both("add_producer", Registration("client", "", ""), Producer(self.peers[n]))

    @rule(n=peer, topic=st.sampled_from(TOPICS), channel=st.sampled_from(SUBKEYS))
    def register(self, n: int, topic: str, channel: str) -> None:
        if channel:
            self._both("add_producer", Registration("channel", topic, channel), Producer(self.peers[n]))
        self._both("add_producer", Registration("topic", topic, ""), Producer(self.peers[n]))

    @rule(n=peer, topic=st.sampled_from(TOPICS), channel=st.sampled_from(SUBKEYS))
    def unregister(self, n: int, topic: str, channel: str) -> None:
        peer_id = self.peers[n].id
        regs = ([Registration("channel", topic, channel)] if channel
                else [*self.naive.find_registrations("channel", topic, "*"), Registration("topic", topic, "")])
        for reg in regs:
            _, left = self._both("remove_producer", reg, peer_id)
            if left == 0 and (channel or topic).endswith("#ephemeral") and reg.subkey == channel:
                self._both("remove_registration", reg)

    # ... and any change at all, including shapes nothing makes.

    @rule(reg=registrations)
    def add_registration(self, reg: Registration) -> None:
        self.db.add_registration(reg)
        self.naive.add_registration(reg)

    @rule(reg=registrations, n=peer)
    def add_producer(self, reg: Registration, n: int) -> None:
        # The same Producer in both, so a tombstone shows in both.
        self._both("add_producer", reg, Producer(self.peers[n]))

    @rule(reg=registrations, n=peer)
    def remove_producer(self, reg: Registration, n: int) -> None:
        self._both("remove_producer", reg, self.peers[n].id)

    @rule(reg=registrations)
    def remove_registration(self, reg: Registration) -> None:
        self.db.remove_registration(reg)
        self.naive.remove_registration(reg)

    @rule(n=peer)
    def disconnect(self, n: int) -> None:
        """What the V1 protocol does when a broker's connection ends."""
        peer_id = self.peers[n].id
        for reg in self.db.lookup_registrations(peer_id):
            self._both("remove_producer", reg, peer_id)
        assert self.naive.lookup_registrations(peer_id) == []

    @rule(topic=st.sampled_from(TOPICS), n=peer)
    def tombstone(self, topic: str, n: int) -> None:
        node = self.peers[n]
        for producer in self.naive.find_producers("topic", topic, ""):
            if producer.peer.broadcast_address == node.broadcast_address:
                producer.tombstone(self.clock.seconds())

    @rule(n=peer)
    def ping(self, n: int) -> None:
        self.peers[n].last_update = self.clock.seconds()

    @rule(seconds=st.sampled_from([0.5, 20, 44, 46, 200, 301]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def queries_agree(self) -> None:
        db, naive = self.db, self.naive
        for category in CATEGORIES:
            for key in (*KEYS, "*"):
                for subkey in (*SUBKEYS, "*"):
                    pattern = (category, key, subkey)
                    assert db.find_registrations(*pattern) == naive.find_registrations(*pattern), pattern
                    # Producer compares by identity: the very same objects, in the same order.
                    assert db.find_producers(*pattern) == naive.find_producers(*pattern), pattern
        for peer in self.peers:
            assert db.lookup_registrations(peer.id) == naive.lookup_registrations(peer.id)
        assert list(db.items()) == naive.items()
        assert db.registrations() == list(naive.map)

    @invariant()
    def answers_agree(self) -> None:
        http, naive = self.http, self.naive
        assert http.get("/topics").body == naive_topics(naive)
        assert http.get("/nodes").body == naive_nodes(naive)
        assert http.get("/debug").body == naive_debug(naive)
        for topic in TOPICS:
            assert http.get(f"/channels?topic={topic}").body == naive_channels(naive, topic)
            want = naive_lookup(naive, topic)
            got = http.get(f"/lookup?topic={topic}")
            if want is None:
                assert got.status == 404 and got.json() == {"message": "TOPIC_NOT_FOUND"}
            else:
                assert (got.status, got.body) == (200, want)


IndexedMatchesNaive.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_indexes_match_the_naive_registration_db = IndexedMatchesNaive.TestCase


# -- histories too particular for the state machine to find often ---------------------------------


def _both():
    clock = TurnClock()
    clock.advance(START_TIME)
    db, naive = RegistrationDB(clock), NaiveRegistrationDB(clock)
    return clock, db, naive, StreamingClient(LookupdSite(db, clock, slice_size=2), clock)


def _add(dbs, reg: Registration, peer: PeerInfo) -> Producer:
    producer = Producer(peer)
    for db in dbs:
        db.add_producer(reg, producer)
    return producer


def test_a_broker_joining_an_older_registration_lists_it_in_registration_order():
    clock, db, naive, http = _both()
    x, y = _peer(1, "10.0.0.1:5000"), _peer(2, "10.0.0.2:5000")
    for peer in (x, y):
        _add((db, naive), Registration("client", "", ""), peer)
    _add((db, naive), Registration("topic", "older", ""), y)
    _add((db, naive), Registration("topic", "newer", ""), x)
    _add((db, naive), Registration("topic", "older", ""), x)  # x joins "older" last
    want = [Registration("client", "", ""), Registration("topic", "older", ""),
            Registration("topic", "newer", "")]
    assert db.lookup_registrations(x.id) == naive.lookup_registrations(x.id) == want
    body = http.get("/nodes").body
    assert body == naive_nodes(naive)
    assert [n["topics"] for n in http.get("/nodes").json()["producers"]] == [["older", "newer"], ["older"]]
    # Re-created registrations go to the end, in every index.
    db.remove_registration(Registration("topic", "older", ""))
    naive.remove_registration(Registration("topic", "older", ""))
    _add((db, naive), Registration("topic", "older", ""), x)
    assert db.lookup_registrations(x.id) == naive.lookup_registrations(x.id) == [
        Registration("client", "", ""), Registration("topic", "newer", ""), Registration("topic", "older", "")]
    assert db.find_registrations("topic", "*", "") == naive.find_registrations("topic", "*", "")
    assert http.get("/nodes").body == naive_nodes(naive)


def test_nodes_tombstones_are_those_of_the_same_broker_in_the_topic_registration():
    clock, db, naive, http = _both()
    peer = _peer(1, "10.0.0.1:5000")
    other = _peer(9, peer.id)  # the same id, another PeerInfo
    _add((db, naive), Registration("client", "", ""), peer)
    _add((db, naive), Registration("topic", "t", ""), other).tombstone(clock.seconds())
    _add((db, naive), Registration("topic", "u", ""), peer).tombstone(clock.seconds())
    # A topic registration with a subkey (none is ever made so) reads the plain one's tombstone.
    _add((db, naive), Registration("topic", "u", "c"), peer)
    node = http.get("/nodes").json()["producers"][0]
    assert (node["topics"], node["tombstones"]) == (["t", "u", "u"], [False, True, True])
    assert http.get("/nodes").body == naive_nodes(naive)
    clock.advance(45)
    assert http.get("/nodes").json()["producers"][0]["tombstones"] == [False, False, False]
    assert http.get("/nodes").body == naive_nodes(naive)
