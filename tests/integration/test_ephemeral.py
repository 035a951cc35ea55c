"""#ephemeral channels and topics: gone with their last reader, never in nsqd.dat, bounded by mem-queue-size."""

from __future__ import annotations

from tests.support.processes import FAST_SCAN
from tests.support.pynsq_loop import Collector
from tests.support.raw_conn import RawConn, command
from tests.support.v2_frames import mpub_body


def _wait_for_metadata(loop, broker, topic: str, channels: list[str]) -> None:
    loop.run_until(lambda: broker.channels_in_metadata().get(topic) == channels,
                   what=f"nsqd.dat to list {topic} with {channels}")


def test_ephemeral_channel_goes_with_its_last_reader(twistd_broker, loop, name):
    topic = name()
    keep, eph = Collector(), Collector()
    loop.reader(twistd_broker, topic, "keep", keep, max_in_flight=10)
    eph_reader = loop.reader(twistd_broker, topic, "e#ephemeral", eph, max_in_flight=10)
    writer = loop.writer(twistd_broker)
    first = [b"a%d" % i for i in range(5)]
    assert loop.publish(writer, "mpub", topic, first) == b"OK"
    loop.run_until(lambda: len(keep) == 5 and len(eph) == 5, what="both channels to get 5")
    assert sorted(eph.bodies) == first

    # Only the durable channel is in the metadata, even while the ephemeral one is live.
    _wait_for_metadata(loop, twistd_broker, topic, ["keep"])
    assert "#ephemeral" not in twistd_broker.metadata_path.read_text()

    eph_reader.close()
    loop.run_for(0.5)
    # With the ephemeral channel gone these go to "keep" only; if it had
    # survived, they would wait there for the next subscriber.
    gap = [b"gap%d" % i for i in range(3)]
    assert loop.publish(writer, "mpub", topic, gap) == b"OK"
    loop.run_until(lambda: len(keep) == 8, what="the durable channel to get the gap messages")

    again = Collector()
    loop.reader(twistd_broker, topic, "e#ephemeral", again, max_in_flight=10)
    loop.run_for(0.5)
    assert again.bodies == [], "the ephemeral channel kept a backlog after its reader left"
    assert loop.publish(writer, "pub", topic, b"fresh") == b"OK"
    loop.run_until(lambda: again.bodies, what="the fresh message")
    # "keep" (RDY > 1) may hold it in its output buffer for up to 250 ms.
    loop.run_until(lambda: len(keep) == 9, what="the durable channel to get the fresh message")
    loop.run_for(0.2)
    assert again.bodies == [b"fresh"]
    assert sorted(keep.bodies) == sorted(first + gap + [b"fresh"])
    assert "#ephemeral" not in twistd_broker.metadata_path.read_text()


def test_ephemeral_topic_never_reaches_metadata(twistd_broker, loop, name):
    eph_topic = name() + "#ephemeral"
    marker = name()
    got = Collector()
    loop.reader(twistd_broker, eph_topic, "c", got)
    writer = loop.writer(twistd_broker)
    assert loop.publish(writer, "pub", eph_topic, b"hello") == b"OK"
    loop.run_until(lambda: got.bodies == [b"hello"], what="the ephemeral topic's message")

    # A durable topic created afterwards: once it is in nsqd.dat, the
    # ephemeral topic and channel (created earlier) would have been too.
    assert loop.publish(writer, "pub", marker, b"m") == b"OK"
    _wait_for_metadata(loop, twistd_broker, marker, [])
    topics = [t["name"] for t in twistd_broker.metadata()["topics"]]
    assert topics == [marker]

    # And a clean shutdown writes none of it either.
    twistd_broker.stop_cleanly()
    assert [t["name"] for t in twistd_broker.metadata()["topics"]] == [marker]


def test_ephemeral_channel_drops_beyond_mem_queue_size(start_broker, name):
    broker = start_broker("--mem-queue-size=5", *FAST_SCAN)
    topic = name()
    with RawConn(broker) as consumer, RawConn(broker) as producer:
        consumer.send(command(f"SUB {topic} c#ephemeral"))
        assert consumer.read_frame() == (0, b"OK")
        bodies = [b"n%02d" % i for i in range(20)]
        producer.send(command(f"MPUB {topic}", mpub_body(bodies)))
        assert producer.read_frame() == (0, b"OK")  # accepted, though most are dropped

        consumer.send(command("RDY 100"))
        got = [consumer.read_message()[3] for _ in range(5)]
        assert got == bodies[:5]
        consumer.expect_silence(0.5)
