"""mqadmin's options, routing, base path, pages and static files, and its twistd entry.

The site runs in-process (twisted.web over a StringTransport, on a Clock)
with a small fake API route table, so routing is checked on its own: the
API modules have their own tests.
"""

from __future__ import annotations

import pytest
from twisted.application.service import IServiceMaker
from twisted.internet import _producer_helpers
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Cooperator
from twisted.internet.testing import MemoryReactorClock
from twisted.plugin import getPlugins
from twisted.python import usage
from twisted.python.failure import Failure

from mqd.admin import tap
from mqd.admin.endpoint import Admin, AdminEndpoint, ApiError
from mqd.admin.web import STATIC_DIR, AdminSite, PatternRouter, merge_routes
from mqd.options import MQADMIN_OPTIONS, ConfigError, resolve
from tests.support.http_client import HTTPClient, error, parse_response

PAGE = b'<!doctype html><base href="{{BASE_PATH}}"><script>const BASE = "{{BASE_PATH}}";</script>'


def write(tmp_path, text: str, name="mqadmin.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def admin_settings(**flags):
    flags.setdefault("nsqd-http-address", ["127.0.0.1:4151"])
    return resolve(MQADMIN_OPTIONS, flags)


# -- fake API -----------------------------------------------------------------------------------


class Echo(AdminEndpoint):
    """Answers what the router gave it: which route, which parameters."""

    def __init__(self, admin, name: str) -> None:
        super().__init__(admin)
        self.name = name

    def handle_GET(self, request, params):
        return {"route": self.name, "params": dict(params)}


class Act(AdminEndpoint):
    """The write side of a route another endpoint reads (as actions.py beside api.py)."""

    def handle_POST(self, request, params):
        return {"route": "act", "params": dict(params)}

    def handle_DELETE(self, request, params):
        raise ApiError(403, "FORBIDDEN")


def fake_routes(admin) -> dict:
    read = {p: Echo(admin, p) for p in ("/api/topics", "/api/topics/:topic",
                                        "/api/topics/:topic/:channel", "/api/nodes/:node")}
    write_side = {"/api/topics/:topic": Act(admin), "/api/topics/:topic/:channel": Act(admin)}
    return merge_routes(read, write_side)


@pytest.fixture
def static_dir(tmp_path):
    root = tmp_path / "static"
    (root / "vendor").mkdir(parents=True)
    (root / "index.html").write_bytes(PAGE)
    (root / "app.js").write_text("export const x = 1;\n")
    (root / "vendor" / "lib.css").write_text("body{}\n")
    (tmp_path / "secret.txt").write_text("outside")
    return str(root)


class AdminClient(HTTPClient):
    """The in-process HTTP client of tests/support/http_client.py, on an AdminSite.

    A static file is written by twisted.web's pull producer, which the
    reactor's cooperator drives; here a cooperator on the test's clock
    does, and the clock is turned until the answer is complete.
    """

    def __init__(self, site, clock) -> None:
        self.site = site
        self.clock = clock

    def request(self, method, path, body=None, headers=None):
        transport = self.send(method, path, body, headers)
        for _ in range(100):
            response = parse_response(transport.value(), head=method == "HEAD")
            if response is not None:
                break
            self.clock.advance(0)
        assert response is not None, "no complete response"
        transport.protocol.connectionLost(Failure(ConnectionDone()))
        return response


@pytest.fixture(autouse=True)
def cooperator(clock, monkeypatch):
    coop = Cooperator(scheduler=lambda step: clock.callLater(0, step))
    monkeypatch.setattr(_producer_helpers, "cooperate", coop.cooperate)
    return coop


@pytest.fixture
def site(clock, static_dir):
    def make(base_path="/", routes=fake_routes, directory=static_dir):
        admin = Admin(admin_settings(**{"base-path": base_path}), clock)
        return AdminClient(AdminSite(admin, routes(admin), static_dir=directory), clock)

    return make


@pytest.fixture
def http(site):
    return site()


# -- options ------------------------------------------------------------------------------------


def test_defaults_are_nsqadmins():
    s = resolve(MQADMIN_OPTIONS, {})
    assert s.http_address == "0.0.0.0:4171"
    assert s.base_path == "/"
    assert s.lookupd_http_address == [] and s.nsqd_http_address == []
    assert s.notification_http_endpoint == ""
    assert s.allow_config_from_cidr == "127.0.0.1/8"
    assert (s.http_client_connect_timeout, s.http_client_request_timeout) == (2.0, 5.0)
    assert s.http_client_tls_insecure_skip_verify is False
    assert s.http_client_tls_root_ca_file == s.http_client_tls_cert == s.http_client_tls_key == ""
    assert s.acl_http_header == "X-Forwarded-User"
    assert s.admin_user == []
    assert s.log_level == "info"
    assert (s.stats_interval, s.stats_history) == (5.0, 900.0)


def test_flags_repeatable_and_go_style():
    o = tap.Options()
    o.parseOptions(["--lookupd-http-address=10.0.0.1:4161", "-lookupd-http-address", "10.0.0.2:4161",
                    "--admin-user=alice", "--admin-user", "bob", "-base-path=/admin/",
                    "--http-client-tls-insecure-skip-verify", "--stats-interval=2s"])
    s = resolve(MQADMIN_OPTIONS, o.flag_values())
    assert s.lookupd_http_address == ["10.0.0.1:4161", "10.0.0.2:4161"]
    assert s.admin_user == ["alice", "bob"]
    assert s.base_path == "/admin"
    assert s.http_client_tls_insecure_skip_verify is True
    assert s.stats_interval == 2.0


@pytest.mark.parametrize("key", ["lookupd-http-address", "lookupd_http_address",
                                 "nsqlookupd_http_addresses"])
def test_yaml_lookupd_key_spellings(tmp_path, key):
    path = write(tmp_path, f"{key}:\n  - 10.0.0.1:4161\n  - 10.0.0.2:4161\n")
    assert resolve(MQADMIN_OPTIONS, {}, path).lookupd_http_address == ["10.0.0.1:4161", "10.0.0.2:4161"]


def test_yaml_nsqadmin_cfg_names(tmp_path):
    path = write(tmp_path, 'nsqd_http_addresses: ["10.0.0.1:4151"]\nadmin_users: [alice]\n'
                           "acl_http_header: X-User\nhttp_client_request_timeout: 1m\n")
    s = resolve(MQADMIN_OPTIONS, {}, path)
    assert s.nsqd_http_address == ["10.0.0.1:4151"]
    assert s.admin_user == ["alice"]
    assert s.acl_http_header == "X-User"
    assert s.http_client_request_timeout == 60.0


def test_precedence_flag_over_yaml_over_default(tmp_path):
    path = write(tmp_path, "nsqd-http-address: [10.0.0.1:4151, 10.0.0.2:4151]\n"
                           "base-path: /from-file\nstats-history: 5m\n")
    s = resolve(MQADMIN_OPTIONS, {"nsqd-http-address": ["10.0.0.9:4151"], "base-path": "/flag"}, path)
    assert s.nsqd_http_address == ["10.0.0.9:4151"]  # the flag's list replaces the file's
    assert s.base_path == "/flag"
    assert s.stats_history == 300.0  # file
    assert s.stats_interval == 5.0  # default


def test_shipped_config_file_resolves():
    s = resolve(MQADMIN_OPTIONS, {}, "config/mqadmin.yaml")
    assert s.lookupd_http_address == ["127.0.0.1:4161"]
    tap.check_settings(s)


@pytest.mark.parametrize("value, expected", [
    ("", "/"), ("/", "/"), ("admin", "/admin"), ("/admin/", "/admin"),
    ("//a//b/../c/", "/a/c"), ("/a/./b", "/a/b"),
])
def test_base_path_normalized_as_nsqadmin(value, expected):
    assert resolve(MQADMIN_OPTIONS, {"base-path": value}).base_path == expected


@pytest.mark.parametrize("text, key", [
    ('base-path: "/a\\"b"\n', "base-path"),
    ("base-path: /a<b\n", "base-path"),
    ("base-path: /my%20admin\n", "base-path"),
    ("allow-config-from-cidr: 127.0.0.1/99\n", "allow-config-from-cidr"),
    ("http-client-connect-timeout: 0s\n", "http-client-connect-timeout"),
    ("stats-interval: soon\n", "stats-interval"),
    ("lookupd-http-address: [localhost]\n", "lookupd-http-address"),
    ("nsqd_http_addresses: [10.0.0.1:99999]\n", "nsqd_http_addresses"),
    ("notification-http-endpoint: example.com/hook\n", "notification-http-endpoint"),
    ("http-client-tls-insecure-skip-verify: maybe\n", "http-client-tls-insecure-skip-verify"),
    ("graphite-address: http://g\n", None),
])
def test_bad_yaml_values_name_the_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        resolve(MQADMIN_OPTIONS, {}, path)
    message = str(e.value)
    assert message.startswith(f"{path}: ")
    assert (f": {key}: " in message) if key else "unknown option 'graphite-address'" in message


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match=r"^--allow-config-from-cidr: expected a CIDR"):
        resolve(MQADMIN_OPTIONS, {"allow-config-from-cidr": "nope"})


