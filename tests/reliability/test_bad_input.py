"""Bad client input, answered as nsqd and nsqlookupd answer it.

- Every bad argument or IDENTIFY body gets nsqd's (or nsqlookupd's) answer,
  never an exception out of the protocol and a dropped connection. nsqd
  reads RDY/REQ/DPUB numbers with ByteToBase10 (uint64 arithmetic that
  wraps, so any number of digits parses) and IDENTIFY bodies with Go's
  encoding/json (nesting is an error, not a crash).
- IDENTIFY's fields are typed as Go unmarshals them into identifyDataV2
  (and nsqlookupd's PeerInfo): a float literal is no int, a JSON null
  leaves the default, keys match case-insensitively.
- mqlookupd stops reading from a client that does not read its answers.
"""

from __future__ import annotations

import json
import socket
import struct
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher

from mqd.lookup.protocol import LookupdFactory
from mqd.lookup.protocol import frame as v1_frame
from mqd.lookup.registry import RegistrationDB
from tests.support.inprocess_broker import new_broker, scan
from tests.support.inprocess_fuzz import check_answer_or_close, fresh_broker
from tests.support.lookupd_clients import IDENTIFY as PEER
from tests.support.lookupd_clients import Conn
from tests.support.v2_client import Client, consumer
from tests.support.v2_frames import ERROR, Frame, Msg, cmd, dpub, err, ok, parse_frames, pub, sized

DECODE_FAILED = err("E_BAD_BODY IDENTIFY failed to decode JSON body")
V1_DECODE_FAILED = v1_frame(b"E_BAD_BODY IDENTIFY failed to decode JSON body")
V1_MISSING = v1_frame(b"E_BAD_BODY IDENTIFY missing fields")
INT_FIELDS = ("heartbeat_interval", "output_buffer_size", "output_buffer_timeout",
              "deflate_level", "sample_rate", "msg_timeout")
MASK64 = (1 << 64) - 1


def go_byte_to_base10(raw: str) -> int:
    """nsqd's protocol.ByteToBase10, digit by digit in uint64 (a reference, not mqd's code)."""
    n = 0
    for d in raw:
        n = (n * 10 + int(d)) & MASK64
    return n


