"""mqd.client's Producer driven over StringTransport with task.Clock: no network, no sleeping.

The producer's connection attempts go to an endpoint stub the test
completes (a real NSQClientProtocol on a StringTransport, handshake
answered here) or fails; nsqd's side is the frames the test writes back.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
from twisted.internet.error import ConnectionLost, ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher

from mqd.client import producer as producer_module
from mqd.client.config import Config
from mqd.client.errors import (
    BadBodyError,
    BadMessageError,
    BadTopicError,
    ClientConfigError,
    ConnectionClosed,
    ProducerFullError,
    PubFailedError,
    StoppedError,
)
from mqd.client.producer import Producer
from mqd.wire.framing import FRAME_TYPE_RESPONSE, frame
from tests.support.producer_fakes import (
    ADDRESS,
    IDENTIFY_ANSWER,
    OK,
    Endpoint,
    Outcome,
    Server,
    error,
)
from tests.support.v2_frames import MAGIC, cmd, dpub, mpub, pub


@pytest.fixture(autouse=True)
def no_logged_failures():
    """No unhandled error in a Deferred, no failure logged (a state machine's NoTransition, say)."""
    failures: list[dict] = []

    def observe(event: dict) -> None:
        if "log_failure" in event:
            failures.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield
        gc.collect()  # Deferreds garbage with an unhandled failure log it now
    finally:
        globalLogPublisher.removeObserver(observe)
    assert not failures, [formatEvent(e) + str(e["log_failure"]) for e in failures]


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch):
    """Reconnect delays exactly 0.1 × 2**attempt, so the clock can be advanced to them."""
    monkeypatch.setattr(producer_module, "RETRY_JITTER", 0.0)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def config() -> Config:
    return Config(heartbeat_interval=-1)


@pytest.fixture
def endpoint(config) -> Endpoint:
    return Endpoint(config)


@pytest.fixture
def make_producer(clock, config, endpoint):
    made: list[Producer] = []

    def make(start: bool = True, **kw: Any) -> Producer:
        p = Producer(ADDRESS, config, reactor=clock, endpoint=endpoint, **kw)
        made.append(p)
        if start:
            p.startService()
        return p

    return make


@pytest.fixture
def connected(make_producer, endpoint):
    """make(**kw) -> (producer, server) with the handshake done."""

    def make(**kw: Any) -> tuple[Producer, Server]:
        p = make_producer(**kw)
        server = endpoint.accept()
        assert p.connected
        return p, server

    return make


# -- pipelining -----------------------------------------------------------------------


def test_publishes_are_pipelined_and_answers_matched_in_order(connected):
    p, server = connected()
    outcomes = [Outcome(p.publish("t", b"m%d" % i)) for i in range(3)]
    # All three on the wire before any answer.
    assert server.take() == pub("t", b"m0") + pub("t", b"m1") + pub("t", b"m2")
    assert p.outstanding == 3
    assert not any(o.fired for o in outcomes)

    server.send(OK)
    assert [o.fired for o in outcomes] == [True, False, False]
    assert outcomes[0].result() == b"OK"
    server.send(OK + OK)
    assert [o.result() for o in outcomes] == [b"OK", b"OK", b"OK"]
    assert p.outstanding == 0


def test_a_publish_made_from_an_answer_callback_goes_behind_the_others(connected):
    p, server = connected()
    later: list[Outcome] = []
    first = p.publish("t", b"a")
    first.addCallback(lambda ok: later.append(Outcome(p.publish("t", b"c"))) or ok)
    second = Outcome(p.publish("t", b"b"))
    server.take()
    server.send(OK)
    assert server.take() == pub("t", b"c")
    server.send(OK + OK)
    assert second.result() == b"OK" and later[0].result() == b"OK"


# -- the bytes on the wire ------------------------------------------------------------------


def test_pub_mpub_and_dpub_bytes_on_the_wire(connected):
    p, server = connected()
    p.publish("topic.a", b"hello\nworld")
    p.multi_publish("topic.b", [b"one", b"", b"three\x00"])
    p.deferred_publish("topic_c#ephemeral", b"later", 1500)
    assert server.take() == (
        b"PUB topic.a\n" + b"\x00\x00\x00\x0bhello\nworld"
        + b"MPUB topic.b\n" + b"\x00\x00\x00\x19" + b"\x00\x00\x00\x03"
        + b"\x00\x00\x00\x03one" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x06three\x00"
        + b"DPUB topic_c#ephemeral 1500\n" + b"\x00\x00\x00\x05later"
    )
    # The same, spelt with the broker tests' encoders.
    p.multi_publish("t", [b"x", b"yy"])
    p.deferred_publish("t", b"z", 0)
    assert server.take() == mpub("t", [b"x", b"yy"]) + dpub("t", 0, b"z")


