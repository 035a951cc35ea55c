"""The TCP protocol brokers speak to mqlookupd: nsqlookupd's "V1".

As nsqlookupd (`nsqlookupd/tcp.go`, `nsqlookupd/lookup_protocol_v1.go`):
after the magic `"  V1"` a broker sends `\\n`-terminated commands
(IDENTIFY with a size-prefixed JSON body, REGISTER, UNREGISTER, PING).
Every answer is `[4-byte size][payload]`, with no frame type, unlike
nsqd's V2, and every error (`E_INVALID ...`, `E_BAD_BODY ...`) is fatal:
sent, then the connection closes. When a connection ends, by error or
not, the broker is taken out of every registration, which is how a
broker that dies stops being handed out to consumers.

Two bounds nsqlookupd lacks: the IDENTIFY body (it allocates whatever
size the client names) and the command line (it buffers a line without
end). A command line over the bound closes the connection without an
answer, as no nsqlookupd error text fits. A third comes from Go's
blocking writes: nsqlookupd reads no further command while an answer
cannot be sent, so each connection is its transport's streaming producer
and stops reading while its unsent answers fill the transport's buffer.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping
from typing import Any

from twisted.internet.interfaces import IHalfCloseableProtocol, IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

from mqd.logs import get_logger
from mqd.lookup.registry import PeerInfo, Producer, Registration, RegistrationDB
from mqd.names import EPHEMERAL_SUFFIX, is_valid_name
from mqd.peers import remote_address
from mqd.wire.errors import GoStruct
from mqd.wire.framing import MAGIC_V1
from mqd.wire.json_encoding import encode_json
from mqd.wire.transport import IStreamTransport

__all__ = ["LOOKUPD_VERSION", "LookupdFactory", "LookupdProtocol", "MAGIC_V1", "frame"]

log = get_logger(__name__)

# What brokers and tools compare against (nsqlookupd's version.Binary).
LOOKUPD_VERSION = "1.3.0"
# nsqd's IDENTIFY is a few hundred bytes; a megabyte leaves room for any real one.
MAX_IDENTIFY_BODY = 1 << 20
# The longest real command is `UNREGISTER <64 chars> <64 chars>`.
MAX_LINE = 4096

_CLIENT = Registration("client", "", "")
# Go's strings.TrimSpace, for the ASCII whitespace a command line can hold.
_SPACE = b" \t\n\r\v\f"


def frame(payload: bytes) -> bytes:
    """A V1 answer: the payload's size, then the payload."""
    return struct.pack(">i", len(payload)) + payload


class _Fatal(Exception):
    """An nsqlookupd FatalClientErr: `<CODE> <description>`, then the connection closes."""

    def __init__(self, code: str, description: str = "") -> None:
        super().__init__(f"{code} {description}" if description else code)


# nsqlookupd's PeerInfo as json.Unmarshal fills it. remote_address is
# decoded (a wrong type fails) but then replaced by the real one.
_PEER_INFO = GoStruct({
    "remote_address": "string", "hostname": "string", "broadcast_address": "string",
    "tcp_port": "int", "http_port": "int", "version": "string",
    "topology_zone": "string", "topology_region": "string",
})


def _peer_fields(body: bytes) -> dict[str, Any]:
    """IDENTIFY's JSON as PeerInfo's fields, or ValueError where Go's decoder fails."""
    fields = _PEER_INFO.unmarshal(body)
    del fields["remote_address"]
    return fields