def go_int64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def deep(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def member(key: str, value: str) -> str:
    """A JSON object of one member whose value is given as JSON text."""
    return '{"' + key + '": ' + value + "}"


@pytest.fixture
def logged_failures():
    """Log events that carry a failure (a traceback in mqd's log)."""
    events: list[dict] = []

    def observe(event: dict) -> None:
        if "log_failure" in event:
            events.append(event)

    globalLogPublisher.addObserver(observe)
    yield events
    globalLogPublisher.removeObserver(observe)


def identify_raw(body: bytes) -> bytes:
    return cmd("IDENTIFY") + sized(body)


def _lookupd_conn() -> Conn:
    """A V1 connection to an mqlookupd of its own, past the magic."""
    factory = LookupdFactory(RegistrationDB(Clock()), "lookup-host", {"TCP": 4160, "HTTP": 4161},
                             hostname="lhost")
    conn = Conn(factory, 50000)
    assert conn.send(b"  V1") == b""
    return conn


# -- RDY / REQ / DPUB numbers -------------------------------------------------------------


@pytest.mark.parametrize("raw", ["9" * 5000, "1" + "0" * 4400, "18446744073709551615",
                                 "9223372036854775808", "18446744073709551617", "9" * 4301])
def test_rdy_count_of_any_length_parses_as_nsqd_does(inproc_broker, logged_failures, raw):
    c = consumer(inproc_broker, rdy=None)
    count = go_int64(go_byte_to_base10(raw))
    out = c.request(cmd("RDY", raw))
    if 0 <= count <= 2500:
        # The digits wrapped into range: nsqd takes the count.
        assert out == [] and not c.closed
        assert c.proto.ready_count == count
    else:
        assert out == [err(f"E_INVALID RDY count {count} out of range 0-2500")]
        assert c.closed
    assert logged_failures == []


@pytest.mark.parametrize("raw", ["9" * 400, "9" * 5000, "18446744073709551615"])
def test_req_timeout_wrapping_negative_requeues_at_once(inproc_broker, publish, logged_failures, raw):
    # (2**64 - 1) ms is -1 ms as nsqd's time.Duration: clamped to 0, requeued now.
    c = consumer(inproc_broker, rdy=1)
    publish(b"x")
    [m] = c.messages()
    assert c.request(cmd("REQ", m.id, raw)) == [Msg(m.timestamp, 2, m.id, b"x")]
    assert not c.closed
    assert logged_failures == []


@pytest.mark.parametrize("raw", ["1" + "0" * 399, "9" * 19, "1000000000000", "18446744073709552",
                                 "5" * 4400])
def test_req_timeout_of_any_length_is_clamped_as_nsqd_does(inproc_broker, publish, clock, logged_failures, raw):
    c = consumer(inproc_broker, rdy=1)
    publish(b"x")
    [m] = c.messages()
    expect = go_int64(go_byte_to_base10(raw) * 1_000_000 & MASK64)
    assert c.request(cmd("REQ", m.id, raw)) == ([] if expect > 0 else [Msg(m.timestamp, 2, m.id, b"x")])
    assert not c.closed
    channel = inproc_broker.topics["t"].channels["c"]
    if expect > 0:
        # Clamped to --max-req-timeout (1 h).
        assert channel.deferred_count() == 1
        assert channel.peek("deferred", 1)[0][1] == pytest.approx(clock.seconds() + min(expect / 1e9, 3600))
    assert logged_failures == []


def test_dpub_timeout_of_thousands_of_digits_is_out_of_range(connect, logged_failures):
    c = connect()
    assert c.request(dpub("t", "9" * 5000, b"x")) == [
        err("E_INVALID DPUB timeout 18446744073709551615 out of range 0-3600000")]
    assert c.closed
    c = connect()
    assert c.request(dpub("t", "1" + "0" * 4400, b"x")) == [ok()]  # wraps to 0
    assert logged_failures == []


def test_dpub_timeout_wraps_like_go(connect, inproc_broker):
    # 18446744073709552 ms * 1e6 wraps to 384000 ns: nsqd defers by 0.384 ms.
    c = connect()
    assert c.request(cmd("SUB", "t", "c")) == [ok()]
    p = connect()
    assert p.request(dpub("t", "18446744073709552", b"x")) == [ok()]
    assert inproc_broker.topics["t"].channels["c"].deferred_count() == 1
    # 10**13 ms overflows to a negative Duration; 10**15 ms to over an hour.
    assert p.request(dpub("t", "10000000000000", b"x")) == [
        err("E_INVALID DPUB timeout 10000000000000 out of range 0-3600000")]
    p = connect()
    assert p.request(dpub("t", "1000000000000000", b"x")) == [
        err("E_INVALID DPUB timeout 1000000000000000 out of range 0-3600000")]


def test_bad_arguments_are_echoed_byte_for_byte(inproc_broker, connect):
    # nsqd prints the argument with %s: the bytes as sent, UTF-8 or not.
    c = consumer(inproc_broker, rdy=None)
    assert c.request(b"RDY 1\xff\n") == [err(b"E_INVALID RDY could not parse count 1\xff")]
    c = consumer(inproc_broker, rdy=None)
    assert c.request(b"REQ " + b"\xe9" * 16 + b" \xfe\n") == [err(b"E_INVALID REQ could not parse timeout \xfe")]
    c = consumer(inproc_broker, rdy=None)
    assert c.request(b"REQ " + b"\xe9" * 16 + b" 0\n") == [
        err(b"E_REQ_FAILED REQ " + b"\xe9" * 16 + b" failed ID not in flight")]
    assert c.request(b"TOUCH " + b"\xe9" * 16 + b"\n") == [
        err(b"E_TOUCH_FAILED TOUCH " + b"\xe9" * 16 + b" failed ID not in flight")]
    c = connect()
    assert c.request(b"DPUB t \xc3\n" + sized(b"x")) == [err(b"E_INVALID DPUB could not parse timeout \xc3")]
    c = consumer(inproc_broker, rdy=None)
    assert c.request(b"FIN " + b"\xe9" * 16 + b"\n") == [
        err(b"E_FIN_FAILED FIN " + b"\xe9" * 16 + b" failed ID not in flight")]
    c = connect()
    assert c.request(b"P\xffB t\n") == [err(b"E_INVALID invalid command P\xffB")]


# -- IDENTIFY bodies -----------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    deep(100_000),
    member("x", deep(100_000)),
    member("client_id", deep(50_000, '{"a":', "}")),
    member("heartbeat_interval", deep(20_000)),
])
def test_identify_deeply_nested_json_is_bad_body(connect, logged_failures, body):
    c = connect()
    assert c.request(identify_raw(body.encode())) == [DECODE_FAILED]
    assert c.closed
    assert logged_failures == []


