"""The broker's HTTP API: its routes on mqd.http.router's nsqd-style routing.

The endpoints themselves live in one module per concept: status.py
(/ping, /info, /stats), metrics.py (/metrics), publish.py (/pub, /mpub),
topics.py (/topic/*, /channel/*), config.py (/config/:opt), snapshot.py
(/snapshot, the broker's whole queue state for the Spark bridge), peek.py
(/channel/peek, /topic/peek: mqd's look at messages without consuming them),
retained.py (/topic/retention, /topic/offsets, /topic/read: a topic's
retained log), replay.py (/channel/replay: a range of that log queued into
a channel again).
What those last two keep between requests is an `HttpState`
(mqd.nsqd.http.state), given to the site or built by it.

With `--http-auth-required`, every route but `/ping` and `/info` is
Guarded by the grant GRANTS gives it (docs/security.md has the table); a
route missing from it would need the broker-wide admin grant.
"""

from __future__ import annotations

from collections.abc import Mapping

from twisted.web import resource, server

from mqd.http.args import query_of
from mqd.http.auth import AuthState
from mqd.http.authorization import (
    Guarded,
    Rule,
    admin_everywhere,
    admin_on_channel,
    admin_on_topic,
    any_grant,
    guard_routes,
    publish_on_topic,
)
from mqd.http.endpoint import Endpoint
from mqd.http.router import ApiSite, CappedBody, Router
from mqd.nsqd.http.config import Config
from mqd.nsqd.http.metrics import Metrics
from mqd.nsqd.http.peek import ChannelPeek, TopicPeek
from mqd.nsqd.http.publish import Mpub, Pub
from mqd.nsqd.http.replay import ChannelReplay, admin_on_replayed_channel
from mqd.nsqd.http.retained import TopicOffsets, TopicRead, TopicRetention
from mqd.nsqd.http.snapshot import Snapshot
from mqd.nsqd.http.state import HttpState
from mqd.nsqd.http.status import Info, Ping, Stats, includes_clients
from mqd.nsqd.http.topics import (
    ChannelCreate,
    ChannelDelete,
    ChannelEmpty,
    ChannelPause,
    TopicCreate,
    TopicDelete,
    TopicEmpty,
    TopicPause,
)

__all__ = ["GRANTS", "NsqdAPI", "NsqdSite", "TLSRequired"]

# The one route with a parameter: /config/:opt (one non-empty segment).
_CONFIG_PREFIX = "/config/"


def _stats_grant(request: server.Request, state: AuthState) -> bool:
    """`/stats`: its clients' addresses, names and identities are the broker-wide admin's; counters anyone's."""
    if includes_clients(query_of(request)):
        return state.allows_admin_everywhere()
    return True


# What each route needs under --http-auth-required (mqd.http.authorization
# has the rules). Peek and the retained log's readers (/topic/offsets,
# /topic/read) answer `any_grant` here because they check their own
# `subscribe` grant (as they do whenever auth is configured); `/snapshot`
# checks its own too, after this one.
GRANTS: dict[str, Rule] = {
    "/stats": _stats_grant,
    "/metrics": any_grant,
    "/pub": publish_on_topic,
    "/mpub": publish_on_topic,
    "/topic/create": admin_on_topic,
    "/topic/delete": admin_on_topic,
    "/topic/empty": admin_on_topic,
    "/topic/pause": admin_on_topic,
    "/topic/unpause": admin_on_topic,
    "/channel/create": admin_on_channel,
    "/channel/delete": admin_on_channel,
    "/channel/empty": admin_on_channel,
    "/channel/pause": admin_on_channel,
    "/channel/unpause": admin_on_channel,
    "/channel/peek": any_grant,
    "/topic/peek": any_grant,
    "/topic/retention": admin_on_topic,
    "/topic/offsets": any_grant,
    "/topic/read": any_grant,
    "/channel/replay": admin_on_replayed_channel,
    "/snapshot": admin_everywhere,
    _CONFIG_PREFIX: admin_everywhere,
}


