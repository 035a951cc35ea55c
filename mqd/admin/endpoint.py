"""What every mqadmin endpoint shares: the context it serves from, and nsqd's answer conventions.

An endpoint's `handle_<METHOD>(request, params)` returns a JSON-able value
(answered 200 with the V1 conventions of nsqd, whose base class
`mqd.http.endpoint.Endpoint` this is), a Deferred firing with one, or
raises `ApiError` (`{"message": TEXT}` with its status). `params` are the
route's named segments (`topic`, `channel`, `node`). The router (web.py)
dispatches; endpoints never write responses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mqd.http.endpoint import Endpoint
from mqd.http.response import ApiError

__all__ = ["Admin", "AdminEndpoint", "ApiError", "go_lines", "upstream_error"]


@dataclass
class Admin:
    """The running mqadmin: its settings and the parts endpoints use (filled in by tap.build_service).

    `upstream` (upstream.Upstream), `cluster` (cluster.Cluster), `history`
    (history.History) and `notifier` (notify.Notifier) are set once at
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


def go_lines(errors: Iterable[str]) -> str:
    """nsq's ErrList text: each failure in the Go client's words (an ErrorLine's `go`), one per line."""
    return "\n".join(getattr(e, "go", e) for e in errors)


def upstream_error(errors: Sequence[str]) -> ApiError:
    """nsqadmin's total failure: `502 UPSTREAM_ERROR: failed to query any <nsqlookupd|nsqd>: <ErrList>`."""
    kind = next((k for e in errors if (k := getattr(e, "kind", ""))), "")
    prefix = f"failed to query any {kind}: " if kind else ""
    return ApiError(502, "UPSTREAM_ERROR: " + prefix + go_lines(errors))