@pytest.mark.parametrize("literal", ["1" * 5000, "-" + "9" * 5000, "1e999999", "1" * 5000 + ".5"])
def test_identify_huge_number_in_unknown_field_is_skipped(connect, literal):
    # Go only scans the values of fields identifyDataV2 does not have.
    c = connect()
    assert c.request(identify_raw(b'{"x": %s, "client_id": "k"}' % literal.encode())) == [ok()]
    assert c.proto.client_id == "k"
    c = connect()
    assert c.request(identify_raw(b'{"msg_timeout": %s}' % literal.encode())) == [DECODE_FAILED]


def test_lookupd_identify_null_is_missing_fields(logged_failures):
    conn = _lookupd_conn()
    assert conn.send(b"IDENTIFY\n" + sized(b"null")) == V1_MISSING
    assert conn.closed
    assert logged_failures == []


@pytest.mark.parametrize("body", [deep(100_000), member("x", deep(100_000)),
                                  member("tcp_port", deep(20_000, '{"a":', "}"))])
def test_lookupd_identify_deeply_nested_json_is_bad_body(logged_failures, body):
    conn = _lookupd_conn()
    assert conn.send(b"IDENTIFY\n" + sized(body.encode())) == V1_DECODE_FAILED
    assert conn.closed
    assert logged_failures == []


def test_lookupd_identify_huge_numbers():
    conn = _lookupd_conn()
    body = json.dumps(PEER)[:-1].encode() + b', "x": ' + b"7" * 5000 + b"}"
    assert json.loads(conn.send(b"IDENTIFY\n" + sized(body))[4:])["tcp_port"] == 4160
    conn = _lookupd_conn()
    body = json.dumps({**PEER, "tcp_port": 0}).replace('"tcp_port": 0', '"tcp_port": ' + "7" * 5000)
    assert conn.send(b"IDENTIFY\n" + sized(body.encode())) == V1_DECODE_FAILED


# -- nothing a client sends escapes the protocol --------------------------------------------

_digits = st.one_of(st.text(alphabet="0123456789", max_size=25),
                    st.builds(str.__mul__, st.sampled_from("123456789"), st.integers(4000, 6000)))
