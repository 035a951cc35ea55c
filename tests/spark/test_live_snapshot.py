"""Snapshots of a real, busy broker (twistd mqd --durable) read back with Spark.

With --durable every message is in LMDB from its publish until its FIN
(the memory queue is bypassed, a read only moves the queue's position),
so a snapshot holds exactly the messages not yet FINished, and once
traffic has stopped each channel holds "published minus finished".

Publishers (HTTP /mpub and a raw TCP MPUB connection) and a consumer that
FINishes two messages in three run in threads while the test takes
snapshots through POST /snapshot. The snapshots are read with Spark after
traffic stops (so Spark does not compete with the broker for the cores).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

from mqd.nsqd.snapshot_format import read_manifest
from tests.support.broker_http import call, create, queue_stats
from tests.support.processes import FAST_SCAN, wait_for
from tests.support.traffic import Traffic, consumer, http_publisher, number, tcp_publisher

TOPIC, SOLO = "live", "solo"
BATCH = 20


def snapshot(broker, name: str) -> str:
    status, text = call(broker, "POST", f"/snapshot?out={name}")
    assert status == 200, text
    return json.loads(text)["path"]


def read_with_spark(spark, path: str) -> dict[str, list[tuple[str, bytes]]]:
    """{queue name: [(message id, body), ...]} of a snapshot, read through the mqd format."""
    table = (spark.read.format("mqd").option("partitions", "2").load(path)
             .select("topic", "channel", "message_id", "body").toArrow())
    out: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
    for row in table.to_pylist():
        name = row["topic"] if row["channel"] is None else f"{row['topic']}:{row['channel']}"
        out[name].append((row["message_id"], row["body"]))
    return out


def test_snapshots_of_a_busy_durable_broker(start_broker, spark):
    broker = start_broker(*FAST_SCAN, "--durable")
    create(broker, TOPIC, "c1")
    assert call(broker, "POST", f"/channel/create?topic={TOPIC}&channel=c2")[0] == 200
    assert call(broker, "POST", f"/topic/create?topic={SOLO}")[0] == 200

    traffic = Traffic()
    # c1's consumer FINishes every message whose number is not a multiple of 3
    # and keeps the others in flight.
    traffic.start(consumer, broker, TOPIC, "c1", rdy=2500, keep_every=3)
    for tag in (1, 2):
        traffic.start(http_publisher, broker, TOPIC, prefix=b"h%d" % tag, batch=BATCH, padding=97)
    traffic.start(tcp_publisher, broker, SOLO, batches=(BATCH,), padding=13)
    paths = []
    try:
        for i in range(4):
            # Each snapshot with more traffic behind it than the last one.
            goal = 200 * (i + 1)
            wait_for(lambda goal=goal: (traffic.count(TOPIC) >= goal and traffic.count(SOLO) >= goal // 4
                                        and len(traffic.finished) >= goal // 10) or traffic.errors,
                     timeout=30, what=f"{goal} messages published")
            assert not traffic.errors, traffic.errors
            paths.append(snapshot(broker, f"busy{i}"))
    finally:
        traffic.join()
    assert not traffic.errors, traffic.errors
    published = {topic: set(bodies) for topic, bodies in traffic.published.items()}
    assert len(published[TOPIC]) == len(traffic.published[TOPIC])  # bodies are unique
    assert len(published[SOLO]) == len(traffic.published[SOLO])
    finished = set(traffic.finished)

    # Traffic has stopped and the consumer is gone: wait for its in-flight
    # messages to be requeued, then take the final snapshot.
    want_c1 = len(published[TOPIC]) - len(finished)
    def requeued() -> bool:
        c1 = queue_stats(broker)[f"{TOPIC}:c1"]
        return (c1["client_count"], c1["in_flight_count"], c1["depth"]) == (0, 0, want_c1)

    wait_for(requeued, timeout=30, what="the consumer's in-flight messages to be requeued")
    paths.append(snapshot(broker, "final"))

    ids: dict[bytes, str] = {}  # body -> message id, the same in every queue and snapshot
    for path in paths:
        manifest = read_manifest(path)
        got = read_with_spark(spark, path)
        counts = {q.name: q.count for q in manifest.queues}
        assert {name: len(rows) for name, rows in got.items()} == {n: c for n, c in counts.items() if c}
        assert set(counts) <= {TOPIC, f"{TOPIC}:c1", f"{TOPIC}:c2", SOLO}
        for name, rows in got.items():
            topic = name.partition(":")[0]
            repeated = [i for i, n in Counter(i for i, _ in rows).items() if n > 1]
            assert not repeated, f"{path} {name}: message ids more than once: {repeated[:5]}"
            unknown = [b for _, b in rows if b not in published[topic]]
            assert not unknown, f"{path} {name}: bodies never published: {unknown[:5]}"
            for msg_id, body in rows:
                assert ids.setdefault(body, msg_id) == msg_id, (path, name, body)

    # The final cut: each channel holds what was published minus what was finished.
    final = read_with_spark(spark, paths[-1])
    bodies = {name: {b for _, b in rows} for name, rows in final.items()}
    assert bodies[f"{TOPIC}:c1"] == published[TOPIC] - finished
    assert bodies[f"{TOPIC}:c2"] == published[TOPIC]
    assert bodies[SOLO] == published[SOLO]
    assert TOPIC not in bodies  # the topic's own queue is drained into its channels
    assert finished and all(number(b) % 3 for b in finished)
    # The consumer saw the same ids as the snapshots hold (a body's every delivery).
    for body, msg_id, _ in traffic.deliveries:
        assert ids[body] == msg_id, body
