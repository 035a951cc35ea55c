"""txnsq (mqd.client) end to end: its Producer and Consumer against real `twistd mqd` and mqlookupd.

Every test counts exactly: each published message consumed once (or, across
a restart, twice only when its handler was interrupted), and what the
client did is checked in the brokers' own /stats, not only in the client.
The tests run in pytest-twisted's reactor; the brokers are subprocesses.
"""

from __future__ import annotations

import time

import pytest
import pytest_twisted
from OpenSSL import SSL
from service_identity import VerificationError
from twisted.internet import defer, reactor, threads

from mqd.client.consumer import Consumer
from mqd.client.errors import AuthFailedError, ConnectionClosed, UnauthorizedError
from mqd.client.producer import Producer
from tests.support.authd import PUBLISH, SUBSCRIBE, AuthServer, grant
from tests.support.certs import make_certs, tls_flags
from tests.support.client_e2e import (
    Recorder,
    channel_stats,
    free_port,
    ready_counts,
    sleep,
    wait_until,
)
from tests.support.processes import FAST_SCAN


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("client-certs"))


@pytest.fixture
def authd(tmp_path):
    server = AuthServer(tmp_path)
    yield server
    server.close()


@pytest_twisted.async_yield_fixture
async def services(start_broker, start_lookupd):
    """Producers and consumers a test started; stopped (10 s cap each) before the brokers are killed."""
    started: list = []
    yield started
    for service in reversed(started):
        if not service.running:
            continue
        d = defer.maybeDeferred(service.stopService)
        d.addTimeout(10, reactor)
        try:
            await d
        except Exception:  # noqa: BLE001 - teardown is best effort; the tests check stop() themselves
            pass


def producer(services: list, address: str, **options) -> Producer:
    p = Producer(address, reactor=reactor, **options)
    p.startService()
    services.append(p)
    return p


async def consumer(services: list, topic: str, channel: str, handler, *, wait: bool = True,
                   **options) -> Consumer:
    """A started Consumer; with `wait`, returned once every direct nsqd address is connected."""
    c = Consumer(topic, channel, handler, reactor=reactor, **options)
    c.startService()
    services.append(c)
    if wait:
        addresses = set(options.get("nsqd_tcp_addresses", ()))
        await wait_until(lambda: addresses <= connected(c), what=f"the consumer to connect to {addresses}")
    return c


def connected(c: Consumer) -> set[str]:
    return {address for address, conn in c.connections.items() if conn.connected}


async def publish_all(p: Producer, topic: str, bodies: list[bytes]) -> None:
    """PUB each body (pipelined) and check every answer is OK."""
    answers = await defer.gatherResults([p.publish(topic, body) for body in bodies], consumeErrors=True)
    assert answers == [b"OK"] * len(bodies)


async def drained(broker, topic: str, channel: str, messages: int, requeued: int = 0) -> dict:
    """Wait until the channel got `messages` and has nothing queued, in flight or deferred; its stats.

    nsqd's channel stats have no FIN count: everything that came in and is
    no longer queued, in flight or deferred was finished (no timeouts).
    """
    def done():
        stats = channel_stats(broker, topic, channel)
        if stats and stats["depth"] == 0 and stats["in_flight_count"] == 0 \
                and stats["deferred_count"] == 0 and stats["message_count"] >= messages:
            return stats
        return None

    try:
        stats = await wait_until(done, what=f"{topic}/{channel} drained after {messages} messages")
    except AssertionError as e:
        raise AssertionError(f"{e}: {channel_stats(broker, topic, channel)}") from None
    assert (stats["message_count"], stats["requeue_count"], stats["timeout_count"]) \
        == (messages, requeued, 0), stats
    return stats


# -- 1. TLS, snappy, deflate, AUTH -----------------------------------------------------------------


