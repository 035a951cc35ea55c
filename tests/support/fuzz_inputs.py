"""What the fuzzers feed the broker and mqlookupd: tokens that reach the corners, and random mixes.

Huge and odd numbers, odd JSON, odd names, compression and TLS negotiation,
bodies of every size class; the fuzzers mix in random bytes and random
sized blobs. The in-process fuzz tests draw from these lists with
hypothesis; `fuzz_broker` sends random mixes to a real broker.
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Iterator
from typing import Any

from hypothesis import HealthCheck, settings

from tests.support.raw_conn import MAGIC_V2
from tests.support.v2_frames import mpub_body, sized

_I32 = struct.Struct(">i")


def identify_raw(body: bytes) -> bytes:
    """IDENTIFY with exactly this body, JSON or not."""
    return b"IDENTIFY\n" + sized(body)


def json_bytes(**fields: Any) -> bytes:
    """The fields as a JSON object."""
    return json.dumps(fields).encode()


DEEP_JSON = b"[" * 50_000 + b"]" * 50_000
DEEP_OBJECT = b'{"a":' * 20_000 + b"1" + b"}" * 20_000
HUGE = 10**30
LONG_NUMBER = b"9" * 5000  # past Python's default limit on int() of a digit string
ID = b"0123456789abcdef"

# Inputs that reach the corners: huge and odd numbers, odd JSON, odd names,
# compression and TLS negotiation, bodies of every size class. Random bytes
# and random sized blobs are mixed in by the fuzzers.
V2_TOKENS: list[bytes] = [
    b"NOP\n", b"\n", b"\r\n", b" ", b"CLS\n", b"AUTH\n", b"AUTH\n" + sized(b"secret"),
    b"SUB t c\n", b"SUB t#ephemeral c#ephemeral\n", b"SUB t\n", b"SUB " + b"x" * 70 + b" c\n",
    "SUB t\u00e9 c\n".encode(), b"SUB t c\xff\n",
    b"RDY 5\n", b"RDY 0\n", b"RDY -1\n", b"RDY x\n", b"RDY\n", b"RDY %d\n" % HUGE,
    b"RDY 2500\n", b"RDY 1e400\n", b"RDY 0x10\n", b"RDY  1\n", b"RDY " + LONG_NUMBER + b"\n",
    b"REQ " + ID + b" " + LONG_NUMBER + b"\n", b"DPUB t " + LONG_NUMBER + b"\n" + sized(b"x"),
    b"REQ " + ID + b" %d\n" % (2**63), b"DPUB t %d\n" % (2**64 + 5) + sized(b"x"),
    b"SUB t c\nRDY 10\nPUB t\n" + sized(b"in flight"),
    b"FIN " + ID + b"\n", b"FIN short\n", b"FIN " + ID + b" extra\n",
    b"REQ " + ID + b" 10\n", b"REQ " + ID + b" x\n", b"REQ " + ID + b" %d\n" % HUGE,
    b"REQ " + ID + b" -%d\n" % HUGE, b"REQ " + ID + b" 1e400\n",
    b"TOUCH " + ID + b"\n",
    b"PUB t\n", b"MPUB t\n", b"DPUB t 100\n",
    b"PUB t\n" + sized(b"hello"), b"PUB t\n" + sized(b""), b"PUB t\n" + _I32.pack(-1),
    b"PUB t\n" + _I32.pack(2**31 - 1), b"PUB bad!\n" + sized(b"x"),
    b"MPUB t\n" + sized(mpub_body([b"a", b"b"])), b"MPUB t\n" + sized(_I32.pack(0)),
    b"MPUB t\n" + sized(_I32.pack(2**31 - 1)), b"MPUB t\n" + sized(_I32.pack(-5)),
    b"MPUB t\n" + sized(_I32.pack(2) + sized(b"a")),
    b"MPUB t\n" + sized(_I32.pack(1) + _I32.pack(2**31 - 1)),
    b"DPUB t 5\n" + sized(b"later"), b"DPUB t %d\n" % HUGE + sized(b"x"),
    b"DPUB t -%d\n" % HUGE + sized(b"x"), b"DPUB t 1e400\n" + sized(b"x"),
    b"DPUB t 99999999999999999999999999999999999999\n" + sized(b"x"),
    b"IDENTIFY\n",
    identify_raw(json_bytes(feature_negotiation=True)),
    identify_raw(json_bytes(heartbeat_interval=-1)),
    identify_raw(b"null"), identify_raw(b"[]"), identify_raw(b"1"), identify_raw(b'"s"'),
    identify_raw(b""),
    identify_raw(b"{"), identify_raw(DEEP_JSON), identify_raw(DEEP_OBJECT),
    identify_raw(json_bytes(heartbeat_interval=1.5, msg_timeout=2000.5, output_buffer_size=100.25)),
    identify_raw(json_bytes(sample_rate=50.5, deflate_level=3.7, output_buffer_timeout=0.5)),
    identify_raw(json_bytes(heartbeat_interval=HUGE, msg_timeout=HUGE, output_buffer_size=HUGE)),
    identify_raw(json_bytes(output_buffer_timeout=-HUGE, sample_rate=-HUGE, deflate_level=HUGE)),
    identify_raw(b'{"heartbeat_interval": 1e400, "msg_timeout": -1e400, "sample_rate": NaN}'),
    identify_raw(b'{"heartbeat_interval": 2000.0, "msg_timeout": 1e300, "output_buffer_timeout": 1e15}'),
    identify_raw(b'{"user_agent": "\\udc80x", "client_id": "\\ud800", "hostname": "\\udfff"}'),
    identify_raw(b'{"user_agent": "\\udc80x", "client_id": "\\ud800"}') + b"SUB t c\n",
    identify_raw(json_bytes(user_agent=["list"], client_id={"o": 1}, hostname=7)),
    identify_raw(json_bytes(feature_negotiation=True, deflate=True, deflate_level=9)),
    identify_raw(json_bytes(feature_negotiation=True, snappy=True)),
    identify_raw(json_bytes(feature_negotiation=True, deflate=True, snappy=True)),
    identify_raw(json_bytes(feature_negotiation=True, tls_v1=True)),
    identify_raw(json_bytes(feature_negotiation="yes", tls_v1=1, snappy="x", deflate=None)),
]

LOOKUPD_TOKENS: list[bytes] = [
    b"  V1", b"PING\n", b"\n", b" ", b"REGISTER t c\n", b"REGISTER t\n", b"REGISTER\n",
    b"UNREGISTER t c\n", b"UNREGISTER t\n", b"UNREGISTER t#ephemeral\n", b"REGISTER bad! c\n",
    b"REGISTER t c d e\n", b"IDENTIFY\n",
    identify_raw(json_bytes(version="1.3.0", tcp_port=4150, http_port=4151, broadcast_address="b")),
    identify_raw(b"null"), identify_raw(b"[]"), identify_raw(b"1"), identify_raw(b""), identify_raw(DEEP_JSON),
    identify_raw(DEEP_OBJECT),
    identify_raw(json_bytes(version="1.3.0", tcp_port=4150.5, http_port=4151.0, broadcast_address="b")),
    identify_raw(json_bytes(version="1.3.0", tcp_port=HUGE, http_port=-HUGE, broadcast_address="b")),
    identify_raw(json_bytes(version=1, tcp_port="4150", http_port=None, broadcast_address=["b"])),
    identify_raw(b'{"version": "\\ud800", "tcp_port": 1, "http_port": 2, "broadcast_address": "\\udc80"}'),
    _I32.pack(-1), _I32.pack(2**31 - 1),
]

# HTTP requests (method, target, body) an API fuzzer combines with random ones.
HTTP_PATHS = [
    "/ping", "/info", "/stats", "/metrics", "/pub", "/mpub", "/topic/create", "/topic/delete",
    "/topic/empty", "/topic/pause", "/topic/unpause", "/channel/create", "/channel/delete",
    "/channel/empty", "/channel/pause", "/channel/unpause", "/snapshot", "/config/log_level",
    "/config/nsqlookupd_tcp_addresses", "/config/x", "/", "//ping", "/ping/", "/PING", "/%ff",
    "/%", "/a/../ping", "/lookup", "/topics", "/channels", "/nodes", "/debug",
    "/topic/tombstone", "/tombstone_topic_producer", "/create_topic", "/delete_topic",
    "/topic/retention", "/topic/offsets", "/topic/read", "/channel/replay",
]
HTTP_QUERY_KEYS = ["topic", "channel", "defer", "format", "out", "node", "binary", "channel",
                   "include_clients", "include_mem", "topic", "x", "", "offset", "timestamp",
                   "max_messages", "max_bytes", "time", "bytes", "default"]
HTTP_QUERY_VALUES = [
    "t", "c", "t#ephemeral", "bad!", "", "json", "text", "prometheus", "true", "1", "-1",
    str(HUGE), "-" + str(HUGE), "1e400", "NaN", "%ff", "%ed%a0%80", "%00", "..", "a/../..",
    "/etc", "x" * 300, "%25", "snap1", "a/b", ".", "./x", "..%2fx", "nul%00l", "%c3%a9",
    "a%2fb%2fc", "x" * 5000, LONG_NUMBER.decode(), str(2**63), str(2**64 + 1),
    "earliest", "latest", "0", "24h", "10GB", "0.5KiB",
]
HTTP_BODIES = [
    b"", b"hello", b"\x00" * 10, b"null", b"[]", b'["127.0.0.1:1"]', b'"info"', b"info", b"debug",
    b"INFO", b"[1]", b"{}", DEEP_JSON, DEEP_OBJECT, b"[" * 5000, mpub_body([b"a", b"b"]),
    b"a\nb\n", b"\n\n", _I32.pack(2**31 - 1), "\udc80".encode("utf-8", "surrogatepass"),
]
HTTP_METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "CONNECT"]
# Every route with the method it serves, for the systematic sweeps.
HTTP_ROUTES = [
    ("GET", "/ping"), ("GET", "/info"), ("GET", "/stats"), ("GET", "/metrics"), ("POST", "/pub"),
    ("POST", "/mpub"), ("POST", "/topic/create"), ("POST", "/topic/delete"),
    ("POST", "/topic/empty"), ("POST", "/topic/pause"), ("POST", "/topic/unpause"),
    ("POST", "/channel/create"), ("POST", "/channel/delete"), ("POST", "/channel/empty"),
    ("POST", "/channel/pause"), ("POST", "/channel/unpause"), ("POST", "/snapshot"),
    ("GET", "/config/log_level"), ("PUT", "/config/log_level"),
    ("PUT", "/config/nsqlookupd_tcp_addresses"), ("PUT", "/config/x"),
    ("GET", "/lookup"), ("GET", "/topics"), ("GET", "/channels"), ("GET", "/nodes"),
    ("GET", "/debug"), ("POST", "/topic/tombstone"),
    ("GET", "/topic/retention"), ("POST", "/topic/retention"), ("GET", "/topic/offsets"),
    ("GET", "/topic/read"), ("POST", "/channel/replay"), ("DELETE", "/channel/replay"),
]
SWEEP_KEYS = ["topic", "channel", "defer", "out", "format", "node", "offset", "bytes"]


def http_sweep() -> Iterator[tuple[str, str, bytes | None]]:
    """Every route with every body, then with every value of every query key."""
    for method, path in HTTP_ROUTES:
        for body in HTTP_BODIES:
            yield method, f"{path}?topic=t&channel=c", body
        for key in SWEEP_KEYS:
            for value in HTTP_QUERY_VALUES:
                yield method, f"{path}?topic=t&channel=c&{key}={value}", b"x"


def random_v2_stream(rng: random.Random, max_tokens: int = 12) -> bytes:
    """Magic (usually) and a random mix of tokens, random bytes and sized blobs."""
    parts = [MAGIC_V2 if rng.random() < 0.9 else rng.randbytes(4)]
    for _ in range(rng.randrange(max_tokens + 1)):
        r = rng.random()
        if r < 0.65:
            parts.append(rng.choice(V2_TOKENS))
        elif r < 0.85:
            parts.append(rng.randbytes(rng.randrange(40)))
        else:
            parts.append(sized(rng.randbytes(rng.randrange(20))))
    return b"".join(parts)


def random_http_request(rng: random.Random) -> tuple[str, str, bytes | None]:
    """(method, target, body) built from the lists above and random characters."""
    path = rng.choice(HTTP_PATHS)
    if rng.random() < 0.1:
        path += "/" + "".join(rng.choice("ab%/.\u00e9") for _ in range(rng.randrange(8)))
    query = "&".join(
        f"{rng.choice(HTTP_QUERY_KEYS)}={rng.choice(HTTP_QUERY_VALUES)}"
        for _ in range(rng.randrange(4))
    )
    target = path + ("?" + query if query or rng.random() < 0.1 else "")
    body = rng.choice(HTTP_BODIES) if rng.random() < 0.7 else None
    return rng.choice(HTTP_METHODS), target, body


EXAMPLES_OVERRIDE = int(os.environ.get("MQD_FUZZ_EXAMPLES", "0"))


def examples(ci_count: int) -> settings:
    return settings(max_examples=EXAMPLES_OVERRIDE or ci_count, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
