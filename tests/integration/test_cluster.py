"""A cluster on loopback: two brokers announcing themselves to one mqlookupd, re-announcing to a new or restarted one.

Consumers find producers only through lookupd here, as a pynsq Reader given
`lookupd_http_addresses` does in production.
"""

from __future__ import annotations

import json

import nsq
import pytest

from tests.support.processes import FAST_SCAN, http_request
from tests.support.pynsq_loop import Collector


def producers(lookupd, topic: str) -> set[tuple[str, int, int]]:
    """(broadcast_address, tcp_port, http_port) of the topic's producers, per lookupd."""
    status, body = lookupd.get(f"/lookup?topic={topic}")
    if status != 200:
        return set()
    return {(p["broadcast_address"], p["tcp_port"], p["http_port"]) for p in body["producers"]}


def node(broker) -> tuple[str, int, int]:
    return ("127.0.0.1", broker.tcp_port, broker.http_port)


@pytest.fixture
def cluster(start_lookupd, start_broker):
    lookupd = start_lookupd()
    brokers = [start_broker(*FAST_SCAN, "--broadcast-address=127.0.0.1",
                            f"--lookupd-tcp-address={lookupd.tcp_address}") for _ in range(2)]
    return lookupd, brokers


def test_reader_finds_every_producer_through_lookupd(cluster, loop):
    lookupd, brokers = cluster
    for i, broker in enumerate(brokers):
        w = loop.writer(broker)
        assert loop.publish(w, "pub", "spread", f"from-{i}".encode()) == b"OK"
    loop.run_until(lambda: producers(lookupd, "spread") == {node(b) for b in brokers},
                   what="both brokers registered for the topic")
    got = Collector()
    reader = nsq.Reader(topic="spread", channel="c", message_handler=got,
                        lookupd_http_addresses=[f"http://{lookupd.http_address}"],
                        lookupd_poll_interval=1, max_in_flight=10)
    loop.clients.append(reader)
    loop.run_until(lambda: len(got) >= 2, what="a message from each broker")
    assert sorted(got.bodies) == [b"from-0", b"from-1"]
    # The channel the Reader made on each broker is registered too.
    loop.run_until(lambda: "c" in (lookupd.get("/channels?topic=spread")[1] or {}).get("channels", []),
                   what="the channel registered")


def test_killed_broker_drops_out_of_lookup(cluster, loop):
    lookupd, (alive, dead) = cluster
    for broker in (alive, dead):
        assert broker.post("/topic/create?topic=t") == 200
    loop.run_until(lambda: producers(lookupd, "t") == {node(alive), node(dead)}, what="both registered")
    dead.kill()
    loop.run_until(lambda: producers(lookupd, "t") == {node(alive)}, what="the killed broker to go")


def test_restarted_lookupd_gets_every_registration_back(cluster, start_lookupd, loop):
    lookupd, brokers = cluster
    for broker in brokers:
        for path in ("/topic/create?topic=only-topic", "/topic/create?topic=with-channel",
                     "/channel/create?topic=with-channel&channel=ch"):
            assert broker.post(path) == 200
    loop.run_until(lambda: producers(lookupd, "with-channel") == {node(b) for b in brokers},
                   what="both registered")
    lookupd.kill()
    # A new lookupd (new ports); the brokers are told at run time.
    replacement = start_lookupd()
    for broker in brokers:
        status, _ = http_request(broker.http_address, "PUT", "/config/nsqlookupd_tcp_addresses",
                                 json.dumps([replacement.tcp_address]).encode())
        assert status == 200
    for topic in ("only-topic", "with-channel"):
        loop.run_until(lambda topic=topic: producers(replacement, topic) == {node(b) for b in brokers},
                       what=f"{topic} registered again")
    _, channels = replacement.get("/channels?topic=with-channel")
    assert channels["channels"] == ["ch"]


def test_info_and_nodes_agree(cluster, loop):
    lookupd, brokers = cluster
    loop.run_until(lambda: len(lookupd.get("/nodes")[1]["producers"]) == 2, what="both brokers identified")
    _, nodes = lookupd.get("/nodes")
    seen = {(p["broadcast_address"], p["tcp_port"], p["http_port"], p["version"])
            for p in nodes["producers"]}
    expected = set()
    for broker in brokers:
        _, info = broker.get("/info")
        expected.add((info["broadcast_address"], info["tcp_port"], info["http_port"], info["version"]))
    assert seen == expected


def test_lookupd_back_on_the_same_port_gets_every_registration_back(cluster, start_lookupd, loop):
    lookupd, brokers = cluster
    for broker in brokers:
        assert broker.post("/topic/create?topic=t") == 200
    loop.run_until(lambda: producers(lookupd, "t") == {node(b) for b in brokers}, what="both registered")
    lookupd.kill()
    # The brokers keep redialling (with a backoff) and re-announce on reconnecting.
    again = start_lookupd(f"--tcp-address={lookupd.tcp_address}")
    loop.run_until(lambda: producers(again, "t") == {node(b) for b in brokers},
                   timeout=20, what="both brokers registered again")
