"""Whether this host has IPv6, for the tests of listeners that use it where it exists."""

from __future__ import annotations

import socket


def host_has_ipv6_loopback() -> bool:
    """True when an IPv6 socket can bind ::1 here (a host or container without IPv6 cannot)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True
