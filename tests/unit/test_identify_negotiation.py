"""IDENTIFY's negotiation as a pure function: nsqd's checks, bounds and answer, with no connection."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mqd import NSQ_VERSION
from mqd.nsqd.protocol.identify import Negotiated, negotiate, parse_request
from mqd.options import MQD_OPTIONS, Settings, resolve
from mqd.wire.errors import ProtocolError

# A connection's settings before any IDENTIFY (nsqd's defaults).
CURRENT = {"heartbeat_interval": 30.0, "output_buffer_size": 16 * 1024, "output_buffer_timeout": 0.25,
           "msg_timeout": 60.0}


def options(**flags: Any) -> Settings:
    values = {"backend": "memory"}
    values.update({k.replace("_", "-"): v for k, v in flags.items()})
    return resolve(MQD_OPTIONS, values)


def request(**fields: Any) -> dict[str, Any]:
    """A request as parse_request decodes the JSON of `fields`."""
    return parse_request(json.dumps(fields).encode())


def settle(opts: Settings | None = None, tls_available: bool = False, auth_required: bool = False,
           **fields: Any) -> Negotiated:
    return negotiate(opts or options(), request(**fields), **CURRENT,
                     tls_available=tls_available, auth_required=auth_required)


def refusal(**fields: Any) -> str:
    with pytest.raises(ProtocolError) as caught:
        settle(**fields)
    assert caught.value.fatal
    return caught.value.payload.decode()


# -- defaults -------------------------------------------------------------------------


def test_an_empty_request_keeps_the_connection_settings_and_is_answered_ok():
    got = settle()
    assert (got.heartbeat_interval, got.output_buffer_size, got.output_buffer_timeout) == (30.0, 16384, 0.25)
    assert got.msg_timeout == 60.0  # the broker's --msg-timeout
    assert got.sample_rate == 0
    assert got.response is None
    assert got.answer() == b"OK"
    assert not got.upgrades
    assert got.deflate_level is None
    assert got.refused is None


def test_a_zero_keeps_what_an_earlier_identify_set():
    got = negotiate(options(), request(), heartbeat_interval=5.0, output_buffer_size=100,
                    output_buffer_timeout=1.0, msg_timeout=2.0, tls_available=False, auth_required=False)
    assert (got.heartbeat_interval, got.output_buffer_size, got.output_buffer_timeout) == (5.0, 100, 1.0)
    assert got.msg_timeout == 2.0


def test_the_client_names_are_taken_as_sent():
    got = settle(client_id="c1", hostname="h1", user_agent="ua/1", topology_region="r", topology_zone="z")
    assert (got.client_id, got.hostname, got.user_agent) == ("c1", "h1", "ua/1")
    assert (got.topology_region, got.topology_zone) == ("r", "z")


def test_feature_negotiation_is_answered_with_the_settings_as_json():
    got = settle(opts=options(snappy=False), auth_required=True, feature_negotiation=True,
                 heartbeat_interval=10_000, msg_timeout=5_000, sample_rate=7)
    assert got.response == {
        "max_rdy_count": 2500,
        "version": NSQ_VERSION,
        "max_msg_timeout": 900_000,
        "msg_timeout": 5_000,
        "tls_v1": False,
        "deflate": False,
        "deflate_level": 6,
        "max_deflate_level": 6,
        "snappy": False,
        "sample_rate": 7,
        "auth_required": True,
        "output_buffer_size": 16384,
        "output_buffer_timeout": 250,
        "topology_region": "",
        "topology_zone": "",
    }
    assert got.answer() == json.dumps(got.response, separators=(",", ":")).encode()
    assert got.heartbeat_interval == 10.0


def test_the_http_port_is_the_one_key_added_to_nsqds_answer():
    plain = settle(feature_negotiation=True).response
    got = negotiate(options(), request(feature_negotiation=True), **CURRENT, tls_available=False,
                    auth_required=False, http_port=4151).response
    assert got == {**plain, "http_port": 4151}
    assert list(got)[-1] == "http_port"


def test_the_https_port_is_added_only_when_given():
    plain = settle(feature_negotiation=True).response
    got = negotiate(options(), request(feature_negotiation=True), **CURRENT, tls_available=False,
                    auth_required=False, https_port=4152).response
    assert got == {**plain, "https_port": 4152}


# -- bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize(("asked", "interval"), [(-1, 0.0), (1000, 1.0), (60_000, 60.0)])
def test_heartbeat_interval_within_bounds(asked, interval):
    assert settle(heartbeat_interval=asked).heartbeat_interval == interval


@pytest.mark.parametrize("asked", [-2, 1, 999, 60_001])
def test_heartbeat_interval_out_of_bounds_is_a_bad_body(asked):
    assert refusal(heartbeat_interval=asked) == f"E_BAD_BODY IDENTIFY heartbeat interval ({asked}) is invalid"


@pytest.mark.parametrize("asked", [64, 65536])
def test_output_buffer_size_within_bounds(asked):
    assert settle(output_buffer_size=asked).output_buffer_size == asked


def test_output_buffer_size_minus_one_turns_buffering_off():
    got = settle(output_buffer_size=-1, output_buffer_timeout=1000)
    assert (got.output_buffer_size, got.output_buffer_timeout) == (1, 0.0)


@pytest.mark.parametrize("asked", [-2, 63, 65537])
def test_output_buffer_size_out_of_bounds_is_a_bad_body(asked):
    assert refusal(output_buffer_size=asked) == f"E_BAD_BODY IDENTIFY output buffer size ({asked}) is invalid"


@pytest.mark.parametrize(("asked", "timeout"), [(-1, 0.0), (25, 0.025), (30_000, 30.0)])
def test_output_buffer_timeout_within_bounds(asked, timeout):
    assert settle(output_buffer_timeout=asked).output_buffer_timeout == timeout


@pytest.mark.parametrize("asked", [-2, 24, 30_001])
def test_output_buffer_timeout_out_of_bounds_is_a_bad_body(asked):
    assert refusal(output_buffer_timeout=asked) == (
        f"E_BAD_BODY IDENTIFY output buffer timeout ({asked}) is invalid")


@pytest.mark.parametrize("asked", [-1, 100])
def test_sample_rate_out_of_bounds_is_a_bad_body(asked):
    assert refusal(sample_rate=asked) == f"E_BAD_BODY IDENTIFY sample rate ({asked}) is invalid"


@pytest.mark.parametrize("asked", [999, 900_001])
def test_msg_timeout_out_of_bounds_is_a_bad_body(asked):
    assert refusal(msg_timeout=asked) == f"E_BAD_BODY IDENTIFY msg timeout ({asked}) is invalid"


def test_the_first_bad_field_in_nsqds_order_is_the_one_reported():
    assert refusal(heartbeat_interval=1, output_buffer_size=1, msg_timeout=1).startswith(
        "E_BAD_BODY IDENTIFY heartbeat interval")


@pytest.mark.parametrize("raw", [b"not json", b"[1]", b'{"heartbeat_interval": "x"}',
                                 b'{"heartbeat_interval": 1000.0}'])
def test_a_body_go_would_not_decode_is_a_bad_body(raw):
    with pytest.raises(ProtocolError) as caught:
        parse_request(raw)
    assert caught.value.payload == b"E_BAD_BODY IDENTIFY failed to decode JSON body"


# -- upgrades -------------------------------------------------------------------------


def test_tls_is_offered_only_when_the_broker_has_a_certificate():
    assert not settle(feature_negotiation=True, tls_v1=True).tls_v1
    got = settle(tls_available=True, feature_negotiation=True, tls_v1=True)
    assert got.tls_v1 and got.upgrades
    assert got.response["tls_v1"] is True


@pytest.mark.parametrize("codec", ["snappy", "deflate"])
def test_compression_is_offered_only_when_the_broker_allows_it(codec):
    assert getattr(settle(feature_negotiation=True, **{codec: True}), codec)
    assert not settle(opts=options(**{codec: False}), feature_negotiation=True, **{codec: True}).upgrades


def test_without_feature_negotiation_nothing_is_upgraded():
    got = settle(tls_available=True, tls_v1=True, snappy=True)
    assert not got.upgrades
    assert got.answer() == b"OK"


@pytest.mark.parametrize(("asked", "level"), [(0, 6), (3, 3), (9, 6)])
def test_deflate_level_defaults_to_6_and_is_capped_by_the_broker(asked, level):
    assert settle(feature_negotiation=True, deflate=True, deflate_level=asked).deflate_level == level


@pytest.mark.parametrize(("max_level", "answered"), [(6, 6), (4, 4)])
def test_a_level_without_deflate_is_answered_as_the_default(max_level, answered):
    got = settle(opts=options(max_deflate_level=max_level), feature_negotiation=True, deflate_level=2)
    assert (got.deflate, got.response["deflate_level"]) == (False, answered)


def test_both_compressions_are_refused_after_the_settings_are_taken():
    got = settle(feature_negotiation=True, snappy=True, deflate=True, heartbeat_interval=-1)
    assert got.refused is not None and got.refused.fatal
    assert got.refused.payload == b"E_IDENTIFY_FAILED cannot enable both deflate and snappy compression"
    assert got.heartbeat_interval == 0.0
    assert got.deflate_level is None


def test_without_feature_negotiation_both_compressions_are_not_refused():
    got = settle(snappy=True, deflate=True)
    assert got.refused is None and not got.upgrades
    assert got.answer() == b"OK"
