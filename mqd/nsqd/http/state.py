"""What the broker's HTTP API keeps between requests, apart from the broker itself.

The endpoints that show or copy message bodies hold state of their own:
the auth server's answers for bearer secrets (mqd.http.authorization),
the bytes and the Cooperator of the peek answers being built or written
(mqd.nsqd.http.peek), and the snapshot admissions with their reservations
(mqd.nsqd.snapshot_space). None of it is the broker's: it lives here, one
`HttpState` per broker, built by whoever builds its sites
(mqd.nsqd.tap gives the same one to the HTTP and HTTPS sites, so their
bounds are shared, as one broker's memory and disk are).
"""

from __future__ import annotations

from twisted.internet.interfaces import IReactorTime

from mqd.http.auth import AuthClient
from mqd.http.authorization import AuthCache
from mqd.nsqd.http.peek import PeekWork
from mqd.nsqd.snapshot_space import SnapshotSpace

__all__ = ["HttpState"]


class HttpState:
    """The HTTP endpoints' own state: bearer-secret answers, peek work, snapshot admissions."""

    def __init__(self, auth: AuthClient, clock: IReactorTime) -> None:
        # The bearer secrets' answers, asked of the auth servers AUTH asks.
        self.auth = AuthCache(auth, clock)
        # What the peek answers in progress hold, and the Cooperator building them.
        self.peeks = PeekWork(clock)
        # Snapshot admissions: one at a time, each reserving its estimate.
        self.snapshots = SnapshotSpace()
