"""With auth configured, the HTTP endpoints that show bodies ask for the secret TCP's AUTH asks for;
mqadmin passes it on and acts only on nodes the cluster knows.

Real processes throughout: twistd mqd with `--auth-http-address` pointing
at the auth server of tests/support/authd_server.py (its own process),
twistd mqadmin in front of the broker, and plain HTTP clients. Before,
`GET /channel/peek` handed any HTTP client the bodies a TCP client without
a secret was refused (`E_AUTH_FIRST` on SUB), `POST /snapshot` wrote them
all to disk for anyone, and mqadmin's `DELETE /api/nodes/<host:port>`
POSTed `/topic/delete` to whatever address it was given. Over HTTPS the
auth server is told so, and the name of the client's certificate, as AUTH
tells it.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.support.admin import AdminProcess
from tests.support.authd import SUBSCRIBE, AuthServer, grant, identify_auth
from tests.support.certs import client_context, make_certs, tls_flags
from tests.support.processes import NO_PROXY
from tests.support.raw_conn import FRAME_MESSAGE, FRAME_RESPONSE, RawConn, command

BODY = b"the body only subscribers may read"


def request(address: str, method: str, path: str, secret: str | None = None,
            header: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request, with `Authorization: Bearer <secret>` (or `header`)."""
    req = urllib.request.Request(f"http://{address}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    if secret is not None:
        req.add_header("Authorization", f"Bearer {secret}")
    elif header is not None:
        req.add_header("Authorization", header)
    try:
        with NO_PROXY.open(req, timeout=15) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def message_of(body: bytes) -> str:
    return json.loads(body)["message"]


@pytest.fixture
def authd(tmp_path):
    server = AuthServer(tmp_path)
    yield server
    server.close()


@pytest.fixture
def secured(start_broker, authd):
    """A broker asking `authd`, with topic t and its channels c and other."""
    broker = start_broker(f"--auth-http-address={authd.address}", "--broadcast-address=127.0.0.1")
    for path in ("/topic/create?topic=t", "/channel/create?topic=t&channel=c",
                 "/channel/create?topic=t&channel=other"):
        status, _, body = request(broker.http_address, "POST", path)
        assert status == 200, (path, body)
    return broker


def publish(broker, body: bytes = BODY) -> None:
    """One message into t (HTTP /pub needs no secret, as in nsqd)."""
    req = urllib.request.Request(f"http://{broker.http_address}/pub?topic=t", data=body, method="POST")
    with NO_PROXY.open(req, timeout=15) as response:
        assert response.status == 200


def test_peek_asks_for_the_secret_tcp_asks_for(secured, authd):
    publish(secured)
    address = secured.http_address
    # No secret (or another kind of credential): no body.
    for path in ("/channel/peek?topic=t&channel=c", "/topic/peek?topic=t"):
        status, headers, body = request(address, "GET", path)
        assert (status, message_of(body), headers.get("WWW-Authenticate")) == (401, "AUTH_REQUIRED", "Bearer")
        assert BODY not in body
        status, _, body = request(address, "GET", path, header="Basic dXNlcjpwYXNz")
        assert (status, message_of(body)) == (401, "AUTH_REQUIRED")
    assert authd.queries == []
    # A secret the auth server refuses: logged, not told.
    status, _, body = request(address, "GET", "/channel/peek?topic=t&channel=c", secret="wrong")
    assert (status, message_of(body)) == (401, "AUTH_FAILED")
    assert BODY not in body and b"403" not in body
    assert authd.queries == [{"remote_ip": "127.0.0.1", "tls": "false", "secret": "wrong", "common_name": ""}]
    assert "AUTH failed" in secured.log()
    # A subscriber's secret: its channel, and its topic, not another channel.
    authd.answers["c-only"] = grant({"topic": "^t$", "channels": ["^c$"], "permissions": ["subscribe"]})
    authd.answers["pub"] = grant({"topic": ".*", "channels": [".*"], "permissions": ["publish"]})
    status, _, body = request(address, "GET", "/channel/peek?topic=t&channel=c", secret="c-only")
    assert status == 200
    assert [m["body_text"] for m in json.loads(body)["messages"]] == [BODY.decode()]
    status, _, body = request(address, "GET", "/channel/peek?topic=t&channel=other", secret="c-only")
    assert (status, message_of(body)) == (403, "UNAUTHORIZED")
    # Whoever may subscribe to one channel of t gets all of t's messages: the topic too.
    assert request(address, "GET", "/topic/peek?topic=t", secret="c-only")[0] == 200
    for path in ("/channel/peek?topic=t&channel=c", "/topic/peek?topic=t"):
        status, _, body = request(address, "GET", path, secret="pub")
        assert (status, message_of(body)) == (403, "UNAUTHORIZED")
    # The answers are kept for their ttl: one query per secret.
    assert sorted(q["secret"] for q in authd.queries) == ["c-only", "pub", "wrong"]
    # The same secret still works over TCP, as before.
    with RawConn(secured) as conn:
        assert identify_auth(conn, b"c-only")[0] == FRAME_RESPONSE
        conn.send(command("SUB t c") + command("RDY 1"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        frame_type, payload = conn.read_frame()
        assert frame_type == FRAME_MESSAGE and payload.endswith(BODY)


def test_snapshots_and_mqadmin_ask_for_it_too_and_mqadmin_acts_only_on_known_nodes(secured, authd, tmp_path):
    publish(secured)
    authd.answers["c-only"] = grant({"topic": "^t$", "channels": ["^c$"], "permissions": ["subscribe"]})
    authd.answers["all"] = grant(SUBSCRIBE)
    snapshots = secured.data_dir / "snapshots"
    address = secured.http_address
    status, _, body = request(address, "POST", "/snapshot?out=nobody")
    assert (status, message_of(body)) == (401, "AUTH_REQUIRED")
    status, _, body = request(address, "POST", "/snapshot?out=partial", secret="c-only")
    assert (status, message_of(body)) == (403, "UNAUTHORIZED")
    assert not (snapshots / "nobody").exists() and not (snapshots / "partial").exists()
    status, _, body = request(address, "POST", "/snapshot?out=everything", secret="all")
    assert status == 200, body
    assert (snapshots / "everything").is_dir()

    admin = AdminProcess(tmp_path / "admin", [f"--nsqd-http-address={address}"]).start()
    try:
        node = f"127.0.0.1:{secured.http_port}"
        status, headers, body = request(admin.http_address, "GET", "/api/peek/t/c")
        assert (status, message_of(body), headers.get("WWW-Authenticate")) == (401, "AUTH_REQUIRED", "Bearer")
        status, _, body = request(admin.http_address, "GET", "/api/peek/t/c", secret="wrong")
        assert (status, message_of(body)) == (401, "AUTH_FAILED")
        status, _, body = request(admin.http_address, "GET", "/api/peek/t/c?max_body=8", secret="all")
        assert status == 200, body
        [entry] = json.loads(body)["nodes"]
        assert [(m["body_text"], m["size"], m["truncated"]) for m in entry["messages"]] == \
            [(BODY[:8].decode(), len(BODY), True)]
        status, _, body = request(admin.http_address, "POST", f"/api/snapshot/{node}")
        assert (status, message_of(body)) == (401, "AUTH_REQUIRED")
        status, _, body = request(admin.http_address, "POST", f"/api/snapshot/{node}", secret="all")
        assert status == 200, body

        # DELETE /api/nodes/<node>: only on a node of the cluster.
        with socket.socket() as bystander:
            bystander.bind(("127.0.0.1", 0))
            bystander.listen(8)
            bystander.settimeout(0.5)
            status, _, body = _delete(admin, f"127.0.0.1:{bystander.getsockname()[1]}", "t")
            assert (status, message_of(body)) == (404, "NODE_NOT_FOUND")
            with pytest.raises(TimeoutError):
                bystander.accept()  # nothing was asked of it
        status, _, body = _delete(admin, node, "t")
        assert status == 200, body
        assert secured.get("/stats?format=json")[1]["topics"] == []
    finally:
        admin.stop()


def _delete(admin: AdminProcess, node: str, topic: str) -> tuple[int, Any, bytes]:
    req = urllib.request.Request(admin.url(f"api/nodes/{node}"), method="DELETE",
                                 data=json.dumps({"topic": topic}).encode())
    try:
        with NO_PROXY.open(req, timeout=15) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_over_https_the_auth_server_hears_tls_and_the_certificates_name(start_broker, authd, tmp_path):
    certs = make_certs(tmp_path / "certs")
    broker = start_broker(f"--auth-http-address={authd.address}", *tls_flags(certs, "--tls-client-auth-policy=require"))
    authd.answers["all"] = grant(SUBSCRIBE)
    https = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(
        context=client_context(certs, client_cert=True)))
    assert https.open(urllib.request.Request(f"https://127.0.0.1:{broker.https_port}/topic/create?topic=t",
                                             data=b"", method="POST"), timeout=15).status == 200
    req = urllib.request.Request(f"https://127.0.0.1:{broker.https_port}/topic/peek?topic=t",
                                 headers={"Authorization": "Bearer all"})
    with https.open(req, timeout=15) as response:
        assert response.status == 200 and json.loads(response.read())["total"] == 0
    assert authd.queries == [{"remote_ip": "127.0.0.1", "tls": "true", "secret": "all",
                              "common_name": "mqd-test-client"}]
