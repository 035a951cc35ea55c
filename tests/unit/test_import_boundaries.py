"""Which parts may load which: dependencies point one way.

The client (txnsq) runs in the tools and in Spark's executors and
streaming-source process, none of which has any use for the broker,
LMDB or the Spark bridge. The broker writes the snapshot format the Spark
bridge reads, and needs neither the bridge nor Spark nor Arrow. Each check imports a package in a fresh
interpreter and lists what came with it, so an import added anywhere
along the way (not only in the package itself) fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.integration._support import REPO_ROOT


def modules_loaded_by(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return set(json.loads(out))


# What the client must not pull in: the broker's core and protocol, the other daemons,
# the storage backends and the Spark bridge.
NOT_FOR_THE_CLIENT = ("mqd.broker", "mqd.topic", "mqd.channel", "mqd.protocol.v2", "mqd.http",
                      "mqd.lookup", "mqd.admin", "mqd.capture", "backends", "lmdb",
                      "spark_bridge", "pyspark")


def test_the_client_loads_no_broker_backend_or_spark_module():
    loaded = modules_loaded_by("mqd.client")
    forbidden = sorted(m for m in loaded
                       if any(m == p or m.startswith(p + ".") for p in NOT_FOR_THE_CLIENT))
    assert forbidden == []


# The broker with everything its daemon builds: HTTP API, peek, snapshots, capture.
BROKER_MODULES = ("mqd.service", "mqd.http.api", "mqd.http.snapshot", "mqd.http.peek",
                  "mqd.capture", "mqd.snapshot_space")


def test_the_broker_loads_neither_the_spark_bridge_nor_spark():
    loaded = modules_loaded_by(", ".join(BROKER_MODULES))
    forbidden = sorted(m for m in loaded
                       if m.split(".")[0] in ("spark_bridge", "pyspark", "pyarrow"))
    assert forbidden == []
