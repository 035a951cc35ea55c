"""A legal but huge publish must not hold the reactor: it used to, for seconds.

One MPUB of 1,048,575 one-byte messages kept every other client waiting
~2.5 s and grew the broker by ~320 MB; a text /mpub of 2.6 M lines, ~8 s
and ~800 MB. Big batches are now checked whole, then published a chunk per
reactor turn (mqd.nsqd.batches); these tests drive the broker turn by turn, as
the reactor runs it, and look at the order of events, never at timings.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
import tracemalloc
import urllib.request

import pytest

from mqd.http.response import ApiError
from mqd.nsqd import batches as publisher
from mqd.nsqd.http.publish import split_text_mpub
from tests.support.http_client import HTTPClient, error, parse_response
from tests.support.inprocess_broker import failing_once
from tests.support.reactor_turns import CHUNK, run_turns, turn
from tests.support.v2_client import consumer, publisher_client
from tests.support.v2_frames import cmd, err, mpub, mpub_body, ok, pub, sized


def drain(broker, clock, topic: str, n: int) -> list[bytes]:
    """The bodies a new channel's consumer gets, FINed as they come, in order."""
    c = consumer(broker, topic, "drain", rdy=broker.options.max_rdy_count)
    got: list[bytes] = []
    while len(got) < n:
        clock.advance(0)  # the topic hands its backlog over a batch per turn
        msgs = c.messages()
        assert msgs, f"only {len(got)} of {n} messages"
        for m in msgs:
            got.append(m.body)
            c.fin(m)
    return got


# -- TCP MPUB -------------------------------------------------------------------------------


def test_bystander_answered_between_chunks_of_a_huge_mpub(inproc_broker, clock, small_chunks):
    n = 40 * CHUNK + 7
    bodies = [b"%d" % i for i in range(n)]
    p = publisher_client(inproc_broker)
    # A PUB pipelined behind the MPUB in the same read: answered after it.
    p.send(mpub("big", bodies) + pub("big", b"tail"))
    topic = inproc_broker.topics["big"]
    assert p.read() == []  # nothing answered within the read itself
    run_turns(clock, lambda: topic.message_count > 0)
    # Mid-way: part of the batch is in, and another client is served now.
    assert 0 < topic.message_count < n
    assert p.read() == []
    bystander = publisher_client(inproc_broker, port=5001)
    assert bystander.request(pub("other", b"y")) == [ok()]
    assert bystander.request(mpub("big", [b"b1", b"b2"])) == [ok()]
    turns = run_turns(clock, lambda: p.transport.value())
    assert turns > 1
    assert p.read() == [ok(), ok()]  # the MPUB's OK, then the PUB read after it
    assert p.proto.pub_counts == {"big": n + 1}
    # Every message once, the publisher's own in its order; the bystander's
    # two landed between two chunks (as concurrent publishers may in nsqd).
    got = drain(inproc_broker, clock, "big", n + 3)
    assert [b for b in got if not b.startswith(b"b")] == bodies + [b"tail"]
    assert sorted(got) == sorted(bodies + [b"tail", b"b1", b"b2"])
    assert 0 < got.index(b"b1") < n


def test_huge_mpub_holds_the_connection_input_until_answered(inproc_broker, clock, small_chunks):
    """What arrives while a big MPUB is published waits: commands are answered in order."""
    n = 10 * CHUNK
    p = publisher_client(inproc_broker)
    p.send(mpub("big", [b"x"] * n))
    assert p.transport.producerState == "paused"
    p.send(pub("big", b"after") + cmd("NOP"))
    assert p.read() == []
    run_turns(clock, lambda: p.transport.value())
    assert p.read() == [ok(), ok()]
    assert p.transport.producerState == "producing"
    assert inproc_broker.topics["big"].message_count == n + 1
    assert drain(inproc_broker, clock, "big", n + 1)[-1] == b"after"


