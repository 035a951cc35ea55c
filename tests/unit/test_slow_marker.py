"""The `slow` marker's rule (tests/conftest.py): real processes are slow, everything else is fast."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REAL_PROCESS_FIXTURES, _real_process
from tests.support.cli_tools import tool
from tests.support.processes import twistd_command


@pytest.mark.parametrize("argv", [
    twistd_command("--tcp-address=127.0.0.1:0"),
    twistd_command(program="mqlookupd"),
    twistd_command(program="mqadmin"),
    tool("pub", "--topic=t"),
    tool("to_file", "--help"),
    [sys.executable, "-m", "spark_bridge", "snapshot"],
    [sys.executable, "tests/support/authd_server.py", "state.json", "queries.jsonl"],
    "twistd -n mqd",
])
def test_the_projects_daemons_and_commands_are_real_processes(argv):
    assert _real_process(argv) is not None


@pytest.mark.parametrize("argv", [
    [sys.executable, "-c", "import mqd.client"],
    [sys.executable, "-m", "ruff", "check"],
    ["node", "--check", "app.js"],
    ["ss", "-ltnH"],
])
def test_other_commands_are_not_counted(argv):
    assert _real_process(argv) is None


def test_this_test_is_fast_and_uses_no_process_fixture(request):
    assert request.node.get_closest_marker("slow") is None
    assert not REAL_PROCESS_FIXTURES.intersection(request.fixturenames)


def test_every_collected_test_using_a_process_fixture_is_slow(request):
    """Over this run's tests (all of them when no `-m` deselected any)."""
    unmarked = [item.nodeid for item in request.session.items
                if REAL_PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("slow") is None]
    assert unmarked == []
