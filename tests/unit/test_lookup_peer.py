"""The broker's lookupd peers: what goes on the wire, and reconnecting.

Each peer's ClientService connects through a fake endpoint that hands the
test every connection attempt; a connection is a StringTransport, and time
(PINGs, the 1 s command deadline, the reconnect backoff) is the broker's
Clock.
"""

from __future__ import annotations

import json
import struct

import pytest

from mqd import NSQ_VERSION
from mqd.nsqd.lookup_peer import MAGIC_V1, LookupService, identify_body
from tests.support.lookup_peer_fakes import LOOKUPD_INFO, PORTS, Conn, FakeEndpoint
from tests.support.v2_frames import sized


@pytest.fixture
def lookup(inproc_broker):
    """lookup(*addresses): a started LookupService whose endpoints are FakeEndpoints."""
    endpoints: dict[str, FakeEndpoint] = {}
    services = []

    def endpoint_for(address):
        endpoints[address] = FakeEndpoint(address)
        return endpoints[address]

    def start(*addresses: str):
        inproc_broker.update_options(lookupd_tcp_address=list(addresses))
        svc = LookupService(inproc_broker, PORTS, reactor=inproc_broker.clock, endpoint_for=endpoint_for)
        svc.endpoints = endpoints
        svc.startService()
        services.append(svc)
        return svc

    yield start
    for svc in services:
        if svc.running:
            svc.stopService()


def connected(lookup, address="10.0.0.1:4160"):
    """A service with the one lookupd `address`, connected and past IDENTIFY: (service, conn)."""
    svc = lookup(address)
    conn = svc.endpoints[address].accept()
    conn.identified()
    return svc, conn


def test_identify_announces_broadcast_ports_and_version(inproc_broker, lookup):
    svc = lookup("10.0.0.1:4160")
    conn = svc.endpoints["10.0.0.1:4160"].accept()
    assert conn.identified() == []
    assert conn.identify["version"] == NSQ_VERSION
    assert conn.identify["broadcast_address"] == "test-host"
    assert (conn.identify["tcp_port"], conn.identify["http_port"]) == (4150, 4151)
    assert set(conn.identify) == {"version", "tcp_port", "http_port", "hostname", "broadcast_address",
                                  "topology_zone", "topology_region"}
    # What nsqd keeps of the answer: its peerInfo struct's fields.
    assert svc.peers["10.0.0.1:4160"].protocol.lookupd_info == {
        k: LOOKUPD_INFO[k] for k in ("tcp_port", "http_port", "version", "broadcast_address")}


def test_broadcast_port_options_override_bound_ports(make_broker, tmp_path):
    broker = make_broker(path=tmp_path / "b", broadcast_tcp_port=5150, broadcast_http_port=5151)
    info = json.loads(identify_body(broker, PORTS))
    assert (info["tcp_port"], info["http_port"]) == (5150, 5151)


def test_connect_registers_existing_topics_and_channels(inproc_broker, lookup):
    inproc_broker.topic("lonely")
    busy = inproc_broker.topic("busy")
    busy.channel("a")
    busy.channel("b#ephemeral")
    svc = lookup("10.0.0.1:4160")
    conn = svc.endpoints["10.0.0.1:4160"].accept()
    # A topic without channels on its own; one with channels once per channel.
    assert conn.identified() == [b"REGISTER lonely", b"REGISTER busy a", b"REGISTER busy b#ephemeral"]


def test_creation_and_deletion_register_and_unregister(inproc_broker, lookup):
    svc = lookup("10.0.0.1:4160", "10.0.0.2:4160")
    conns = [svc.endpoints[a].accept() for a in ("10.0.0.1:4160", "10.0.0.2:4160")]
    for conn in conns:
        conn.identified()
    topic = inproc_broker.topic("t")
    topic.channel("c")
    topic.channel("e#ephemeral")
    topic.delete_channel("c")
    inproc_broker.delete_topic("t")
    for conn in conns:
        assert conn.lines() == [b"REGISTER t", b"REGISTER t c", b"REGISTER t e#ephemeral",
                                b"UNREGISTER t c", b"UNREGISTER t e#ephemeral", b"UNREGISTER t"]
        conn.ok(6)
        assert conn.open


def test_ping_every_15_seconds(inproc_broker, lookup):
    _, conn = connected(lookup)
    inproc_broker.clock.advance(14.9)
    assert conn.lines() == []
    inproc_broker.clock.advance(0.1)
    assert conn.lines() == [b"PING"]
    conn.ok()
    inproc_broker.clock.advance(15)
    assert conn.lines() == [b"PING"]
    conn.ok()
    assert conn.open


def _reconnected(svc, address):
    """Let the backoff run out and accept the new connection attempt."""
    endpoint = svc.endpoints[address]
    before = len(endpoint.attempts)
    for _ in range(40):
        if len(endpoint.attempts) > before:
            break
        svc.broker.clock.advance(0.5)
    assert len(endpoint.attempts) == before + 1
    return endpoint.accept()


def test_error_response_closes_and_reconnect_registers_everything(inproc_broker, lookup):
    svc, conn = connected(lookup)
    inproc_broker.topic("t").channel("c")
    assert conn.lines() == [b"REGISTER t", b"REGISTER t c"]
    conn.reply(b"OK", b"E_INVALID something")
    assert not conn.open
    # While disconnected, changes are not sent anywhere ...
    inproc_broker.topic("u")
    # ... the next connection announces the whole state.
    conn2 = _reconnected(svc, "10.0.0.1:4160")
    assert conn2.identified() == [b"REGISTER t c", b"REGISTER u"]
    conn2.ok(2)
    assert conn2.open


