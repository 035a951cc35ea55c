"""The broker's own rule for bearer secrets: which secret may copy every queue (a snapshot).

The cache of the auth server's answers, the `Authorization: Bearer` parsing
and the guard of `--http-auth-required` are shared with mqlookupd, in
mqd.http.authorization (whose module doc says what is answered when).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mqd.http.auth import AuthState
    from mqd.nsqd.topic import Topic

__all__ = ["sees_every_queue"]


def sees_every_queue(state: AuthState, topics: Mapping[str, Topic]) -> bool:
    """Whether `state` grants `subscribe` on every topic and channel in `topics` (what a snapshot writes).

    A topic without channels needs a subscribe grant on some channel of it
    (AuthState.allows_topic), as /topic/peek does.
    """
    for name, topic in topics.items():
        channels = topic.channels
        if channels:
            if not all(state.allows(name, channel) for channel in channels):
                return False
        elif not state.allows_topic(name):
            return False
    return True
