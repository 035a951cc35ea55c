"""Notifications of mqadmin's actions: nsqadmin's AdminAction JSON, POSTed to --notification-http-endpoint."""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.web.server import Request

from mqd.clusterinfo.upstream import error_text, reason_of
from mqd.http.response import dumps
from mqd.http.router import client_of
from mqd.logs import get_logger

__all__ = ["MAX_PENDING_NOTIFICATIONS", "Notifier"]

log = get_logger(__name__)

# Events waiting for the notification endpoint; beyond this they are dropped (and counted).
MAX_PENDING_NOTIFICATIONS = 1000


def _header(request: Request, name: str) -> str:
    values = request.requestHeaders.getRawHeaders(name)
    return values[0] if values else ""


class Notifier:
    """Posts nsqadmin's AdminAction JSON (nsqadmin/notify.go) to --notification-http-endpoint.

    Events go one at a time, in the order the actions were done, as
    nsqadmin's single sender does; the action never waits for them. A
    failing endpoint is logged once, not per event, until one gets through
    again (then how many were lost is logged); if it stays down, at most
    MAX_PENDING_NOTIFICATIONS events wait and later ones are dropped.
    """

    def __init__(self, upstream: Any, settings: Any, clock: Any = None, hostname: str | None = None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.upstream = upstream
        self.endpoint: str = settings.notification_http_endpoint
        self.acl_header: str = settings.acl_http_header
        self.clock = clock
        self.via = hostname if hostname is not None else socket.gethostname()
        self.pending = 0
        self.failed = 0  # failures since the last event that got through
        self.dropped = 0
        self._tail: Deferred[Any] = succeed(None)

    def event(self, request: Request, action: str, topic: str, channel: str = "",
              node: str = "") -> dict[str, Any]:
        """The JSON nsqadmin posts for one action (`channel`, `node`, `user` left out when empty)."""
        secure = request.isSecure() or _header(request, "X-Scheme") == "https"
        host = _header(request, "Host")
        event: dict[str, Any] = {"action": action, "topic": topic}
        if channel:
            event["channel"] = channel
        if node:
            event["node"] = node
        event["timestamp"] = int(self.clock.seconds())
        # nsqadmin's is the basic-auth user; behind a proxy that names the user in
        # --acl-http-header instead, that one (an mqd addition).
        user = request.getUser().decode("utf-8", "replace") or _header(request, self.acl_header)
        if user:
            event["user"] = user
        event["remote_ip"] = client_of(request)
        event["user_agent"] = _header(request, "User-Agent")
        event["url"] = f"{'https' if secure else 'http'}://{host}{request.uri.decode('utf-8', 'replace')}"
        event["via"] = self.via
        return event

    def notify(self, request: Request, action: str, topic: str, channel: str = "", node: str = "") -> None:
        """Queue the event for one action done; returns at once."""
        if not self.endpoint:
            return
        if self.pending >= MAX_PENDING_NOTIFICATIONS:
            if not self.dropped:
                log.warn("notifications to {url} are backing up: dropping events", url=self.endpoint)
            self.dropped += 1
            return
        body = dumps(self.event(request, action, topic, channel, node))
        self.pending += 1
        self._tail.addCallback(lambda _: self._send(body))

    def _send(self, body: bytes) -> Deferred[Any]:
        d = maybeDeferred(self.upstream.post, self.endpoint, body)
        d.addCallbacks(self._answered, lambda f: self._failed(reason_of(f.value)))
        d.addBoth(self._settled)
        return d

    def _answered(self, answer: tuple[int, bytes]) -> None:
        status, body = answer
        if not 200 <= status < 300:
            self._failed(error_text(status, body))
            return
        if self.failed:
            log.info("notifications to {url} get through again ({n} lost)", url=self.endpoint, n=self.failed)
        self.failed = 0

    def _failed(self, reason: str) -> None:
        if not self.failed:
            log.warn("failed to POST notification to {url} - {reason} (not logged again until one succeeds)",
                     url=self.endpoint, reason=reason)
        self.failed += 1

    def _settled(self, _: Any) -> None:
        self.pending -= 1
        if not self.pending and self.dropped:
            log.warn("{n} notifications were dropped while {url} was slow", n=self.dropped, url=self.endpoint)
            self.dropped = 0