def test_urls_accepted_as_addresses():
    s = resolve(MQADMIN_OPTIONS, {"nsqd-http-address": ["https://10.0.0.1:4152"]})
    assert s.nsqd_http_address == ["https://10.0.0.1:4152"]


@pytest.mark.parametrize("flags, text", [
    ({}, "--nsqd-http-address or --lookupd-http-address required"),
    ({"nsqd-http-address": ["a:1"], "lookupd-http-address": ["b:2"]},
     "use --nsqd-http-address or --lookupd-http-address not both"),
    ({"nsqd-http-address": ["a:1"], "http-client-tls-cert": "c.pem"},
     "--http-client-tls-key must be specified with --http-client-tls-cert"),
    ({"nsqd-http-address": ["a:1"], "http-client-tls-key": "k.pem"},
     "--http-client-tls-cert must be specified with --http-client-tls-key"),
    ({"nsqd-http-address": ["a:1"], "stats-interval": "1m", "stats-history": "30s"},
     "--stats-history (30s) must be at least --stats-interval (60s)"),
])
def test_cross_option_checks_use_nsqadmins_words(flags, text, capsys):
    settings = resolve(MQADMIN_OPTIONS, flags)
    with pytest.raises(ConfigError) as e:
        tap.check_settings(settings)
    assert str(e.value) == text
    # Under twistd: one line on stderr and exit status 1, nothing started.
    with pytest.raises(SystemExit) as stop:
        tap.build_service(settings, MemoryReactorClock())
    assert stop.value.code == 1
    assert capsys.readouterr().err == f"mqadmin: {text}\n"


