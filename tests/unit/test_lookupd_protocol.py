"""mqlookupd's V1 TCP protocol: every command and error byte for byte, and registration semantics."""

from __future__ import annotations

import json
import struct

import pytest

from mqd.lookup.protocol import MAX_IDENTIFY_BODY, MAX_LINE, LookupdFactory, frame
from mqd.lookup.registry import Registration, RegistrationDB
from tests.support.lookupd_clients import IDENTIFY, Conn
from tests.support.v2_frames import sized


@pytest.fixture
def db(clock):
    return RegistrationDB(clock)


@pytest.fixture
def factory(db):
    return LookupdFactory(db, "lookup-host", {"TCP": 4160, "HTTP": 4161}, hostname="lhost")


@pytest.fixture
def connect(factory):
    ports = iter(range(50000, 60000))

    def make(magic: bool = True) -> Conn:
        conn = Conn(factory, next(ports))
        if magic:
            assert conn.send(b"  V1") == b""
        return conn

    return make


def _producers(db, *reg):
    return [p.peer.id for p in db.find_producers(*reg)]


def test_frame_is_size_then_payload_without_a_type():
    assert frame(b"OK") == b"\x00\x00\x00\x02OK"


def test_bad_magic_is_answered_and_closed(connect):
    conn = connect(magic=False)
    assert conn.send(b"  V2") == frame(b"E_BAD_PROTOCOL")
    assert conn.closed
    assert conn.send(b"PING\n") == b""


def test_identify_answers_lookupds_own_addresses(connect, db, clock):
    conn = connect()
    out = conn.identify()
    assert out == frame(b'{"broadcast_address":"lookup-host","hostname":"lhost",'
                        b'"http_port":4161,"tcp_port":4160,"version":"1.3.0"}')
    assert not conn.closed
    (producer,) = db.find_producers("client", "", "")
    peer = producer.peer
    assert (peer.id, peer.remote_address) == ("10.0.0.1:50000", "10.0.0.1:50000")
    assert (peer.broadcast_address, peer.tcp_port, peer.http_port, peer.version) == ("b1", 4150, 4151, "1.3.0")
    assert (peer.hostname, peer.topology_zone, peer.topology_region) == ("box", "z", "r")
    assert peer.last_update == clock.seconds()


def test_identify_in_pieces(connect):
    conn = connect()
    body = json.dumps(IDENTIFY).encode()
    data = b"IDENTIFY\n" + sized(body) + b"PING\n"
    out = b"".join(conn.send(data[i:i + 1]) for i in range(len(data)))
    assert out.endswith(frame(b"OK")) and out.startswith(b"\x00\x00\x00")


def test_a_half_close_after_whole_commands_closes_quietly(connect):
    conn = connect()
    assert conn.send(b"PING\n") == frame(b"OK")
    conn.proto.readConnectionLost()
    assert conn.closed and conn.transport.value() == b""


@pytest.mark.parametrize(("cut", "what"), [(b"\x00\x00", b"body size"), (sized(b'{"tcp_port"')[:9], b"body")])
def test_an_identify_cut_short_by_a_half_close_is_a_bad_body(connect, cut, what):
    conn = connect()
    assert conn.send(b"IDENTIFY\n" + cut) == b""
    conn.proto.readConnectionLost()
    assert conn.transport.value() == frame(b"E_BAD_BODY IDENTIFY failed to read " + what)
    assert conn.closed


def test_identify_twice_is_fatal(connect):
    conn = connect()
    conn.identify()
    assert conn.send(b"IDENTIFY\n") == frame(b"E_INVALID cannot IDENTIFY again")
    assert conn.closed


@pytest.mark.parametrize("body", [b"{nope", b"[1]", b'{"tcp_port":"4150"}', b'{"version":1}',
                                  b'{"tcp_port":true}', b'{"http_port":1.5}'])
def test_identify_bad_json(connect, body):
    conn = connect()
    out = conn.send(b"IDENTIFY\n" + sized(body))
    assert out == frame(b"E_BAD_BODY IDENTIFY failed to decode JSON body")
    assert conn.closed


@pytest.mark.parametrize("missing", ["broadcast_address", "tcp_port", "http_port", "version"])
def test_identify_missing_fields(connect, db, missing):
    conn = connect()
    assert conn.identify(**{missing: None}) == frame(b"E_BAD_BODY IDENTIFY missing fields")
    assert conn.closed
    assert db.find_registrations("client", "", "") == []


@pytest.mark.parametrize("size", [-1, MAX_IDENTIFY_BODY + 1])
def test_identify_body_size_is_bounded(connect, size):
    conn = connect()
    out = conn.send(b"IDENTIFY\n" + struct.pack(">i", size))
    assert out == frame(b"E_BAD_BODY IDENTIFY invalid body size %d" % size)
    assert conn.closed


def test_overlong_command_line_closes(connect):
    conn = connect()
    assert conn.send(b"R" * (MAX_LINE + 1)) == b""
    assert conn.closed


def test_invalid_command(connect):
    conn = connect()
    assert conn.send(b"NOPE a b\n") == frame(b"E_INVALID invalid command NOPE")
    assert conn.closed


def test_empty_line_is_an_invalid_command(connect):
    conn = connect()
    assert conn.send(b"  \r\n") == frame(b"E_INVALID invalid command ")


@pytest.mark.parametrize("command", [b"REGISTER", b"UNREGISTER"])
def test_register_before_identify(connect, command):
    conn = connect()
    assert conn.send(command + b" t\n") == frame(b"E_INVALID client must IDENTIFY")
    assert conn.closed


