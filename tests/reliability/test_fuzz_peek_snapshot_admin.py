"""Fuzzing the endpoints that show bodies (/channel/peek, /topic/peek, /snapshot) and mqadmin's API.

In-process (hypothesis), on test_fuzz's harness: a broker on a task.Clock
with a control channel full of acknowledged messages, with or without
auth configured (and with `--http-auth-required` too, where a refused
request must be nsqd's JSON 401/403 and change nothing) (its auth server is AuthClient's test seam: secrets that
grant everything, one channel, publishing only, answers nsqd would
refuse, and refusals). mqadmin runs in the same process, its whole site
and its real Cluster over an upstream that sends its requests to that
broker's HTTP API, with and without `--admin-user`. Random methods,
paths, queries, bodies and `Authorization` / user headers are thrown at
both. The oracle, for every request:

* an answer comes (the clock turned), never a 5xx but the documented
  ones (502 UPSTREAM_ERROR from mqadmin, 503 PEEK_BUSY / STORE_FAILED,
  507 SNAPSHOT_LIMIT);
* an error is nsqd's JSON `{"message": ...}` (redirects and the pages aside);
* with auth configured, a body is shown or written only for a secret
  granted it, and a 401 says `WWW-Authenticate: Bearer`;
* nothing is logged as a failure, critical or error (LogWatch);
* afterwards the control client is served (PUB, /ping, /stats count
  every control message) and, at the end, every control message comes out.

MQD_FUZZ_EXAMPLES=N runs N examples per test instead of the CI counts
(the default run takes a few seconds). A real mqadmin over a real lookupd
and broker that run with `--http-auth-required` is fuzzed in
test_fuzz_admin_auth_required.py, on the same requests (tests/support/admin_fuzz.py).
"""

from __future__ import annotations

import json
import os
import random
import socket
import tempfile
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.defer import fail, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from mqd.admin.endpoint import Admin
from mqd.admin.history import History, sampler
from mqd.admin.web import AdminSite
from mqd.clusterinfo.cluster import Cluster
from mqd.clusterinfo.upstream import UpstreamError
from mqd.http.auth import AuthClient, AuthError
from mqd.options import MQADMIN_OPTIONS, resolve
from tests.support.admin import AdminProcess
from tests.support.admin_fuzz import (
    ADMIN_PATHS,
    DOCUMENTED_5XX,
    fuzzed_admin_request,
    peek_query,
    spare_control,
)
from tests.support.auth_fakes import answer
from tests.support.auth_fuzz import ANSWERS, FULL_SECRET, RequiredAuthHarness
from tests.support.authd import PUBLISH as PUBLISH_ALL
from tests.support.authd import SUBSCRIBE as SUBSCRIBE_ALL
from tests.support.authd import AuthServer as AuthServer_
from tests.support.authd import grant as auth_grant
from tests.support.authd import identify_auth
from tests.support.fuzz_inputs import (
    EXAMPLES_OVERRIDE,
    HTTP_BODIES,
    HTTP_METHODS,
    examples,
)
from tests.support.http_client import HTTPClient, Response, error, parse_response
from tests.support.inprocess_fuzz import CONTROL_CHANNEL, CONTROL_TOPIC, Harness
from tests.support.log_watch import LogWatch
from tests.support.raw_conn import FRAME_RESPONSE, RawConn, command
from tests.support.v2_client import Client
from tests.support.v2_frames import cmd, sized


@pytest.fixture(autouse=True)
def _snapshots_in_line(sync_threads):
    """A snapshot of the in-process brokers here is answered in its request's call (see sync_threads)."""


# Secrets the fake auth server knows, and what each may see.
EVERYTHING = {"topic": ".*", "channels": [".*"], "permissions": ["subscribe", "publish"]}
GRANTS: dict[str, bytes] = {
    "all": answer(authorizations=[EVERYTHING]),
    "control": answer(authorizations=[{"topic": f"^{CONTROL_TOPIC}$", "channels": [f"^{CONTROL_CHANNEL}$"],
                                       "permissions": ["subscribe"]}]),
    "publisher": answer(authorizations=[{"topic": ".*", "channels": [".*"], "permissions": ["publish"]}]),
    "nothing": answer(authorizations=[]),
    "broken": b'{"ttl": 1, "authorizations": [{"topic": "(?=x)", "channels": [], "permissions": []}]}',
    "expired": answer(ttl=0),
}
SECRETS = [*GRANTS, "unknown", "", " ", "a" * 5000, "\u00e9", "Bearer", "all all"]

