"""What every mqadmin endpoint shares: the context it serves from, and nsqd's answer conventions.

An endpoint's `handle_<METHOD>(request, params)` returns a JSON-able value
(answered 200 with the V1 conventions of nsqd, whose base class
`mqd.http.endpoint.Endpoint` this is), a Deferred firing with one, or
raises `ApiError` (`{"message": TEXT}` with its status). `params` are the
route's named segments (`topic`, `channel`, `node`). The router (web.py)
dispatches; endpoints never write responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mqd.http.endpoint import Endpoint
from mqd.http.response import ApiError

__all__ = ["Admin", "AdminEndpoint", "ApiError"]


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