def test_lookupds_alone_and_brokers_alone_are_fine():
    tap.check_settings(resolve(MQADMIN_OPTIONS, {"lookupd-http-address": ["a:4161"]}))
    tap.check_settings(resolve(MQADMIN_OPTIONS, {"nsqd-http-address": ["a:4151"]}))


def test_twistd_mqadmin_help_lists_the_flags(capsys):
    makers = {m.tapname: m for m in getPlugins(IServiceMaker)}
    maker = makers["mqadmin"]
    assert maker.module == "mqd.admin.tap"
    with pytest.raises(SystemExit) as stop:
        maker.options().parseOptions(["--help"])
    assert stop.value.code == 0
    usage_text = capsys.readouterr().out
    for opt in MQADMIN_OPTIONS:
        assert f"--{opt.name}" in usage_text, opt.name
    assert "--config" in usage_text
    with pytest.raises(usage.UsageError):
        maker.options().parseOptions(["--graphite-address=http://g"])
    # nsqadmin's graphite and statsd flags are accepted (its command lines keep working), to no effect.
    options = maker.options()
    options.parseOptions(["--lookupd-http-address=127.0.0.1:4161", "--graphite-url=http://g",
                          "--proxy-graphite", "--statsd-prefix=nsq.%s", "--log-prefix=[nsqadmin] "])


