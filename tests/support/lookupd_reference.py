"""What mqlookupd's answers must be, computed the slow, obvious way; and a client for streamed ones.

`NaiveRegistrationDB` is the registration DB without indexes: one map of
registrations to producers, scanned for every question, as nsqlookupd's
registration_db.go does. The `naive_*` functions build each HTTP answer
from it as a whole value, encoded once. The indexed DB and the sliced
answers of mqd.lookup must agree with them byte for byte, whatever
happened before (tests/unit/test_lookupd_indexes.py,
tests/reliability/test_lookupd_at_scale.py).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from mqd.http.response import dumps
from mqd.lookup.http import LookupdSite, _debug_entry
from mqd.lookup.registry import Producer, Registration
from tests.support.http_client import Response, parse_response


class NaiveRegistrationDB:
    """Registrations → {broker id: Producer} in insertion order, and nothing else."""

    def __init__(self, clock, inactive_producer_timeout: float = 300.0,
                 tombstone_lifetime: float = 45.0) -> None:
        self.clock = clock
        self.inactive_producer_timeout = inactive_producer_timeout
        self.tombstone_lifetime = tombstone_lifetime
        self.map: dict[Registration, dict[str, Producer]] = {}

    def add_registration(self, reg: Registration) -> None:
        self.map.setdefault(reg, {})

    def add_producer(self, reg: Registration, producer: Producer) -> bool:
        producers = self.map.setdefault(reg, {})
        if producer.peer.id in producers:
            return False
        producers[producer.peer.id] = producer
        return True

    def remove_producer(self, reg: Registration, peer_id: str) -> tuple[bool, int]:
        producers = self.map.get(reg)
        if producers is None:
            return False, 0
        removed = producers.pop(peer_id, None) is not None
        return removed, len(producers)

    def remove_registration(self, reg: Registration) -> None:
        self.map.pop(reg, None)

    def find_registrations(self, category: str, key: str, subkey: str) -> list[Registration]:
        return [reg for reg in self.map
                if reg.category == category and key in ("*", reg.key) and subkey in ("*", reg.subkey)]

    def find_producers(self, category: str, key: str, subkey: str) -> list[Producer]:
        seen: dict[str, Producer] = {}
        for reg in self.find_registrations(category, key, subkey):
            for peer_id, producer in self.map[reg].items():
                seen.setdefault(peer_id, producer)
        return list(seen.values())

    def lookup_registrations(self, peer_id: str) -> list[Registration]:
        return [reg for reg, producers in self.map.items() if peer_id in producers]

    def items(self) -> list[tuple[Registration, list[Producer]]]:
        return [(reg, list(producers.values())) for reg, producers in self.map.items()]

    def active(self, producers: list[Producer]) -> list[Producer]:
        now = self.clock.seconds()
        return [p for p in producers if now - p.peer.last_update <= self.inactive_producer_timeout]

    def is_tombstoned(self, producer: Producer) -> bool:
        return producer.is_tombstoned(self.tombstone_lifetime, self.clock.seconds())

    def live(self, producers: list[Producer]) -> list[Producer]:
        return [p for p in self.active(producers) if not self.is_tombstoned(p)]


# -- the answers ------------------------------------------------------------------------------


def naive_topics(db: NaiveRegistrationDB) -> bytes:
    return dumps({"topics": [reg.key for reg in db.find_registrations("topic", "*", "")]})


def naive_channels(db: NaiveRegistrationDB, topic: str) -> bytes:
    return dumps({"channels": [reg.subkey for reg in db.find_registrations("channel", topic, "*")]})


def naive_lookup(db: NaiveRegistrationDB, topic: str) -> bytes | None:
    """The /lookup body, or None for 404 TOPIC_NOT_FOUND."""
    if not db.find_registrations("topic", topic, ""):
        return None
    channels = [reg.subkey for reg in db.find_registrations("channel", topic, "*")]
    producers = db.live(db.find_producers("topic", topic, ""))
    return dumps({"channels": channels, "producers": [p.peer.as_json() for p in producers]})


def naive_nodes(db: NaiveRegistrationDB) -> bytes:
    nodes = []
    for client in db.active(db.find_producers("client", "", "")):
        peer = client.peer
        topics = [reg.key for reg in db.lookup_registrations(peer.id) if reg.category == "topic"]
        tombstones = []
        for topic in topics:
            tombstoned = False
            for producer in db.find_producers("topic", topic, ""):
                if producer.peer is peer:
                    tombstoned = db.is_tombstoned(producer)
                    break
            tombstones.append(tombstoned)
        nodes.append({**peer.as_json(), "tombstones": tombstones, "topics": topics})
    return dumps({"producers": nodes})


def naive_debug(db: NaiveRegistrationDB) -> bytes:
    data: dict[str, list[dict[str, Any]]] = {}
    for reg, producers in sorted(db.items(), key=lambda item: str(item[0])):
        for producer in producers:
            data.setdefault(str(reg), []).append(_debug_entry(producer))
    return dumps(data)


# -- a client that lets a streamed answer finish ------------------------------------------------


class TurnClock(Clock):
    """A Clock that can also run one reactor turn: the calls due now, not the ones they schedule.

    `advance(0)` runs a call scheduled by a due call in the same go, so a
    cooperative task would look like one long call; a real reactor polls
    for I/O in between, which `turn` lets a test do.
    """

    def turn(self) -> int:
        """Run the calls due now; how many ran."""
        due = [call for call in self.calls if call.getTime() <= self.seconds()]
        for call in due:
            if call in self.calls:  # not cancelled by an earlier one
                self.calls.remove(call)
                call.called = 1
                call.func(*call.args, **call.kw)
        return len(due)


def dechunk(body: bytes) -> bytes | None:
    """The body of a chunked transfer, or None if its last chunk has not arrived."""
    out, pos = [], 0
    while True:
        end = body.find(b"\r\n", pos)
        if end < 0:
            return None
        size = int(body[pos:end], 16)
        if size == 0:
            return b"".join(out)
        if len(body) < end + 2 + size + 2:
            return None
        out.append(body[end + 2:end + 2 + size])
        pos = end + 4 + size


def answer_of(raw: bytes) -> Response | None:
    """The response in `raw`, sized or chunked, or None while incomplete."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    if b"transfer-encoding: chunked" not in head.lower():
        return parse_response(raw)
    body = dechunk(rest)
    if body is None:
        return None
    response = parse_response(head + b"\r\n\r\n")
    assert response is not None
    response.body = body
    return response


class StreamingClient:
    """Requests to a LookupdSite over StringTransports; answers may need reactor turns to finish."""

    def __init__(self, site: LookupdSite, clock: TurnClock) -> None:
        self.site = site
        self.clock = clock
        self._port = 30000

    def send(self, path: str, method: str = "GET") -> StringTransport:
        self._port += 1
        addr = IPv4Address("TCP", "127.0.0.1", self._port)
        proto = self.site.buildProtocol(addr)
        transport = StringTransport(peerAddress=addr)
        proto.makeConnection(transport)
        proto.dataReceived(f"{method} {path} HTTP/1.1\r\nHost: lookupd\r\n\r\n".encode())
        transport.protocol = proto
        return transport

    def get(self, path: str, max_turns: int = 100_000, method: str = "GET") -> Response:
        """The whole answer, turning the reactor until it is complete."""
        transport = self.send(path, method)
        for _ in range(max_turns):
            response = answer_of(transport.value())
            if response is not None:
                transport.protocol.connectionLost(Failure(ConnectionDone()))
                return response
            if not self.clock.turn():
                break
        raise AssertionError(f"GET {path}: no complete answer: {transport.value()[-300:]!r}")
