"""The broker's side of lookupd: announce every topic and channel to each lookupd.

As nsqd (`nsqd/lookup.go`, `nsqd/lookup_peer.go`), a broker opens one TCP
connection per `--lookupd-tcp-address`, sends the `"  V1"` magic and
IDENTIFY, then REGISTERs what it has, and from then on REGISTERs and
UNREGISTERs topics and channels as they come and go, with a PING every
15 s. lookupd drops every registration of a broker when its connection
closes, so nothing needs remembering across connections: any failed
command (an error response, or no answer within the 1 s deadline) closes
the connection, and the next one announces the broker's state afresh.

Reconnecting is Twisted's `ClientService` with a backoff, rather than
nsqd's "reconnect on the next command": the same outcome (a lookupd that
comes back learns everything within seconds) without a dial per PING
while it is down.

A new non-ephemeral topic first asks every connected lookupd's HTTP
`/channels?topic=` (at the address its IDENTIFY answer gives) and creates
the channels they list before it hands out a message, as nsqd's GetTopic
does, so a channel declared in lookupd gets the topic's first message.
nsqd blocks the topic's creation on the query; here the topic is held
(its messages wait at the topic) until every lookupd answered or failed.
With `--http-client-auth-secret` (or its `-file`) the query carries
`Authorization: Bearer <secret>`, which an mqlookupd run with
`--http-auth-required` asks for; nsqd sends none.

A lookupd that answers garbage gets what one that fails gets: one logged
line, the connection closed, a reconnect. Its IDENTIFY answer is decoded
as nsqd's json.Unmarshal into its peerInfo (a non-object, a field of the
wrong type, nesting too deep for Python's decoder all fail it), and an
answer declaring more than `--max-body-size` is refused before it is
buffered.
"""

from __future__ import annotations

import json
import socket
import struct
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from twisted.application import service
from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from mqd import NSQ_VERSION
from mqd.clusterinfo.bearer import bearer_headers
from mqd.endpoints import client_endpoint, join_host_port
from mqd.logs import get_logger
from mqd.names import is_valid_name
from mqd.wire.errors import GoStruct
from mqd.wire.framing import MAGIC_V1
from mqd.wire.json_encoding import encode_json
from mqd.wire.transport import IStreamTransport

__all__ = ["LookupPeer", "LookupPeerProtocol", "LookupService", "MAGIC_V1", "broadcast_port",
           "registrations"]

log = get_logger(__name__)

# nsqd's per-command read/write deadline and its ping interval.
COMMAND_TIMEOUT = 1.0
PING_INTERVAL = 15.0
# Reconnect backoff: quick at first, never longer than a ping interval.
RETRY_POLICY = backoffPolicy(initialDelay=0.5, maxDelay=PING_INTERVAL, factor=2.0)

# nsqd's lookupPeer.Info, what it keeps of a lookupd's IDENTIFY answer.
_PEER_INFO = GoStruct({"tcp_port": "int", "http_port": "int", "version": "string",
                       "broadcast_address": "string"})
_SIZE = struct.Struct(">I")


def registrations(broker) -> list[tuple[str, ...]]:
    """What a fresh connection REGISTERs, in nsqd's form.

    A topic with channels is announced by one `REGISTER t c` per channel
    (which registers the topic too); a topic without channels by
    `REGISTER t`.
    """
    args: list[tuple[str, ...]] = []
    for topic in list(broker.topics.values()):
        channels = list(topic.channels)
        if channels:
            args.extend((topic.name, name) for name in channels)
        else:
            args.append((topic.name,))
    return args


def broadcast_port(options, ports: Mapping[str, int], listener: str) -> int:
    """The port the broker is known by for `listener` ("TCP" or "HTTP").

    `--broadcast-tcp-port` / `--broadcast-http-port`, else the bound one:
    what lookupd is told, what the statsd prefix names and what /config
    shows, as nsqd settles it at start-up.
    """
    announced = options.broadcast_tcp_port if listener == "TCP" else options.broadcast_http_port
    return announced or ports.get(listener, 0)