TRANSPORTS = {
    "tls": lambda certs: {"tls_v1": True, "tls_root_ca_file": str(certs.ca)},
    "tls-insecure": lambda certs: {"tls_v1": True, "tls_insecure_skip_verify": True},
    "snappy": lambda certs: {"snappy": True},
    "deflate": lambda certs: {"deflate": True},
    "tls-snappy": lambda certs: {"tls_v1": True, "tls_root_ca_file": str(certs.ca), "snappy": True},
    "tls-deflate": lambda certs: {"tls_v1": True, "tls_root_ca_file": str(certs.ca), "deflate": True},
}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest_twisted.ensureDeferred
async def test_producer_and_consumer_over(transport, start_broker, services, certs, name):
    broker = start_broker(*FAST_SCAN, *tls_flags(certs, f"--tls-root-ca-file={certs.ca}"))
    options = TRANSPORTS[transport](certs)
    topic = name()
    got = Recorder()
    c = await consumer(services, topic, "c", got, nsqd_tcp_addresses=[broker.tcp_address],
                       max_in_flight=8, **options)
    p = producer(services, broker.tcp_address, **options)

    # PUB, MPUB and DPUB; one body larger than a snappy chunk (64 KiB) and deflate's window.
    singles = [b"pub-%d" % i for i in range(10)] + [bytes(range(256)) * 800]
    batch = [b"mpub-%d" % i for i in range(10)]
    deferred = [b"dpub-%d" % i for i in range(5)]
    await publish_all(p, topic, singles)
    assert await p.multi_publish(topic, batch) == b"OK"
    answers = await defer.gatherResults([p.deferred_publish(topic, body, 100) for body in deferred])
    assert answers == [b"OK"] * len(deferred)

    everything = singles + batch + deferred
    await wait_until(lambda: set(got.bodies) == set(everything), what=f"every message over {transport}")
    await drained(broker, topic, "c", len(everything))
    assert got.bodies == {body: 1 for body in everything}
    assert len(got.ids) == len(everything)

    [client] = channel_stats(broker, topic, "c")["clients"]
    assert client["tls"] is options.get("tls_v1", False)
    assert (client["snappy"], client["deflate"]) == (options.get("snappy", False),
                                                     options.get("deflate", False))
    if options.get("tls_v1"):
        assert client["tls_version"].startswith("TLS1.")
        assert c.connections[broker.tcp_address].server["tls_v1"] is True


@pytest_twisted.ensureDeferred
async def test_producer_and_consumer_with_auth(start_broker, authd, services, name):
    authd.answers["pub"] = grant(PUBLISH, identity="producer")
    authd.answers["sub"] = grant(SUBSCRIBE, identity="consumer")
    broker = start_broker(f"--auth-http-address={authd.address}")
    topic = name()
    got = Recorder()
    c = await consumer(services, topic, "c", got, nsqd_tcp_addresses=[broker.tcp_address],
                       max_in_flight=5, auth_secret="sub")
    p = producer(services, broker.tcp_address, auth_secret="pub")
    bodies = [b"authed-%d" % i for i in range(20)]
    await publish_all(p, topic, bodies)
    await wait_until(lambda: len(got) >= len(bodies), what="every authed message")
    await drained(broker, topic, "c", len(bodies))
    assert got.bodies == {body: 1 for body in bodies}
    assert c.connections[broker.tcp_address].auth["identity"] == "consumer"
    [client] = channel_stats(broker, topic, "c")["clients"]
    assert (client["authed"], client["auth_identity"]) == (True, "consumer")
    assert {q["secret"] for q in authd.queries} == {"pub", "sub"}

    # A secret the auth server does not know: the handshake fails, and so
    # does the publish waiting for it, with nsqd's error.
    stranger = producer(services, broker.tcp_address, auth_secret="nobody")
    with pytest.raises(AuthFailedError) as failed:
        await stranger.publish(topic, b"never")
    assert str(failed.value) == "E_AUTH_FAILED AUTH failed"
    assert failed.value.fatal is True
    await stranger.stop()

    # A secret that may only subscribe: PUB is refused.
    reader_only = producer(services, broker.tcp_address, auth_secret="sub")
    with pytest.raises(UnauthorizedError) as refused:
        await reader_only.publish(topic, b"never")
    assert str(refused.value) == f'E_UNAUTHORIZED AUTH failed for PUB on "{topic}" ""'
    await reader_only.stop()
    # A consumer whose secret may only publish: SUB is refused.
    writer_only = await consumer(services, topic, "other", Recorder(), wait=False, auth_secret="pub")
    with pytest.raises(UnauthorizedError) as refused:
        await writer_only.connect_to_nsqd(broker.tcp_address)
    assert str(refused.value) == f'E_UNAUTHORIZED AUTH failed for SUB on "{topic}" "other"'
    await writer_only.stop()
    stats = channel_stats(broker, topic, "c")
    assert (stats["message_count"], stats["depth"]) == (len(bodies), 0)


