"""mqlookupd's HTTP API, as nsqlookupd's (`nsqlookupd/http.go`).

Consumers ask `/lookup?topic=` which brokers produce a topic; nsqadmin
and operators read `/topics`, `/channels`, `/nodes`, `/debug` and
pre-declare or forget registrations with the POST endpoints. The
endpoints reuse the broker's conventions (mqd.http): handlers return a
value or raise ApiError, `Router` answers unknown paths, wrong methods and
near-miss paths exactly as nsqd and nsqlookupd's shared router does.

Lists keep registration order (nsqlookupd's follow Go's random map
order, so clients cannot rely on any).

Answers that grow with the cluster (`/nodes`, `/lookup` of a topic many
brokers produce, `/topics`, `/channels`, `/debug`) are built as pieces of
JSON and written a slice per reactor turn (`JsonStreamer`): with thousands
of brokers `/nodes` is a megabyte, and built in one go it would make every
consumer's `/lookup` and every broker's PING wait for it. The bytes are
those `dumps` would write for the whole answer.

With `--http-auth-required` every endpoint but `/ping` and `/info` asks for
a bearer secret and the grant GRANTS names, as the broker's do
(mqd.http.authorization).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from time import perf_counter
from typing import Any, NamedTuple
from weakref import WeakKeyDictionary

from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import CooperativeTask, Cooperator, TaskFinished, TaskStopped
from twisted.python.failure import Failure
from twisted.web.server import Request
from zope.interface import implementer

from mqd.http.args import query_of, topic_arg, topic_channel_args
from mqd.http.authorization import (
    AuthCache,
    Rule,
    admin_on_channel,
    admin_on_topic,
    any_grant,
    guard_routes,
    reads_topic,
)
from mqd.http.endpoint import LATER, Endpoint, Ping, client_gone
from mqd.http.response import ApiError, dumps, nanoseconds, respond_v1
from mqd.http.router import ApiSite, CappedBody, Router
from mqd.logs import get_logger
from mqd.lookup.protocol import LOOKUPD_VERSION
from mqd.lookup.registry import GO_ZERO_TIME_NS, PeerInfo, Producer, Registration, RegistrationDB

__all__ = ["GRANTS", "JsonStreamer", "LookupdAPI", "LookupdSite"]

log = get_logger(__name__)

_CLIENT = Registration("client", "", "")


# A streamed answer's pieces written per reactor turn. A piece is one item
# of a list (one broker of /nodes, one producer of /lookup or /debug) or a
# batch of names, each some microseconds of work; 100 of them hold the
# reactor for about a millisecond, so a /lookup or a broker's PING that
# arrives meanwhile waits about that long, not for the whole answer.
SLICE = 100
# ... and a slice after the first ends sooner if it has taken this long (a
# busy machine, pieces encoded for the first time).
SLICE_SECONDS = 0.002
# Names (/topics, /channels) encoded per piece.
NAMES_PER_PIECE = 64


class JsonStreamer:
    """Answers with JSON built piece by piece, a slice of pieces per reactor turn.

    An answer that fits in one slice (most of them) is sent at once with a
    Content-Length, as before; a longer one is sent chunked as it is built,
    its slices run by a Cooperator that lets the reactor go round between
    any two, and paused while the client does not read (the request's
    transport calls `pauseProducing`).
    """

    def __init__(self, reactor, slice_size: int = SLICE) -> None:
        self.slice_size = slice_size
        self.cooperator = Cooperator(terminationPredicateFactory=_one_unit_per_turn,
                                     scheduler=lambda step: reactor.callLater(0, step))

    def answer(self, request: Request, pieces: Iterable[bytes]) -> object:
        """Answer `request` with the pieces, concatenated: a JSON text. Returns LATER."""
        _StreamedAnswer(request, iter(pieces), self).start()
        return LATER


def _one_unit_per_turn() -> Callable[[], bool]:
    """The Cooperator's termination predicate: one slice per reactor turn, however quick."""
    return lambda: True


