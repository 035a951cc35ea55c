"""The base of every nsqd HTTP endpoint: handlers return values, the base answers.

An endpoint is one route. Its `handle_<METHOD>(request, params)` methods
return what nsqd's handler would (a string, None, a JSON-able structure,
a Deferred of one, or `LATER`, or a Deferred of it, when the handler
answers later itself) or
raise `ApiError`; the
base turns that into a V1 response, so every endpoint gets the same
headers and error bodies without writing any. The methods an endpoint
defines are the ones its route allows (others get 405 from the router).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.server import NOT_DONE_YET, Request

from mqd.http.response import ApiError, respond_plain, respond_v1
from mqd.logs import get_logger

__all__ = ["Endpoint", "LATER", "Ping", "PlainTextEndpoint", "client_gone", "finish_v1", "read_body"]

log = get_logger(__name__)

# What a handler returns when it will answer with `finish_v1` later. Not
# twisted's NOT_DONE_YET itself: that is the int 1, which a handler may
# well return as a JSON value (`/config/log_level` at debug).
LATER = object()


class Endpoint:
    """One route's handlers (`handle_GET`, ...), given the daemon object they serve.

    The attribute is `broker` for the broker's endpoints, whose handlers
    read it most; nsqlookupd's endpoints get their registry, mqadmin's its
    Admin.
    """

    def __init__(self, broker: Any) -> None:
        self.broker = broker

    @cached_property
    def methods(self) -> tuple[str, ...]:
        """The HTTP methods this endpoint answers, sorted (looked up once: asked per request)."""
        return tuple(sorted(name[len("handle_"):] for name in dir(self) if name.startswith("handle_")))

    def render(self, request: Request, params: Mapping[str, str]) -> Any:
        """The body for twisted.web (status and headers set), or NOT_DONE_YET.

        An unexpected exception is nsqd's recovered panic: logged, and
        answered `500 {"message":"INTERNAL_ERROR"}` so the client is not
        left with a half-written response.
        """
        handler = getattr(self, "handle_" + request.method.decode("ascii", "replace"))
        try:
            result = handler(request, params)
        except ApiError as e:
            return respond_v1(request, e.code, e.message)
        except Exception:
            log.failure("{method} {uri} failed", method=request.method, uri=request.uri)
            return respond_v1(request, 500, "INTERNAL_ERROR")
        if result is LATER:
            return NOT_DONE_YET
        if isinstance(result, Deferred):
            result.addCallbacks(lambda value: _succeeded(request, value),
                                lambda failure: _failed(request, failure))
            return NOT_DONE_YET
        return respond_v1(request, 200, result)


def _succeeded(request: Request, value: Any) -> None:
    """A handler's Deferred fired: its value is the answer, unless LATER (the handler answers itself)."""
    if value is not LATER:
        finish_v1(request, 200, value)


def _failed(request: Request, failure) -> None:
    """A handler's Deferred failed: its ApiError is the answer, anything else nsqd's 500."""
    if failure.check(ApiError):
        finish_v1(request, failure.value.code, failure.value.message)
        return
    log.failure("{method} {uri} failed", failure, method=request.method, uri=request.uri)
    finish_v1(request, 500, "INTERNAL_ERROR")


class PlainTextEndpoint(Endpoint):
    """An endpoint nsqd wraps in PlainText rather than V1 (`/ping`): the text and status alone.

    Load balancers and scripts check the status and compare the text, so
    neither JSON nor the V1 header is added. Subclasses define
    `handle_GET` returning the text, or raising ApiError for another status.
    """

    handle_GET: Callable[[Request, Mapping[str, str]], str]

    def render(self, request: Request, params: Mapping[str, str]) -> bytes:
        try:
            return respond_plain(request, 200, self.handle_GET(request, params))
        except ApiError as e:
            return respond_plain(request, e.code, e.message)


def finish_v1(request: Request, code: int, data: Any = None) -> None:
    """Answer a request whose handler returned LATER, unless its client has gone meanwhile."""
    if client_gone(request):
        return
    body = respond_v1(request, code, data)
    request.setHeader(b"Content-Length", b"%d" % len(body))
    request.write(body)
    request.finish()


def client_gone(request: Request) -> bool:
    """Whether the request's connection was lost (twisted.web then drops its `channel`).

    Read when the answer is ready, instead of a `notifyFinish()` Deferred per request.
    """
    return request.channel is None


def read_body(request: Request, limit: int = -1) -> bytes:
    """At most `limit` bytes of the body (all of it by default): nsqd reads max+1 to tell a too-big body."""
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    return content.read(limit)


class Ping(PlainTextEndpoint):
    """`GET /ping` of mqlookupd and mqadmin: `OK` as plain text (health checks compare the text)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> str:
        return "OK"
