"""What the client makes of a broker that answers wrongly: a clean, logged close, never a traceback.

On StringTransports and a task.Clock: handshake answers nested too deep
for Python's JSON decoder, of the wrong shape or types, frames declaring
sizes the client will not buffer, error frames where none belongs, bytes
dripped one at a time; then what the consumer and the producer do with
those ends (one log line per attempt, no "Unhandled error in Deferred", a
refused AUTH fatal for an nsqd that never let the consumer in).
"""

from __future__ import annotations

import gc
import json
import struct

import pytest
from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure

from mqd.client import errors
from mqd.client.config import Config
from mqd.client.consumer import Consumer
from mqd.client.errors import (
    AuthRefusedError,
    ConnectionClosed,
    HeartbeatTimeout,
    ServerProtocolError,
)
from mqd.client.producer import Producer
from mqd.client.protocol import NSQClientProtocol
from mqd.wire.framing import OK
from tests.support.client_conn import Conn, error, message_frame, ready, response, server_json
from tests.support.consumer_fakes import ERROR, RESPONSE, Lookupd, Network, Recorder, make
from tests.support.producer_fakes import ADDRESS, Endpoint, Outcome

DEEP = [b"[" * 100_000, b'{"a":' * 100_000, b"[" * 100_000 + b"]" * 100_000]


