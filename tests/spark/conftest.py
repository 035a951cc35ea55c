"""Fixtures of the Spark bridge's tests: one local Spark session, a snapshot with known content.

`spark` starts once per run (~8 s) and is shared by every test here; a
test that changes its configuration restores it. `known_snapshot` is
`tests.support.known_snapshots.STANDARD_QUEUES` written once per run: tests only read it.
The real-broker fixtures (`start_broker`) are in tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.known_snapshots import (
    STANDARD_QUEUES,
    KnownSnapshot,
    build_snapshot,
    expected_rows,
)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    # No importorskip: the test env installs the spark extra, and a missing
    # pyspark must fail the run, not skip the bridge's tests.
    from spark_bridge.session import build_session

    session = build_session("local[2]", conf={"spark.ui.enabled": "false"})
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def known_snapshot(tmp_path_factory) -> KnownSnapshot:
    path = build_snapshot(tmp_path_factory.mktemp("known"), STANDARD_QUEUES)
    return KnownSnapshot(path, STANDARD_QUEUES, expected_rows(STANDARD_QUEUES))
