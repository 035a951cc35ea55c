"""Fixtures more than one test directory uses.

In process (unit and reliability tests): a broker on a `task.Clock`, so
heartbeats, read timeouts, in-flight expiry and deferred delivery are
driven by `clock.advance()`, with V2 clients on StringTransports and an
HTTP client of its API. Real processes (integration, reliability and Spark
tests): twistd mqd and mqlookupd on ephemeral ports, a tornado loop for
pynsq, an auth server, certificates.

A directory's own conftest.py holds the fixtures only its tests use;
tests/integration/conftest.py's `broker` (a real process) stands in there
for the in-process one defined here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest
from twisted.internet import defer
from twisted.internet.task import Clock

import mqd.nsqd.http.snapshot as snapshot_endpoint
from mqd.nsqd.broker import Broker
from tests.support.authd import AuthServer
from tests.support.certs import Certs, make_certs
from tests.support.http_client import HTTPClient
from tests.support.inprocess_broker import START_TIME, new_broker
from tests.support.processes import BrokerProcess, LookupdProcess
from tests.support.pynsq_loop import Loop
from tests.support.v2_client import Client
from tests.support.v2_frames import identify, mpub, ok, pub

# -- a broker in process ---------------------------------------------------------------


@pytest.fixture
def clock() -> Clock:
    """The reactor clock of the in-process broker, at START_TIME."""
    c = Clock()
    c.advance(START_TIME)
    return c


@pytest.fixture
def make_broker(tmp_path, clock):
    """make_broker(**flags): a broker on the test clock, data in tmp_path (or path=)."""

    def make(path=None, **flags) -> Broker:
        return new_broker(path or tmp_path, clock, **flags)

    return make


@pytest.fixture
def broker(make_broker) -> Broker:
    """A broker on the test clock with default settings (the memory backend)."""
    return make_broker()


@pytest.fixture
def connect(broker):
    """connect(**kw): a new client of the default broker."""
    ports = iter(range(20000, 30000))

    def make(**kw) -> Client:
        kw.setdefault("port", next(ports))
        return Client(broker, **kw)

    return make


@pytest.fixture
def publish(connect):
    """publish(*bodies, topic="t"): PUB one body or MPUB several, each answered OK."""
    p = connect()
    p.send(identify(heartbeat_interval=-1))
    assert p.read() == [ok()]

    def do(*data: bytes, topic="t"):
        if len(data) == 1:
            assert p.request(pub(topic, data[0])) == [ok()]
        else:
            assert p.request(mpub(topic, list(data))) == [ok()]

    return do


@pytest.fixture
def sync_threads(monkeypatch):
    """POST /snapshot writes in the request's call, not in a thread of the real reactor.

    The answer is then there when the request returns, and no snapshot
    thread outlives its test writing into a directory being removed.
    """
    monkeypatch.setattr(snapshot_endpoint.threads, "deferToThread",
                        lambda f, *a, **kw: defer.maybeDeferred(f, *a, **kw))


@pytest.fixture
def http(broker, sync_threads):
    """An in-process HTTP client of the default broker's API."""
    return HTTPClient(broker)


# -- real processes ----------------------------------------------------------------

_names = itertools.count(1)


@pytest.fixture
def start_broker(tmp_path) -> Iterator[Callable[..., BrokerProcess]]:
    """start_broker(*flags, addresses=True, data_path=True) -> a running BrokerProcess.

    Each broker has its own work directory (log, data) under tmp_path and
    is killed at teardown whatever the test did; `stop()` is the clean way.
    """
    brokers: list[BrokerProcess] = []

    def start(*args: str, addresses: bool = True, data_path: bool = True) -> BrokerProcess:
        broker = BrokerProcess(tmp_path / f"broker{len(brokers) + 1}", args,
                               addresses=addresses, data_path=data_path)
        brokers.append(broker)
        return broker.start()

    yield start
    for broker in brokers:
        broker.kill()


@pytest.fixture
def start_lookupd(tmp_path) -> Iterator[Callable[..., LookupdProcess]]:
    """start_lookupd(*flags) -> a running LookupdProcess, killed at teardown like start_broker's."""
    started: list[LookupdProcess] = []

    def start(*args: str) -> LookupdProcess:
        lookupd = LookupdProcess(tmp_path / f"lookupd{len(started) + 1}", args)
        started.append(lookupd)
        return lookupd.start()

    yield start
    for lookupd in started:
        lookupd.kill()


@pytest.fixture
def loop() -> Iterator[Loop]:
    """A fresh asyncio/tornado loop for pynsq's clients, closed with them at teardown."""
    loop = Loop()
    try:
        yield loop
    finally:
        loop.close()


@pytest.fixture
def name(request) -> Callable[[str], str]:
    """Unique, valid topic/channel names for this test."""
    base = "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]

    def make(kind: str = "t") -> str:
        return f"{base}.{kind}{next(_names)}"

    return make


@pytest.fixture
def authd(tmp_path) -> Iterator[AuthServer]:
    """An auth server process of its own, stopped at teardown."""
    server = AuthServer(tmp_path)
    yield server
    server.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    """A CA and the server and client certificates it signed, once per test module."""
    return make_certs(tmp_path_factory.mktemp("certs"))