class Logged:
    """mqd.client's lines at warn and above, and every failure or critical event from anywhere."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.bad: list[str] = []

    def __call__(self, event: dict) -> None:
        level = event.get("log_level")
        if "log_failure" in event or level == LogLevel.critical:
            failure = event.get("log_failure")
            self.bad.append(formatEvent(event) + (failure.getTraceback() if failure else ""))
        elif (event.get("log_namespace") == "mqd.client"
              and level in (LogLevel.warn, LogLevel.error)):
            self.lines.append(formatEvent(event))


@pytest.fixture
def logged():
    """The log lines of the test; no traceback or critical event may be among them."""
    watch = Logged()
    globalLogPublisher.addObserver(watch)
    try:
        yield watch
        gc.collect()  # a Deferred failed with nobody listening says so when collected
    finally:
        globalLogPublisher.removeObserver(watch)
    assert not watch.bad, watch.bad[:2]


def closed_with(conn: Conn, cls: type[BaseException]) -> BaseException:
    """The connection closed itself, `ready` failed with a `cls`, and the delegate heard it once."""
    assert conn.transport.disconnecting
    conn.lose()
    err = conn.results[0].value if conn.results and isinstance(conn.results[0], Failure) else None
    assert isinstance(err, cls), conn.results
    kinds = conn.delegate.kinds()
    assert kinds.count("closed") == 1 and "ready" not in kinds
    return err


# -- handshake answers -----------------------------------------------------------------


@pytest.mark.parametrize("payload", DEEP, ids=["lists", "objects", "closed-lists"])
def test_identify_answer_nested_too_deep_fails_the_handshake(payload, logged):
    conn = Conn()
    conn.feed(response(payload))  # RecursionError escaped dataReceived here once
    err = closed_with(conn, ServerProtocolError)
    assert "IDENTIFY answer is nested too deep" in str(err)


@pytest.mark.parametrize(("payload", "what"), [
    (b"[]", "is not a JSON object"),
    (b"null", "is not a JSON object"),
    (b'"OK"', "is not a JSON object"),
    (b"\xff\xfe{", "is not JSON"),
    (b'{"max_rdy_count": 25', "is not JSON"),
    (b"1" * 5000, "is not JSON"),  # more digits than Python converts
    # go-nsq's json.Unmarshal into its IdentifyResponse fails on these, and so must the client:
    (b'{"snappy": "false"}', "field snappy is not a boolean"),  # was taken as true: snappy on
    (b'{"tls_v1": 1}', "field tls_v1 is not a boolean"),
    (b'{"auth_required": "yes"}', "field auth_required is not a boolean"),
    (b'{"max_rdy_count": 2500.0}', "field max_rdy_count is not an integer"),
    (b'{"max_rdy_count": 9223372036854775808}', "field max_rdy_count is not an integer"),
    (b'{"max_rdy_count": true}', "field max_rdy_count is not an integer"),
])
def test_identify_answer_of_the_wrong_shape_fails_the_handshake(payload, what, logged):
    conn = Conn(snappy=True)
    conn.feed(response(payload))
    err = closed_with(conn, ServerProtocolError)
    assert f"IDENTIFY answer {what}" in str(err)
    assert conn.proto._codec is None and conn.proto.compression is None


def test_null_fields_are_left_alone_as_go_does(logged):
    conn = Conn()
    conn.feed(response(b'{"max_rdy_count": null, "tls_v1": null, "auth_required": null}'))
    assert conn.results == [conn.proto]
    assert conn.proto.max_rdy_count == 2500


@pytest.mark.parametrize(("payload", "what"), [
    *[(deep, "is nested too deep") for deep in DEEP],
    (b'{"permission_count": "2"}', "field permission_count is not an integer"),
    (b'{"identity": 7}', "field identity is not a string"),
    (b"[1]", "is not a JSON object"),
    (b"OK", "is not JSON"),
])
def test_auth_answer_nested_too_deep_or_of_the_wrong_shape_fails_the_handshake(payload, what,
                                                                               logged):
    conn = Conn(auth_secret="s")
    conn.feed(server_json(auth_required=True))
    conn.feed(response(payload))
    err = closed_with(conn, ServerProtocolError)
    assert f"AUTH answer {what}" in str(err)


# -- what the tools print: go-nsq's words ------------------------------------------------------

_GO_FIELD = "into Go struct field IdentifyResponse"


@pytest.mark.parametrize(("answer", "nsq_text"), [
    (response(b'{"max_rdy_count": 1000000000000000000000000000000}'),
     f"failed to IDENTIFY - json: cannot unmarshal number 1000000000000000000000000000000 {_GO_FIELD}"
     ".max_rdy_count of type int64"),
    (response(b'{"tls_v1": "yes"}'),
     f"failed to IDENTIFY - json: cannot unmarshal string {_GO_FIELD}.tls_v1 of type bool"),
    (response(b'{"max_rdy_count": 25'), "failed to IDENTIFY - unexpected end of JSON input"),
    (b"HTTP/1.1 400 Bad Request\r\n\r\n",
     "failed to IDENTIFY - unexpected HTTP response, a nsqd TCP endpoint is required"),
    (struct.pack(">ii", 5, 9) + b"x", "failed to IDENTIFY - bad frame type 9"),
])
def test_an_identify_answer_that_cannot_be_used_is_a_handshake_refusal_in_go_nsqs_words(
        answer, nsq_text, logged):
    conn = Conn()
    conn.feed(answer)
    err = closed_with(conn, errors.UnusableAnswerError)
    assert isinstance(err, errors.HandshakeRefusedError)
    assert str(err).startswith("protocol error: ")  # the client's own account, as before
    assert err.nsq_text == nsq_text


def test_an_error_frame_answering_identify_is_a_refusal_and_still_its_own_class(logged):
    conn = Conn()
    conn.feed(error(b"E_BAD_BODY IDENTIFY heartbeat interval (999999999) is invalid"))
    err = closed_with(conn, errors.IdentifyRefusedError)
    assert isinstance(err, errors.BadBodyError) and isinstance(err, errors.HandshakeRefusedError)
    assert str(err) == "E_BAD_BODY IDENTIFY heartbeat interval (999999999) is invalid"
    assert err.nsq_text == "failed to IDENTIFY - " + str(err)


def test_an_auth_answer_that_cannot_be_used_is_go_nsqs_bare_json_error(logged):
    conn = Conn(auth_secret="s")
    conn.feed(server_json(auth_required=True))
    conn.feed(response(b'{"permission_count": "2"}'))
    err = closed_with(conn, errors.UnusableAnswerError)
    assert err.nsq_text == ("json: cannot unmarshal string into Go struct field "
                            "AuthResponse.permission_count of type int64")


def test_a_bad_frame_after_the_handshake_is_no_handshake_refusal(logged):
    conn = ready()
    conn.feed(struct.pack(">ii", 5, 9) + b"x")
    conn.lose()
    closed = conn.delegate.events[-1][1].value
    assert isinstance(closed, ServerProtocolError)
    assert not isinstance(closed, errors.HandshakeRefusedError)  # a subscribed consumer reconnects


# -- sizes -------------------------------------------------------------------------------


def test_a_huge_declared_size_closes_before_anything_is_buffered(logged):
    conn = ready()
    d = conn.proto.pub("t", b"x")
    results: list = []
    d.addBoth(results.append)
    conn.feed(struct.pack(">ii", 2**31 - 1, 2) + b"\0" * 65536)
    assert conn.transport.disconnecting
    assert conn.proto._chunks == [] and conn.proto._chunks_len <= 8
    conn.lose()
    err = results[0].value
    assert isinstance(err, ServerProtocolError)
    assert f"frame of {2**31 - 1} bytes is over the limit of {64 * 1024 * 1024 + 30}" in str(err)


def test_max_msg_size_bounds_a_message_body_exactly():
    conn = ready(max_msg_size=1000)
    conn.feed(message_frame(b"m" * 1000))
    assert conn.delegate.kinds()[-1] == "message"
    conn.feed(message_frame(b"m" * 1001)[:100])  # only its header is needed to refuse it
    assert conn.transport.disconnecting and conn.proto._chunks == []
    conn.lose()
    closed = conn.delegate.events[-1]
    assert closed[0] == "closed" and "over the limit of 1030 (max_msg_size 1000)" in str(closed[1].value)


def test_max_msg_size_zero_accepts_what_the_size_field_can_say():
    conn = ready(max_msg_size=0)
    assert conn.proto.max_frame_size == 2**31 - 1
    conn.feed(struct.pack(">ii", 2**31 - 1, 2) + b"\0" * 100)
    assert not conn.transport.disconnecting


def test_an_http_answer_says_an_nsqd_tcp_address_is_needed(logged):
    conn = Conn()
    conn.feed(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    err = closed_with(conn, ServerProtocolError)
    assert str(err) == "protocol error: unexpected HTTP response, a nsqd TCP endpoint is required"


# -- error frames in the wrong place ---------------------------------------------------


def test_any_error_frame_during_identify_ends_the_handshake(logged):
    conn = Conn()
    conn.feed(error(b"E_FIN_FAILED FIN 0123456789abcdef failed ID not in flight"))
    err = closed_with(conn, errors.FinFailedError)
    assert not isinstance(err, AuthRefusedError)


@pytest.mark.parametrize(("text", "cls"), [
    (b"E_AUTH_FAILED AUTH failed", errors.AuthFailedError),
    (b"E_UNAUTHORIZED AUTH no authorizations found", errors.UnauthorizedError),
    (b"E_SOMETHING_NEW later nsqd", errors.NSQError),
])
def test_an_error_answering_auth_is_an_auth_refusal_and_still_its_own_class(text, cls, logged):
    conn = Conn(auth_secret="wrong")
    conn.feed(server_json(auth_required=True))
    conn.feed(error(text))
    err = closed_with(conn, AuthRefusedError)
    assert isinstance(err, cls) and err.fatal
    assert err.code == text.split()[0].decode()
    assert str(err) == text.decode()  # an NSQError's text, whatever the step
    assert err.nsq_text == "Error authenticating " + text.decode()  # go-nsq's, nsq_tail's last line


def test_the_same_code_after_the_handshake_is_no_auth_refusal(logged):
    conn = ready()
    results: list = []
    conn.proto.sub("t", "c").addBoth(results.append)
    conn.feed(error(b"E_AUTH_FAILED AUTH failed"))  # the TTL's re-query failed: SUB's answer
    err = results[0].value
    assert isinstance(err, errors.AuthFailedError) and not isinstance(err, AuthRefusedError)


def test_missing_secret_is_go_nsqs_auth_required(logged):
    conn = Conn()
    conn.feed(server_json(auth_required=True))
    err = closed_with(conn, errors.AuthRequiredError)
    assert isinstance(err, AuthRefusedError) and err.nsq_text == "Auth Required"
    assert str(err) == "E_AUTH_REQUIRED nsqd requires AUTH and no auth_secret is configured"


# -- a slow drip --------------------------------------------------------------------------


def test_a_dripped_handshake_times_out_after_read_timeout(logged):
    conn = Conn(read_timeout=10, heartbeat_interval=5)
    answer = server_json()
    for byte in range(3):
        conn.clock.advance(4)
        conn.feed(answer[byte:byte + 1])
    assert conn.clock.seconds() == 1012 and conn.transport.disconnected  # 10 s after connecting
    err = closed_with(conn, HeartbeatTimeout)
    assert str(err) == "handshake not done within read_timeout"


def test_a_dripped_frame_times_out_and_fails_the_command(logged):
    conn = ready(read_timeout=10, heartbeat_interval=5)
    results: list = []
    conn.proto.pub("t", b"x").addBoth(results.append)
    for byte in range(4):
        conn.clock.advance(3)
        conn.feed(OK[byte:byte + 1])
    assert not conn.transport.disconnected  # 12 s: the frame began 9 s ago
    conn.clock.advance(1)
    assert conn.transport.disconnected and not results  # 10 s after its first byte
    conn.lose()
    assert isinstance(results[0].value, HeartbeatTimeout)
    assert str(results[0].value) == "a frame still incomplete after read_timeout"


def test_frames_that_complete_keep_the_connection_however_they_are_cut(logged):
    conn = ready(read_timeout=10, heartbeat_interval=5)
    data = message_frame(b"m" * 100) * 30
    for start in range(0, len(data), 70):  # every read ends mid-frame, one read per 4 s
        conn.clock.advance(4)
        conn.feed(data[start:start + 70])
    assert not conn.transport.disconnecting
    assert conn.delegate.kinds().count("message") == 30


# -- logging --------------------------------------------------------------------------------


def test_the_protocol_leaves_the_report_to_its_delegate(logged):
    conn = ready()
    conn.feed(struct.pack(">ii", 5, 9) + b"x")
    assert conn.transport.disconnecting
    conn.lose()
    assert logged.lines == []
    assert conn.delegate.kinds()[-1] == "closed"


def test_without_a_delegate_the_end_is_logged_once(logged):
    proto = NSQClientProtocol(Config(), None, "127.0.0.1:1", clock=Clock())
    proto.makeConnection(StringTransport())
    proto.ready.addErrback(lambda f: None)
    proto.dataReceived(response(b"[" * 100_000))
    proto.connectionLost(Failure(ConnectionClosed()))
    assert len(logged.lines) == 1 and "IDENTIFY answer is nested too deep" in logged.lines[0]


# -- the consumer -------------------------------------------------------------------------------


@pytest.fixture
def net(clock) -> Network:
    """test_client_consumer's network of fake nsqds, on the unit tests' clock."""
    return Network(clock)


def _drop(net: Network) -> None:
    """Forget the servers' ends, so that nothing but the consumer holds a connection."""
    net.servers.clear()


