"""mqd.client.config: go-nsq's options, defaults and bounds; strings as the CLI gives them."""

from __future__ import annotations

import json

import pytest
from twisted.internet import ssl
from twisted.internet._sslverify import ClientTLSOptions

from mqd import __version__
from mqd.client.config import OPTIONS, Config, format_duration, parse_duration
from mqd.client.errors import ClientConfigError

# go-nsq 1.1's config.go: option → (min, max) in seconds (durations) or units.
BOUNDS = {
    "read_timeout": (0.1, 300.0),
    "write_timeout": (0.1, 300.0),
    "lookupd_poll_interval": (0.01, 300.0),
    "lookupd_poll_jitter": (0.0, 1.0),
    "max_requeue_delay": (0.0, 3600.0),
    "default_requeue_delay": (0.0, 3600.0),
    "max_backoff_duration": (0.0, 3600.0),
    "backoff_multiplier": (0.0, 3600.0),
    "max_attempts": (0, 65535),
    "low_rdy_idle_timeout": (1.0, 300.0),
    "low_rdy_timeout": (1.0, 300.0),
    "rdy_redistribute_interval": (0.001, 5.0),
    "sample_rate": (0, 99),
    "deflate_level": (1, 9),
}

DEFAULTS = {
    "dial_timeout": 1.0, "read_timeout": 60.0, "write_timeout": 1.0, "local_addr": None,
    "lookupd_poll_interval": 60.0, "lookupd_poll_jitter": 0.3, "max_requeue_delay": 900.0,
    "default_requeue_delay": 90.0, "backoff_strategy": "exponential",
    "max_backoff_duration": 120.0, "backoff_multiplier": 1.0, "max_attempts": 5,
    "low_rdy_idle_timeout": 10.0, "low_rdy_timeout": 30.0, "rdy_redistribute_interval": 5.0,
    "user_agent": f"mqd.client/{__version__}", "heartbeat_interval": 30.0, "sample_rate": 0,
    "tls_v1": False, "tls_root_ca_file": "", "tls_cert": "", "tls_key": "",
    "tls_insecure_skip_verify": False, "tls_server_name": "", "deflate": False,
    "deflate_level": 6, "snappy": False, "output_buffer_size": 16384,
    "output_buffer_timeout": 0.25, "max_in_flight": 1, "msg_timeout": 0.0, "auth_secret": "",
    "max_msg_size": 64 * 1024 * 1024,  # go-nsq's later option; a limit here, not its 0
}


def test_defaults_are_go_nsqs():
    config = Config()
    for name, value in DEFAULTS.items():
        assert getattr(config, name) == value, name
    assert config.client_id and "." not in config.client_id
    assert config.hostname


def test_options_table_is_ordered_and_complete():
    assert list(OPTIONS)[:3] == ["dial_timeout", "read_timeout", "write_timeout"]
    assert set(OPTIONS) == set(DEFAULTS) | {"client_id", "hostname"}
    for name, (_default, low, high, doc) in OPTIONS.items():
        assert doc and "\n" not in doc, name
        if name in BOUNDS:
            assert (low, high) == BOUNDS[name], name
    assert OPTIONS["max_in_flight"][1:3] == (0, None)
    assert OPTIONS["msg_timeout"][1:3] == (0.0, None)
    assert Config.OPTIONS is OPTIONS


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_every_bound_is_checked(name):
    low, high = BOUNDS[name]
    is_int = isinstance(low, int) and not isinstance(low, bool) and isinstance(high, int)
    step = 1 if is_int else 0.0005
    extra = {"heartbeat_interval": -1} if name == "read_timeout" else {}
    assert getattr(Config(**{name: low}, **extra), name) == low
    assert getattr(Config(**{name: high}, **extra), name) == high
    with pytest.raises(ClientConfigError, match=f"^{name}: .* is below the minimum"):
        Config(**{name: low - step})
    with pytest.raises(ClientConfigError, match=f"^{name}: .* is above the maximum"):
        Config(**{name: high + step})


def test_unbounded_minimums():
    with pytest.raises(ClientConfigError, match="max_in_flight: -1 is below the minimum 0"):
        Config(max_in_flight=-1)
    with pytest.raises(ClientConfigError, match="msg_timeout: -1s is below the minimum 0"):
        Config(msg_timeout=-1.0)
    assert Config(max_in_flight=100000).max_in_flight == 100000


def test_bound_message_is_readable():
    with pytest.raises(ClientConfigError) as e:
        Config(read_timeout="50ms")
    assert str(e.value) == "read_timeout: 50ms is below the minimum 100ms"


def test_unknown_option():
    with pytest.raises(ClientConfigError, match="^unknown option 'max_inflight'$"):
        Config(max_inflight=3)
    config = Config()
    with pytest.raises(ClientConfigError, match="unknown option 'nope'"):
        config.set("nope", "1")
    with pytest.raises(ClientConfigError, match="unknown option 'nope'"):
        config.nope = 1