def test_unanswered_command_times_out_after_1s(inproc_broker, lookup):
    svc, conn = connected(lookup)
    inproc_broker.clock.advance(15)
    assert conn.lines() == [b"PING"]
    inproc_broker.clock.advance(0.99)
    assert conn.open
    inproc_broker.clock.advance(0.01)
    assert not conn.open
    conn2 = _reconnected(svc, "10.0.0.1:4160")
    assert conn2.identified() == []


def test_refused_connection_retries_with_backoff(inproc_broker, lookup):
    svc = lookup("10.0.0.1:4160")
    endpoint = svc.endpoints["10.0.0.1:4160"]
    endpoint.refuse()
    inproc_broker.clock.advance(0.1)
    assert len(endpoint.attempts) == 1
    inproc_broker.topic("t")
    conn = _reconnected(svc, "10.0.0.1:4160")
    assert conn.identified() == [b"REGISTER t"]


def test_runtime_address_change_drops_removed_and_adds_new(inproc_broker, lookup):
    svc, old = connected(lookup)
    inproc_broker.topic("t")
    old.lines()
    inproc_broker.update_options(lookupd_tcp_address=["10.0.0.2:4160"])
    assert not old.open
    assert list(svc.peers) == ["10.0.0.2:4160"]
    new = svc.endpoints["10.0.0.2:4160"].accept()
    assert new.identified() == [b"REGISTER t"]
    # The removed lookupd is not reconnected.
    attempts = len(svc.endpoints["10.0.0.1:4160"].attempts)
    inproc_broker.clock.advance(60)
    assert len(svc.endpoints["10.0.0.1:4160"].attempts) == attempts


def test_stop_disconnects_every_peer(inproc_broker, lookup):
    svc, conn = connected(lookup)
    svc.stopService()
    assert not conn.open
    assert svc not in inproc_broker.observers
    inproc_broker.topic("t")
    assert conn.lines() == []


# -- a lookupd that answers garbage ------------------------------------------------------------


def _identify_answer(conn: Conn, payload: bytes) -> None:
    data = conn.written()
    assert data.startswith(MAGIC_V1 + b"IDENTIFY\n")
    conn.reply(payload)


@pytest.fixture
def errors_logged():
    """LOOKUPD's error lines; no traceback (log_failure) may be logged meanwhile."""
    from twisted.logger import LogLevel, formatEvent, globalLogPublisher

    lines: list[str] = []
    failures: list[str] = []

    def observe(event) -> None:
        if "log_failure" in event:
            failures.append(formatEvent(event))
        elif event.get("log_level") == LogLevel.error:
            lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)
    assert not failures, failures


@pytest.mark.parametrize(("payload", "why"), [
    (b"[" * 100_000, "JSON nested too deep"),  # RecursionError escaped dataReceived here once
    (b'{"a":' * 100_000, "JSON nested too deep"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"http_port": "4161"}', "http_port"),  # nsqd's json.Unmarshal into peerInfo fails on these
    (b'{"tcp_port": 4160.5}', "tcp_port"),
    (b'{"broadcast_address": 7}', "broadcast_address"),
    (b"\x00garbage", "Expecting value"),
])
def test_a_bad_identify_answer_closes_with_one_line_and_reconnects(inproc_broker, lookup, errors_logged,
                                                                   payload, why):
    svc = lookup("10.0.0.1:4160")
    conn = svc.endpoints["10.0.0.1:4160"].accept()
    _identify_answer(conn, payload)  # must not raise
    assert not conn.open
    assert len(errors_logged) == 1
    assert "parsing IDENTIFY response" in errors_logged[0] and why in errors_logged[0]
    assert svc.peers["10.0.0.1:4160"].http_address() is None
    conn2 = _reconnected(svc, "10.0.0.1:4160")
    assert conn2.identified() == []
    assert svc.peers["10.0.0.1:4160"].http_address() == "lookup-host:4161"


def test_null_identify_answer_is_an_empty_peer_info_as_in_go(inproc_broker, lookup, errors_logged):
    svc = lookup("10.0.0.1:4160")
    conn = svc.endpoints["10.0.0.1:4160"].accept()
    _identify_answer(conn, b"null")
    assert conn.open and errors_logged == []
    assert svc.peers["10.0.0.1:4160"].http_address() is None


def test_an_answer_over_max_body_size_closes_before_it_is_buffered(inproc_broker, lookup, errors_logged):
    svc, conn = connected(lookup)
    proto = svc.peers["10.0.0.1:4160"].protocol
    conn.proxy.dataReceived(struct.pack(">I", 5 * 1024 * 1024 + 1) + b"x" * 1000)
    assert not conn.open
    assert errors_logged == ["LOOKUPD(10.0.0.1:4160): response too big (5242881 bytes); reconnecting"]
    assert len(proto._buffer) == 0
    conn2 = _reconnected(svc, "10.0.0.1:4160")
    assert conn2.identified() == []


def test_an_answer_dripped_a_byte_at_a_time_is_read(inproc_broker, lookup):
    svc = lookup("10.0.0.1:4160")
    conn = svc.endpoints["10.0.0.1:4160"].accept()
    conn.written()
    data = sized(json.dumps(LOOKUPD_INFO).encode())
    for i in range(len(data)):
        conn.proxy.dataReceived(data[i:i + 1])
    assert conn.open
    assert svc.peers["10.0.0.1:4160"].http_address() == "lookup-host:4161"


def test_channels_answer_nested_too_deep_is_a_value_error():
    from mqd.nsqd.lookup_peer import channels_answer

    with pytest.raises(ValueError, match="JSON nested too deep"):
        channels_answer(b'{"channels":' + b"[" * 100_000)