_secret = st.one_of(st.sampled_from(SECRETS), st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                                                      max_size=20))
# Values an Authorization header takes: bearer secrets, other schemes, garbage (no CR/LF: it is one header).
_authorization = st.one_of(
    st.none(),
    st.sampled_from(["Bearer all", "Bearer control", "Bearer publisher", "Bearer nothing", f"Bearer {FULL_SECRET}"]),
    _secret.map(lambda s: f"Bearer {s}"),
    _secret.map(lambda s: f"bEaReR   {s}  "),
    st.sampled_from(["Basic dXNlcjpwYXNz", "Bearer", "Bearer ", "Token all", "Bearer all extra", "Bearer\tall"]),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40),
)
_names = st.sampled_from([f"topic={CONTROL_TOPIC}&channel={CONTROL_CHANNEL}&", f"topic={CONTROL_TOPIC}&",
                          "topic=t&channel=c&", "", "topic=zz_other&channel=c&"])
_query_with_names = st.builds(lambda names, rest: (names + rest).rstrip("&"), _names, peek_query)

# (path, the method it serves), the real routes more often than their near misses.
BROKER_ROUTES = [("/channel/peek", "GET")] * 4 + [("/topic/peek", "GET")] * 3 + [("/snapshot", "POST")] * 2 + [
    ("/channel/peek/", "GET"), ("/CHANNEL/PEEK", "GET"), ("/topic//peek", "GET")]


@st.composite
def _broker_request(draw) -> tuple[str, str, bytes | None, str | None]:
    path, method = draw(st.sampled_from(BROKER_ROUTES))
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(HTTP_METHODS))
    query = draw(_query_with_names)
    body = draw(st.one_of(st.none(), st.sampled_from(HTTP_BODIES[:6])))
    return method, path + (f"?{query}" if query else ""), body, draw(_authorization)


class AuthServer:
    """AuthClient's fetch: the answer of GRANTS for a known secret, a refusal for any other."""

    def __init__(self) -> None:
        self.queries = 0

    def __call__(self, url: str, method: str, params: dict[str, str]):
        self.queries += 1
        body = GRANTS.get(params["secret"])
        return succeed(body) if body is not None else fail(AuthError("got response 403 b'no'"))


class AuthHarness(Harness):
    """test_fuzz's harness, then auth configured: the control publisher, connected before, publishes as it did."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        broker = self.broker
        broker.update_options(auth_http_address=["127.0.0.1:4181"])
        broker.auth = AuthClient(broker.options, self.clock, fetch=AuthServer())
        # A site of its own, whose bearer-secret cache asks this auth client.
        self.http = HTTPClient(broker)

    def drain(self) -> None:
        consumer = Client(self.broker, port=2)
        consumer.send(cmd("AUTH") + sized(b"all"))
        assert consumer.read()[0].type == 0
        consumer.sub(CONTROL_TOPIC, CONTROL_CHANNEL, rdy=1000)
        got = [m.body for m in consumer.messages()]
        assert sorted(got) == sorted(self.bodies), (got, self.bodies)


def shown(method: str, target: str, body: bytes | None, headers: dict[str, str]) -> str:
    return f"{method} {target[:120]} headers={str(headers)[:80]} body={(body or b'')[:30]!r}"


def check_answer(response: Response | None, what: str, auth: bool, granted: bool) -> None:
    """The oracle for one answer (see the module doc)."""
    assert response is not None, f"{what}: no complete answer"
    status = response.status
    if status >= 400 and response.body:  # (the answer to a HEAD has none)
        assert response.is_json, f"{what}: {status} not JSON: {response.headers} {response.body[:200]!r}"
        message = json.loads(response.body)["message"]
        if status >= 500:
            assert (status, message.split(":")[0]) in DOCUMENTED_5XX, f"{what}: {status} {message}"
        if status == 401:
            assert (response.header("WWW-Authenticate") or "").startswith("Bearer"), f"{what}: {response.headers}"
    if auth and not granted and status == 200 and response.is_json:
        assert not _shows_bodies(json.loads(response.body)), \
            f"{what}: bodies without a granted secret: {response.body[:200]!r}"


def _shows_bodies(doc: Any) -> bool:
    """Whether a JSON answer holds messages (a peek's, or mqadmin's per node) or a snapshot's manifest."""
    if not isinstance(doc, dict):
        return False
    nodes = doc.get("nodes") if isinstance(doc.get("nodes"), list) else []
    return bool(doc.get("messages")) or "manifest" in doc or any(
        isinstance(n, dict) and n.get("messages") for n in nodes)


