"""The callers' side of `--http-auth-required`: the secret sent as `Authorization: Bearer`, refusals worded.

In process: the lookupd poller's client (`BearerHTTP`) against a
twisted.web Resource through treq's StubTreq; mqadmin's Upstream and
Cluster against a real twisted.web server on 127.0.0.1 that answers as a
broker with `--http-auth-required` does; mqadmin's API over a fake
cluster whose brokers refuse; and the option plumbing (a secret file, the
tools' environment variable, a secret never shown). The processes
(mqadmin, the tools) are tests/integration/test_http_auth_callers.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import pytest_twisted
from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.web.resource import Resource

from mqd.admin import actions, api
from mqd.admin.endpoint import Admin
from mqd.admin.tap import auth_secret, build_service
from mqd.admin.web import AdminSite
from mqd.clusterinfo.bearer import (
    BearerHTTP,
    HTTPRefusedError,
    bearer_headers,
    check_secret,
    node_of,
    read_secret_file,
    refusal_text,
)
from mqd.clusterinfo.cluster import Cluster
from mqd.clusterinfo.upstream import Authorized, Upstream, UpstreamError, go_line
from mqd.options import MQADMIN_OPTIONS, ConfigError, resolve
from mqd.tools.flags import ToolError, http_auth_secret, refused_line
from tests.support.admin_fakes import CannedUpstream
from tests.support.http_client import HTTPClient, error

# -- the secret and its wording -----------------------------------------------------------------


def test_a_secret_goes_as_one_bearer_header_and_must_be_printable_ascii_without_spaces():
    assert bearer_headers("s3cr=t,x") == {b"Authorization": [b"Bearer s3cr=t,x"]}
    assert bearer_headers("") == {}
    for bad in ("two words", "tab\there", "caf\u00e9", "new\nline"):
        with pytest.raises(ValueError, match="printable ASCII without spaces") as caught:
            check_secret(bad, "--http-client-auth-secret")
        assert bad not in str(caught.value)  # the secret is never in the message


def test_a_secret_file_is_read_without_its_newline(tmp_path):
    path = tmp_path / "secret"
    path.write_text("good\n")
    assert read_secret_file(str(path), "--x") == "good"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret_file(str(path), "--x")
    with pytest.raises(ValueError, match="No such file"):
        read_secret_file(str(tmp_path / "missing"), "--x")


@pytest.mark.parametrize(("url", "node"), [
    ("http://10.0.0.1:4151/stats?format=json", "10.0.0.1:4151"),
    ("https://broker.example/stats", "broker.example:443"),
    ("http://[::1]:4161/lookup", "[::1]:4161"),
])
def test_a_refusal_names_the_node_and_the_answer(url, node):
    assert refusal_text("nsqd", url, 401, b'{"message":"AUTH_REQUIRED"}') == \
        f"nsqd {node} answered 401 Unauthorized (AUTH_REQUIRED)"
    assert refusal_text("nsqd", url, 403, b"not json") == f"nsqd {node} answered 403 Forbidden"
    assert node_of(url) == node


@pytest.mark.parametrize(("code", "message", "hint"), [
    (401, "AUTH_REQUIRED", "it requires a secret (--http-auth-secret)"),
    (401, "AUTH_FAILED", "the auth server refused the secret"),
    (403, "UNAUTHORIZED", "the secret has no grant for this request"),
])
def test_the_tools_line_for_a_refusal(code, message, hint):
    refused = HTTPRefusedError("nsqlookupd", "http://127.0.0.1:4161/lookup?topic=t", code,
                               json.dumps({"message": message}).encode())
    phrase = "Unauthorized" if code == 401 else "Forbidden"
    assert refused_line(refused) == f"ERROR: nsqlookupd 127.0.0.1:4161 answered {code} {phrase} ({message}): {hint}"


def test_the_tools_secret_is_the_flag_else_the_environment(monkeypatch):
    monkeypatch.setenv("MQ_HTTP_AUTH_SECRET", "from-env\n")
    assert http_auth_secret(SimpleNamespace(http_auth_secret=None)) == "from-env"
    assert http_auth_secret(SimpleNamespace(http_auth_secret="flag")) == "flag"
    assert http_auth_secret(SimpleNamespace(http_auth_secret="")) == ""  # given empty: none
    monkeypatch.delenv("MQ_HTTP_AUTH_SECRET")
    assert http_auth_secret(SimpleNamespace(http_auth_secret=None)) == ""
    with pytest.raises(ToolError, match="--http-auth-secret: an HTTP auth secret must be printable"):
        http_auth_secret(SimpleNamespace(http_auth_secret="a b"))


def test_an_upstream_refusal_is_quoted_naming_the_node():
    e = UpstreamError("http://10.0.0.1:4151/stats", "got response", 401, b'{"message":"AUTH_REQUIRED"}')
    assert go_line(e, "nsqd") == \
        'nsqd 10.0.0.1:4151: got response 401 Unauthorized "{\\"message\\":\\"AUTH_REQUIRED\\"}"'
    assert str(e.refusal("nsqd")) == "nsqd 10.0.0.1:4151 answered 401 Unauthorized (AUTH_REQUIRED)"
    other = UpstreamError("http://10.0.0.1:4151/stats", "got response", 404, b'{"message":"NOT_FOUND"}')
    assert go_line(other, "nsqd") == other.go_text and other.refusal("nsqd") is None


# -- the lookupd poller's client ------------------------------------------------------------------


class Guarded(Resource):
    """A lookupd with --http-auth-required: only `Bearer good` is let in; records the headers."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bytes | None] = []

    def render_GET(self, request):
        auth = request.getHeader(b"authorization")
        self.seen.append(auth)
        if auth == b"Bearer good":
            return b'{"channels":[],"producers":[]}'
        if auth == b"Bearer limited":
            request.setResponseCode(403)
            return b'{"message":"UNAUTHORIZED"}'
        request.setResponseCode(401)
        return b'{"message":"AUTH_REQUIRED"}' if auth is None else b'{"message":"AUTH_FAILED"}'


