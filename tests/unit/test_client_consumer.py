"""mqd.client.consumer: the real NSQClientProtocol over StringTransports, on a task.Clock.

Each test plays nsqd: it answers the handshake and SUB, sends message
frames and reads back what the consumer wrote (SUB, RDY, FIN, REQ, CLS).
Connections come from a fake endpoint (Consumer's `endpoint_factory`),
so the consumer's ClientServices, backoff and redistribution all run on
the test's clock.
"""

from __future__ import annotations

import pytest
from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from mqd.client.consumer import STOP_TIMEOUT, Consumer
from mqd.client.errors import ClientConfigError
from tests.support.consumer_fakes import (
    ERROR,
    RESPONSE,
    Lookupd,
    Network,
    PickLast,
    Recorder,
    make,
    msg_id,
)


@pytest.fixture
def clock() -> Clock:
    clock = Clock()
    clock.advance(1000)
    return clock


@pytest.fixture
def net(clock) -> Network:
    return Network(clock)


def test_subscribes_then_sends_rdy(net, clock):
    consumer = make(net, clock, max_in_flight=2500)
    server = net.last("a:4150")
    assert server.subscribe() == [b"RDY 2500"]
    assert consumer.stats.connections == 1
    assert set(consumer.connections) == {"a:4150"}


def test_rdy_capped_by_the_servers_max_rdy_count(net, clock):
    make(net, clock, max_in_flight=2500)
    assert net.last("a:4150").subscribe(max_rdy_count=100) == [b"RDY 100"]


def test_rdy_spread_over_three_connections(net, clock):
    make(net, clock, addresses=("a:1", "b:1", "c:1"), max_in_flight=10)
    a, b, c = (net.last(x) for x in ("a:1", "b:1", "c:1"))
    assert a.subscribe() == [b"RDY 10"]
    b.subscribe()
    assert a.rdy() == [5]
    c.subscribe()
    assert a.rdy() == [3]
    assert b.rdy() == [3]
    assert c.rdy() == []  # (already read by subscribe)
    assert [x.proto.rdy_count for x in (a, b, c)] == [3, 3, 3]


def test_max_in_flight_one_over_two_connections(net, clock):
    consumer = make(net, clock, addresses=("a:1", "b:1"), max_in_flight=1)
    a, b = net.last("a:1"), net.last("b:1")
    assert a.subscribe() == [b"RDY 1"]
    assert b.subscribe() == []  # nothing left for b
    assert consumer.ready.total_rdy == 1


def test_redistribution_moves_rdy_to_the_connection_with_work(net, clock):
    consumer = make(net, clock, addresses=("a:1", "b:1"), max_in_flight=1,
                    low_rdy_idle_timeout="10s", rdy_redistribute_interval="5s", rng=PickLast())
    a, b = net.last("a:1"), net.last("b:1")
    a.subscribe()
    b.subscribe()
    # b's starved RDY retry (5 s) finds no budget; a stays idle
    clock.advance(10)
    assert (a.proto.rdy_count, b.proto.rdy_count) == (1, 0)
    clock.advance(5)  # a idle 15 s > 10 s: its RDY goes to b
    assert a.rdy() == [0]
    assert b.rdy() == [1]
    assert a.proto.rdy_count == 0
    assert consumer.ready.total_rdy == 1
    # b has work: a message arrives, is handled and FINed
    b.commands()
    b.message(1)
    assert b.commands() == [b"FIN " + msg_id(1)]


def test_handler_success_fins(net, clock):
    handler = Recorder()
    consumer = make(net, clock, handler)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1, b"hello")
    assert [m.body for m in handler.messages] == [b"hello"]
    assert server.commands() == [b"FIN " + msg_id(1)]
    assert server.proto.in_flight == 0
    assert consumer.stats[:3] == (1, 1, 0)


