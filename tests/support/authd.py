"""A real auth server for the broker's AUTH, in its own process, and the grants tests give.

`AuthServer` runs authd_server.py (twisted.web: the test process's reactor
belongs to pytest-twisted) and keeps its answers in a state file that the
server reads on every query, so a test can change them between queries.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.raw_conn import FRAME_RESPONSE, RawConn, command

PUBLISH = {"topic": ".*", "channels": [".*"], "permissions": ["publish"]}
SUBSCRIBE = {"topic": ".*", "channels": [".*"], "permissions": ["subscribe"]}


class _Saved(dict):
    """A dict (or, with `add`, a set) that writes the auth server's state file on every change."""

    def __init__(self, save) -> None:
        super().__init__()
        self._save = save

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._save()

    def add(self, key) -> None:
        self[key] = True


class AuthServer:
    """The twisted.web auth server of authd_server.py in its own process.

    `answers` (secret → answer) and `slow` (secrets answered after 3 s) can
    change between queries; `queries` lists what the broker asked.
    """

    def __init__(self, workdir) -> None:
        self._state = workdir / "authd-state.json"
        self._queries = workdir / "authd-queries.jsonl"
        self._queries.write_text("")
        self.answers = _Saved(self._save)
        self.slow = _Saved(self._save)
        self._save()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("authd_server.py")), str(self._state),
             str(self._queries)],
            stdout=subprocess.PIPE, text=True,
        )
        self.address = f"127.0.0.1:{int(self.proc.stdout.readline())}"

    def _save(self) -> None:
        self._state.write_text(json.dumps({"answers": dict(self.answers), "slow": list(self.slow)}))

    @property
    def queries(self) -> list[dict[str, str]]:
        return [json.loads(line) for line in self._queries.read_text().splitlines() if line]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def grant(*authorizations, ttl=3600, identity="someone"):
    return {"ttl": ttl, "identity": identity, "identity_url": f"http://id/{identity}",
            "authorizations": list(authorizations)}


def identify_auth(conn: RawConn, secret: bytes) -> tuple[int, bytes]:
    conn.send(command("IDENTIFY", json.dumps({"feature_negotiation": True}).encode()))
    frame_type, payload = conn.read_frame()
    assert frame_type == FRAME_RESPONSE
    assert json.loads(payload)["auth_required"] is True
    conn.send(command("AUTH", secret))
    return conn.read_frame()
