"""IDENTIFY: the plain and negotiated answers, field validation and body errors."""

from __future__ import annotations

import json
import struct

import pytest

from tests.support.v2_client import Client
from tests.support.v2_frames import Frame, cmd, err, identify, ok, sized

DEFAULT_NEGOTIATED = {
    "max_rdy_count": 2500,
    "version": "1.3.0",
    "max_msg_timeout": 900000,
    "msg_timeout": 60000,
    "tls_v1": False,
    "deflate": False,
    "deflate_level": 6,
    "max_deflate_level": 6,
    "snappy": False,
    "sample_rate": 0,
    "auth_required": False,
    "output_buffer_size": 16384,
    "output_buffer_timeout": 250,
    "topology_region": "",
    "topology_zone": "",
}


def negotiate(client, **fields) -> dict:
    [frame] = client.request(identify(feature_negotiation=True, **fields))
    assert frame.type == 0, frame
    assert frame.payload[:1] == b"{"  # go-nsq tells JSON from OK by the first byte
    return json.loads(frame.payload)


def test_plain_identify_answers_ok(connect):
    c = connect()
    assert c.request(identify(client_id="worker-1", hostname="box", user_agent="test/1.0")) == [ok()]
    assert not c.closed
    assert (c.proto.client_id, c.proto.hostname, c.proto.user_agent) == ("worker-1", "box", "test/1.0")


def test_empty_object_answers_ok(connect):
    c = connect()
    assert c.request(identify()) == [ok()]


def test_feature_negotiation_false_answers_ok(connect):
    c = connect()
    assert c.request(identify(feature_negotiation=False, msg_timeout=5000)) == [ok()]
    assert c.proto.msg_timeout == 5.0


def test_client_id_defaults_to_remote_host(connect):
    c = connect()
    assert c.proto.client_id == "127.0.0.1"
    assert c.proto.hostname == "127.0.0.1"


def test_negotiated_defaults(connect):
    c = connect()
    assert negotiate(c) == DEFAULT_NEGOTIATED


def test_negotiated_answer_adds_only_the_http_port_once_it_is_known(connect, inproc_broker):
    """mqd's one addition to nsqd's answer: the HTTP port (no listener, as here by default: none)."""
    inproc_broker.ports["HTTP"] = 4151
    assert negotiate(connect()) == {**DEFAULT_NEGOTIATED, "http_port": 4151}


def test_negotiated_answer_names_the_https_port_only_when_that_listener_exists(connect, inproc_broker):
    """A TLS client finds the HTTPS API from the TCP address; a broker without --https-address adds nothing."""
    inproc_broker.ports["HTTP"] = 4151
    assert "https_port" not in negotiate(connect())
    inproc_broker.ports["HTTPS"] = 4152
    got = negotiate(connect())
    assert got == {**DEFAULT_NEGOTIATED, "http_port": 4151, "https_port": 4152}
    assert list(got)[-2:] == ["http_port", "https_port"]


def test_negotiated_client_values(connect):
    c = connect()
    got = negotiate(
        c,
        msg_timeout=5000,
        sample_rate=10,
        output_buffer_size=1024,
        output_buffer_timeout=100,
        deflate_level=3,
        heartbeat_interval=10000,
    )
    assert got == {
        **DEFAULT_NEGOTIATED,
        "msg_timeout": 5000,
        "sample_rate": 10,
        "output_buffer_size": 1024,
        "output_buffer_timeout": 100,
        "deflate_level": 6,  # a level counts only when deflate is on
    }
    p = c.proto
    assert (p.msg_timeout, p.sample_rate, p.heartbeat_interval) == (5.0, 10, 10.0)


def test_negotiated_reflects_broker_options(make_broker):
    broker = make_broker(
        max_rdy_count=100,
        max_msg_timeout="5m",
        msg_timeout="30s",
        max_deflate_level=9,
        output_buffer_timeout="100ms",
    )
    c = Client(broker)
    assert negotiate(c) == {
        **DEFAULT_NEGOTIATED,
        "max_rdy_count": 100,
        "max_msg_timeout": 300000,
        "msg_timeout": 30000,
        "max_deflate_level": 9,
        "output_buffer_timeout": 100,
    }


