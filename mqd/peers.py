"""A connection's remote address written as Go's `net.Addr` writes it, for every daemon.

nsqd, nsqlookupd and nsqadmin listen on every interface with one IPv6
socket that takes IPv4 too, and Go reports an IPv4 client of such a socket
as plain IPv4 (`127.0.0.1:50312`), an IPv6 one in brackets
(`[::1]:50313`). Twisted reports the IPv4 client of a dual-stack socket
as an IPv4-mapped IPv6 address (`::ffff:127.0.0.1`): `peer_host` turns it
back, so /stats, lookupd's producers, AUTH's remote_ip and the logs read
as NSQ's do.
"""

from __future__ import annotations

import os

from mqd.endpoints import join_host_port

__all__ = ["peer_host", "remote_address"]

_MAPPED = "::ffff:"


def peer_host(address: object) -> str:
    """The host of a Twisted address (IPv4Address, IPv6Address, UNIXAddress...), IPv4-mapped ones as IPv4.

    A UNIX socket's peer has no host: its path (often empty), as str.
    """
    host: str | None = getattr(address, "host", None)
    if host is None:
        name = getattr(address, "name", None) or ""
        return os.fsdecode(name) if isinstance(name, bytes) else str(name)
    if host[:7].lower() == _MAPPED and "." in host:
        return host[7:]
    return host


def remote_address(address: object) -> str:
    """Go's `net.Addr` String() for a peer: `ip:port`, `[ip]:port`, or a UNIX socket's path."""
    host = peer_host(address)
    port = getattr(address, "port", None)
    return host if port is None else join_host_port(host, port)
