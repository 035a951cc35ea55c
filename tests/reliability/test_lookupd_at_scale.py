"""mqlookupd with a thousand brokers: big answers are built in slices, and nobody waits for them.

mqadmin asks `/nodes` every few seconds; with thousands of registered
brokers that answer is about a megabyte. Built in one go it would hold the
reactor (formerly for seconds: it scanned every registration for every
broker), and consumers' `/lookup`s and brokers' PINGs would wait for it.
Big answers are now written a slice of pieces per reactor turn, so:

* a `/lookup` asked while `/nodes` is being written is answered before
  it ends (on a clock whose turns the test runs one by one, and over real
  TCP on the real reactor);
* each turn writes one slice, so the turns an answer takes grow with it;
* brokers coming and going meanwhile neither break the answer nor raise;
* a client that goes away stops the work, one that does not read pauses it.

The answers' bytes are compared with the naive construction of
tests/support/lookupd_reference.py. Nothing here measures speed: the figures
come from `python -m bench lookupd`.
"""

from __future__ import annotations

import gc
import json
import struct
import weakref

import pytest
import pytest_twisted
from twisted.internet import defer, protocol, reactor
from twisted.internet.address import IPv4Address
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from mqd.lookup.http import SLICE, LookupdSite
from mqd.lookup.protocol import LookupdFactory, LookupdProtocol
from mqd.lookup.registry import RegistrationDB
from tests.support.inprocess_broker import START_TIME
from tests.support.log_watch import LogWatch
from tests.support.lookupd_reference import (
    NaiveRegistrationDB,
    StreamingClient,
    TurnClock,
    answer_of,
    dechunk,
    naive_debug,
    naive_lookup,
    naive_nodes,
    naive_topics,
)
from tests.support.v2_frames import sized

BROKERS = 1000
TOPICS = [f"topic{t}" for t in range(5)]
PROBE = "probe"


def _register(factory: LookupdFactory, n: int, *topics: str) -> LookupdProtocol:
    """Broker n's V1 connection, identified, each topic registered with two channels as nsqd does."""
    addr = IPv4Address("TCP", f"10.{n // 250}.{n % 250}.1", 5000 + n)
    proto = factory.buildProtocol(addr)
    proto.makeConnection(StringTransport(peerAddress=addr))
    body = json.dumps({"version": "1.3.0", "tcp_port": 4150, "http_port": 4151,
                       "hostname": f"h{n}", "broadcast_address": f"b{n}"}).encode()
    lines = [b"  V1IDENTIFY\n" + sized(body)]
    for topic in topics:
        lines += [f"REGISTER {topic}\n".encode(), f"REGISTER {topic} c0\n".encode(),
                  f"REGISTER {topic} c1\n".encode()]
    proto.dataReceived(b"".join(lines))
    assert not proto.transport.disconnecting
    proto.transport.clear()
    return proto


def _cluster(clock, n: int = BROKERS) -> tuple[RegistrationDB, LookupdFactory, list[LookupdProtocol]]:
    db = RegistrationDB(clock)
    factory = LookupdFactory(db, "lookup-host", {"TCP": 4160, "HTTP": 4161}, hostname="lhost")
    brokers = [_register(factory, i, *TOPICS, *([PROBE] if i == 0 else [])) for i in range(n)]
    return db, factory, brokers


def _naive_copy(db: RegistrationDB, clock) -> NaiveRegistrationDB:
    """The same registrations and producers, for the naive answers."""
    naive = NaiveRegistrationDB(clock, db.inactive_producer_timeout, db.tombstone_lifetime)
    for reg, producers in db.items():
        naive.map[reg] = {p.peer.id: p for p in producers}
    return naive


@pytest.fixture(scope="module")
def cluster():
    """A thousand registered brokers on a clock that turns one reactor turn at a time."""
    clock = TurnClock()
    clock.advance(START_TIME)
    db, factory, brokers = _cluster(clock)
    return clock, db, factory, brokers


def _chunks(raw: bytes) -> int:
    """How many chunks of a chunked body have arrived."""
    body = raw.partition(b"\r\n\r\n")[2]
    count, pos = 0, 0
    while (end := body.find(b"\r\n", pos)) >= 0:
        size = int(body[pos:end], 16)
        if size == 0 or len(body) < end + 4 + size:
            break
        count += 1
        pos = end + 4 + size
    return count


