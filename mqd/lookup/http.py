"""mqlookupd's HTTP API, as nsqlookupd's (`nsqlookupd/http.go`).

Consumers ask `/lookup?topic=` which brokers produce a topic; nsqadmin
and operators read `/topics`, `/channels`, `/nodes`, `/debug` and
pre-declare or forget registrations with the POST endpoints. The
endpoints reuse the broker's conventions (mqd.http): handlers return a
value or raise ApiError, `Router` answers unknown paths, wrong methods and
near-miss paths exactly as nsqd and nsqlookupd's shared router does.

Lists keep registration order (nsqlookupd's follow Go's random map
order, so clients cannot rely on any).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from ..http.api import ApiSite, CappedBody, Router
from ..http.args import query_of, topic_arg, topic_channel_args
from ..http.endpoint import Endpoint, PlainTextEndpoint
from ..http.response import ApiError
from ..http.status import nanoseconds
from ..logs import get_logger
from .protocol import LOOKUPD_VERSION
from .registry import GO_ZERO_TIME_NS, Producer, Registration, RegistrationDB

__all__ = ["LookupdAPI", "LookupdSite"]

log = get_logger(__name__)


class _LookupdEndpoint(Endpoint):
    """An Endpoint over the registration DB rather than a broker."""

    def __init__(self, db: RegistrationDB) -> None:
        super().__init__(db)
        self.db = db


class Ping(PlainTextEndpoint):
    """`GET /ping`: `OK` as plain text (health checks compare the text)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> str:
        return "OK"


class Info(_LookupdEndpoint):
    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        return {"version": LOOKUPD_VERSION}


class Topics(_LookupdEndpoint):
    """`GET /topics`: every topic registration, with producers or not."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        return {"topics": [reg.key for reg in self.db.find_registrations("topic", "*", "")]}


class Channels(_LookupdEndpoint):
    """`GET /channels?topic=`: the topic's channel registrations (`[]` for an unknown topic)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        topic = topic_arg(query_of(request), invalid=None)
        regs = self.db.find_registrations("channel", topic, "*")
        return {"channels": [reg.subkey for reg in regs]}


class Lookup(_LookupdEndpoint):
    """`GET /lookup?topic=`: the topic's channels and its live producers (what consumers use)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        topic = topic_arg(query_of(request), invalid=None)
        if not self.db.find_registrations("topic", topic, ""):
            raise ApiError(404, "TOPIC_NOT_FOUND")
        channels = [reg.subkey for reg in self.db.find_registrations("channel", topic, "*")]
        producers = self.db.live(self.db.find_producers("topic", topic, ""))
        return {"channels": channels, "producers": [p.peer.as_json() for p in producers]}


class Nodes(_LookupdEndpoint):
    """`GET /nodes`: every active broker, its topics and whether each is tombstoned there."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        nodes = []
        for client in self.db.active(self.db.find_producers("client", "", "")):
            peer = client.peer
            topics = [reg.key for reg in self.db.lookup_registrations(peer.id)
                      if reg.category == "topic"]
            tombstones = []
            for topic in topics:
                tombstoned = False
                for producer in self.db.find_producers("topic", topic, ""):
                    if producer.peer is peer:
                        tombstoned = self.db.is_tombstoned(producer)
                        break
                tombstones.append(tombstoned)
            nodes.append({**peer.as_json(), "tombstones": tombstones, "topics": topics})
        return {"producers": nodes}


class Debug(_LookupdEndpoint):
    """`GET /debug`: every registration with producers, and each producer's raw state."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        data: dict[str, list[dict[str, Any]]] = {}
        for reg, producers in sorted(self.db.items(), key=lambda item: str(item[0])):
            for producer in producers:
                data.setdefault(str(reg), []).append(_debug_entry(producer))
        return data


def _debug_entry(producer: Producer) -> dict[str, Any]:
    """nsqlookupd's map for one producer; keys sorted, as Go writes a map."""
    peer = producer.peer
    return {
        "broadcast_address": peer.broadcast_address,
        "hostname": peer.hostname,
        "http_port": peer.http_port,
        "id": peer.id,
        "last_update": nanoseconds(peer.last_update),
        "tcp_port": peer.tcp_port,
        "tombstoned": producer.tombstoned,
        "tombstoned_at": (GO_ZERO_TIME_NS if producer.tombstoned_at is None
                          else nanoseconds(producer.tombstoned_at)),
        "topology_region": peer.topology_region,
        "topology_zone": peer.topology_zone,
        "version": peer.version,
    }


