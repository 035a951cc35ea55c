"""nsqd's every-interface addresses: one socket for IPv6 and IPv4, IPv4 alone on a host without IPv6."""

from __future__ import annotations

import errno
import socket

import pytest
from twisted.internet import reactor
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory, Protocol

from mqd.service import AnyInterfaceEndpoint, _DualStackPort, listen_endpoint
from tests.support.ipv6 import host_has_ipv6_loopback


def _listened(endpoint):
    """The port a synchronous listen gave, or the failure it raised."""
    outcome = []
    endpoint.listen(Factory.forProtocol(Protocol)).addBoth(outcome.append)
    return outcome[0]


def test_every_interface_is_one_socket_for_both_families():
    port = _listened(listen_endpoint(reactor, "0.0.0.0:0", 16))
    try:
        host = port.getHost()
        if host_has_ipv6_loopback():
            assert isinstance(host, IPv6Address) and host.host == "::"
            assert port.socket.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
            with socket.create_connection(("::1", host.port), timeout=5):
                pass
        else:
            assert isinstance(host, IPv4Address) and host.host == "0.0.0.0"
        # An IPv4 client reaches it either way.
        with socket.create_connection(("127.0.0.1", host.port), timeout=5):
            pass
    finally:
        port.stopListening()


def test_without_ipv6_it_listens_on_ipv4(monkeypatch):
    def no_ipv6(self):
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    monkeypatch.setattr(_DualStackPort, "createInternetSocket", no_ipv6)
    port = _listened(AnyInterfaceEndpoint(reactor, 0, 16))
    try:
        host = port.getHost()
        assert isinstance(host, IPv4Address) and host.host == "0.0.0.0"
    finally:
        port.stopListening()


def test_a_port_in_use_is_an_error_not_a_fallback():
    with socket.socket(socket.AF_INET) as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        failure = _listened(AnyInterfaceEndpoint(reactor, taken.getsockname()[1], 16))
    with pytest.raises(CannotListenError):
        failure.raiseException()