@implementer(IHalfCloseableProtocol, IPushProducer)
class LookupdProtocol(Protocol):
    """One broker's connection: magic, commands, and its registrations' lifetime."""

    factory: LookupdFactory
    transport: IStreamTransport

    def connectionMade(self) -> None:
        peer = self.transport.getPeer()
        # Go's net.Addr String(): the peer id and remote_address.
        self.peer_id = remote_address(peer)
        self.peer: PeerInfo | None = None
        self._buf = b""
        self._magic = False
        self._identifying = False
        self._closing = False
        self.transport.registerProducer(self, True)

    @property
    def db(self) -> RegistrationDB:
        return self.factory.db

    # -- input ----------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return
        self._buf += data
        try:
            self._process()
        except _Fatal as e:
            log.error("[{peer}] - {error}", peer=self.peer_id, error=str(e))
            self._close_with(str(e).encode("utf-8", "surrogateescape"))

    def _process(self) -> None:
        while not self._closing:
            if not self._magic:
                if len(self._buf) < 4:
                    return
                magic, self._buf = self._buf[:4], self._buf[4:]
                if magic != MAGIC_V1:
                    log.error("client({peer}) bad protocol magic {magic!r}", peer=self.peer_id,
                              magic=magic)
                    self._close_with(b"E_BAD_PROTOCOL")
                    return
                self._magic = True
            elif self._identifying:
                if len(self._buf) < 4:
                    return
                (size,) = struct.unpack(">i", self._buf[:4])
                if size < 0 or size > MAX_IDENTIFY_BODY:
                    raise _Fatal("E_BAD_BODY", f"IDENTIFY invalid body size {size}")
                if len(self._buf) < 4 + size:
                    return
                body, self._buf = self._buf[4:4 + size], self._buf[4 + size:]
                self._identifying = False
                self._send(self._identify(body))
            else:
                end = self._buf.find(b"\n")
                if end < 0:
                    if len(self._buf) > MAX_LINE:
                        log.error("[{peer}] - command line over {max} bytes", peer=self.peer_id,
                                  max=MAX_LINE)
                        self._lose()
                    return
                line, self._buf = self._buf[:end], self._buf[end + 1:]
                params = line.strip(_SPACE).decode("utf-8", "surrogateescape").split(" ")
                response = self._execute(params)
                if response is not None:
                    self._send(response)

    def readConnectionLost(self) -> None:
        """IHalfCloseableProtocol: the peer sent its last byte; answer what it sent, then close.

        Every whole command is answered by now (Twisted would otherwise
        drop the connection before those answers are written). An IDENTIFY
        cut short gets nsqlookupd's error for it; a partial command line is
        dropped without one, as nsqlookupd's line reader drops it.
        """
        if self._closing:
            return
        if self._identifying:
            what = "body size" if len(self._buf) < 4 else "body"
            error = _Fatal("E_BAD_BODY", f"IDENTIFY failed to read {what}")
            log.error("[{peer}] - {error}", peer=self.peer_id, error=str(error))
            self._close_with(str(error).encode())
        else:
            self._lose()

    def writeConnectionLost(self) -> None:
        """IHalfCloseableProtocol: mqlookupd never half-closes its side; nothing to do."""

    def _execute(self, params: list[str]) -> bytes | None:
        command = params[0]
        if command == "PING":
            return self._ping()
        if command == "IDENTIFY":
            if self.peer is not None:
                raise _Fatal("E_INVALID", "cannot IDENTIFY again")
            # The body follows; `_process` reads it and answers.
            self._identifying = True
            return None
        if command == "REGISTER":
            return self._register(params[1:])
        if command == "UNREGISTER":
            return self._unregister(params[1:])
        raise _Fatal("E_INVALID", f"invalid command {command}")

    # -- commands -------------------------------------------------------------------------

    def _identify(self, body: bytes) -> bytes:
        try:
            fields = _peer_fields(body)
        except ValueError:
            raise _Fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None
        peer = PeerInfo(id=self.peer_id, remote_address=self.peer_id, **fields)
        if not (peer.broadcast_address and peer.tcp_port and peer.http_port and peer.version):
            raise _Fatal("E_BAD_BODY", "IDENTIFY missing fields")
        peer.last_update = self.db.now()
        self.peer = peer
        log.info("CLIENT({peer}): IDENTIFY Address:{address} TCP:{tcp} HTTP:{http} Version:{version}",
                 peer=self.peer_id, address=peer.broadcast_address, tcp=peer.tcp_port,
                 http=peer.http_port, version=peer.version)
        if self.db.add_producer(_CLIENT, Producer(peer)):
            self._logged("REGISTER", _CLIENT)
        factory = self.factory
        # Go marshals a map: keys sorted.
        return encode_json({
            "broadcast_address": factory.broadcast_address,
            "hostname": factory.hostname,
            "http_port": factory.ports.get("HTTP", 0),
            "tcp_port": factory.ports.get("TCP", 0),
            "version": LOOKUPD_VERSION,
        }, sort_keys=True)

    def _ping(self) -> bytes:
        # Allowed before IDENTIFY; then there is no one to mark as alive.
        if self.peer is not None:
            self.peer.last_update = self.db.now()
        return b"OK"

    def _register(self, params: list[str]) -> bytes:
        peer = self._identified()
        topic, channel = _topic_channel("REGISTER", params)
        if channel:
            reg = Registration("channel", topic, channel)
            if self.db.add_producer(reg, Producer(peer)):
                self._logged("REGISTER", reg)
        reg = Registration("topic", topic, "")
        if self.db.add_producer(reg, Producer(peer)):
            self._logged("REGISTER", reg)
        return b"OK"

    def _unregister(self, params: list[str]) -> bytes:
        peer = self._identified()
        topic, channel = _topic_channel("UNREGISTER", params)
        if channel:
            self._remove_producer(Registration("channel", topic, channel), peer, channel)
            return b"OK"
        # A topic's unregistration takes the broker out of its channels too
        # (nsqd unregisters those first, so normally there is nothing left).
        for reg in self.db.find_registrations("channel", topic, "*"):
            removed, _ = self.db.remove_producer(reg, peer.id)
            if removed:
                log.warn("client({peer}) unexpected UNREGISTER category:{reg.category} "
                         "key:{reg.key} subkey:{reg.subkey}", peer=self.peer_id, reg=reg)
        self._remove_producer(Registration("topic", topic, ""), peer, topic)
        return b"OK"

    def _remove_producer(self, reg: Registration, peer: PeerInfo, name: str) -> None:
        """UNREGISTER's rule: an ephemeral `name` nobody produces is gone, a durable one stays listed."""
        removed, left = self.db.remove_producer(reg, peer.id)
        if removed:
            self._logged("UNREGISTER", reg)
        if left == 0 and name.endswith(EPHEMERAL_SUFFIX):
            self.db.remove_registration(reg)

    def _identified(self) -> PeerInfo:
        if self.peer is None:
            raise _Fatal("E_INVALID", "client must IDENTIFY")
        return self.peer

    def _logged(self, what: str, reg: Registration) -> None:
        log.info("DB: client({peer}) {what} category:{reg.category} key:{reg.key} subkey:{reg.subkey}",
                 peer=self.peer_id, what=what, reg=reg)

    # -- output and the end -----------------------------------------------------------------

    def _send(self, payload: bytes) -> None:
        self.transport.write(frame(payload))

    def _close_with(self, payload: bytes) -> None:
        self._buf = b""
        self._send(payload)
        self._lose()

    def _lose(self) -> None:
        """Close once the answers are out; a registered producer would hold the close back forever."""
        self._closing = True
        self.transport.unregisterProducer()
        self.transport.loseConnection()

    # IPushProducer: the transport calls these as its write buffer fills and drains.

    def pauseProducing(self) -> None:
        self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        self.transport.resumeProducing()

    def stopProducing(self) -> None:
        """The connection is going; connectionLost does the cleanup."""

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._closing = True
        peer, self.peer = self.peer, None
        if peer is None:
            return
        for reg in self.db.lookup_registrations(peer.id):
            removed, _ = self.db.remove_producer(reg, peer.id)
            if removed:
                self._logged("UNREGISTER", reg)


