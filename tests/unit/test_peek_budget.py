"""A peek's bounds: bodies cut at max_body, answers within --peek-max-bytes, built a slice at a time,
and the bytes of all answers in progress counted (503 PEEK_BUSY past the bound).

In-process, on a task.Clock: a slice is one `clock.advance(0)`, so that the
reactor turns between slices is seen by counting turns, and what another
client is answered meanwhile (a PUB) is checked while the answer is still
incomplete. Every store a queue can sit on is covered where its part of
the answer is read differently (memory references, LMDB pieces).
"""

from __future__ import annotations

import base64
import json

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from mqd.nsqd.http.peek import MESSAGE_COST, PEEK_ANSWERS, SLICE_COST, WRITE_CHUNK
from tests.support.http_client import HTTPClient, error, parse_response
from tests.support.inprocess_broker import lmdb_store, msgs
from tests.support.peek_brokers import MODES, Producer, make, quiet_client
from tests.support.v2_client import Client
from tests.support.v2_frames import identify, mpub, ok, pub

MB = 1 << 20
KIB = 1 << 10


def body_of(message: dict) -> bytes:
    return base64.b64decode(message["body"])


def answer_of(http: HTTPClient, path: str) -> tuple[dict, int]:
    """The JSON of a peek answered 200, and its size in bytes."""
    r = http.turned("GET", path)
    assert r.status == 200, r.body
    return r.json(), len(r.body)


def reactor_turn(clock) -> int:
    """What one reactor iteration runs: the calls due when it starts (not those they schedule).

    Clock.advance(0) would also run the calls scheduled meanwhile, all
    slices of an answer in one go; a reactor runs those on its next turn.
    """
    due = [c for c in clock.getDelayedCalls() if c.getTime() <= clock.seconds()]
    for call in due:
        if call.active():
            clock.calls.remove(call)
            call.called = True
            call.func(*call.args, **call.kw)
    return len(due)


class SlowTransport(StringTransport):
    """A transport whose buffer is full past `limit` bytes (it pauses its producer) until `drain()`."""

    def __init__(self, limit: int, **kw) -> None:
        super().__init__(**kw)
        self.limit = limit
        self.received = 0

    def write(self, data: bytes) -> None:
        super().write(data)
        if len(self.io.getvalue()) > self.limit and self.producer is not None:
            self.producer.pauseProducing()

    def drain(self) -> bytes:
        data = self.value()
        self.received += len(data)
        self.clear()
        if self.producer is not None:
            self.producer.resumeProducing()
        return data


