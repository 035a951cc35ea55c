"""Routing as nsqd does it, for the HTTP APIs of all three daemons.

Routing follows nsqd's router (julienschmidt/httprouter) rather than
twisted.web's resource tree, because clients see the difference: a path
matches exactly (`/ping/x` is 404, not /ping), a path that is only off by
a trailing slash, its case or `//` and `..` segments is redirected to the
route (301 for GET, 307 otherwise), a known path with the wrong method is
`405 {"message":"METHOD_NOT_ALLOWED"}` with an `Allow` header, OPTIONS on
a known path lists the methods, and anything else is
`404 {"message":"NOT_FOUND"}`.
"""

from __future__ import annotations

import html
import io
import posixpath
import re
from collections.abc import Mapping
from urllib.parse import unquote_to_bytes

from twisted.web import http, resource, server

from mqd.http.args import BAD_ESCAPE
from mqd.http.endpoint import Endpoint
from mqd.http.response import respond_v1
from mqd.logs import get_logger
from mqd.peers import remote_address

__all__ = ["ApiSite", "CappedBody", "Router", "client_of", "origin_path"]

log = get_logger(__name__)


class Router(resource.Resource):
    """One leaf resource routing by exact path with httprouter's rules (see the module doc).

    Shared by nsqd's API and nsqlookupd's (mqd.lookup.http), which answer
    unknown paths, wrong methods and near-miss paths the same way.
    """

    isLeaf = True

    def __init__(self, routes: Mapping[str, Endpoint]) -> None:
        super().__init__()
        self.routes: dict[str, Endpoint] = dict(routes)
        self._lower = {path.lower(): path for path in self.routes}

    # -- routing --------------------------------------------------------------------

    def match(self, path: str) -> tuple[Endpoint, dict[str, str]] | None:
        """The endpoint for a decoded path and its parameters, or None."""
        endpoint = self.routes.get(path)
        if endpoint is not None:
            return endpoint, {}
        return None

    def _route_like(self, candidate: str) -> str | None:
        """The route `candidate` names up to case, or None."""
        return self._lower.get(candidate.lower())

    def _fixed_path(self, path: str, method: str) -> str | None:
        """Where httprouter would redirect `path`: the route it names up to a slash or case."""
        cleaned = _clean_path(path)
        candidates = [path[:-1] if path.endswith("/") else path + "/", cleaned]
        candidates.append(cleaned[:-1] if cleaned.endswith("/") else cleaned + "/")
        for candidate in candidates:
            fixed = self._route_like(candidate)
            if fixed is None or fixed == path:
                continue
            found = self.match(fixed)
            if found is not None and method in found[0].methods:
                return fixed
        return None

    # -- twisted.web ----------------------------------------------------------------

    def render(self, request: server.Request) -> bytes | int:
        raw_path = origin_path(request.path)
        if BAD_ESCAPE.search(raw_path):
            # Go's server refuses a request line it cannot decode before any handler runs.
            request.setResponseCode(400)
            request.setHeader(b"Content-Type", b"text/plain; charset=utf-8")
            return b"400 Bad Request"
        path = unquote_to_bytes(raw_path).decode("utf-8", "surrogateescape")
        method = request.method.decode("ascii", "replace")
        found = self.match(path)
        if found is not None and method in found[0].methods:
            endpoint, params = found
            return endpoint.render(request, params)
        if method != "CONNECT" and path != "/":
            fixed = self._fixed_path(path, method)
            if fixed is not None:
                return _redirect(request, fixed, 301 if method == "GET" else 307)
        if found is not None:
            allow = ", ".join(sorted({*found[0].methods, "OPTIONS"})).encode()
            request.setHeader(b"Allow", allow)
            if method == "OPTIONS":
                request.defaultContentType = None
                return b""
            return respond_v1(request, 405, "METHOD_NOT_ALLOWED")
        return respond_v1(request, 404, "NOT_FOUND")


_ABSOLUTE_FORM = re.compile(rb"^[A-Za-z][A-Za-z0-9+.-]*://[^/]*")


def origin_path(raw_path: bytes) -> bytes:
    """The path of a request target, also when it is in absolute form.

    HTTP/1.1 lets a client send `GET http://host:4151/stats` (as through a
    proxy); Go's server routes it by its path, as every server must, where
    twisted.web leaves the scheme and authority in `request.path`.
    """
    absolute = _ABSOLUTE_FORM.match(raw_path)
    if absolute is None:
        return raw_path
    return raw_path[absolute.end():] or b"/"


def _clean_path(path: str) -> str:
    """Go's httprouter.CleanPath: one slash, no `.` or `..`, trailing slash kept."""
    if not path:
        return "/"
    cleaned = posixpath.normpath("/" + path.lstrip("/"))
    if cleaned.startswith("//"):
        cleaned = cleaned[1:]
    if path.endswith("/") and cleaned != "/":
        cleaned += "/"
    return cleaned


def _redirect(request: server.Request, path: str, code: int) -> bytes:
    """Go's http.Redirect to the fixed path, keeping the query."""
    _, sep, query = request.uri.partition(b"?")
    location = path.encode("utf-8", "surrogateescape") + sep + query
    request.setResponseCode(code)
    request.setHeader(b"Location", location)
    if request.method in (b"GET", b"HEAD"):
        request.setHeader(b"Content-Type", b"text/html; charset=utf-8")
        text = "Moved Permanently" if code == 301 else "Temporary Redirect"
        href = html.escape(location.decode("latin-1")).encode("latin-1")
        return b'<a href="%s">%s</a>.\n\n' % (href, text.encode())
    request.defaultContentType = None
    return b""


class CappedBody(io.BytesIO):
    """A request body that keeps its first `cap` bytes and drops the rest."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap
        self.stored = 0

    def write(self, data) -> int:
        room = self.cap - self.stored
        if room > 0:
            chunk = data[:room]
            self.stored += len(chunk)
            super().write(chunk)
        return len(data)


class ApiSite(server.Site):
    """The HTTP factory of a Router: nsqd's API (mqd.nsqd.http.site), nsqlookupd's (mqd.lookup.http), mqadmin's (mqd.admin.web).

    Requests are logged as nsqd logs them, at debug level through mqd's
    logger (so `--log-level` and `PUT /config/log_level` govern them),
    instead of twisted.web's access log, which would write a line per
    publish whatever the level. POST bodies are never parsed as forms:
    `curl -d` labels a message body as a form, and a body is the message.
    """

    noisy = False

    def __init__(self, root: Router, reactor=None) -> None:
        super().__init__(root, reactor=reactor, parsePOSTFormSubmission=False)

    def log(self, request: http.Request) -> None:
        log.debug("{code} {method} {uri} ({client})", code=request.code,
                  method=request.method.decode("ascii", "replace"),
                  uri=request.uri.decode("ascii", "replace"), client=client_of(request))


def client_of(request: http.Request) -> str:
    """The client as Go's req.RemoteAddr writes it (`ip:port`, `[ip]:port` for IPv6)."""
    return remote_address(request.getClientAddress())