def identify_body(broker, ports: dict) -> bytes:
    """IDENTIFY's JSON: the *broadcast* ports (the bound ones unless overridden).

    Keys are sorted as Go's encoding of nsqd's map sorts them.
    """
    opts = broker.options
    info = {
        "version": NSQ_VERSION,
        "tcp_port": broadcast_port(opts, ports, "TCP"),
        "http_port": broadcast_port(opts, ports, "HTTP"),
        "hostname": socket.gethostname(),
        "broadcast_address": opts.broadcast_address,
        # No --topology-* options: nsqd's defaults.
        "topology_zone": "",
        "topology_region": "",
    }
    return encode_json(info, sort_keys=True)


class LookupPeerProtocol(Protocol):
    """One connection to a lookupd: commands out in order, answers matched FIFO.

    lookupd answers every command, in order, with `[4-byte size][payload]`
    (no frame type); an answer starting `E_` is an error, after which
    lookupd closes the connection anyway, so the broker closes it too.
    """

    transport: IStreamTransport

    def __init__(self, peer: LookupPeer) -> None:
        self.peer = peer
        self.clock = peer.clock
        self._buffer = bytearray()
        # Commands sent and not yet answered, oldest first.
        self.pending: deque[bytes] = deque()
        self._deadline: IDelayedCall | None = None
        self.lookupd_info: dict[str, Any] | None = None
        self.closing = False

    def connectionMade(self) -> None:
        self.transport.write(MAGIC_V1)
        self.send(b"IDENTIFY", self.peer.identify_body())
        for args in registrations(self.peer.broker):
            self.send(b"REGISTER", *(a.encode() for a in args))
        self.peer.connected(self)

    def send(self, verb: bytes, *args: bytes) -> None:
        """Write one command; a body (IDENTIFY's) follows its line size-prefixed."""
        if self.closing:
            return
        if verb == b"IDENTIFY":
            (body,) = args
            label, data = verb, b"IDENTIFY\n" + struct.pack(">I", len(body)) + body
        else:
            label = b" ".join((verb, *args))
            data = label + b"\n"
        self.pending.append(label)
        self.transport.write(data)
        if self._deadline is None:
            self._deadline = self.clock.callLater(COMMAND_TIMEOUT, self._timed_out)

    def dataReceived(self, data: bytes) -> None:
        if self.closing:
            return
        buffer = self._buffer
        buffer += data
        while len(buffer) >= 4 and not self.closing:
            (size,) = _SIZE.unpack_from(buffer)
            if size > self.peer.max_response_size():
                self._fail(f"response too big ({size} bytes)")
                return
            if len(buffer) < 4 + size:
                return
            payload = bytes(buffer[4:4 + size])
            del buffer[:4 + size]
            self._answer(payload)

    def _answer(self, payload: bytes) -> None:
        if not self.pending:
            self._fail(f"unexpected response {payload[:64]!r}")
            return
        command = self.pending.popleft()
        self._cancel_deadline()
        if self.pending:
            self._deadline = self.clock.callLater(COMMAND_TIMEOUT, self._timed_out)
        if payload.startswith(b"E_"):
            self._fail(f"{command.decode(errors='replace')}: {payload.decode(errors='replace')}")
            return
        if command == b"IDENTIFY":
            try:
                self.lookupd_info = _PEER_INFO.unmarshal(payload)
            except ValueError as e:
                self._fail(f"parsing IDENTIFY response - {e}: {payload[:64]!r}")
                return
            log.info("LOOKUPD({address}): peer info {info}", address=self.peer.address,
                     info=self.lookupd_info)

    def _timed_out(self) -> None:
        self._deadline = None
        command = self.pending[0].decode(errors="replace") if self.pending else "?"
        self._fail(f"no response to {command} within {COMMAND_TIMEOUT:g}s")

    def _fail(self, reason: str) -> None:
        """Any failure closes the connection; reconnecting re-announces everything."""
        if self.closing:
            return
        self.closing = True
        log.error("LOOKUPD({address}): {reason}; reconnecting", address=self.peer.address,
                  reason=reason)
        self._buffer.clear()
        self._cancel_deadline()
        self.transport.abortConnection()

    def _cancel_deadline(self) -> None:
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def connectionLost(self, reason=None) -> None:
        self.closing = True
        self._cancel_deadline()
        self.pending.clear()
        self.peer.disconnected(self)