@pytest_twisted.ensureDeferred
async def test_tls_verification_failures(start_broker, services, certs, name):
    """Without the CA, or under another server name, the TLS handshake fails and nothing is published."""
    broker = start_broker(*tls_flags(certs))
    topic = name()
    for options, reason in (({}, SSL.Error),
                            ({"tls_root_ca_file": str(certs.ca), "tls_server_name": "wrong.example"},
                             VerificationError)):
        p = producer(services, broker.tcp_address, tls_v1=True, **options)
        with pytest.raises(ConnectionClosed) as failed:
            await p.publish(topic, b"never")
        assert failed.value.reason.check(reason), failed.value.reason
        await p.stop()
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200 and not stats["topics"], stats


# -- 2. max_in_flight 1 over two brokers: RDY redistribution ---------------------------------------


@pytest_twisted.ensureDeferred
async def test_max_in_flight_one_over_two_brokers_gets_everything(start_broker, services, name):
    brokers = [start_broker(*FAST_SCAN) for _ in range(2)]
    topic = name()
    for i, broker in enumerate(brokers):
        await publish_all(producer(services, broker.tcp_address), topic,
                          [b"b%d-%d" % (i, n) for n in range(10)])
    rdy_totals: list[int] = []
    started: list[Consumer] = []

    def handle(message):
        # The consumer never has more RDY out than max_in_flight, whatever it rotates.
        rdy_totals.append(sum(conn.rdy_count for c in started for conn in c.connections.values()))

    got = Recorder(handle)
    started.append(await consumer(services, topic, "c", got, wait=False,
                                  nsqd_tcp_addresses=[b.tcp_address for b in brokers],
                                  max_in_flight=1, low_rdy_idle_timeout=1,
                                  rdy_redistribute_interval=0.1))
    await wait_until(lambda: len(got) >= 20, timeout=20, what="all 20 messages through one RDY")
    for i, broker in enumerate(brokers):
        await drained(broker, topic, "c", 10)
        assert sorted(got.from_nsqd(broker.tcp_address)) == sorted(b"b%d-%d" % (i, n) for n in range(10))
    assert len(got) == 20 and len(got.ids) == 20
    assert max(rdy_totals) == 1, rdy_totals


# -- 3. backoff, as the brokers see it -------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_backoff_visible_in_broker_stats(start_broker, services, name):
    brokers = [start_broker(*FAST_SCAN) for _ in range(2)]
    first, second = brokers
    topic = name()
    held: list[defer.Deferred] = []
    mode = ["ok"]

    def respond(message):
        if mode[0] == "fail":
            mode[0] = "hold"
            raise RuntimeError("the handler fails once")
        if mode[0] == "hold":  # the message that tests the waters waits for the test
            mode[0] = "ok"
            held.append(defer.Deferred())
            return held[-1]
        return None

    got = Recorder(respond)
    await consumer(services, topic, "c", got, nsqd_tcp_addresses=[b.tcp_address for b in brokers],
                   max_in_flight=4, backoff_multiplier=0.4, default_requeue_delay=0.1)
    producers = [producer(services, b.tcp_address) for b in brokers]

    def rdy() -> tuple[int, ...]:
        return tuple(sum(ready_counts(b, topic, "c")) for b in brokers)

    # Full RDY: max_in_flight 4 over two connections.
    await publish_all(producers[0], topic, [b"warm-up"])
    await publish_all(producers[1], topic, [b"warm-up-2"])
    await wait_until(lambda: len(got) == 2 and rdy() == (2, 2),
                     what=lambda: f"the warm-ups handled and RDY 2 on each broker (RDY {rdy()})")

    mode[0] = "fail"
    await publish_all(producers[0], topic, [b"bad"])
    await wait_until(lambda: rdy() == (0, 0), interval=0.005, what="RDY 0 on every broker (backoff)")
    bodies = [b"good-%d" % i for i in range(3)]
    for p in producers:
        await publish_all(p, topic, bodies)
    # After the backoff, RDY 1 on one connection only; its message is held by the handler.
    await wait_until(lambda: held and sorted(rdy()) == [0, 1],
                     what=lambda: f"RDY 1 on one broker (RDY {rdy()}, held {len(held)}, "
                                  f"handled {got.deliveries})")
    await sleep(0.2)
    assert held and not held[0].called and sorted(rdy()) == [0, 1], rdy()
    # One success ends the backoff: full RDY again.
    held[0].callback(None)
    await wait_until(lambda: rdy() == (2, 2), what="RDY 2 on each broker after the success")
    expected = {b"warm-up": 1, b"warm-up-2": 1, b"bad": 2, **{b: 2 for b in bodies}}
    await wait_until(lambda: got.bodies == expected, what="every message handled")
    await drained(first, topic, "c", 1 + 1 + len(bodies), requeued=1)
    await drained(second, topic, "c", 1 + len(bodies))
    assert [d[2] for d in got.deliveries if d[1] == b"bad"] == [1, 2]


