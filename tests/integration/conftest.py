"""The integration tests' `broker`: a real twistd mqd.

The other fixtures of real processes (`start_broker`, `start_lookupd`,
`loop`, `name`) are in tests/conftest.py.
"""

from __future__ import annotations

import pytest

from tests.support.processes import FAST_SCAN, BrokerProcess


@pytest.fixture
def broker(start_broker) -> BrokerProcess:
    """A broker with default settings but a fast queue scan."""
    return start_broker(*FAST_SCAN)
