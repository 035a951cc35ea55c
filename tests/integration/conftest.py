"""The integration tests' `twistd_broker` (a real twistd mqd, a process of its own) and `browser`.

Its in-process counterpart, `inproc_broker` (a Broker object on a
`task.Clock`), and the other fixtures of real processes (`start_broker`,
`start_lookupd`, `loop`, `name`) are in tests/conftest.py. Every test that
uses `twistd_broker` is marked slow there.
"""

from __future__ import annotations

import pytest

from tests.support.processes import FAST_SCAN, BrokerProcess


@pytest.fixture
def twistd_broker(start_broker) -> BrokerProcess:
    """A running twistd mqd with default settings but a fast queue scan."""
    return start_broker(*FAST_SCAN)


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium per test module (mqadmin's pages), quit at the module's end."""
    from tests.support.admin import chromium

    with chromium() as driver:
        yield driver
