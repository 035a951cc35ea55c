"""Minimal NSQ client bits shared by the bench processes: V2 over TCP, and the HTTP API.

Only the slow, once-per-connection parts live here (handshakes, topic setup,
/stats); the hot loops in load.py parse frames inline, because a function
call per frame would make the load generator the bottleneck.
"""

from __future__ import annotations

import json
import socket
import struct
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

MAGIC = b"  V2"
FRAME_RESPONSE = 0
FRAME_ERROR = 1
FRAME_MESSAGE = 2
HEARTBEAT = b"_heartbeat_"
NOP = b"NOP\n"

HEADER = struct.Struct(">ii")  # frame size (counts the type field), frame type
SIZE = struct.Struct(">i")


class ProtocolError(Exception):
    """The broker said something a correct nsqd would not (or sent an error frame)."""


def parse_address(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` allowed) so CLI input and log lines share one parser."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a HOST:PORT address: {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def connect(address: tuple[str, int], timeout: float = 10.0) -> socket.socket:
    """Open a V2 connection in blocking mode.

    TCP_NODELAY matters: FIN batches, NOPs and single PUBs are small writes that
    Nagle would otherwise hold back behind unacknowledged data.
    """
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)  # hot loops rely on blocking sockets (no poll before each recv)
    sock.sendall(MAGIC)
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ProtocolError("connection closed by broker")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """Read exactly one frame; never reads past it, so the hot loop can take over after."""
    size, ftype = HEADER.unpack(_recv_exact(sock, 8))
    if size < 4:
        raise ProtocolError(f"invalid frame size {size}")
    return ftype, _recv_exact(sock, size - 4)


def read_response(sock: socket.socket, what: str) -> bytes:
    """Return the next response payload, answering heartbeats and failing on errors."""
    while True:
        ftype, payload = read_frame(sock)
        if ftype == FRAME_RESPONSE and payload == HEARTBEAT:
            sock.sendall(NOP)
            continue
        if ftype == FRAME_RESPONSE:
            return payload
        if ftype == FRAME_ERROR:
            raise ProtocolError(f"{what}: broker error {payload.decode(errors='replace')}")
        raise ProtocolError(f"{what}: unexpected frame type {ftype}")


def expect(sock: socket.socket, expected: bytes, what: str) -> None:
    payload = read_response(sock, what)
    if payload != expected:
        raise ProtocolError(f"{what}: expected {expected!r}, got {payload[:200]!r}")


def identify_body(client_id: str = "bench", fields: Mapping[str, Any] | None = None) -> bytes:
    """The JSON body of a bench client's IDENTIFY; ``fields`` are added to (or override) it.

    Only what is asked for is sent: a field left out keeps the broker's default,
    which is not always what an explicit value means (``output_buffer_timeout``
    0 is the default, -1 turns output buffering off).
    """
    data: dict[str, Any] = {
        "feature_negotiation": True,
        "client_id": client_id,
        "hostname": "bench",
        "user_agent": "mqd-bench/0.1",
    }
    data.update(fields or {})
    return json.dumps(data).encode()


def identify(
    sock: socket.socket, client_id: str = "bench", fields: Mapping[str, Any] | None = None
) -> dict:
    """Send IDENTIFY with feature negotiation (plus ``fields``) and return the broker's JSON answer.

    Checking the JSON (rather than accepting any OK) catches brokers that ignore
    feature_negotiation, which real clients such as go-nsq depend on. A value
    the broker rejects (E_BAD_BODY) raises ProtocolError.
    """
    body = identify_body(client_id, fields)
    sock.sendall(b"IDENTIFY\n" + SIZE.pack(len(body)) + body)
    payload = read_response(sock, "IDENTIFY")
    try:
        answer = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"IDENTIFY: response is not JSON: {payload[:200]!r}") from exc
    if not isinstance(answer, dict):
        raise ProtocolError(f"IDENTIFY: response is not a JSON object: {payload[:200]!r}")
    return answer


def create_topic_channel(address: tuple[str, int], topic: str, channel: str) -> None:
    """Make sure topic and channel exist before writers start, so messages accumulate.

    NSQ's bench uses /topic/create and /channel/create over HTTP; a SUB followed by
    CLS has the same effect over TCP and needs no HTTP address.
    """
    sock = connect(address)
    try:
        sock.sendall(f"SUB {topic} {channel}\n".encode())
        expect(sock, b"OK", "SUB")
        sock.sendall(b"CLS\n")
        expect(sock, b"CLOSE_WAIT", "CLS")
    finally:
        sock.close()


# -- the HTTP API --------------------------------------------------------------------


def http_request(
    address: str, path: str, method: str = "GET", timeout: float = 30.0, **query: str
) -> bytes:
    """The body of ``METHOD http://address/path?query`` (an empty body for a POST).

    Raises OSError (urllib's HTTPError) unless the answer is 2xx.
    """
    url = f"http://{address}{path}" + ("?" + urllib.parse.urlencode(query) if query else "")
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def http_create(http_address: str, topic: str, *channels: str) -> None:
    """``/topic/create`` then ``/channel/create`` for each channel, as nsqd's own bench does."""
    http_request(http_address, "/topic/create", "POST", topic=topic)
    for channel in channels:
        http_request(http_address, "/channel/create", "POST", topic=topic, channel=channel)


def channel_counts(stats: dict, topic: str, channel: str) -> tuple[int, int] | None:
    """(depth, in-flight) of a channel in a /stats?format=json answer, None if absent.

    Accepts nsqd's current flat shape and the pre-1.0 ``{"status_code", "data"}``
    envelope, so the check also works against another broker.
    """
    data = stats.get("data", stats) if isinstance(stats.get("data"), dict) else stats
    for t in data.get("topics") or ():
        if t.get("topic_name") != topic:
            continue
        for c in t.get("channels") or ():
            if c.get("channel_name") == channel:
                return int(c.get("depth", 0)), int(c.get("in_flight_count", 0))
    return None


def stats_counts(http_address: str, topic: str, channel: str) -> tuple[int, int] | None:
    """(depth, in-flight) of a channel, asked of the broker's /stats; None if absent."""
    stats = json.loads(http_request(http_address, "/stats", format="json", topic=topic))
    return channel_counts(stats, topic, channel)