def test_bodies_must_be_bytes(connected):
    p, server = connected()
    with pytest.raises(TypeError):
        p.publish("t", "text")
    with pytest.raises(TypeError):
        p.multi_publish("t", b"one body, not a list")
    with pytest.raises(TypeError):
        p.multi_publish("t", [b"ok", "text"])
    with pytest.raises(TypeError):
        p.deferred_publish("t", b"x", 1.5)
    assert server.take() == b""


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("verb", "call", "text"), [
    ("PUB", lambda p, t: p.publish(t, b"x"), 'E_BAD_TOPIC PUB topic name "a b" is not valid'),
    ("MPUB", lambda p, t: p.multi_publish(t, [b"x"]), 'E_BAD_TOPIC E_BAD_TOPIC MPUB topic name "a b" is not valid'),
    ("DPUB", lambda p, t: p.deferred_publish(t, b"x", 10), 'E_BAD_TOPIC DPUB topic name "a b" is not valid'),
])
def test_bad_topic_fails_at_once_without_network(make_producer, endpoint, verb, call, text):
    # Not even started: the name alone decides.
    p = make_producer(start=False)
    e = Outcome(call(p, "a b")).error()
    assert isinstance(e, BadTopicError) and e.fatal
    assert str(e) == text
    assert p.queued == 0 and endpoint.attempts == []
    # Too long, and an empty name, the same way.
    assert isinstance(Outcome(call(p, "x" * 65)).error(), BadTopicError)
    assert isinstance(Outcome(call(p, "")).error(), BadTopicError)


def test_error_frame_fails_its_publish_with_the_nsq_error(connected):
    p, server = connected()
    first = Outcome(p.publish("t", b"ok"))
    bad = Outcome(p.publish("t", b""))
    server.take()
    server.send(OK, error("E_BAD_MESSAGE PUB invalid message body size 0"))
    assert first.result() == b"OK"
    e = bad.error()
    assert type(e) is BadMessageError
    assert (e.code, e.detail, e.fatal) == ("E_BAD_MESSAGE", "PUB invalid message body size 0", True)


def test_fatal_error_fails_the_commands_behind_it_with_connection_closed(connected, endpoint, clock):
    p, server = connected()
    outcomes = [Outcome(p.publish("t", b"m%d" % i)) for i in range(3)]
    server.take()
    server.send(error("E_PUB_FAILED PUB failed exiting"))
    assert isinstance(outcomes[0].error(), PubFailedError)
    # nsqd closes after a fatal error, and so does the producer; nothing
    # new goes to the dying connection.
    assert server.closed_by_client
    assert not p.connected
    waiting = Outcome(p.publish("t", b"after"))
    assert server.take() == b""
    server.lose()
    for o in outcomes[1:]:
        assert isinstance(o.error(), ConnectionClosed)
    assert p.outstanding == 0
    # The publish made meanwhile goes out on the next connection.
    assert not waiting.fired and p.queued == 1
    clock.advance(0.2)
    server2 = endpoint.accept()
    assert server2.take() == pub("t", b"after")
    server2.send(OK)
    assert waiting.result() == b"OK"


def test_connection_lost_fails_outstanding_with_connection_closed(connected):
    p, server = connected()
    outcomes = [Outcome(p.publish("t", b"m%d" % i)) for i in range(2)]
    server.lose(ConnectionLost("reset"))
    for o in outcomes:
        e = o.error()
        assert isinstance(e, ConnectionClosed)
    assert not p.connected and p.outstanding == 0


# -- bounds ---------------------------------------------------------------------------------


def test_beyond_max_outstanding_and_max_queued_publish_fails_at_once(connected):
    p, server = connected(max_outstanding=2, max_queued=3)
    accepted = [Outcome(p.publish("t", b"m%d" % i)) for i in range(5)]
    # Two on the wire, three waiting behind them.
    assert server.take() == pub("t", b"m0") + pub("t", b"m1")
    assert (p.outstanding, p.queued) == (2, 3)
    full = Outcome(p.publish("t", b"m5"))
    assert isinstance(full.error(), ProducerFullError)
    assert isinstance(Outcome(p.multi_publish("t", [b"x"])).error(), ProducerFullError)

    # Each answer makes room for exactly one waiting command.
    server.send(OK)
    assert server.take() == pub("t", b"m2")
    assert (p.outstanding, p.queued) == (2, 2)
    more = Outcome(p.publish("t", b"m6"))
    assert not more.fired and p.queued == 3
    server.send(OK * 2)
    assert server.take() == pub("t", b"m3") + pub("t", b"m4")
    server.send(OK * 2)
    assert server.take() == pub("t", b"m6")
    server.send(OK)
    assert [o.result() for o in accepted] == [b"OK"] * 5
    assert more.result() == b"OK"
    assert (p.outstanding, p.queued) == (0, 0)


