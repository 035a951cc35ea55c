"""A channel declared in mqlookupd exists on a broker from the topic's first message.

The channel is declared with mqlookupd's `POST /channel/create` (what
mqadmin and nsqadmin do); the broker, connected to that lookupd, asks its
`/channels?topic=` when the topic is created by a publish; with a lookupd
run with `--http-auth-required` (and a real auth server), the broker's
`--http-client-auth-secret` lets that query in.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.support.authd import AuthServer, grant
from tests.support.processes import FAST_SCAN, NO_PROXY, http_request, wait_for
from tests.support.raw_conn import RawConn, command


def _channels(broker, topic: str) -> dict[str, tuple[int, int]]:
    """channel -> (depth, message_count) from the broker's /stats."""
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200
    return {c["channel_name"]: (c["depth"], c["message_count"])
            for t in stats["topics"] if t["topic_name"] == topic for c in t["channels"]}


def test_channel_declared_in_lookupd_holds_every_message(start_lookupd, start_broker):
    lookupd = start_lookupd("--broadcast-address=127.0.0.1")
    assert lookupd.post("/channel/create?topic=pre&channel=archive") == 200
    assert lookupd.post("/channel/create?topic=pre&channel=tmp%23ephemeral") == 200
    broker = start_broker(*FAST_SCAN, "--broadcast-address=127.0.0.1",
                          f"--lookupd-tcp-address={lookupd.tcp_address}")
    wait_for(lambda: any(p["http_port"] == broker.http_port for p in lookupd.get("/nodes")[1]["producers"]),
             what="the broker to register with lookupd")

    for i in range(5):
        assert http_request(broker.http_address, "POST", "/pub?topic=pre", b"m%d" % i) == (200, b"OK")

    wait_for(lambda: _channels(broker, "pre") == {"archive": (5, 5)}, what="archive to hold all 5")
    with RawConn(broker) as conn:
        conn.send(command(b"SUB pre archive") + command(b"RDY 10"))
        assert conn.read_frame() == (0, b"OK")
        assert [conn.read_message()[3] for _ in range(5)] == [b"m%d" % i for i in range(5)]
    assert "failed to query nsqlookupd" not in broker.log()


@pytest.fixture
def authd(tmp_path):
    server = AuthServer(tmp_path)
    # What the broker's secret may do at lookupd: read /channels, declare channels.
    server.answers["good"] = grant({"topic": ".*", "channels": [".*"], "permissions": ["subscribe", "publish"],
                                    "admin": True})
    yield server
    server.close()


def _with_secret(address: str, method: str, path: str) -> tuple[int, bytes]:
    """(status, body) of a request to `host:port` carrying the secret `good`."""
    request = urllib.request.Request(f"http://{address}{path}", data=b"" if method == "POST" else None,
                                     method=method, headers={"Authorization": "Bearer good"})
    try:
        with NO_PROXY.open(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _registered(lookupd, broker) -> bool:
    status, body = _with_secret(lookupd.http_address, "GET", "/nodes")
    return status == 200 and any(p["http_port"] == broker.http_port for p in json.loads(body)["producers"])


@pytest.mark.parametrize("how", ["flag", "file"])
def test_the_secret_gets_the_channels_of_a_lookupd_that_requires_one(start_lookupd, start_broker, authd, tmp_path,
                                                                    how):
    lookupd = start_lookupd("--broadcast-address=127.0.0.1", "--http-auth-required",
                            f"--auth-http-address={authd.address}")
    assert lookupd.post("/channel/create?topic=pre&channel=archive") == 401
    assert _with_secret(lookupd.http_address, "POST", "/channel/create?topic=pre&channel=archive")[0] == 200
    if how == "flag":
        option = "--http-client-auth-secret=good"
    else:
        (tmp_path / "secret").write_text("good\n")
        option = f"--http-client-auth-secret-file={tmp_path / 'secret'}"
    broker = start_broker(*FAST_SCAN, "--broadcast-address=127.0.0.1", option,
                          f"--lookupd-tcp-address={lookupd.tcp_address}")
    wait_for(lambda: _registered(lookupd, broker), what="the broker to register with lookupd")

    assert http_request(broker.http_address, "POST", "/pub?topic=pre", b"m0") == (200, b"OK")

    wait_for(lambda: _channels(broker, "pre") == {"archive": (1, 1)}, what="archive to hold the message")
    assert "failed to query nsqlookupd" not in broker.log()
    assert "good" not in broker.log()
    assert any(q.get("secret") == "good" for q in authd.queries)

