"""mqd.client's Producer against a real `twistd mqd`, in pytest-twisted's reactor.

What was published is read back with pynsq (the `loop` fixture: its
tornado loop runs while the reactor waits, and the other way round) or
from the broker's /stats.
"""

from __future__ import annotations

import gc

import pytest
import pytest_twisted
from twisted.internet import defer, reactor
from twisted.logger import formatEvent, globalLogPublisher

from mqd.client.errors import BadMessageError, ConnectionClosed, StoppedError
from mqd.client.producer import Producer
from tests.support.client_e2e import channel_stats, free_port, wait_until
from tests.support.processes import FAST_SCAN
from tests.support.pynsq_loop import Collector


@pytest.fixture(autouse=True)
def no_logged_failures():
    """Nothing the client does may end in a logged failure (an unhandled error in a Deferred, say)."""
    failures: list[dict] = []

    def observe(event: dict) -> None:
        if "log_failure" in event:
            failures.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield
        gc.collect()
    finally:
        globalLogPublisher.removeObserver(observe)
    assert not failures, [formatEvent(e) + str(e["log_failure"]) for e in failures]


@pytest.fixture
def producers():
    """make(address, **kw) -> a started Producer, stopped at teardown whatever the test did."""
    made: list[Producer] = []

    def make(address: str, **kw) -> Producer:
        p = Producer(address, reactor=reactor, heartbeat_interval="1s", read_timeout="5s", **kw)
        p.startService()
        made.append(p)
        return p

    yield make
    for p in made:
        pytest_twisted.blockon(p.stop())


def outcomes(ds: list[defer.Deferred]) -> defer.Deferred:
    """Every Deferred's outcome in order, failures included (as their exceptions)."""
    return defer.gatherResults(
        [d.addErrback(lambda f: f.value) for d in ds], consumeErrors=True)


@pytest_twisted.inlineCallbacks
def test_publish_mpub_and_dpub_land(start_broker, producers, loop, name):
    broker = start_broker(*FAST_SCAN)
    topic, channel = name("t"), name("c")
    got = Collector()
    loop.reader(broker, topic, channel, got, max_in_flight=10)
    p = producers(broker.tcp_address)

    assert (yield p.publish(topic, b"one")) == b"OK"
    assert (yield p.multi_publish(topic, [b"two", b"three", b"four"])) == b"OK"
    assert (yield p.deferred_publish(topic, b"much later", 600_000)) == b"OK"
    assert (yield p.deferred_publish(topic, b"later", 200)) == b"OK"
    assert p.connected

    loop.run_until(lambda: len(got) >= 5, what="the PUB, MPUB and short DPUB bodies")
    assert got.bodies == [b"one", b"two", b"three", b"four", b"later"]
    # The long DPUB waits its 10 minutes at the channel.
    assert channel_stats(broker, topic, channel)["deferred_count"] == 1


@pytest_twisted.inlineCallbacks
def test_2000_pipelined_publishes_all_ok_in_order(start_broker, producers, loop, name):
    broker = start_broker(*FAST_SCAN)
    topic, channel = name("t"), name("c")
    got = Collector()
    loop.reader(broker, topic, channel, got, max_in_flight=2500)
    p = producers(broker.tcp_address, max_outstanding=1000)
    yield wait_until(lambda: p.connected, what="the producer to connect")

    answered: list[int] = []
    bodies = [b"m%04d" % i for i in range(2000)]
    ds = []
    for i, body in enumerate(bodies):
        d = p.publish(topic, body)
        d.addCallback(lambda ok, i=i: answered.append(i) or ok)
        ds.append(d)
    # max_outstanding on the wire, the rest waiting behind them.
    assert (p.outstanding, p.queued) == (1000, 1000)
    results = yield outcomes(ds)
    assert results == [b"OK"] * 2000
    assert answered == list(range(2000))
    assert (p.outstanding, p.queued) == (0, 0)

    loop.run_until(lambda: len(got) == 2000, what="2000 deliveries")
    assert got.bodies == bodies


@pytest_twisted.inlineCallbacks
def test_message_over_max_msg_size_fails_just_that_publish(start_broker, producers, name):
    broker = start_broker(*FAST_SCAN, "--max-msg-size=100")
    topic = name("t")
    p = producers(broker.tcp_address)
    assert (yield p.publish(topic, b"x" * 100)) == b"OK"

    with pytest.raises(BadMessageError) as caught:
        yield p.publish(topic, b"x" * 101)
    e = caught.value
    assert str(e) == "E_BAD_MESSAGE PUB message too big 101 > 100"
    assert e.fatal
    # nsqd closed that connection; the producer reconnects and goes on.
    assert (yield p.publish(topic, b"y" * 10)) == b"OK"
    assert (yield p.multi_publish(topic, [b"z"] * 3)) == b"OK"
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert [t["message_count"] for t in stats["topics"] if t["topic_name"] == topic] == [5]


