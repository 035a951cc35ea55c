"""Delivery rules on the wire: REQ, TOUCH, DPUB limits, late channels."""

from __future__ import annotations

import time

import pytest

from tests.support.processes import FAST_SCAN
from tests.support.raw_conn import RawConn, command
from tests.support.v2_frames import mpub_body


@pytest.fixture
def tight_broker(start_broker):
    return start_broker("--msg-timeout=1s", "--max-req-timeout=1s", *FAST_SCAN)


def _subscribe(broker, topic: str, channel: str = "c", rdy: int = 1) -> RawConn:
    conn = RawConn(broker)
    conn.send(command(f"SUB {topic} {channel}"))
    assert conn.read_frame() == (0, b"OK")
    if rdy:
        conn.send(command(f"RDY {rdy}"))
    return conn


def _publish(broker, topic: str, *bodies: bytes) -> None:
    with RawConn(broker) as producer:
        producer.send(command(f"MPUB {topic}", mpub_body(bodies)))
        assert producer.read_frame() == (0, b"OK")


def test_req_0_comes_back_at_once(tight_broker, name):
    topic = name()
    with _subscribe(tight_broker, topic) as conn:
        _publish(tight_broker, topic, b"again")
        _, attempts, msg_id, _ = conn.read_message()
        assert attempts == 1
        started = time.monotonic()
        conn.send(command(b"REQ " + msg_id + b" 0"))
        _, attempts, again_id, body = conn.read_message()
        assert (attempts, again_id, body) == (2, msg_id, b"again")
        assert time.monotonic() - started < 0.5
        conn.send(command(b"FIN " + msg_id))
        conn.expect_silence(0.2)


def test_req_delay_above_the_maximum_is_clamped(tight_broker, name):
    topic = name()
    with _subscribe(tight_broker, topic) as conn:
        _publish(tight_broker, topic, b"later")
        _, _, msg_id, _ = conn.read_message()
        started = time.monotonic()
        conn.send(command(b"REQ " + msg_id + b" 600000"))  # 10 min > --max-req-timeout=1s
        _, attempts, again_id, _ = conn.read_message()  # no error frame first
        waited = time.monotonic() - started
        assert (attempts, again_id) == (2, msg_id)
        assert 0.9 <= waited < 3.0, f"clamped REQ came back after {waited:.3f}s"


def test_touch_postpones_the_timeout(tight_broker, name):
    topic = name()
    with _subscribe(tight_broker, topic) as conn:
        _publish(tight_broker, topic, b"slow work")
        _, _, msg_id, _ = conn.read_message()
        delivered = time.monotonic()
        time.sleep(0.6)
        conn.send(command(b"TOUCH " + msg_id))
        # Without the TOUCH it would be back at ~1.0 s.
        conn.expect_silence(1.3 - (time.monotonic() - delivered))
        _, attempts, again_id, _ = conn.read_message()
        waited = time.monotonic() - delivered
        assert (attempts, again_id) == (2, msg_id)
        assert 1.5 <= waited < 3.5, f"touched message timed out after {waited:.3f}s"


def test_dpub_delay_range_is_inclusive(tight_broker, name):
    topic = name()
    with RawConn(tight_broker) as conn:
        conn.send(command(f"DPUB {topic} 1000", b"at the max"))
        assert conn.read_frame() == (0, b"OK")
        conn.send(command(f"DPUB {topic} 1001", b"over"))
        assert conn.read_frame() == (1, b"E_INVALID DPUB timeout 1001 out of range 0-1000")
        conn.expect_closed()


def test_a_new_channel_gets_only_later_messages(twistd_broker, name):
    topic = name()
    with _subscribe(twistd_broker, topic, "first", rdy=10) as first:
        _publish(twistd_broker, topic, b"old-1", b"old-2")
        assert [first.read_message()[3] for _ in range(2)] == [b"old-1", b"old-2"]
        with _subscribe(twistd_broker, topic, "second", rdy=10) as second:
            second.expect_silence(0.3)
            _publish(twistd_broker, topic, b"new")
            assert first.read_message()[3] == b"new"
            assert second.read_message()[3] == b"new"
            second.expect_silence(0.2)


def test_a_subscribed_connection_can_publish(twistd_broker, name):
    topic = name()
    with _subscribe(twistd_broker, topic, rdy=5) as conn:
        conn.send(command(f"PUB {topic}", b"to myself"))
        frames = {conn.read_frame(), conn.read_frame()}
        assert (0, b"OK") in frames
        assert any(t == 2 and p.endswith(b"to myself") for t, p in frames)