def test_huge_mpub_bad_last_message_found_over_turns_publishes_nothing(inproc_broker, clock, small_chunks):
    n = 20 * CHUNK
    body = mpub_body([b"x"] * (n - 1)) + struct.pack(">i", 0)
    body = struct.pack(">i", n) + body[4:]
    p = publisher_client(inproc_broker)
    p.send(cmd("MPUB", "big") + sized(body))
    assert p.read() == []
    assert publisher_client(inproc_broker, port=5001).request(pub("other", b"y")) == [ok()]
    run_turns(clock, lambda: p.transport.value())
    assert p.read() == [err(f"E_BAD_MESSAGE MPUB invalid message({n - 1}) body size 0")]
    assert p.closed
    assert inproc_broker.topics["big"].message_count == 0


def test_huge_mpub_bytes_inside_the_declared_size_are_the_next_command(
        inproc_broker, clock, small_chunks):
    # nsqd reads MPUB's messages from the stream: the declared size is
    # no frame, so the NOP inside it is a command of its own (no answer).
    body = mpub_body([b"x"] * (5 * CHUNK)) + b"NOP\n"
    p = publisher_client(inproc_broker)
    p.send(cmd("MPUB", "big") + sized(body))
    assert p.transport.value() == b""  # published over turns like any big batch
    run_turns(clock, lambda: p.transport.value())
    assert p.read() == [ok()]
    assert inproc_broker.topics["big"].message_count == 5 * CHUNK


def test_store_failure_mid_way_keeps_earlier_chunks_and_fails_the_mpub(
        make_broker, clock, small_chunks):
    """nsqd's PutMessages: messages put before the failure stay published; E_MPUB_FAILED (fatal)."""
    broker = make_broker(backend="lmdb", mem_queue_size=0)  # every message is written
    n = 10 * CHUNK
    p = publisher_client(broker)
    p.send(mpub("big", [b"%d" % i for i in range(n)]))
    topic = broker.topics["big"]
    run_turns(clock, lambda: topic.message_count > 0)
    failing_once(broker.store)  # the commit of the chunk just published fails
    run_turns(clock, lambda: p.transport.value())
    assert p.read() == [err("E_MPUB_FAILED MPUB failed LMDB write failed: No space left on device")]
    assert p.closed
    assert 0 < topic.message_count < n
    assert broker.health == "LMDB write failed: No space left on device"
    published = topic.message_count
    clock.advance(5)  # the store's retry commits what it kept
    assert broker.store.failure is None
    assert drain(broker, clock, "big", published) == [b"%d" % i for i in range(published)]


def test_durable_huge_mpub_acks_after_the_commit_of_its_last_chunk(make_broker, clock, small_chunks):
    broker = make_broker(backend="lmdb", durable=True)
    n = 10 * CHUNK
    p = publisher_client(broker)
    p.send(mpub("big", [b"%d" % i for i in range(n)]) + pub("big", b"tail"))
    topic = broker.topics["big"]
    store = broker.store
    seen = []
    for _ in range(1000):
        if not turn(clock):
            break
        seen.append((topic.message_count, store._pending(), p.transport.value()))
    assert len({count for count, _, _ in seen}) > 2  # published over several turns
    answered = next(i for i, (_, _, out) in enumerate(seen) if out)
    # The last chunk went in a turn before the OK, which comes with the
    # commit holding it; the PUB read after the MPUB is answered behind it.
    assert seen[answered - 1][0] == n + 1
    assert not seen[answered][1]
    assert p.read() == [ok(), ok()]


def test_client_gone_mid_batch_still_publishes_it(inproc_broker, clock, small_chunks):
    n = 10 * CHUNK
    p = publisher_client(inproc_broker)
    p.send(mpub("big", [b"x"] * n))
    topic = inproc_broker.topics["big"]
    run_turns(clock, lambda: topic.message_count > 0)
    assert topic.message_count < n
    p.lose()
    clock.advance(0)
    assert topic.message_count == n


