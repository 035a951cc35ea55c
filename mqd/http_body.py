"""Reading an HTTP answer's body with a bound, for every client of HTTP in mqd.

mqadmin reads brokers and lookupds, the client library reads lookupds: a
peer that answers with an endless or huge body must cost a bounded amount
of memory, so the body is collected as it arrives and the connection is
dropped once it passes the bound, before the rest is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import treq
from twisted.internet import defer

__all__ = ["read_bounded"]


def read_bounded(response: Any, limit: int, too_large: Callable[[str], Exception]) -> defer.Deferred[bytes]:
    """Deferred of the body of a treq `response`, failing with `too_large(reason)` past `limit` bytes.

    A declared `Content-Length` over the bound fails at once, without
    reading; otherwise the body is read until it passes the bound, then
    the connection is closed (treq.collect stops on the collector's error).
    """
    length = getattr(response, "length", None)
    if isinstance(length, int) and length > limit:
        return defer.fail(too_large(f"answer of {length} bytes is over {limit}"))
    parts: list[bytes] = []
    received = 0

    def collect(data: bytes) -> None:
        nonlocal received
        received += len(data)
        if received > limit:
            raise too_large(f"answer larger than {limit} bytes")
        parts.append(data)

    return treq.collect(response, collect).addCallback(lambda _: b"".join(parts))