def test_twistd_mqadmin_makes_the_service(tmp_path):
    path = write(tmp_path, "nsqd-http-address: [127.0.0.1:4151]\nhttp-address: 127.0.0.1:0\n")
    options = tap.Options()
    options.parseOptions(["-c", path, "--base-path=/ops"])
    top = tap.makeService(options)  # built on the global reactor, not started
    settings = top.admin.settings
    assert (settings.base_path, settings.http_address) == ("/ops", "127.0.0.1:0")
    assert settings.nsqd_http_address == ["127.0.0.1:4151"]
    assert [type(s).__name__ for s in top] == ["UpstreamService", "History", "ListeningService"]


# -- the service tree ---------------------------------------------------------------------------


def test_build_service_wires_admin_and_listens():
    reactor = MemoryReactorClock()
    settings = admin_settings(**{"http-address": "127.0.0.1:4171", "stats-interval": "1s"})
    top = tap.build_service(settings, reactor)
    admin = top.admin
    assert admin.settings is settings and admin.reactor is reactor
    assert admin.upstream is not None and admin.cluster is not None and admin.notifier is not None
    assert admin.history in list(top)  # started and stopped with the tree
    top.privilegedStartService()
    top.startService()
    try:
        assert admin.history.running
        [(port, factory, _backlog, interface)] = reactor.tcpServers
        assert (port, interface) == (4171, "127.0.0.1")
        assert isinstance(factory, AdminSite) and factory.admin is admin
        assert "HTTP" in top.ports
    finally:
        top.stopService()
    assert not admin.history.running


def test_unreadable_tls_file_stops_start_up(tmp_path, capsys):
    missing = str(tmp_path / "ca.pem")
    settings = admin_settings(**{"http-client-tls-root-ca-file": missing})
    with pytest.raises(SystemExit) as stop:
        tap.build_service(settings, MemoryReactorClock())
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("mqadmin: ") and missing in err and err.count("\n") == 1


def test_upstream_connections_closed_on_stop():
    top = tap.build_service(admin_settings(), MemoryReactorClock())
    closed = []
    top.admin.upstream.close = lambda: closed.append(True)
    top.startService()
    top.stopService()
    assert closed == [True]


# -- routing --------------------------------------------------------------------------------------


def test_ping_is_plain_ok(http):
    r = http.get("/ping")
    assert (r.status, r.body) == (200, b"OK")
    assert r.header("Content-Type") == "text/plain; charset=utf-8"
    assert not r.v1


def test_static_route(http):
    r = http.get("/api/topics")
    assert r.json() == {"route": "/api/topics", "params": {}}
    assert r.v1


@pytest.mark.parametrize("path, route, params", [
    ("/api/topics/t1", "/api/topics/:topic", {"topic": "t1"}),
    ("/api/topics/t1/c1", "/api/topics/:topic/:channel", {"topic": "t1", "channel": "c1"}),
    ("/api/topics/t%231/c%23ephemeral", "/api/topics/:topic/:channel",
     {"topic": "t#1", "channel": "c#ephemeral"}),
    ("/api/topics/a%20b", "/api/topics/:topic", {"topic": "a b"}),
    ("/api/nodes/10.0.0.1:4151", "/api/nodes/:node", {"node": "10.0.0.1:4151"}),
    ("/api/nodes/%5B::1%5D:4151", "/api/nodes/:node", {"node": "[::1]:4151"}),
    ("/api/topics/t1?inactive=true", "/api/topics/:topic", {"topic": "t1"}),
])
def test_pattern_params_decoded(http, path, route, params):
    r = http.get(path)
    assert r.status == 200
    assert r.json() == {"route": route, "params": params}


