"""nsqd's rule for topic and channel names, shared by TCP, HTTP, lookupd and metadata."""

from __future__ import annotations

import re

__all__ = ["is_valid_name", "EPHEMERAL_SUFFIX", "QUEUE_STATES"]

EPHEMERAL_SUFFIX = "#ephemeral"
# fullmatch, not `$`: Python's `$` would also accept a trailing newline.
_NAME = re.compile(r"[.a-zA-Z0-9_-]+(#ephemeral)?")


def is_valid_name(name: str) -> bool:
    """1-64 characters of [.a-zA-Z0-9_-], optionally ending in '#ephemeral'."""
    return 0 < len(name) <= 64 and _NAME.fullmatch(name) is not None


# Where a channel's message can be, as peek asks for it and a snapshot records it:
# waiting in the queue, held by a consumer, or deferred (DPUB, REQ with a delay).
QUEUE_STATES = ("queued", "in_flight", "deferred")
