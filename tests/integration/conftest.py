"""Fixtures that run the real broker (twistd mqd) and a fresh tornado loop per test."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from tests.integration._support import FAST_SCAN, BrokerProcess, LookupdProcess, Loop

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
def broker(start_broker) -> BrokerProcess:
    """A broker with default settings but a fast queue scan."""
    return start_broker(*FAST_SCAN)


@pytest.fixture
def loop() -> Iterator[Loop]:
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
