"""Fuzzing V2, V1 (lookupd) and the HTTP APIs with one oracle: no traceback, nothing
lost, a well-behaved client still served.

In-process (hypothesis): the protocols on StringTransports and the HTTP
resources through tests/support/http_client.py, on a broker driven by a `task.Clock`.
Before the fuzzed input, a control connection publishes messages into a
control channel; after it, the control client must get correct answers,
the channel must still count every acknowledged message and give them all
back, and no failure or critical/error event may have been logged (an
exception escaping `dataReceived` fails the example directly).

The HTTP fuzzers of the broker and of mqlookupd also run under
`--http-auth-required` (the `..._with_http_auth_required` tests): each
request carries a random caller (no header, a malformed one, a refused
secret, partial grants, every grant; tests/support/auth_fuzz.py) and a
refused request must be nsqd's JSON 401/403 and change nothing.

One real-process smoke test sends a few hundred random streams and requests
over real sockets to a twistd broker, then runs the same checks and reads
its log for 'Traceback' / 'Unhandled'.

MQD_FUZZ_EXAMPLES=N runs N examples per hypothesis test (and N streams in
the real-process test) instead of the CI counts.
"""

from __future__ import annotations

import json
import random
import tempfile
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from mqd.logs import set_log_level
from mqd.lookup.protocol import LookupdFactory, frame
from mqd.lookup.registry import RegistrationDB
from mqd.message import IdFactory
from tests.support.auth_fuzz import (
    FULL,
    FULL_SECRET,
    PARTIAL,
    RequiredAuthHarness,
    caller,
    check_refusal,
    guarded_lookupd,
    lookupd_state,
    open_answers,
    random_caller,
)
from tests.support.authd import grant
from tests.support.broker_fuzz import fuzz_broker
from tests.support.control_checks import Control, log_problems
from tests.support.fuzz_inputs import (
    EXAMPLES_OVERRIDE,
    HTTP_BODIES,
    HTTP_METHODS,
    HTTP_PATHS,
    HTTP_QUERY_KEYS,
    HTTP_QUERY_VALUES,
    LOOKUPD_TOKENS,
    V2_TOKENS,
    examples,
    http_sweep,
)
from tests.support.http_client import HTTPClient, parse_response
from tests.support.inprocess_broker import NODE_ID, START_TIME
from tests.support.inprocess_fuzz import Harness, check_answer_or_close
from tests.support.log_watch import LogWatch
from tests.support.lookupd_clients import Conn, LookupdClient
from tests.support.processes import FAST_SCAN
from tests.support.v2_client import Client
from tests.support.v2_frames import MAGIC, cmd, pub, sized


@pytest.fixture(autouse=True)
def _snapshots_in_line(sync_threads):
    """The in-process brokers here run on a Clock in temporary directories (see sync_threads)."""


def _feed(client: Client, data: bytes, chunk: int) -> None:
    for i in range(0, len(data), chunk):
        if client.closed:
            break
        client.send(data[i:i + chunk])


# -- V2 ---------------------------------------------------------------------------------

# A broker on the test clock hands out the same ids every time: FIN, REQ and
# TOUCH can then hit messages really in flight to the fuzzed client.
_IDS = IdFactory(NODE_ID).new_ids(16, int(START_TIME * 1e9))
_ID_TOKENS = [
    line
    for msg_id in _IDS
    for line in (cmd("FIN", msg_id), cmd("TOUCH", msg_id), cmd("REQ", msg_id, 0),
                 cmd("REQ", msg_id, 2**63), cmd("REQ", msg_id, 10**30),
                 cmd("REQ", msg_id, "9" * 5000))
]

v2_token = st.one_of(
    st.sampled_from(V2_TOKENS),
    st.sampled_from(_ID_TOKENS),
    st.binary(max_size=40),
    st.binary(max_size=12).map(sized),
)


