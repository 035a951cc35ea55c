"""`host:port` addresses, shared by every daemon and the NSQ client: client endpoints, and Go's JoinHostPort.

Here rather than with either of them so that the client (which Spark
executors and the tools load) does not import the broker to dial one.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import endpoints
from twisted.internet.abstract import isIPAddress
from twisted.internet.interfaces import IStreamClientEndpoint

__all__ = ["DIAL_TIMEOUT", "client_endpoint", "join_host_port"]

DIAL_TIMEOUT = 1.0  # nsqd's dial timeout to lookupds


def join_host_port(host: str, port: int | str) -> str:
    """`host:port`, an IPv6 host in brackets (Go's net.JoinHostPort)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def client_endpoint(reactor: Any, address: str, timeout: float = DIAL_TIMEOUT,
                    bind_address: tuple[str, int] | None = None) -> IStreamClientEndpoint:
    """`host:port` or `[v6]:port` as a client endpoint, with nsqd's 1 s dial timeout by default.

    The broker dials lookupds with it, and the NSQ client (mqd.client) brokers, with its
    dial_timeout and local_addr.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}: want host:port or [v6]:port")
    if host.startswith("[") and host.endswith("]"):
        return endpoints.TCP6ClientEndpoint(reactor, host[1:-1], int(port), timeout=timeout,
                                            bindAddress=bind_address)
    if isIPAddress(host):
        # No name to resolve: HostnameEndpoint would still go through its
        # happy-eyeballs delay and report a refused connection ~0.3 s late.
        return endpoints.TCP4ClientEndpoint(reactor, host, int(port), timeout=timeout,
                                            bindAddress=bind_address)
    return endpoints.HostnameEndpoint(reactor, host, int(port), timeout=timeout,
                                      bindAddress=bind_address)
