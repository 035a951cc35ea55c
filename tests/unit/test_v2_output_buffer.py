"""Output buffering (message frames held up to output_buffer_size bytes or
output_buffer_timeout), and sample_rate, on a test clock.

These tests look at `transport.value()` directly: `Client.read()` flushes
the buffer first, as the flush timer would, which would hide it.
"""

from __future__ import annotations

import random

from tests.support.v2_frames import Msg, cmd, identify, ok, parse_frames, pub


def consumer(connect, rdy=100, **fields):
    c = connect()
    assert c.request(identify(**fields)) == [ok()]
    c.sub(rdy=rdy)
    c.transport.clear()
    return c


def written(c) -> list:
    frames = parse_frames(c.transport.value())
    c.transport.clear()
    return frames


def test_low_rate_stream_arrives_within_the_timeout(connect, publish, clock):
    c = consumer(connect)  # default output_buffer_timeout: 250 ms
    for i in range(5):
        publish(b"m%d" % i)
        assert written(c) == []  # buffered
        clock.advance(0.249)
        assert written(c) == [] or i > 0  # an older timer may already have flushed it
        clock.advance(0.001)
        got = written(c)
        # never later than the timeout after it was buffered
        assert [m.body for m in got if isinstance(m, Msg)] in ([b"m%d" % i], [])
        clock.advance(0.25)
        written(c)


def test_each_message_within_timeout_whatever_the_phase(connect, publish, clock):
    c = consumer(connect, output_buffer_timeout=100)
    rng = random.Random(5)
    for i in range(50):
        clock.advance(rng.uniform(0, 0.3))
        publish(b"%d" % i)
        clock.advance(0.1)
        got = [m.body for m in written(c) if isinstance(m, Msg)]
        assert got == [b"%d" % i]


def test_disabled_buffer_writes_at_once(connect, publish):
    c = consumer(connect, output_buffer_size=-1)
    publish(b"now")
    [m] = written(c)
    assert m.body == b"now"


def test_size_threshold_flushes(connect, publish, clock):
    c = consumer(connect, output_buffer_size=64, output_buffer_timeout=-1)
    publish(b"a")  # 35 bytes: stays
    assert written(c) == []
    publish(b"b")  # 70 bytes >= 64: both go
    assert [m.body for m in written(c)] == [b"a", b"b"]
    publish(b"c")
    clock.advance(10)  # no timed flush with -1 (a heartbeat at 30 s would flush)
    assert written(c) == []


def test_not_ready_flushes(connect, publish):
    c = consumer(connect, rdy=2)
    publish(b"a")
    assert written(c) == []
    publish(b"b")  # RDY window used up: nothing more can join them
    assert [m.body for m in written(c)] == [b"a", b"b"]


def test_rdy_zero_flushes(connect, publish):
    c = consumer(connect, rdy=5)
    publish(b"a")
    c.send(cmd("RDY", 0))
    assert [m.body for m in written(c)] == [b"a"]


def test_response_frames_come_after_buffered_messages(connect, publish):
    c = consumer(connect, rdy=5)
    publish(b"a")
    c.send(cmd("NOP") + pub("other", b"x"))
    frames = written(c)
    assert isinstance(frames[0], Msg) and frames[0].body == b"a"
    assert frames[1:] == [ok()]


def test_big_batch_written_together(connect, publish):
    c = consumer(connect, rdy=1000)
    publish(*[b"x" * 100] * 500)
    # 500 * 134 bytes is over 16 KiB: written without waiting for the timer
    assert len(written(c)) == 500


def test_sample_rate_50(connect, publish):
    """sample_rate: about (s+1) % of the channel's messages reach the client (s = 50, ±5 %)."""
    random.seed(7)
    c = connect()
    assert c.request(identify(sample_rate=50)) == [ok()]
    c.sub(rdy=2500)
    publish(*[b"%d" % i for i in range(2000)])
    got = c.messages()
    assert 0.46 * 2000 <= len(got) <= 0.56 * 2000