@implementer(IPushProducer)
class _StreamedAnswer:
    """One request's answer as a cooperative task; the request's producer while it runs."""

    def __init__(self, request: Request, pieces: Iterator[bytes], streamer: JsonStreamer) -> None:
        self.request = request
        self.pieces = pieces
        self.streamer = streamer
        self.done = False
        self.task: CooperativeTask | None = None
        self.paused = False

    def _take(self, deadline: float = math.inf) -> bytes:
        """The next slice: up to slice_size pieces, fewer once `deadline` (perf_counter) has passed."""
        chunk = []
        size = self.streamer.slice_size
        for piece in self.pieces:
            chunk.append(piece)
            if len(chunk) >= size or perf_counter() >= deadline:
                return b"".join(chunk)
        self.done = True
        return b"".join(chunk)

    def start(self) -> None:
        request = self.request
        first = self._take()
        _json_headers(request)
        if self.done:
            request.setHeader(b"Content-Length", b"%d" % len(first))
            request.write(first)
            request.finish()
            return
        request.write(first)
        request.registerProducer(self, True)
        self.task = self.streamer.cooperator.cooperate(self._rest())
        self.task.whenDone().addCallbacks(self._finished, self._failed)

    def _rest(self) -> Iterator[None]:
        while not client_gone(self.request):
            chunk = self._take(perf_counter() + SLICE_SECONDS)
            if chunk:
                self.request.write(chunk)
            if self.done:
                return
            yield None

    def _finished(self, _: object) -> None:
        if not client_gone(self.request):
            self.request.unregisterProducer()
            self.request.finish()

    def _failed(self, failure: Failure) -> None:
        if failure.check(TaskStopped):  # stopProducing: the connection is going
            return
        request = self.request
        log.failure("{method} {uri} failed while answering", failure, method=request.method,
                    uri=request.uri)
        if not client_gone(request):
            # The status is out; cutting the answer short is how the client learns.
            request.unregisterProducer()
            request.loseConnection()

    # IPushProducer, for the request's transport.

    def pauseProducing(self) -> None:
        if self.task is not None and not self.paused:
            self.paused = True
            with suppress(TaskFinished):
                self.task.pause()

    def resumeProducing(self) -> None:
        if self.task is not None and self.paused:
            self.paused = False
            with suppress(TaskFinished):
                self.task.resume()

    def stopProducing(self) -> None:
        if self.task is not None:
            with suppress(TaskFinished):
                self.task.stop()


_PEER_JSON: WeakKeyDictionary[PeerInfo, bytes] = WeakKeyDictionary()


def peer_json(peer: PeerInfo) -> bytes:
    """`dumps(peer.as_json())`, encoded once per broker (what IDENTIFY said does not change)."""
    encoded = _PEER_JSON.get(peer)
    if encoded is None:
        encoded = _PEER_JSON[peer] = dumps(peer.as_json())
    return encoded


def _json_headers(request: Request) -> None:
    """respond_v1's status and headers for a JSON answer; its body (`{}`) is not sent, the pieces are."""
    respond_v1(request, 200, {})


def _object(name: str, value: Iterable[bytes]) -> Iterator[bytes]:
    """`{"name":<value>}` as `dumps` writes it, the value's pieces as they come."""
    yield b"{" + dumps(name) + b":"
    yield from value
    yield b"}"


def _array(values: Sequence[Any]) -> Iterator[bytes]:
    """`dumps(values)`, a piece per NAMES_PER_PIECE values."""
    yield b"["
    for i in range(0, len(values), NAMES_PER_PIECE):
        items = dumps(values[i:i + NAMES_PER_PIECE])[1:-1]
        yield items if i == 0 else b"," + items
    yield b"]"


def _encoded_array(items: Iterable[bytes]) -> Iterator[bytes]:
    """A JSON array of already encoded items, an item per piece."""
    yield b"["
    sep = b""
    for item in items:
        yield sep + item
        sep = b","
    yield b"]"


