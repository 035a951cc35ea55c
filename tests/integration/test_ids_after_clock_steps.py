"""A real `--durable` broker, SIGKILLed and restarted with its clock behind, stores no id twice.

The clock is moved with the test-only MQD_TEST_CLOCK_OFFSET (mqd.nsqd.tap):
the restarted broker's reactor time, which ids and timestamps are made
of, is that many seconds behind the wall clock. Before the id lease the
restarted broker reissued the ids of the last seconds before the crash.
"""

from __future__ import annotations

import time

import lmdb
import pytest

from backends.lmdb import ENV_DIR, RECORD
from mqd.nsqd.tap import CLOCK_OFFSET_ENV
from tests.support.processes import http_request

pytestmark = pytest.mark.slow

BEHIND = 3.0


def _publish_for(broker, seconds: float, body: bytes) -> int:
    """MPUB batches of 100 for `seconds`; how many messages were acknowledged (all must be)."""
    done = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        status, _ = http_request(broker.http_address, "POST", "/mpub?topic=t", b"\n".join([body] * 100))
        assert status == 200
        done += 100
    return done


def _stored(data_dir) -> list[tuple[int, bytes, bytes]]:
    """(timestamp, id, body) of every record of a stopped broker's store."""
    env = lmdb.open(str(data_dir / ENV_DIR), max_dbs=8, readonly=True, lock=False)
    try:
        messages = env.open_db(b"messages")
        with env.begin() as txn:
            out = []
            for _key, value in txn.cursor(db=messages):
                ts, _attempts, _deferred, msg_id = RECORD.unpack_from(value)
                out.append((ts, msg_id, bytes(value[RECORD.size:])))
            return out
    finally:
        env.close()


def test_sigkill_and_a_clock_stepped_back_reissue_no_id(start_broker, monkeypatch):
    broker = start_broker("--durable")
    assert broker.post("/topic/create?topic=t") == 200
    assert broker.post("/channel/create?topic=t&channel=c") == 200
    before = _publish_for(broker, 1.5, b"before")
    broker.crash()
    monkeypatch.setenv(CLOCK_OFFSET_ENV, str(-BEHIND))
    broker.start()
    after = _publish_for(broker, 1.5, b"after")
    broker.stop_cleanly()

    stored = _stored(broker.data_dir)
    assert len(stored) == before + after  # one channel, nothing consumed
    ids = [msg_id for _, msg_id, _ in stored]
    assert len(set(ids)) == len(ids), f"{len(ids) - len(set(ids))} stored messages share an id"
    # The offset took: the restarted broker's clock was behind the first run's.
    last_before = max(ts for ts, _, body in stored if body == b"before")
    first_after = min(ts for ts, _, body in stored if body == b"after")
    assert first_after < last_before
    # And every id after the restart sorts after every id before it.
    assert max(i for _, i, b in stored if b == b"before") < min(i for _, i, b in stored if b == b"after")
