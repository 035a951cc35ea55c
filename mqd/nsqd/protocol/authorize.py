"""A V2 connection's AUTH: the auth server's answer, the secret, and the checks of SUB and PUB.

The auth server is reached through the broker's client of it
(mqd.http.auth); a query never blocks the reactor: the protocol stops
parsing and reading until it answers, with the input that came meanwhile
kept, then runs the commands that waited in order. An answer that has
expired is asked again before the next command it must allow.

`AuthGate` owns the last answer, the secret to ask again with, whether
AUTH succeeded, and which query is due (AUTH's own, or the re-query of an
expired answer); the protocol asks it when a pass over the input is done
and acts on the outcome.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mqd.nsqd.protocol.params import PAUSED
from mqd.wire.errors import fatal

if TYPE_CHECKING:
    from twisted.internet.defer import Deferred

    from mqd.http.auth import AuthClient, AuthState

__all__ = ["AUTHORIZED", "AuthGate", "RECHECKED", "REFUSED"]

# What an answer meant (AuthGate.answered).
AUTHORIZED = "authorized"  # AUTH's own query, with authorizations
REFUSED = "refused"  # AUTH's own query, without any
RECHECKED = "rechecked"  # the re-query of an expired answer

_AUTH = "auth"
_RECHECK = "recheck"


class AuthGate:
    """AUTH state of one V2 connection."""

    __slots__ = ("state", "authorized", "_auth", "_secret", "_due", "_asking")

    def __init__(self, auth: AuthClient) -> None:
        """`auth` is the broker's client of the auth server (mqd.http.auth.AuthClient)."""
        # The auth server's last answer (mqd.http.auth.AuthState); read-only outside.
        self.state: AuthState | None = None
        # AUTH succeeded (its answer had authorizations); read-only outside.
        self.authorized = False
        self._auth = auth
        self._secret = ""
        # The query to make once the current pass over the input is done,
        # and the one being made.
        self._due: str | None = None
        self._asking: str | None = None

    @property
    def has_grants(self) -> bool:
        """An answer with authorizations is in: AUTH may not be sent again."""
        return self.state is not None and bool(self.state.grants)

    @property
    def query_due(self) -> bool:
        """A command waits for the auth server: query() once the pass over the input is done."""
        return self._due is not None

    def authenticate(self, secret: str) -> None:
        """AUTH: ask the auth server with `secret` (once the pass is done)."""
        self._secret = secret
        self._due = _AUTH

    def check(self, verb: str, topic: str, channel: str, now: float) -> int | None:
        """nsqd's CheckAuth: None when allowed, PAUSED while an expired answer is fetched again.

        Raises the fatal errors nsqd sends. A re-query pauses parsing and
        runs this same command again once the new answer is in.
        """
        state = self.state
        if state is None or not self.authorized:
            raise fatal("E_AUTH_FIRST", f"AUTH required before {verb}")
        if now >= state.expires:
            self._due = _RECHECK
            return PAUSED
        if not state.allows(topic, channel):
            raise fatal("E_UNAUTHORIZED", f'AUTH failed for {verb} on "{topic}" "{channel}"')
        return None

    def query(self, remote_ip: str, tls: bool, tls_common_name: str) -> Deferred[AuthState]:
        """Ask the auth server the due query without blocking: a Deferred of its answer (an AuthState).

        The connection hands the answer to answered(), unless it closed meanwhile.
        """
        self._asking, self._due = self._due, None
        return self._auth.query(remote_ip, tls, self._secret, tls_common_name)

    def answered(self, state: AuthState) -> str:
        """Take the auth server's answer: AUTHORIZED, REFUSED or RECHECKED."""
        self.state = state
        asking, self._asking = self._asking, None
        if asking != _AUTH:
            return RECHECKED
        if not state.grants:
            return REFUSED
        self.authorized = True
        return AUTHORIZED

    def identity(self) -> dict[str, Any]:
        """AUTH's answer to the client: who the auth server says it is."""
        state = self.state
        assert state is not None  # asked only once AUTH is answered
        return {"identity": state.identity, "identity_url": state.identity_url,
                "permission_count": state.permission_count}