@pytest.mark.parametrize(("ftype", "answer", "why"), [
    (ERROR, b"E_BAD_BODY IDENTIFY failed to decode JSON body",
     "failed to IDENTIFY - E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (RESPONSE, b'{"max_rdy_count": 1000000000000000000000000000000}',
     "failed to IDENTIFY - json: cannot unmarshal number 1000000000000000000000000000000 into Go "
     "struct field IdentifyResponse.max_rdy_count of type int64"),
    (RESPONSE, b"[" * 100_000, "failed to IDENTIFY - invalid character '[' exceeded max depth"),
])
def test_a_handshake_answer_that_cannot_be_used_is_fatal_for_that_nsqd(net, clock, logged, ftype,
                                                                       answer, why):
    refused: list = []
    consumer = make(net, clock, on_fatal=lambda address, err: refused.append((address, err.nsq_text)))
    net.last("a:4150").send(ftype, answer)
    _drop(net)
    clock.advance(0)
    gc.collect()  # an unheard failed `ready` said "Unhandled error in Deferred" here
    clock.advance(3600)
    assert refused == [("a:4150", why)]  # go-nsq's words: nsq_tail's last line
    assert len(net.attempts) == 1  # the same nsqd gives the same answer: not dialed again
    assert logged.lines == [f"(a:4150) {why}; not reconnecting"]
    consumer.stopService()
    clock.advance(60)


