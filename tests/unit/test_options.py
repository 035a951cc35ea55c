"""Options: flag > YAML > default, durations, config errors, listen addresses, twistd flags."""

from __future__ import annotations

import pytest
from twisted.internet import endpoints
from twisted.internet.testing import MemoryReactor
from twisted.python import usage

from mqd.nsqd.tap import Options
from mqd.options import (
    MQD_OPTIONS,
    ConfigError,
    parse_duration,
    resolve,
    to_endpoint,
    wildcard_port,
)


def write(tmp_path, text: str, name="mqd.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# -- resolve ---------------------------------------------------------------------------------


def test_defaults():
    s = resolve(MQD_OPTIONS, {})
    assert s.mem_queue_size == 10000
    assert s.msg_timeout == 60.0
    assert s.max_msg_timeout == 900.0
    assert s.max_msg_size == 1048576
    assert s.max_body_size == 5242880
    assert s.max_rdy_count == 2500
    assert s.max_req_timeout == 3600.0
    assert s.max_heartbeat_interval == 60.0
    assert s.output_buffer_timeout == 0.25
    assert s.min_output_buffer_timeout == 0.025
    assert s.tcp_address == "0.0.0.0:4150"
    assert s.backend == "lmdb"
    assert s.durable is False
    assert s.sync_every == 2500
    assert s.sync_timeout == 2.0
    assert 0 <= s.node_id <= 1023
    assert s.broadcast_address
    assert s._explicit == frozenset()


def test_precedence_flag_over_yaml_over_default(tmp_path):
    path = write(tmp_path, "mem-queue-size: 5\nmsg_timeout: 250ms\nmax-rdy-count: 10\n")
    s = resolve(MQD_OPTIONS, {"mem-queue-size": "7"}, path)
    assert s.mem_queue_size == 7  # flag
    assert s.msg_timeout == 0.25  # file, underscore spelling
    assert s.max_rdy_count == 10  # file
    assert s.max_msg_size == 1048576  # default
    assert s._explicit == {"mem-queue-size", "msg-timeout", "max-rdy-count"}


def test_none_flag_means_not_given(tmp_path):
    path = write(tmp_path, "mem-queue-size: 5\n")
    assert resolve(MQD_OPTIONS, {"mem-queue-size": None}, path).mem_queue_size == 5


def test_empty_yaml_is_all_defaults(tmp_path):
    path = write(tmp_path, "# nothing here\n")
    assert resolve(MQD_OPTIONS, {}, path).mem_queue_size == 10000


def test_yaml_alias(tmp_path):
    path = write(tmp_path, "id: 42\n")
    assert resolve(MQD_OPTIONS, {}, path).node_id == 42


def test_settings_read_only_and_replace():
    s = resolve(MQD_OPTIONS, {"mem-queue-size": 3})
    with pytest.raises(AttributeError):
        s.mem_queue_size = 4
    t = s.replace(mem_queue_size=4)
    assert (s.mem_queue_size, t.mem_queue_size) == (3, 4)
    assert t.as_dict()["mem_queue_size"] == 4


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("250ms", 0.25),
        ("1m30s", 90.0),
        ("1h", 3600.0),
        ("60s", 60.0),
        ("1.5s", 1.5),
        ("2h45m", 9900.0),
        ("100us", 0.0001),
        ("100µs", 0.0001),
        ("500ns", 5e-7),
        ("0", 0.0),
        (0, 0.0),
        ("-1s", -1.0),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5", "", "abc", "1x", "1s2", True, 5, None, "s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_durations_in_yaml_and_flags(tmp_path):
    path = write(tmp_path, "msg-timeout: 1m30s\nqueue-scan-interval: 250ms\n")
    s = resolve(MQD_OPTIONS, {"max-req-timeout": "2h"}, path)
    assert (s.msg_timeout, s.queue_scan_interval, s.max_req_timeout) == (90.0, 0.25, 7200.0)


def test_bad_yaml(tmp_path):
    path = write(tmp_path, "mem-queue-size: [1, 2\nmsg-timeout: 5s\n")
    with pytest.raises(ConfigError) as e:
        resolve(MQD_OPTIONS, {}, path)
    assert str(e.value).startswith(f"{path}: invalid YAML")
    assert "line" in str(e.value)


def test_yaml_not_a_mapping(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        resolve(MQD_OPTIONS, {}, path)


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as e:
        resolve(MQD_OPTIONS, {}, path)
    assert str(e.value).startswith(f"{path}: cannot read config file")


def test_unknown_key(tmp_path):
    path = write(tmp_path, "mem-queue-size: 5\nmem-queue-sise: 6\n")
    with pytest.raises(ConfigError) as e:
        resolve(MQD_OPTIONS, {}, path)
    assert str(e.value) == f"{path}: unknown option 'mem-queue-sise'"


@pytest.mark.parametrize(
    "text, key",
    [
        ("mem-queue-size: lots\n", "mem-queue-size"),
        ("mem_queue_size: -1\n", "mem_queue_size"),
        ("msg-timeout: 5\n", "msg-timeout"),
        ("snappy: maybe\n", "snappy"),
        ("max-deflate-level: 10\n", "max-deflate-level"),
        ("node-id: 1024\n", "node-id"),
        ("backend: floppy\n", "backend"),
        ("log-level: loud\n", "log-level"),
        ("tcp-address: nonsense\n", "tcp-address"),
        ("queue-scan-dirty-percent: 2\n", "queue-scan-dirty-percent"),
    ],
)
def test_bad_value_names_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        resolve(MQD_OPTIONS, {}, path)
    assert str(e.value).startswith(f"{path}: {key}: ")


def test_bad_flag_value_names_flag():
    with pytest.raises(ConfigError) as e:
        resolve(MQD_OPTIONS, {"mem-queue-size": "x"})
    assert str(e.value) == "--mem-queue-size: expected an integer, got 'x'"


def test_flag_checked_even_when_yaml_is_fine(tmp_path):
    path = write(tmp_path, "max-rdy-count: 10\n")
    with pytest.raises(ConfigError, match="^--max-rdy-count: must be at least 1, got 0$"):
        resolve(MQD_OPTIONS, {"max-rdy-count": "0"}, path)


def test_bool_spellings(tmp_path):
    for text, value in [("true", True), ("false", False), ("yes", True), ("off", False), ("'0'", False)]:
        path = write(tmp_path, f"snappy: {text}\n")
        assert resolve(MQD_OPTIONS, {}, path).snappy is value


# -- to_endpoint ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address, endpoint",
    [
        ("127.0.0.1:4150", "tcp:4150:interface=127.0.0.1"),
        (":4150", "tcp:4150"),
        ("0.0.0.0:4150", "tcp:4150"),
        ("[::1]:4150", "tcp6:4150:interface=\\:\\:1"),
        ("[::]:4150", "tcp6:4150:interface=\\:\\:"),
        ("tcp:4150:interface=127.0.0.1", "tcp:4150:interface=127.0.0.1"),
        ("unix:/tmp/x.sock", "unix:/tmp/x.sock"),
        ("/tmp/x.sock", "unix:/tmp/x.sock"),
        ("./x.sock", "unix:./x.sock"),
        ("127.0.0.1:0", "tcp:0:interface=127.0.0.1"),
    ],
)
def test_to_endpoint(address, endpoint):
    assert to_endpoint(address) == endpoint


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1", "host:port", "[::1]", ""])
def test_to_endpoint_rejects(address):
    with pytest.raises(ValueError):
        to_endpoint(address)


@pytest.mark.parametrize("address, port", [
    (":4150", 4150), ("0.0.0.0:4151", 4151), ("0.0.0.0:0", 0), ("[::]:4152", 4152),
    ("127.0.0.1:4150", None), ("[::1]:4150", None),
    ("tcp:4150", None), ("/tmp/x.sock", None),
])
def test_every_interface_forms_of_nsqd(address, port):
    """The addresses that nsqd listens on with one IPv6 socket taking IPv4 too."""
    assert wildcard_port(address) == port


def test_endpoints_parse_in_twisted():
    reactor = MemoryReactor()
    ep = endpoints.serverFromString(reactor, to_endpoint("127.0.0.1:4150"))
    assert (ep._port, ep._interface) == (4150, "127.0.0.1")
    ep = endpoints.serverFromString(reactor, to_endpoint("[::1]:4150"))
    assert (ep._port, ep._interface) == (4150, "::1")
    ep = endpoints.serverFromString(reactor, to_endpoint(":4150"))
    assert (ep._port, ep._interface) == (4150, "")
    ep = endpoints.serverFromString(reactor, to_endpoint("/tmp/x.sock"))
    assert ep._address == "/tmp/x.sock"


# -- twistd options -------------------------------------------------------------------------------------


def parse(*args: str) -> Options:
    o = Options()
    o.parseOptions(list(args))
    return o


def test_tap_double_dash_with_equals():
    o = parse("--tcp-address=127.0.0.1:4150", "--http-address", "127.0.0.1:4151")
    assert o.flag_values() == {"tcp-address": "127.0.0.1:4150", "http-address": "127.0.0.1:4151"}


def test_tap_go_style_single_dash():
    o = parse("-mem-queue-size=5", "-msg-timeout", "10s")
    assert o.flag_values() == {"mem-queue-size": "5", "msg-timeout": "10s"}


def test_tap_bare_bool_flag():
    assert parse("--snappy").flag_values() == {"snappy": True}
    assert parse("-deflate").flag_values() == {"deflate": True}


@pytest.mark.parametrize("arg", ["--snappy=false", "-snappy=false", "--snappy=0", "--snappy=off"])
def test_tap_bool_flag_false(arg):
    assert parse(arg).flag_values() == {"snappy": False}


def test_tap_bool_flag_true_with_value():
    assert parse("--snappy=true").flag_values() == {"snappy": True}


def test_tap_nothing_given():
    assert parse().flag_values() == {}


def test_tap_unknown_flag():
    with pytest.raises(usage.UsageError):
        parse("--no-such-flag=1")


def test_tap_config_file_and_resolve(tmp_path):
    path = write(tmp_path, "mem-queue-size: 5\nsnappy: true\nmax-rdy-count: 50\n")
    o = parse("-c", path, "--mem-queue-size=9", "--snappy=false")
    assert o["config"] == path
    s = resolve(MQD_OPTIONS, o.flag_values(), o["config"])
    assert (s.mem_queue_size, s.snappy, s.max_rdy_count) == (9, False, 50)


def test_tap_long_config_go_style(tmp_path):
    path = write(tmp_path, "mem-queue-size: 5\n")
    o = parse(f"-config={path}")
    assert o["config"] == path


@pytest.mark.parametrize("text", ["-", "+", "--1s", "+-1s", " - "])
def test_a_duration_with_a_sign_but_no_number_or_two_signs_is_refused(text):
    """Go's time.ParseDuration refuses these; a flag that took them would mean 0."""
    from mqd.options import parse_duration

    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("table_name", ["MQD_OPTIONS", "LOOKUPD_OPTIONS"])
def test_http_auth_required_is_off_by_default_and_needs_an_auth_server(tmp_path, table_name):
    import mqd.options as options

    table = getattr(options, table_name)
    assert resolve(table, {}).http_auth_required is False
    options.check_http_auth(resolve(table, {}))
    with pytest.raises(ConfigError, match="--http-auth-required needs --auth-http-address"):
        options.check_http_auth(resolve(table, {"http-auth-required": True}))
    path = write(tmp_path, "http_auth_required: true\nauth_http_address: ['127.0.0.1:4181']\n")
    s = resolve(table, {}, path)
    assert (s.http_auth_required, s.auth_http_address) == (True, ["127.0.0.1:4181"])
    options.check_http_auth(s)


def test_tap_http_auth_required_flag():
    assert parse("--http-auth-required").flag_values() == {"http-auth-required": True}


@pytest.mark.parametrize("program", ["mqd", "mqlookupd"])
def test_a_daemon_with_http_auth_required_and_no_auth_server_does_not_start(program, capsys, tmp_path):
    import mqd.options as options
    from mqd.lookup import tap as lookupd_tap
    from mqd.nsqd import tap as broker_tap

    table, build = ((options.MQD_OPTIONS, broker_tap.build_service) if program == "mqd"
                    else (options.LOOKUPD_OPTIONS, lookupd_tap.build_service))
    settings = resolve(table, {"http-auth-required": True, "data-path": str(tmp_path)}
                       if program == "mqd" else {"http-auth-required": True})
    with pytest.raises(SystemExit) as stopped:
        build(settings, MemoryReactor())
    assert stopped.value.code == 1
    assert f"{program}: --http-auth-required needs --auth-http-address" in capsys.readouterr().err


# -- the broker's secret for lookupds (--http-client-auth-secret) ------------------------------


def test_the_broker_takes_the_lookupd_secret_from_a_flag_the_yaml_or_a_file(tmp_path):
    from mqd.options import http_client_auth_secret

    assert http_client_auth_secret(resolve(MQD_OPTIONS, {})) == ""
    assert parse("--http-client-auth-secret=s3cret").flag_values() == {"http-client-auth-secret": "s3cret"}
    assert http_client_auth_secret(resolve(MQD_OPTIONS, {"http-client-auth-secret": "s3cret"})) == "s3cret"
    assert http_client_auth_secret(resolve(MQD_OPTIONS, {}, write(tmp_path, "http_client_auth_secret: y4ml\n"))) == "y4ml"
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file\n", encoding="ascii")
    path = write(tmp_path, f"http_client_auth_secret_file: {secret_file}\n")
    assert http_client_auth_secret(resolve(MQD_OPTIONS, {}, path)) == "from-file"
    assert "s3cret" not in repr(resolve(MQD_OPTIONS, {"http-client-auth-secret": "s3cret"}))


@pytest.mark.parametrize("given, message", [
    ({"http-client-auth-secret": "s3cret", "http-client-auth-secret-file": "FILE"},
     "use --http-client-auth-secret or --http-client-auth-secret-file not both"),
    ({"http-client-auth-secret": "s3cret with space"},
     "--http-client-auth-secret: an HTTP auth secret must be printable ASCII without spaces"),
    ({"http-client-auth-secret-file": "MISSING"}, "--http-client-auth-secret-file MISSING: No such file"),
    ({"http-client-auth-secret-file": "EMPTY"}, "--http-client-auth-secret-file EMPTY: the file is empty"),
])
def test_an_unusable_lookupd_secret_stops_the_broker_with_one_line(capsys, tmp_path, given, message):
    from mqd.nsqd import tap as broker_tap

    (tmp_path / "secret").write_text("s3cret\n", encoding="ascii")
    (tmp_path / "empty").write_text("\n", encoding="ascii")
    paths = {"FILE": str(tmp_path / "secret"), "MISSING": str(tmp_path / "missing"), "EMPTY": str(tmp_path / "empty")}
    flags = {k: paths.get(v, v) for k, v in given.items()}
    with pytest.raises(SystemExit) as stopped:
        broker_tap.build_service(resolve(MQD_OPTIONS, {"data-path": str(tmp_path), **flags}), MemoryReactor())
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    for word, path in paths.items():
        message = message.replace(word, path)
    assert err.startswith(f"mqd: {message}") and err.count("\n") == 1
    assert "s3cret" not in err