def test_methods_from_two_modules_share_a_route(http):
    assert http.post("/api/topics/t1/c1").json() == {"route": "act", "params": {"topic": "t1", "channel": "c1"}}
    assert error(http.request("DELETE", "/api/topics/t1")) == (403, "FORBIDDEN")
    r = http.put("/api/topics/t1")
    assert error(r) == (405, "METHOD_NOT_ALLOWED")
    assert r.header("Allow") == "DELETE, GET, OPTIONS, POST"
    r = http.request("OPTIONS", "/api/topics/t1")
    assert (r.status, r.body, r.header("Allow")) == (200, b"", "DELETE, GET, OPTIONS, POST")


@pytest.mark.parametrize("path", ["/api/nope", "/api/topics/t1/c1/extra", "/api/nodes",
                                  "/api/nodes/", "/favicon.ico", "/static", "/static/"])
def test_unknown_paths_404(http, path):
    assert error(http.get(path)) == (404, "NOT_FOUND")


def test_wrong_method_405(http):
    r = http.post("/api/nodes/n1")
    assert error(r) == (405, "METHOD_NOT_ALLOWED")
    assert r.header("Allow") == "GET, OPTIONS"


@pytest.mark.parametrize("method, path, location, code", [
    ("GET", "/api/topics/t1/", "/api/topics/t1", 301),
    ("GET", "/API/Topics/T1?inactive=true", "/api/topics/T1?inactive=true", 301),
    ("GET", "/api//topics/t1/./c1", "/api/topics/t1/c1", 301),
    ("POST", "/api/topics/t1/c1/", "/api/topics/t1/c1", 307),
    ("GET", "/Topics/abc", "/topics/abc", 301),
    ("GET", "/PING", "/ping", 301),
    ("GET", "/Static/vendor/lib.css", "/static/vendor/lib.css", 301),
])
def test_near_misses_redirect_as_httprouter(http, method, path, location, code):
    r = http.request(method, path)
    assert (r.status, r.header("Location")) == (code, location)


def test_bad_escape_is_400(http):
    r = http.get("/api/topics/%zz")
    assert (r.status, r.body) == (400, b"400 Bad Request")


def test_conflicting_patterns_refused():
    with pytest.raises(ValueError, match="conflicts"):
        PatternRouter({"/api/topics/:topic": object(), "/api/topics/:name": object()})
    with pytest.raises(ValueError, match="bad route"):
        PatternRouter({"/static/*file/x": object()})


def test_method_routed_twice_refused():
    admin = Admin(admin_settings(), None)
    with pytest.raises(ValueError, match="GET /api/topics is routed twice"):
        merge_routes({"/api/topics": Echo(admin, "a")}, {"/api/topics": Echo(admin, "b")})


def test_static_segment_wins_over_parameter(clock, static_dir):
    admin = Admin(admin_settings(), clock)
    routes = {"/api/topics/:topic": Echo(admin, "param"), "/api/topics/special": Echo(admin, "static")}
    http = AdminClient(AdminSite(admin, routes, static_dir=static_dir), clock)
    assert http.get("/api/topics/special").json()["route"] == "static"
    assert http.get("/api/topics/other").json()["route"] == "param"


# -- pages and static files --------------------------------------------------------------------


UI_PATHS = ["/", "/topics", "/topics/t1", "/topics/t1/c1", "/nodes", "/nodes/10.0.0.1:4151",
            "/counter", "/lookup"]


@pytest.mark.parametrize("path", UI_PATHS)
def test_ui_routes_serve_index_with_base_path(http, path):
    r = http.get(path)
    assert r.status == 200
    assert r.header("Content-Type") == "text/html; charset=utf-8"
    assert r.body == PAGE.replace(b"{{BASE_PATH}}", b"/")


def test_static_files(http):
    r = http.get("/static/app.js")
    assert (r.status, r.body) == (200, b"export const x = 1;\n")
    assert r.header("Content-Type").startswith("text/javascript")
    r = http.get("/static/vendor/lib.css")
    assert (r.status, r.body) == (200, b"body{}\n")
    assert r.header("Content-Type").startswith("text/css")


