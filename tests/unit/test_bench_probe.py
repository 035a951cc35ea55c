"""The ceiling probe (bench/harness/probe.py) speaks enough V2 to stay a valid yardstick.

If it answered the bench clients wrongly (lost messages, ignored RDY, FINs
that never free the window) its figures would be no ceiling for mqd's.
"""

from __future__ import annotations

import json

import pytest
from twisted.internet.testing import StringTransport

from bench.harness.probe import DurableLog, ProbeFactory
from tests.support.threaded_clock import ThreadedClock
from tests.support.v2_frames import (
    CLOSE_WAIT,
    MAGIC,
    Frame,
    Msg,
    cmd,
    err,
    identify,
    mpub,
    ok,
    parse_frames,
    pub,
)


class TcpTransport(StringTransport):
    """StringTransport plus the TCP option the probe sets on every connection."""

    nodelay = False

    def setTcpNoDelay(self, enabled: bool) -> None:
        self.nodelay = enabled


class Conn:
    def __init__(self, factory: ProbeFactory) -> None:
        self.proto = factory.buildProtocol(None)
        self.transport = TcpTransport()
        self.proto.makeConnection(self.transport)
        self.proto.dataReceived(MAGIC)

    def request(self, data: bytes, split: bool = False) -> list[Frame | Msg]:
        if split:  # byte by byte: every partial-command path of the parser
            for i in range(len(data)):
                self.proto.dataReceived(data[i : i + 1])
        else:
            self.proto.dataReceived(data)
        out = parse_frames(self.transport.value())
        self.transport.clear()
        return out


@pytest.fixture
def factory() -> ProbeFactory:
    return ProbeFactory()


@pytest.mark.parametrize("split", [False, True])
def test_pub_sub_rdy_fin(factory, split):
    writer, reader = Conn(factory), Conn(factory)
    assert writer.transport.nodelay
    assert reader.request(cmd("SUB", "t", "c"), split) == [ok()]
    assert writer.request(pub("t", b"one") + mpub("t", [b"two", b"three", b"four"]), split) == [
        ok(),
        ok(),
    ]
    assert reader.request(b"", split) == []  # RDY 0: nothing delivered yet

    got = reader.request(cmd("RDY", 2), split)
    assert [m.body for m in got] == [b"one", b"two"]
    assert all(isinstance(m, Msg) and m.attempts == 1 and len(m.id) == 16 for m in got)
    assert len({m.id for m in got}) == 2
    assert reader.request(cmd("NOP"), split) == []  # window full

    # Each FIN frees a slot; the next message follows in the same turn.
    assert [m.body for m in reader.request(cmd("FIN", got[0].id), split)] == [b"three"]
    rest = reader.request(cmd("FIN", got[1].id), split)
    assert [m.body for m in rest] == [b"four"]
    assert reader.request(cmd("FIN", got[0].id), split) == [err("E_FIN_FAILED FIN failed")]
    assert reader.request(cmd("FIN", rest[0].id) + cmd("CLS"), split) == [CLOSE_WAIT]
    assert writer.request(pub("t", b"five"), split) == [ok()]
    assert reader.request(b"", split) == []  # closing: no more deliveries
    assert not reader.transport.disconnecting


@pytest.mark.parametrize("split", [False, True])
def test_a_pipelined_run_of_pubs_is_answered_and_delivered_in_order(factory, split):
    writer, reader = Conn(factory), Conn(factory)
    reader.request(cmd("SUB", "t", "c") + cmd("RDY", 10))
    run = pub("t", b"1") + pub("t", b"2") + pub("u", b"x") + pub("t", b"3")
    assert writer.request(run, split) == [ok()] * 4
    assert [m.body for m in reader.request(b"")] == [b"1", b"2", b"3"]
    # A run cut inside a body waits for the rest, then goes on.
    tail = pub("t", b"4") + pub("t", b"five")
    assert writer.request(tail[:-2]) == [ok()]
    assert writer.request(tail[-2:]) == [ok()]
    assert [m.body for m in reader.request(b"")] == [b"4", b"five"]