@pytest.mark.parametrize(("secret", "expected"), [
    ("", "nsqlookupd 127.0.0.1:4161 answered 401 Unauthorized (AUTH_REQUIRED)"),
    ("wrong", "nsqlookupd 127.0.0.1:4161 answered 401 Unauthorized (AUTH_FAILED)"),
    ("limited", "nsqlookupd 127.0.0.1:4161 answered 403 Forbidden (UNAUTHORIZED)"),
])
def test_the_poller_client_reports_a_refusal_and_fails_the_query(secret, expected):
    lookupd = Guarded()
    refusals: list[HTTPRefusedError] = []
    client = BearerHTTP(secret, refusals.append, http=StubTreq(lookupd))
    d = client.get("http://127.0.0.1:4161/lookup?topic=t", headers={b"Accept": [b"x"]})
    failure = []
    d.addErrback(failure.append)
    assert [str(e) for e in refusals] == [expected]
    assert failure and failure[0].check(HTTPRefusedError) and str(failure[0].value) == expected
    assert lookupd.seen == [f"Bearer {secret}".encode() if secret else None]


def test_the_poller_client_sends_the_secret_and_passes_an_answer_on():
    lookupd = Guarded()
    client = BearerHTTP("good", http=StubTreq(lookupd))
    answers = []
    client.get("http://127.0.0.1:4161/lookup?topic=t").addCallback(answers.append)
    assert [r.code for r in answers] == [200]
    assert lookupd.seen == [b"Bearer good"]


# -- mqadmin's client against a real server -------------------------------------------------------


@pytest.fixture
def guarded():
    from tests.support.guarded_http import GuardedNode

    node = GuardedNode()
    yield node
    node.close()


def upstream_for(address: str) -> Upstream:
    from twisted.internet import reactor

    return Upstream(reactor, resolve(MQADMIN_OPTIONS, {"lookupd-http-address": [address]}))


@pytest_twisted.inlineCallbacks
def test_authorized_sends_the_secret_and_a_callers_own_replaces_it(guarded):
    upstream = upstream_for(guarded.address)
    client = Authorized(upstream, bearer_headers("good"))
    url = f"http://{guarded.address}/topics"
    try:
        assert (yield client.get_json(url)) == {"topics": ["t"]}
        user = Authorized(client, {b"Authorization": [b"Bearer limited"]})
        with pytest.raises(UpstreamError) as caught:
            yield user.get_json(url)
        assert caught.value.code == 403
        yield upstream.get(url)  # the bare client (notifications) sends none
        assert guarded.authorizations("/topics") == ["Bearer good", "Bearer limited", None]
    finally:
        yield upstream.close()


