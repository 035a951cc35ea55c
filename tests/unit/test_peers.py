"""Remote addresses written as Go's net.Addr writes them, whatever socket family Twisted reports."""

from __future__ import annotations

import json

import pytest
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.testing import StringTransport

from mqd.endpoints import join_host_port
from mqd.lookup.protocol import LookupdFactory
from mqd.lookup.registry import RegistrationDB
from mqd.nsqd.protocol.v2 import V2Factory
from mqd.peers import peer_host, remote_address
from tests.support.v2_frames import MAGIC


@pytest.mark.parametrize("address, host, remote", [
    (IPv4Address("TCP", "10.1.2.3", 4150), "10.1.2.3", "10.1.2.3:4150"),
    # An IPv4 client of a dual-stack listener: Go shows it as IPv4.
    (IPv6Address("TCP", "::ffff:127.0.0.1", 50312), "127.0.0.1", "127.0.0.1:50312"),
    (IPv6Address("TCP", "::FFFF:10.0.0.7", 9), "10.0.0.7", "10.0.0.7:9"),
    (IPv6Address("TCP", "::1", 50313), "::1", "[::1]:50313"),
    (IPv6Address("TCP", "fe80::1%lo", 7), "fe80::1%lo", "[fe80::1%lo]:7"),
    # Not a mapped IPv4 address, though it starts alike.
    (IPv6Address("TCP", "::ffff:1", 7), "::ffff:1", "[::ffff:1]:7"),
    (UNIXAddress("/run/mqd.sock"), "/run/mqd.sock", "/run/mqd.sock"),
    (UNIXAddress(None), "", ""),
])
def test_hosts_and_addresses_as_go_writes_them(address, host, remote):
    assert peer_host(address) == host
    assert remote_address(address) == remote


def test_host_port_brackets_ipv6_only():
    assert join_host_port("127.0.0.1", 1) == "127.0.0.1:1"
    assert join_host_port("example.com", 2) == "example.com:2"
    assert join_host_port("2001:db8::1", 3) == "[2001:db8::1]:3"


def test_broker_connection_of_a_mapped_ipv4_client(inproc_broker):
    addr = IPv6Address("TCP", "::ffff:10.0.0.1", 4242)
    proto = V2Factory(inproc_broker).buildProtocol(addr)
    proto.makeConnection(StringTransport(peerAddress=addr))
    proto.dataReceived(MAGIC)
    assert (proto.remote_address, proto.client_id, proto.hostname) == ("10.0.0.1:4242", "10.0.0.1", "10.0.0.1")


def test_broker_connection_of_an_ipv6_client(inproc_broker):
    addr = IPv6Address("TCP", "::1", 4243)
    proto = V2Factory(inproc_broker).buildProtocol(addr)
    proto.makeConnection(StringTransport(peerAddress=addr))
    assert (proto.remote_address, proto.client_id) == ("[::1]:4243", "::1")


def test_lookupd_peer_of_a_mapped_ipv4_broker(clock):
    factory = LookupdFactory(RegistrationDB(clock), "lookup-host", {"TCP": 4160, "HTTP": 4161}, hostname="lhost")
    addr = IPv6Address("TCP", "::ffff:10.0.0.9", 5009)
    proto = factory.buildProtocol(addr)
    proto.makeConnection(StringTransport(peerAddress=addr))
    body = json.dumps({"version": "1.3.0", "tcp_port": 4150, "http_port": 4151,
                       "hostname": "h9", "broadcast_address": "b9"}).encode()
    proto.dataReceived(b"  V1IDENTIFY\n" + len(body).to_bytes(4, "big") + body)
    assert proto.peer_id == "10.0.0.9:5009"
    assert proto.peer.remote_address == "10.0.0.9:5009"