_junk = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b""))
_arg = st.one_of(_digits.map(str.encode), _junk,
                 st.sampled_from([b"ID", b"-1", b"+1", b"1.5", b"1e3", b""]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(verb=st.sampled_from([b"RDY", b"REQ", b"DPUB", b"TOUCH", b"FIN", b"SUB", b"PUB", b"MPUB"]),
       args=st.lists(_arg, max_size=3), subscribe=st.booleans())
@example(verb=b"RDY", args=[b"9" * 5000], subscribe=True)
@example(verb=b"REQ", args=[b"ID", b"9" * 400], subscribe=True)
@example(verb=b"DPUB", args=[b"t", b"9" * 5000], subscribe=False)
def test_any_command_arguments_are_answered_or_closed(verb, args, subscribe):
    failures: list[dict] = []
    observer = lambda e: failures.append(e) if "log_failure" in e else None  # noqa: E731
    globalLogPublisher.addObserver(observer)
    try:
        with tempfile.TemporaryDirectory() as path:
            broker, clock = fresh_broker(path)
            c = Client(broker)
            if subscribe:
                c.sub(rdy=1)
                Client(broker).send(pub("t", b"x"))
                [m] = c.messages()
                args = [m.id if a == b"ID" else a for a in args]
            c.send(b" ".join([verb, *args]) + b"\n" + sized(b"body"))
            check_answer_or_close(c)
            clock.advance(3601)
            scan(broker)
            c.lose()
    finally:
        globalLogPublisher.removeObserver(observer)
    assert failures == []


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                       st.floats(allow_nan=False), st.text(max_size=8))
_json = st.recursive(_json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)
_field = st.sampled_from([*INT_FIELDS, "client_id", "hostname", "user_agent", "feature_negotiation",
                          "tls_v1", "snappy", "deflate", "HEARTBEAT_INTERVAL", "x"])
_identify_body = st.one_of(
    st.dictionaries(_field, _json, max_size=4).map(lambda d: json.dumps(d).encode()),
    _json.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=60),
    st.builds(lambda f, v: member(f, v).encode(), _field, st.one_of(
        st.integers(1, 30_000).map(deep),
        _digits, st.sampled_from(["NaN", "-Infinity", "1.0", "-0", "-0.0", "1e3", "null", '"\\udc80"']))),
)


@settings(max_examples=200, deadline=None)
@given(body=_identify_body)
@example(body=member("x", deep(5000)).encode())
@example(body=member("x", "1" * 5000).encode())
def test_any_identify_body_is_answered_or_closed(body):
    with tempfile.TemporaryDirectory() as path:
        # Without compression, so every answer can be parsed here.
        broker = new_broker(path, Clock(), deflate=False, snappy=False)
        c = Client(broker)
        c.send(identify_raw(body))
        frames = check_answer_or_close(c)
        assert len(frames) == 1
        if c.closed:
            assert frames[0].payload.startswith((b"E_BAD_BODY IDENTIFY ", b"E_IDENTIFY_FAILED "))
        c.lose()


_peer_body = st.fixed_dictionaries(
    {}, optional={k: st.one_of(st.just(v), _json) for k, v in PEER.items()}).map(lambda d: json.dumps(d).encode())


@settings(max_examples=200, deadline=None)
@given(body=st.one_of(_identify_body, _peer_body), line=_junk)
@example(body=b"null", line=b"PING")
@example(body=deep(5000).encode(), line=b"PING")
def test_lookupd_any_input_is_answered_or_closed(body, line):
    conn = _lookupd_conn()
    out = conn.send(b"IDENTIFY\n" + sized(body))
    assert len(out) == 4 + struct.unpack(">i", out[:4])[0]
    if conn.closed:
        assert out[4:].startswith(b"E_BAD_BODY IDENTIFY ")
        return
    assert json.loads(out[4:])["version"]
    out = conn.send(line + b"\n")
    if conn.closed:
        assert out[4:].startswith((b"E_INVALID ", b"E_BAD_TOPIC ", b"E_BAD_CHANNEL "))
    conn.close()


# -- IDENTIFY's field types ----------------------------------------------------------------


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("literal", ["1000.0", "-0.0", "1e3", "1E3", '""', '"1000"', "[]", "{}", "true",
                                     "9223372036854775808", "-9223372036854775809"])