def _granted(authorization: str | None, secrets: tuple[str, ...] = ("all", "control")) -> bool:
    """Whether the header carries one of `secrets`: those granted a subscription (only they may see bodies)."""
    if authorization is None:
        return False
    scheme, _, secret = authorization.partition(" ")
    return scheme.lower() == "bearer" and secret.strip(" \t") in secrets


def fire(h: Harness, method: str, target: str, body: bytes | None, headers: dict[str, str]) -> Response | None:
    """One request to the broker's API, the clock turned until it is answered (a peek in slices)."""
    try:
        return h.http.turned(method, target, body, headers, turns=2000)
    except AssertionError:
        return None


# -- the broker's body endpoints ------------------------------------------------------------------


REFUSALS = {(401, "AUTH_REQUIRED"), (401, "AUTH_FAILED"), (403, "UNAUTHORIZED")}


def _broker_case(auth: bool, requests: list, required: bool = False) -> None:
    """`auth`: auth configured; `required`: --http-auth-required too (then a secret granted everything exists)."""
    with tempfile.TemporaryDirectory() as path, LogWatch() as logs:
        h: Any = RequiredAuthHarness(path, {**ANSWERS, **GRANTS}) if required else AuthHarness(path) if auth \
            else Harness(path)
        granting = ("all", "control", FULL_SECRET) if required else ("all", "control")
        for method, target, body, authorization in requests:
            headers = {} if authorization is None else {"Authorization": authorization}
            what = shown(method, target, body, headers)
            before = h.state() if required else None
            response = fire(h, method, target, body, headers)
            check_answer(response, what, auth, _granted(authorization, granting))
            if required and response is not None and response.status in (401, 403):
                assert h.state() == before, f"{what}: refused {response.status} but changed the state"
                if method != "HEAD":
                    assert error(response) in REFUSALS, f"{what}: {response.status} {response.body[:200]!r}"
            h.check(what)
        assert h.http.site.state.peeks.held == 0
        h.drain()
        logs.check("peek/snapshot requests")


@examples(120)
@given(requests=st.lists(_broker_request(), min_size=1, max_size=4))
def test_fuzzed_body_endpoints_without_auth(requests):
    _broker_case(False, requests)


@examples(120)
@given(requests=st.lists(_broker_request(), min_size=1, max_size=4))
def test_fuzzed_body_endpoints_with_auth(requests):
    _broker_case(True, requests)


@examples(120)
@given(requests=st.lists(_broker_request(), min_size=1, max_size=4))
def test_fuzzed_body_endpoints_with_http_auth_required(requests):
    _broker_case(True, requests, required=True)


def test_every_secret_on_every_body_endpoint():
    """The systematic half: each known secret and each header form on each endpoint, with auth configured."""
    paths = [f"/channel/peek?topic={CONTROL_TOPIC}&channel={CONTROL_CHANNEL}", f"/topic/peek?topic={CONTROL_TOPIC}",
             "/channel/peek?topic=t&channel=c", "/snapshot?out=x"]
    headers = [None, "Basic dXNlcjpwYXNz", "Bearer", *[f"Bearer {s}" for s in SECRETS if s.strip()]]
    requests = [("POST" if p.startswith("/snapshot") else "GET", p, None, a) for p in paths for a in headers]
    _broker_case(True, requests)


# -- mqadmin -------------------------------------------------------------------------------------


