"""A lookupd and broker in one, behind `--http-auth-required`'s answers: for testing the callers' secret.

`GuardedNode` serves, on one loopback port, what mqadmin, mq-stat,
mq-tail, mq-to-file and the Spark sink ask of a lookupd (`/lookup`,
`/topics`, `/nodes`, `/channels`) and of a broker (`/stats`, `/info`),
listing itself as the one producer of topic `t` (channel `c`). Every
endpoint but /ping and /info answers as a broker with
`--http-auth-required` does: no `Authorization: Bearer` is
`401 {"message":"AUTH_REQUIRED"}` (with `WWW-Authenticate: Bearer`), the
secret `good` is let in, `limited` is `403 {"message":"UNAUTHORIZED"}`,
any other `401 {"message":"AUTH_FAILED"}`. `seen` records
`(path, Authorization header or None)` of every request.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

GOOD, LIMITED = "good", "limited"
OPEN = ("/ping", "/info")


class GuardedNode:
    """See the module docstring; `address` is its `127.0.0.1:port`, `close()` stops it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner.answer(self)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                owner.answer(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def authorizations(self, path: str) -> list[str | None]:
        return [auth for p, auth in self.seen if p == path]

    def producer(self) -> dict[str, Any]:
        return {"broadcast_address": "127.0.0.1", "hostname": "guarded", "http_port": self.port,
                "tcp_port": 4150, "version": "1.3.0", "remote_address": "127.0.0.1:1"}

    def document(self, path: str) -> dict[str, Any] | None:
        if path == "/ping":
            return None
        if path == "/info":
            return {"version": "1.3.0", "broadcast_address": "127.0.0.1", "hostname": "guarded",
                    "http_port": self.port, "tcp_port": 4150, "start_time": 1}
        if path == "/lookup":
            return {"channels": ["c"], "producers": [self.producer()]}
        if path == "/topics":
            return {"topics": ["t"]}
        if path == "/channels":
            return {"channels": ["c"]}
        if path == "/nodes":
            return {"producers": [{**self.producer(), "tombstones": [False], "topics": ["t"]}]}
        if path == "/stats":
            channel = {"channel_name": "c", "depth": 3, "backend_depth": 0, "in_flight_count": 0,
                       "deferred_count": 0, "message_count": 3, "requeue_count": 0, "timeout_count": 0,
                       "client_count": 0, "clients": [], "paused": False, "e2e_processing_latency": None}
            return {"version": "1.3.0", "health": "OK", "start_time": 1, "producers": None,
                    "topics": [{"topic_name": "t", "channels": [channel], "depth": 0, "backend_depth": 0,
                                "message_count": 3, "paused": False, "e2e_processing_latency": None}]}
        return {}

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path.partition("?")[0]
        authorization = handler.headers.get("Authorization")
        self.seen.append((path, authorization))
        headers = {}
        if path in OPEN or authorization == f"Bearer {GOOD}":
            status, doc = 200, self.document(path)
        elif authorization is None or not authorization.startswith("Bearer "):
            status, doc = 401, {"message": "AUTH_REQUIRED"}
            headers["WWW-Authenticate"] = "Bearer"
        elif authorization == f"Bearer {LIMITED}":
            status, doc = 403, {"message": "UNAUTHORIZED"}
        else:
            status, doc = 401, {"message": "AUTH_FAILED"}
            headers["WWW-Authenticate"] = 'Bearer error="invalid_token"'
        body = b"OK" if doc is None else json.dumps(doc, separators=(",", ":")).encode()  # as Go writes it
        handler.send_response(status)
        handler.send_header("Content-Type", "text/plain" if doc is None else "application/json")
        handler.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