def _topic_channel(command: str, params: list[str]) -> tuple[str, str]:
    """nsqlookupd's getTopicChan: the topic and optional channel, checked."""
    if not params:
        raise _Fatal("E_INVALID", f"{command} insufficient number of params")
    topic = params[0]
    channel = params[1] if len(params) >= 2 else ""
    if not is_valid_name(topic):
        raise _Fatal("E_BAD_TOPIC", f"{command} topic name '{topic}' is not valid")
    if channel and not is_valid_name(channel):
        raise _Fatal("E_BAD_CHANNEL", f"{command} channel name '{channel}' is not valid")
    return topic, channel


class LookupdFactory(Factory):
    """Builds a LookupdProtocol per broker connection, all sharing one RegistrationDB.

    `ports` is filled with the bound TCP and HTTP ports once the listeners
    are up; IDENTIFY's answer reports them (port 0 picks one at start-up).
    """

    # Twisted types Factory.protocol against its own Protocol/Factory pairing,
    # which a protocol with `factory: LookupdFactory` does not match.
    protocol = LookupdProtocol  # type: ignore[assignment]
    noisy = False

    def __init__(self, db: RegistrationDB, broadcast_address: str,
                 ports: Mapping[str, int] | None = None, hostname: str | None = None) -> None:
        self.db = db
        self.broadcast_address = broadcast_address
        self.ports = ports if ports is not None else {}
        self.hostname = hostname if hostname is not None else socket.gethostname()
