"""What build_session asks Spark for: settings, the Python its workers run, the JVM class archive.

Only the last tests start Spark: the shared session (workers' imports)
and the slow archive build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mqd.nsqd.snapshot_format import read_manifest
from spark_bridge import jvm_archive, python_launcher
from spark_bridge import session as spark_session
from spark_bridge.__main__ import _shut_down, main
from spark_bridge.sample import write_sample_snapshot
from spark_bridge.session import JAVA_OPTIONS, PUSHDOWN_CONF, session_conf
from tests.support.processes import child_env


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MQD_NO_JVM_ARCHIVE", raising=False)
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    return tmp_path / "cache"


def test_local_session_settings(cache):
    master, conf = session_conf(None)
    assert master == "local[*]"
    assert conf[PUSHDOWN_CONF] == "true" and conf["spark.sql.session.timeZone"] == "UTC"
    assert int(conf["spark.sql.shuffle.partitions"]) >= 2
    assert JAVA_OPTIONS not in conf  # no archive built
    # The caller's settings win.
    _, conf = session_conf("local[2]", {"spark.sql.shuffle.partitions": "7"})
    assert conf["spark.sql.shuffle.partitions"] == "7"


def test_a_cluster_master_gets_no_local_tweaks(cache):
    master, conf = session_conf("spark://head:7077")
    assert master == "spark://head:7077"
    assert "spark.sql.shuffle.partitions" not in conf and JAVA_OPTIONS not in conf


def test_under_spark_submit_its_master_stands(cache, monkeypatch):
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "12345")
    master, conf = session_conf(None, {"a": "b"})
    assert master is None and conf["a"] == "b" and conf[PUSHDOWN_CONF] == "true"
    # An explicit --master still overrides.
    assert session_conf("local[1]")[0] == "local[1]"


def test_the_archive_is_used_once_built(cache, monkeypatch):
    path = jvm_archive.archive_path()
    assert path is not None and path.parent == cache / "mqd" and path.suffix == ".jsa"
    assert jvm_archive.archive_path() == path  # stable for this JVM and pyspark
    path.parent.mkdir(parents=True)
    path.write_bytes(b"archive")
    _, conf = session_conf("local[2]")
    assert conf[JAVA_OPTIONS].startswith(f"-XX:SharedArchiveFile={path} -Xshare:auto")
    # Not when switched off, not over the caller's own JVM options, not on a cluster.
    monkeypatch.setenv("MQD_NO_JVM_ARCHIVE", "1")
    assert JAVA_OPTIONS not in session_conf("local[2]")[1]
    monkeypatch.delenv("MQD_NO_JVM_ARCHIVE")
    assert session_conf("local[2]", {JAVA_OPTIONS: "-Xmx2g"})[1][JAVA_OPTIONS] == "-Xmx2g"
    assert JAVA_OPTIONS not in session_conf("spark://head:7077")[1]


def test_the_python_launcher_runs_this_interpreter_without_sparks_zips(cache):
    entries = python_launcher.sparks_python_path()
    assert entries is not None and [os.path.basename(e) for e in entries][0] == "pyspark.zip"
    path = python_launcher.launcher_path()
    assert path is not None and Path(path).parent == cache / "mqd" and os.access(path, os.X_OK)
    written = os.stat(path).st_mtime_ns
    assert python_launcher.launcher_path() == path and os.stat(path).st_mtime_ns == written
    # What Spark gives its Python processes: its zips and a jar first, then
    # the caller's own PYTHONPATH (an empty entry, a space in a name).
    home = os.path.dirname(os.path.dirname(os.path.dirname(entries[0])))
    jar = os.path.join(home, "jars", "spark-core_2.13-4.3.0.jar")
    spark_path = os.pathsep.join([*entries, jar, "/opt/my lib", "", "/srv/x"])
    probe = ("import os, sys, pyspark; "
             "print(os.environ['PYTHONPATH'], pyspark.__file__, sys.executable, sys.argv[1], sep='|')")
    proc = subprocess.run([path, "-c", probe, "an 'argument' with spaces"], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=spark_path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    import pyspark
    assert proc.stdout.strip().split("|") == [
        "/opt/my lib:/srv/x", pyspark.__file__, sys.executable, "an 'argument' with spaces"]


def test_no_launcher_when_spark_home_is_another_spark(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SPARK_HOME", str(tmp_path))
    assert python_launcher.sparks_python_path() is None and python_launcher.launcher_path() is None


def test_shutting_down_stops_spark_then_ends_the_jvm_it_launched(monkeypatch):
    # The JVM pyspark launches exits at EOF on its stdin; a stand-in that
    # does the same shows the CLI closes it and waits for it.
    jvm = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                           stdin=subprocess.PIPE)
    calls = []

    class Session:
        sparkContext = object()

        def stop(self):
            calls.append(jvm.poll())

    session = Session()
    monkeypatch.setitem(spark_session._LAUNCHED, id(session.sparkContext), jvm)
    _shut_down(session)
    assert calls == [None] and jvm.returncode == 0
    # Under spark-submit the JVM is our parent, not our child: only stop.
    _shut_down(Session())
    assert len(calls) == 2


def test_the_session_knows_the_jvm_it_launched(spark):
    jvm = spark_session.launched_jvm(spark)
    assert jvm is not None and jvm.poll() is None


def test_spark_workers_import_the_installed_pyspark(spark):
    import pyspark

    assert os.environ["PYSPARK_PYTHON"] == python_launcher.launcher_path()
    seen = spark.sparkContext.parallelize([0], 1).map(lambda _: __import__("pyspark").__file__)
    assert seen.collect() == [pyspark.__file__]


def test_launch_classpath_is_read_from_sparks_launch_command():
    stderr = ("noise\nSpark Command: /usr/lib/jvm/java/bin/java -cp '/p/conf:/p/jars/*' -Xmx1g "
              "--add-modules=jdk.incubator.vector --add-opens=java.base/java.lang=ALL-UNNAMED "
              "org.apache.spark.deploy.SparkSubmit pyspark-shell\n========\n")
    assert jvm_archive._launch_classpath(stderr) == [
        "-cp", "/p/conf:/p/jars/*", "--add-modules=jdk.incubator.vector"]
    with pytest.raises(RuntimeError, match="launch command"):
        jvm_archive._launch_classpath("no command here")


def test_sample_command_writes_a_backlog_that_snapshots(tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["sample", "--data-path", str(data), "--messages", "3000"]) == 0
    assert "wrote 3,000 messages" in capsys.readouterr().out
    assert main(["snapshot", "--data-path", str(data), "--out", str(tmp_path / "snap")]) == 0
    manifest = read_manifest(tmp_path / "snap")
    assert manifest.total == 3000 and len(manifest.queues) == 14
    # An existing directory is never written into.
    assert main(["sample", "--data-path", str(data)]) == 1
    assert os.listdir(data) == ["mqd.lmdb"]


@pytest.mark.slow
def test_jvm_archive_is_built_and_the_jvm_maps_it(cache):
    # The whole pipeline (~1 min): a sample analysis listing the classes,
    # java -Xshare:dump with the launcher's classpath, the archive checked
    # with -Xshare:on before it is installed; then a real local session
    # starts with it (Spark's launcher uses the same classpath).
    path = jvm_archive.build_archive()
    assert path == jvm_archive.archive_path() and path.stat().st_size > 50_000_000
    assert not path.with_suffix(".tmp").exists()
    snap = write_sample_snapshot(cache / "data", cache / "snap", n=500)
    proc = subprocess.run(
        [sys.executable, "-m", "spark_bridge", "analyze", str(snap), "--master", "local[1]",
         "--conf", "spark.driver.extraJavaOptions=" + jvm_archive.java_options().replace(
             "-Xshare:auto", "-Xshare:on")],
        capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "500 messages in 14 queues" in proc.stdout