@pytest.mark.parametrize("command", ["REGISTER", "UNREGISTER"])
def test_register_argument_errors(connect, command):
    cases = [
        (f"{command}\n", f"E_INVALID {command} insufficient number of params"),
        (f"{command} bad!topic\n", f"E_BAD_TOPIC {command} topic name 'bad!topic' is not valid"),
        (f"{command} t bad!chan\n", f"E_BAD_CHANNEL {command} channel name 'bad!chan' is not valid"),
        (f"{command}  t\n", f"E_BAD_TOPIC {command} topic name '' is not valid"),
    ]
    for line, error in cases:
        conn = connect()
        conn.identify()
        assert conn.send(line.encode()) == frame(error.encode()), line
        assert conn.closed


def test_ping_before_and_after_identify(connect, db, clock):
    conn = connect()
    assert conn.send(b"PING\n") == frame(b"OK")
    conn.identify()
    (producer,) = db.find_producers("client", "", "")
    clock.advance(15)
    assert conn.send(b"PING\r\n") == frame(b"OK")
    assert producer.peer.last_update == clock.seconds()
    assert not conn.closed


def test_register_topic_and_channel(connect, db):
    conn = connect()
    conn.identify()
    assert conn.send(b"REGISTER t c\n") == frame(b"OK")
    assert _producers(db, "topic", "t", "") == ["10.0.0.1:50000"]
    assert _producers(db, "channel", "t", "c") == ["10.0.0.1:50000"]
    assert conn.send(b"REGISTER t2\n") == frame(b"OK")
    assert _producers(db, "topic", "t2", "") == ["10.0.0.1:50000"]
    assert db.find_registrations("channel", "t2", "*") == []
    # Registering again changes nothing.
    assert conn.send(b"REGISTER t c\n") == frame(b"OK")
    assert _producers(db, "topic", "t", "") == ["10.0.0.1:50000"]


def test_unregister_channel_keeps_topic(connect, db):
    conn = connect()
    conn.identify()
    conn.send(b"REGISTER t c\n")
    assert conn.send(b"UNREGISTER t c\n") == frame(b"OK")
    assert _producers(db, "channel", "t", "c") == []
    # A durable channel with no producers is still listed; the topic keeps its producer.
    assert db.find_registrations("channel", "t", "c") == [Registration("channel", "t", "c")]
    assert _producers(db, "topic", "t", "") == ["10.0.0.1:50000"]


def test_unregister_ephemeral_channel_removes_it_when_unproduced(connect, db):
    a, b = connect(), connect()
    a.identify()
    b.identify()
    a.send(b"REGISTER t c#ephemeral\n")
    b.send(b"REGISTER t c#ephemeral\n")
    a.send(b"UNREGISTER t c#ephemeral\n")
    assert db.find_registrations("channel", "t", "c#ephemeral") != []
    b.send(b"UNREGISTER t c#ephemeral\n")
    assert db.find_registrations("channel", "t", "c#ephemeral") == []
    assert db.find_registrations("topic", "t", "") != []


def test_unregister_topic_removes_it_from_channels(connect, db):
    conn = connect()
    conn.identify()
    conn.send(b"REGISTER t c\n")
    conn.send(b"REGISTER t d\n")
    assert conn.send(b"UNREGISTER t\n") == frame(b"OK")
    assert _producers(db, "channel", "t", "c") == _producers(db, "channel", "t", "d") == []
    assert _producers(db, "topic", "t", "") == []
    # Durable: still registered, with no producers.
    assert db.find_registrations("topic", "t", "") == [Registration("topic", "t", "")]


def test_unregister_ephemeral_topic_removes_it(connect, db):
    conn = connect()
    conn.identify()
    conn.send(b"REGISTER t#ephemeral\n")
    assert conn.send(b"UNREGISTER t#ephemeral\n") == frame(b"OK")
    assert db.find_registrations("topic", "t#ephemeral", "") == []


def test_unregister_unknown_is_ok(connect):
    conn = connect()
    conn.identify()
    assert conn.send(b"UNREGISTER nothing here#ephemeral\n") == frame(b"OK")


def test_close_removes_every_registration_of_that_broker(connect, db):
    a, b = connect(), connect()
    a.identify()
    b.identify(broadcast_address="b2")
    a.send(b"REGISTER t c\n")
    b.send(b"REGISTER t c\n")
    a.close()
    assert db.lookup_registrations("10.0.0.1:50000") == []
    assert _producers(db, "topic", "t", "") == ["10.0.0.1:50001"]
    assert _producers(db, "client", "", "") == ["10.0.0.1:50001"]
    # The registrations themselves stay (non-ephemeral).
    b.close()
    assert db.find_registrations("channel", "t", "c") == [Registration("channel", "t", "c")]


def test_error_closes_and_cleans_up(connect, db):
    conn = connect()
    conn.identify()
    conn.send(b"REGISTER t\n")
    assert conn.send(b"BOGUS\n") == frame(b"E_INVALID invalid command BOGUS")
    assert conn.closed
    # Anything after the error is ignored; the transport's close ends the registrations.
    assert conn.send(b"REGISTER t2\n") == b""
    conn.close()
    assert db.find_producers("topic", "t", "") == []


def test_commands_in_one_packet(connect, db):
    conn = connect(magic=False)
    body = json.dumps(IDENTIFY).encode()
    out = conn.send(b"  V1IDENTIFY\n" + sized(body) +
                    b"REGISTER t c\nPING\n")
    assert out.endswith(frame(b"OK") + frame(b"OK"))
    assert _producers(db, "channel", "t", "c") == ["10.0.0.1:50000"]
