"""GET/PUT /config/:opt: nsqd's option names and JSON values, the two run-time options."""

from __future__ import annotations

import json

import pytest
from twisted.logger import LogLevel

from mqd import logs
from mqd.nsqd.http.config import config_name
from mqd.options import MQD_OPTIONS
from tests.support.http_client import HTTPClient, error


@pytest.fixture(autouse=True)
def restore_log_level():
    yield
    logs.set_log_level("info")


def level_in_force():
    return logs._predicate.logLevelForNamespace("mqd.http.router")


def value(http, name):
    """The option's value; a string comes back as raw text, as nsqd's V1 answer sends strings."""
    r = http.get(f"/config/{name}")
    assert r.status == 200 and r.v1, (r.status, r.body)
    if not r.is_json:
        assert r.header("Content-Type") == ("text/plain; charset=utf-8" if r.body else None)
        return r.body.decode()
    return r.json()


@pytest.mark.parametrize(("name", "expected"), [
    ("nsqlookupd_tcp_addresses", []),
    ("log_level", 2),
    ("id", 7),
    ("msg_timeout", 60_000_000_000),
    ("max_req_timeout", 3_600_000_000_000),
    ("output_buffer_timeout", 250_000_000),
    ("mem_queue_size", 10000),
    ("max_msg_size", 1048576),
    ("broadcast_address", "test-host"),
    ("snappy", True),
    ("queue_scan_dirty_percent", 0.25),
    ("backend", "memory"),
    ("statsd_address", ""),
    ("broadcast_tcp_port", 4150),
    ("broadcast_http_port", 4151),
    ("statsd_prefix", "nsq.test-host_4151."),
    ("tls_required", 0),
    ("tls_min_version", 769),
])
def test_get_values_as_nsqd_serialises_them(http, name, expected):
    assert value(http, name) == expected


@pytest.mark.parametrize(("flags", "name", "expected"), [
    ({"broadcast_tcp_port": 5150}, "broadcast_tcp_port", 5150),
    ({"broadcast_http_port": 5151, "statsd_prefix": "app.%s.nsqd"}, "statsd_prefix", "app.test-host_5151.nsqd."),
    ({"statsd_prefix": ""}, "statsd_prefix", ""),
    ({"tls_required": "tcp-https"}, "tls_required", 1),
    ({"tls_required": "true"}, "tls_required", 2),
    ({"tls_client_auth_policy": "require"}, "tls_required", 2),
    ({"tls_min_version": "tls1.3"}, "tls_min_version", 772),
])
def test_options_nsqd_resolves_at_start_up_are_shown_resolved(make_broker, flags, name, expected):
    assert value(HTTPClient(make_broker(**flags)), name) == expected


def test_every_option_can_be_read_by_its_config_name(http):
    for opt in MQD_OPTIONS:
        if not opt.attr.endswith("_secret"):
            value(http, config_name(opt))


def test_the_lookupd_secret_is_not_shown_nor_set(make_broker):
    http = HTTPClient(make_broker(**{"http-client-auth-secret": "top-secret"}))
    for method in ("get", "put"):
        r = getattr(http, method)("/config/http_client_auth_secret", **({"body": b"x"} if method == "put" else {}))
        assert error(r) == (400, "INVALID_OPTION")
        assert b"top-secret" not in r.body
    assert value(http, "http_client_auth_secret_file") == ""


@pytest.mark.parametrize("name", ["nope", "node_id", "lookupd_tcp_address", "mem-queue-size",
                                  "LOG_LEVEL"])
def test_get_unknown_option(http, name):
    assert error(http.get(f"/config/{name}")) == (400, "INVALID_OPTION")


def test_put_lookupd_addresses(http, inproc_broker):
    addresses = ["127.0.0.1:4160", "lookupd-2:4160"]
    r = http.put("/config/nsqlookupd_tcp_addresses", json.dumps(addresses).encode())
    assert (r.status, r.json()) == (200, addresses) and r.v1 and r.is_json
    assert value(http, "nsqlookupd_tcp_addresses") == addresses
    assert inproc_broker.options.lookupd_tcp_address == addresses
    r = http.put("/config/nsqlookupd_tcp_addresses", b" [] ")
    assert r.json() == []
    assert http.put("/config/nsqlookupd_tcp_addresses", b"null").json() == []