class _PeerFactory(Factory):
    noisy = False

    def __init__(self, peer: LookupPeer) -> None:
        self.peer = peer

    def buildProtocol(self, addr):
        proto = LookupPeerProtocol(self.peer)
        proto.factory = self
        return proto


class LookupPeer:
    """One lookupd: its reconnecting connection and its PING loop."""

    def __init__(self, broker, address: str, ports: dict, reactor, endpoint=None) -> None:
        self.broker = broker
        self.address = address
        self.ports = ports
        self.clock = broker.clock
        self.protocol: LookupPeerProtocol | None = None
        endpoint = endpoint if endpoint is not None else client_endpoint(reactor, address)
        self.client = ClientService(endpoint, _PeerFactory(self), retryPolicy=RETRY_POLICY,
                                    clock=self.clock)
        self._ping = LoopingCall(self.ping)
        self._ping.clock = self.clock

    def identify_body(self) -> bytes:
        return identify_body(self.broker, self.ports)

    def max_response_size(self) -> int:
        return self.broker.options.max_body_size

    def start(self) -> None:
        log.info("LOOKUP({address}): adding peer", address=self.address)
        self.client.startService()
        self._ping.start(PING_INTERVAL, now=False)

    def stop(self) -> defer.Deferred:
        if self._ping.running:
            self._ping.stop()
        return defer.maybeDeferred(self.client.stopService)

    def connected(self, protocol: LookupPeerProtocol) -> None:
        log.info("LOOKUPD({address}): connected", address=self.address)
        self.protocol = protocol

    def disconnected(self, protocol: LookupPeerProtocol) -> None:
        if self.protocol is protocol:
            self.protocol = None

    def command(self, verb: bytes, *args: str) -> None:
        """Send a command if connected; if not, the next connection announces the state anyway."""
        if self.protocol is not None:
            self.protocol.send(verb, *(a.encode() for a in args))

    def ping(self) -> None:
        self.command(b"PING")

    def http_address(self) -> str | None:
        """`host:port` of the lookupd's HTTP API, from its IDENTIFY answer (nsqd's lookupdHTTPAddrs).

        None while not connected and identified, or when the answer has
        no broadcast address.
        """
        info = self.protocol.lookupd_info if self.protocol is not None else None
        if not isinstance(info, dict):
            return None
        host, port = info.get("broadcast_address"), info.get("http_port")
        if not host or not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            return None
        return join_host_port(host, port)


