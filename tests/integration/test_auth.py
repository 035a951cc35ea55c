"""AUTH against a real auth server (twisted.web, in its own process) and a real broker."""

from __future__ import annotations

import json
import socket
import time

from tests.support.authd import PUBLISH, SUBSCRIBE, grant, identify_auth
from tests.support.pynsq_loop import Collector
from tests.support.raw_conn import FRAME_ERROR, FRAME_RESPONSE, RawConn, command


def test_pynsq_reader_and_writer_with_auth(start_broker, authd, loop, name):
    authd.answers["pub"] = grant(PUBLISH, identity="producer")
    authd.answers["sub"] = grant(SUBSCRIBE, identity="consumer")
    broker = start_broker(f"--auth-http-address={authd.address}")
    topic = name()
    got = Collector()
    loop.reader(broker, topic, "c", got, max_in_flight=10, auth_secret="sub")
    writer = loop.writer(broker, auth_secret="pub")
    assert loop.publish(writer, "pub", topic, b"hello") == b"OK"
    loop.run_until(lambda: got.bodies == [b"hello"], what="the message")
    assert {q["secret"] for q in authd.queries} == {"pub", "sub"}
    assert all(q["remote_ip"] == "127.0.0.1" and q["tls"] == "false" for q in authd.queries)

    status, stats = broker.get("/stats?format=json")
    assert status == 200
    [topic_stats] = [t for t in stats["topics"] if t["topic_name"] == topic]
    [client] = topic_stats["channels"][0]["clients"]
    assert client["authed"] is True
    assert client["auth_identity"] == "consumer"
    assert client["auth_identity_url"] == "http://id/consumer"


def test_denied(start_broker, authd, name):
    authd.answers["pub"] = grant(PUBLISH)
    broker = start_broker(f"--auth-http-address={authd.address}")
    topic = name()
    with RawConn(broker) as conn:
        conn.send(command(f"PUB {topic}", b"x"))
        assert conn.read_frame() == (FRAME_ERROR, b"E_AUTH_FIRST AUTH required before PUB")
        conn.expect_closed()
    with RawConn(broker) as conn:
        frame_type, payload = identify_auth(conn, b"pub")
        assert frame_type == FRAME_RESPONSE
        assert json.loads(payload) == {"identity": "someone", "identity_url": "http://id/someone",
                                       "permission_count": 1}
        conn.send(command(f"SUB {topic} c"))
        assert conn.read_frame() == (FRAME_ERROR, f'E_UNAUTHORIZED AUTH failed for SUB on "{topic}" "c"'.encode())
        conn.expect_closed()
    with RawConn(broker) as conn:
        assert identify_auth(conn, b"nobody") == (FRAME_ERROR, b"E_AUTH_FAILED AUTH failed")
        conn.expect_closed()


def test_expired_ttl_is_queried_again(start_broker, authd, name):
    authd.answers["s"] = grant(PUBLISH, ttl=1)
    broker = start_broker(f"--auth-http-address={authd.address}")
    topic = name()
    with RawConn(broker) as conn:
        assert identify_auth(conn, b"s")[0] == FRAME_RESPONSE
        conn.send(command(f"PUB {topic}", b"1"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        assert len(authd.queries) == 1
        time.sleep(1.1)
        conn.send(command(f"PUB {topic}", b"2"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        assert len(authd.queries) == 2
        authd.answers["s"] = grant(SUBSCRIBE, ttl=1)
        time.sleep(1.1)
        conn.send(command(f"PUB {topic}", b"3"))
        assert conn.read_frame() == (FRAME_ERROR, f'E_UNAUTHORIZED AUTH failed for PUB on "{topic}" ""'.encode())
        conn.expect_closed()
    assert len(authd.queries) == 3


def test_auth_server_down(start_broker):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    broker = start_broker(f"--auth-http-address={dead}")
    with RawConn(broker) as conn:
        assert identify_auth(conn, b"x") == (FRAME_ERROR, b"E_AUTH_FAILED AUTH failed")
        conn.expect_closed()
    assert "AUTH failed" in broker.log()


def test_slow_auth_server_does_not_block_others(start_broker, authd, name):
    authd.answers["ok"] = grant(PUBLISH)
    authd.answers["slow"] = grant(PUBLISH)
    authd.slow.add("slow")
    broker = start_broker(f"--auth-http-address={authd.address}", "--http-client-request-timeout=1s")
    topic = name()
    with RawConn(broker) as waiting, RawConn(broker) as other:
        waiting.send(command("IDENTIFY", b"{}"))
        assert waiting.read_frame() == (FRAME_RESPONSE, b"OK")
        waiting.send(command("AUTH", b"slow") + command(f"PUB {topic}", b"queued"))
        started = time.monotonic()
        # While the first connection waits for its auth server, another one is served.
        assert identify_auth(other, b"ok")[0] == FRAME_RESPONSE
        other.send(command(f"PUB {topic}", b"x"))
        assert other.read_frame() == (FRAME_RESPONSE, b"OK")
        assert time.monotonic() - started < 1.0
        # The slow one times out (1 s) and fails; its PUB is never run.
        assert waiting.read_frame() == (FRAME_ERROR, b"E_AUTH_FAILED AUTH failed")
        waiting.expect_closed()
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200
    assert stats["topics"][0]["message_count"] == 1
