"""Each object owns its state: no module outside the tests reaches into another's.

An attribute whose name starts with an underscore belongs to the object
that holds it: other objects change it through that object's methods. The
check is ruff's SLF001 (a private member reached through anything but
`self`, `cls` or `super()`), over every source tree that ships or runs
beside the broker. The tests themselves may look inside what they test.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import REPO_ROOT

CHECKED = ["mqd", "backends", "spark_bridge", "twisted", "bench", "examples"]


def test_no_module_reads_or_writes_another_objects_private_attributes():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "SLF001",
         "--output-format", "json", *CHECKED],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr
    found = json.loads(done.stdout or "[]")
    places = [f"{f['filename'].removeprefix(str(REPO_ROOT) + '/')}:{f['location']['row']}: "
              f"{f['message']}" for f in found]
    assert places == [], "private state reached from outside its object:\n" + "\n".join(places)
