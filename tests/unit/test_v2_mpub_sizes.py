"""MPUB is read as nsqd reads it (raw V2 bytes, frame by frame, to an in-process broker).

nsqd range-checks MPUB's declared body size (<= 0 and > --max-body-size are
fatal E_BAD_BODY) and then reads the message count and each message from
the stream, however many bytes that takes. Clients declare either the whole
body (go-nsq, pynsq) or the messages' bytes only (squeaky, npm's nsq): both
get OK. The answers asserted here are nsqd's, except the last test (mqd's
own bound on what a pending MPUB may hold, which nsqd does not have).

The connections are tests/support/inproc_conn.py's: RawConn's calls on a
StringTransport, the broker's clock standing in for waiting.
"""

from __future__ import annotations

import struct

import pytest

from tests.support.inproc_conn import InprocConn, get
from tests.support.raw_conn import command
from tests.support.v2_frames import mpub_body

I32 = struct.Struct(">i")
MAX_BODY = 1000
MAX_MSG = 100


@pytest.fixture
def small_broker(make_broker):
    return make_broker(max_msg_size=MAX_MSG, max_body_size=MAX_BODY)


def mpub_declared(topic: str, bodies: list[bytes], declared: int) -> bytes:
    return f"MPUB {topic}\n".encode() + I32.pack(declared) + mpub_body(bodies)


def consume(broker, topic: str, n: int) -> list[bytes]:
    """The bodies of the next `n` messages of `topic` (a new channel sees the topic's backlog)."""
    with InprocConn(broker) as conn:
        conn.send(command(f"SUB {topic} c") + command(f"RDY {n}"))
        assert conn.read_frame() == (0, b"OK")
        got = []
        for _ in range(n):
            _, _, msg_id, body = conn.read_message()
            conn.send(command(b"FIN " + msg_id))
            got.append(body)
        return got


def whole(bodies: list[bytes]) -> int:
    return len(mpub_body(bodies))


def message_bytes(bodies: list[bytes]) -> int:
    return sum(map(len, bodies))


@pytest.mark.parametrize("size_of", [whole, message_bytes], ids=["whole-body", "message-bytes-only"])
def test_both_size_forms_get_ok(small_broker, name, size_of):
    topic = name()
    bodies = [b"one", b"two", b"three"]
    with InprocConn(small_broker) as conn:
        conn.send(mpub_declared(topic, bodies, size_of(bodies)) + command(f"PUB {topic}", b"tail"))
        assert conn.read_frame() == (0, b"OK")
        assert conn.read_frame() == (0, b"OK")
        conn.expect_silence(0.2)
    assert consume(small_broker, topic, 4) == bodies + [b"tail"]


@pytest.mark.parametrize("size_of", [whole, message_bytes], ids=["whole-body", "message-bytes-only"])
def test_both_size_forms_arriving_in_pieces(small_broker, name, size_of):
    """The messages are read from the stream: the broker waits for them, then answers."""
    topic = name()
    bodies = [b"a" * 90, b"b" * 90, b"c"]
    data = mpub_declared(topic, bodies, size_of(bodies))
    with InprocConn(small_broker) as conn:
        conn.send(data[:40])
        conn.expect_silence(0.2)
        conn.send(data[40:150])
        conn.expect_silence(0.2)
        conn.send(data[150:])
        assert conn.read_frame() == (0, b"OK")
    assert consume(small_broker, topic, 3) == bodies


@pytest.mark.parametrize("declared", [1, 3, 4, 10])
def test_declared_smaller_than_what_follows_within_limits(small_broker, name, declared):
    """nsqd only refuses a declared size <= 0 (1-3 included): the count comes from the stream."""
    topic = name()
    with InprocConn(small_broker) as conn:
        conn.send(mpub_declared(topic, [b"x" * 50, b"y"], declared))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command("NOP") + command(f"PUB {topic}", b"z"))
        assert conn.read_frame() == (0, b"OK")
    assert consume(small_broker, topic, 3) == [b"x" * 50, b"y", b"z"]


@pytest.mark.parametrize("declared", [100, MAX_BODY])
def test_declared_larger_than_what_follows_within_limits(small_broker, name, declared):
    """Answered once the messages are in, without waiting for the declared bytes."""
    topic = name()
    with InprocConn(small_broker) as conn:
        conn.send(mpub_declared(topic, [b"m"], declared))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command(f"PUB {topic}", b"n"))
        assert conn.read_frame() == (0, b"OK")
    assert consume(small_broker, topic, 2) == [b"m", b"n"]


