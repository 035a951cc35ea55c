"""The reliability suite: each of issue #16's defects as a named regression test,
plus fuzzing, a model-based test and fault tests (kill -9, a full disk, stuck clients).

In-process tests reuse the unit fixtures (a broker on a `task.Clock`, V2
clients on StringTransports); tests of real processes reuse the
integration fixtures (`start_broker`, `start_lookupd`, `loop`).
"""

from tests.integration.conftest import loop, name, start_broker, start_lookupd  # noqa: F401
from tests.unit.conftest import (  # noqa: F401
    broker,
    clock,
    connect,
    http,
    make_broker,
    publish,
    sync_threads,
)