@pytest.mark.parametrize("path", [
    "/static/vendor", "/static/missing.js", "/static/../secret.txt",
    "/static/%2e%2e/secret.txt", "/static/..%2fsecret.txt", "/static/vendor/../../secret.txt",
    "/static/vendor/..%2F..%2Fsecret.txt", "/static/vendor%5C..%5C..%5Csecret.txt",
    "/static/vendor/%00", "/static/./app.js",
])
def test_static_never_lists_nor_escapes(http, path):
    r = http.get(path)
    assert (r.status, r.body) == (404, b"NOT_FOUND")


@pytest.mark.parametrize("path, location", [
    ("/static//etc/passwd", "/static/etc/passwd"),
    ("/static/%2Fetc%2Fpasswd", "/static/etc/passwd"),
    ("/static/vendor/", "/static/vendor"),
])
def test_static_empty_segments_redirected_inside(http, path, location):
    r = http.get(path)
    assert (r.status, r.header("Location")) == (301, location)
    assert http.get(location).status == 404


def test_static_is_get_only(http):
    assert error(http.post("/static/app.js")) == (405, "METHOD_NOT_ALLOWED")


def test_missing_index_is_500(site, tmp_path):
    http = site(directory=str(tmp_path / "nowhere"))
    assert error(http.get("/")) == (500, "INTERNAL_ERROR")


# -- base path -------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["/admin", "admin/", "/admin/"])
def test_everything_under_the_base_path(site, flag):
    http = site(base_path=flag)
    page = PAGE.replace(b"{{BASE_PATH}}", b"/admin/")
    assert http.get("/admin").body == page
    assert http.get("/admin/topics/t1/c1").body == page
    assert http.get("/admin/ping").body == b"OK"
    assert http.get("/admin/static/app.js").body == b"export const x = 1;\n"
    assert http.get("/admin/api/topics/t1").json() == {"route": "/api/topics/:topic",
                                                       "params": {"topic": "t1"}}
    for path in ("/", "/ping", "/api/topics/t1", "/static/app.js", "/topics"):
        assert error(http.get(path)) == (404, "NOT_FOUND"), path


@pytest.mark.parametrize("path, location", [
    ("/admin/", "/admin"),
    ("/admin/?x=1", "/admin?x=1"),
    ("/Admin/api/topics/t1", "/admin/api/topics/t1"),
    ("/admin/nodes/", "/admin/nodes"),
])
def test_base_path_redirects(site, path, location):
    r = site(base_path="/admin").get(path)
    assert (r.status, r.header("Location")) == (301, location)


def test_nested_base_path(site):
    http = site(base_path="/ops/nsq")
    assert http.get("/ops/nsq/counter").body == PAGE.replace(b"{{BASE_PATH}}", b"/ops/nsq/")
    assert error(http.get("/ops/counter")) == (404, "NOT_FOUND")


def test_shipped_index_gets_the_base_path(clock):
    admin = Admin(admin_settings(**{"base-path": "/admin"}), clock)
    http = AdminClient(AdminSite(admin, {}, static_dir=STATIC_DIR), clock)
    r = http.get("/admin/topics")
    assert r.status == 200
    assert b"{{BASE_PATH}}" not in r.body
    assert b'"/admin/"' in r.body


def test_default_route_table_merges_every_module(clock):
    admin = Admin(admin_settings(), clock)
    router = AdminSite(admin).router
    expected = {
        "/api/topics": {"GET", "POST"},
        "/api/topics/t1": {"GET", "POST", "DELETE"},
        "/api/topics/t1/c1": {"GET", "POST", "DELETE"},
        "/api/nodes": {"GET"},
        "/api/nodes/10.0.0.1:4151": {"GET", "DELETE"},
        "/api/counter": {"GET"},
        "/api/health": {"GET"},
        "/api/lookup": {"GET"},
        "/api/history": {"GET"},
        "/api/peek/t1/c1": {"GET"},
        "/api/snapshot/10.0.0.1:4151": {"POST"},
        "/config/log_level": {"GET", "PUT"},
        "/ping": {"GET"},
        "/static/app.js": {"GET"},
        "/nodes/10.0.0.1:4151": {"GET"},
    }
    for path, methods in expected.items():
        endpoint, _ = router.match(path)
        assert set(endpoint.methods) == methods, path