@pytest_twisted.inlineCallbacks
def test_pipelined_behind_a_fatal_error_fail_with_connection_closed(start_broker, producers, name):
    broker = start_broker(*FAST_SCAN, "--max-msg-size=100")
    topic = name("t")
    p = producers(broker.tcp_address)
    yield wait_until(lambda: p.connected, what="the producer to connect")
    results = yield outcomes([p.publish(topic, b"ok"), p.publish(topic, b"x" * 101),
                              p.publish(topic, b"behind")])
    assert results[0] == b"OK"
    assert isinstance(results[1], BadMessageError)
    assert isinstance(results[2], ConnectionClosed)
    assert (yield p.publish(topic, b"after")) == b"OK"


@pytest_twisted.inlineCallbacks
def test_reconnects_after_a_broker_restart_and_delivers_what_was_published_meanwhile(
        start_broker, producers, loop, name):
    # The broker comes back on the same TCP port, as a restarted nsqd does.
    port = free_port()
    broker = start_broker(*FAST_SCAN, f"--tcp-address=127.0.0.1:{port}", "--http-address=127.0.0.1:0",
                          addresses=False)
    topic, channel = name("t"), name("c")
    p = producers(broker.tcp_address)
    assert (yield p.publish(topic, b"before")) == b"OK"

    broker.stop_cleanly()  # the reactor waits meanwhile
    yield wait_until(lambda: not p.connected, what="the producer to see the broker gone")
    # Published during the outage: they wait for the next connection.
    during = [p.publish(topic, b"during%02d" % i) for i in range(50)]
    during.append(p.multi_publish(topic, [b"during-m1", b"during-m2"]))
    assert p.queued == 51
    # Back before the first retry is due (0.2 s after the loss at the
    # earliest; the reactor does not run while the broker starts).
    broker.start()
    assert (yield outcomes(during)) == [b"OK"] * 51
    assert p.connected

    got = Collector()
    loop.reader(broker, topic, channel, got, max_in_flight=100)
    expected = {b"during%02d" % i for i in range(50)} | {b"during-m1", b"during-m2"}
    loop.run_until(lambda: expected <= set(got.bodies), what="the outage's messages")


@pytest_twisted.inlineCallbacks
def test_publishing_while_the_broker_is_down_fails_with_the_connect_error(start_broker, producers, name):
    port = free_port()
    broker = start_broker(*FAST_SCAN, f"--tcp-address=127.0.0.1:{port}", "--http-address=127.0.0.1:0",
                          addresses=False)
    topic = name("t")
    p = producers(broker.tcp_address)
    assert (yield p.publish(topic, b"before")) == b"OK"
    broker.stop_cleanly()
    yield wait_until(lambda: not p.connected, what="the producer to see the broker gone")
    # Nobody listens: the next attempt is refused and the waiting publish
    # fails with that (never hangs).
    waiting = p.publish(topic, b"lost")
    results = yield outcomes([waiting])
    assert "refused" in str(results[0]).lower(), results
    # The producer keeps retrying and recovers once the broker is back.
    broker.start()
    yield wait_until(lambda: p.connected, what="the producer to reconnect")
    assert (yield p.publish(topic, b"after")) == b"OK"


@pytest_twisted.inlineCallbacks
def test_stop_waits_for_outstanding(start_broker, name):
    broker = start_broker(*FAST_SCAN)
    topic = name("t")
    p = Producer(broker.tcp_address, reactor=reactor, max_outstanding=50)
    p.startService()
    answered: list[int] = []
    ds = []
    for i in range(500):
        d = p.publish(topic, b"m%d" % i)
        d.addCallback(lambda ok, i=i: answered.append(i) or ok)
        ds.append(d)
    stopped = p.stop()
    with pytest.raises(StoppedError):
        yield p.publish(topic, b"late")
    seen_at_stop: list[int] = []
    stopped.addCallback(lambda _: seen_at_stop.append(len(answered)))
    yield stopped
    # Every accepted publish was answered before stop() fired.
    assert seen_at_stop == [500]
    assert (yield outcomes(ds)) == [b"OK"] * 500
    assert not p.connected
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert [t["message_count"] for t in stats["topics"] if t["topic_name"] == topic] == [500]