@pytest.mark.parametrize("body", [b"not json", b'"127.0.0.1:4160"', b"[1, 2]", b"{}",
                                  b'["a",'])
def test_put_lookupd_addresses_bad_value(http, inproc_broker, body):
    assert error(http.put("/config/nsqlookupd_tcp_addresses", body)) == (400, "INVALID_VALUE")
    assert inproc_broker.options.lookupd_tcp_address == []


def test_put_log_level(http, inproc_broker):
    r = http.put("/config/log_level", b"debug")
    assert (r.status, r.json()) == (200, 1)
    assert inproc_broker.options.log_level == "debug"
    assert level_in_force() == LogLevel.debug
    assert value(http, "log_level") == 1
    assert http.put("/config/log_level", b"WARN").json() == 3
    assert level_in_force() == LogLevel.warn
    assert http.put("/config/log_level", b"fatal").json() == 5
    assert http.put("/config/log_level", b"info").json() == 2


@pytest.mark.parametrize("body", [b"bad", b"debug\n", b" info", b"2"])
def test_put_log_level_bad_value(http, inproc_broker, body):
    assert error(http.put("/config/log_level", body)) == (400, "INVALID_VALUE")
    assert inproc_broker.options.log_level == "info"


@pytest.mark.parametrize("name", ["log_level", "nsqlookupd_tcp_addresses", "mem_queue_size",
                                  "nope"])
def test_put_empty_or_too_big_body(make_broker, name):
    http = HTTPClient(make_broker(max_msg_size=10))
    assert error(http.put(f"/config/{name}", b"")) == (413, "INVALID_VALUE")
    assert error(http.put(f"/config/{name}", b"x" * 11)) == (413, "INVALID_VALUE")


@pytest.mark.parametrize("name", ["mem_queue_size", "msg_timeout", "id", "nope"])
def test_put_other_options_is_invalid_option(http, name):
    assert error(http.put(f"/config/{name}", b"5")) == (400, "INVALID_OPTION")


def test_update_options_checks_before_changing(inproc_broker):
    with pytest.raises(ValueError):
        inproc_broker.update_options(log_level="loud")
    with pytest.raises(ValueError):
        inproc_broker.update_options(no_such_option=1)
    assert inproc_broker.options.log_level == "info"
    inproc_broker.update_options(lookupd_tcp_address=["a:1"])
    assert inproc_broker.options.lookupd_tcp_address == ["a:1"]


def test_lookupd_flag_is_repeatable_and_read_back(tmp_path, clock):
    from mqd.nsqd.broker import Broker
    from mqd.nsqd.tap import Options, settings_from

    names = [opt.name for opt in MQD_OPTIONS]
    assert names[names.index("http-address") + 1] == "lookupd-tcp-address"
    o = Options()
    o.parseOptions([f"--data-path={tmp_path}", "--backend=memory",
                    "--lookupd-tcp-address=a:4160", "-lookupd-tcp-address=b:4160"])
    broker = Broker(settings_from(o, MQD_OPTIONS, "mqd"), clock=clock)
    broker.open()
    assert value(HTTPClient(broker), "nsqlookupd_tcp_addresses") == ["a:4160", "b:4160"]
    broker.close()


def test_put_log_level_changes_what_mqd_loggers_emit(http):
    from twisted.logger import globalLogPublisher

    seen = []

    def observer(event):
        if event.get("log_namespace") == "test.http.level":
            seen.append(event["log_level"])

    globalLogPublisher.addObserver(observer)
    try:
        log = logs.get_logger("test.http.level")
        log.debug("hidden at info")
        http.put("/config/log_level", b"debug")
        log.debug("shown at debug")
        http.put("/config/log_level", b"error")
        log.warn("hidden at error")
        log.error("shown at error")
    finally:
        globalLogPublisher.removeObserver(observer)
    assert seen == [LogLevel.debug, LogLevel.error]