def test_waiting_while_disconnected_is_bounded_too(make_producer):
    p = make_producer(start=False, max_outstanding=10, max_queued=2)
    a, b = Outcome(p.publish("t", b"a")), Outcome(p.publish("t", b"b"))
    assert isinstance(Outcome(p.publish("t", b"c")).error(), ProducerFullError)
    assert not a.fired and not b.fired and p.queued == 2


# -- connecting -----------------------------------------------------------------------------


def test_publishes_made_before_connecting_are_sent_in_order_once_connected(make_producer, endpoint):
    p = make_producer(start=False, max_outstanding=2)
    outcomes = [Outcome(p.publish("t", b"m%d" % i)) for i in range(3)]
    assert endpoint.attempts == []
    p.startService()
    server = endpoint.accept(handshake=False)
    # Nothing but the handshake until IDENTIFY is answered.
    assert server.take().startswith(MAGIC + cmd("IDENTIFY"))
    assert not p.connected
    server.send(frame(FRAME_TYPE_RESPONSE, IDENTIFY_ANSWER))
    assert p.connected
    # Flushed in order, bounded by max_outstanding.
    assert server.take() == pub("t", b"m0") + pub("t", b"m1")
    server.send(OK)
    assert server.take() == pub("t", b"m2")
    server.send(OK * 2)
    assert [o.result() for o in outcomes] == [b"OK"] * 3


def test_failed_connection_attempt_fails_the_waiting_with_the_reason(make_producer, endpoint, clock):
    p = make_producer()
    waiting = [Outcome(p.publish("t", b"m%d" % i)) for i in range(2)]
    endpoint.refuse(ConnectionRefusedError("nobody there"))
    for o in waiting:
        assert isinstance(o.error(), ConnectionRefusedError)
    assert p.queued == 0
    # The service keeps trying, after a backoff.
    clock.advance(0.19)
    assert endpoint.attempts == []
    clock.advance(0.01)
    assert len(endpoint.attempts) == 1
    later = Outcome(p.publish("t", b"later"))
    server = endpoint.accept()
    assert server.take() == pub("t", b"later")
    server.send(OK)
    assert later.result() == b"OK"


def test_ping_fires_once_the_handshake_is_done_and_at_once_when_connected(make_producer, endpoint):
    p = make_producer()
    first = Outcome(p.ping())
    server = endpoint.accept(handshake=False)
    assert not first.fired  # TCP is up, IDENTIFY not answered yet
    server.take()
    server.send(frame(FRAME_TYPE_RESPONSE, IDENTIFY_ANSWER))
    assert first.result() is None
    assert Outcome(p.ping()).result() is None
    assert server.take() == b""  # a ping sends nothing


def test_ping_fails_with_why_the_connection_attempt_failed(make_producer, endpoint, clock):
    p = make_producer()
    refused = Outcome(p.ping())
    endpoint.refuse(ConnectionRefusedError("nobody there"))
    assert isinstance(refused.error(), ConnectionRefusedError)
    handshake = Outcome(p.ping())
    clock.advance(0.2)  # the service's next attempt: TCP up, IDENTIFY refused
    server = endpoint.accept(handshake=False)
    server.take()
    server.send(error("E_BAD_BODY IDENTIFY failed to decode JSON body"))
    assert isinstance(handshake.error(), BadBodyError)


def test_ping_of_a_stopping_producer_fails_with_stopped(make_producer, endpoint):
    p = make_producer()
    waiting = Outcome(p.ping())
    p.stop()
    assert isinstance(waiting.error(), StoppedError)
    assert isinstance(Outcome(p.ping()).error(), StoppedError)


def test_failed_handshake_fails_the_waiting_and_counts_towards_the_backoff(make_producer, endpoint, clock):
    p = make_producer()
    waiting = Outcome(p.publish("t", b"m"))
    server = endpoint.accept(handshake=False)
    server.take()
    server.send(error("E_BAD_BODY IDENTIFY failed to decode JSON body"))
    e = waiting.error()
    assert isinstance(e, BadBodyError)
    server.lose()
    assert not p.connected
    # TCP connected, so ClientService counts no failure; the producer does:
    # the retry waits 0.1 × 2**(1 + 1 failed handshake) = 0.4 s.
    clock.advance(0.39)
    assert endpoint.attempts == []
    clock.advance(0.01)
    assert len(endpoint.attempts) == 1
    endpoint.accept()
    assert p.connected