def test_topic_deleted_mid_batch_is_mpub_failed_exiting(inproc_broker, clock, small_chunks):
    n = 10 * CHUNK
    p = publisher_client(inproc_broker)
    p.send(mpub("big", [b"x"] * n))
    topic = inproc_broker.topics["big"]
    run_turns(clock, lambda: topic.message_count > 0)
    inproc_broker.delete_topic("big")
    run_turns(clock, lambda: p.transport.value())
    assert p.read() == [err("E_MPUB_FAILED MPUB failed exiting")]
    assert inproc_broker.health is None


def test_two_huge_mpubs_take_turns(inproc_broker, clock, small_chunks):
    n = 10 * CHUNK
    a, b = publisher_client(inproc_broker), publisher_client(inproc_broker, port=5001)
    a.send(mpub("ta", [b"a"] * n))
    b.send(mpub("tb", [b"b"] * n))
    ta, tb = inproc_broker.topics["ta"], inproc_broker.topics["tb"]
    run_turns(clock, lambda: ta.message_count or tb.message_count)
    run_turns(clock, lambda: ta.message_count and tb.message_count)
    assert ta.message_count < n and tb.message_count < n
    clock.advance(0)
    assert a.read() == [ok()] and b.read() == [ok()]


def test_huge_mpub_memory_stays_near_its_bytes(make_broker, clock):
    """Python memory beyond the command's own bytes is bounded by a chunk, not the batch.

    Default settings (LMDB, mem-queue-size 10000) and a subscribed channel.
    Before, every message existed at once as body, id, Message and store
    entry: ~280 B a message (~75 MB here). Now the peak is what stays in
    memory by design, the channel's mem-queue-size messages (~2.5 MB), plus
    one chunk in flight (~1.5 MB): the bound, 32 B a message (8 MB), is
    well above that and far below the old cost.
    """
    broker = make_broker(backend="lmdb")
    consumer(broker, "big", "c", rdy=0)
    n = 262_143
    p = publisher_client(broker)
    data = mpub("big", [b"x"] * n)
    tracemalloc.start()
    try:
        p.send(data)
        run_turns(clock, lambda: p.transport.value())
        clock.advance(0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert p.read() == [ok()]
    assert broker.topics["big"].channels["c"].depth() == n
    assert peak < 32 * n, f"{peak / n:.0f} B a message"


# -- HTTP /mpub ------------------------------------------------------------------------------


def _binary(bodies: list[bytes]) -> bytes:
    return struct.pack(">i", len(bodies)) + b"".join(sized(b) for b in bodies)


@pytest.mark.parametrize("binary", [False, True])
def test_http_huge_mpub_published_over_turns(inproc_broker, clock, small_chunks, binary):
    n = 20 * CHUNK + 3
    bodies = [b"%d" % i for i in range(n)]
    http = HTTPClient(inproc_broker)
    if binary:
        transport = http.send("POST", "/mpub?topic=big&binary=true", _binary(bodies))
    else:
        transport = http.send("POST", "/mpub?topic=big", b"\n".join(bodies) + b"\n\n")
    topic = inproc_broker.topics["big"]
    assert transport.value() == b""
    run_turns(clock, lambda: topic.message_count > 0)
    assert 0 < topic.message_count < n
    assert http.post("/pub?topic=other", b"y").body == b"OK"  # served mid-way
    run_turns(clock, lambda: transport.value())
    r = parse_response(transport.value())
    assert (r.status, r.body) == (200, b"OK") and r.v1
    assert drain(inproc_broker, clock, "big", n) == bodies


@pytest.mark.parametrize(("binary", "body", "expected"), [
    (False, b"x\n" * (20 * CHUNK) + b"y" * 11 + b"\n", (413, "MSG_TOO_BIG")),
    # max-body-size + 1 bytes, sent chunked so no Content-Length refuses it first
    (False, b"x\n" * 5000 + b"x", (413, "BODY_TOO_BIG")),
    (True, _binary([b"x"] * (20 * CHUNK)) + struct.pack(">i", 11) + b"y" * 11, (413, "BAD_MESSAGE")),
])
def test_http_huge_mpub_bad_message_publishes_nothing(make_broker, clock, small_chunks,
                                                               binary, body, expected):
    if binary:
        body = struct.pack(">i", 20 * CHUNK + 1) + body[4:]
    broker = make_broker(max_msg_size=10, max_body_size=10_000)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                       for i in range(0, len(body), 1000)) + b"0\r\n\r\n"
    transport = HTTPClient(broker).send("POST", "/mpub?topic=big" + "&binary=true" * binary, chunked,
                                        headers={"Transfer-Encoding": "chunked"})
    assert transport.value() == b""
    run_turns(clock, lambda: transport.value())
    assert error(parse_response(transport.value())) == expected
    assert broker.topics["big"].message_count == 0