@examples(200)
@given(tokens=st.lists(v2_token, max_size=14), chunk=st.integers(1, 4096))
def test_fuzzed_v2_stream_loses_nothing_and_the_broker_still_serves(tokens, chunk):
    with tempfile.TemporaryDirectory() as path, LogWatch() as logs:
        h = Harness(path)
        c = Client(h.broker, port=3, magic=False)
        _feed(c, MAGIC + b"".join(tokens), chunk)
        if not (c.proto.deflate or c.proto.snappy):  # compressed output is not frames
            check_answer_or_close(c)
        h.check("the fuzzed stream")
        h.clock.advance(61)  # heartbeats, msg timeouts, output flushes of the fuzzed client
        c.lose()
        h.clock.advance(61)
        h.check("the fuzzed connection closing")
        h.drain()
        logs.check("V2 stream")


def _v2_case(tokens: bytes, what: str) -> str | None:
    """One stream through the whole oracle; the failure as text, or None."""
    try:
        with tempfile.TemporaryDirectory() as path, LogWatch() as logs:
            h = Harness(path)
            c = Client(h.broker, port=3)
            c.send(tokens)
            if not (c.proto.deflate or c.proto.snappy):
                check_answer_or_close(c)
            h.check(what)
            h.clock.advance(61)
            c.lose()
            h.clock.advance(61)
            h.drain()
            logs.check(what)
    except Exception as e:  # noqa: BLE001 - collected, so one run shows every failing input
        return f"{what}: {type(e).__name__}: {str(e)[:300]}"
    return None


def test_every_v2_token_alone_and_with_a_message_in_flight():
    """The systematic half of the V2 fuzzing: each nasty input once, fresh and subscribed."""
    in_flight = cmd("SUB", "t", "c") + cmd("RDY", 10) + pub("t", b"in flight")
    failures = [
        failure
        for token in [*V2_TOKENS, *_ID_TOKENS[:24]]
        for prefix in (b"", in_flight)
        if (failure := _v2_case(prefix + token, f"{'subscribed, ' if prefix else ''}{token[:60]!r}"))
    ]
    assert not failures, f"{len(failures)} inputs failed:\n" + "\n".join(failures)


# -- V1 (lookupd) --------------------------------------------------------------------------

lookupd_token = st.one_of(
    st.sampled_from(LOOKUPD_TOKENS),
    st.binary(max_size=30),
    st.binary(max_size=12).map(sized),
)

_LOOKUPD_PEER = {"version": "1.3.0", "tcp_port": 4150, "http_port": 4151, "hostname": "ctl",
                 "broadcast_address": "control-broker"}


class V1Conn(Conn):
    def identify(self) -> bytes:
        return super().identify(**_LOOKUPD_PEER)


def _lookupd_frames(data: bytes) -> list[bytes]:
    """Split V1 output (size + payload, no type) into payloads; fails on a partial frame."""
    out, pos = [], 0
    while pos < len(data):
        size = int.from_bytes(data[pos:pos + 4], "big")
        assert pos + 4 + size <= len(data), f"partial V1 frame at {pos}: {data[pos:]!r}"
        out.append(data[pos + 4:pos + 4 + size])
        pos += 4 + size
    return out


@examples(200)
@given(tokens=st.lists(lookupd_token, max_size=10), chunk=st.integers(1, 4096),
       magic=st.booleans())
def test_fuzzed_lookupd_stream_keeps_registrations_and_serves(tokens, chunk, magic):
    _lookupd_case((b"  V1" if magic else b"") + b"".join(tokens), chunk)


