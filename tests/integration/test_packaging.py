"""The wheel carries the twistd plugin, which is how `twistd mqd` works once installed, and the tools."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.support.processes import REPO_ROOT

_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".tox", "build", "dist", "*.egg-info", "__pycache__", ".ruff_cache",
    ".pytest_cache", ".hypothesis", "dropin.cache", "data", "_trial_temp",
)


@pytest.mark.slow
def test_wheel_contains_the_twistd_plugin(tmp_path):
    # Built from a copy, so the build leaves nothing in the checkout.
    source = tmp_path / "src"
    shutil.copytree(REPO_ROOT, source, ignore=_NOT_SOURCE)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("mqd-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    names = set(zipfile.ZipFile(wheels[0]).namelist())

    assert "twisted/plugins/mqd_plugins.py" in names
    # Never Twisted's own package files: installing them would clobber Twisted.
    assert "twisted/__init__.py" not in names
    assert "twisted/plugins/__init__.py" not in names
    assert not any(n.startswith("twisted/") and n != "twisted/plugins/mqd_plugins.py"
                   for n in names), sorted(n for n in names if n.startswith("twisted/"))
    # Every module of the shipped packages, subpackages included (a
    # subpackage left out of [tool.setuptools] packages only shows here: in
    # the checkout it imports fine).
    for package in ("mqd", "backends"):
        modules = {p.relative_to(source).as_posix() for p in (source / package).rglob("*.py")}
        assert modules, package
        missing = sorted(modules - names)
        assert not missing, f"not in the wheel: {missing}"
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)
    # The client's tools become commands on `pip install .`, under their NSQ-like names.
    wheel = zipfile.ZipFile(wheels[0])
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = wheel.read(entry_points).decode().split("[console_scripts]", 1)[1]
    for tool, module in (("mq-tail", "tail"), ("mq-pub", "pub"), ("mq-stat", "stat"),
                         ("mq-to-file", "to_file")):
        assert f"{tool} = mqd.tools.{module}:main" in scripts, scripts
