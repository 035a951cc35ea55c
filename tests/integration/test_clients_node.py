"""Node NSQ clients (nsqjs, squeaky) against a running broker.

Each test runs one script of tests/integration/node/ (`node SCRIPT
HOST:PORT TOPIC CHANNEL [COMPRESSION]`), which publishes with PUB, MPUB and
DPUB, consumes with FIN and REQ (at once and delayed) and prints what it
saw as one JSON line; the assertions are the asyncnsq test's. The packages
come from the committed package-lock.json (tests/ensure_node.py, which tox
runs first and the fixture below runs again if needed).

squeaky declares an MPUB body's size as the messages' bytes only, without
the 4-byte message count; nsqd reads the count and messages regardless of
that size (it only bounds it), and so must mqd.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.ensure_node import NODE_DIR, ensure
from tests.support.client_scenario import DEFER_MS, REQUEUE_DELAY_MS, check_scenario
from tests.support.processes import FAST_SCAN

SCRIPT_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def node_packages() -> dict[str, str]:
    """{package: pinned version}, with node_modules installed from the lockfile."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed (Debian: apt-get install nodejs npm)")
    problem = ensure()
    if problem is not None:
        pytest.fail(f"the Node clients could not be installed: {problem}")
    return json.loads((NODE_DIR / "package.json").read_text())["dependencies"]


def run_script(script: str, broker, topic: str, channel: str, *args: str) -> dict:
    """The script's JSON report; fails with its output if it exits non-zero."""
    argv = ["node", str(NODE_DIR / script), broker.tcp_address, topic, channel, *args]
    try:
        done = subprocess.run(argv, cwd=NODE_DIR, capture_output=True, text=True,
                              timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{script} did not finish within {SCRIPT_TIMEOUT}s\n"
                             f"stdout: {e.stdout}\nstderr: {e.stderr}\n{broker.describe()}") from None
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, (
        f"{script} exited with {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr[-3000:]}"
        f"\n{broker.describe()}")
    result = json.loads(lines[-1])
    assert (result["defer_ms"], result["requeue_delay_ms"]) == (DEFER_MS, REQUEUE_DELAY_MS)
    # The asyncnsq test's shape: (body, attempts, seconds since start).
    result["deliveries"] = [(d["body"], d["attempts"], d["ms"] / 1000) for d in result["deliveries"]]
    result["deferred_at"] = result["deferred_at_ms"] / 1000
    return result


@pytest.mark.parametrize("compression", ["none", "snappy", "deflate"])
def test_nsqjs_publish_consume_requeue_defer(node_packages, start_broker, name, compression):
    broker = start_broker(*FAST_SCAN)
    result = run_script("nsqjs_roundtrip.js", broker, name(), name("c"), compression)
    assert result["version"] == node_packages["nsqjs"]
    check_scenario(result)
    on = {"snappy": compression == "snappy", "deflate": compression == "deflate",
          "version": "1.3.0"}
    assert result["negotiated"] == {"writer": on, "reader": on}
    # nsqjs ends a connection with CLS written past its compressor, which
    # nsqd (and mqd) reject as bad compressed data: nothing else may be.
    bad = [line for line in broker.log().splitlines() if "bad compressed data" in line]
    assert len(bad) <= (2 if compression != "none" else 0), broker.describe()


def test_squeaky_publish_consume_requeue_defer(node_packages, start_broker, name):
    """squeaky's MPUB (body size without the message count) is accepted as nsqd accepts it."""
    broker = start_broker(*FAST_SCAN)
    result = run_script("squeaky_roundtrip.js", broker, name(), name("c"))
    assert result["version"] == node_packages["squeaky"]
    check_scenario(result)