def test_identify_int_fields_take_only_go_ints(connect, field, literal):
    c = connect()
    assert c.request(identify_raw(b'{"%s": %s}' % (field.encode(), literal.encode()))) == [DECODE_FAILED]
    assert c.closed


@pytest.mark.parametrize("field", INT_FIELDS)
def test_identify_int_fields_accept_minus_zero_and_null(connect, field):
    c = connect()
    assert c.request(identify_raw(b'{"%s": -0, "client_id": "z"}' % field.encode())) == [ok()]
    c = connect()
    assert c.request(identify_raw(b'{"%s": null, "client_id": "z"}' % field.encode())) == [ok()]
    assert c.proto.client_id == "z"


def test_identify_int_ranges(connect):
    c = connect()
    assert c.request(identify_raw(b'{"sample_rate": 2147483648}')) == [DECODE_FAILED]
    c = connect()
    assert c.request(identify_raw(b'{"sample_rate": -2147483649}')) == [DECODE_FAILED]
    c = connect()
    assert c.request(identify_raw(b'{"sample_rate": 2147483647}')) == [
        err("E_BAD_BODY IDENTIFY sample rate (2147483647) is invalid")]
    c = connect()
    assert c.request(identify_raw(b'{"heartbeat_interval": 9223372036854775807}')) == [
        err("E_BAD_BODY IDENTIFY heartbeat interval (9223372036854775807) is invalid")]


@pytest.mark.parametrize("field, literal", [
    ("client_id", "5"), ("hostname", "[]"), ("user_agent", "{}"), ("client_id", "true"),
    ("feature_negotiation", "1"), ("feature_negotiation", '"true"'), ("tls_v1", '""'),
    ("snappy", "0.0"), ("deflate", "[]"), ("deflate", "0"),
])
def test_identify_string_and_bool_fields_typed(connect, field, literal):
    c = connect()
    assert c.request(identify_raw(b'{"%s": %s}' % (field.encode(), literal.encode()))) == [DECODE_FAILED]


def test_identify_null_leaves_defaults(connect):
    c = connect()
    assert c.request(identify_raw(b"null")) == [ok()]
    assert not c.closed
    c = connect()
    body = b'{"client_id": null, "feature_negotiation": null, "msg_timeout": null}'
    assert c.request(identify_raw(body)) == [ok()]
    # nsqd copies every field, so a client_id left out (or null) is "".
    assert (c.proto.client_id, c.proto.msg_timeout) == ("", 60.0)


def test_identify_keys_match_case_insensitively(connect):
    c = connect()
    assert c.request(identify_raw(b'{"HEARTBEAT_INTERVAL": 5}')) == [
        err("E_BAD_BODY IDENTIFY heartbeat interval (5) is invalid")]
    c = connect()
    # U+017F LATIN SMALL LETTER LONG S folds to "S", as in Go's decoder.
    assert c.request(identify_raw('{"\u017fample_rate": 100}'.encode())) == [
        err("E_BAD_BODY IDENTIFY sample rate (100) is invalid")]
    c = connect()
    [f] = c.request(identify_raw(b'{"Feature_Negotiation": true, "Msg_Timeout": 5000}'))
    assert json.loads(f.payload)["msg_timeout"] == 5000
    c = connect()
    # The last key wins; a null one changes nothing.
    body = b'{"msg_timeout": 5, "MSG_TIMEOUT": 2000, "msg_timeout": null, "Client_ID": "q"}'
    assert c.request(identify_raw(body)) == [ok()]
    assert (c.proto.msg_timeout, c.proto.client_id) == (2.0, "q")
    c = connect()
    assert c.request(identify_raw(b'{"client_id": "a", "CLIENT_ID": 5}')) == [DECODE_FAILED]