def test_messages_before_the_channel_and_unfinished_ones_are_kept(factory):
    writer = Conn(factory)
    assert writer.request(mpub("t", [b"a", b"b"])) == [ok()]
    first = Conn(factory)
    first.request(cmd("SUB", "t", "c"))
    got = first.request(cmd("RDY", 10))
    assert [m.body for m in got] == [b"a", b"b"]
    first.proto.connectionLost(None)  # in flight, never FINed: back to the queue
    second = Conn(factory)
    second.request(cmd("SUB", "t", "c"))
    assert [m.body for m in second.request(cmd("RDY", 10))] == [b"a", b"b"]


def test_channels_each_get_every_message(factory):
    a, b = Conn(factory), Conn(factory)
    a.request(cmd("SUB", "t", "x") + cmd("RDY", 5))
    b.request(cmd("SUB", "t", "y") + cmd("RDY", 5))
    Conn(factory).request(mpub("t", [b"m1", b"m2"]))
    assert [m.body for m in a.request(b"")] == [b"m1", b"m2"]
    assert [m.body for m in b.request(b"")] == [b"m1", b"m2"]


def test_identify(factory):
    assert Conn(factory).request(identify(client_id="x")) == [ok()]
    (answer,) = Conn(factory).request(identify(feature_negotiation=True))
    assert json.loads(answer.payload)["max_rdy_count"] == 2500


def test_bad_input_closes(factory):
    c = Conn(factory)
    assert c.request(cmd("BOGUS")) == [err("E_INVALID invalid command BOGUS")]
    assert c.transport.disconnecting
    proto, transport = factory.buildProtocol(None), TcpTransport()
    proto.makeConnection(transport)
    proto.dataReceived(b"  V1")
    assert parse_frames(transport.value()) == [err("E_BAD_PROTOCOL bad protocol magic")]
    assert transport.disconnecting


def test_durable_probe_answers_and_delivers_only_once_the_chunk_is_synced(tmp_path):
    """--durable: a turn's publishes and FINs go to the log in one write; OK and delivery follow the sync."""
    clock = ThreadedClock()
    path = tmp_path / "probe.log"
    factory = ProbeFactory(DurableLog(clock, str(path), size=4096))
    writer, reader = Conn(factory), Conn(factory)
    assert reader.request(cmd("SUB", "t", "c") + cmd("RDY", 10)) == [ok()]
    assert writer.request(pub("t", b"one") + mpub("t", [b"two", b"three"])) == []
    assert reader.request(b"") == []
    clock.advance(0)  # the turn ends: its chunk goes to the writer thread
    assert writer.request(b"") == [] and path.read_bytes() == bytes(4096)  # preallocated, nothing written
    assert clock.run_threads() == 1
    written = sum(4 + 16 + len(b) for b in (b"one", b"two", b"three"))
    assert path.read_bytes()[written:] == bytes(4096 - written)
    assert path.read_bytes()[4:20] != bytes(16)  # the first record's id
    assert writer.request(b"") == []  # written and synced, not landed yet
    clock.advance(0)
    assert writer.request(b"") == [ok(), ok()]
    got = reader.request(b"")
    assert [m.body for m in got] == [b"one", b"two", b"three"]

    # A FIN is logged (its id) with the next chunk; it needs no answer.
    assert reader.request(cmd("FIN", got[0].id)) == []
    clock.advance(0)
    clock.run_threads()
    assert path.read_bytes()[written:written + 16] == got[0].id

    # A chunk that would run past the end starts the log over, in place: the file never grows.
    big = b"x" * 4000
    assert writer.request(pub("t", big)) == []
    clock.advance(0)
    clock.run_threads()
    clock.advance(0)
    assert writer.request(b"") == [ok()]
    data = path.read_bytes()
    assert len(data) == 4096 and data[20:4020] == big
