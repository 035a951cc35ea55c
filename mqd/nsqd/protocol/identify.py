"""IDENTIFY negotiation: a client's request checked against the broker's options.

`negotiate` is a pure function of the options, the request and the
connection's current settings: it touches no connection and no transport,
so nsqd's rules (checks, their order, their error texts) are testable on
their own. The protocol applies what it returns, answers with it, and makes
the upgrades it names (mqd.nsqd.protocol.upgrades).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mqd import NSQ_VERSION
from mqd.options import Settings
from mqd.wire.errors import GoStruct, ProtocolError, fatal
from mqd.wire.json_encoding import encode_json

__all__ = ["IDENTIFY_DATA", "Negotiated", "negotiate", "parse_request"]


# nsqd's identifyDataV2 (a field the client leaves out has its zero value).
# (topology_region/zone are only type-checked: mqd has no topology-aware delivery.)
IDENTIFY_DATA = GoStruct({
    "client_id": "string", "hostname": "string", "user_agent": "string",
    "topology_region": "string", "topology_zone": "string",
    "heartbeat_interval": "int", "output_buffer_size": "int", "output_buffer_timeout": "int",
    "deflate_level": "int", "sample_rate": "int32", "msg_timeout": "int",
    "feature_negotiation": "bool", "tls_v1": "bool", "snappy": "bool", "deflate": "bool",
})


def parse_request(raw: bytes) -> dict[str, Any]:
    """IDENTIFY's JSON body as nsqd's identifyDataV2, or nsqd's fatal E_BAD_BODY."""
    try:
        return IDENTIFY_DATA.unmarshal(raw)
    except ValueError:
        raise fatal("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None


@dataclass(frozen=True, slots=True)
class Negotiated:
    """What an IDENTIFY settles for a connection.

    The settings are the connection's from then on. `response` is the
    JSON answer, None for a client without feature_negotiation (answered
    a plain OK, and upgraded to nothing). `deflate_level` is None when
    the request left it alone. `refused` is an error to raise once the
    settings are applied: nsqd applies them before it checks the
    compression asked for, so a connection refused for asking both
    deflate and snappy closes with its new heartbeat interval.
    """

    client_id: str
    hostname: str
    user_agent: str
    topology_region: str
    topology_zone: str
    heartbeat_interval: float
    output_buffer_size: int
    output_buffer_timeout: float
    sample_rate: int
    msg_timeout: float
    deflate_level: int | None = None
    response: dict[str, Any] | None = None
    tls_v1: bool = False
    deflate: bool = False
    snappy: bool = False
    refused: ProtocolError | None = None

    @property
    def upgrades(self) -> bool:
        """Whether the connection switches to TLS or compression after the answer."""
        return self.tls_v1 or self.deflate or self.snappy

    def answer(self) -> bytes:
        """The response frame's body: the JSON (compact, as nsqd marshals it), or OK."""
        if self.response is None:
            return b"OK"
        return encode_json(self.response)


def negotiate(
    options: Settings,
    request: Mapping[str, Any],
    *,
    heartbeat_interval: float,
    output_buffer_size: int,
    output_buffer_timeout: float,
    msg_timeout: float,
    tls_available: bool,
    auth_required: bool,
    http_port: int = 0,
    https_port: int = 0,
) -> Negotiated:
    """nsqd's IDENTIFY: its checks, in its order, with its texts.

    `request` is identifyDataV2 as parse_request decodes it. The keyword
    settings are the connection's current ones, which a 0 in the request
    keeps (a second IDENTIFY starts from what the first one set). Raises
    the fatal E_BAD_BODY errors nsqd sends for a value out of range.

    `http_port` is the broker's HTTP port, which the JSON answer names as
    one key more than nsqd's, `"http_port"` (a client reading a topic's
    retained log finds the HTTP API there; NSQ clients ignore the key);
    0 (no HTTP listener) leaves the answer nsqd's exactly. `https_port`
    likewise: the broker's HTTPS port (`--https-address`), named
    `"https_port"` only when that listener exists, so that a client
    speaking TLS finds the same API over TLS from a TCP address.
    """
    heartbeat = request["heartbeat_interval"]
    if heartbeat == -1:
        heartbeat_interval = 0.0
    elif heartbeat == 0:
        pass
    elif 1000 <= heartbeat <= options.max_heartbeat_interval * 1000:
        heartbeat_interval = heartbeat / 1000
    else:
        raise fatal("E_BAD_BODY", f"IDENTIFY heartbeat interval ({heartbeat}) is invalid")

    buf_timeout = request["output_buffer_timeout"]
    if buf_timeout == -1:
        output_buffer_timeout = 0.0
    elif buf_timeout == 0:
        pass
    elif (int(options.min_output_buffer_timeout * 1000) <= buf_timeout
          <= int(options.max_output_buffer_timeout * 1000)):
        output_buffer_timeout = buf_timeout / 1000
    else:
        raise fatal("E_BAD_BODY", f"IDENTIFY output buffer timeout ({buf_timeout}) is invalid")
    buf_size = request["output_buffer_size"]
    if buf_size == -1:
        output_buffer_size = 1
        output_buffer_timeout = 0.0
    elif buf_size == 0:
        pass
    elif 64 <= buf_size <= options.max_output_buffer_size:
        output_buffer_size = buf_size
    else:
        raise fatal("E_BAD_BODY", f"IDENTIFY output buffer size ({buf_size}) is invalid")

    sample_rate = request["sample_rate"]
    if not 0 <= sample_rate <= 99:
        raise fatal("E_BAD_BODY", f"IDENTIFY sample rate ({sample_rate}) is invalid")

    asked_timeout = request["msg_timeout"]
    if asked_timeout == 0:
        pass
    elif 1000 <= asked_timeout <= options.max_msg_timeout * 1000:
        msg_timeout = asked_timeout / 1000
    else:
        raise fatal("E_BAD_BODY", f"IDENTIFY msg timeout ({asked_timeout}) is invalid")

    settings = {
        "client_id": request["client_id"],
        "hostname": request["hostname"],
        "user_agent": request["user_agent"],
        "topology_region": request["topology_region"],
        "topology_zone": request["topology_zone"],
        "heartbeat_interval": heartbeat_interval,
        "output_buffer_size": output_buffer_size,
        "output_buffer_timeout": output_buffer_timeout,
        "sample_rate": sample_rate,
        "msg_timeout": msg_timeout,
    }

    if not request["feature_negotiation"]:
        # As nsqd: without feature negotiation nothing is upgraded, so
        # nothing is checked either (snappy and deflate together is OK).
        return Negotiated(**settings)
    tls_v1 = tls_available and request["tls_v1"]
    deflate = options.deflate and request["deflate"]
    snappy = options.snappy and request["snappy"]
    if deflate and snappy:
        return Negotiated(**settings, refused=fatal(
            "E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression"))
    # A level asked for counts only with deflate on; the answer says 6
    # (capped) otherwise, as nsqd's does.
    deflate_level = request["deflate_level"] if deflate and request["deflate_level"] > 0 else 6
    deflate_level = min(deflate_level, options.max_deflate_level)
    response = {
        "max_rdy_count": options.max_rdy_count,
        "version": NSQ_VERSION,
        "max_msg_timeout": int(options.max_msg_timeout * 1000),
        "msg_timeout": int(msg_timeout * 1000),
        "tls_v1": tls_v1,
        "deflate": deflate,
        "deflate_level": deflate_level,
        "max_deflate_level": options.max_deflate_level,
        "snappy": snappy,
        "sample_rate": sample_rate,
        "auth_required": auth_required,
        "output_buffer_size": output_buffer_size,
        "output_buffer_timeout": int(output_buffer_timeout * 1000),
        "topology_region": "",
        "topology_zone": "",
    }
    if http_port:
        response["http_port"] = http_port
    if https_port:
        response["https_port"] = https_port
    return Negotiated(**settings, deflate_level=deflate_level, response=response,
                      tls_v1=tls_v1, deflate=deflate, snappy=snappy)