# -- 4. lookupd discovery ---------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_lookupd_discovery_adds_and_drops_brokers(start_broker, start_lookupd, services, name):
    lookupd = start_lookupd()
    flags = (*FAST_SCAN, "--broadcast-address=127.0.0.1", f"--lookupd-tcp-address={lookupd.tcp_address}")
    early = start_broker(*flags)
    topic = name()
    early_producer = producer(services, early.tcp_address)
    await publish_all(early_producer, topic, [b"early-%d" % i for i in range(5)])

    def listed() -> set[str]:
        status, body = lookupd.get(f"/lookup?topic={topic}")
        if status != 200:
            return set()
        return {f"{p['broadcast_address']}:{p['tcp_port']}" for p in body["producers"]}

    await wait_until(lambda: listed() == {early.tcp_address}, what="the first broker registered")
    got = Recorder()
    c = await consumer(services, topic, "c", got, wait=False,
                       lookupd_http_addresses=[lookupd.http_address],
                       lookupd_poll_interval=0.2, lookupd_poll_jitter=0.1, max_in_flight=10)
    await wait_until(lambda: len(got) >= 5, what="the first broker's messages")

    late = start_broker(*flags)
    await publish_all(producer(services, late.tcp_address), topic, [b"late-%d" % i for i in range(5)])
    await wait_until(lambda: connected(c) == {early.tcp_address, late.tcp_address},
                     what="the consumer to find the later broker")
    await wait_until(lambda: len(got) >= 10, what="the later broker's messages")
    assert sorted(got.from_nsqd(late.tcp_address)) == [b"late-%d" % i for i in range(5)]
    assert sorted(got.from_nsqd(early.tcp_address)) == [b"early-%d" % i for i in range(5)]
    assert len(got.ids) == 10
    await drained(late, topic, "c", 5)

    # A clean stop unregisters the broker; the next polls drop it.
    await early_producer.stop()
    early.stop_cleanly()
    await wait_until(lambda: listed() == {late.tcp_address}, what="lookupd to drop the stopped broker")
    await wait_until(lambda: set(c.connections) == {late.tcp_address},
                     what="the consumer to drop the stopped broker")
    for _ in range(5):  # several polls later it is still gone, not redialled
        await sleep(0.2)
        assert set(c.connections) == {late.tcp_address}
    assert len(got) == 10


# -- 5. a durable broker restarted under the client -------------------------------------------------