def test_a_handshake_cut_short_is_retried_with_one_line_per_attempt(net, clock, logged):
    refused: list = []
    consumer = make(net, clock, on_fatal=lambda address, err: refused.append(err))
    for attempt in range(3):
        net.last("a:4150").close()  # a broker restarting: the next attempt may well succeed
        _drop(net)
        clock.advance(0)
        gc.collect()
        clock.advance(60)  # the next attempt
        assert len(logged.lines) == attempt + 1, logged.lines
    assert logged.lines == ["(a:4150) handshake failed: Connection was closed cleanly."] * 3
    assert len(net.attempts) == 4 and refused == []
    consumer.stopService()
    clock.advance(60)


def _refuse_auth(net: Network, address: str = "a:4150", text: bytes = b"E_AUTH_FAILED AUTH failed") -> None:
    server = net.last(address)
    server.handshake(auth_required=True)
    assert server.transport.value().endswith(b"AUTH\n" + struct.pack(">i", 5) + b"wrong")
    server.send(ERROR, text)


def test_auth_refused_on_the_first_connection_is_fatal_for_that_nsqd(net, clock, logged):
    refused: list = []
    consumer = make(net, clock, addresses=(), auth_secret="wrong",
                    on_fatal=lambda address, err: refused.append((address, err)))
    outcome = Outcome(consumer.connect_to_nsqd("a:4150"))
    _refuse_auth(net)
    clock.advance(0)
    assert [(a, e.nsq_text) for a, e in refused] == [
        ("a:4150", "Error authenticating E_AUTH_FAILED AUTH failed")]
    assert isinstance(outcome.error(), errors.AuthFailedError)
    clock.advance(3600)
    assert len(net.attempts) == 1  # not dialed again: retrying the same secret cannot help
    assert logged.lines == ["(a:4150) Error authenticating E_AUTH_FAILED AUTH failed; not reconnecting"]
    assert "a:4150" not in consumer._links
    stopped = Outcome(consumer.stop())
    clock.advance(0)
    assert stopped.fired