def _lookupd_case(data: bytes, chunk: int) -> None:
    clock = Clock()
    clock.advance(START_TIME)
    db = RegistrationDB(clock)
    factory = LookupdFactory(db, "lookup-host", {"TCP": 4160, "HTTP": 4161}, hostname="lhost")
    http = LookupdClient(db, clock)
    with LogWatch() as logs:
        control = V1Conn(factory, 1)
        assert control.send(b"  V1") == b""
        assert json.loads(_lookupd_frames(control.identify())[0])["tcp_port"] == 4160
        assert control.send(b"REGISTER zz_control zz_c\n") == frame(b"OK")
        fuzzed = V1Conn(factory, 2)
        out = b""
        for i in range(0, len(data), chunk):
            if fuzzed.transport.disconnecting:
                break
            out += fuzzed.send(data[i:i + chunk])
        _lookupd_frames(out)  # whole frames only
        clock.advance(10)
        fuzzed.proto.connectionLost(Failure(ConnectionDone()))
        # The control registration is untouched and a new client is served.
        assert control.send(b"PING\n") == frame(b"OK")
        fresh = V1Conn(factory, 3)
        assert fresh.send(b"  V1PING\n") == frame(b"OK")
        assert fresh.identify()[4:5] == b"{"
        assert fresh.send(b"REGISTER zz_other\n") == frame(b"OK")
        r = http.get("/lookup?topic=zz_control")
        assert r.status == 200, r
        assert [p["broadcast_address"] for p in r.json()["producers"]] == ["control-broker"]
        assert r.json()["channels"] == ["zz_c"]
        for path in ("/nodes", "/topics", "/debug", "/info", "/ping"):
            assert http.get(path).status == 200, path
        logs.check("lookupd stream")


# -- HTTP -------------------------------------------------------------------------------------

_query_value = st.one_of(
    st.sampled_from(HTTP_QUERY_VALUES),
    st.text(max_size=12).map(lambda s: quote(s, safe="", errors="surrogatepass")),
)
_query = st.lists(st.tuples(st.sampled_from(HTTP_QUERY_KEYS), _query_value), max_size=4).map(
    lambda pairs: "&".join(f"{k}={v}" for k, v in pairs))
_target = st.builds(
    lambda path, query, extra: path + extra + (f"?{query}" if query else ""),
    st.sampled_from(HTTP_PATHS), _query,
    st.sampled_from(["", "", "", "/", "/x", "%2f", "/../info"]),
)
_body = st.one_of(st.none(), st.sampled_from(HTTP_BODIES), st.binary(max_size=64))
http_request = st.tuples(st.sampled_from(HTTP_METHODS), _target, _body)


def _fire(client: HTTPClient, method: str, target: str, body: bytes | None,
          headers: dict[str, str] | None = None):
    transport = client.send(method, target, body, headers)
    response = parse_response(transport.value(), head=method == "HEAD")
    transport.protocol.connectionLost(Failure(ConnectionDone()))
    return response


# Under --http-auth-required: a caller for each request (the kind, its headers).
_callers = st.lists(caller(), min_size=4, max_size=4)


def _broker_http_case(requests: list, callers: list | None) -> None:
    """The fuzzed requests on test_fuzz's harness; `callers`: under --http-auth-required, who sends each."""
    with tempfile.TemporaryDirectory() as path, LogWatch() as logs:
        h = RequiredAuthHarness(path) if callers else Harness(path)
        opened = open_answers(h.http) if callers else set()
        try:
            for i, (method, target, body) in enumerate(requests):
                kind, headers = callers[i] if callers else ("", None)
                shown = f"{method} {target} headers={headers} body={(body or b'')[:40]!r}"
                before = h.state() if callers else None
                response = _fire(h.http, method, target, body, headers)
                assert response is not None, f"{shown}: no complete answer"
                assert response.status != 500, f"{shown}: {response.status} {response.body[:300]!r}"
                if callers:
                    check_refusal(kind, method, response, before, h.state(), opened, shown)
                h.check(shown)
        finally:
            set_log_level("info")  # PUT /config/log_level is process-wide
        h.drain()
        logs.check("HTTP requests")


@examples(200)
@given(requests=st.lists(http_request, min_size=1, max_size=4))
def test_fuzzed_http_requests_lose_nothing_and_the_api_still_serves(requests):
    _broker_http_case(requests, None)


@examples(200)
@given(requests=st.lists(http_request, min_size=1, max_size=4), callers=_callers)
def test_fuzzed_http_requests_with_http_auth_required(requests, callers):
    _broker_http_case(requests, callers)