def test_a_lookup_during_a_big_nodes_is_answered_before_it_ends(cluster):
    clock, db, factory, brokers = cluster
    http = StreamingClient(LookupdSite(db, clock), clock)
    with LogWatch() as logs:
        nodes = http.send("/nodes")
        assert answer_of(nodes.value()) is None, "/nodes was written in one go"
        assert b"Transfer-Encoding: chunked" in nodes.value()
        # Between two slices: a consumer's /lookup and a broker's PING get their answers.
        lookup = http.get(f"/lookup?topic={PROBE}", max_turns=1)
        assert [p["hostname"] for p in lookup.json()["producers"]] == ["h0"]
        brokers[1].dataReceived(b"PING\n")
        assert brokers[1].transport.value() == struct.pack(">i", 2) + b"OK"
        assert answer_of(nodes.value()) is None
        turns = 0
        while answer_of(nodes.value()) is None:
            assert clock.turn() == 1, "a turn runs the one cooperative step"
            turns += 1
            # One slice per turn: the reactor gets back control at least this often.
            assert _chunks(nodes.value()) == turns + 1
        logs.check("/nodes")
    assert turns >= BROKERS // SLICE
    response = answer_of(nodes.value())
    assert response is not None and response.status == 200 and response.is_json and response.v1
    assert response.body == naive_nodes(_naive_copy(db, clock))
    assert len(response.json()["producers"]) == BROKERS
    assert clock.getDelayedCalls() == [] or all(c.getTime() > clock.seconds()
                                                for c in clock.getDelayedCalls())


def test_every_big_answer_is_streamed_and_exact(cluster):
    clock, db, factory, brokers = cluster
    http = StreamingClient(LookupdSite(db, clock, slice_size=50), clock)
    naive = _naive_copy(db, clock)
    for path, want in [(f"/lookup?topic={TOPICS[0]}", naive_lookup(naive, TOPICS[0])),
                       ("/debug", naive_debug(naive)), ("/nodes", naive_nodes(naive))]:
        transport = http.send(path)
        assert answer_of(transport.value()) is None, f"{path} was written in one go"
        response = http.get(path)
        assert response.body == want, path
    # Small answers are still sent whole, with their length.
    response = http.get("/topics", max_turns=1)
    assert response.header("Content-Length") == str(len(response.body))
    assert response.body == naive_topics(naive)


def test_brokers_coming_and_going_during_nodes():
    clock = TurnClock()
    clock.advance(START_TIME)
    db, factory, brokers = _cluster(clock, 400)
    http = StreamingClient(LookupdSite(db, clock, slice_size=20), clock)
    with LogWatch() as logs:
        nodes = http.send("/nodes")
        clock.turn()
        # Early brokers (already written) and late ones (not yet) leave, others arrive
        # and register, a topic is deleted: the answer goes on.
        for gone in (brokers[1], brokers[300]):
            gone.connectionLost(Failure(ConnectionDone()))
        newcomer = _register(factory, 1000, "late_topic")
        brokers[350].dataReceived(b"REGISTER late_topic\nUNREGISTER topic0 c0\n")
        assert http.get("/topic/delete?topic=topic1", max_turns=1, method="POST").status == 200
        while answer_of(nodes.value()) is None:
            assert clock.turn()
        logs.check("/nodes with changes")
    listed = {n["hostname"]: n for n in answer_of(nodes.value()).json()["producers"]}
    # Those written before they left are listed; those gone before their turn are not;
    # a broker that came after the request is not in it.
    assert "h1" in listed and "h300" not in listed and "h1000" not in listed
    assert len(listed) == 399
    # Each broker's topics are those at its turn.
    assert listed["h350"]["topics"] == ["topic0", "topic2", "topic3", "topic4", "late_topic"]
    assert listed["h2"]["topics"] == TOPICS
    assert newcomer.peer is not None
    # And the next /nodes is exact again.
    assert http.get("/nodes").body == naive_nodes(_naive_copy(db, clock))


