"""nsqd.dat: written atomically after changes, ephemeral names left out, restored on load."""

from __future__ import annotations

import json
import os

import pytest

from mqd.nsqd.broker import Broker
from mqd.nsqd.metadata import ID_LEASE_FILE, METADATA_FILE
from mqd.options import ConfigError
from tests.support.inprocess_broker import new_broker, settings
from tests.support.v2_client import Client
from tests.support.v2_frames import ok, pub


def read_meta(path) -> dict:
    return json.loads((path / METADATA_FILE).read_bytes())


def test_open_writes_empty_metadata(tmp_path, make_broker):
    make_broker()
    assert read_meta(tmp_path) == {"topics": None, "version": "1.3.0"}
    assert sorted(os.listdir(tmp_path)) == [ID_LEASE_FILE, METADATA_FILE]


def test_open_creates_data_path(tmp_path, make_broker):
    path = tmp_path / "a" / "b"
    make_broker(path=path)
    assert read_meta(path)["topics"] is None


def test_data_path_not_creatable(tmp_path, clock):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    broker = Broker(settings(blocker / "sub"), clock=clock)
    with pytest.raises(ConfigError, match="data-path"):
        broker.open()


def test_written_after_creation_on_next_turn(tmp_path, inproc_broker, clock):
    c = Client(inproc_broker)
    c.sub("t", "c")
    assert c.request(pub("u", b"x")) == [ok()]
    assert read_meta(tmp_path)["topics"] is None  # scheduled, not yet written
    clock.advance(0)
    assert read_meta(tmp_path) == {
        "topics": [
            {"name": "t", "paused": False, "channels": [{"name": "c", "paused": False}]},
            {"name": "u", "paused": False, "channels": None},
        ],
        "version": "1.3.0",
    }
    assert sorted(os.listdir(tmp_path)) == [ID_LEASE_FILE, METADATA_FILE]  # no temp files left


def test_one_write_for_many_changes(tmp_path, inproc_broker, clock, monkeypatch):
    writes = []
    original = inproc_broker.metadata._write_file

    def counting(data, seq):
        writes.append(1)
        original(data, seq)

    monkeypatch.setattr(inproc_broker.metadata, "_write_file", counting)
    for i in range(5):
        inproc_broker.topic(f"t{i}").channel("c")
    clock.advance(0)
    assert len(writes) == 1
    assert len(read_meta(tmp_path)["topics"]) == 5


def test_ephemeral_excluded(tmp_path, inproc_broker, clock):
    Client(inproc_broker).sub("t", "c#ephemeral")
    Client(inproc_broker).sub("t", "c")
    Client(inproc_broker).sub("e#ephemeral", "c")
    clock.advance(0)
    assert read_meta(tmp_path)["topics"] == [
        {"name": "t", "paused": False, "channels": [{"name": "c", "paused": False}]}
    ]


def test_ephemeral_only_changes_schedule_nothing(tmp_path, inproc_broker, clock):
    Client(inproc_broker).sub("e#ephemeral", "c#ephemeral")
    assert inproc_broker.metadata._call is None
    assert not any(call.func == inproc_broker.metadata._write_async for call in clock.getDelayedCalls())
    assert inproc_broker.metadata.writing is None


def test_deletion_rewritten(tmp_path, inproc_broker, clock):
    inproc_broker.topic("t").channel("c")
    inproc_broker.topic("u")
    clock.advance(0)
    inproc_broker.topics["t"].delete_channel("c")
    inproc_broker.delete_topic("u")
    clock.advance(0)
    assert read_meta(tmp_path)["topics"] == [{"name": "t", "paused": False, "channels": None}]


def test_write_is_atomic(tmp_path, inproc_broker, clock, monkeypatch):
    inproc_broker.topic("t")
    clock.advance(0)
    before = (tmp_path / METADATA_FILE).read_bytes()
    inproc_broker.topic("u")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        inproc_broker.metadata.write_now()
    assert (tmp_path / METADATA_FILE).read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == [ID_LEASE_FILE, METADATA_FILE]


def test_load_restores_topics_channels_and_paused(tmp_path, clock):
    first = new_broker(tmp_path, clock)
    first.topic("t").channel("c")
    first.topic("t").channel("paused-ch").pause()
    first.topic("p").pause()
    first.topic("p").channel("x")
    first.topic("lonely")
    first.topic("t").channel("gone#ephemeral")
    first.topic("e#ephemeral").channel("c")
    first.close()  # saves metadata and releases the data-path lock

    second = new_broker(tmp_path, clock)
    assert set(second.topics) == {"t", "p", "lonely"}
    t = second.topics["t"]
    assert set(t.channels) == {"c", "paused-ch"}
    assert not t.paused
    assert not t.channels["c"].paused
    assert t.channels["paused-ch"].paused
    assert second.topics["p"].paused
    assert set(second.topics["p"].channels) == {"x"}
    assert second.topics["lonely"].channels == {}
    # Loading does not schedule a rewrite of what it just read.
    assert second.metadata._call is None


def test_restored_topic_delivers_to_restored_channel(tmp_path, clock):
    first = new_broker(tmp_path, clock)
    first.topic("t").channel("c")
    first.close()
    second = new_broker(tmp_path, clock)
    # The channel exists before any consumer, so published messages wait in it.
    assert Client(second).request(pub("t", b"x")) == [ok()]
    assert second.topics["t"].channels["c"].depth() == 1


def test_load_nsqd_written_file(tmp_path, clock):
    (tmp_path / METADATA_FILE).write_text(
        json.dumps(
            {
                "topics": [
                    {"name": "orders", "paused": False, "channels": [{"name": "billing", "paused": True}]},
                    {"name": "bad name!", "paused": False, "channels": None},
                    {"name": "ok", "paused": False, "channels": [{"name": "x#ephemeral", "paused": False},
                                                                  {"name": "?", "paused": False}]},
                ],
                "version": "1.2.1",
            }
        )
    )
    broker = new_broker(tmp_path, clock)
    assert set(broker.topics) == {"orders", "ok"}
    assert broker.topics["orders"].channels["billing"].paused
    assert broker.topics["ok"].channels == {}
    assert read_meta(tmp_path)["version"] == "1.3.0"  # rewritten at open


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        b"null",
        b'{"topics": 5}',
        b'{"topics": {"name": "t"}}',
        b'{"topics": [{"name": 5}]}',
        b'{"topics": [{"name": "t", "channels": 5}]}',
        b'{"topics": [{"name": "t", "channels": [{"name": ["c"]}]}]}',
        b'{"topics": [1]}',
        b'{"topics": [{"name": "t", "channels": ["c"]}]}',
    ],
)
def test_corrupt_metadata_is_config_error(tmp_path, clock, content):
    (tmp_path / METADATA_FILE).write_bytes(content)
    broker = Broker(settings(tmp_path), clock=clock)
    with pytest.raises(ConfigError) as e:
        broker.open()
    assert str(tmp_path / METADATA_FILE) in str(e.value)
    assert (tmp_path / METADATA_FILE).read_bytes() == content  # not overwritten


def test_close_persists(tmp_path, inproc_broker, clock):
    inproc_broker.topic("t").channel("c")
    inproc_broker.close()
    assert read_meta(tmp_path)["topics"][0]["name"] == "t"
