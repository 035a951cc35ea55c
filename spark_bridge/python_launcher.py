"""The Python that Spark starts on a local master: this interpreter, importing its installed pyspark.

Spark puts $SPARK_HOME/python/lib/pyspark.zip and py4j's zip (and a
Spark jar) first on the path of every Python process it starts. Python
compiles what it imports from a zip anew in each process (zipimport
keeps no bytecode cache): measured here, what a Spark worker imports
takes 1.1 s from the zip against 0.4 s from the installed package, and a
local `analyze` starts five such processes (the data source lookup,
creation and read planning, the worker daemon, a version check), all on
its critical path.

When pyspark is installed as a package (pip; SPARK_HOME is then the
package's own directory) the zip holds the very code the package has,
already compiled. So `build_session` hands Spark, as PYSPARK_PYTHON, a
small shell script (written once under ~/.cache/mqd) that removes those
entries from PYTHONPATH and execs this interpreter. With any other
layout (a Spark distribution's own SPARK_HOME, no POSIX shell) there is
no launcher and Spark runs this interpreter as it is.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shlex
import sys

from spark_bridge.cache import cache_dir

__all__ = ["launcher_path", "sparks_python_path"]

_SCRIPT = """\
#!/bin/sh
# Written by mqd's spark_bridge (python_launcher.py): runs {python}
# without Spark's zipped copy of the installed pyspark on PYTHONPATH.
set -f
IFS=:
kept=
for entry in $PYTHONPATH; do
  case $entry in
    ''{patterns}) ;;
    *) kept=${{kept:+$kept:}}$entry ;;
  esac
done
PYTHONPATH=$kept
export PYTHONPATH
exec {python} "$@"
"""


def sparks_python_path() -> list[str] | None:
    """The entries Spark prepends to its Python processes' path, if they duplicate the installed pyspark.

    None when Spark's home is not the installed pyspark package (its zip
    might then differ from what this interpreter would import).
    """
    import pyspark

    package = os.path.dirname(os.path.realpath(pyspark.__file__))
    home = os.environ.get("SPARK_HOME") or package
    if os.path.realpath(home) != package:
        return None
    lib = os.path.join(home, "python", "lib")
    zips = sorted(glob.glob(os.path.join(lib, "py4j-*-src.zip")))
    if not os.path.exists(os.path.join(lib, "pyspark.zip")) or not zips:
        return None
    return [os.path.join(lib, "pyspark.zip"), *zips]


def launcher_path() -> str | None:
    """The launcher script for this interpreter and pyspark, written if missing (None: not applicable)."""
    if os.name != "posix":
        return None
    entries = sparks_python_path()
    if entries is None:
        return None
    home = os.path.dirname(os.path.dirname(os.path.dirname(entries[0])))
    # Spark also appends the jar PythonUtils came from: nothing to import there.
    patterns = [shlex.quote(e) for e in entries] + [shlex.quote(os.path.join(home, "jars")) + "/*.jar"]
    script = _SCRIPT.format(python=shlex.quote(sys.executable), patterns="".join("|" + p for p in patterns))
    digest = hashlib.sha256(script.encode()).hexdigest()[:16]
    path = cache_dir() / f"python-{digest}"
    if path.exists():
        return str(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(script)
        partial.chmod(0o755)
        os.replace(partial, path)
    except OSError:
        return None  # a read-only home: Spark runs this interpreter directly
    return str(path)

