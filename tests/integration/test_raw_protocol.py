"""The wire as a raw socket sees it: a client's half-close, on a real broker.

The rest of what a raw V2 connection sees (fatal and non-fatal errors,
size limits, the RDY window) is checked in memory in
tests/unit/test_v2_raw_protocol.py.
"""

from __future__ import annotations

import socket

import pytest

from tests.support.raw_conn import RawConn, command
from tests.support.v2_frames import mpub_body


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
