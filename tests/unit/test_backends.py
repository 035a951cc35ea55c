"""Backends and the consumer interface: zope declarations and queue behaviour."""

from __future__ import annotations

import pytest
from zope.interface.verify import verifyClass, verifyObject

import backends
from backends import BackendError, IBackendQueue, IBackendStore
from backends.dummy import DummyQueue, DummyStore
from backends.memory import MemoryQueue, MemoryStore
from mqd.message import Message
from mqd.nsqd.interfaces import IConsumer
from mqd.nsqd.protocol.v2 import V2Protocol
from tests.support.v2_client import Client
from tests.support.v2_frames import cmd, err, mpub, ok, pub


def msgs(n: int, start: int = 0) -> list[Message]:
    return [Message(b"%016d" % i, b"%d" % i, 0) for i in range(start, start + n)]


@pytest.mark.parametrize("store_class", [MemoryStore, DummyStore])
def test_stores_provide_interfaces(store_class):
    store = store_class(None)
    assert verifyObject(IBackendStore, store)
    queue = store.open_queue("t:c")
    assert verifyObject(IBackendQueue, queue)
    assert queue.name == "t:c"
    store.close()


@pytest.mark.parametrize("queue_class", [MemoryQueue, DummyQueue])
def test_queue_classes_implement_interface(queue_class):
    assert verifyClass(IBackendQueue, queue_class)


def test_protocol_provides_iconsumer(connect):
    c = connect()
    assert verifyObject(IConsumer, c.proto)
    assert verifyClass(IConsumer, V2Protocol)


def test_open_store_by_name(tmp_path):
    assert {"memory", "dummy"} <= set(backends.available())
    assert isinstance(backends.open_store("memory"), MemoryStore)
    assert isinstance(backends.open_store("dummy"), DummyStore)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        backends.open_store("nope")


def test_register_backend():
    calls = []

    def factory(options, clock=None):
        calls.append(options)
        return MemoryStore(options)

    backends.register("test-only", factory)
    try:
        assert "test-only" in backends.available()
        store = backends.open_store("test-only", "opts")
        assert isinstance(store, MemoryStore)
        assert calls == ["opts"]
    finally:
        backends._FACTORIES.pop("test-only", None)


def test_memory_queue_fifo_in_batches():
    q = MemoryStore().open_queue("t")
    q.put(msgs(5))
    q.put(msgs(5, 5))
    assert q.depth() == 10
    assert [m.body for m in q.read(3)] == [b"0", b"1", b"2"]
    assert q.depth() == 7
    assert [m.body for m in q.read(100)] == [b"%d" % i for i in range(3, 10)]
    assert q.depth() == 0
    assert q.read(10) == []


def test_memory_queue_empty_delete_sync_close():
    q = MemoryQueue("t")
    q.put(msgs(3))
    q.sync()
    assert q.depth() == 3
    q.empty()
    assert q.depth() == 0
    q.put(msgs(2))  # still usable after empty
    assert q.depth() == 2
    q.delete()
    assert q.depth() == 0
    q.close()


def test_memory_store_returns_same_queue_by_name():
    store = MemoryStore()
    a = store.open_queue("t")
    a.put(msgs(2))
    assert store.open_queue("t") is a
    assert store.open_queue("t").depth() == 2
    assert store.open_queue("u") is not a
    store.close()
    assert store.open_queue("t").depth() == 0


def test_dummy_queue_drops_everything():
    q = DummyStore().open_queue("t#ephemeral")
    q.put(msgs(100))
    assert q.depth() == 0
    assert q.read(100) == []
    q.empty()
    q.sync()
    q.delete()
    q.close()


def test_ephemeral_channel_overflow_dropped(make_broker):
    broker = make_broker(mem_queue_size=2)
    c = Client(broker)
    c.sub("t", "c#ephemeral")
    assert Client(broker).request(mpub("t", [b"1", b"2", b"3", b"4"])) == [ok()]
    channel = broker.topics["t"].channels["c#ephemeral"]
    assert (channel.depth(), channel.backend_depth(), channel.message_count) == (2, 0, 4)
    # The durable topic itself overflowed nothing: it fans out at once.
    c.send(b"RDY 10\n")
    assert [m.body for m in c.messages()] == [b"1", b"2"]


class FailingQueue(MemoryQueue):
    def put(self, messages, fresh=False):
        raise BackendError("disk full")


def test_backend_failure_is_pub_failed(make_broker):
    broker = make_broker(mem_queue_size=0)
    broker.topic("t")._queue.backend = FailingQueue("t")
    c = Client(broker)
    assert c.request(pub("t", b"x")) == [err("E_PUB_FAILED PUB failed disk full")]
    assert c.closed
    assert broker.health == "disk full"
    # A refused publish is not counted.
    assert (broker.topics["t"].message_count, broker.topics["t"].message_bytes) == (0, 0)
    c = Client(broker)
    assert c.request(mpub("t", [b"x"])) == [err("E_MPUB_FAILED MPUB failed disk full")]
    c = Client(broker)
    assert c.request(cmd("DPUB", "t", 10) + b"\x00\x00\x00\x01x") == [err("E_DPUB_FAILED DPUB failed disk full")]


def test_requeue_survives_backend_failure(make_broker):
    broker = make_broker(mem_queue_size=1)
    c = Client(broker)
    c.sub(rdy=5)
    assert Client(broker).request(mpub("t", [b"1", b"2"])) == [ok()]
    m1, m2 = c.messages()
    channel = broker.topics["t"].channels["c"]
    channel._queue.backend = FailingQueue("t:c")
    c.send(cmd("RDY", 0) + cmd("REQ", m1.id, 0) + cmd("REQ", m2.id, 0))
    assert c.raw() == b""
    assert channel.depth() == 2  # kept in memory beyond the bound, not lost
    c.send(cmd("RDY", 5))
    assert [(m.body, m.attempts) for m in c.messages()] == [(b"1", 2), (b"2", 2)]