def test_deflate_level_capped_at_max(connect):
    c = connect()
    assert negotiate(c, deflate_level=9)["deflate_level"] == 6


def test_tls_negotiated_off_without_a_certificate(connect):
    c = connect()
    got = negotiate(c, tls_v1=True)
    assert (got["tls_v1"], got["snappy"], got["deflate"]) == (False, False, False)
    # No upgrade follows: the connection carries on in plaintext.
    assert c.request(cmd("NOP")) == []
    assert not c.closed


def test_output_buffer_size_minus_one_disables_buffering(connect):
    c = connect()
    got = negotiate(c, output_buffer_size=-1)
    assert (got["output_buffer_size"], got["output_buffer_timeout"]) == (1, 0)


def test_output_buffer_timeout_minus_one(connect):
    c = connect()
    got = negotiate(c, output_buffer_timeout=-1)
    assert (got["output_buffer_size"], got["output_buffer_timeout"]) == (16384, 0)


def test_unknown_keys_ignored(connect):
    c = connect()
    assert c.request(identify(short_id="a", long_id="a.b", something_new=[1, 2])) == [ok()]


def test_identify_body_in_chunks(connect):
    c = connect()
    data = identify(feature_negotiation=True, client_id="x" * 500)
    for i in range(0, len(data), 7):
        c.send(data[i : i + 7])
    [frame] = c.read()
    assert json.loads(frame.payload) == DEFAULT_NEGOTIATED


def test_second_identify_in_init_is_accepted(connect):
    c = connect()
    assert c.request(identify(client_id="a")) == [ok()]
    assert c.request(identify(client_id="b")) == [ok()]
    assert c.proto.client_id == "b"


def test_second_identify_keeps_the_timeouts_the_first_one_set(connect):
    c = connect()
    negotiate(c, msg_timeout=1000, heartbeat_interval=2000)
    got = negotiate(c, client_id="again")
    assert (got["msg_timeout"], c.proto.msg_timeout, c.proto.heartbeat_interval) == (1000, 1.0, 2.0)


@pytest.mark.parametrize(
    "field, value, what",
    [
        ("heartbeat_interval", 999, "heartbeat interval"),
        ("heartbeat_interval", 60001, "heartbeat interval"),
        ("heartbeat_interval", 300001, "heartbeat interval"),
        ("heartbeat_interval", -2, "heartbeat interval"),
        ("output_buffer_timeout", 24, "output buffer timeout"),
        ("output_buffer_timeout", 30001, "output buffer timeout"),
        ("output_buffer_timeout", -2, "output buffer timeout"),
        ("output_buffer_size", 63, "output buffer size"),
        ("output_buffer_size", 65537, "output buffer size"),
        ("output_buffer_size", -2, "output buffer size"),
        ("sample_rate", -1, "sample rate"),
        ("sample_rate", 100, "sample rate"),
        ("msg_timeout", 999, "msg timeout"),
        ("msg_timeout", 900001, "msg timeout"),
        ("msg_timeout", -1, "msg timeout"),
    ],
)
def test_invalid_field(connect, field, value, what):
    c = connect()
    assert c.request(identify(**{field: value})) == [err(f"E_BAD_BODY IDENTIFY {what} ({value}) is invalid")]
    assert c.closed


@pytest.mark.parametrize(
    "field, value",
    [
        ("heartbeat_interval", 1000),
        ("heartbeat_interval", 60000),
        ("output_buffer_timeout", 25),
        ("output_buffer_timeout", 30000),
        ("output_buffer_size", 64),
        ("output_buffer_size", 65536),
        ("sample_rate", 0),
        ("sample_rate", 99),
        ("msg_timeout", 1000),
        ("msg_timeout", 900000),
    ],
)
def test_boundary_values_accepted(connect, field, value):
    c = connect()
    assert c.request(identify(**{field: value})) == [ok()]
    assert not c.closed


