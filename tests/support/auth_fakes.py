"""A fake auth server for the in-process broker: its HTTP fetch answered by the test.

`FakeAuth` records each query and answers it with a Deferred the test
fires (or at once, with `auto`), so a test can show that commands sent
while the auth server is being asked wait their turn.
"""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred, fail, succeed

from tests.support.v2_frames import cmd, sized

ALL = [{"topic": ".*", "channels": [".*"], "permissions": ["subscribe", "publish"]}]


def answer(ttl=60, authorizations=ALL, identity="alice", identity_url="http://id/alice") -> bytes:
    return json.dumps({"ttl": ttl, "identity": identity, "identity_url": identity_url,
                       "authorizations": authorizations}).encode()


class FakeAuth:
    """Stands in for the HTTP fetch; `pending` holds the Deferreds not answered yet."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict]] = []
        self.pending: list[Deferred] = []
        self.auto: bytes | None = None
        self.auto_fail = False

    def __call__(self, url, method, params):
        self.calls.append((url, method, params))
        if self.auto_fail:
            return fail(ConnectionRefusedError("refused"))
        if self.auto is not None:
            return succeed(self.auto)
        d = Deferred()
        self.pending.append(d)
        return d

    def reply(self, body: bytes) -> None:
        self.pending.pop(0).callback(body)


def auth(secret: bytes = b"s3cret") -> bytes:
    return cmd("AUTH") + sized(secret)
