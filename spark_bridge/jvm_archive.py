"""A class-data sharing (AppCDS) archive of Spark's classes, to start the driver JVM faster.

A local `analyze` spends about a third of its time starting Spark: the
JVM loads and verifies ~16,000 classes. Java 17 can map them from an
archive made once (`java -Xshare:dump`) instead; measured here the
SparkSession start went from ~8 s to 4-5 s. The archive is optional:
`python -m spark_bridge jvm-archive` builds it (~40 s, ~190 MB, under
~/.cache/mqd), and `session.build_session` uses it for local masters when
it exists. It is tied to the JVM and to pyspark's jars, so its file name
carries both; the JVM itself refuses an archive that does not match
(`-Xshare:auto`) and simply starts without it.

The class list comes from a real run of the bridge (a small snapshot
analysed with `-XX:DumpLoadedClassList`), and the archive is dumped with
exactly the classpath Spark's launcher used for that run (printed by it
with SPARK_PRINT_LAUNCH_COMMAND), because the JVM only maps an archive
whose classpath matches.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from spark_bridge.cache import cache_dir

__all__ = ["archive_path", "build_archive", "java_options"]


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    return shutil.which("java")


def archive_path() -> Path | None:
    """Where the archive for this JVM and this pyspark lives (None: no java, or no pip-installed pyspark)."""
    import pyspark

    java = _java()
    if java is None:
        return None
    real = os.path.realpath(java)
    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    if not os.path.isdir(jars):
        return None  # not pip's pyspark (e.g. run by spark-submit from its zip)
    stamp = f"{real}:{os.stat(real).st_mtime_ns}:{pyspark.__version__}:{sorted(os.listdir(jars))}"
    digest = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    return cache_dir() / f"spark-{pyspark.__version__}-{digest}.jsa"


def java_options() -> str | None:
    """The driver JVM options that map the archive, if it has been built."""
    path = archive_path()
    if path is None or not path.exists():
        return None
    return f"-XX:SharedArchiveFile={path} -Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"


def _launch_classpath(stderr: str) -> list[str]:
    """The java command's `-cp` and `--add-modules` options from Spark's printed launch command."""
    for line in stderr.splitlines():
        if line.startswith("Spark Command: "):
            argv = shlex.split(line[len("Spark Command: "):])
            out = []
            for i, arg in enumerate(argv):
                if arg == "-cp":
                    out += ["-cp", argv[i + 1]]
                elif arg.startswith("--add-modules"):
                    out.append(arg)
            if out and out[0] == "-cp":
                return out
    raise RuntimeError("could not read Spark's launch command (SPARK_PRINT_LAUNCH_COMMAND)")


def build_archive(out: Path | None = None) -> Path:
    """Run a small analysis to list the classes Spark loads, then dump them into an archive."""
    from spark_bridge.sample import write_sample_snapshot

    target = out or archive_path()
    java = _java()
    if target is None or java is None:
        raise RuntimeError("no java found (set JAVA_HOME or put java on PATH)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mqd-jvm-archive-") as tmp:
        snapshot = write_sample_snapshot(Path(tmp) / "data", Path(tmp) / "snap")
        classes = Path(tmp) / "classes.lst"
        env = dict(os.environ, SPARK_PRINT_LAUNCH_COMMAND="1", MQD_NO_JVM_ARCHIVE="1")
        run = subprocess.run(
            [sys.executable, "-m", "spark_bridge", "analyze", str(snapshot), "--master", "local[2]",
             "--json-field", "type", "--report", str(Path(tmp) / "r.html"),
             "--conf", f"spark.driver.extraJavaOptions=-XX:DumpLoadedClassList={classes}"],
            capture_output=True, text=True, env=env)
        if run.returncode != 0 or not classes.exists():
            raise RuntimeError(f"the class-listing run failed:\n{run.stderr[-2000:]}")
        partial = target.with_suffix(".tmp")
        classpath = _launch_classpath(run.stderr + run.stdout)
        dump = subprocess.run(
            [java, "-Xshare:dump", f"-XX:SharedClassListFile={classes}",
             f"-XX:SharedArchiveFile={partial}", *classpath],
            capture_output=True, text=True)
        if dump.returncode != 0 or not partial.exists():
            raise RuntimeError(f"java -Xshare:dump failed:\n{dump.stdout[-2000:]}{dump.stderr[-2000:]}")
        # Installed only if a JVM started as Spark's launcher starts it maps
        # it (-Xshare:on fails instead of ignoring an unusable archive).
        check = subprocess.run(
            [java, "-Xshare:on", f"-XX:SharedArchiveFile={partial}", *classpath, "-version"],
            capture_output=True, text=True)
        if check.returncode != 0:
            partial.unlink()
            raise RuntimeError(f"the JVM cannot map the new archive:\n{check.stderr[-2000:]}")
        os.replace(partial, target)
    return target
