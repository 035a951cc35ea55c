"""`twistd mqlookupd` end to end: a raw V1 client registers, the HTTP API shows it."""

from __future__ import annotations

import json
import socket
import struct

import pytest


@pytest.fixture
def lookupd(start_lookupd):
    return start_lookupd()


def _read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "lookupd closed the connection"
            data += chunk
        return data

    (size,) = struct.unpack(">i", exactly(4))
    return exactly(size)


def test_register_then_query_over_http(lookupd):
    identify = json.dumps({"version": "1.3.0", "tcp_port": 4150, "http_port": 4151,
                           "hostname": "h1", "broadcast_address": "b1"}).encode()
    with socket.create_connection((lookupd.tcp_host, lookupd.tcp_port), timeout=5) as sock:
        sock.sendall(b"  V1IDENTIFY\n" + struct.pack(">i", len(identify)) + identify)
        answer = json.loads(_read_frame(sock))
        assert answer["tcp_port"] == lookupd.tcp_port
        assert answer["http_port"] == lookupd.http_port
        assert answer["version"] == "1.3.0"
        sock.sendall(b"REGISTER t c\nREGISTER u\nPING\n")
        assert [_read_frame(sock) for _ in range(3)] == [b"OK", b"OK", b"OK"]
        host, port = sock.getsockname()[:2]
        local = f"{host}:{port}"

        status, body = lookupd.get("/lookup?topic=t")
        assert status == 200
        assert body == {"channels": ["c"], "producers": [{
            "remote_address": local, "hostname": "h1", "broadcast_address": "b1",
            "tcp_port": 4150, "http_port": 4151, "version": "1.3.0",
            "topology_zone": "", "topology_region": ""}]}
        assert lookupd.get("/topics") == (200, {"topics": ["t", "u"]})
        assert lookupd.get("/channels?topic=t") == (200, {"channels": ["c"]})
        status, body = lookupd.get("/nodes")
        assert status == 200
        assert [(n["broadcast_address"], n["topics"], n["tombstones"]) for n in body["producers"]] \
            == [("b1", ["t", "u"], [False, False])]

        sock.sendall(b"BOGUS\n")
        assert _read_frame(sock) == b"E_INVALID invalid command BOGUS"
        assert sock.recv(1) == b""

    # The connection's end took the broker out of everything; the registrations stay.
    assert lookupd.get("/lookup?topic=t") == (200, {"channels": ["c"], "producers": []})
    assert lookupd.get("/nodes") == (200, {"producers": []})
    assert lookupd.get("/lookup?topic=nope") == (404, {"message": "TOPIC_NOT_FOUND"})


def test_commands_before_a_half_close_are_answered(lookupd):
    with socket.create_connection((lookupd.tcp_host, lookupd.tcp_port), timeout=5) as sock:
        sock.sendall(b"  V1PING\nPING\nIDENTIFY\n\x00\x00")
        sock.shutdown(socket.SHUT_WR)
        assert [_read_frame(sock) for _ in range(3)] == [
            b"OK", b"OK", b"E_BAD_BODY IDENTIFY failed to read body size"]
        assert sock.recv(1) == b""


def test_restart_forgets_and_stops_cleanly(lookupd):
    assert lookupd.post("/topic/create?topic=t") == 200
    assert lookupd.get("/topics") == (200, {"topics": ["t"]})
    lookupd.restart()
    assert lookupd.get("/topics") == (200, {"topics": []})
    assert lookupd.stop() in (0, -15)
    assert "Traceback" not in lookupd.log()
