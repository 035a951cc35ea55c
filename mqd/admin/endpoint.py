"""What every mqadmin endpoint shares: the context it serves from, and nsqadmin's answer conventions.

An endpoint's `handle_<METHOD>(request, params)` returns a JSON-able value
(answered 200, V1 conventions as nsqd's: `mqd.http.response.respond_v1`),
a Deferred firing with one, or raises `ApiError` (`{"message": TEXT}` with
its status). `params` are the route's named segments (`topic`, `channel`,
`node`). The router (web.py) dispatches; endpoints never write responses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.server import NOT_DONE_YET, Request

from ..http.endpoint import client_gone
from ..http.response import ApiError, respond_v1
from ..logs import get_logger

__all__ = ["Admin", "AdminEndpoint", "ApiError"]

log = get_logger(__name__)


@dataclass
class Admin:
    """The running mqadmin: its settings and the parts endpoints use (filled in by tap.build_service).

    `upstream` (upstream.Upstream), `cluster` (cluster.Cluster), `history`
    (history.History) and `notifier` (actions.Notifier) are set once at
    start-up; tests build an Admin with fakes of their own.
    """

    settings: Any
    reactor: Any
    upstream: Any = None
    cluster: Any = None
    history: Any = None
    notifier: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


class AdminEndpoint:
    """One route of mqadmin's API; see the module docstring for the handler contract."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin

    @cached_property
    def methods(self) -> tuple[str, ...]:
        return tuple(sorted(name[len("handle_"):] for name in dir(self) if name.startswith("handle_")))

    def render(self, request: Request, params: Mapping[str, str]) -> Any:
        handler = getattr(self, "handle_" + request.method.decode("ascii", "replace"))
        try:
            result = handler(request, params)
        except ApiError as e:
            return respond_v1(request, e.code, e.message)
        except Exception:
            log.failure("{method} {uri} failed", method=request.method, uri=request.uri)
            return respond_v1(request, 500, "INTERNAL_ERROR")
        if isinstance(result, Deferred):
            result.addCallbacks(lambda value: _finish(request, 200, value), lambda f: _failed(request, f))
            return NOT_DONE_YET
        return respond_v1(request, 200, result)


def _finish(request: Request, code: int, data: Any) -> None:
    if client_gone(request):
        return
    body = respond_v1(request, code, data)
    request.setHeader(b"Content-Length", b"%d" % len(body))
    request.write(body)
    request.finish()


def _failed(request: Request, failure) -> None:
    if failure.check(ApiError):
        _finish(request, failure.value.code, failure.value.message)
        return
    log.failure("{method} {uri} failed", failure, method=request.method, uri=request.uri)
    _finish(request, 500, "INTERNAL_ERROR")
