"""mqd.nsqd.snapshot_format on a real LMDB store driven by a task.Clock, and POST /snapshot in-process.

The store commits at `clock.advance(0)`; a snapshot copies what is
committed, so every test commits before it snapshots. The HTTP tests run
the copy synchronously (deferToThread replaced) so they stay on the Clock.
"""

from __future__ import annotations

import json
import os

import lmdb
import pytest

from backends.lmdb_records import FORMAT, KEY, decode_record
from mqd.message import Message
from mqd.nsqd import snapshot_format as snapmod
from mqd.nsqd.snapshot_format import MANIFEST, SnapshotError, read_manifest, take_snapshot
from spark_bridge.__main__ import main
from tests.support.http_client import HTTPClient, error
from tests.support.inprocess_broker import START_TIME, lmdb_store, msgs, new_broker


@pytest.fixture
def store(tmp_path, clock):
    s = lmdb_store(tmp_path / "data", clock)
    yield s
    s.close()


def copied(snap_dir) -> dict[str, list[Message]]:
    """Every record of a snapshot, decoded, by queue name."""
    env = lmdb.open(str(snap_dir), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin() as txn:
            names = {int.from_bytes(bytes(q), "big"): bytes(n).decode()
                     for n, q in txn.cursor(db=env.open_db(b"queues", txn=txn, create=False))}
            out: dict[str, list[Message]] = {name: [] for name in names.values()}
            for k, v in txn.cursor(db=env.open_db(b"messages", txn=txn, create=False)):
                qid, _ = KEY.unpack(k)
                out[names[qid]].append(decode_record(bytes(k), bytes(v)))
    finally:
        env.close()
    return out


def fill(store, clock, counts: dict[str, int]) -> dict[str, object]:
    queues = {}
    for name, n in counts.items():
        q = queues[name] = store.open_queue(name)
        q.put(msgs(n, body=name.encode() + b"-"))
    clock.advance(0)
    return queues


def test_manifest_counts_match_what_was_committed(store, clock, tmp_path):
    fill(store, clock, {"orders": 30, "orders:billing": 20, "orders:ship": 0, "events": 7})
    out = tmp_path / "snap"
    manifest = take_snapshot(store.env, out, broker_id="host-a", node_id=12)

    assert manifest.format_version == 2 and manifest.source == "data-path"
    assert manifest.broker_id == "host-a" and manifest.node_id == 12
    assert manifest.data_format == FORMAT.decode()
    assert manifest.created_at.endswith("Z")
    by_name = {q.name: q for q in manifest.queues}
    assert {n: q.count for n, q in by_name.items()} == {
        "events": 7, "orders": 30, "orders:billing": 20, "orders:ship": 0}
    billing = by_name["orders:billing"]
    assert (billing.topic, billing.channel, billing.first_seq, billing.last_seq) == ("orders", "billing", 0, 19)
    assert by_name["orders"].channel is None and by_name["orders"].topic == "orders"
    assert by_name["orders:ship"].first_seq is None and by_name["orders:ship"].last_seq is None
    assert manifest.total == 57
    assert manifest.bytes == os.path.getsize(out / "data.mdb") > 0
    # The file on disk says the same, and the copy holds exactly that.
    assert read_manifest(out) == manifest
    assert json.loads((out / MANIFEST).read_text())["queues"][0]["name"] == "events"
    held = copied(out)
    assert {n: len(v) for n, v in held.items()} == {n: q.count for n, q in by_name.items()}
    assert [m.body for m in held["events"]] == [b"events-%d" % i for i in range(7)]


def test_first_and_last_seq_after_reads(store, clock, tmp_path):
    """Default mode removes what is read: the manifest shows the remaining key range."""
    q = fill(store, clock, {"t": 10})["t"]
    q.read(4)
    clock.advance(0)
    info = take_snapshot(store.env, tmp_path / "snap").queue("t")
    assert (info.count, info.first_seq, info.last_seq) == (6, 4, 9)


def test_deferred_and_attempts_survive_in_the_copy(tmp_path, clock):
    store = lmdb_store(tmp_path / "data", clock, durable=True)
    try:
        q = store.open_queue("t:c")
        batch = msgs(3)
        q.put(batch)
        clock.advance(0)
        got = q.read(3)
        got[0].attempts = 4
        got[0].deferred_until = START_TIME + 60.5
        got[1].attempts = 2
        q.update(got[:2])
        clock.advance(0)
        take_snapshot(store.env, tmp_path / "snap")
    finally:
        store.close()
    records = copied(tmp_path / "snap")["t:c"]
    assert [(m.body, m.attempts, m.deferred_until, m.timestamp, m.id) for m in records] == [
        (b"m0", 4, START_TIME + 60.5, 1000, b"%016d" % 0),
        (b"m1", 2, 0.0, 1001, b"%016d" % 1),
        (b"m2", 0, 0.0, 1002, b"%016d" % 2),
    ]


def test_snapshot_is_a_fixed_cut_while_writing_continues(store, clock, tmp_path):
    queues = fill(store, clock, {"t": 100, "t:c": 50})
    manifest = take_snapshot(store.env, tmp_path / "snap")
    before = (tmp_path / "snap" / "data.mdb").read_bytes()
    queues["t"].put(msgs(25, start=100))
    queues["t:c"].read(10)
    store.open_queue("new").put(msgs(5))
    clock.advance(0)
    assert (tmp_path / "snap" / "data.mdb").read_bytes() == before
    assert {n: len(v) for n, v in copied(tmp_path / "snap").items()} == {"t": 100, "t:c": 50}
    assert read_manifest(tmp_path / "snap") == manifest
    # A second snapshot sees the later commits.
    later = take_snapshot(store.env, tmp_path / "snap2")
    assert {q.name: q.count for q in later.queues} == {"new": 5, "t": 125, "t:c": 40}


def test_uncommitted_writes_are_not_in_the_snapshot(store, clock, tmp_path):
    q = fill(store, clock, {"t": 3})["t"]
    q.put(msgs(2, start=3))  # not committed: no clock.advance(0)
    assert take_snapshot(store.env, tmp_path / "snap").queue("t").count == 3


def test_written_in_a_temp_dir_then_renamed(store, clock, tmp_path, monkeypatch):
    fill(store, clock, {"t": 3})
    seen = {}
    real = snapmod._describe

    def spy(env, txn):
        # Mid-snapshot: the data is in a hidden sibling, the destination does not exist yet.
        (hidden,) = os.listdir(tmp_path / "snaps")
        seen["dir"] = str(tmp_path / "snaps" / hidden)
        seen["dest_exists"] = (tmp_path / "snaps" / "one").exists()
        seen["listing"] = sorted(os.listdir(seen["dir"]))
        return real(env, txn)

    monkeypatch.setattr(snapmod, "_describe", spy)
    take_snapshot(store.env, tmp_path / "snaps" / "one")
    assert seen["dest_exists"] is False
    assert os.path.dirname(seen["dir"]) == str(tmp_path / "snaps")
    assert os.path.basename(seen["dir"]).startswith(".one.")
    assert seen["listing"] == ["data.mdb"]
    assert sorted(os.listdir(tmp_path / "snaps")) == ["one"]
    assert sorted(os.listdir(tmp_path / "snaps" / "one")) == ["data.mdb", MANIFEST]


def test_a_failed_snapshot_leaves_nothing(store, clock, tmp_path, monkeypatch):
    fill(store, clock, {"t": 3})

    def broken(env, txn):
        raise SnapshotError("boom")

    monkeypatch.setattr(snapmod, "_describe", broken)
    with pytest.raises(SnapshotError):
        take_snapshot(store.env, tmp_path / "snaps" / "one")
    assert os.listdir(tmp_path / "snaps") == []


def test_an_existing_destination_is_refused(store, clock, tmp_path):
    (tmp_path / "snap").mkdir()
    with pytest.raises(SnapshotError, match="already exists"):
        take_snapshot(store.env, tmp_path / "snap")
    assert os.listdir(tmp_path / "snap") == []


def test_from_a_path_of_a_closed_store(tmp_path, clock):
    s = lmdb_store(tmp_path / "data", clock)
    fill(s, clock, {"a": 4, "a:x": 2})
    s.close()
    # The data path itself, or its mqd.lmdb directory.
    m1 = take_snapshot(tmp_path / "data", tmp_path / "s1")
    m2 = take_snapshot(tmp_path / "data" / "mqd.lmdb", tmp_path / "s2")
    assert {q.name: q.count for q in m1.queues} == {q.name: q.count for q in m2.queues} == {"a": 4, "a:x": 2}


def test_a_path_without_an_environment_is_an_error(tmp_path):
    with pytest.raises(SnapshotError, match="no LMDB environment"):
        take_snapshot(tmp_path, tmp_path / "snap")
    assert not (tmp_path / "snap").exists()


def test_a_foreign_environment_is_refused(tmp_path):
    env = lmdb.open(str(tmp_path / "other"), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    with pytest.raises(SnapshotError, match="not an mqd environment"):
        take_snapshot(tmp_path / "other", tmp_path / "snap")
    assert sorted(os.listdir(tmp_path)) == ["other"]


# -- the command line ---------------------------------------------------------------------


def test_cli_snapshot(tmp_path, clock, capsys):
    s = lmdb_store(tmp_path / "data", clock)
    fill(s, clock, {"a": 4, "a:x": 2})
    s.close()
    code = main(["snapshot", "--data-path", str(tmp_path / "data"), "--out", str(tmp_path / "snap"),
                 "--broker-id", "b1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "2 queues, 6 messages" in out and "MB/s" in out and "a / x: 2" in out
    assert read_manifest(tmp_path / "snap").broker_id == "b1"


def test_cli_default_out_is_under_the_data_path(tmp_path, clock, capsys):
    lmdb_store(tmp_path / "data", clock).close()
    assert main(["snapshot", "--data-path", str(tmp_path / "data")]) == 0
    (snap,) = os.listdir(tmp_path / "data" / "snapshots")
    assert read_manifest(tmp_path / "data" / "snapshots" / snap).queues == []


@pytest.mark.parametrize("command", [["analyze"], ["export", "--out", "x.parquet"]])
def test_cli_analyze_and_export_refuse_a_directory_that_is_no_snapshot(command, tmp_path, capsys):
    # Refused before any Spark session starts (or any file is written).
    assert main([command[0], str(tmp_path), *command[1:]]) == 1
    err = capsys.readouterr().err
    assert f"{command[0]} failed: " in err and str(tmp_path) in err and "not an mqd snapshot" in err
    assert os.listdir(tmp_path) == []


def test_cli_failure_is_reported(tmp_path, capsys):
    assert main(["snapshot", "--data-path", str(tmp_path), "--out", str(tmp_path / "s")]) == 1
    assert "snapshot failed" in capsys.readouterr().err


# -- POST /snapshot ----------------------------------------------------------------------




def test_http_snapshot(tmp_path, clock, sync_threads):
    broker = new_broker(tmp_path, clock, backend="lmdb", mem_queue_size=0)
    try:
        http = HTTPClient(broker)
        assert http.post("/pub?topic=t", b"one").status == 200
        assert http.post("/pub?topic=t", b"two").status == 200
        assert http.post("/channel/create?topic=t&channel=c").status == 200
        clock.advance(0)
        reply = http.post("/snapshot?out=mine")
        assert reply.status == 200, reply.body
        body = reply.json()
        assert body["path"] == str(tmp_path / "snapshots" / "mine")
        counts = {q["name"]: q["count"] for q in body["manifest"]["queues"]}
        assert sum(counts.values()) == 2
        assert body["manifest"]["broker_id"] == "test-host"
        assert read_manifest(body["path"]).to_json() == body["manifest"]
        assert broker.background == set()
        # Default destination: a UTC time stamp under <data-path>/snapshots.
        default = http.post("/snapshot").json()["path"]
        assert os.path.dirname(default) == str(tmp_path / "snapshots")
        # The same destination again is refused, not overwritten.
        assert error(http.post("/snapshot?out=mine")) == (400, "OUT_EXISTS")
    finally:
        broker.close()


def test_http_snapshot_of_the_memory_backend(tmp_path, clock, sync_threads):
    # Every backend can be snapshotted: its messages are all held rows.
    broker = new_broker(tmp_path, clock, backend="memory")
    try:
        http = HTTPClient(broker)
        assert http.post("/pub?topic=t", b"one").status == 200
        reply = http.post("/snapshot?out=m")
        assert reply.status == 200, reply.body
        manifest = read_manifest(reply.json()["path"])
        assert (manifest.backend, manifest.total, manifest.queue("t").held) == ("memory", 1, 1)
    finally:
        broker.close()


def test_http_snapshot_is_post_only(http):
    assert error(http.get("/snapshot")) == (405, "METHOD_NOT_ALLOWED")


@pytest.mark.parametrize("out", ["/tmp/elsewhere", "../outside", "a/../../b"])
def test_http_snapshot_out_stays_under_the_snapshots_dir(tmp_path, clock, sync_threads, out):
    broker = new_broker(tmp_path, clock, backend="lmdb")
    try:
        http = HTTPClient(broker)
        assert error(http.post(f"/snapshot?out={out}")) == (400, "INVALID_OUT")
        assert broker.store.copies == 0
    finally:
        broker.close()


def test_cli_analyze_refuses_a_malformed_conf(tmp_path, clock, capsys):
    snap = tmp_path / "snap"
    lmdb_store(tmp_path / "data", clock).close()
    assert main(["snapshot", "--data-path", str(tmp_path / "data"), "--out", str(snap)]) == 0
    capsys.readouterr()
    # Refused before Spark starts.
    assert main(["analyze", str(snap), "--conf", "spark.ui.enabled"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