def test_messages_finished_together_are_each_finished_once_and_counted(net, clock):
    held = []
    handler = Recorder()
    handler.result = lambda msg: msg.disable_auto_response() or held.append(msg)
    consumer = make(net, clock, handler, max_in_flight=10)
    server = net.last("a:4150")
    server.subscribe()
    for n in (1, 2, 3):
        server.message(n)
    server.commands()
    held[1].finish()  # answered already: not FINished twice
    server.proto.finish_messages(held)
    assert server.commands() == [b"FIN " + msg_id(2), b"FIN " + msg_id(1), b"FIN " + msg_id(3)]
    assert server.proto.in_flight == 0
    assert all(m.has_responded() for m in held)
    assert consumer.stats[:3] == (3, 3, 0)


def test_handler_failure_requeues_with_delay_and_backs_off(net, clock):
    handler = Recorder()
    consumer = make(net, clock, handler, max_in_flight=10, default_requeue_delay="90s",
                    max_requeue_delay="15m", backoff_multiplier="1s")
    server = net.last("a:4150")
    server.subscribe()
    handler.result = ValueError("boom")
    server.message(1, attempts=2)
    # the REQ with 90 s × 2 attempts, then RDY 0 (backoff)
    assert server.commands() == [b"REQ " + msg_id(1) + b" 180000", b"RDY 0"]
    assert consumer.stats.messages_requeued == 1
    clock.advance(1.9)
    assert server.commands() == []
    clock.advance(0.1)
    assert server.commands() == [b"RDY 1"]  # test the waters
    handler.result = None
    server.message(2)
    # success at level 1 → level 0: full RDY again
    assert server.commands() == [b"FIN " + msg_id(2), b"RDY 10"]


def test_requeue_delay_is_capped(net, clock):
    handler = Recorder()
    handler.result = ValueError("boom")
    make(net, clock, handler, max_attempts=0, default_requeue_delay="90s",
         max_requeue_delay="15m")
    server = net.last("a:4150")
    server.subscribe()
    server.message(1, attempts=20)
    assert b"REQ " + msg_id(1) + b" 900000" in server.commands()


def test_requeue_without_backoff(net, clock):
    handler = Recorder()
    handler.result = lambda msg: msg.requeue(5, backoff=False)
    consumer = make(net, clock, handler, max_in_flight=10)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    assert server.commands() == [b"REQ " + msg_id(1) + b" 5000"]
    assert consumer.ready.backoff.level == 0
    assert not consumer.ready.in_backoff_timeout()
    assert consumer.stats.messages_requeued == 1


def test_deferred_handler_fins_when_it_fires(net, clock):
    pending: list[defer.Deferred] = []
    handler = Recorder()
    handler.result = lambda msg: pending.append(defer.Deferred()) or pending[-1]
    make(net, clock, handler, max_in_flight=10)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    server.message(2)
    assert server.commands() == []
    assert server.proto.in_flight == 2
    pending[1].callback("done")
    assert server.commands() == [b"FIN " + msg_id(2)]
    pending[0].errback(Failure(RuntimeError("later")))
    assert server.commands() == [b"REQ " + msg_id(1) + b" 90000", b"RDY 0"]
    assert server.proto.in_flight == 0


def test_coroutine_handler(net, clock):
    async def handler(msg):
        return None

    make(net, clock, handler)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    assert server.commands() == [b"FIN " + msg_id(1)]


def test_auto_response_disabled(net, clock):
    kept = []
    handler = Recorder()
    handler.result = lambda msg: (msg.disable_auto_response(), kept.append(msg))[0]
    make(net, clock, handler)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    assert server.commands() == []
    kept[0].touch()
    kept[0].finish()
    assert server.commands() == [b"TOUCH " + msg_id(1), b"FIN " + msg_id(1)]
    # a failing handler with auto-response off does not REQ either
    handler.result = lambda msg: (msg.disable_auto_response(), 1 / 0)
    server.message(2)
    assert server.commands() == []


def test_handler_that_responded_itself_is_not_answered_twice(net, clock):
    handler = Recorder()
    handler.result = lambda msg: msg.finish()
    make(net, clock, handler)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    assert server.commands() == [b"FIN " + msg_id(1)]