@pytest_twisted.inlineCallbacks
def test_a_cluster_query_refused_is_an_error_naming_the_node(guarded):
    upstream = upstream_for(guarded.address)
    cluster = Cluster(Authorized(upstream, bearer_headers("limited")), [guarded.address], [])
    try:
        producers, errors = yield cluster.topic_producers("t")
        assert producers is None
        [e] = errors
        assert e.code == 403
        assert e.go == (f'nsqlookupd {guarded.address}: got response 403 Forbidden '
                        '"{\\"message\\":\\"UNAUTHORIZED\\"}"')
        assert str(e.refusal) == f"nsqlookupd {guarded.address} answered 403 Forbidden (UNAUTHORIZED)"
        good = cluster.using(Authorized(upstream, bearer_headers("good")))
        producers, errors = yield good.topic_producers("t")
        assert errors == [] and len(producers) == 1
        assert good.seen is cluster.seen  # what one request learns, the others see
    finally:
        yield upstream.close()


# -- mqadmin's API: refusals as such --------------------------------------------------------------


class Refusing(CannedUpstream):
    """Every lookupd and broker answers `code`, unless the request carries `Bearer good`."""

    def __init__(self, code: int, message: str) -> None:
        self.answer = code, json.dumps({"message": message}, separators=(",", ":")).encode()
        self.sent: list = []

    def get_json(self, url: str, headers=None, max_bytes=None):
        self.sent.append((headers or {}).get(b"Authorization"))
        self.good = (headers or {}).get(b"Authorization") == [b"Bearer good"]
        return super().get_json(url, headers, max_bytes)

    def _canned(self, method: str, url: str) -> tuple[int, bytes]:
        if self.good:
            return 200, b'{"topics": ["t"]}'
        return self.answer


class Client(HTTPClient):
    def __init__(self, site) -> None:
        self.site = site


def admin_api(upstream, **flags) -> Client:
    lookupds = ["lk1:4161", "lk2:4161"]
    settings = resolve(MQADMIN_OPTIONS, {"lookupd-http-address": lookupds, **flags})
    admin = Admin(settings, Clock(), upstream=upstream, cluster=Cluster(upstream, lookupds, []))
    return Client(AdminSite(admin, api.routes(admin)))


@pytest.mark.parametrize(("code", "message", "phrase"), [
    (401, "AUTH_REQUIRED", "401 Unauthorized"), (403, "UNAUTHORIZED", "403 Forbidden")])
def test_every_lookupd_refusing_is_their_status_naming_each(code, message, phrase):
    r = admin_api(Refusing(code, message)).get("/api/topics")
    quoted = json.dumps(json.dumps({"message": message}, separators=(",", ":")))
    assert error(r) == (code, "UPSTREAM_ERROR: failed to query any nsqlookupd: "
                              f"nsqlookupd lk1:4161: got response {phrase} {quoted}\n"
                              f"nsqlookupd lk2:4161: got response {phrase} {quoted}")
    # A 401 asks for a bearer secret: the user's, passed on, is what mqadmin would send.
    assert r.header("WWW-Authenticate") == ("Bearer" if code == 401 else None)


@pytest.mark.parametrize(("code", "message", "phrase"), [
    (401, "AUTH_FAILED", "401 Unauthorized"), (403, "UNAUTHORIZED", "403 Forbidden")])
@pytest.mark.parametrize(("method", "path", "prefix"), [
    ("GET", "/api/peek/t/c", "failed to query any nsqlookupd: "), ("POST", "/api/topics", "")])
