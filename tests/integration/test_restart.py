"""Topics and channels survive a restart through nsqd.dat, which an idle restart leaves as it was."""

from __future__ import annotations

from tests.support.processes import FAST_SCAN
from tests.support.pynsq_loop import Collector


def test_restart_keeps_topics_and_channels(start_broker, loop, name):
    # The memory backend is asked for by name: what it holds is documented
    # to be gone when the process ends (backends/memory.py).
    broker = start_broker("--backend=memory", *FAST_SCAN)
    topic, lonely = name(), name()
    one, two = Collector(), Collector()
    loop.reader(broker, topic, "one", one)
    loop.reader(broker, topic, "two", two)
    loop.reader(broker, topic, "gone#ephemeral", Collector())
    writer = loop.writer(broker)
    assert loop.publish(writer, "pub", topic, b"before") == b"OK"
    assert loop.publish(writer, "pub", lonely, b"no channel") == b"OK"
    loop.run_until(lambda: one.bodies == [b"before"] and two.bodies == [b"before"],
                   what="both channels to get the first message")
    loop.close_clients()

    # Queued in both channels when the broker stops; memory backend: lost.
    writer = loop.writer(broker)
    assert loop.publish(writer, "pub", topic, b"queued at stop") == b"OK"
    loop.close_clients()

    broker.stop_cleanly()
    meta = broker.metadata()
    assert isinstance(meta["version"], str) and meta["version"]
    topics = sorted(meta["topics"], key=lambda t: t["name"])
    expected = sorted([
        {"name": topic, "paused": False,
         "channels": [{"name": "one", "paused": False}, {"name": "two", "paused": False}]},
        {"name": lonely, "paused": False, "channels": None},
    ], key=lambda t: t["name"])
    for entry in topics:
        if entry["channels"]:
            entry["channels"].sort(key=lambda c: c["name"])
    assert topics == expected

    broker.start()
    assert broker.channels_in_metadata() == {topic: ["one", "two"], lonely: []}

    # Published after the restart with no consumer connected: each restored
    # channel takes its copy at once. (Had the channels not come back, the
    # messages would wait at the topic and all go to whichever channel is
    # subscribed first, leaving the second with nothing.)
    writer = loop.writer(broker)
    after = [b"after-1", b"after-2", b"after-3"]
    for body in after:
        assert loop.publish(writer, "pub", topic, body) == b"OK"

    one_again, two_again = Collector(), Collector()
    loop.reader(broker, topic, "one", one_again, max_in_flight=10)
    loop.run_until(lambda: len(one_again) >= 3, what="channel one's backlog")
    loop.reader(broker, topic, "two", two_again, max_in_flight=10)
    loop.run_until(lambda: len(two_again) >= 3, what="channel two's backlog")
    loop.run_for(0.3)
    assert sorted(one_again.bodies) == after
    assert sorted(two_again.bodies) == after
    assert {d[2] for d in one_again.deliveries + two_again.deliveries} == {1}


def test_restart_of_an_idle_broker_keeps_metadata_stable(start_broker):
    broker = start_broker(*FAST_SCAN)
    broker.stop_cleanly()
    first = broker.metadata()
    assert first["topics"] is None
    broker.restart()
    broker.stop_cleanly()
    assert broker.metadata() == first
