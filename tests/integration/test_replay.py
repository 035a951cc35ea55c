"""A replay of a retained topic into a channel on a real twistd mqd (LMDB), consumed by pynsq."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.processes import FAST_SCAN, http_request
from tests.support.pynsq_loop import Collector

pytestmark = pytest.mark.slow

N = 5000


def test_a_replay_from_offset_0_gives_the_consumer_every_message_again_in_order(start_broker, loop, name):
    # A small memory queue: the replay waits for the consumer many times over.
    broker = start_broker(*FAST_SCAN, "--retention-bytes=1000000000", "--mem-queue-size=200")
    topic, other = name(), name()
    got = Collector()
    loop.reader(broker, topic, "c", got, max_in_flight=50)
    writer = loop.writer(broker)
    bodies = [b"body-%05d" % i for i in range(N)]
    for i in range(0, N, 500):
        assert loop.publish(writer, "mpub", topic, bodies[i:i + 500]) == b"OK"
    loop.run_until(lambda: len(got) >= N, what=f"the {N} published messages")
    first = list(got.deliveries)
    assert [d[1] for d in first] == bodies

    status, raw = http_request(broker.http_address, "POST",
                               f"/channel/replay?topic={topic}&channel=c&offset=0", b"")
    assert status == 200, raw
    answer = json.loads(raw)
    assert (answer["topic"], answer["channel"], answer["start"], answer["end"]) == (topic, "c", 0, N)

    # A bystander publishes to another topic round trip after round trip meanwhile.
    waits = []
    deadline = time.monotonic() + 60
    while len(got) < 2 * N and time.monotonic() < deadline:
        sent = time.monotonic()
        assert loop.publish(writer, "pub", other, b"bystander") == b"OK"
        waits.append(time.monotonic() - sent)
    loop.run_until(lambda: len(got) >= 2 * N, what=f"the {N} replayed messages")
    loop.run_for(0.3)
    again = got.deliveries[N:]
    assert len(again) == N  # exactly once more, nothing else
    assert [d[1] for d in again] == bodies
    assert [d[0] for d in again] == [d[0] for d in first]  # the original ids
    assert {d[2] for d in again} == {1}
    assert waits and max(waits) < 2.0

    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    channel = stats["topics"][0]["channels"][0]
    assert "replay" not in channel
    assert (channel["depth"], channel["in_flight_count"]) == (0, 0)
    assert stats["topics"][0]["retained"]["latest"] == N