def slow_get(http: HTTPClient, path: str, limit: int = 64 * KIB) -> SlowTransport:
    addr = IPv4Address("TCP", "127.0.0.1", 41000)
    proto = http.site.buildProtocol(addr)
    transport = SlowTransport(limit, peerAddress=addr)
    proto.makeConnection(transport)
    proto.dataReceived(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    transport.protocol = proto
    return transport


def big_backlog(broker, n: int, size: int, topic: str = "t", channel: str | None = "c") -> bytes:
    """`n` messages of one `size`-byte body (one bytes object: the test does not hold n copies)."""
    body = (b"0123456789abcdef" * (size // 16 + 1))[:size]
    t = broker.topic(topic)
    if channel is not None:
        t.channel(channel)
    t.publish([body] * n)
    return body


# -- cutting bodies --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_body_past_the_cap_is_cut_and_says_so(tmp_path, mode):
    broker = make(tmp_path, mode)
    http = HTTPClient(broker)
    small, big = b"small", bytes(range(256)) * 400  # 100 KiB
    Producer(broker)(pub("t", small))
    for _ in range(6):  # past mem-queue-size 4: the last ones are read from the store
        Producer(broker)(pub("t", big))
    answer, _ = answer_of(http, "/topic/peek?topic=t")
    assert answer["max_body"] == 64 * KIB and answer["more"] is False
    first, *rest = answer["messages"]
    assert (body_of(first), first["size"], first["truncated"]) == (small, 5, False)
    assert len(rest) == 6
    for m in rest:
        assert (body_of(m), m["size"], m["truncated"], m["body_text"]) == (big[:64 * KIB], len(big), True, None)
    broker.close()


@pytest.mark.parametrize(("query", "shown"), [("&max_body=10", 10), ("&max_body=0", 0), ("&max_body=0007", 7),
                                              ("&max_body=99999999999999999999", 64 * KIB),
                                              ("&max_body=" + "9" * 5000, 64 * KIB),
                                              ("&n=" + "9" * 5000 + "&max_body=10", 10),
                                              ("&max_body=70000", 64 * KIB)])
def test_max_body_asks_less_up_to_the_cap(tmp_path, query, shown):
    broker = make(tmp_path, "lmdb")
    http = HTTPClient(broker)
    body = b"x" * (100 * KIB)
    for _ in range(6):
        Producer(broker)(pub("t", body))
    answer, _ = answer_of(http, "/topic/peek?topic=t" + query)
    assert answer["max_body"] == shown
    assert [(len(body_of(m)), m["size"], m["truncated"]) for m in answer["messages"]] == [(shown, len(body), True)] * 6
    broker.close()


@pytest.mark.parametrize("value", ["", "-1", "x", "1.5", "0x10", "1e3", "%201", "+1"])
def test_max_body_not_a_number_is_invalid(inproc_broker, http, value):
    inproc_broker.topic("t").channel("c")
    assert error(http.get(f"/channel/peek?topic=t&channel=c&max_body={value}")) == (400, "INVALID_MAX_BODY")
    assert error(http.get(f"/topic/peek?topic=t&max_body={value}")) == (400, "INVALID_MAX_BODY")


def test_max_body_comes_after_n_and_state(inproc_broker, http):
    inproc_broker.topic("t").channel("c")
    assert error(http.get("/channel/peek?topic=t&channel=c&max_body=x&n=0")) == (400, "INVALID_N")
    assert error(http.get("/channel/peek?topic=t&channel=c&max_body=x&state=no")) == (400, "INVALID_STATE")


def test_the_cap_is_an_option(tmp_path):
    broker = make(tmp_path, "memory", peek_max_body_bytes=3)
    http = HTTPClient(broker)
    Producer(broker)(pub("t", b"abcdef"))
    answer, _ = answer_of(http, "/topic/peek?topic=t&max_body=5")
    assert answer["max_body"] == 3
    assert [(body_of(m), m["size"], m["truncated"]) for m in answer["messages"]] == [(b"abc", 6, True)]


def test_a_cut_through_a_character_leaves_it_out_of_the_text(tmp_path):
    broker = make(tmp_path, "memory")
    http = HTTPClient(broker)
    text = "h\u00e9\u2603llo".encode()  # h, é (2 bytes), snowman (3 bytes)
    Producer(broker)(pub("t", text))
    for cut, expected in [(1, "h"), (2, "h"), (3, "h\u00e9"), (4, "h\u00e9"), (5, "h\u00e9"), (6, "h\u00e9\u2603"),
                          (len(text), text.decode())]:
        [m] = answer_of(http, f"/topic/peek?topic=t&max_body={cut}")[0]["messages"]
        assert (m["body_text"], body_of(m), m["truncated"]) == (expected, text[:cut], cut < len(text))
    # Not UTF-8 before the cut: no text, cut or not.
    Producer(broker)(pub("u", b"\xff" + text))
    [m] = answer_of(http, "/topic/peek?topic=u&max_body=4")[0]["messages"]
    assert m["body_text"] is None


# -- the byte budget -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_answer_ends_with_the_last_message_that_fits(tmp_path, mode):
    broker = make(tmp_path, mode, peek_max_bytes=8 * KIB)
    http = HTTPClient(broker)
    bodies = [b"%04d" % i + b"." * 996 for i in range(20)]
    Producer(broker)(pub("t", bodies[0]))
    for body in bodies[1:]:
        Producer(broker)(pub("t", body))
    answer, size = answer_of(http, "/topic/peek?topic=t&n=20")
    assert size <= 8 * KIB
    shown = [body_of(m) for m in answer["messages"]]
    assert 1 <= len(shown) < 20 and shown == bodies[:len(shown)]
    assert answer["more"] is True and answer["total"] == 20
    assert not any(m["truncated"] for m in answer["messages"])
    # One message less than what did not fit: it would have passed the budget.
    one = len(json.dumps(answer["messages"][0], separators=(",", ":")))
    assert size + one + 1 > 8 * KIB
    # All fit: no `more`.
    answer, size = answer_of(http, "/topic/peek?topic=t&n=3")
    assert (len(answer["messages"]), answer["more"]) == (3, False)
    broker.close()


def test_the_first_message_always_comes_cut_to_fit(tmp_path):
    broker = make(tmp_path, "memory", peek_max_bytes=4096)
    http = HTTPClient(broker)
    body = b"\x01" * (64 * KIB)  # 6 bytes of JSON each in body_text
    Producer(broker)(pub("t", body))
    Producer(broker)(pub("t", b"second"))
    answer, size = answer_of(http, "/topic/peek?topic=t")
    assert size <= 4096
    [m] = answer["messages"]
    assert m["truncated"] is True and m["size"] == len(body) and 0 < len(body_of(m)) < 1000
    assert body_of(m) == body[:len(body_of(m))]
    assert answer["more"] is True


def test_the_budget_option_has_a_floor():
    from mqd.options import MQD_OPTIONS, ConfigError, resolve

    with pytest.raises(ConfigError, match="peek-max-bytes"):
        resolve(MQD_OPTIONS, {"peek-max-bytes": "4095"})
    with pytest.raises(ConfigError, match="peek-max-body-bytes"):
        resolve(MQD_OPTIONS, {"peek-max-body-bytes": "-1"})


# -- slices: the reactor turns, another client is served ------------------------------------------


def test_a_large_peek_is_built_in_slices_while_a_publisher_is_served(tmp_path):
    """200 messages of 1 MB: the answer stays within the budget and the reactor turns between slices.

    Before, the whole answer (200 bodies, base64 and text: ~470 MB) was
    built in the request's one reactor call.
    """
    broker = make(tmp_path, "memory", mem_queue_size=1000)
    http = HTTPClient(broker)
    body = big_backlog(broker, 200, MB)
    publisher = Client(broker, port=7000)
    assert publisher.request(identify(heartbeat_interval=-1)) == [ok()]
    transport = http.send("GET", "/channel/peek?topic=t&channel=c&n=200")
    assert parse_response(transport.value()) is None, "answered in one reactor call"
    # The reactor is free between slices: a publisher is answered in each turn.
    turns = 0
    while (response := parse_response(transport.value())) is None:
        assert publisher.request(pub("other", b"bystander %d" % turns)) == [ok()]
        assert reactor_turn(broker.clock) >= 1
        turns += 1
        assert turns < 1000
    assert broker.topics["other"].message_count == turns
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    assert response.status == 200 and len(response.body) <= 4 * MB
    answer = response.json()
    assert answer["total"] == 200 and answer["more"] is True
    assert [(m["size"], m["truncated"]) for m in answer["messages"]] == [(MB, True)] * len(answer["messages"])
    assert all(body_of(m) == body[:64 * KIB] for m in answer["messages"])
    # Each slice is about SLICE_COST of JSON: as many turns as that takes, give or take one.
    per_message = len(json.dumps(answer["messages"][0], separators=(",", ":"))) + MESSAGE_COST
    assert turns >= len(answer["messages"]) * per_message // SLICE_COST - 1 >= 5
    assert http.site.state.peeks.held == 0
    broker.close()


@pytest.mark.parametrize("mode", ["lmdb", "durable"])
def test_the_store_is_read_a_piece_at_a_time_and_what_is_read_away_is_skipped(tmp_path, mode):
    broker = make(tmp_path, mode, mem_queue_size=0)
    http = HTTPClient(broker)
    bodies = [b"%04d" % i + b"-" * 4092 for i in range(600)]
    broker.topic("t").channel("c")
    Producer(broker)(mpub("t", bodies))
    broker.clock.advance(0)
    consumer = quiet_client(broker, 7001)
    consumer.sub("t", "c", 0)
    transport = http.send("GET", "/channel/peek?topic=t&channel=c&n=600&max_body=8")
    assert parse_response(transport.value()) is None
    # A consumer takes the first 400 while the answer is being built.
    consumer.send(b"RDY 400\n")
    reactor_turn(broker.clock)
    taken = [m.body for m in consumer.messages()]
    assert taken == bodies[:400]
    while (response := parse_response(transport.value())) is None:
        reactor_turn(broker.clock)
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    answer = response.json()
    shown = [int(body_of(m)[:4]) for m in answer["messages"]]
    assert shown == sorted(set(shown)), "out of order or twice"
    assert answer["total"] == 600
    # What had been read into the answer before the consumer came stays; of the rest, none it took.
    before = [i for i in shown if i < 400]
    assert before == list(range(len(before))) and len(before) < 400
    assert shown[len(before):] == list(range(400, 400 + len(shown) - len(before)))
    assert all((m["size"], m["truncated"]) == (4096, True) for m in answer["messages"])
    broker.close()


def test_lmdb_pieces_are_bounded_and_copy_only_the_cut(tmp_path, clock):
    from backends.lmdb_queue import PEEK_PIECE_BYTES, PEEK_PIECE_COUNT

    store = lmdb_store(tmp_path, clock)
    q = store.open_queue("t")
    big = [m for m in msgs(40, body=b"B" * 100_000)]
    small = msgs(600, start=100)
    q.put(big + small)
    clock.advance(0)  # committed
    pieces = list(q.peek_pieces(1000, 16))
    got = [m for piece in pieces for m in piece]
    assert [m.id for m, _ in got] == [m.id for m in big + small]
    assert all(len(m.body) <= 16 for m, _ in got)
    assert [size for _, size in got] == [len(m.body) for m in big + small]
    assert all(len(piece) <= PEEK_PIECE_COUNT for piece in pieces) and len(pieces) >= 3
    wide = list(q.peek_pieces(1000, 100_000))
    assert all(sum(min(s, 100_000) for _, s in piece) <= PEEK_PIECE_BYTES + 100_000 for piece in wide)
    assert q.depth() == 640 and [m.id for m in q.read(3)] == [m.id for m in big[:3]]
    store.close()


# -- the bytes of answers in progress ---------------------------------------------------------------


def test_past_the_bound_a_peek_is_refused_and_the_count_returns_to_zero(tmp_path):
    broker = make(tmp_path, "memory", mem_queue_size=1000)
    http = HTTPClient(broker)
    big_backlog(broker, 100, MB)
    building = [http.send("GET", "/channel/peek?topic=t&channel=c&n=100") for _ in range(PEEK_ANSWERS)]
    assert all(parse_response(t.value()) is None for t in building)
    assert http.site.state.peeks.held == PEEK_ANSWERS * 4 * MB
    busy = http.get("/topic/peek?topic=t")
    assert error(busy) == (503, "PEEK_BUSY")
    while any(parse_response(t.value()) is None for t in building):
        broker.clock.advance(0)
    assert all(parse_response(t.value()).status == 200 for t in building)
    assert http.site.state.peeks.held == 0
    assert http.turned("GET", "/channel/peek?topic=t&channel=c&n=1").status == 200
    broker.close()


def test_an_answer_waiting_for_a_slow_client_stays_counted(tmp_path):
    broker = make(tmp_path, "memory", mem_queue_size=1000)
    http = HTTPClient(broker)
    big_backlog(broker, 50, 40 * KIB)
    transport = slow_get(http, "/channel/peek?topic=t&channel=c&n=50")
    broker.clock.advance(0)
    first = transport.drain()  # as far as the client read before its window closed
    held = http.site.state.peeks.held
    assert 0 < held < 4 * MB, "the reservation shrinks to what the answer still holds"
    length = int(parse_response(first + b"x" * 10**7).headers["content-length"])
    head = first.index(b"\r\n\r\n") + 4
    # Not counted: what sits in the transport's buffer (up to its limit and one more write).
    assert held <= length - (len(first) - head) <= held + 64 * KIB + WRITE_CHUNK
    body = first[head:]
    while http.site.state.peeks.held:
        body += transport.drain()
    body += transport.drain()
    assert len(body) == length and json.loads(body)["total"] == 50
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    broker.close()


def test_a_client_gone_gives_its_bytes_back(tmp_path):
    broker = make(tmp_path, "memory", mem_queue_size=1000)
    http = HTTPClient(broker)
    big_backlog(broker, 100, MB)
    # Gone while the answer is built...
    transport = http.send("GET", "/channel/peek?topic=t&channel=c&n=100")
    broker.clock.advance(0)
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    for _ in range(100):
        broker.clock.advance(0)
    assert http.site.state.peeks.held == 0
    # ... and while it is written.
    transport = slow_get(http, "/channel/peek?topic=t&channel=c&n=100")
    broker.clock.advance(0)
    transport.drain()
    assert 0 < http.site.state.peeks.held < 4 * MB
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    assert http.site.state.peeks.held == 0
    broker.close()


def test_in_flight_and_deferred_are_bounded_too(tmp_path):
    broker = make(tmp_path, "memory", mem_queue_size=1000, max_heartbeat_interval="24h")
    http = HTTPClient(broker)
    big_backlog(broker, 10, 200 * KIB)
    consumer = Client(broker, port=7002)
    assert consumer.request(identify(heartbeat_interval=86_400_000)) == [ok()]
    consumer.sub("t", "c", 10)
    broker.clock.advance(0)
    got = consumer.messages()
    assert len(got) == 10
    for m in got[5:]:
        consumer.req(m, 60_000)
    broker.clock.advance(0)
    for state, count in (("in_flight", 5), ("deferred", 5)):
        answer, size = answer_of(http, f"/channel/peek?topic=t&channel=c&state={state}&max_body=100")
        assert len(answer["messages"]) == count and size < 10 * KIB
        assert all((m["size"], m["truncated"], len(body_of(m))) == (200 * KIB, True, 100)
                   for m in answer["messages"])
    broker.close()


@pytest.mark.parametrize("durable", [False, True])
def test_lmdb_pieces_show_what_peek_shows(tmp_path, clock, monkeypatch, durable):
    """Held records passed over, pending rewrites and deletes honoured, the tail after the records:
    piece by piece (two records a piece here) exactly what `peek` shows."""
    import backends.lmdb_queue

    monkeypatch.setattr(backends.lmdb_queue, "PEEK_PIECE_COUNT", 2)

    def pieced(q, n):
        return [(m.id, m.attempts, size) for piece in q.peek_pieces(n, 1 << 20) for m, size in piece]

    def peeked(q, n):
        return [(m.id, m.attempts, len(m.body)) for m in q.peek(n)]

    store = lmdb_store(tmp_path, clock, durable=durable)
    q = store.open_queue("t:c")
    q.put(msgs(5))
    q.hold(msgs(2, start=100))
    q.put(msgs(4, start=5))
    clock.advance(0)
    q.put(msgs(3, start=20))  # the tail (durable: readable once committed)
    for n in (1, 2, 3, 7, 100):
        assert pieced(q, n) == peeked(q, n), n
    clock.advance(0)
    store.close()
    # After a restart the records are read from LMDB: a held one, a rewrite and a delete pending.
    store = lmdb_store(tmp_path, clock, durable=durable)
    q = store.open_queue("t:c")
    q.hold(msgs(2, start=200))
    q.put(msgs(3, start=300))
    clock.advance(0)
    q.put(msgs(2, start=400))
    assert [m.id for m in q.read(1)] == [msgs(1)[0].id]
    stored = q.peek(100)
    stored[1].attempts = 9
    q.update([stored[1]])
    q.finish([stored[3]])
    assert len(pieced(q, 100)) >= 10
    for n in (1, 2, 5, 9, 100):
        assert pieced(q, n) == peeked(q, n), n
    store.close()
