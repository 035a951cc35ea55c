"""The reliability suite: a regression test for each defect found in a review of the
broker, named after the behaviour it checks, plus fuzzing, a model-based test and
fault tests (kill -9, a full disk, stuck clients).

In-process tests use the fixtures of tests/conftest.py (a broker on a
`task.Clock`, V2 clients on StringTransports), as do the tests of real
processes (`start_broker`, `start_lookupd`, `loop`).
"""

import os
import subprocess
from pathlib import Path

import pytest

from mqd.nsqd import batches
from tests.support.reactor_turns import CHUNK


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


@pytest.fixture
def small_chunks(monkeypatch) -> None:
    """Big batches published `CHUNK` messages (text: 2 * `CHUNK` lines) per reactor turn."""
    monkeypatch.setattr(batches, "CHUNK_MESSAGES", CHUNK)
    monkeypatch.setattr(batches, "TEXT_PIECE", 2 * CHUNK)
