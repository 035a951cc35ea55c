"""AUTH for V2 connections: asking the auth server, and checking SUB and PUB against its answer.

The auth server is reached through the broker's client of it
(mqd.nsqd.auth); a query never blocks the reactor: parsing and reading
stop until it answers, with the input that came meanwhile kept, then the
commands that waited run in order. An answer that has expired is asked
again before the next command it must allow.

A mixin of V2Protocol: it uses the connection's state set up there.
"""

from __future__ import annotations

from mqd.logs import get_logger
from mqd.nsqd.protocol.params import PAUSED
from mqd.wire.errors import fatal
from mqd.wire.framing import FRAME_TYPE_RESPONSE, frame
from mqd.wire.json_encoding import encode_json

__all__ = ["AuthorizeMixin"]

# The V2 protocol logs under one namespace, whichever module a line comes from.
log = get_logger("mqd.nsqd.protocol.v2")


class AuthorizeMixin:
    """Auth server queries and authorization checks for V2Protocol."""

    def _check_auth(self, verb: str, topic: str, channel: str):
        """nsqd's CheckAuth: None when allowed, PAUSED while an expired answer is fetched again.

        Raises the fatal errors nsqd sends. A re-query pauses parsing and
        runs this same command again once the new answer is in.
        """
        state = self.auth_state
        if state is None or not self.authorized:
            raise fatal("E_AUTH_FIRST", f"AUTH required before {verb}")
        if self.clock.seconds() >= state.expires:
            self._resume_at = -1
            self._after_auth = self._resume
            return PAUSED
        if not state.allows(topic, channel):
            raise fatal("E_UNAUTHORIZED", f'AUTH failed for {verb} on "{topic}" "{channel}"')
        return None

    def _query_auth(self, then) -> None:
        """Ask the auth server(s) without blocking; `then()` runs once auth_state holds the answer."""
        # tls_common_name is set by handshakeCompleted, which runs before
        # any byte read over TLS reaches dataReceived.
        # Parsing waits for the answer, and so does reading (nsqd's read loop
        # is blocked in the query): what the client streams meanwhile stays
        # in the kernel's buffers, not ours.
        self._auth_waiting = True
        d = self.broker.auth.query(self._remote_ip, bool(self.tls),
                                   self._auth_secret, self.tls_common_name)
        d.addCallbacks(self._auth_answer, self._auth_failed, callbackArgs=(then,))
        d.addErrback(lambda f: log.failure("AUTH answer handling failed", f))
        self._update_reading()  # unless answered already

    def _auth_answer(self, state, then) -> None:
        self._auth_waiting = False
        if self._closed:
            return
        self.auth_state = state
        then()  # _authed or _resume: both end in _resume, which reads on (or the connection closes)

    def _auth_failed(self, failure) -> None:
        self._auth_waiting = False
        if self._closed:
            return
        # The reason stays in the log: nsqd never tells untrusted clients
        # what went wrong with the auth server.
        log.warn("client {remote}: AUTH failed - {error}", remote=self.remote_address,
                 error=failure.getErrorMessage())
        self._fail(fatal("E_AUTH_FAILED", "AUTH failed"))

    def _authed(self) -> None:
        state = self.auth_state
        if not state.grants:
            self._fail(fatal("E_UNAUTHORIZED", "AUTH no authorizations found"))
            return
        self.authorized = True
        body = {"identity": state.identity, "identity_url": state.identity_url,
                "permission_count": state.permission_count}
        self._write_frame(frame(FRAME_TYPE_RESPONSE, encode_json(body)))
        self._resume()