class BrokerUpstream:
    """mqadmin's Upstream, its requests sent to the in-process broker's HTTP API (any address is that broker)."""

    def __init__(self, h: Harness) -> None:
        self.h = h

    def _send(self, method: str, url: str, body: bytes, headers) -> tuple[int, bytes]:
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        sent = {k.decode("latin-1"): v[0].decode("latin-1") for k, v in (headers or {}).items()}
        response = fire(self.h, method, target, body if method == "POST" else None, sent)
        if response is None:
            raise UpstreamError(url, "request timed out")
        return response.status, response.body

    def get(self, url: str, headers=None):
        return succeed(self._send("GET", url, b"", headers))

    def get_json(self, url: str, headers=None, max_bytes=None):
        code, body = self._send("GET", url, b"", headers)
        if code != 200:
            return fail(UpstreamError(url, f"got response {code}", code, body))
        if max_bytes is not None and len(body) > max_bytes:
            return fail(UpstreamError(url, f"answer larger than {max_bytes} bytes"))
        return succeed(json.loads(body))

    def post(self, url: str, body: bytes = b"", content_type: bytes = b"", timeout=None, headers=None):
        code, answer = self._send("POST", url, body, headers)
        if not 200 <= code < 300:
            return fail(UpstreamError(url, f"got response {code}", code, answer))
        return succeed((code, answer))


def admin_site(h: Harness, admin_users: list[str]) -> AdminSite:
    flags: dict[str, Any] = {"nsqd-http-address": ["127.0.0.1:4151"], "admin-user": admin_users}
    settings = resolve(MQADMIN_OPTIONS, flags)
    upstream = BrokerUpstream(h)
    cluster = Cluster(upstream, [], settings.nsqd_http_address)
    admin = Admin(settings, h.clock, upstream=upstream, cluster=cluster,
                  history=History(h.clock, 5.0, 60.0, sampler(cluster)))
    return AdminSite(admin)