class NsqdAPI(Router):
    """Serves every nsqd endpoint from one leaf resource with nsqd's routing rules.

    `state` is what the body endpoints (peek, snapshot) keep between requests.
    """

    def __init__(self, broker, ports: Mapping[str, int], state: HttpState) -> None:
        auth = state.auth
        routes: dict[str, Endpoint] = {
            "/ping": Ping(broker),
            "/info": Info(broker, ports),
            "/stats": Stats(broker),
            "/metrics": Metrics(broker),
            "/pub": Pub(broker),
            "/mpub": Mpub(broker),
            "/topic/create": TopicCreate(broker),
            "/topic/delete": TopicDelete(broker),
            "/topic/empty": TopicEmpty(broker),
            "/topic/pause": TopicPause(broker, paused=True),
            "/topic/unpause": TopicPause(broker, paused=False),
            "/channel/create": ChannelCreate(broker),
            "/channel/delete": ChannelDelete(broker),
            "/channel/empty": ChannelEmpty(broker),
            "/channel/pause": ChannelPause(broker, paused=True),
            "/channel/unpause": ChannelPause(broker, paused=False),
            "/channel/peek": ChannelPeek(broker, auth, state.peeks),
            "/topic/peek": TopicPeek(broker, auth, state.peeks),
            "/topic/retention": TopicRetention(broker),
            "/topic/offsets": TopicOffsets(broker, auth, state.peeks),
            "/topic/read": TopicRead(broker, auth, state.peeks),
            "/channel/replay": ChannelReplay(broker),
            "/snapshot": Snapshot(broker, auth, state.snapshots),
        }
        config: Endpoint = Config(broker, ports)
        # (No broker: the API built only to list its routes.)
        if broker is not None and broker.options.http_auth_required:
            routes = guard_routes(routes, auth, GRANTS)
            config = Guarded(config, auth, GRANTS[_CONFIG_PREFIX])
        super().__init__(routes)
        self.config = config

    def match(self, path: str) -> tuple[Endpoint, dict[str, str]] | None:
        found = super().match(path)
        if found is not None:
            return found
        if path.startswith(_CONFIG_PREFIX):
            opt = path[len(_CONFIG_PREFIX):]
            if opt and "/" not in opt:
                return self.config, {"opt": opt}
        return None

    def _route_like(self, candidate: str) -> str | None:
        fixed = super()._route_like(candidate)
        if fixed is None and candidate.lower().startswith(_CONFIG_PREFIX):
            fixed = _CONFIG_PREFIX + candidate[len(_CONFIG_PREFIX):]
        return fixed


class NsqdSite(ApiSite):
    """The HTTP factory serving an NsqdAPI.

    The HTTP and HTTPS sites of one broker share one `state` (its bounds
    are the broker's); without one, the site builds its own.
    """

    def __init__(self, broker, ports: Mapping[str, int], reactor=None, *,
                 tls_required: bool = False, state: HttpState | None = None) -> None:
        if state is None:
            state = HttpState(broker.auth, broker.clock)
        super().__init__(NsqdAPI(broker, ports, state), reactor)
        self.broker = broker
        self.ports = ports
        self.state = state
        # The plain-HTTP site of a broker run with --tls-required=true
        # turns every request away, pointing at the HTTPS port (go-nsq's
        # HTTP client retries there).
        self.tls_required = tls_required

    def getResourceFor(self, request: server.Request):
        if self.tls_required:
            return TLSRequired(self.ports)
        return super().getResourceFor(request)

    def getContentFile(self, length: int | None) -> CappedBody:
        """Where twisted.web puts a request body: memory, bounded by the largest limit.

        Every endpoint reads at most its limit + 1 bytes (as nsqd's
        LimitReader), so keeping more is never needed; without the cap a
        client could make the broker spool any amount to a temporary file.
        """
        opts = self.broker.options
        return CappedBody(max(opts.max_msg_size, opts.max_body_size) + 1)


class TLSRequired(resource.Resource):
    """nsqd's answer on plain HTTP under --tls-required=true, byte for byte (a literal in http.go)."""

    isLeaf = True

    def __init__(self, ports: Mapping[str, int]) -> None:
        super().__init__()
        self.ports = ports

    def render(self, request: server.Request) -> bytes:
        request.setResponseCode(403)
        request.setHeader(b"X-NSQ-Content-Type", b"nsq; version=1.0")
        request.setHeader(b"Content-Type", b"application/json; charset=utf-8")
        port = self.ports.get("HTTPS", 0)
        return f'{{"message": "TLS_REQUIRED", "https_port": {port}}}'.encode()


