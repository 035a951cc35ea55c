"""`python -m spark_bridge snapshot`: its flags, the running-broker check and the summary.

The running broker's lock is the one `MetadataFile.open` takes (an
exclusive flock on the data-path directory), held here by the test on a
descriptor of its own: flock locks belong to the open file, so the CLI's
attempt in the same process conflicts with it as with a broker's.
Asking a real broker over HTTP is in tests/integration/test_snapshot_cli.py.
"""

from __future__ import annotations

import fcntl
import http.server
import os
import socket
import threading

import pytest

from mqd.nsqd.snapshot_format import Manifest, read_manifest
from spark_bridge.__main__ import data_path_in_use, main, stats_mismatches, summary
from tests.support.inprocess_broker import lmdb_store, msgs


@pytest.fixture
def data(tmp_path, clock):
    """A stopped broker's data path: 3 messages in queue `a:x`."""
    path = tmp_path / "data"
    store = lmdb_store(path, clock)
    store.open_queue("a:x").put(msgs(3))
    clock.advance(0)
    store.close()
    return path


@pytest.fixture
def held(data):
    """Hold `data` as a running broker does; released at teardown."""
    fd = os.open(data, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield data
    os.close(fd)


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- --data-path on a running broker ------------------------------------------------------


def test_data_path_in_use(held, tmp_path):
    assert data_path_in_use(str(held))
    assert data_path_in_use(str(held / "mqd.lmdb"))  # the store's directory: its parent is locked
    assert not data_path_in_use(str(tmp_path / "missing"))


def test_data_path_not_in_use(data):
    assert not data_path_in_use(str(data))
    assert not data_path_in_use(str(data / "mqd.lmdb"))
    # The check let go of its own lock: a broker can take the directory.
    fd = os.open(data, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["", "mqd.lmdb"])
def test_data_path_of_a_running_broker_is_refused_with_the_hint(held, tmp_path, capsys, where):
    out = tmp_path / "snap"
    assert main(["snapshot", "--data-path", str(held / where), "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "a broker is running on" in captured.err
    assert "memory queues" in captured.err and "in flight" in captured.err and "deferred" in captured.err
    assert "--broker http://HOST:PORT" in captured.err and "--http-address" in captured.err
    assert "--lmdb-only" in captured.err
    assert not out.exists() and not (held / "snapshots").exists()


def test_lmdb_only_takes_a_running_brokers_files_anyway(held, tmp_path, capsys):
    out = tmp_path / "snap"
    assert main(["snapshot", "--data-path", str(held), "--out", str(out), "--lmdb-only"]) == 0
    captured = capsys.readouterr()
    assert "a / x: 3 (3 queued, 0 in flight, 0 deferred)" in captured.out
    assert "not in this snapshot" in captured.err
    manifest = read_manifest(out)
    assert manifest.source == "data-path" and manifest.total == 3


def test_a_stopped_brokers_data_path_needs_no_flag(data, tmp_path, capsys):
    out = tmp_path / "snap"
    assert main(["snapshot", "--data-path", str(data), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "copied from the store's files" in captured.out and "stats check" not in captured.out
    assert read_manifest(out).total == 3


# -- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    ([], "one of the arguments --broker --data-path is required"),
    (["--broker", "http://127.0.0.1:4151", "--data-path", "d"], "not allowed with argument"),
    (["--broker", "http://127.0.0.1:4151", "--out", "a/b"], "not a path (no path separator)"),
    (["--broker", "http://127.0.0.1:4151", "--out", "/tmp/snap"], "not a path (no path separator)"),
    (["--broker", "http://127.0.0.1:4151", "--lmdb-only"], "--lmdb-only goes with --data-path"),
    (["--broker", "http://127.0.0.1:4151", "--broker-id", "b"], "--broker-id goes with --data-path"),
    (["--broker", "http://127.0.0.1:4151", "--timeout", "0"], "--timeout must be more than 0"),
    (["--broker", "http://127.0.0.1:4151", "--timeout", "inf"], "--timeout must be more than 0"),
    (["--broker", "ftp://127.0.0.1:4151"], "expected the broker's HTTP address"),
    (["--broker", "http://127.0.0.1:port"], "expected the broker's HTTP address"),
    (["--broker", "http://127.0.0.1:4151/?x=1"], "expected the broker's HTTP address"),
    (["--data-path", "d", "--timeout", "5"], "--timeout goes with --broker"),
])
def test_usage_errors(argv, expected, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["snapshot", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m spark_bridge snapshot" in err and expected in err


@pytest.mark.parametrize("address", ["http://127.0.0.1:{port}", "127.0.0.1:{port}/"])
def test_unreachable_broker(address, capsys):
    port = refused_port()
    assert main(["snapshot", "--broker", address.format(port=port), "--out", "s1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"snapshot failed: http://127.0.0.1:{port}/snapshot?out=s1: "
                            "cannot connect: Connection refused\n")


# -- the summary -------------------------------------------------------------------------------


def v1_manifest() -> Manifest:
    return Manifest.from_json({
        "format_version": 1, "broker_id": "h", "node_id": None, "created_at": "2026-11-23T08:00:00Z",
        "data_format": "mqd-lmdb-1", "bytes": 2_000_000, "copy_seconds": 0.01,
        "queues": [
            {"name": "a", "topic": "a", "channel": None, "queue_id": 1, "count": 0,
             "first_seq": None, "last_seq": None},
            {"name": "a:x", "topic": "a", "channel": "x", "queue_id": 2, "count": 5,
             "first_seq": 3, "last_seq": 7},
        ],
    })


def broker_manifest(**x_stats: int) -> Manifest:
    """A broker's v2 manifest; `x_stats` overrides what /stats said of `a / x`."""
    x = {"depth": 4, "in_flight_count": 2, "deferred_count": 1, **x_stats}
    return Manifest.from_json({
        "format_version": 2, "broker_id": "h:4150", "node_id": 7, "created_at": "2026-11-23T08:00:00Z",
        "data_format": "mqd-lmdb-1", "bytes": 1_000_000, "copy_seconds": 0.01,
        "source": "broker", "backend": "lmdb", "durable": False, "capture_seconds": 0.0025,
        "clients": [{"remote_address": "127.0.0.1:5000", "client_id": "c", "hostname": "c",
                     "user_agent": "u"}],
        "left_out": [{"topic": "e#ephemeral", "channel": "c", "reason": "ephemeral", "depth": 9,
                      "in_flight_count": 1, "deferred_count": 0}],
        "queues": [
            {"name": "a", "topic": "a", "channel": None, "queue_id": 1, "count": 2,
             "first_seq": None, "last_seq": None, "stored": 0, "held": 2, "queued": 2,
             "in_flight": 0, "deferred": 0,
             "stats": {"depth": 2, "in_flight_count": 0, "deferred_count": 0}},
            {"name": "a:x", "topic": "a", "channel": "x", "queue_id": 2, "count": 7,
             "first_seq": 10, "last_seq": 11, "stored": 2, "held": 5, "queued": 4,
             "in_flight": 2, "deferred": 1, "stats": x},
        ],
    })


def test_summary_of_a_version_1_manifest():
    text = summary(v1_manifest(), "/snaps/old")
    lines = text.splitlines()
    assert lines[0] == "snapshot /snaps/old"
    assert "copied from the store's files" in text
    assert "2.0 MB copied in 0.010 s (200 MB/s)" in text
    assert "2 queues, 5 messages: 5 queued, 0 in flight, 0 deferred" in text
    assert "    a: 0 (0 queued, 0 in flight, 0 deferred)" in lines
    assert "    a / x: 5 (5 queued, 0 in flight, 0 deferred)  stored seq 3..7" in lines
    assert "left out" not in text and "stats check" not in text and "reactor" not in text


def test_summary_of_a_brokers_snapshot():
    manifest = broker_manifest()
    assert stats_mismatches(manifest) == []
    text = summary(manifest, "/data/snapshots/s1")
    lines = text.splitlines()
    assert "  taken by the broker (lmdb backend): everything it held" in lines
    assert "reactor held 2.5 ms for the capture" in text
    assert "2 queues, 9 messages: 6 queued, 2 in flight, 1 deferred" in text
    assert "    a: 2 (2 queued, 0 in flight, 0 deferred)" in lines
    assert "    a / x: 7 (4 queued, 2 in flight, 1 deferred)  stored seq 10..11" in lines
    assert "  left out: 1 queue" in lines
    assert "    e#ephemeral / c (ephemeral): depth 9, 1 in flight, 0 deferred" in lines
    assert lines[-1] == "  stats check: the rows of 2 queues equal /stats at the capture instant"
    assert "BUG" not in text


def test_summary_says_loudly_when_rows_and_stats_differ():
    manifest = broker_manifest(in_flight_count=3)
    (wrong,) = stats_mismatches(manifest)
    assert wrong.startswith("a / x: rows 4 queued, 2 in flight, 1 deferred; /stats depth 4, "
                            "in_flight_count 3, deferred_count 1")
    text = summary(manifest, "/s")
    assert "!!! BUG: the rows of 1 queue differ from /stats at the same instant" in text
    assert f"    {wrong}" in text.splitlines()
    assert "stats check" not in text


def test_summary_of_a_durable_memory_or_data_path_manifest():
    manifest = broker_manifest()
    manifest.durable = True
    assert "(lmdb backend, --durable)" in summary(manifest, "/s")
    # No stats check on a copy of files: there were no /stats to compare with.
    manifest.source = "data-path"
    assert "stats check" not in summary(manifest, "/s")


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A broker that asks who is calling and grants nothing: it records the Authorization it got."""

    seen: list[str | None] = []

    def do_POST(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's name
        self.seen.append(self.headers.get("Authorization"))
        body = b'{"message":"UNAUTHORIZED"}'
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_broker():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Refusing.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}", _Refusing.seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_secret_goes_to_the_broker_as_a_bearer_token(refusing_broker, how, monkeypatch, capsys):
    url, seen = refusing_broker
    argv = ["snapshot", "--broker", url]
    if how == "flag":
        argv += ["--http-auth-secret", "s3cret"]
    else:
        monkeypatch.setenv("MQ_HTTP_AUTH_SECRET", "s3cret")
    assert main(argv) == 1
    assert seen == ["Bearer s3cret"]
    assert "403 UNAUTHORIZED" in capsys.readouterr().err


def test_no_secret_sends_no_authorization(refusing_broker, monkeypatch):
    url, seen = refusing_broker
    monkeypatch.delenv("MQ_HTTP_AUTH_SECRET", raising=False)
    assert main(["snapshot", "--broker", url]) == 1
    assert seen == [None]


def test_a_secret_a_header_cannot_carry_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["snapshot", "--broker", "http://127.0.0.1:4151", "--http-auth-secret", "two words"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "printable ASCII without spaces" in err and "two words" not in err