def test_a_client_gone_mid_answer_stops_it_and_one_not_reading_pauses_it(cluster):
    clock, db, factory, brokers = cluster
    http = StreamingClient(LookupdSite(db, clock), clock)
    with LogWatch() as logs:
        gone = http.send("/nodes")
        clock.turn()
        written = len(gone.value())
        gone.protocol.connectionLost(Failure(ConnectionDone()))
        while clock.turn():
            pass
        assert len(gone.value()) == written

        slow = http.send("/nodes")
        clock.turn()
        slow.producer.pauseProducing()  # what the transport does when its buffer is full
        written = len(slow.value())
        assert clock.turn() == 0, "a paused answer is not scheduled"
        assert len(slow.value()) == written
        slow.producer.resumeProducing()
        while answer_of(slow.value()) is None:
            assert clock.turn()
        logs.check("gone and slow clients")
    assert answer_of(slow.value()).body == naive_nodes(_naive_copy(db, clock))


# -- the real reactor, over TCP ----------------------------------------------------------------


class _Get(protocol.Protocol):
    """A raw HTTP/1.0 GET; `first` fires at the first bytes, `done` with everything at the close."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data = b""
        self.first: defer.Deferred[None] = defer.Deferred()
        self.done: defer.Deferred[bytes] = defer.Deferred()

    def connectionMade(self) -> None:
        self.transport.write(f"GET {self.path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        if not self.first.called:
            self.first.callback(None)

    def connectionLost(self, reason=None) -> None:
        self.done.callback(self.data)


@pytest_twisted.ensureDeferred
async def test_a_lookup_over_tcp_is_answered_while_nodes_is_written():
    db, factory, brokers = _cluster(reactor, 1000)
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
        LookupdSite(db, reactor, slice_size=10))
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
    order: list[str] = []
    try:
        nodes = _Get("/nodes")
        await endpoint.connect(protocol.Factory.forProtocol(lambda: nodes))
        nodes.done.addCallback(lambda raw: order.append("nodes") or raw)
        await nodes.first
        lookup = _Get(f"/lookup?topic={PROBE}")
        await endpoint.connect(protocol.Factory.forProtocol(lambda: lookup))
        lookup_raw = await lookup.done
        order.append("lookup")
        nodes_raw = await nodes.done
    finally:
        await port.stopListening()
    assert order == ["lookup", "nodes"]
    assert json.loads(lookup_raw.partition(b"\r\n\r\n")[2])["producers"][0]["hostname"] == "h0"
    body = dechunk(nodes_raw.partition(b"\r\n\r\n")[2])
    assert body is not None and len(json.loads(body)["producers"]) == 1000


def test_a_failure_mid_answer_cuts_the_connection():
    """The status is out when a later slice fails: the client must see a cut answer, not a short one."""
    clock = TurnClock()
    clock.advance(START_TIME)
    db, factory, brokers = _cluster(clock, 50)
    http = StreamingClient(LookupdSite(db, clock, slice_size=10), clock)
    failures = []

    def observe(event):
        if "log_failure" in event:
            failures.append(event["log_failure"])

    nodes = http.send("/nodes")
    brokers[40].peer.hostname = object()  # not JSON: no IDENTIFY gets here, a bug could
    globalLogPublisher.addObserver(observe)
    try:
        while clock.turn():
            pass
    finally:
        globalLogPublisher.removeObserver(observe)
    assert [f.type for f in failures] == [TypeError]
    assert nodes.disconnecting
    assert answer_of(nodes.value()) is None, "the answer looks complete"


def test_brokers_gone_are_not_kept_by_the_answers():
    """/nodes keeps each broker's encoded entry for the next time; a broker gone is let go."""
    clock = TurnClock()
    clock.advance(START_TIME)
    db, factory, brokers = _cluster(clock, 30)
    http = StreamingClient(LookupdSite(db, clock, slice_size=10), clock)
    assert len(http.get("/nodes").json()["producers"]) == 30
    assert http.get(f"/lookup?topic={TOPICS[0]}").status == 200
    gone = [weakref.ref(b.peer) for b in brokers[10:]]
    for broker in brokers[10:]:
        broker.connectionLost(Failure(ConnectionDone()))
    assert len(http.get("/nodes").json()["producers"]) == 10
    gc.collect()
    assert [ref() for ref in gone] == [None] * 20