def channels_answer(body: bytes) -> list[str]:
    """The channel names of a lookupd's `/channels` answer (`{"channels": [...]}`), or ValueError."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    channels = data.get("channels") if isinstance(data, dict) else None
    if channels is None:
        return []
    if not isinstance(channels, list) or not all(isinstance(c, str) for c in channels):
        raise ValueError(f"unexpected answer {body[:200]!r}")
    return channels


# fetch(url, method, params, headers) -> Deferred firing with the answer's body.
ChannelsFetch = Callable[[str, str, dict[str, str], Mapping[bytes, list[bytes]]], defer.Deferred]


class LookupService(service.Service):
    """The broker's lookupd peers: one per configured address, kept in step with the options.

    It observes the broker (topic_created and the rest) and forwards each
    change to every peer, and follows `nsqlookupd_tcp_addresses` changed
    at run time: removed lookupds are disconnected, new ones connected.
    """

    name = "lookupd"

    def __init__(self, broker, ports: dict, reactor=None, endpoint_for=None,
                 fetch: ChannelsFetch | None = None, secret: str = "") -> None:
        if reactor is None:
            from twisted.internet import reactor
        self.broker = broker
        self.ports = ports
        self.reactor = reactor
        # address -> endpoint; tests substitute their own.
        self.endpoint_for = endpoint_for
        # fetch(url, method, params, headers) -> Deferred body: the auth
        # client's HTTP GET (its Accept header and --http-client-* timeouts)
        # unless a test passes its own.
        self.fetch = fetch
        # Sent with every /channels query: `Authorization: Bearer` with
        # --http-client-auth-secret, for lookupds run with
        # --http-auth-required; none without a secret.
        self.headers = bearer_headers(secret)
        self.peers: dict[str, LookupPeer] = {}

    def startService(self) -> None:
        super().startService()
        self.broker.observers.append(self)
        self._set_addresses(self.broker.options.lookupd_tcp_address)

    def stopService(self):
        super().stopService()
        if self in self.broker.observers:
            self.broker.observers.remove(self)
        return self._set_addresses([])

    def _set_addresses(self, addresses) -> defer.Deferred:
        wanted = list(dict.fromkeys(addresses))
        stopping = []
        for address in list(self.peers):
            if address not in wanted:
                log.info("LOOKUP({address}): removing peer", address=address)
                stopping.append(self.peers.pop(address).stop())
        for address in wanted:
            if address in self.peers:
                continue
            endpoint = self.endpoint_for(address) if self.endpoint_for else None
            try:
                peer = LookupPeer(self.broker, address, self.ports, self.reactor, endpoint)
            except ValueError as e:
                log.error("LOOKUP: {error}", error=str(e))
                continue
            self.peers[address] = peer
            peer.start()
        return defer.gatherResults(stopping, consumeErrors=True)

    # -- broker observer ------------------------------------------------------------------

    def options_changed(self, old, new) -> None:
        if self.running and old.lookupd_tcp_address != new.lookupd_tcp_address:
            self._set_addresses(new.lookupd_tcp_address)

    def _all(self, verb: bytes, *args: str) -> None:
        for peer in list(self.peers.values()):
            peer.command(verb, *args)

    def topic_created(self, topic) -> None:
        self._all(b"REGISTER", topic.name)
        if not topic.ephemeral and not self.broker.loading:
            self.precreate_channels(topic)

    def http_addresses(self) -> list[str]:
        return [a for a in (p.http_address() for p in list(self.peers.values())) if a]

    def precreate_channels(self, topic) -> defer.Deferred | None:
        """Hold the new topic, create the channels the lookupds list, then release it.

        A lookupd that fails or does not answer in time is logged and
        skipped, as nsqd does: the topic then starts with what the others
        listed. Fires once the topic is released (None: nothing to ask).
        """
        addresses = self.http_addresses()
        if not addresses:
            if self.peers:
                log.error("no available nsqlookupd to query for channels to pre-create for topic {topic}",
                          topic=topic.name)
            return None
        topic.hold()
        queries = [self._channels_of(address, topic.name) for address in addresses]
        d = defer.gatherResults(queries, consumeErrors=True)
        d.addCallback(self._precreate, topic)
        d.addBoth(self._release, topic)
        return d

    def _channels_of(self, address: str, topic_name: str) -> defer.Deferred:
        """One lookupd's channels for the topic; [] (logged) when it cannot say."""
        fetch = self.fetch or self.broker.auth.fetch
        d = defer.maybeDeferred(fetch, f"http://{address}/channels", "get", {"topic": topic_name}, self.headers)
        d.addCallback(channels_answer)

        def failed(failure) -> list[str]:
            log.warn("failed to query nsqlookupd {address} for channels to pre-create for topic {topic} - {error}",
                     address=address, topic=topic_name,
                     error=str(failure.value) or type(failure.value).__name__)
            return []

        d.addErrback(failed)
        return d

    def _precreate(self, answers: list[list[str]], topic) -> None:
        if topic.exiting or self.broker.topics.get(topic.name) is not topic:
            return  # deleted meanwhile
        for name in dict.fromkeys(n for names in answers for n in names):
            if name.endswith("#ephemeral"):
                continue
            if not is_valid_name(name):
                log.warn("ignoring channel {name!r} listed by nsqlookupd for topic {topic}: invalid name",
                         name=name, topic=topic.name)
                continue
            topic.channel(name)

    def _release(self, result, topic) -> None:
        topic.release()
        if isinstance(result, Failure):
            log.failure("pre-creating the channels of topic {topic} failed", result, topic=topic.name)

    def topic_deleted(self, topic) -> None:
        self._all(b"UNREGISTER", topic.name)

    def channel_created(self, topic, channel) -> None:
        self._all(b"REGISTER", topic.name, channel.name)

    def channel_deleted(self, topic, channel) -> None:
        self._all(b"UNREGISTER", topic.name, channel.name)
