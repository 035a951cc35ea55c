"""The wire byte for byte, what pynsq hides: fatal and non-fatal errors, size limits, the RDY window.

Raw V2 bytes to an in-process broker, read frame by frame with
tests/support/inproc_conn.py (RawConn's calls on a StringTransport, the
broker's clock standing in for waiting). A half-close from a real socket
is tested on a real broker in tests/integration/test_raw_protocol.py.
"""

from __future__ import annotations

import struct

import pytest

from tests.support.inproc_conn import InprocConn
from tests.support.raw_conn import command
from tests.support.v2_frames import mpub_body


@pytest.mark.parametrize("magic", [b"  V1", b"GET ", b"V2  "])
def test_bad_magic_gets_e_bad_protocol_and_close(inproc_broker, magic):
    with InprocConn(inproc_broker, magic=magic) as conn:
        assert conn.read_frame() == (1, b"E_BAD_PROTOCOL")
        conn.expect_closed()


def test_bad_magic_does_not_hurt_the_broker(inproc_broker, name):
    with InprocConn(inproc_broker, magic=b"XXXX") as bad:
        assert bad.read_frame() == (1, b"E_BAD_PROTOCOL")
    with InprocConn(inproc_broker) as good:
        good.send(command(f"PUB {name()}", b"still here"))
        assert good.read_frame() == (0, b"OK")


@pytest.fixture
def small_broker(make_broker):
    return make_broker(max_msg_size=100, max_body_size=1000)


def test_oversize_pub_is_fatal(small_broker, name):
    topic = name()
    with InprocConn(small_broker) as conn:
        conn.send(command(f"PUB {topic}", b"x" * 100))  # the limit itself is fine
        assert conn.read_frame() == (0, b"OK")
        conn.send(command(f"PUB {topic}", b"x" * 101))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE PUB message too big 101 > 100")
        conn.expect_closed()


def test_oversize_pub_is_refused_before_its_body_arrives(small_broker, name):
    """The size alone is enough: the broker does not wait for a 1 GB body."""
    with InprocConn(small_broker) as conn:
        conn.send(f"PUB {name()}\n".encode() + struct.pack(">i", 1 << 30))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE PUB message too big 1073741824 > 100")
        conn.expect_closed()


def test_oversize_dpub_and_mpub_are_fatal(small_broker, name):
    topic = name()
    with InprocConn(small_broker) as conn:
        conn.send(command(f"DPUB {topic} 10", b"y" * 101))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE DPUB message too big 101 > 100")
        conn.expect_closed()
    with InprocConn(small_broker) as conn:
        conn.send(command(f"MPUB {topic}", mpub_body([b"ok", b"z" * 101])))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE MPUB message too big 101 > 100")
        conn.expect_closed()
    with InprocConn(small_broker) as conn:
        conn.send(command(f"MPUB {topic}", mpub_body([b"w" * 90] * 11)))
        assert conn.read_frame() == (1, b"E_BAD_BODY MPUB body too big 1038 > 1000")
        conn.expect_closed()


def test_empty_pub_is_fatal(inproc_broker, name):
    with InprocConn(inproc_broker) as conn:
        conn.send(command(f"PUB {name()}", b""))
        assert conn.read_frame() == (1, b"E_BAD_MESSAGE PUB invalid message body size 0")
        conn.expect_closed()


def test_fin_of_unknown_id_is_not_fatal(inproc_broker, name):
    topic = name()
    with InprocConn(inproc_broker) as conn:
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


def test_fin_with_malformed_id_is_fatal(inproc_broker, name):
    with InprocConn(inproc_broker) as conn:
        conn.send(command(f"SUB {name()} c"))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command("FIN short"))
        assert conn.read_frame() == (1, b"E_INVALID invalid message ID")
        conn.expect_closed()


def test_rdy_0_holds_messages_and_rdy_is_a_window(inproc_broker, name):
    """Nothing before RDY; at most RDY unacknowledged; FIN frees a slot."""
    topic = name()
    with InprocConn(inproc_broker) as conn, InprocConn(inproc_broker) as producer:
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


def test_second_sub_and_unknown_command_are_fatal(inproc_broker, name):
    with InprocConn(inproc_broker) as conn:
        conn.send(command(f"SUB {name()} c"))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command(f"SUB {name()} d"))
        assert conn.read_frame() == (1, b"E_INVALID cannot SUB in current state")
        conn.expect_closed()
    with InprocConn(inproc_broker) as conn:
        conn.send(b"\n")
        assert conn.read_frame() == (1, b"E_INVALID invalid command ")
        conn.expect_closed()