def test_no_secret_for_an_nsqd_that_wants_one_is_fatal(net, clock, logged):
    refused: list = []
    make(net, clock, on_fatal=lambda address, err: refused.append(err))
    net.last("a:4150").send(RESPONSE, json.dumps({"auth_required": True}).encode())
    clock.advance(0)
    clock.advance(3600)
    assert len(refused) == 1 and isinstance(refused[0], errors.AuthRequiredError)
    assert len(net.attempts) == 1


def test_auth_refused_after_having_subscribed_is_retried(net, clock, logged):
    refused: list = []
    make(net, clock, auth_secret="wrong", on_fatal=lambda address, err: refused.append(err))
    first = net.last("a:4150")
    first.handshake(auth_required=True)
    first.send(RESPONSE, json.dumps({"identity": "me", "permission_count": 1}).encode())
    first.send(RESPONSE, b"OK")  # SUB
    first.close()
    clock.advance(0)
    clock.advance(1)
    _refuse_auth(net)  # the auth server changed its mind, or is down (E_AUTH_FAILED too)
    clock.advance(0)
    clock.advance(60)
    assert refused == []
    assert len(net.attempts) == 3  # go-nsq retries a lost connection whatever the reason


def test_a_discovered_nsqd_refusing_auth_is_tried_again_at_the_next_poll(net, clock, logged):
    lookupd = Lookupd()
    lookupd.producers = [("n1", 4150)]
    refused: list = []
    consumer = Consumer("t", "c", Recorder(), lookupd_http_addresses=["lk:4161"], reactor=clock,
                        endpoint_factory=net.endpoint, lookupd_http=StubTreq(lookupd),
                        auth_secret="wrong", on_fatal=lambda a, e: refused.append(e))
    consumer.startService()
    _refuse_auth(net, "n1:4150")
    clock.advance(0)
    clock.advance(3600)  # no reconnect of its own ...
    assert len(net.attempts) == 1
    consumer._poller.poll()  # ... but lookupd still lists it
    assert len(net.attempts) == 2
    assert refused == []  # nsq_tail with lookupd does not exit either
    assert logged.lines == ["(n1:4150) Error authenticating E_AUTH_FAILED AUTH failed; "
                            "tried again when lookupd lists it next"]


def test_a_fatal_error_frame_unasked_is_one_line(net, clock, logged):
    make(net, clock)
    server = net.last("a:4150")
    server.subscribe()
    server.send(ERROR, b"E_INVALID cannot do that")
    clock.advance(0)
    assert logged.lines == ["(a:4150) connection closed: E_INVALID cannot do that; 0 left"]


# -- the producer ----------------------------------------------------------------------------


def test_producer_handshake_failure_is_one_line_and_fails_the_waiting_publish(clock, logged):
    config = Config(heartbeat_interval=-1)
    endpoint = Endpoint(config)
    producer = Producer(ADDRESS, config, reactor=clock, endpoint=endpoint)
    producer.startService()
    outcome = Outcome(producer.publish("t", b"x"))
    server = endpoint.accept(handshake=False)
    server.send(response(b'{"a":' * 100_000))
    server.lose()
    assert isinstance(outcome.error(), ServerProtocolError)
    assert logged.lines == [f"producer {ADDRESS}: handshake failed: protocol error: "
                            "IDENTIFY answer is nested too deep"]
    producer.stopService()
