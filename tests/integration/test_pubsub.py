"""Publishing and consuming through pynsq, the official client, against a real broker."""

from __future__ import annotations

import time
from collections import Counter

import nsq

from tests.support.pynsq_loop import Collector


def test_pub_mpub_dpub_answer_ok(twistd_broker, loop, name):
    topic = name()
    writer = loop.writer(twistd_broker)
    assert loop.publish(writer, "pub", topic, b"one") == b"OK"
    assert loop.publish(writer, "mpub", topic, [b"two", b"three", b"four"]) == b"OK"
    assert loop.publish(writer, "dpub", topic, 50, b"five") == b"OK"

    got = Collector()
    loop.reader(twistd_broker, topic, "c", got, max_in_flight=10)
    loop.run_until(lambda: len(got) >= 5, what="all five messages")
    loop.run_for(0.2)
    assert sorted(got.bodies) == sorted([b"one", b"two", b"three", b"four", b"five"])
    assert {d[2] for d in got.deliveries} == {1}


def test_publish_errors_reach_the_writer_callback(twistd_broker, loop, name):
    writer = loop.writer(twistd_broker)
    # An invalid topic is fatal: the callback gets the error, not OK.
    result = loop.publish(writer, "pub", "bad!topic", b"x")
    assert isinstance(result, nsq.Error)
    assert result.args[0] == b'E_BAD_TOPIC PUB topic name "bad!topic" is not valid'
    # pynsq reconnects (the error was fatal) and publishing works again.
    loop.run_until(lambda: any(c.connected() for c in writer.conns.values()), what="reconnect")
    assert loop.publish(writer, "pub", name(), b"fine") == b"OK"


def test_dpub_arrives_no_earlier_than_its_delay(twistd_broker, loop, name):
    topic = name()
    got = Collector()
    loop.reader(twistd_broker, topic, "c", got, max_in_flight=10)
    writer = loop.writer(twistd_broker)

    delay_ms = 600
    sent = time.monotonic()
    assert loop.publish(writer, "dpub", topic, delay_ms, b"later") == b"OK"
    assert loop.publish(writer, "pub", topic, b"now") == b"OK"

    loop.run_until(lambda: b"later" in got.bodies, what="the deferred message")
    arrived = {body: at for _, body, _, at in got.deliveries}
    # The plain PUB is not held up behind the deferred one.
    assert got.bodies[0] == b"now"
    assert arrived[b"now"] - sent < delay_ms / 1000
    waited = arrived[b"later"] - sent
    assert waited >= delay_ms / 1000, f"deferred message came after {waited:.3f}s"
    assert waited < delay_ms / 1000 + 3.0
    assert [d[2] for d in got.deliveries] == [1, 1]


def test_reader_consumes_everything_exactly_once(twistd_broker, loop, name):
    topic = name()
    writer = loop.writer(twistd_broker)
    expected: list[bytes] = []

    # Published before any channel exists: held at the topic, then handed to
    # the first channel.
    for i in range(50):
        body = b"early-%d" % i
        expected.append(body)
        assert loop.publish(writer, "pub", topic, body) == b"OK"

    got = Collector()
    loop.reader(twistd_broker, topic, "c", got, max_in_flight=32)

    batch = [b"late-%d" % i for i in range(450)]
    expected += batch
    for i in range(0, len(batch), 90):
        assert loop.publish(writer, "mpub", topic, batch[i:i + 90]) == b"OK"
    # Bodies of several sizes, including binary ones.
    odd = [b"x", b"\x00\n\xff" * 100, bytes(range(256)) * 40]
    for body in odd:
        assert loop.publish(writer, "pub", topic, body) == b"OK"
    expected += odd

    loop.run_until(lambda: len(got) >= len(expected), what=f"{len(expected)} messages")
    loop.run_for(0.3)  # anything extra (a duplicate) would show up now
    assert len(got) == len(expected)
    assert Counter(got.bodies) == Counter(expected)
    assert len({d[0] for d in got.deliveries}) == len(expected), "message ids are not unique"
    assert {d[2] for d in got.deliveries} == {1}