@pytest.mark.parametrize(("text", "seconds"), [
    ("250ms", 0.25), ("1m30s", 90.0), ("90s", 90.0), ("1h", 3600.0), ("1.5s", 1.5),
    ("100us", 1e-4), ("100µs", 1e-4), ("10ns", 1e-8), ("-1ms", -0.001), ("0", 0.0),
    ("2h45m", 9900.0), ("30", 30.0), (".5s", 0.5),
])
def test_go_duration_strings(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "ms", "1x", "1 s", "s1", "1m30", "--1s", "1.2.3s"])
def test_bad_duration_strings(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_durations_as_seconds_or_strings():
    config = Config(read_timeout="30s", lookupd_poll_interval=15, max_requeue_delay="1m30s")
    assert config.read_timeout == 30.0
    assert config.lookupd_poll_interval == 15.0
    assert config.max_requeue_delay == 90.0
    with pytest.raises(ClientConfigError, match="read_timeout: cannot parse '30 parsecs' as a duration"):
        Config(read_timeout="30 parsecs")
    with pytest.raises(ClientConfigError, match="read_timeout: expected seconds"):
        Config(read_timeout=True)
    with pytest.raises(ClientConfigError, match="read_timeout: not a number"):
        Config(read_timeout=float("nan"))


def test_set_parses_strings_like_go_nsq():
    config = Config()
    config.set("max_in_flight", "200")
    config.set("tls-v1", "true")  # dashes accepted, as go-nsq
    config.set("snappy", "1")
    config.set("read_timeout", "2m")
    config.set("lookupd_poll_jitter", "0.5")
    config.set("user_agent", "tool/1.0")
    config.set("backoff_strategy", "full_jitter")
    config.set("local_addr", "127.0.0.1:0")
    assert (config.max_in_flight, config.tls_v1, config.snappy, config.read_timeout,
            config.lookupd_poll_jitter, config.user_agent, config.backoff_strategy,
            config.local_addr) == (200, True, True, 120.0, 0.5, "tool/1.0", "full_jitter",
                                   "127.0.0.1:0")
    config.set("tls_v1", "F")
    assert config.tls_v1 is False
    config.set("max_attempts", 7)  # a non-string is set as is
    assert config.max_attempts == 7


@pytest.mark.parametrize(("name", "text", "message"), [
    ("max_in_flight", "lots", "max_in_flight: cannot parse 'lots' as a integer"),
    ("tls_v1", "yes", "tls_v1: cannot parse 'yes' as a boolean"),
    ("lookupd_poll_jitter", "x", "lookupd_poll_jitter: cannot parse 'x' as a number"),
    ("read_timeout", "soon", "read_timeout: cannot parse 'soon' as a duration"),
    ("backoff_strategy", "linear", "backoff_strategy: 'linear' is not one of exponential, full_jitter"),
    ("max_attempts", "70000", "max_attempts: 70000 is above the maximum 65535"),
])
def test_set_errors_name_the_option(name, text, message):
    with pytest.raises(ClientConfigError) as e:
        Config().set(name, text)
    assert str(e.value) == message


def test_types_are_checked():
    with pytest.raises(ClientConfigError, match="max_in_flight: expected an integer"):
        Config(max_in_flight=1.5)
    with pytest.raises(ClientConfigError, match="max_in_flight: expected an integer"):
        Config(max_in_flight=True)
    with pytest.raises(ClientConfigError, match="snappy: expected True or False"):
        Config(snappy="true")
    with pytest.raises(ClientConfigError, match="auth_secret: expected a string"):
        Config(auth_secret=b"x")


def test_assignment_is_checked_too():
    config = Config()
    config.max_in_flight = 10
    assert config.max_in_flight == 10
    with pytest.raises(ClientConfigError, match="sample_rate: 100 is above the maximum 99"):
        config.sample_rate = 100
    assert config.sample_rate == 0


def test_cross_field_rules():
    with pytest.raises(ClientConfigError, match="heartbeat_interval 2m must not exceed read_timeout 1m"):
        Config(heartbeat_interval=120)
    assert Config(read_timeout=30, heartbeat_interval=30).heartbeat_interval == 30.0
    assert Config(read_timeout=5, heartbeat_interval=-1).heartbeat_interval == -1.0
    with pytest.raises(ClientConfigError, match="snappy and deflate cannot both be enabled"):
        Config(snappy=True, deflate=True)
    with pytest.raises(ClientConfigError, match="tls_cert and tls_key must be given together"):
        Config(tls_cert="c.pem")
    config = Config(snappy=True)
    config.deflate = True  # one at a time: validate() sees both
    with pytest.raises(ClientConfigError, match="snappy and deflate"):
        config.validate()


def test_disabling_values():
    with pytest.raises(ClientConfigError, match="heartbeat_interval: -2s is negative"):
        Config(heartbeat_interval=-2)
    with pytest.raises(ClientConfigError, match="output_buffer_size: -2 is invalid"):
        Config(output_buffer_size=-2)
    config = Config(heartbeat_interval=-1, output_buffer_timeout=-1, output_buffer_size=-1)
    body = json.loads(config.identify_body())
    assert (body["heartbeat_interval"], body["output_buffer_timeout"], body["output_buffer_size"]) \
        == (-1, -1, -1)


def test_identify_body_fields():
    config = Config(client_id="c1", hostname="h.example", user_agent="ua/1", msg_timeout="90s",
                    output_buffer_timeout="100ms", output_buffer_size=4096, sample_rate=10,
                    heartbeat_interval="1.5s", deflate=True, deflate_level=3)
    raw = config.identify_body()
    assert b" " not in raw  # compact, as Go marshals
    assert json.loads(raw) == {
        "client_id": "c1", "hostname": "h.example", "user_agent": "ua/1",
        "feature_negotiation": True, "heartbeat_interval": 1500, "output_buffer_size": 4096,
        "output_buffer_timeout": 100, "msg_timeout": 90000, "tls_v1": False, "snappy": False,
        "deflate": True, "deflate_level": 3, "sample_rate": 10,
    }


def test_copy_and_equality():
    config = Config(max_in_flight=5)
    other = config.copy(max_in_flight=6)
    assert (config.max_in_flight, other.max_in_flight) == (5, 6)
    assert config == config.copy()
    assert config != other
    assert "max_in_flight=5" in repr(config)


def test_format_duration():
    assert [format_duration(s) for s in (0, 0.25, 90, 60, 900, 3600, 1.5, -0.001)] == \
        ["0", "250ms", "90s", "1m", "15m", "1h", "1.5s", "-1ms"]


# -- TLS ---------------------------------------------------------------------------


def test_tls_creator_verifies_the_address_host_by_default():
    creator = Config(tls_v1=True).tls_creator("nsqd.example")
    assert isinstance(creator, ClientTLSOptions)
    assert creator._hostnameASCII == "nsqd.example"


def test_tls_creator_server_name_and_ipv6_brackets():
    assert Config(tls_server_name="name.example").tls_creator("10.0.0.1")._hostnameASCII == "name.example"
    assert Config().tls_creator("[::1]")._hostnameASCII == "::1"


def test_tls_creator_insecure_skip_verify():
    creator = Config(tls_insecure_skip_verify=True).tls_creator("127.0.0.1")
    assert isinstance(creator, ssl.CertificateOptions)
    assert creator.verify is False


def test_tls_creator_with_ca_and_client_certificate(tmp_path):
    from tests.support.certs import make_certs

    certs = make_certs(tmp_path / "certs")
    config = Config(tls_v1=True, tls_root_ca_file=str(certs.ca), tls_cert=str(certs.client_cert),
                    tls_key=str(certs.client_key))
    creator = config.tls_creator("127.0.0.1")
    assert isinstance(creator, ClientTLSOptions)
    insecure = Config(tls_insecure_skip_verify=True, tls_cert=str(certs.client_cert),
                      tls_key=str(certs.client_key)).tls_creator("127.0.0.1")
    assert insecure.certificate is not None and insecure.privateKey is not None


def test_tls_creator_bad_files(tmp_path):
    with pytest.raises(ClientConfigError, match="tls_root_ca_file: cannot load"):
        Config(tls_root_ca_file=str(tmp_path / "missing.pem")).tls_creator("h")
    empty = tmp_path / "empty.pem"
    empty.write_text("nothing here\n")
    with pytest.raises(ClientConfigError, match="tls_root_ca_file: no certificate"):
        Config(tls_root_ca_file=str(empty)).tls_creator("h")
    with pytest.raises(ClientConfigError, match="tls_cert/tls_key: cannot load"):
        Config(tls_cert=str(empty), tls_key=str(empty)).tls_creator("h")


def test_docs_options_table_lists_every_option_with_its_default():
    """The client page's options table is the user's reference: it must not drift from Config."""
    from pathlib import Path

    from mqd.client.config import Config

    page = (Path(__file__).resolve().parents[2] / "docs" / "client.md").read_text(encoding="utf-8")
    section = page.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
            for line in section.splitlines() if line.startswith("| `")}
    assert set(Config.OPTIONS) <= set(rows)
    assert rows["max_in_flight"] == "1"
    assert rows["default_requeue_delay"] == "90s"
    assert rows["user_agent"] == Config.OPTIONS["user_agent"][0]
