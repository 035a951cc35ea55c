"""A twisted.web resource served on an ephemeral loopback port, for tests that need a real HTTP server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from twisted.web.resource import Resource


@contextmanager
def serving(root: Resource) -> Iterator[str]:
    """`root` served on 127.0.0.1:0 while the block runs; yields its `host:port`."""
    from twisted.internet import reactor
    from twisted.web.server import Site

    port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
    try:
        yield f"127.0.0.1:{port.getHost().port}"
    finally:
        port.stopListening()
