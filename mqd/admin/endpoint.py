"""What every mqadmin endpoint shares: the context it serves from, and nsqd's answer conventions.

An endpoint's `handle_<METHOD>(request, params)` returns a JSON-able value
(answered 200 with the V1 conventions of nsqd, whose base class
`mqd.http.endpoint.Endpoint` this is), a Deferred firing with one, or
raises `ApiError` (`{"message": TEXT}` with its status). `params` are the
route's named segments (`topic`, `channel`, `node`). The router (web.py)
dispatches; endpoints never write responses.

Requests to brokers and lookupds go out with the secret they may ask for
(`--http-client-auth-secret`), or, when the page request carries an
`Authorization: Bearer` header (set by a reverse proxy for its user), with
that one instead: `upstream_for` / `cluster_for` are the clients an
endpoint uses for one request. A total failure in which a broker refused
the secret is answered with its 401 or 403, not a 502.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from twisted.web.server import Request

from mqd.clusterinfo.bearer import REFUSALS
from mqd.clusterinfo.upstream import Authorized
from mqd.http.endpoint import Endpoint
from mqd.http.response import ApiError

__all__ = ["Admin", "AdminEndpoint", "ApiError", "go_lines", "refusal_status", "upstream_error", "user_bearer"]


@dataclass
class Admin:
    """The running mqadmin: its settings and the parts endpoints use (filled in by tap.build_service).

    `upstream` (upstream.Upstream, as `Authorized` with mqadmin's secret
    when one is configured), `cluster` (cluster.Cluster over it), `history`
    (history.History) and `notifier` (notify.Notifier, over the bare
    Upstream: no secret goes to the notification endpoint) are set once at
    start-up; tests build an Admin with fakes of their own.
    """

    settings: Any
    reactor: Any
    upstream: Any = None
    cluster: Any = None
    history: Any = None
    notifier: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


class AdminEndpoint(Endpoint):
    """One route of mqadmin's API: an nsqd endpoint whose context is the Admin, not a broker."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin

    def upstream_for(self, request: Request) -> Any:
        """The client for the brokers and lookupds this request asks: with the user's secret when it has one."""
        headers = user_bearer(request)
        return self.admin.upstream if headers is None else Authorized(self.admin.upstream, headers)

    def cluster_for(self, request: Request) -> Any:
        """The cluster's queries as this request makes them (upstream_for's client)."""
        headers = user_bearer(request)
        if headers is None:
            return self.admin.cluster
        return self.admin.cluster.using(Authorized(self.admin.upstream, headers))


def user_bearer(request: Request) -> dict[bytes, list[bytes]] | None:
    """The request's one `Authorization: Bearer` header, passed on to brokers and lookupds; None if it has none.

    Only a bearer secret is passed on: a browser's Basic credentials, or
    anything else, are mqadmin's (or its proxy's) business, not the brokers'.
    """
    values = request.requestHeaders.getRawHeaders(b"authorization") or []
    if len(values) == 1 and values[0][:7].lower() == b"bearer ":
        return {b"Authorization": cast("list[bytes]", values)}  # Twisted's raw headers are a list
    return None


def refusal_status(codes: Iterable[int | None]) -> int | None:
    """401 if some answer was a 401, else 403 if one was a 403, else None: what a total failure is answered."""
    refused = [c for c in codes if c in REFUSALS]
    return min(refused) if refused else None


def go_lines(errors: Iterable[str]) -> str:
    """nsq's ErrList text: each failure in the Go client's words (an ErrorLine's `go`), one per line."""
    return "\n".join(getattr(e, "go", e) for e in errors)


def upstream_error(errors: Sequence[str]) -> ApiError:
    """nsqadmin's total failure: `502 UPSTREAM_ERROR: failed to query any <nsqlookupd|nsqd>: <ErrList>`.

    When a broker or lookupd refused the secret the status is its 401 or
    403 (the text the same, each refusal naming its node), so a page or a
    script sees an authorization problem, not a cluster that is down.
    """
    kind = next((k for e in errors if (k := getattr(e, "kind", ""))), "")
    prefix = f"failed to query any {kind}: " if kind else ""
    status = refusal_status(getattr(e, "code", None) for e in errors) or 502
    return ApiError(status, "UPSTREAM_ERROR: " + prefix + go_lines(errors))