def test_max_attempts_gives_up_then_fins(net, clock):
    given_up = []
    handler = Recorder()
    consumer = Consumer("t", "c", handler, nsqd_tcp_addresses=["a:4150"], reactor=clock,
                        endpoint_factory=net.endpoint, max_attempts=5, giving_up=given_up.append)
    consumer.startService()
    server = net.last("a:4150")
    server.subscribe()
    server.message(1, attempts=5)
    server.message(2, attempts=6)
    assert [m.id for m in handler.messages] == [msg_id(1)]
    assert [m.id for m in given_up] == [msg_id(2)]
    assert server.commands() == [b"FIN " + msg_id(1), b"FIN " + msg_id(2)]


def test_giving_up_from_the_handler_object(net, clock):
    class Handler:
        def __init__(self):
            self.handled, self.failed = [], []

        def handle_message(self, msg):
            self.handled.append(msg)

        def giving_up(self, msg):
            self.failed.append(msg)

    handler = Handler()
    make(net, clock, handler, max_attempts=1)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1, attempts=2)
    assert handler.handled == [] and len(handler.failed) == 1
    assert server.commands() == [b"FIN " + msg_id(1)]


def test_change_max_in_flight(net, clock):
    consumer = make(net, clock, addresses=("a:1", "b:1"), max_in_flight=10)
    a, b = net.last("a:1"), net.last("b:1")
    a.subscribe()
    b.subscribe()
    a.commands()
    consumer.change_max_in_flight(0)
    assert a.rdy() == [0] and b.rdy() == [0]
    consumer.change_max_in_flight(4)
    assert a.rdy() == [2] and b.rdy() == [2]


def test_stop_waits_for_a_running_handler(net, clock):
    pending: list[defer.Deferred] = []
    handler = Recorder()
    handler.result = lambda msg: pending.append(defer.Deferred()) or pending[-1]
    consumer = make(net, clock, handler, max_in_flight=10)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    stopped = consumer.stop()
    assert server.commands() == [b"CLS"]
    server.send(RESPONSE, b"CLOSE_WAIT")
    clock.advance(1)
    assert not server.transport.disconnecting  # a message is still in flight
    assert not stopped.called
    pending[0].callback(None)
    assert server.commands() == [b"FIN " + msg_id(1)]
    assert server.transport.disconnecting
    clock.advance(0)
    assert stopped.called
    assert consumer.stats.connections == 0
    assert not consumer.running  # stop() is stopService(): a parent MultiService agrees
    # no reconnection
    clock.advance(60)
    assert len(net.servers["a:4150"]) == 1
    assert clock.getDelayedCalls() == []


def test_stop_waits_for_close_wait(net, clock):
    consumer = make(net, clock)
    server = net.last("a:4150")
    server.subscribe()
    stopped = consumer.stop()
    assert server.commands() == [b"CLS"]
    clock.advance(1)
    assert not stopped.called and not server.transport.disconnecting
    server.send(RESPONSE, b"CLOSE_WAIT")
    clock.advance(0)
    assert server.transport.disconnecting and stopped.called


def test_stop_gives_up_after_30_seconds(net, clock):
    handler = Recorder()
    handler.result = lambda msg: defer.Deferred()  # never fires
    consumer = make(net, clock, handler)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    stopped = consumer.stop()
    server.send(RESPONSE, b"CLOSE_WAIT")
    clock.advance(STOP_TIMEOUT - 1)
    assert not stopped.called
    clock.advance(1)
    assert stopped.called
    assert server.transport.disconnecting


def test_stop_while_not_connected(net, clock):
    net.refused.add("a:4150")
    consumer = make(net, clock)
    stopped = consumer.stop()
    assert stopped.called
    clock.advance(120)
    assert len(net.attempts) == 1


def test_reconnects_after_the_server_closes(net, clock):
    consumer = make(net, clock, max_in_flight=10)
    first = net.last("a:4150")
    first.subscribe()
    first.close()
    clock.advance(0)
    assert consumer.stats.connections == 0
    assert consumer.ready.total_rdy == 0
    clock.advance(1)
    second = net.last("a:4150")
    assert second is not first
    assert second.subscribe() == [b"RDY 10"]
    assert consumer.connections["a:4150"] is second.proto


def test_connect_to_nsqd_fires_when_subscribed(net, clock):
    consumer = make(net, clock, addresses=())
    d = consumer.connect_to_nsqd("x:1")
    assert not d.called
    net.last("x:1").subscribe()
    assert d.result is net.last("x:1").proto


