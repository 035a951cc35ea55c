"""Which parts may load which: dependencies point one way.

The contracts in pyproject.toml (import-linter) say it for every import in
the source, lazy ones included: tools -> client -> shared modules; the
broker -> shared modules + stores; mqlookupd and mqadmin -> shared modules;
the Spark bridge -> client, shared modules and the broker's snapshot
format. The checks below add what a static graph cannot see: what a
fresh interpreter actually loads when a daemon's entry point is imported,
third-party packages included.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    done = subprocess.run([lint, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_no_two_modules_import_each_other_directly_or_through_others():
    """No import circle: every module can be read, and loaded, before the ones that use it."""
    import grimp

    graph = grimp.build_graph("mqd", "backends", "spark_bridge", cache_dir=None)
    circles = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back:
                circles.add((module,) + tuple(back))
    assert sorted(circles) == []


def modules_loaded_by(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return set(json.loads(out))


def under(loaded: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes))


# The client runs in the tools and in Spark's executors and streaming-source
# process, none of which has any use for a daemon, LMDB or the Spark bridge.
@pytest.mark.parametrize("entry", ["mqd.client", "mqd.tools.tail", "mqd.tools.stat"])
def test_the_client_and_tools_load_no_daemon_store_or_spark(entry):
    loaded = modules_loaded_by(entry)
    assert under(loaded, ("mqd.nsqd", "mqd.lookup", "mqd.admin", "backends", "lmdb",
                          "spark_bridge", "pyspark")) == []


# mqlookupd and mqadmin run on machines with no broker: neither loads it nor LMDB.
@pytest.mark.parametrize("entry", ["mqd.lookup.tap", "mqd.admin.tap"])
def test_lookupd_and_admin_load_no_broker_or_store(entry):
    loaded = modules_loaded_by(entry)
    assert under(loaded, ("mqd.nsqd", "backends", "lmdb", "spark_bridge", "pyspark")) == []


def test_the_broker_loads_neither_the_spark_bridge_nor_spark():
    loaded = modules_loaded_by("mqd.nsqd.tap")
    assert "mqd.nsqd.http.snapshot" in loaded and "mqd.nsqd.capture" in loaded
    assert under(loaded, ("spark_bridge", "pyspark", "pyarrow", "mqd.client", "mqd.lookup",
                          "mqd.admin")) == []