def test_http_durable_huge_mpub_answers_after_the_commit(make_broker, clock, small_chunks):
    broker = make_broker(backend="lmdb", durable=True)
    n = 10 * CHUNK
    transport = HTTPClient(broker).send("POST", "/mpub?topic=big", b"x\n" * n)
    topic = broker.topics["big"]
    assert run_turns(clock, lambda: topic.message_count == n) > 1
    assert transport.value() == b""
    run_turns(clock, lambda: transport.value())
    assert not broker.store._pending()
    assert parse_response(transport.value()).body == b"OK"


def test_http_client_gone_mid_batch_still_publishes_it(inproc_broker, clock, small_chunks):
    from twisted.internet.error import ConnectionDone
    from twisted.python.failure import Failure

    n = 10 * CHUNK
    transport = HTTPClient(inproc_broker).send("POST", "/mpub?topic=big", b"x\n" * n)
    topic = inproc_broker.topics["big"]
    run_turns(clock, lambda: topic.message_count > 0)
    assert topic.message_count < n
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    clock.advance(0)  # answering a request whose connection is gone must not raise
    assert topic.message_count == n


@pytest.mark.parametrize("binary", [False, True])
def test_http_huge_mpub_costs_its_body_and_one_chunk(make_broker, clock, monkeypatch, binary):
    """A huge /mpub holds its body once and a chunk of messages at a time, never the batch.

    `--mem-queue-size 0` (every message goes to LMDB), so nothing stays in
    Python once its chunk is committed. Each publish is at most a chunk,
    and while the batch goes in the traced peak is the body (one copy: the
    site's buffer, not a second one read out of it) plus one chunk's
    objects, measured at about 375 B a message of the chunk. The bound,
    512 B a message of the chunk, does not grow with the batch: every
    message at once would be over 100 B a message of the batch (26 MB
    here), a second copy of the body another 0.5 MB (text) or 1.3 MB
    (binary).
    """
    broker = make_broker(backend="lmdb", mem_queue_size=0)
    consumer(broker, "big", "c", rdy=0)
    n = 262_143
    body = _binary([b"x"] * n) if binary else b"x\n" * n
    topic = broker.topics["big"]
    sizes: list[int] = []
    publish_chunk = publisher._publish_chunk

    def counted(topic, bodies, defer):
        sizes.append(len(bodies))
        publish_chunk(topic, bodies, defer)

    monkeypatch.setattr(publisher, "_publish_chunk", counted)
    http = HTTPClient(broker)
    tracemalloc.start()
    try:
        transport = http.send("POST", "/mpub?topic=big" + "&binary=true" * binary, body)
        # The request as the test writes it and twisted.web parses it is
        # gone: what is left is the site's buffer of the body.
        tracemalloc.reset_peak()
        run_turns(clock, lambda: transport.value())
        clock.advance(0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert parse_response(transport.value()).body == b"OK"
    assert topic.channels["c"].depth() == n
    assert sum(sizes) == n and max(sizes) <= publisher.CHUNK_MESSAGES
    beyond_body = peak - len(body)
    assert beyond_body < 512 * publisher.CHUNK_MESSAGES, f"{beyond_body / 1e6:.2f} MB beyond the body"


def _line_reader(body: bytes, read_max: int, max_msg: int) -> list[bytes]:
    """nsqd's text /mpub as a line reader sees it, line by line (the model)."""
    bodies, total, pos = [], 0, 0
    while True:
        nl = body.find(b"\n", pos)
        stop = len(body) if nl < 0 else nl + 1
        total += stop - pos
        if total == read_max:
            raise ApiError(413, "BODY_TOO_BIG")
        line = body[pos:stop - (nl >= 0)]
        if line:
            if len(line) > max_msg:
                raise ApiError(413, "MSG_TOO_BIG")
            bodies.append(line)
        if nl < 0:
            return bodies
        pos = stop


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64])
def test_text_pieces_split_as_nsqds_line_reader(monkeypatch, piece):
    """Cutting a text body into pieces changes nothing: same messages, same error."""
    monkeypatch.setattr(publisher, "TEXT_PIECE", piece)
    rng = random.Random(piece)
    for _ in range(400):
        body = bytes(rng.choice(b"ab\n\n") for _ in range(rng.randrange(0, 40)))
        # read_max is max-body-size + 1: at least 2; the body is cut there.
        read_max = max(2, rng.choice([len(body), len(body) + 1, 60]))
        args = (body[:read_max], read_max, rng.randrange(1, 8))
        assert _outcome(split_text_mpub, args) == _outcome(_line_reader, args), args