def test_invalid_field_respects_broker_limits(make_broker):
    broker = make_broker(max_heartbeat_interval="10s", max_output_buffer_size=1000, max_msg_timeout="2s")
    c = Client(broker)
    assert c.request(identify(heartbeat_interval=10001)) == [
        err("E_BAD_BODY IDENTIFY heartbeat interval (10001) is invalid")
    ]
    c = Client(broker)
    assert c.request(identify(output_buffer_size=1001)) == [
        err("E_BAD_BODY IDENTIFY output buffer size (1001) is invalid")
    ]
    c = Client(broker)
    assert c.request(identify(msg_timeout=2001)) == [err("E_BAD_BODY IDENTIFY msg timeout (2001) is invalid")]
    c = Client(broker)
    assert c.request(identify(msg_timeout=2000, heartbeat_interval=10000, output_buffer_size=1000)) == [ok()]


def test_output_buffer_timeout_checked_before_size(connect):
    c = connect()
    assert c.request(identify(output_buffer_size=1, output_buffer_timeout=1)) == [
        err("E_BAD_BODY IDENTIFY output buffer timeout (1) is invalid")
    ]


def test_invalid_identify_changes_nothing(connect):
    c = connect()
    assert c.request(identify(client_id="new", heartbeat_interval=5)) == [
        err("E_BAD_BODY IDENTIFY heartbeat interval (5) is invalid")
    ]
    assert c.proto.client_id == "127.0.0.1"
    assert c.proto.heartbeat_interval == 30.0


def test_body_too_big(connect):
    c = connect()
    c.send(cmd("IDENTIFY") + struct.pack(">i", 5242881))
    assert c.read() == [err("E_BAD_BODY IDENTIFY body too big 5242881 > 5242880")]
    assert c.closed


def test_body_too_big_vs_max_body_size(make_broker):
    c = Client(make_broker(max_body_size=100))
    c.send(cmd("IDENTIFY") + sized(b"{" + b" " * 99 + b"}"))
    assert c.read() == [err("E_BAD_BODY IDENTIFY body too big 101 > 100")]


@pytest.mark.parametrize("size", [0, -1, -2147483648])
def test_body_size_not_positive(connect, size):
    c = connect()
    c.send(cmd("IDENTIFY") + struct.pack(">i", size))
    assert c.read() == [err(f"E_BAD_BODY IDENTIFY invalid body size {size}")]
    assert c.closed


@pytest.mark.parametrize(
    "body",
    [b"not json", b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"heartbeat_interval": "5000"}',
     b'{"feature_negotiation": "yes"}', b'{"client_id": 5}', b'{"sample_rate": 1.5}'],
)
def test_body_not_decodable(connect, body):
    c = connect()
    assert c.request(cmd("IDENTIFY") + sized(body)) == [err("E_BAD_BODY IDENTIFY failed to decode JSON body")]
    assert c.closed


def test_identify_after_sub(connect):
    c = connect()
    c.sub()
    assert c.request(identify()) == [err("E_INVALID cannot IDENTIFY in current state")]
    assert c.closed


def test_identify_after_cls(connect):
    c = connect()
    c.sub()
    assert c.request(cmd("CLS")) == [Frame(0, b"CLOSE_WAIT")]
    assert c.request(identify()) == [err("E_INVALID cannot IDENTIFY in current state")]


def test_identify_state_error_before_body_is_read(connect):
    c = connect()
    c.sub()
    # The state check happens before nsqd reads the body, so no body is needed.
    assert c.request(cmd("IDENTIFY")) == [err("E_INVALID cannot IDENTIFY in current state")]


def test_auth_without_auth_server(connect):
    c = connect()
    assert c.request(cmd("AUTH") + sized(b"secret")) == [err("E_AUTH_DISABLED AUTH disabled")]
    assert c.closed


def test_auth_errors(connect):
    c = connect()
    assert c.request(cmd("AUTH", "x") + sized(b"secret")) == [err("E_INVALID AUTH invalid number of parameters")]
    c = connect()
    assert c.request(cmd("AUTH") + sized(b"")) == [err("E_BAD_BODY AUTH invalid body size 0")]
    c = connect()
    c.sub()
    assert c.request(cmd("AUTH") + sized(b"s")) == [err("E_INVALID cannot AUTH in current state")]
