"""The reliability suite: each of issue #16's defects as a named regression test,
plus fuzzing, a model-based test and fault tests (kill -9, a full disk, stuck clients).

In-process tests reuse the unit fixtures (a broker on a `task.Clock`, V2
clients on StringTransports); tests of real processes reuse the
integration fixtures (`start_broker`, `start_lookupd`, `loop`).
"""

import os
import subprocess
from pathlib import Path

import pytest

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


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(size_mb) -> the mount point of a tmpfs of that size, unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (run as root to test a full disk)")
    mounts: list[Path] = []

    def mount(size_mb: int) -> Path:
        mnt = tmp_path / f"tmpfs{len(mounts)}"
        mnt.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mnt)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(mnt)
        return mnt

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
