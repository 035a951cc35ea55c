"""In-flight timeouts: a message nobody answers comes back; a FIN after its timeout fails."""

from __future__ import annotations

import pytest

from tests.support.processes import FAST_SCAN
from tests.support.pynsq_loop import Collector
from tests.support.raw_conn import RawConn, command


@pytest.fixture
def quick_broker(start_broker):
    return start_broker("--msg-timeout=1s", *FAST_SCAN)


def test_unanswered_message_is_redelivered_after_msg_timeout(quick_broker, loop, name):
    topic = name()
    held = []

    def ignore_first(message):
        if message.attempts == 1:
            message.enable_async()  # and never FIN/REQ/TOUCH it
            held.append(message)
            return None
        return True

    got = Collector(ignore_first)
    loop.reader(quick_broker, topic, "c", got)
    writer = loop.writer(quick_broker)
    assert loop.publish(writer, "pub", topic, b"slow") == b"OK"

    loop.run_until(lambda: len(got) >= 2, timeout=6, what="the timed-out message to come back")
    (id1, body1, att1, at1), (id2, body2, att2, at2) = got.deliveries[:2]
    assert (body1, att1) == (b"slow", 1)
    assert (body2, att2) == (b"slow", 2)
    assert id1 == id2
    # Measured between the two receipts: the first one's delivery latency
    # may make the gap look a few ms shorter than the broker's full second.
    waited = at2 - at1
    assert 0.9 <= waited < 4.0, f"redelivered after {waited:.3f}s with --msg-timeout=1s"
    assert not held[0].has_responded()

    # The second delivery was finished in time: it does not come back again.
    loop.run_for(1.5)
    assert len(got) == 2


def test_fin_after_timeout_fails_without_closing(quick_broker, name):
    """On the wire: a FIN that comes too late is E_FIN_FAILED, non-fatal."""
    topic = name()
    with RawConn(quick_broker) as consumer, RawConn(quick_broker) as producer:
        consumer.send(command(f"SUB {topic} c"))
        assert consumer.read_frame() == (0, b"OK")
        # The second consumer takes the message once the first one's times out.
        with RawConn(quick_broker) as other:
            consumer.send(command("RDY 1"))
            producer.send(command(f"PUB {topic}", b"payload"))
            assert producer.read_frame() == (0, b"OK")
            _, attempts, msg_id, body = consumer.read_message()
            assert (attempts, body) == (1, b"payload")
            other.send(command(f"SUB {topic} c") + command("RDY 1"))
            assert other.read_frame() == (0, b"OK")
            # RDY 1 is used up by the unanswered message: the first consumer
            # may not get it again; the message times out to `other`.
            consumer.send(command("RDY 0"))
            _, attempts, again_id, body = other.read_message()
            assert (attempts, again_id, body) == (2, msg_id, b"payload")

            consumer.send(command(b"FIN " + msg_id))
            assert consumer.read_frame() == (
                1, b"E_FIN_FAILED FIN " + msg_id + b" failed client does not own message")
            other.send(command(b"FIN " + msg_id))
            other.send(command(b"FIN " + msg_id))
            assert other.read_frame() == (
                1, b"E_FIN_FAILED FIN " + msg_id + b" failed ID not in flight")
        # Still connected and serving after the failed FIN.
        consumer.send(command(f"PUB {topic}", b"more"))
        assert consumer.read_frame() == (0, b"OK")