def test_a_peek_or_an_action_every_lookupd_refused_names_them_as_every_page_does(
        code, message, phrase, method, path, prefix):
    upstream = Refusing(code, message)
    upstream.good = False
    client = admin_api(upstream)
    client.site = AdminSite(client.site.admin, actions.routes(client.site.admin))
    r = client.request(method, path, b'{"topic": "t"}' if method == "POST" else None)
    quoted = json.dumps(json.dumps({"message": message}, separators=(",", ":")))
    assert error(r) == (code, f"UPSTREAM_ERROR: {prefix}"
                              f"nsqlookupd lk1:4161: got response {phrase} {quoted}\n"
                              f"nsqlookupd lk2:4161: got response {phrase} {quoted}")
    assert r.header("WWW-Authenticate") == ("Bearer" if code == 401 else None)


def test_a_users_bearer_is_passed_on_and_gets_the_page():
    upstream = Refusing(401, "AUTH_REQUIRED")
    r = admin_api(upstream).get("/api/topics", headers={"Authorization": "Bearer good"})
    assert r.status == 200 and r.json()["topics"] == ["t"]
    assert upstream.sent == [[b"Bearer good"]] * 2


def test_the_secret_is_no_config_option_and_never_in_the_settings_repr(tmp_path):
    settings = resolve(MQADMIN_OPTIONS, {"lookupd-http-address": ["lk1:4161"],
                                         "http-client-auth-secret": "top-secret"})
    assert "top-secret" not in repr(settings)
    client = admin_api(CannedUpstream(), **{"http-client-auth-secret": "top-secret"})
    client.site = AdminSite(client.site.admin, actions.routes(client.site.admin))
    r = client.get("/config/http_client_auth_secret")
    assert error(r) == (400, "INVALID_OPTION")
    assert b"top-secret" not in r.body


def test_the_secret_option_or_its_file_not_both(tmp_path):
    path = tmp_path / "secret"
    path.write_text("from-file\n")

    def settings(**flags):
        return resolve(MQADMIN_OPTIONS, {"lookupd-http-address": ["lk1:4161"], **flags})

    assert auth_secret(settings()) == ""
    assert auth_secret(settings(**{"http-client-auth-secret": "flag"})) == "flag"
    assert auth_secret(settings(**{"http-client-auth-secret-file": str(path)})) == "from-file"
    with pytest.raises(ConfigError, match="not both"):
        auth_secret(settings(**{"http-client-auth-secret": "flag", "http-client-auth-secret-file": str(path)}))
    with pytest.raises(ConfigError, match="--http-client-auth-secret: an HTTP auth secret must be"):
        auth_secret(settings(**{"http-client-auth-secret": "with space"}))


def test_brokers_get_the_secret_and_the_notification_endpoint_never():
    settings = resolve(MQADMIN_OPTIONS, {"lookupd-http-address": ["lk1:4161"],
                                         "http-client-auth-secret": "good",
                                         "notification-http-endpoint": "http://hooks.example/x"})
    service = build_service(settings, Clock())
    admin = service.admin
    assert isinstance(admin.upstream, Authorized)
    assert admin.upstream.headers == {b"Authorization": [b"Bearer good"]}
    assert admin.cluster.upstream is admin.upstream
    assert isinstance(admin.notifier.upstream, Upstream)  # the bare client: no Authorization


# -- the Spark stream source's lookupd queries (its feed, without Spark) ---------------------------


@pytest_twisted.inlineCallbacks
def test_the_stream_sources_lookupd_queries_carry_auth_secret_and_a_refusal_fails_it(guarded, tmp_path):
    from twisted.internet import reactor, task

    from spark_bridge.stream_source import ChannelFeed, TopicStreamReader
    from spark_bridge.stream_wal import WalDirectory

    reader = TopicStreamReader({"topic": "t", "channel": "c", "lookupd": guarded.address,
                                "checkpointLocation": str(tmp_path), "auth_secret": "limited"})
    feed = ChannelFeed("t", "c", reader.nsqd, reader.lookupd, reader.config, 1,
                       WalDirectory(str(tmp_path), "t", "c"), reader.confirm_after, reader.retention,
                       clock=reactor)
    feed.start()
    try:
        for _ in range(200):
            if feed.fatal:
                break
            yield task.deferLater(reactor, 0.02, lambda: None)
        assert feed.fatal == (f"mqd: nsqlookupd {guarded.address} answered 403 Forbidden (UNAUTHORIZED): "
                              "the secret has no grant for this request")
        assert guarded.authorizations("/lookup")[0] == "Bearer limited"
    finally:
        yield feed.stop()