def test_reconnects_with_growing_backoff_after_a_loss(connected, endpoint, clock):
    p, server = connected()
    server.lose(ConnectionLost("reset"))
    assert not p.connected
    # Made while disconnected: waits for the next connection.
    during = Outcome(p.publish("t", b"during"))
    clock.advance(0.19)
    assert endpoint.attempts == []
    clock.advance(0.01)
    # Refused twice more: the waiting publish fails with the first refusal,
    # and the delays grow 0.4 s, then 0.8 s.
    endpoint.refuse()
    assert isinstance(during.error(), ConnectionRefusedError)
    clock.advance(0.39)
    assert endpoint.attempts == []
    clock.advance(0.01)
    endpoint.refuse()
    clock.advance(0.79)
    assert endpoint.attempts == []
    clock.advance(0.01)
    after = Outcome(p.publish("t", b"after"))
    server2 = endpoint.accept()
    assert server2.take() == pub("t", b"after")
    server2.send(OK)
    assert after.result() == b"OK"


def test_the_backoff_is_capped(make_producer, endpoint, clock):
    make_producer()
    for _ in range(12):
        endpoint.refuse()
        clock.advance(producer_module.RETRY_MAX)
        assert len(endpoint.attempts) == 1


# -- stop ---------------------------------------------------------------------------------------


def test_stop_waits_for_outstanding_then_closes(connected):
    p, server = connected(max_outstanding=2)
    outcomes = [Outcome(p.publish("t", b"m%d" % i)) for i in range(3)]
    server.take()
    stopped = Outcome(p.stop())
    assert not stopped.fired and not p.running
    refused = Outcome(p.publish("t", b"late"))
    assert isinstance(refused.error(), StoppedError)
    # The queued one still goes out as room frees up.
    server.send(OK)
    assert server.take() == pub("t", b"m2")
    server.send(OK)
    assert not server.closed_by_client
    server.send(OK)
    assert [o.result() for o in outcomes] == [b"OK"] * 3
    # Everything answered: the producer closes the connection and is done
    # once it is gone.
    assert server.closed_by_client
    assert not stopped.fired
    server.lose()
    assert stopped.fired
    assert Outcome(p.stop()).fired  # again: at once


def test_stop_service_is_stop(connected):
    p, server = connected()
    pending = Outcome(p.publish("t", b"m"))
    stopped = Outcome(p.stopService())
    assert isinstance(Outcome(p.deferred_publish("t", b"x", 5)).error(), StoppedError)
    server.take()
    server.send(OK)
    assert pending.result() == b"OK"
    server.lose()
    assert stopped.fired


def test_stop_with_nothing_outstanding_closes_at_once(connected):
    p, server = connected()
    stopped = Outcome(p.stop())
    assert server.closed_by_client
    server.lose()
    assert stopped.fired


def test_stop_while_connecting_waits_for_the_connection_and_flushes(make_producer, endpoint):
    p = make_producer()
    waiting = Outcome(p.publish("t", b"m"))
    stopped = Outcome(p.stop())
    assert not stopped.fired and not waiting.fired
    server = endpoint.accept()
    assert server.take() == pub("t", b"m")
    server.send(OK)
    assert waiting.result() == b"OK"
    assert server.closed_by_client
    server.lose()
    assert stopped.fired


def test_stop_between_attempts_fails_the_waiting_and_stops_retrying(make_producer, endpoint, clock):
    p = make_producer()
    endpoint.refuse()
    waiting = Outcome(p.publish("t", b"m"))
    stopped = Outcome(p.stop())
    assert isinstance(waiting.error(), StoppedError)
    assert stopped.fired
    clock.advance(60)
    assert endpoint.attempts == []


def test_stop_before_start(make_producer, endpoint):
    p = make_producer(start=False)
    waiting = Outcome(p.publish("t", b"m"))
    stopped = Outcome(p.stop())
    assert isinstance(waiting.error(), StoppedError)
    assert stopped.fired
    assert endpoint.attempts == []


def test_connection_lost_while_stopping_settles_everything(connected):
    p, server = connected(max_outstanding=1)
    on_wire, behind = Outcome(p.publish("t", b"a")), Outcome(p.publish("t", b"b"))
    stopped = Outcome(p.stop())
    server.lose(ConnectionLost("reset"))
    assert isinstance(on_wire.error(), ConnectionClosed)
    assert isinstance(behind.error(), StoppedError)
    assert stopped.fired


# -- options ---------------------------------------------------------------------------------


def test_options_make_the_config(clock, endpoint):
    p = Producer(ADDRESS, reactor=clock, endpoint=endpoint, user_agent="pub/1", heartbeat_interval=-1)
    assert p.config.user_agent == "pub/1"
    base = Config(heartbeat_interval=-1)
    q = Producer(ADDRESS, base, reactor=clock, endpoint=endpoint, user_agent="pub/2")
    assert q.config.user_agent == "pub/2" and base.user_agent != "pub/2"
    with pytest.raises(ClientConfigError, match="no_such_option"):
        Producer(ADDRESS, reactor=clock, endpoint=endpoint, no_such_option=1)