def _outcome(parse, args):
    try:
        return parse(*args)
    except ApiError as e:
        return e.message


# -- a real broker ------------------------------------------------------------------------------


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < 8:
        head += sock.recv(8 - len(head))
    size, kind = struct.unpack(">ii", head)
    data = b""
    while len(data) < size - 4:
        data += sock.recv(size - 4 - len(data))
    return kind, data


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(b"  V2")
    return sock


def test_real_broker_serves_a_bystander_during_a_max_size_mpub(start_broker, record_property):
    """1,048,575 one-byte messages in one MPUB while another client PUBs round trip after round trip.

    The bystander is answered while the batch is part-way in (its topic's
    message_count seen strictly between 0 and N), which a batch published
    in one reactor turn never allows. The bystander's worst round trip
    (its PUB or its /stats GET) is recorded (`bystander_worst_ms`), a
    figure for the README, not an assertion.
    """
    broker = start_broker()
    n = 1_048_575
    big = _connect(broker.tcp_address)
    bystander = _connect(broker.tcp_address)
    data = b"MPUB big\n" + struct.pack(">ii", 4 + 5 * n, n) + b"\x00\x00\x00\x01x" * n
    answer: list = []

    def send_big() -> None:
        big.sendall(data)
        answer.append(_read_frame(big))

    stats_url = f"http://{broker.http_address}/stats?format=json&topic=big"
    midway = []
    worst = 0.0
    sender = threading.Thread(target=send_big)
    sender.start()
    while not answer:
        t = time.monotonic()
        bystander.sendall(pub("other", b"y"))
        assert _read_frame(bystander) == (0, b"OK")
        t2 = time.monotonic()
        with urllib.request.urlopen(stats_url, timeout=60) as r:
            topics = json.load(r)["topics"]
        worst = max(worst, t2 - t, time.monotonic() - t2)
        counts = [tp["message_count"] for tp in topics if tp["topic_name"] == "big"]
        if counts and 0 < counts[0] < n:
            midway.append(counts[0])
    sender.join()
    assert answer == [(0, b"OK")]
    record_property("bystander_worst_ms", round(worst * 1000))
    print(f"bystander worst round trip during the MPUB: {worst * 1000:.0f} ms")
    assert midway, "the bystander was never served while the batch was part-way in"
    with urllib.request.urlopen(stats_url, timeout=60) as r:
        topics = json.load(r)["topics"]
    assert [tp["message_count"] for tp in topics if tp["topic_name"] == "big"] == [n]
    big.close()
    bystander.close()
