"""GET /channel/peek and /topic/peek: order, states, caps, errors, and that a peek changes nothing.

Every scenario runs on the three stores a queue can sit on: the memory
backend, LMDB in default mode (memory queue, then LMDB) and LMDB
--durable (everything in LMDB, deferred messages held there). A small
mem-queue-size makes the queues overflow into the backend, so the order
across memory and backend is looked at. "Changes nothing" is checked
twice: /stats before and after peeking, then a broker that was peeked all
along and one that never was are drained and must deliver the same
messages with the same attempts in the same order.
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from backends.dummy import DummyQueue
from backends.memory import MemoryQueue
from mqd.message import Message
from mqd.nsqd.http.peek import MAX_PEEK
from tests.support.http_client import HTTPClient, error
from tests.support.inprocess_broker import START_TIME, lmdb_store, msgs, scan
from tests.support.peek_brokers import MEM, MODES, Producer, make, quiet_client
from tests.support.v2_client import Client
from tests.support.v2_frames import Msg, cmd, dpub, mpub, pub

NS = 1_000_000_000


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


def peek(http: HTTPClient, path: str) -> dict:
    # A large peek is built a slice at a time: the clock turns until it is answered.
    response = http.turned("GET", path)
    assert response.status == 200, response.body
    assert response.v1 and response.is_json
    return response.json()


def bodies(answer: dict) -> list[bytes]:
    return [base64.b64decode(m["body"]) for m in answer["messages"]]


def channel_numbers(broker, channel: str = "c") -> tuple:
    ch = broker.topics["t"].channels[channel]
    return (ch.depth(), ch.backend_depth(), ch.in_flight_count(), ch.deferred_count(),
            ch.message_count, ch.requeue_count, ch.timeout_count)


M = [b"m%d" % i for i in range(12)]
N = [b"n%d" % i for i in range(3)]


def backlog(broker, between=lambda: None) -> dict:
    """Topic t with channels c (a client holding messages) and c2 (idle), a backlog in every state.

    c: queued m3..m11 n0..n2; in flight m2 then m0 (TOUCHed later);
    deferred m1 (REQ 1 s), d2 (DPUB 2 s), d5 (DPUB 5 s).
    c2: queued m0..m11 n0..n2; deferred d2, d5. `between` runs after each step.
    """
    clock = broker.clock
    t0 = clock.seconds()
    holder = quiet_client(broker, 6000)
    holder.sub("t", "c", 0)
    idle = quiet_client(broker, 6001)
    idle.sub("t", "c2", 0)
    between()
    producer = Producer(broker)
    producer(mpub("t", M))
    between()
    producer(dpub("t", 5000, b"d5"))
    producer(dpub("t", 2000, b"d2"))
    between()
    producer(mpub("t", N))
    between()
    holder.send(cmd("RDY", 3))
    got = holder.messages()
    assert [m.body for m in got] == M[:3]
    holder.send(cmd("RDY", 0))
    holder.req(got[1], 1000)
    between()
    clock.advance(0.5)
    holder.touch(got[0])
    clock.advance(0)
    assert holder.read() == []
    between()
    return {"t0": t0, "holder": holder, "idle": idle, "producer": producer, "got": got}


# -- order and content of each state -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_every_state_in_order(tmp_path, mode):
    broker = make(tmp_path, mode)
    http = HTTPClient(broker)
    b = backlog(broker)
    t0, got = b["t0"], b["got"]

    queued = peek(http, "/channel/peek?topic=t&channel=c")
    assert (queued["topic"], queued["channel"], queued["state"], queued["total"]) == ("t", "c", "queued", 12)
    assert bodies(queued) == M[3:] + N
    first = queued["messages"][0]
    assert set(first) == {"id", "attempts", "timestamp", "size", "body", "body_text", "deferred_until",
                          "timeout_at", "client", "truncated"}
    assert (first["attempts"], first["timestamp"], first["size"], first["body_text"]) == (0, ns(t0), 2, "m3")
    assert (first["deferred_until"], first["timeout_at"], first["client"]) == (None, None, None)
    assert all(len(m["id"]) == 16 and int(m["id"], 16) >= 0 for m in queued["messages"])
    assert len({m["id"] for m in queued["messages"]}) == 12

    in_flight = peek(http, "/channel/peek?topic=t&channel=c&state=in_flight")
    assert (in_flight["state"], in_flight["total"]) == ("in_flight", 2)
    # m2 times out at t0 + 60 s; m0 was TOUCHed at t0 + 0.5 s.
    assert [(m["id"].encode(), m["attempts"], m["timeout_at"], m["client"], m["deferred_until"])
            for m in in_flight["messages"]] == [
        (got[2].id, 1, ns(t0 + 60), "127.0.0.1:6000", None),
        (got[0].id, 1, ns(t0 + 60.5), "127.0.0.1:6000", None),
    ]

    deferred = peek(http, "/channel/peek?topic=t&channel=c&state=deferred")
    assert (deferred["state"], deferred["total"]) == ("deferred", 3)
    assert [(base64.b64decode(m["body"]), m["attempts"], m["deferred_until"], m["timeout_at"], m["client"])
            for m in deferred["messages"]] == [
        (b"m1", 1, ns(t0 + 1), None, None),
        (b"d2", 0, ns(t0 + 2), None, None),
        (b"d5", 0, ns(t0 + 5), None, None),
    ]
    assert deferred["messages"][0]["id"].encode() == got[1].id

    idle = peek(http, "/channel/peek?topic=t&channel=c2&n=1000")
    assert (idle["total"], bodies(idle)) == (15, M + N)
    assert [m["attempts"] for m in idle["messages"]] == [0] * 15
    assert bodies(peek(http, "/channel/peek?topic=t&channel=c2&state=deferred")) == [b"d2", b"d5"]
    assert peek(http, "/channel/peek?topic=t&channel=c2&state=in_flight")["messages"] == []
    # The topic itself holds nothing while it has channels.
    assert peek(http, "/topic/peek?topic=t") == {"topic": "t", "channel": None, "state": "queued",
                                                 "total": 0, "messages": [], "more": False,
                                                 "max_body": 65536}
    broker.close()


@pytest.mark.parametrize("mode", MODES)
def test_queued_order_spans_memory_and_backend(tmp_path, mode):
    broker = make(tmp_path, mode)
    http = HTTPClient(broker)
    quiet_client(broker, 6000).sub("t", "c", 0)
    producer = Producer(broker)
    for i in range(10):
        producer(pub("t", b"%d" % i))
    ch = broker.topics["t"].channels["c"]
    if mode == "durable":
        assert (len(ch._queue.mem), ch.backend_depth()) == (0, 10)
    else:
        assert (len(ch._queue.mem), ch.backend_depth()) == (MEM, 10 - MEM)
    for n in range(1, 12):
        assert bodies(peek(http, f"/channel/peek?topic=t&channel=c&n={n}")) == [
            b"%d" % i for i in range(min(n, 10))]
    broker.close()


@pytest.mark.parametrize("mode", MODES)
def test_topic_peek_shows_what_waits_for_channels(tmp_path, mode):
    broker = make(tmp_path, mode)
    http = HTTPClient(broker)
    producer = Producer(broker)
    producer(mpub("u", [b"u%d" % i for i in range(9)]))
    producer(dpub("u", 3000, b"later"))
    answer = peek(http, "/topic/peek?topic=u")
    assert (answer["topic"], answer["channel"], answer["state"], answer["total"]) == ("u", None, "queued", 10)
    assert bodies(answer) == [b"u%d" % i for i in range(9)] + [b"later"]
    # A DPUB waiting at a topic is queued there, with its due time.
    assert [m["deferred_until"] for m in answer["messages"]] == [None] * 9 + [ns(START_TIME + 3)]
    assert bodies(peek(http, "/topic/peek?topic=u&n=3&state=queued")) == [b"u0", b"u1", b"u2"]
    assert broker.topics["u"].depth() == 10
    # The channel created afterwards gets everything, in the order peeked.
    c = quiet_client(broker, 6000)
    c.sub("u", "c", 100)
    broker.clock.advance(0)
    assert [m.body for m in c.messages()] == [b"u%d" % i for i in range(9)]
    broker.close()


def test_ephemeral_channel_peeks_its_memory(tmp_path):
    broker = make(tmp_path, "lmdb")
    http = HTTPClient(broker)
    quiet_client(broker, 6000).sub("t", "e#ephemeral", 0)
    Producer(broker)(mpub("t", M))
    answer = peek(http, "/channel/peek?topic=t&channel=e%23ephemeral&n=100")
    # mem-queue-size kept, the rest dropped, as nsqd's dummy backend does.
    assert (answer["total"], bodies(answer)) == (MEM, M[:MEM])
    broker.close()


# -- bodies and caps ------------------------------------------------------------------------------


def test_body_base64_and_text(tmp_path):
    broker = make(tmp_path, "memory")
    http = HTTPClient(broker)
    raw = b"\xff\xfe\x00binary\x80"
    text = "h\u00e9llo \u2603 {\"k\": 1}".encode()
    Producer(broker)(mpub("t", [raw, text]))
    answer = peek(http, "/topic/peek?topic=t")
    first, second = answer["messages"]
    assert (first["body"], first["body_text"], first["size"]) == (base64.b64encode(raw).decode(), None, len(raw))
    assert (second["body"], second["body_text"], second["size"]) == (
        base64.b64encode(text).decode(), text.decode(), len(text))
    broker.close()


@pytest.mark.parametrize("mode", MODES)
def test_n_default_and_cap(tmp_path, mode):
    broker = make(tmp_path, mode)
    http = HTTPClient(broker)
    sent = [b"%04d" % i for i in range(1500)]
    Producer(broker)(mpub("t", sent))
    for query, count in [("", 20), ("&n=1", 1), ("&n=999", 999), ("&n=1000", 1000), ("&n=1001", 1000),
                         ("&n=5000", 1000), ("&n=99999999999999999999999", 1000), ("&n=007", 7)]:
        answer = peek(http, "/topic/peek?topic=t" + query)
        assert answer["total"] == 1500
        assert bodies(answer) == sent[:count], query
    assert MAX_PEEK == 1000
    broker.close()


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("query", "expected"), [
    ("", (400, "MISSING_ARG_TOPIC")),
    ("?channel=c", (400, "MISSING_ARG_TOPIC")),
    ("?topic=t", (400, "MISSING_ARG_CHANNEL")),
    ("?topic=b@d&channel=c", (400, "INVALID_ARG_TOPIC")),
    ("?topic=&channel=c", (400, "INVALID_ARG_TOPIC")),
    ("?topic=t&channel=b@d", (400, "INVALID_ARG_CHANNEL")),
    ("?topic=t&channel=c;", (400, "INVALID_REQUEST")),
    ("?topic=t&channel=%zz", (400, "INVALID_REQUEST")),
    ("?topic=nope&channel=c", (404, "TOPIC_NOT_FOUND")),
    ("?topic=t&channel=nope", (404, "CHANNEL_NOT_FOUND")),
    # Names and existence come first, then n and state (as nsqd checks /pub's defer after the topic).
    ("?topic=nope&channel=c&n=0", (404, "TOPIC_NOT_FOUND")),
    ("?topic=t&channel=c&n=0", (400, "INVALID_N")),
    ("?topic=t&channel=c&n=-1", (400, "INVALID_N")),
    ("?topic=t&channel=c&n=", (400, "INVALID_N")),
    ("?topic=t&channel=c&n=abc", (400, "INVALID_N")),
    ("?topic=t&channel=c&n=1.5", (400, "INVALID_N")),
    ("?topic=t&channel=c&n=%2B3", (400, "INVALID_N")),
    ("?topic=t&channel=c&n=1e3", (400, "INVALID_N")),
    ("?topic=t&channel=c&state=", (400, "INVALID_STATE")),
    ("?topic=t&channel=c&state=QUEUED", (400, "INVALID_STATE")),
    ("?topic=t&channel=c&state=inflight", (400, "INVALID_STATE")),
    ("?topic=t&channel=c&n=0&state=bogus", (400, "INVALID_N")),
])
def test_channel_peek_errors(inproc_broker, http, query, expected):
    Client(inproc_broker, port=6000).sub("t", "c", 0)
    assert error(http.get("/channel/peek" + query)) == expected
    assert sorted(inproc_broker.topics) == ["t"]
    assert sorted(inproc_broker.topics["t"].channels) == ["c"]


@pytest.mark.parametrize(("query", "expected"), [
    ("", (400, "MISSING_ARG_TOPIC")),
    ("?topic=", (400, "INVALID_ARG_TOPIC")),
    ("?topic=b@d", (400, "INVALID_ARG_TOPIC")),
    ("?topic=t;", (400, "INVALID_REQUEST")),
    ("?topic=nope", (404, "TOPIC_NOT_FOUND")),
    ("?topic=t&n=0", (400, "INVALID_N")),
    ("?topic=t&n=x", (400, "INVALID_N")),
    # A topic's own queue only holds queued messages.
    ("?topic=t&state=in_flight", (400, "INVALID_STATE")),
    ("?topic=t&state=deferred", (400, "INVALID_STATE")),
])
def test_topic_peek_errors(inproc_broker, http, query, expected):
    Producer(inproc_broker)(pub("t", b"x"))
    assert error(http.get("/topic/peek" + query)) == expected
    assert sorted(inproc_broker.topics) == ["t"]
    assert inproc_broker.topics["t"].channels == {}


@pytest.mark.parametrize("path", ["/channel/peek?topic=t&channel=c", "/topic/peek?topic=t"])
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_only_get(inproc_broker, http, path, method):
    Client(inproc_broker, port=6000).sub("t", "c", 0)
    response = http.request(method, path, b"")
    assert error(response) == (405, "METHOD_NOT_ALLOWED")
    assert response.header("Allow") == "GET, OPTIONS"


# -- a peek changes nothing -------------------------------------------------------------------------


def peek_everything(http: HTTPClient) -> None:
    for path in ("/channel/peek?topic=t&channel=c", "/channel/peek?topic=t&channel=c2", "/topic/peek?topic=t"):
        for n in (1, 2, 5, 20, 1000):
            for state in (("queued", "in_flight", "deferred") if "channel" in path else ("queued",)):
                peek(http, f"{path}&n={n}&state={state}")


def drain(broker, channel: str, port: int) -> list[tuple[bytes, int, bytes]]:
    """Let every timer run out, then consume and FIN everything: (id, attempts, body) in delivery order."""
    clock = broker.clock
    clock.advance(61)
    scan(broker)
    c = quiet_client(broker, port)
    c.sub("t", channel, 100)
    ch = broker.topics["t"].channels[channel]
    out = []
    for _ in range(100):
        clock.advance(0)
        frames = [f for f in c.read() if isinstance(f, Msg)]
        for m in frames:
            out.append((m.id, m.attempts, m.body))
            c.fin(m)
        clock.advance(0)
        if not frames and not (ch.depth() or ch.in_flight_count() or ch.deferred_count()):
            return out
        clock.advance(1)
        scan(broker)
    raise AssertionError(f"{channel} never drained: {channel_numbers(broker, channel)}")


@pytest.mark.parametrize("mode", MODES)
def test_peek_changes_nothing(tmp_path, mode):
    peeked = make(tmp_path / "peeked", mode)
    plain = make(tmp_path / "plain", mode)
    http = HTTPClient(peeked)

    def stats() -> dict:
        return peek(http, "/stats?format=json&include_mem=false")["topics"]

    backlog(peeked, between=lambda: peek_everything(http))
    backlog(plain)
    before = stats()
    peek_everything(http)
    assert stats() == before
    for channel in ("c", "c2"):
        assert channel_numbers(peeked, channel) == channel_numbers(plain, channel)
    assert (peeked.topics["t"].depth(), peeked.topics["t"].backend_depth()) == (0, 0)

    got = {}
    for name, broker in (("peeked", peeked), ("plain", plain)):
        got[name] = {channel: drain(broker, channel, 7000 + i) for i, channel in enumerate(("c", "c2"))}
    assert got["peeked"] == got["plain"]
    for channel in ("c", "c2"):
        delivered = [body for _, _, body in got["peeked"][channel]]
        assert sorted(delivered) == sorted(M + N + [b"d2", b"d5"])
    # Timed-out, requeued and deferred messages came back with their attempts.
    attempts = {body: a for _, a, body in got["peeked"]["c"]}
    assert (attempts[b"m0"], attempts[b"m1"], attempts[b"m2"], attempts[b"m3"]) == (2, 2, 2, 1)
    peeked.close()
    plain.close()


@pytest.mark.parametrize("mode", ["lmdb", "durable"])
def test_peek_before_the_commit(tmp_path, mode):
    """Puts and requeues not committed yet are peeked where the next reads will find them."""
    broker = make(tmp_path, mode, mem_queue_size=0)
    http = HTTPClient(broker)
    holder = quiet_client(broker, 6000)
    holder.sub("t", "c", 0)
    p = Client(broker, port=5000)
    p.send(mpub("t", [b"a", b"b", b"c"]))
    # Not committed yet: the backend serves them from its tail (durable: only once committed).
    assert broker.store._pending()
    assert bodies(peek(http, "/channel/peek?topic=t&channel=c")) == ([] if mode == "durable" else [b"a", b"b", b"c"])
    broker.clock.advance(0)
    holder.send(cmd("RDY", 1))
    (a,) = holder.messages()
    holder.send(cmd("RDY", 0))
    # The refill moved all three to memory; the requeued one goes behind the others
    # (durable: in memory, its record rewritten at the next commit; default: put again).
    holder.req(a, 0)
    answer = peek(http, "/channel/peek?topic=t&channel=c")
    assert [(m["body_text"], m["attempts"]) for m in answer["messages"]] == [("b", 0), ("c", 0), ("a", 1)]
    broker.clock.advance(0)
    holder.send(cmd("RDY", 10))
    assert [(m.body, m.attempts) for m in holder.messages()] == [(b"b", 1), (b"c", 1), (b"a", 2)]
    broker.close()


# -- the backends' peek ----------------------------------------------------------------------------


def test_memory_and_dummy_queue_peek():
    q = MemoryQueue("t")
    q.put(msgs(5))
    assert [m.id for m in q.peek(3)] == [m.id for m in msgs(3)]
    assert len(q.peek(100)) == 5 and q.peek(0) == [] and q.depth() == 5
    assert [m.id for m in q.read(5)] == [m.id for m in msgs(5)]
    d = DummyQueue("t")
    d.put(msgs(5))
    assert d.peek(5) == []


def _state(q) -> tuple:
    writes = q._writes
    return (q._read_seq, q._depth, q._next_seq, [m.key for m in q._tail], set(q._held),
            dict(writes.puts), dict(writes.updates), set(writes.dels), writes.commit_call)


def _peek_then_read(q, n: int) -> list[Message]:
    state = _state(q)
    peeked = q.peek(n)
    assert _state(q) == state
    seen = [(m.id, m.attempts, m.body) for m in peeked]
    read = q.read(n)
    assert seen == [(m.id, m.attempts, m.body) for m in read]
    return read


@pytest.mark.parametrize("durable", [False, True])
def test_lmdb_peek_is_the_next_read(tmp_path, clock, durable):
    store = lmdb_store(tmp_path, clock, durable=durable)
    q = store.open_queue("t:c")
    q.put(msgs(10))
    clock.advance(0)
    q.hold(msgs(3, start=100))  # deferred, stored past the records so far (durable only)
    q.put(msgs(5, start=10))
    clock.advance(0)
    q.put(msgs(2, start=20))  # still in the tail, uncommitted (durable: not readable until committed)
    if durable:
        assert [m.id for m in q.peek(100)] == [m.id for m in msgs(10) + msgs(5, start=10)]
        clock.advance(0)
    assert [m.id for m in q.peek(100)] == [m.id for m in msgs(10) + msgs(5, start=10) + msgs(2, start=20)]
    read = []
    for n in (1, 2, 3, 5, 8, 100):
        read += _peek_then_read(q, n)
    assert [m.id for m in read] == [m.id for m in msgs(10) + msgs(5, start=10) + msgs(2, start=20)]
    assert q.peek(10) == [] and q.read(10) == []
    store.close()


def test_lmdb_peek_after_restart_skips_held_and_deleted_and_takes_rewrites(tmp_path, clock):
    """Records read from LMDB (no tail): held ones passed over, a pending delete and rewrite honoured."""
    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t:c")
    q.put(msgs(4))
    q.hold(msgs(2, start=100))  # after a restart these are plain records (deferred ones, in the broker)
    q.put(msgs(4, start=4))
    clock.advance(0)
    store.close()
    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t:c")
    assert not q._tail and q.depth() == 10
    q.hold(msgs(2, start=200))  # held now: stored before the tail, never read
    clock.advance(0)
    q.put(msgs(2, start=300))
    clock.advance(0)  # durable: readable once committed
    assert [m.id for m in q.read(1)] == [msgs(1)[0].id]
    stored = q.peek(100)
    ids = [m.id for m in msgs(4) + msgs(2, start=100) + msgs(4, start=4) + msgs(2, start=300)]
    assert [m.id for m in stored] == ids[1:]
    # A record past the read position rewritten (new attempts), another deleted, both pending.
    rewritten = stored[2]
    rewritten.attempts = 7
    q.update([rewritten])
    gone = stored[4]
    q.finish([gone])
    assert gone.key is None and store._pending()
    expected = [(m.id, m.attempts) for i, m in enumerate(stored) if i != 4]
    peeked = q.peek(100)
    assert [(m.id, m.attempts) for m in peeked] == expected
    assert peeked[2] is rewritten
    assert [(m.id, m.attempts) for m in peeked[:3]] == [(m.id, m.attempts) for m in q.peek(3)]
    assert [(m.id, m.attempts) for m in _peek_then_read(q, 100)] == expected
    store.close()


# -- random sequences -----------------------------------------------------------------------------------

_OPS = st.lists(st.one_of(
    st.tuples(st.just("pub"), st.integers(1, 8)),
    st.tuples(st.just("dpub"), st.integers(1, 3000)),
    st.tuples(st.just("rdy"), st.integers(0, 8)),
    st.tuples(st.just("fin"), st.integers(0, 4)),
    st.tuples(st.just("req"), st.integers(0, 2000)),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.5, 1.0, 3.0, 61.0])),
    st.tuples(st.just("peek"), st.integers(1, 30)),
), min_size=3, max_size=40)


class _Run:
    """One broker driven by an op sequence, with what its consumer received."""

    def __init__(self, path: Path, mode: str) -> None:
        self.broker = make(path, mode, mem_queue_size=3)
        self.http = HTTPClient(self.broker)
        self.producer = Producer(self.broker)
        self.consumer = quiet_client(self.broker, 6000)
        self.consumer.sub("t", "c", 0)
        self.held: list[Msg] = []
        self.log: list[tuple[bytes, int, bytes]] = []
        self.finished: list[bytes] = []
        self.sent = 0

    def receive(self) -> None:
        self.broker.clock.advance(0)
        for m in self.consumer.messages():
            self.log.append((m.id, m.attempts, m.body))
            # A message that timed out and came back is held once.
            self.held = [h for h in self.held if h.id != m.id]
            self.held.append(m)

    def do(self, op: str, arg, peeking: bool) -> None:
        broker = self.broker
        if op == "pub":
            self.producer(mpub("t", [b"%d" % (self.sent + i) for i in range(arg)]))
            self.sent += arg
        elif op == "dpub":
            self.producer(dpub("t", arg, b"%d" % self.sent))
            self.sent += 1
        elif op == "rdy":
            self.consumer.send(cmd("RDY", arg))
        elif op == "fin":
            for m in self.held[:arg]:
                self.consumer.fin(m)
                self.finished.append(m.body)
            del self.held[:arg]
        elif op == "req":
            if self.held:
                self.consumer.req(self.held.pop(0), arg)
        elif op == "wait":
            broker.clock.advance(arg)
            scan(broker)
            # Timed-out messages are no longer ours to FIN.
            live = broker.topics["t"].channels["c"]._in_flight
            self.held = [m for m in self.held if m.id in live]
        elif op == "peek" and peeking:
            for state in ("queued", "in_flight", "deferred"):
                peek(self.http, f"/channel/peek?topic=t&channel=c&n={arg}&state={state}")
        self.receive()

    def finish_everything(self) -> None:
        """Take and FIN whatever is left, letting deferrals and timeouts run out."""
        self.do("rdy", 1000, False)
        for _ in range(10):
            self.do("fin", len(self.held), False)
            self.do("wait", 61.0, False)


# The mode is drawn rather than parametrized: pytest-twisted runs only the
# first parametrized case of a hypothesis test.
@hsettings(max_examples=40, deadline=None)
@given(mode=st.sampled_from(sorted(MODES)), ops=_OPS)
def test_random_sequences_consume_the_same_with_and_without_peeks(mode, ops):
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_Run(Path(tmp) / "peeked", mode), _Run(Path(tmp) / "plain", mode)]
        for op, arg in ops:
            for run, peeking in zip(runs, (True, False), strict=True):
                run.do(op, arg, peeking)
            assert runs[0].log == runs[1].log
            assert channel_numbers(runs[0].broker) == channel_numbers(runs[1].broker)
        for run in runs:
            run.finish_everything()
        assert runs[0].log == runs[1].log
        peeked = runs[0]
        assert sorted(peeked.finished) == sorted(b"%d" % i for i in range(peeked.sent))
        assert channel_numbers(peeked.broker)[:4] == (0, 0, 0, 0)
        for run in runs:
            run.broker.close()
