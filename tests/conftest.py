"""Fixtures more than one test directory uses, and the `slow` marker's rule.

In process (unit and reliability tests): `inproc_broker`, a Broker object
on a `task.Clock`, so heartbeats, read timeouts, in-flight expiry and
deferred delivery are driven by `clock.advance()`, with V2 clients on
StringTransports (`connect`, `publish`) and an HTTP client of its API
(`http`). Real processes (integration, reliability and Spark tests):
twistd mqd and mqlookupd on ephemeral ports (`start_broker`,
`start_lookupd`; tests/integration/conftest.py adds `twistd_broker`), a
tornado loop for pynsq, an auth server, certificates.

A test is `slow` when it starts a real process: it uses one of
`REAL_PROCESS_FIXTURES` (directly or through another fixture), lives in a
directory of `SLOW_DIRS`, or is marked `@pytest.mark.slow` itself. A test
not marked slow that starts twistd, the auth server, a tool or the Spark
bridge as a process fails, saying so (`_real_processes_are_slow`), so the
fast loop (`pytest -m "not slow"`) stays in memory.

A directory's own conftest.py holds the fixtures only its tests use.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from twisted.internet import defer
from twisted.internet.task import Clock

import mqd.nsqd.http.snapshot as snapshot_endpoint
from mqd.nsqd.broker import Broker
from tests.support.admin import AdminProcess
from tests.support.authd import AuthServer
from tests.support.certs import Certs, make_certs
from tests.support.http_client import HTTPClient
from tests.support.inprocess_broker import START_TIME, new_broker
from tests.support.processes import BrokerProcess, LookupdProcess
from tests.support.pynsq_loop import Loop
from tests.support.v2_client import Client
from tests.support.v2_frames import identify, mpub, ok, pub

# -- the fast loop: which tests are `slow` ---------------------------------------------

# Fixtures that start a real process: a test using one, directly or through
# another fixture, is marked slow.
REAL_PROCESS_FIXTURES = frozenset({
    "start_broker",  # twistd mqd
    "start_lookupd",  # twistd mqlookupd
    "twistd_broker",  # tests/integration's default broker, a twistd mqd
    "authd",  # the auth server, a process of its own
    "tmpfs",  # a filesystem mounted for a real broker to fill
    "spark",  # a local Spark session: a JVM
})

# Directories (under tests/) whose every test runs real processes.
SLOW_DIRS = ("spark",)

_TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    slow_dirs = [_TESTS / d for d in SLOW_DIRS]
    for item in items:
        if item.get_closest_marker("slow"):
            continue
        if (REAL_PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or any(item.path.is_relative_to(d) for d in slow_dirs)):
            item.add_marker(pytest.mark.slow)


def _real_process(args) -> str | None:
    """What `args` starts if it is one of the project's daemons or commands, else None."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    argv = [os.fsdecode(a) for a in argv]
    if len(argv) == 1 and " " in argv[0]:  # a shell command line
        argv = argv[0].split()
    for i, arg in enumerate(argv):
        name = Path(arg).name
        if name == "twistd" or name == "authd_server.py":
            return f"`{name}`"
        if arg == "-m" and i + 1 < len(argv):
            module = argv[i + 1]
            if module.startswith(("mqd", "spark_bridge")):
                return f"`python -m {module}`"
    return None


@pytest.fixture(autouse=True)
def _real_processes_are_slow(request, monkeypatch) -> None:
    """A test not marked slow may not start twistd, the auth server, a tool or the Spark bridge.

    So the fast loop stays in memory as tests are added: such a test fails
    saying what to mark (or which fixture to use) instead of running slowly.
    """
    if request.node.get_closest_marker("slow"):
        return
    popen_init = subprocess.Popen.__init__

    def guarded_init(self, args, *a, **kw):
        what = _real_process(args)
        if what is not None:
            pytest.fail(f"{request.node.nodeid} starts {what} as a process but is not marked "
                        "slow: mark it @pytest.mark.slow, or start it through a fixture of "
                        "REAL_PROCESS_FIXTURES (tests/conftest.py)", pytrace=False)
        popen_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_init)


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
def inproc_broker(make_broker) -> Broker:
    """A Broker object in this process, on the test clock, with default settings (memory backend).

    Not a process: tests/integration/conftest.py's `twistd_broker` is the real one.
    """
    return make_broker()


@pytest.fixture
def connect(inproc_broker):
    """connect(**kw): a new V2 client (on a StringTransport) of `inproc_broker`."""
    ports = iter(range(20000, 30000))

    def make(**kw) -> Client:
        kw.setdefault("port", next(ports))
        return Client(inproc_broker, **kw)

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
def http(inproc_broker, sync_threads):
    """An in-process HTTP client of `inproc_broker`'s API."""
    return HTTPClient(inproc_broker)


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
def start_admin(tmp_path) -> Iterator[Callable[..., AdminProcess]]:
    """start_admin(*flags) -> a running mqadmin, killed at teardown like start_broker's."""
    started: list[AdminProcess] = []

    def start(*args: str) -> AdminProcess:
        admin = AdminProcess(tmp_path / f"admin{len(started)}", args)
        started.append(admin)
        return admin.start()

    yield start
    for admin in started:
        admin.kill()


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
