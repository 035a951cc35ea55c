"""The log-floor store (bench/harness/logfloor.py) keeps the durable contract it measures the floor of.

If it answered a publish before its log chunk was synced, or delivered
messages not yet on disk, its figure would be no floor for mqd's durable
mode. Driven through the real broker and V2 protocol; the writer thread is
a ThreadedClock's, run when the test says.
"""

from __future__ import annotations

import pytest

import backends
from bench.harness import logfloor
from bench.harness.logfloor import NAME, LogFloorStore
from tests.support.inprocess_broker import new_broker
from tests.support.threaded_clock import ThreadedClock
from tests.support.v2_client import Client
from tests.support.v2_frames import mpub, ok, pub


@pytest.fixture
def broker(tmp_path, monkeypatch):
    monkeypatch.setitem(backends._FACTORIES, NAME, LogFloorStore)
    monkeypatch.setattr(logfloor, "_LOG_SIZE", 4096)
    clock = ThreadedClock()
    broker = new_broker(tmp_path, clock, backend=NAME, durable=True)
    yield broker
    broker.close()


def test_a_publish_is_answered_and_delivered_only_once_its_chunk_is_synced(broker, tmp_path):
    clock = broker.clock
    log = tmp_path / "floor.log"
    reader, writer = Client(broker), Client(broker)
    reader.sub(rdy=10)
    assert writer.request(pub("t", b"one") + mpub("t", [b"two", b"three"])) == []
    assert reader.read() == []
    clock.advance(0)  # the turn ends: its chunk goes to the writer thread
    assert log.read_bytes().count(b"\0") == len(log.read_bytes())  # nothing written yet
    clock.run_threads()
    data = log.read_bytes()
    assert all(body in data for body in (b"one", b"two", b"three"))
    assert writer.read() == [] and reader.read() == []  # synced, not landed yet
    clock.advance(0)
    assert writer.read() == [ok(), ok()]
    got = reader.messages()
    assert [m.body for m in got] == [b"one", b"two", b"three"]

    # A FIN is logged, its id, with the next chunk.
    reader.fin(got[0])
    clock.advance(0)
    clock.run_threads()
    assert log.read_bytes().count(got[0].id) == 2  # in its record, then alone
