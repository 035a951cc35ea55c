"""kill -9 of a `--durable` broker with retention on: every acknowledged publish is in the log, in order, once.

Publishers (PUB and MPUB, several connections, several topics) run while
the broker is killed at a random moment, round after round on the same
data directory. After each restart, each topic's retained log is read
whole with `GET /topic/read` (the binary frames): offsets run from the
earliest with no gap and continue the previous round's; every body the
broker acknowledged is there exactly once; a publisher's bodies are in
the order it sent them (responses come in command order); no record is
damaged; and nothing is there that nobody sent.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from mqd.wire.log_frames import iter_frames
from tests.support.durable_load import Publisher, check_body
from tests.support.processes import http_request

pytestmark = pytest.mark.slow

TOPICS = ["log_a", "log_b"]


def _read_log(broker, topic: str) -> tuple[int, list[tuple[int, bytes]]]:
    """The topic's epoch and its (offset, body) records from the earliest on."""
    status, raw = http_request(broker.http_address, "GET", f"/topic/offsets?topic={topic}")
    assert status == 200, raw
    offsets = json.loads(raw)
    records: list[tuple[int, bytes]] = []
    offset = offsets["earliest"]
    while offset < offsets["latest"]:
        status, raw = http_request(broker.http_address, "GET",
                                   f"/topic/read?topic={topic}&offset={offset}&max_messages=100000"
                                   f"&max_bytes={8 << 20}")
        assert status == 200, raw[:200]
        got = [(o, body) for o, _, attempts, _, body in iter_frames(raw)]
        assert got, f"no record at offset {offset} below latest {offsets['latest']}"
        records += got
        offset = got[-1][0] + 1
    return offsets["epoch"], records


def test_kill_9_with_retention_keeps_every_acknowledged_publish_in_the_log_once_in_order(start_broker):
    broker = start_broker("--durable", "--retention-bytes=1GB")
    rounds = int(os.environ.get("MQD_KILL_ROUNDS", "6"))
    rng = random.Random(48)
    acked: dict[bytes, str] = {}
    order: dict[bytes, list[bytes]] = {}  # publisher tag -> its acknowledged bodies, in order
    sent: set[bytes] = set()
    epochs: dict[str, int] = {}
    next_offset = {topic: 0 for topic in TOPICS}
    for round_no in range(rounds):
        publishers = [Publisher(broker, round_no * 10 + i, TOPICS, window=rng.choice((1, 4, 16)))
                      for i in range(3)]
        for p in publishers:
            p.start()
        time.sleep(rng.uniform(0.3, 1.2))
        broker.crash()
        for p in publishers:
            p.join(30)
            assert not p.is_alive()
            sent.update(p.sent)
            acked.update(p.acked)
            # Publisher.acked is filled in acknowledgement order, which is command order.
            order[p.tag] = list(p.acked)
        broker.start()
        seen: dict[bytes, int] = {}
        for topic in TOPICS:
            epoch, records = _read_log(broker, topic)
            if topic in epochs:
                assert epoch == epochs[topic], "the log's epoch changed across a crash"
            epochs[topic] = epoch
            offsets = [o for o, _ in records]
            assert offsets == list(range(offsets[0], offsets[0] + len(offsets))) if offsets else True
            # Offsets continue where the last round's log ended: none reused, none skipped.
            assert offsets[0] == 0 if offsets else True
            assert not offsets or offsets[-1] + 1 >= next_offset[topic]
            next_offset[topic] = offsets[-1] + 1 if offsets else 0
            for offset, body in records:
                check_body(body)
                assert body in sent, f"{topic}@{offset}: a body nobody sent {body[:40]!r}"
                assert body not in seen, f"{topic}@{offset}: {body[:40]!r} twice (also @{seen[body]})"
                seen[body] = offset
        missing = [body for body, topic in acked.items() if body not in seen]
        assert not missing, f"round {round_no}: {len(missing)} acknowledged bodies not in the log"
        for tag, bodies in order.items():
            positions = [(acked[b], seen[b]) for b in bodies]
            for topic in TOPICS:
                mine = [o for t, o in positions if t == topic]
                assert mine == sorted(mine), f"{tag!r}: acknowledged publishes out of order in {topic}"
    assert len(acked) > 300 * rounds
    broker.stop_cleanly()