@pytest.mark.parametrize("how", ["restart", "crash"])
@pytest_twisted.ensureDeferred
async def test_durable_restart_mid_stream(how, start_broker, services, name):
    port = free_port()
    broker = start_broker("--durable", *FAST_SCAN, f"--tcp-address=127.0.0.1:{port}",
                          "--http-address=127.0.0.1:0", addresses=False)
    address = broker.tcp_address
    assert address == f"127.0.0.1:{port}"
    topic = name()
    first = [b"first-%03d" % i for i in range(60)]
    second = [b"second-%03d" % i for i in range(60)]
    p = producer(services, address)
    await publish_all(p, topic, first)

    held: list[tuple[bytes, defer.Deferred]] = []
    holding = [True]

    def respond(message):
        # The first 30 are finished at once; then every delivery waits (in
        # flight) until the test lets go, so the restart interrupts exactly
        # those handlers.
        if holding[0] and len(got) > 30:
            d = defer.Deferred()
            held.append((message.id, d))
            return d
        return None

    got = Recorder(respond)
    c = await consumer(services, topic, "c", got, nsqd_tcp_addresses=[address], max_in_flight=10)
    await wait_until(lambda: len(held) == 10, what="ten handlers holding their messages")

    def settled():
        stats = channel_stats(broker, topic, "c")
        finished = sum(client["finish_count"] for client in (stats or {}).get("clients") or ())
        return stats and finished == 30 and stats["in_flight_count"] == 10

    await wait_until(settled, what="the broker to have every FIN sent so far")
    # A durable OK after the FINs were processed: their commit is synced too.
    assert await p.publish(topic, second[0]) == b"OK"
    interrupted = {msg_id for msg_id, _ in held}
    old_conn = c.connections[address]

    # Publish the rest, one every 10 ms, while the broker goes down and comes back.
    acked = set(first) | {second[0]}
    acked_at: list[float] = []
    retried = [0]

    async def stream():
        deadline = time.monotonic() + 15
        for body in second[1:]:
            while True:
                try:
                    answer = await p.publish(topic, body)
                    break
                except Exception:  # noqa: BLE001 - the connection went: the broker may or may not have it
                    retried[0] += 1
                    assert time.monotonic() < deadline, f"{body!r} still not published"
                    await sleep(0.05)
            assert answer == b"OK"
            acked.add(body)
            acked_at.append(time.monotonic())
            await sleep(0.01)

    publishing = defer.ensureDeferred(stream())
    await wait_until(lambda: len(acked_at) >= 10, what="the stream to be under way")
    if how == "restart":
        await threads.deferToThread(broker.restart)
    else:
        await threads.deferToThread(lambda: (broker.crash(), broker.start()))
    back_at = time.monotonic()
    assert broker.tcp_address == address
    await publishing
    assert acked_at[-1] > back_at, "the stream ended before the broker was back"
    await wait_until(lambda: address in connected(c) and c.connections[address] is not old_conn,
                     what="the consumer to reconnect by itself")
    assert p.connected  # it answered the last publishes

    holding[0] = False
    for _, d in held:
        d.callback(None)  # the interrupted ones answer on a connection that is gone
    await wait_until(lambda: acked <= set(got.bodies), timeout=20, what="every acknowledged body handled")
    await wait_until(lambda: not any(conn.in_flight for conn in c.connections.values()),
                     what="nothing in flight at the consumer")

    def empty():
        stats = channel_stats(broker, topic, "c")
        return (stats["depth"], stats["in_flight_count"], stats["deferred_count"]) == (0, 0, 0)

    await wait_until(empty, what=lambda: f"the channel emptied: {channel_stats(broker, topic, 'c')}")

    twice = {msg_id for msg_id, n in got.ids.items() if n > 1}
    # Handled twice: exactly the messages whose handler the restart interrupted.
    assert twice == interrupted, (len(twice), len(interrupted))
    assert all(got.ids[msg_id] == 2 for msg_id in interrupted)
    assert set(got.bodies) <= set(first) | set(second)
    # A body published twice (its first PUB's answer was lost) is the only other repeat.
    assert sum(got.bodies.values()) - len(got.bodies) <= len(interrupted) + retried[0]


# -- 6. stop() while a handler is still running ---------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_stop_waits_for_a_slow_handler(start_broker, services, name):
    broker = start_broker(*FAST_SCAN)
    topic = name()
    events: list[str] = []

    def slow(message):
        events.append("handler started")
        d = defer.Deferred()
        reactor.callLater(0.8, lambda: (events.append("handler done"), d.callback(None)))
        return d

    got = Recorder(slow)
    c = await consumer(services, topic, "c", got, nsqd_tcp_addresses=[broker.tcp_address],
                       max_in_flight=1)
    await publish_all(producer(services, broker.tcp_address), topic, [b"slow", b"left"])
    await wait_until(lambda: events == ["handler started"], what="the slow handler to start")
    conn = c.connections[broker.tcp_address]
    stopping = c.stop()
    stopping.addCallback(lambda _: events.append("stopped"))
    # CLS: the broker puts the client in its closing state with RDY 0; the
    # message stays in flight until the handler is done.
    clients = await wait_until(lambda: [cl for cl in channel_stats(broker, topic, "c")["clients"] or ()
                                        if cl["state"] == 4],
                               what="the broker to see CLS")
    assert (clients[0]["ready_count"], clients[0]["in_flight_count"]) == (0, 1)
    assert conn.closing and events == ["handler started"]
    started = time.monotonic()
    await wait_until(lambda: stopping.called, what="stop() to finish")
    assert time.monotonic() - started < 5
    assert events == ["handler started", "handler done", "stopped"]
    stats = await wait_until(lambda: (s := channel_stats(broker, topic, "c")) and not s["clients"] and s,
                             what="the broker to see the connection closed")
    # Two came in, one is still queued, none in flight, requeued or timed out: "slow" was FINed.
    assert (stats["message_count"], stats["depth"], stats["in_flight_count"], stats["requeue_count"],
            stats["timeout_count"]) == (2, 1, 0, 0, 0), stats
    assert not conn.connected and not any(x.connected for x in c.connections.values())
    assert got.bodies == {b"slow": 1}
    assert not c.running