def _lookupd_http_case(requests: list, callers: list | None) -> None:
    clock = Clock()
    clock.advance(START_TIME)
    db = RegistrationDB(clock)
    http = guarded_lookupd(db, clock) if callers else LookupdClient(db, clock)
    factory = LookupdFactory(db, "lookup-host", {"TCP": 4160, "HTTP": 4161}, hostname="lhost")
    with LogWatch() as logs:
        control = V1Conn(factory, 1)
        control.send(b"  V1")
        control.identify()
        assert control.send(b"REGISTER zz_control zz_c\n") == frame(b"OK")
        opened = open_answers(http) if callers else set()
        for i, (method, target, body) in enumerate(requests):
            kind, headers = callers[i] if callers else ("", None)
            shown = f"{method} {target} headers={headers} body={(body or b'')[:40]!r}"
            before = lookupd_state(db)
            response = _fire(http, method, target, body, headers)
            assert response is not None, f"{shown}: no complete answer"
            assert response.status != 500, f"{shown}: {response.status} {response.body[:300]!r}"
            if callers:
                check_refusal(kind, method, response, before, lookupd_state(db), opened, shown)
        r = http.get("/lookup?topic=zz_control")
        assert r.status == 200 and r.json()["channels"] == ["zz_c"], r
        logs.check("lookupd HTTP requests")


@examples(150)
@given(requests=st.lists(http_request, min_size=1, max_size=4))
def test_fuzzed_lookupd_http_requests_are_answered(requests):
    _lookupd_http_case(requests, None)


@examples(150)
@given(requests=st.lists(http_request, min_size=1, max_size=4), callers=_callers)
def test_fuzzed_lookupd_http_requests_with_http_auth_required(requests, callers):
    _lookupd_http_case(requests, callers)


def test_every_lookupd_token_alone_and_identified():
    failures = []
    ident = b"IDENTIFY\n" + sized(json.dumps(_LOOKUPD_PEER).encode())
    for token in LOOKUPD_TOKENS:
        for prefix in (b"  V1", b"  V1" + ident):
            try:
                _lookupd_case(prefix + token, 4096)
            except Exception as e:  # noqa: BLE001 - collected, so one run shows every failing input
                failures.append(f"{(prefix + token)[:80]!r}: {type(e).__name__}: {str(e)[:300]}")
    assert not failures, f"{len(failures)} inputs failed:\n" + "\n".join(failures)


def _sweep(client: HTTPClient, check, state=None, opened=frozenset()) -> list[str]:
    """Every request of http_sweep; with `state` (--http-auth-required), each from a random caller."""
    failures = []
    rng = random.Random(7)
    for i, (method, target, body) in enumerate(http_sweep()):
        kind, headers = random_caller(rng) if state is not None else ("", None)
        shown = f"{method} {target[:100]} headers={str(headers)[:60]} body={(body or b'')[:30]!r}"
        before = state() if state is not None else None
        try:
            response = _fire(client, method, target, body, headers)
        except Exception as e:  # noqa: BLE001 - collected
            failures.append(f"{shown}: raised {type(e).__name__}: {e}")
            continue
        if response is None:
            failures.append(f"{shown}: no complete answer")
        elif response.status == 500:
            failures.append(f"{shown}: 500 {response.body[:200]!r}")
        elif state is not None:
            try:
                check_refusal(kind, method, response, before, state(), set(opened), shown)
            except AssertionError as e:
                failures.append(str(e)[:400])
        if i % 50 == 0:
            check(shown)
    return failures


def _broker_sweep(auth: bool) -> None:
    with tempfile.TemporaryDirectory() as path, LogWatch() as logs:
        h: Any = RequiredAuthHarness(path) if auth else Harness(path)
        try:
            if auth:
                failures = _sweep(h.http, h.check, h.state, open_answers(h.http))
            else:
                failures = _sweep(h.http, h.check)
        finally:
            set_log_level("info")
        h.check("the sweep")
        h.drain()
        failures += logs.texts()
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