def test_sub_error_closes_and_retries(net, clock):
    consumer = make(net, clock)
    server = net.last("a:4150")
    server.handshake()
    server.send(ERROR, b"E_BAD_TOPIC SUB topic name \"t\" is not valid")
    clock.advance(0)
    assert server.transport.disconnecting
    assert consumer.stats.connections == 0
    clock.advance(1)
    assert len(net.servers["a:4150"]) == 2


def test_disconnect_from_nsqd(net, clock):
    consumer = make(net, clock, addresses=("a:1", "b:1"), max_in_flight=10)
    a, b = net.last("a:1"), net.last("b:1")
    a.subscribe()
    b.subscribe()
    d = consumer.disconnect_from_nsqd("b:1")
    assert b.commands() == [b"CLS"]
    b.send(RESPONSE, b"CLOSE_WAIT")
    clock.advance(0)
    assert d.called
    assert set(consumer.connections) == {"a:1"}
    clock.advance(60)
    assert len(net.servers["b:1"]) == 1


def test_disconnect_gives_up_on_an_unanswered_message(net, clock):
    handler = Recorder()
    handler.result = lambda msg: msg.disable_auto_response()
    consumer = make(net, clock, handler)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    d = consumer.disconnect_from_nsqd("a:4150")
    server.send(RESPONSE, b"CLOSE_WAIT")
    clock.advance(STOP_TIMEOUT - 1)
    assert not d.called
    clock.advance(1)
    assert d.called and server.transport.disconnecting


def test_address_added_again_while_its_old_connection_drains(net, clock):
    consumer = make(net, clock, max_in_flight=10)
    old = net.last("a:4150")
    old.subscribe()
    consumer.disconnect_from_nsqd("a:4150")  # CLS sent, no CLOSE_WAIT yet
    consumer.connect_to_nsqd("a:4150")
    new = net.last("a:4150")
    assert new is not old
    assert new.subscribe() == [b"RDY 10"]
    assert consumer.ready.total_rdy == 10
    old.send(RESPONSE, b"CLOSE_WAIT")
    clock.advance(0)
    assert consumer.connections == {"a:4150": new.proto}
    assert consumer.ready.total_rdy == 10


def test_lookupd_discovery_connects_and_drops(net, clock):
    lookupd = Lookupd()
    lookupd.producers = [("n1", 4150)]
    consumer = Consumer("t", "c", Recorder(), lookupd_http_addresses=["lk:4161"], reactor=clock,
                        endpoint_factory=net.endpoint, lookupd_http=StubTreq(lookupd),
                        max_in_flight=10)
    consumer.startService()
    n1 = net.last("n1:4150")
    n1.subscribe()
    lookupd.producers = [("n1", 4150), ("n2", 4150)]
    consumer._poller.poll()
    n2 = net.last("n2:4150")
    n2.subscribe()
    assert set(consumer.connections) == {"n1:4150", "n2:4150"}
    assert n1.rdy() == [5]
    lookupd.producers = [("n2", 4150)]
    consumer._poller.poll()
    assert n1.commands() == [b"CLS"]
    n1.send(RESPONSE, b"CLOSE_WAIT")
    clock.advance(0)
    assert set(consumer.connections) == {"n2:4150"}
    stopped = consumer.stop()
    n2.send(RESPONSE, b"CLOSE_WAIT")
    clock.advance(0)
    assert stopped.called


def test_bad_names_and_options():
    with pytest.raises(ClientConfigError):
        Consumer("bad topic", "c", print)
    with pytest.raises(ClientConfigError):
        Consumer("t", "c!", print)
    with pytest.raises(ClientConfigError):
        Consumer("t", "c", print, max_in_flight=-1)


def test_is_starved(net, clock):
    handler = Recorder()
    handler.result = lambda msg: defer.Deferred()
    consumer = make(net, clock, handler, max_in_flight=2)
    server = net.last("a:4150")
    server.subscribe()
    server.message(1)
    assert consumer.is_starved()  # 1 in flight ≥ 85 % of RDY 2 → int(1.7) = 1