class TopicCreate(_LookupdEndpoint):
    """`POST /topic/create`: a producer-less topic registration."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> None:
        topic = topic_arg(query_of(request), "INVALID_ARG_TOPIC")
        log.info("DB: adding topic({topic})", topic=topic)
        self.db.add_registration(Registration("topic", topic, ""))


class TopicDelete(_LookupdEndpoint):
    """`POST /topic/delete`: forget the topic and its channels here only (H10: brokers keep it)."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> None:
        topic = topic_arg(query_of(request), invalid=None)
        for reg in self.db.find_registrations("channel", topic, "*"):
            log.info("DB: removing channel({channel}) from topic({topic})",
                     channel=reg.subkey, topic=topic)
            self.db.remove_registration(reg)
        for reg in self.db.find_registrations("topic", topic, ""):
            log.info("DB: removing topic({topic})", topic=topic)
            self.db.remove_registration(reg)


class TopicTombstone(_LookupdEndpoint):
    """`POST /topic/tombstone?topic=&node=ADDR:HTTP_PORT`: hide one broker of one topic for a while.

    Used before deleting a topic on a broker, so consumers stop being sent
    there while the broker's UNREGISTER is on its way.
    """

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> None:
        query = query_of(request)
        topic = topic_arg(query, invalid=None)
        node = query.first("node")
        if node is None:
            raise ApiError(400, "MISSING_ARG_NODE")
        log.info("DB: setting tombstone for producer@{node} of topic({topic})", node=node, topic=topic)
        now = self.db.now()
        for producer in self.db.find_producers("topic", topic, ""):
            peer = producer.peer
            if f"{peer.broadcast_address}:{peer.http_port}" == node:
                producer.tombstone(now)


class ChannelCreate(_LookupdEndpoint):
    """`POST /channel/create`: pre-declare a channel (brokers then create it with the topic)."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> None:
        topic, channel = topic_channel_args(query_of(request))
        log.info("DB: adding channel({channel}) in topic({topic})", channel=channel, topic=topic)
        self.db.add_registration(Registration("channel", topic, channel))
        self.db.add_registration(Registration("topic", topic, ""))


class ChannelDelete(_LookupdEndpoint):
    """`POST /channel/delete`: forget a channel registration here."""

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> None:
        topic, channel = topic_channel_args(query_of(request))
        regs = self.db.find_registrations("channel", topic, channel)
        if not regs:
            raise ApiError(404, "CHANNEL_NOT_FOUND")
        log.info("DB: removing channel({channel}) from topic({topic})", channel=channel, topic=topic)
        for reg in regs:
            self.db.remove_registration(reg)


class LookupdAPI(Router):
    """Every nsqlookupd endpoint, routed as nsqlookupd routes (404, 405, redirects)."""

    def __init__(self, db: RegistrationDB) -> None:
        super().__init__({
            "/ping": Ping(db),
            "/info": Info(db),
            "/debug": Debug(db),
            "/lookup": Lookup(db),
            "/topics": Topics(db),
            "/channels": Channels(db),
            "/nodes": Nodes(db),
            "/topic/create": TopicCreate(db),
            "/topic/delete": TopicDelete(db),
            "/topic/tombstone": TopicTombstone(db),
            "/channel/create": ChannelCreate(db),
            "/channel/delete": ChannelDelete(db),
        })


class LookupdSite(ApiSite):
    """The HTTP factory serving a LookupdAPI.

    Every argument is in the query, so request bodies are never kept (a
    client cannot make lookupd store one): each is accepted and dropped.
    """

    def __init__(self, db: RegistrationDB, reactor=None) -> None:
        super().__init__(LookupdAPI(db), reactor)

    def getContentFile(self, length: int | None) -> CappedBody:
        return CappedBody(0)