def admin_request(site: AdminSite, method: str, target: str, body: bytes | None,
                  headers: dict[str, str]) -> Response | None:
    addr = IPv4Address("TCP", "127.0.0.1", 43000)
    proto = site.buildProtocol(addr)
    transport = StringTransport(peerAddress=addr)
    proto.makeConnection(transport)
    lines = [f"{method} {target} HTTP/1.1", "Host: admin"] + [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {len(body or b'')}")
    proto.dataReceived(("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b""))
    response = parse_response(transport.value(), head=method == "HEAD")
    proto.connectionLost(Failure(ConnectionDone()))
    return response


def _admin_case(auth: bool, admin_users: list[str], requests: list) -> None:
    with tempfile.TemporaryDirectory() as path, LogWatch() as logs:
        h = AuthHarness(path) if auth else Harness(path)
        site = admin_site(h, admin_users)
        for method, target, body, authorization, user in requests:
            target, body = spare_control(method, target, body)
            headers = {} if authorization is None else {"Authorization": authorization}
            if user is not None:
                headers["X-Forwarded-User"] = user
            what = shown(method, target, body, headers)
            response = admin_request(site, method, target, body, headers)
            shows_bodies = target.startswith(("/api/peek", "/api/snapshot"))
            check_answer(response, what, auth and shows_bodies, _granted(authorization))
            h.check(what)
        assert h.http.site.state.peeks.held == 0
        h.drain()
        # mqadmin logs an action no broker or lookupd could do as nsqadmin does (an error, no traceback).
        logs.events = [e for e in logs.events if "log_failure" in e or e.get("log_namespace") != "mqd.admin.actions"]
        logs.check("mqadmin requests")


@examples(100)
@given(requests=st.lists(fuzzed_admin_request(_authorization), min_size=1, max_size=4), auth=st.booleans(),
       admin_users=st.sampled_from([[], ["alice"]]))
def test_fuzzed_mqadmin_api(requests, auth, admin_users):
    _admin_case(auth, admin_users, requests)


def test_every_mqadmin_path_with_every_method():
    """The systematic half: each path with each method, a body and a secret, with auth configured."""
    requests = [(method, path, b'{"topic": "zz_other", "action": "pause"}', "Bearer all", None)
                for path in ADMIN_PATHS for method in ("GET", "POST", "DELETE", "PUT")]
    _admin_case(True, [], requests)


# -- real processes --------------------------------------------------------------------------------


def _raw(address: str, method: str, target: str, authorization: bytes | None) -> tuple[int, bytes, bytes]:
    """One request written by hand (any header bytes): (status, head, body); status 0 if none came."""
    host, port = address.rsplit(":", 1)
    lines = [f"{method} {target} HTTP/1.1".encode("utf-8", "surrogateescape"), b"Host: x", b"Connection: close"]
    if authorization is not None:
        lines.append(b"Authorization: " + authorization)
    if method in ("POST", "PUT", "DELETE"):
        lines.append(b"Content-Length: 0")
    with socket.create_connection((host, int(port)), timeout=15) as s:
        s.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    return (int(head.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0), head, body


def test_random_requests_to_a_real_broker_with_auth_and_its_mqadmin(start_broker, tmp_path):
    """A few hundred requests over sockets (header bytes of any kind), then the log and a granted client."""
    server = AuthServer_(tmp_path)
    server.answers["all"] = auth_grant(SUBSCRIBE_ALL, PUBLISH_ALL)
    try:
        broker = start_broker(f"--auth-http-address={server.address}", "--broadcast-address=127.0.0.1")
        admin = AdminProcess(tmp_path / "admin", [f"--nsqd-http-address={broker.http_address}"]).start()
        try:
            rng = random.Random(int(os.environ.get("MQD_FUZZ_SEED", "1")))
            count = EXAMPLES_OVERRIDE or 150
            headers = [None, b"Bearer all", b"Bearer nope", b"Bearer", b"Basic eA==", b"\xff\xfe", b"Bearer \x80",
                       b"Bearer " + b"a" * 8000, b"bearer all", b"Bearer all, Bearer all"]
            # (target, the method it serves)
            targets = [(f"/channel/peek?topic={CONTROL_TOPIC}&channel={CONTROL_CHANNEL}", "GET"),
                       (f"/topic/peek?topic={CONTROL_TOPIC}&max_body=3", "GET"), ("/snapshot", "POST"),
                       ("/channel/peek?topic=%ff", "GET"), ("/channel/peek?topic=t&channel=c&n=0", "GET"),
                       ("/topic/peek?topic=t&state=x&max_body=-1", "GET")]
            admin_targets = [(f"/api/peek/{CONTROL_TOPIC}/{CONTROL_CHANNEL}?max_body=2", "GET"),
                             (f"/api/snapshot/127.0.0.1:{broker.http_port}", "POST"),
                             ("/api/nodes/127.0.0.1:1", "DELETE"), ("/api/peek/%ff/c", "GET"),
                             ("/api/topics/%ff", "GET")]
            assert _raw(broker.http_address, "POST", f"/topic/create?topic={CONTROL_TOPIC}", None)[0] == 200
            assert _raw(broker.http_address, "POST", f"/channel/create?topic={CONTROL_TOPIC}&channel="
                        f"{CONTROL_CHANNEL}", None)[0] == 200
            problems = []
            for _ in range(count):
                to_admin = rng.random() < 0.3
                address = admin.http_address if to_admin else broker.http_address
                target, method = rng.choice(admin_targets if to_admin else targets)
                if rng.random() < 0.3:
                    method = rng.choice(["GET", "POST", "DELETE", "HEAD", "PUT"])
                if to_admin and target.startswith("/api/topics") and method in ("POST", "DELETE", "PUT"):
                    method = "GET"
                status, head, body = _raw(address, method, target, rng.choice(headers))
                if status == 0 or status >= 500 and (status, _message(body)) not in DOCUMENTED_5XX:
                    problems.append(f"{method} {address} {target}: {status} {body[:200]!r}")
            assert not problems, "\n".join(problems[:10])
            # A granted client is still served, over TCP and HTTP.
            with RawConn(broker) as conn:
                assert identify_auth(conn, b"all")[0] == FRAME_RESPONSE
                conn.send(command(f"PUB {CONTROL_TOPIC}", b"control"))
                assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
            status, _, body = _raw(broker.http_address, "GET", f"/channel/peek?topic={CONTROL_TOPIC}&channel="
                                   f"{CONTROL_CHANNEL}", b"Bearer all")
            assert status == 200 and json.loads(body)["messages"][0]["body_text"] == "control"
            for process in (broker, admin):
                assert "Traceback" not in process.log() and "Unhandled" not in process.log(), process.describe()
        finally:
            admin.stop()
    finally:
        server.close()


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["message"].split(":")[0]
    except (ValueError, KeyError, TypeError):
        return ""