class _LookupdEndpoint(Endpoint):
    """An Endpoint over the registration DB rather than a broker; big answers are streamed."""

    def __init__(self, db: RegistrationDB, stream: JsonStreamer) -> None:
        super().__init__(db)
        self.db = db
        self.stream = stream


class Info(_LookupdEndpoint):
    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        return {"version": LOOKUPD_VERSION}


class Topics(_LookupdEndpoint):
    """`GET /topics`: every topic registration, with producers or not."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        keys = [reg.key for reg in self.db.find_registrations("topic", "*", "")]
        return self.stream.answer(request, _object("topics", _array(keys)))


class Channels(_LookupdEndpoint):
    """`GET /channels?topic=`: the topic's channel registrations (`[]` for an unknown topic)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        topic = topic_arg(query_of(request), invalid=None)
        subkeys = [reg.subkey for reg in self.db.find_registrations("channel", topic, "*")]
        return self.stream.answer(request, _object("channels", _array(subkeys)))


class Lookup(_LookupdEndpoint):
    """`GET /lookup?topic=`: the topic's channels and its live producers (what consumers use)."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        topic = topic_arg(query_of(request), invalid=None)
        if not self.db.find_registrations("topic", topic, ""):
            raise ApiError(404, "TOPIC_NOT_FOUND")
        channels = [reg.subkey for reg in self.db.find_registrations("channel", topic, "*")]
        return self.stream.answer(request, self._pieces(channels, self.db.find_producers("topic", topic, "")))

    def _pieces(self, channels: list[str], producers: list[Producer]) -> Iterator[bytes]:
        db = self.db
        now = db.now()
        yield b'{"channels":' + dumps(channels) + b',"producers":'
        yield from _encoded_array(peer_json(p.peer) for p in producers if db.is_live(p, now))
        yield b"}"


class _Node(NamedTuple):
    """One broker's /nodes entry as of its registrations' stamp."""

    peer: PeerInfo
    stamp: int
    # Per topic, the producer whose tombstone shows (None: no such producer).
    producers: list[Producer | None]
    head: bytes  # the peer's fields and `,"tombstones":[`
    tail: bytes  # `],"topics":[...]}`
    untombstoned: bytes  # the whole entry when no tombstone shows


class Nodes(_LookupdEndpoint):
    """`GET /nodes`: every active broker, its topics and whether each is tombstoned there.

    The brokers are those active when the request came; each one's topics
    are read when its turn in the answer comes, and one gone meanwhile is
    left out. A broker's entry is encoded again only when its
    registrations change (`peer_stamp`) or one of its producers has been
    tombstoned: mqadmin asks every few seconds, mostly for the same answer.
    """

    def __init__(self, db: RegistrationDB, stream: JsonStreamer) -> None:
        super().__init__(db, stream)
        # By broker id: the entries of the last complete answer (so none of a broker gone stays).
        self._nodes: dict[str, _Node] = {}

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        return self.stream.answer(request, self._pieces())

    def _pieces(self) -> Iterator[bytes]:
        db = self.db
        now = db.now()
        known = self._nodes
        seen: dict[str, _Node] = {}
        nodes = (self._node(client.peer, now, known, seen) for client in db.producers(_CLIENT)
                 if not db.is_inactive(client, now) and db.producer(_CLIENT, client.peer.id) is client)
        yield from _object("producers", _encoded_array(nodes))
        self._nodes = seen

    def _node(self, peer: PeerInfo, now: float, known: dict[str, _Node], seen: dict[str, _Node]) -> bytes:
        node = known.get(peer.id)
        stamp = self.db.peer_stamp(peer.id)
        if node is None or node.peer is not peer or node.stamp != stamp:
            node = self._encode(peer, stamp)
        seen[peer.id] = node
        for producer in node.producers:
            if producer is not None and producer.tombstoned:
                break
        else:
            return node.untombstoned
        tombstones = [b"true" if p is not None and self.db.is_tombstoned(p, now) else b"false"
                      for p in node.producers]
        return node.head + b",".join(tombstones) + node.tail

    def _encode(self, peer: PeerInfo, stamp: int) -> _Node:
        """dumps({**peer.as_json(), "tombstones": [...], "topics": [...]}) in parts."""
        topics = []
        producers: list[Producer | None] = []
        producer: Producer | None
        for reg, producer in self.db.peer_producers(peer.id, "topic"):
            topics.append(reg.key)
            if reg.subkey:  # not the topic's registration itself: its tombstone is that one's
                producer = self.db.producer(Registration("topic", reg.key, ""), peer.id)
            producers.append(producer if producer is not None and producer.peer is peer else None)
        head = peer_json(peer)[:-1] + b',"tombstones":['
        tail = b'],"topics":' + dumps(topics) + b"}"
        return _Node(peer, stamp, producers, head, tail,
                     head + b",".join([b"false"] * len(topics)) + tail)


class Debug(_LookupdEndpoint):
    """`GET /debug`: every registration with producers, and each producer's raw state."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        return self.stream.answer(request, self._pieces())

    def _pieces(self) -> Iterator[bytes]:
        # Go writes a map: keys sorted. Registrations without producers are not shown.
        yield b"{"
        sep = b""
        for reg in sorted(self.db.registrations(), key=str):
            producers = self.db.producers(reg)
            if producers:
                yield sep + dumps(str(reg)) + b":"
                yield from _encoded_array(dumps(_debug_entry(p)) for p in producers)
                sep = b","
        yield b"}"


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
    """`POST /topic/delete`: forget the topic and its channels here only (brokers keep it, as with nsqlookupd)."""

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


