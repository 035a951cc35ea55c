"""mqadmin's site: nsqadmin's routes under --base-path, the pages and their static files.

Routing is nsqd's (mqd.http.router.Router: httprouter's 404, 405 with
`Allow`, redirects of near-miss paths) extended with httprouter's
patterns, because nsqadmin's API names its objects in the path
(`/api/topics/:topic/:channel`) and scripts written against nsqadmin
depend on those URLs and on how a near miss is answered. Every route is
mounted under the base path as nsqadmin mounts it (Go's
`path.Join(base, route)`: with `--base-path=/admin` the index is `/admin`,
and `/admin/` redirects there).

The UI routes all answer index.html (the client app routes itself),
with `{{BASE_PATH}}` replaced by the base path ending in '/', so the
pages work behind a reverse proxy that adds a prefix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from twisted.python.filepath import FilePath, InsecurePath
from twisted.web import server, static
from twisted.web.server import Request

from mqd.admin import actions, api, history, retained
from mqd.admin.endpoint import Admin
from mqd.http.endpoint import Ping
from mqd.http.response import respond_plain, respond_v1
from mqd.http.router import ApiSite, CappedBody, Router
from mqd.logs import get_logger

__all__ = ["AdminSite", "PatternRouter", "STATIC_DIR", "UI_ROUTES", "default_routes", "merge_routes"]

log = get_logger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")

# nsqadmin's page URLs; the client app draws the page each one names.
UI_ROUTES = (
    "/",
    "/topics",
    "/topics/:topic",
    "/topics/:topic/:channel",
    "/nodes",
    "/nodes/:node",
    "/counter",
    "/lookup",
)

BASE_PATH_PLACEHOLDER = b"{{BASE_PATH}}"

# Request bodies are small JSON documents ({"topic", "channel"}, {"action"});
# anything larger is cut here rather than spooled to a temporary file. One
# byte more than nsqadmin reads of a PUT /config body (1 MiB), so that
# handler can still tell a body that is too big.
MAX_BODY_SIZE = (1 << 20) + 1


# -- routing ---------------------------------------------------------------------------------


def _split(pattern: str) -> tuple[str, ...]:
    return tuple(pattern.split("/")[1:])


def _is_param(segment: str) -> bool:
    return segment[:1] in (":", "*")


class PatternRouter(Router):
    """A Router whose routes may hold httprouter's parameters.

    `:name` matches one non-empty path segment and `*name`, last, the
    rest of the path (non-empty segments: an empty one is a near miss,
    redirected as a trailing slash is); the decoded values reach the
    endpoint as `params[name]`. A static segment wins over a parameter at
    the same place, as in httprouter, and two patterns differing only in
    their parameters' names are refused at start-up (httprouter panics).
    """

    def __init__(self, routes: Mapping[str, Any]) -> None:
        static_routes = {p: e for p, e in routes.items() if not any(map(_is_param, _split(p)))}
        super().__init__(static_routes)
        shapes: dict[tuple[str, ...], str] = {}
        patterns = []
        for pattern, endpoint in routes.items():
            if pattern in static_routes:
                continue
            segments = _split(pattern)
            if any(s.startswith("*") for s in segments[:-1]) or any(s in (":", "*") for s in segments):
                raise ValueError(f"bad route pattern {pattern!r}")
            shape = tuple(s[0] if _is_param(s) else s.lower() for s in segments)
            if shape in shapes:
                raise ValueError(f"route {pattern!r} conflicts with {shapes[shape]!r}")
            shapes[shape] = pattern
            patterns.append((segments, endpoint))
        # Tried static segment first, then parameter, then catch-all, place by place.
        rank = {"*": 2, ":": 1}
        patterns.sort(key=lambda item: tuple(rank.get(s[:1], 0) for s in item[0]))
        self.patterns: list[tuple[tuple[str, ...], Any]] = patterns

    @staticmethod
    def _bind(segments: tuple[str, ...], parts: list[str], fold: bool) -> dict[str, str] | None:
        """The parameters if `parts` fits the pattern (static segments up to case when `fold`), else None."""
        params: dict[str, str] = {}
        for i, segment in enumerate(segments):
            if segment[:1] == "*":
                rest = parts[i:]
                if not rest or not all(rest):
                    return None
                params[segment[1:]] = "/".join(rest)
                return params
            if i >= len(parts):
                return None
            part = parts[i]
            if segment[:1] == ":":
                if not part:
                    return None
                params[segment[1:]] = part
            elif part != segment and not (fold and part.lower() == segment.lower()):
                return None
        return params if len(parts) == len(segments) else None

    def match(self, path: str) -> tuple[Any, dict[str, str]] | None:
        found = super().match(path)
        if found is not None:
            return found
        parts = path.split("/")[1:]
        for segments, endpoint in self.patterns:
            params = self._bind(segments, parts, False)
            if params is not None:
                return endpoint, params
        return None

    def _route_like(self, candidate: str) -> str | None:
        """The path a near miss is redirected to: static segments as routed, parameters as sent."""
        fixed = super()._route_like(candidate)
        if fixed is not None:
            return fixed
        parts = candidate.split("/")[1:]
        for segments, _ in self.patterns:
            if self._bind(segments, parts, True) is None:
                continue
            out = []
            for i, segment in enumerate(segments):
                if segment[:1] == "*":
                    out.extend(parts[i:])
                    break
                out.append(parts[i] if segment[:1] == ":" else segment)
            return "/" + "/".join(out)
        return None


class _ByMethod:
    """One route served by several endpoints, each answering its own methods.

    nsqadmin's `/api/topics/:topic` is read by api.py (GET) and acted on by
    actions.py (POST, DELETE): the router sees one route with every method,
    so a method neither answers is still a 405 listing the others.
    """

    def __init__(self, by_method: Mapping[str, Any]) -> None:
        self.by_method = dict(by_method)
        self.methods = tuple(sorted(self.by_method))

    def render(self, request: Request, params: Mapping[str, str]) -> Any:
        return self.by_method[request.method.decode("ascii", "replace")].render(request, params)


def merge_routes(*tables: Mapping[str, Any]) -> dict[str, Any]:
    """One route table from several modules' (`pattern: endpoint`); a method routed twice is an error."""
    owners: dict[str, dict[str, Any]] = {}
    for table in tables:
        for pattern, endpoint in table.items():
            by_method = owners.setdefault(pattern, {})
            for method in endpoint.methods:
                if method in by_method:
                    raise ValueError(f"{method} {pattern} is routed twice")
                by_method[method] = endpoint
    merged: dict[str, Any] = {}
    for pattern, by_method in owners.items():
        endpoints = {id(e): e for e in by_method.values()}
        merged[pattern] = next(iter(endpoints.values())) if len(endpoints) == 1 else _ByMethod(by_method)
    return merged