@pytest.mark.parametrize("body", [
    b'{"x": NaN}', b'{"x": Infinity}', b'{"x": -Infinity}', b"\xef\xbb\xbf{}",
    '{"client_id": "a"}'.encode("utf-16-le"), '{"client_id": "a"}'.encode("utf-32"),
])
def test_identify_json_go_rejects(connect, body):
    c = connect()
    assert c.request(identify_raw(body)) == [DECODE_FAILED]


def test_identify_strings_are_valid_unicode(connect):
    # Go turns invalid UTF-8 and lone surrogate escapes into U+FFFD.
    c = connect()
    assert c.request(identify_raw(b'{"client_id": "a\\ud800b", "hostname": "h\xffx"}')) == [ok()]
    assert (c.proto.client_id, c.proto.hostname) == ("a\ufffdb", "h\ufffdx")


@pytest.mark.parametrize("changes, answer", [
    ({"tcp_port": "4150.0"}, V1_DECODE_FAILED),
    ({"tcp_port": "1e3"}, V1_DECODE_FAILED),
    ({"http_port": "9223372036854775808"}, V1_DECODE_FAILED),
    ({"remote_address": "5"}, V1_DECODE_FAILED),
    ({"tcp_port": "-0"}, V1_MISSING),
    ({"version": "null"}, V1_MISSING),
])
def test_lookupd_identify_field_types(changes, answer):
    fields = {**PEER, **{k: f"@{k}@" for k in changes}}
    body = json.dumps(fields)
    for key, literal in changes.items():
        body = body.replace(f'"@{key}@"', literal)
    conn = _lookupd_conn()
    assert conn.send(b"IDENTIFY\n" + sized(body.encode())) == answer
    assert conn.closed


def test_lookupd_identify_keys_match_case_insensitively():
    conn = _lookupd_conn()
    body = json.dumps({k.upper(): v for k, v in PEER.items()}).encode()
    assert json.loads(conn.send(b"IDENTIFY\n" + sized(body))[4:])["version"] == "1.3.0"
    assert conn.proto.peer.broadcast_address == "b1"
    assert conn.proto.peer.tcp_port == 4150


# -- mqlookupd stops reading while its answers are not read ---------------------------------


def test_lookupd_is_a_streaming_producer_of_its_transport():
    conn = _lookupd_conn()
    transport = conn.transport
    assert transport.producer is conn.proto and transport.streaming
    # The transport's buffer is full: stop reading from the socket ...
    conn.proto.pauseProducing()
    assert transport.producerState == "paused"
    # ... until it has drained.
    conn.proto.resumeProducing()
    assert transport.producerState == "producing"
    assert conn.send(b"PING\n") == v1_frame(b"OK")
    # A registered producer would hold the close back forever: it goes first.
    conn.proto.pauseProducing()
    assert conn.send(b"NOPE\n") == v1_frame(b"E_INVALID invalid command NOPE")
    assert conn.closed and transport.producer is None


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _recv_frames(sock: socket.socket, count: int, timeout: float = 30.0) -> list[bytes]:
    """Read `count` V1 answers, and not a byte more."""
    sock.settimeout(timeout)
    pending = b""
    out: list[bytes] = []
    while len(out) < count:
        chunk = sock.recv(1 << 20)
        assert chunk, "lookupd closed the connection"
        data = pending + chunk
        pos = 0
        while len(out) < count and len(data) - pos >= 4:
            end = pos + 4 + struct.unpack_from(">i", data, pos)[0]
            if end > len(data):
                break
            out.append(data[pos + 4:end])
            pos = end
        pending = data[pos:]
    assert pending == b"", "more answers than commands"
    return out


