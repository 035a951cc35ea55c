"""The stores stay readable: no module of backends/ grows past what one reading holds.

The LMDB store is split along its seams (the write set, the publish log's
writer, the environment, crash replay, mapped pages, the queue, the
store); a module that grows past the bound is a sign that another seam
wants a module of its own.
"""

from __future__ import annotations

from tests.support.processes import REPO_ROOT

MAX_LINES = 700


def test_no_module_of_the_stores_is_over_700_lines():
    sizes = {path.name: len(path.read_text().splitlines())
             for path in sorted((REPO_ROOT / "backends").glob("*.py"))}
    assert sizes, "no store modules found"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
