"""The packages type-check: mypy, configured in pyproject.toml ([tool.mypy]).

mypy reads mqd, backends and spark_bridge against the installed Twisted
and zope.interface (through the mypy-zope plugin) and the Spark extra's
own types; the modules listed as strict there have every function
annotated. The run starts from an empty cache in a temporary directory,
so it writes nothing into the repository and takes what CI takes (about
ten seconds).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.support.processes import REPO_ROOT

PACKAGES = ("mqd", "backends", "spark_bridge")


def test_mypy_finds_no_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # An override naming a module that no longer exists (renamed, merged) is dead config.
    assert "unused section" not in out, out


def test_the_packages_ship_their_py_typed_marker():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    package_data = config["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert (REPO_ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in package_data.get(package, []), package