def test_every_route_with_every_body_and_query_value():
    """The systematic half of the HTTP fuzzing: each route x each nasty body and query value."""
    _broker_sweep(False)


def test_every_route_with_every_body_and_query_value_with_http_auth_required():
    """The same sweep, each request from a random caller (the full secret half the time)."""
    _broker_sweep(True)


def _lookupd_sweep(auth: bool) -> None:
    clock = Clock()
    clock.advance(START_TIME)
    db = RegistrationDB(clock)
    http = guarded_lookupd(db, clock) if auth else LookupdClient(db, clock)
    factory = LookupdFactory(db, "lookup-host", {"TCP": 4160, "HTTP": 4161}, hostname="lhost")
    control = V1Conn(factory, 1)
    control.send(b"  V1")
    control.identify()
    assert control.send(b"REGISTER zz_control zz_c\n") == frame(b"OK")

    def check(what: str) -> None:
        r = http.get("/lookup?topic=zz_control")
        assert r.status == 200 and r.json()["channels"] == ["zz_c"], (what, r)

    with LogWatch() as logs:
        if auth:
            failures = _sweep(http, check, lambda: lookupd_state(db), open_answers(http))
        else:
            failures = _sweep(http, check)
        failures += logs.texts()
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


def test_every_lookupd_route_with_every_body_and_query_value():
    _lookupd_sweep(False)


def test_every_lookupd_route_with_every_body_and_query_value_with_http_auth_required():
    _lookupd_sweep(True)


# -- a real process ---------------------------------------------------------------------------


def test_real_broker_survives_random_streams_and_requests(start_broker):
    broker = start_broker(*FAST_SCAN)
    control = Control(broker)
    control.setup(20)
    streams = EXAMPLES_OVERRIDE or 300
    report = fuzz_broker(broker, control, streams=streams, http_requests=max(60, streams // 5),
                         seed=16)
    control.drain_and_compare()
    problems = log_problems(broker)
    assert not report.http_500, f"{len(report.http_500)} answers 500:\n" + "\n".join(report.http_500[:5])
    assert not report.http_no_answer, "no answer:\n" + "\n".join(report.http_no_answer[:5])
    assert not problems, f"{len(problems)} log lines:\n{broker.describe()}"
    broker.stop_cleanly()
    print(f"\nfuzzed {report.streams} streams + {report.http_requests} HTTP requests in "
          f"{report.seconds:.1f} s; the broker closed {report.closed_by_broker} connections")


def test_real_broker_with_http_auth_required_survives_random_streams_and_requests(start_broker, authd):
    """The same under --http-auth-required (a real auth server): each request from a random caller."""
    authd.answers[FULL_SECRET] = grant(FULL)
    for secret, grants in PARTIAL.items():
        authd.answers[secret] = grant(*grants)
    broker = start_broker(*FAST_SCAN, f"--auth-http-address={authd.address}", "--http-auth-required")
    control = Control(broker, secret=FULL_SECRET.encode())
    control.setup(20)
    streams = EXAMPLES_OVERRIDE or 100
    report = fuzz_broker(broker, control, streams=streams, http_requests=max(60, streams // 2), seed=17,
                         callers=random_caller)
    control.drain_and_compare()
    problems = log_problems(broker)
    assert not report.http_500, f"{len(report.http_500)} answers 500:\n" + "\n".join(report.http_500[:5])
    assert not report.http_no_answer, "no answer:\n" + "\n".join(report.http_no_answer[:5])
    assert not report.bad_refusals, "\n".join(report.bad_refusals[:5])
    assert report.refused > 0
    assert not problems, f"{len(problems)} log lines:\n{broker.describe()}"
    broker.stop_cleanly()
    print(f"\nfuzzed {report.streams} streams + {report.http_requests} HTTP requests ({report.refused} refused) "
          f"in {report.seconds:.1f} s")