def test_lookupd_stops_reading_from_a_client_that_does_not_read(start_lookupd):
    lookupd = start_lookupd()
    pid = lookupd.proc.pid
    addr = (lookupd.tcp_host, lookupd.tcp_port)
    before = _rss_kb(pid)
    pings = 20 * (1 << 20) // 5
    data = b"  V1" + b"PING\n" * pings
    with socket.create_connection(addr, timeout=5) as flood, \
            socket.create_connection(addr, timeout=5) as other:
        flood.setblocking(False)
        sent, stalled_since = 0, None
        # Send without reading until lookupd stops taking more (or all is sent).
        while sent < len(data):
            try:
                sent += flood.send(data[sent:sent + (1 << 20)])
                stalled_since = None
            except BlockingIOError:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 2.0:
                    break
                time.sleep(0.01)
        grown_mb = (_rss_kb(pid) - before) / 1024
        assert grown_mb < 64, f"lookupd grew by {grown_mb:.0f} MB"
        assert sent < len(data), "lookupd read 20 MiB of PINGs it could not answer"
        # Others are still served.
        other.sendall(b"  V1PING\n")
        assert _recv_frames(other, 1) == [b"OK"]
        # Reading the answers lets the rest in; every PING is answered, in order.
        flood.setblocking(True)
        flood.settimeout(30)
        sender = threading.Thread(target=flood.sendall, args=(data[sent:],))
        sender.start()
        answers = _recv_frames(flood, pings, timeout=60)
        sender.join(60)
        assert answers == [b"OK"] * pings
        flood.sendall(b"PING\n")
        assert _recv_frames(flood, 1) == [b"OK"]
        grown_mb = (_rss_kb(pid) - before) / 1024
        assert grown_mb < 64, f"lookupd grew by {grown_mb:.0f} MB"
    log = lookupd.log()
    assert "Traceback" not in log and "Unhandled" not in log, lookupd.describe()


# -- real processes: no traceback in the log --------------------------------------------------


def test_lookupd_process_answers_bad_identify_without_traceback(start_lookupd):
    lookupd = start_lookupd()
    for body, answer in [(b"null", V1_MISSING), (deep(100_000).encode(), V1_DECODE_FAILED),
                         (b'{"tcp_port": 1.0}', V1_DECODE_FAILED)]:
        with socket.create_connection((lookupd.tcp_host, lookupd.tcp_port), timeout=5) as sock:
            sock.sendall(b"  V1IDENTIFY\n" + sized(body))
            sock.settimeout(10)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
            assert got == answer
    with socket.create_connection((lookupd.tcp_host, lookupd.tcp_port), timeout=5) as sock:
        # An error that echoes bytes that are not UTF-8 is logged too.
        sock.sendall(b"  V1IDENTIFY\n" + sized(json.dumps(PEER).encode()) + b"REGISTER \xff\xfe\n")
        sock.settimeout(10)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        assert got.endswith(v1_frame(b"E_BAD_TOPIC REGISTER topic name '\xff\xfe' is not valid"))
    log = lookupd.log()
    assert "Traceback" not in log and "Unhandled" not in log, lookupd.describe()


def test_broker_process_answers_bad_arguments_without_traceback(start_broker):
    broker = start_broker()
    host, port = broker.tcp_host, broker.tcp_port
    cases = [
        (cmd("SUB", "t", "c") + cmd("RDY", "9" * 5000),
         [ok(), err(f"E_INVALID RDY count {go_int64(go_byte_to_base10('9' * 5000))} out of range 0-2500")]),
        (dpub("t", "9" * 5000, b"x"),
         [err("E_INVALID DPUB timeout 18446744073709551615 out of range 0-3600000")]),
        (identify_raw(deep(100_000).encode()), [DECODE_FAILED]),
        (cmd("PUB", b"\xff\xfe") + sized(b"x"), [err('E_BAD_TOPIC PUB topic name "\\xff\\xfe" is not valid')]),
    ]
    for data, answer in cases:
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(b"  V2" + data)
            sock.settimeout(10)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
            frames = [f for f in parse_frames(got) if f != Frame(0, b"_heartbeat_")]
            assert frames == answer
            assert frames[-1].type == ERROR
    log = broker.log()
    assert "Traceback" not in log and "Unhandled" not in log, broker.describe()