def test_bytes_inside_the_declared_size_after_the_messages_are_commands(small_broker, name):
    topic = name()
    body = mpub_body([b"m"]) + command(f"PUB {topic}", b"n")
    with InprocConn(small_broker) as conn:
        conn.send(command(f"MPUB {topic}", body))
        assert conn.read_frame() == (0, b"OK")
        assert conn.read_frame() == (0, b"OK")
    assert consume(small_broker, topic, 2) == [b"m", b"n"]


@pytest.mark.parametrize("declared", [0, -1])
def test_declared_not_positive_is_fatal(small_broker, name, declared):
    with InprocConn(small_broker) as conn:
        conn.send(mpub_declared(name(), [b"m"], declared))
        assert conn.read_frame() == (1, b"E_BAD_BODY MPUB invalid body size %d" % declared)
        conn.expect_closed()


def test_declared_beyond_max_body_size_is_fatal(small_broker, name):
    """Refused on the size alone, however few bytes follow."""
    with InprocConn(small_broker) as conn:
        conn.send(mpub_declared(name(), [b"m"], MAX_BODY + 1))
        assert conn.read_frame() == (1, b"E_BAD_BODY MPUB body too big 1001 > 1000")
        conn.expect_closed()


def test_whole_body_beyond_max_body_size_is_fatal(small_broker, name):
    bodies = [b"w" * 90] * 11
    with InprocConn(small_broker) as conn:
        conn.send(mpub_declared(name(), bodies, whole(bodies)))
        assert conn.read_frame() == (1, b"E_BAD_BODY MPUB body too big 1038 > 1000")
        conn.expect_closed()


def test_message_count_beyond_limit_is_fatal(small_broker, name):
    # (max-body-size - 4) / 5 = 199 messages at most.
    with InprocConn(small_broker) as conn:
        conn.send(f"MPUB {name()}\n".encode() + I32.pack(8) + I32.pack(200))
        assert conn.read_frame() == (1, b"E_BAD_BODY MPUB invalid message count 200")
        conn.expect_closed()


def test_bad_message_read_later_is_fatal_and_publishes_nothing(small_broker, name):
    """All or nothing: the first message was read, the second's size is refused as it arrives."""
    topic = name()
    bodies = [b"a", b"b"]
    with InprocConn(small_broker) as conn:
        conn.send(f"MPUB {topic}\n".encode() + I32.pack(message_bytes(bodies)) + I32.pack(2)
                  + I32.pack(1) + b"a")
        conn.expect_silence(0.2)
        conn.send(I32.pack(0))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE MPUB invalid message(1) body size 0")
        conn.expect_closed()
    with InprocConn(small_broker) as conn:
        conn.send(mpub_declared(topic, [b"a", b"x" * (MAX_MSG + 1)], 2))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE MPUB message too big 101 > 100")
        conn.expect_closed()
    status, stats = get(small_broker, f"/stats?format=json&topic={topic}")
    assert status == 200
    assert [t["depth"] for t in stats["topics"] if t["topic_name"] == topic] == [0]


def test_message_bytes_form_at_max_body_size(small_broker, name):
    """The messages' bytes at max-body-size: over it with the count and sizes, still OK."""
    topic = name()
    bodies = [b"%03d" % i + b"." * 7 for i in range(100)]  # 1000 bytes of messages, 1404 in all
    assert message_bytes(bodies) == MAX_BODY
    with InprocConn(small_broker) as conn:
        conn.send(mpub_declared(topic, bodies, MAX_BODY))
        assert conn.read_frame() == (0, b"OK")
    assert consume(small_broker, topic, 100) == bodies


def test_mqd_bound_messages_over_max_body_size(small_broker, name):
    """mqd's own bound (nsqd reads up to count x (4 + max-msg-size)): a pending MPUB's
    messages may take max-body-size bytes, i.e. 4 + 4 x count + max-body-size after
    the declared size; past it is fatal E_BAD_BODY, refused before the bytes arrive."""
    with InprocConn(small_broker) as conn:
        # 11 messages of 91 bytes: 1001 bytes of messages.
        conn.send(f"MPUB {name()}\n".encode() + I32.pack(4) + I32.pack(11)
                  + (I32.pack(91) + b"x" * 91) * 10 + I32.pack(91))
        assert conn.read_frame() == (1, b"E_BAD_BODY MPUB body too big 1049 > 1048")
        conn.expect_closed()
