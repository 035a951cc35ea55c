"""The wire as a raw socket sees it: what pynsq hides: fatal and non-fatal errors, size limits, the RDY window."""

from __future__ import annotations

import socket
import struct

import pytest

from tests.support.processes import FAST_SCAN
from tests.support.raw_conn import RawConn, command
from tests.support.v2_frames import mpub_body


@pytest.mark.parametrize("magic", [b"  V1", b"GET ", b"V2  "])
def test_bad_magic_gets_e_bad_protocol_and_close(broker, magic):
    with RawConn(broker, magic=magic) as conn:
        assert conn.read_frame() == (1, b"E_BAD_PROTOCOL")
        conn.expect_closed()


def test_bad_magic_does_not_hurt_the_broker(broker, name):
    with RawConn(broker, magic=b"XXXX") as bad:
        assert bad.read_frame() == (1, b"E_BAD_PROTOCOL")
    with RawConn(broker) as good:
        good.send(command(f"PUB {name()}", b"still here"))
        assert good.read_frame() == (0, b"OK")


@pytest.fixture
def small_broker(start_broker):
    return start_broker("--max-msg-size=100", "--max-body-size=1000", *FAST_SCAN)


def test_oversize_pub_is_fatal(small_broker, name):
    topic = name()
    with RawConn(small_broker) as conn:
        conn.send(command(f"PUB {topic}", b"x" * 100))  # the limit itself is fine
        assert conn.read_frame() == (0, b"OK")
        conn.send(command(f"PUB {topic}", b"x" * 101))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE PUB message too big 101 > 100")
        conn.expect_closed()


def test_oversize_pub_is_refused_before_its_body_arrives(small_broker, name):
    """The size alone is enough: the broker does not wait for a 1 GB body."""
    with RawConn(small_broker) as conn:
        conn.send(f"PUB {name()}\n".encode() + struct.pack(">i", 1 << 30))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE PUB message too big 1073741824 > 100")
        conn.expect_closed()


def test_oversize_dpub_and_mpub_are_fatal(small_broker, name):
    topic = name()
    with RawConn(small_broker) as conn:
        conn.send(command(f"DPUB {topic} 10", b"y" * 101))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE DPUB message too big 101 > 100")
        conn.expect_closed()
    with RawConn(small_broker) as conn:
        conn.send(command(f"MPUB {topic}", mpub_body([b"ok", b"z" * 101])))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE MPUB message too big 101 > 100")
        conn.expect_closed()
    with RawConn(small_broker) as conn:
        conn.send(command(f"MPUB {topic}", mpub_body([b"w" * 90] * 11)))
        assert conn.read_frame() == (1, b"E_BAD_BODY MPUB body too big 1038 > 1000")
        conn.expect_closed()


def test_empty_pub_is_fatal(broker, name):
    with RawConn(broker) as conn:
        conn.send(command(f"PUB {name()}", b""))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE PUB invalid message body size 0")
        conn.expect_closed()


def test_fin_of_unknown_id_is_not_fatal(broker, name):
    topic = name()
    with RawConn(broker) as conn:
        conn.send(command(f"SUB {topic} c"))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command("FIN 0123456789abcdef"))
        assert conn.read_frame() == (1, b"E_FIN_FAILED FIN 0123456789abcdef failed ID not in flight")
        conn.send(command("REQ 0123456789abcdef 0"))
        assert conn.read_frame() == (1, b"E_REQ_FAILED REQ 0123456789abcdef failed ID not in flight")
        conn.send(command("TOUCH 0123456789abcdef"))
        assert conn.read_frame() == (
            1, b"E_TOUCH_FAILED TOUCH 0123456789abcdef failed ID not in flight")
        # Still open and still subscribed: NOP has no answer, PUB does, and
        # RDY brings the message it published back to it.
        conn.send(command("NOP") + command(f"PUB {topic}", b"after"))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command("RDY 1"))
        _, attempts, msg_id, body = conn.read_message()
        assert (attempts, body) == (1, b"after")
        conn.send(command(b"FIN " + msg_id))
        conn.send(command("FIN " + msg_id.decode()))
        assert conn.read_frame() == (
            1, b"E_FIN_FAILED FIN " + msg_id + b" failed ID not in flight")


def test_fin_with_malformed_id_is_fatal(broker, name):
    with RawConn(broker) as conn:
        conn.send(command(f"SUB {name()} c"))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command("FIN short"))
        assert conn.read_frame() == (1, b"E_INVALID invalid message ID")
        conn.expect_closed()


def test_rdy_0_holds_messages_and_rdy_is_a_window(broker, name):
    """Nothing before RDY; at most RDY unacknowledged; FIN frees a slot."""
    topic = name()
    with RawConn(broker) as conn, RawConn(broker) as producer:
        conn.send(command(f"SUB {topic} c"))
        assert conn.read_frame() == (0, b"OK")
        producer.send(command(f"MPUB {topic}", mpub_body([b"m%d" % i for i in range(5)])))
        assert producer.read_frame() == (0, b"OK")
        conn.expect_silence(0.3)
        conn.send(command("RDY 2"))
        first = [conn.read_message() for _ in range(2)]
        conn.expect_silence(0.3)
        conn.send(command(b"FIN " + first[0][2]))
        third = conn.read_message()
        conn.expect_silence(0.3)
        assert sorted([m[3] for m in first] + [third[3]]) == [b"m0", b"m1", b"m2"]


def test_second_sub_and_unknown_command_are_fatal(broker, name):
    with RawConn(broker) as conn:
        conn.send(command(f"SUB {name()} c"))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command(f"SUB {name()} d"))
        assert conn.read_frame() == (1, b"E_INVALID cannot SUB in current state")
        conn.expect_closed()
    with RawConn(broker) as conn:
        conn.send(b"\n")
        assert conn.read_frame() == (1, b"E_INVALID invalid command ")
        conn.expect_closed()


@pytest.mark.parametrize("flags", [(), ("--durable",)], ids=["lmdb", "durable"])
def test_every_command_before_a_half_close_is_answered(start_broker, name, flags):
    """A script's client (`nc -N`) writes its publishes and half-closes: it still reads every OK.

    A last command whose body the input ended inside gets nsqd's error for it, after the OKs.
    """
    broker = start_broker(*flags)
    topic = name()
    with RawConn(broker) as conn:
        conn.send(command(f"PUB {topic}", b"one") + command(f"MPUB {topic}", mpub_body([b"two", b"three"]))
                  + command("NOP") + command(f"DPUB {topic} 0", b"four")
                  + command(f"PUB {topic}", b"cut short")[:-3])
        conn.sock.shutdown(socket.SHUT_WR)
        assert [conn.read_frame() for _ in range(4)] == [(0, b"OK")] * 3 + [
            (1, b"E_BAD_MESSAGE PUB failed to read message body")]
        conn.expect_closed()
    _, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert stats["topics"][0]["message_count"] == 4