def test_requeue_with_backoff_redelivers_with_attempts_2(twistd_broker, loop, name):
    topic = name()

    def fail_once(message):
        return message.attempts > 1

    got = Collector(fail_once)
    # requeue_delay=1: pynsq sends REQ <id> 1000 (1 s x attempts) and backs
    # off (RDY 0, then RDY 1 to test the water) for a short backoff.
    loop.reader(twistd_broker, topic, "c", got, requeue_delay=1, max_backoff_duration=0.5)
    writer = loop.writer(twistd_broker)
    assert loop.publish(writer, "pub", topic, b"flaky") == b"OK"

    loop.run_until(lambda: len(got) >= 2, what="the requeued message to come back")
    (id1, body1, att1, at1), (id2, body2, att2, at2) = got.deliveries[:2]
    assert (body1, att1) == (b"flaky", 1)
    assert (body2, att2) == (b"flaky", 2)
    assert id1 == id2
    assert at2 - at1 >= 1.0, f"REQ with a 1000 ms delay came back after {at2 - at1:.3f}s"

    # The second delivery was finished: nothing more comes, and the channel
    # has nothing of it left for a new consumer either.
    loop.run_for(0.3)
    assert len(got) == 2
    loop.clients[0].close()
    loop.run_for(0.1)
    later = Collector()
    loop.reader(twistd_broker, topic, "c", later)
    assert loop.publish(writer, "pub", topic, b"sentinel") == b"OK"
    loop.run_until(lambda: later.bodies, what="the sentinel")
    loop.run_for(0.2)
    assert later.bodies == [b"sentinel"]


def test_every_channel_gets_every_message(twistd_broker, loop, name):
    topic = name()
    a, b = Collector(), Collector()
    loop.reader(twistd_broker, topic, "one", a, max_in_flight=20)
    loop.reader(twistd_broker, topic, "two", b, max_in_flight=20)
    writer = loop.writer(twistd_broker)
    expected = [b"m%d" % i for i in range(100)]
    assert loop.publish(writer, "mpub", topic, expected[:60]) == b"OK"
    for body in expected[60:]:
        assert loop.publish(writer, "pub", topic, body) == b"OK"

    loop.run_until(lambda: len(a) >= 100 and len(b) >= 100, what="both channels to get 100")
    loop.run_for(0.2)
    assert sorted(a.bodies) == sorted(expected)
    assert sorted(b.bodies) == sorted(expected)
    # The copies share id (and body) per message; each counts its own attempts.
    ids_a = {body: mid for mid, body, _, _ in a.deliveries}
    ids_b = {body: mid for mid, body, _, _ in b.deliveries}
    assert ids_a == ids_b
    assert {d[2] for d in a.deliveries + b.deliveries} == {1}


def test_readers_sharing_a_channel_split_the_messages(twistd_broker, loop, name):
    topic = name()
    a, b = Collector(), Collector()
    loop.reader(twistd_broker, topic, "shared", a, max_in_flight=5)
    loop.reader(twistd_broker, topic, "shared", b, max_in_flight=5)
    writer = loop.writer(twistd_broker)
    expected = [b"job-%d" % i for i in range(200)]
    for i in range(0, 200, 20):
        assert loop.publish(writer, "mpub", topic, expected[i:i + 20]) == b"OK"

    loop.run_until(lambda: len(a) + len(b) >= 200, what="200 messages across both readers")
    loop.run_for(0.3)
    together = a.bodies + b.bodies
    assert len(together) == 200, "a message was delivered more than once"
    assert sorted(together) == sorted(expected)
    assert a.bodies and b.bodies, f"one reader got nothing ({len(a)} vs {len(b)})"


def test_sample_rate_50_delivers_about_half(twistd_broker, loop, name):
    """IDENTIFY sample_rate=50 through pynsq: about half the channel's messages."""
    topic = name()
    got = Collector()
    loop.reader(twistd_broker, topic, "c", got, max_in_flight=100, sample_rate=50)
    writer = loop.writer(twistd_broker)
    bodies = [b"s%04d" % i for i in range(2000)]
    for i in range(0, len(bodies), 200):
        assert loop.publish(writer, "mpub", topic, bodies[i:i + 200]) == b"OK"
    # The channel drops what it does not sample, so delivery simply stops.
    seen = -1
    while seen != len(got):
        seen = len(got)
        loop.run_for(1.0)
    share = len(got) / len(bodies)
    # nsqd keeps a message when a draw in [0,100) is <= the rate: 51 % expected.
    assert 0.45 <= share <= 0.57, f"sample_rate 50 delivered {share:.1%}"
    assert len(set(got.bodies)) == len(got) and set(got.bodies) <= set(bodies)