def default_routes(admin: Admin) -> dict[str, Any]:
    """The API: nsqadmin's GET endpoints, its actions (and /config/:opt), the charts' history, replay."""
    return merge_routes(api.routes(admin), actions.routes(admin), history.routes(admin), retained.routes(admin))


def mount(base_path: str, pattern: str) -> str:
    """Go's `path.Join(base, pattern)` for a normalized base path and a route pattern."""
    if pattern == "/":
        return base_path
    return base_path.rstrip("/") + pattern


# -- the pages -------------------------------------------------------------------------------


class Index:
    """Every UI route: index.html with the base path written in, read per request.

    Read each time rather than once so a page edited in place is served
    as it is (the file is a few kilobytes; these are an operator's clicks).
    """

    methods = ("GET",)

    def __init__(self, path: str, base_path: str) -> None:
        self.path = path
        self.base = (base_path.rstrip("/") + "/").encode()

    def render(self, request: Request, params: Mapping[str, str]) -> bytes:
        try:
            with open(self.path, "rb") as f:
                page = f.read()
        except OSError as e:
            log.error("cannot read {path}: {error}", path=self.path, error=e.strerror)
            return respond_v1(request, 500, "INTERNAL_ERROR")
        request.setHeader(b"Content-Type", b"text/html; charset=utf-8")
        request.setHeader(b"Cache-Control", b"no-cache")
        return page.replace(BASE_PATH_PLACEHOLDER, self.base)


class StaticFiles:
    """`/static/*file`: the files under the static directory, never a listing, never outside it.

    twisted.web's File serves them (content types, ranges, conditional
    GETs); the path is checked first, segment by segment, so `..`, an
    encoded slash or an absolute path cannot leave the directory and a
    directory is a 404 like a missing file (nsqadmin's answer: plain
    `NOT_FOUND`).
    """

    methods = ("GET",)

    def __init__(self, directory: str) -> None:
        self.root = FilePath(directory)

    def render(self, request: Request, params: Mapping[str, str]) -> Any:
        target = self.root
        for segment in params["file"].split("/"):
            if segment in ("", ".", "..") or "\\" in segment or "\x00" in segment:
                return respond_plain(request, 404, "NOT_FOUND")
            try:
                target = target.child(segment)
            except InsecurePath:
                return respond_plain(request, 404, "NOT_FOUND")
        if not target.isfile():
            return respond_plain(request, 404, "NOT_FOUND")
        return static.File(target.path).render(request)


# -- the site --------------------------------------------------------------------------------


class AdminRequest(server.Request):
    """mqadmin's requests: every 401 answer asks for a bearer secret (`WWW-Authenticate: Bearer`).

    mqadmin answers 401 when the brokers refused the secret it passed on
    (the user's, or its own); RFC 7235 wants the challenge with it, and a
    proxy that sets the user's `Authorization` can act on it. Set here, with
    the status, so no endpoint has to remember it (one that set its own
    challenge keeps it).
    """

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        super().setResponseCode(code, message)
        if code == 401 and not self.responseHeaders.hasHeader(b"www-authenticate"):
            self.responseHeaders.setRawHeaders(b"WWW-Authenticate", [b"Bearer"])


class AdminSite(ApiSite):
    """The HTTP factory of mqadmin: pages, static files, /ping and the API, all under --base-path.

    `routes` replaces the API's route table (tests give a small fake one);
    by default it is api's, actions' and history's, merged.
    """

    requestFactory = AdminRequest

    def __init__(self, admin: Admin, routes: Mapping[str, Any] | None = None, *,
                 static_dir: str = STATIC_DIR) -> None:
        base = admin.settings.base_path
        index = Index(os.path.join(static_dir, "index.html"), base)
        own: dict[str, Any] = {pattern: index for pattern in UI_ROUTES}
        own["/ping"] = Ping(admin)
        own["/static/*file"] = StaticFiles(static_dir)
        table = merge_routes(own, default_routes(admin) if routes is None else routes)
        self.admin = admin
        self.router = PatternRouter({mount(base, p): e for p, e in table.items()})
        super().__init__(self.router, reactor=admin.reactor)

    def getContentFile(self, length: int | None) -> CappedBody:
        return CappedBody(MAX_BODY_SIZE)