# What each route needs under --http-auth-required (docs/security.md has the
# table): the ones naming a topic, a grant to use it (publish, or subscribe
# on some channel of it); the listings, any secret the auth server accepts;
# the ones that change the registrations, admin on the topic (and channel).
GRANTS: dict[str, Rule] = {
    "/debug": any_grant,
    "/lookup": reads_topic,
    "/topics": any_grant,
    "/channels": reads_topic,
    "/nodes": any_grant,
    "/topic/create": admin_on_topic,
    "/topic/delete": admin_on_topic,
    "/topic/tombstone": admin_on_topic,
    "/channel/create": admin_on_channel,
    "/channel/delete": admin_on_channel,
}


class LookupdAPI(Router):
    """Every nsqlookupd endpoint, routed as nsqlookupd routes (404, 405, redirects).

    `slice_size`: pieces of a big answer built per reactor turn (see SLICE).
    `auth` (`--http-auth-required`): every route but OPEN's is Guarded by its
    GRANTS rule (one missing from it by the admin-of-every-topic rule).
    """

    def __init__(self, db: RegistrationDB, reactor=None, slice_size: int = SLICE,
                 auth: AuthCache | None = None) -> None:
        if reactor is None:
            from twisted.internet import reactor
        stream = JsonStreamer(reactor, slice_size)
        routes: dict[str, Endpoint] = {
            "/ping": Ping(db),
            "/info": Info(db, stream),
            "/debug": Debug(db, stream),
            "/lookup": Lookup(db, stream),
            "/topics": Topics(db, stream),
            "/channels": Channels(db, stream),
            "/nodes": Nodes(db, stream),
            "/topic/create": TopicCreate(db, stream),
            "/topic/delete": TopicDelete(db, stream),
            "/topic/tombstone": TopicTombstone(db, stream),
            "/channel/create": ChannelCreate(db, stream),
            "/channel/delete": ChannelDelete(db, stream),
        }
        if auth is not None:
            routes = guard_routes(routes, auth, GRANTS)
        super().__init__(routes)


class LookupdSite(ApiSite):
    """The HTTP factory serving a LookupdAPI.

    Every argument is in the query, so request bodies are never kept (a
    client cannot make lookupd store one): each is accepted and dropped.
    """

    def __init__(self, db: RegistrationDB, reactor=None, slice_size: int = SLICE,
                 auth: AuthCache | None = None) -> None:
        super().__init__(LookupdAPI(db, reactor, slice_size, auth), reactor)

    def getContentFile(self, length: int | None) -> CappedBody:
        return CappedBody(0)
