"""Snapshots cannot fill the data disk, retention removes only unread ones, and admission cannot be raced.

- On a real small filesystem (a tmpfs, root only) repeated `POST /snapshot`
  stop with `507 SNAPSHOT_LIMIT` before they eat the free space the store
  keeps (`--snapshot-reserve-bytes`), and PUB/MPUB and /ping still answer OK.
- `--snapshot-keep` / `--snapshot-keep-age` remove the oldest snapshots,
  never one a reader holds (spark_bridge's reader, or a plain flock).
- Concurrent requests with room for 3.5 snapshots admit at most 3: each
  one's estimate is reserved before it writes (in-process with every
  thread call of a round started at once, and against a real broker).
"""

from __future__ import annotations

import fcntl
import gc
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from twisted.internet import defer, threads
from twisted.python.failure import Failure

from mqd.nsqd.capture import capture
from mqd.nsqd.snapshot_format import MANIFEST, SnapshotError, hold_snapshot
from mqd.nsqd.snapshot_live import snapshot_estimate
from mqd.nsqd.snapshot_space import Entry, disk_use, retention_victims
from mqd.options import MQD_OPTIONS, ConfigError, resolve
from spark_bridge.records import open_snapshot
from tests.support.control_checks import log_problems, raw_http
from tests.support.http_client import HTTPClient, error, parse_response
from tests.support.raw_conn import FRAME_RESPONSE, RawConn, command
from tests.support.v2_frames import mpub_body

# -- in-process ------------------------------------------------------------------------------


def _publish_in_process(broker, http: HTTPClient, n: int, size: int) -> None:
    body = b"\n".join(b"%06d" % i + b"x" * (size - 6) for i in range(n))
    assert http.post("/mpub?topic=t", body).status == 200
    assert http.post("/channel/create?topic=t&channel=c").status == 200
    broker.clock.advance(0)


def _names(snapshots) -> list[str]:
    return sorted(p for p in os.listdir(snapshots) if not p.startswith("."))


@pytest.fixture
def lmdb_broker(make_broker):
    """make(**flags) -> (an LMDB broker on the test's Clock, its HTTP client); closed at teardown."""
    made = []

    def make(**flags):
        made.append(make_broker(backend="lmdb", **flags))
        return made[-1], HTTPClient(made[-1])

    yield make
    for broker in made:
        broker.close()


def test_retention_keeps_the_newest_and_any_snapshot_a_reader_holds(lmdb_broker, sync_threads):
    broker, http = lmdb_broker(snapshot_keep=2)
    _publish_in_process(broker, http, 50, 200)
    snapshots = os.path.join(broker.data_path, "snapshots")
    assert http.post("/snapshot?out=s1").status == 200
    # A real reader: spark_bridge's open_snapshot holds s1 while its environment lives.
    manifest, env = open_snapshot(os.path.join(snapshots, "s1"))
    assert manifest.total > 0
    for name in ("s2", "s3", "s4"):
        assert http.post(f"/snapshot?out={name}").status == 200
    # Only the newest two, and s1 which is being read.
    assert _names(snapshots) == ["s1", "s3", "s4"]
    with env.begin() as txn:  # still readable
        assert txn.stat(env.open_db(b"messages", txn=txn, create=False))["entries"] > 0
    env.close()
    del env
    gc.collect()
    assert http.post("/snapshot?out=s5").status == 200
    assert _names(snapshots) == ["s4", "s5"]
    # No hidden leftovers of the removals.
    assert sorted(os.listdir(snapshots)) == ["s4", "s5"]


def test_retention_by_age_and_a_plain_flock_holds_a_snapshot(lmdb_broker, sync_threads):
    broker, http = lmdb_broker(snapshot_keep_age="1h")
    _publish_in_process(broker, http, 20, 100)
    snapshots = os.path.join(broker.data_path, "snapshots")
    for name in ("old1", "old2", "new"):
        assert http.post(f"/snapshot?out={name}").status == 200
    two_hours_ago = time.time() - 7200
    for name in ("old1", "old2"):
        os.utime(os.path.join(snapshots, name, MANIFEST), (two_hours_ago, two_hours_ago))
    with open(os.path.join(snapshots, "old1", MANIFEST), "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        assert http.post("/snapshot?out=newer").status == 200
        assert _names(snapshots) == ["new", "newer", "old1"]
    assert http.post("/snapshot?out=newest").status == 200
    assert _names(snapshots) == ["new", "newer", "newest"]


def test_a_reader_of_a_removed_snapshot_gets_an_error_not_an_empty_read(lmdb_broker, sync_threads):
    broker, http = lmdb_broker(snapshot_keep=1)
    _publish_in_process(broker, http, 10, 100)
    snapshots = os.path.join(broker.data_path, "snapshots")
    assert http.post("/snapshot?out=a").status == 200
    # The reader opened the manifest just before the broker took it away.
    held = open(os.path.join(snapshots, "a", MANIFEST), "rb")  # noqa: SIM115
    try:
        assert http.post("/snapshot?out=b").status == 200
        assert _names(snapshots) == ["b"]
        with pytest.raises(SnapshotError, match="not an mqd snapshot|was removed"):
            hold_snapshot(os.path.join(snapshots, "a"))
    finally:
        held.close()


def test_without_retention_nothing_is_removed_and_the_limit_answers_507(lmdb_broker, sync_threads):
    broker, http = lmdb_broker()
    _publish_in_process(broker, http, 50, 200)
    snapshots = os.path.join(broker.data_path, "snapshots")
    assert http.post("/snapshot?out=one").status == 200
    used = disk_use(snapshots)
    broker.update_options(snapshot_max_bytes=used + 1)
    assert error(http.post("/snapshot?out=two")) == (507, "SNAPSHOT_LIMIT")
    # With retention, the old one makes room (removed before the new one is written).
    state, env, txn = capture(broker)
    estimate = snapshot_estimate(state, env)
    txn.abort()
    broker.update_options(snapshot_keep=1, snapshot_max_bytes=used + estimate - 1)
    assert http.post("/snapshot?out=two").status == 200
    assert _names(snapshots) == ["two"]
    # A reserve larger than the whole filesystem's free space: refused, nothing removed.
    broker.update_options(snapshot_keep=0, snapshot_max_bytes=0,
                          snapshot_reserve_bytes=shutil.disk_usage(snapshots).free)
    assert error(http.post("/snapshot?out=three")) == (507, "SNAPSHOT_LIMIT")
    assert _names(snapshots) == ["two"]


def test_retention_picks_the_oldest_beyond_the_count_or_the_age():
    snaps = [Entry(name, 1, mtime) for name, mtime in (("a", 100.0), ("b", 200.0), ("c", 300.0))]
    assert retention_victims(snaps, keep=0, keep_age=0, now=1000.0) == []
    assert retention_victims(snaps, keep=2, keep_age=0, now=1000.0) == ["a", "b"]  # the new one is kept too
    assert retention_victims(snaps, keep=1, keep_age=0, now=1000.0) == ["a", "b", "c"]
    assert retention_victims(snaps, keep=9, keep_age=750, now=1000.0) == ["a", "b"]
    assert retention_victims(snaps, keep=3, keep_age=850, now=1000.0) == ["a"]


def test_snapshot_options_are_read_and_shown_like_the_others(tmp_path, lmdb_broker, sync_threads):
    defaults = resolve(MQD_OPTIONS, {})
    assert (defaults.snapshot_reserve_bytes, defaults.snapshot_keep, defaults.snapshot_keep_age) == (-1, 0, 0.0)
    path = tmp_path / "mqd.yaml"
    path.write_text("snapshot_keep: 3\nsnapshot-keep-age: 36h\n", encoding="utf-8")
    s = resolve(MQD_OPTIONS, {"snapshot-reserve-bytes": "0"}, str(path))
    assert (s.snapshot_reserve_bytes, s.snapshot_keep, s.snapshot_keep_age) == (0, 3, 129600.0)
    with pytest.raises(ConfigError, match="--snapshot-keep: must be at least 0"):
        resolve(MQD_OPTIONS, {"snapshot-keep": "-1"})
    broker, http = lmdb_broker(snapshot_keep=2, snapshot_keep_age="90m", snapshot_reserve_bytes=1 << 20)
    assert http.get("/config/snapshot_keep").json() == 2
    assert http.get("/config/snapshot_keep_age").json() == 5_400_000_000_000  # nanoseconds, as nsqd
    assert http.get("/config/snapshot_reserve_bytes").json() == 1 << 20


class ThreadRounds:
    """deferToThread as rounds: every call queued meanwhile runs at once, in threads started together.

    The thread calls of concurrent requests overlap as much as they can:
    a check made in one cannot see what another writes in the same round.
    """

    def __init__(self) -> None:
        self.queued: list = []
        self.largest_round = 0

    def __call__(self, f, *args, **kwargs):
        d = defer.Deferred()
        self.queued.append((f, args, kwargs, d))
        return d

    def run(self) -> None:
        while self.queued:
            batch, self.queued = self.queued, []
            self.largest_round = max(self.largest_round, len(batch))
            start = threading.Barrier(len(batch))
            results: list = [None] * len(batch)

            def work(i: int, f, args, kwargs, start=start, results=results) -> None:
                start.wait()
                try:
                    results[i] = f(*args, **kwargs)
                except BaseException:
                    results[i] = Failure()

            workers = [threading.Thread(target=work, args=(i, f, args, kwargs))
                       for i, (f, args, kwargs, _) in enumerate(batch)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(60)
            for (_, _, _, d), result in zip(batch, results, strict=True):
                if isinstance(result, Failure):
                    d.errback(result)
                else:
                    d.callback(result)


def test_concurrent_snapshots_cannot_pass_the_limit(lmdb_broker, monkeypatch):
    broker, http = lmdb_broker()
    _publish_in_process(broker, http, 400, 2000)
    snapshots = os.path.join(broker.data_path, "snapshots")
    rounds = ThreadRounds()
    monkeypatch.setattr(threads, "deferToThread", rounds)
    # The size of one snapshot, measured, then room for 3.5 of them.
    probe = http.send("POST", "/snapshot?out=probe")
    rounds.run()
    assert parse_response(probe.value()).status == 200
    size = disk_use(os.path.join(snapshots, "probe"))
    shutil.rmtree(os.path.join(snapshots, "probe"))
    limit = int(size * 3.5)
    broker.update_options(snapshot_max_bytes=limit)

    pending = [http.send("POST", f"/snapshot?out=r{i}") for i in range(12)]
    rounds.run()
    answers = [parse_response(t.value()) for t in pending]
    statuses = sorted(a.status for a in answers)
    assert statuses == [200] * 3 + [507] * 9, statuses
    assert all(error(a) == (507, "SNAPSHOT_LIMIT") for a in answers if a.status != 200)
    assert len(_names(snapshots)) == 3
    assert disk_use(snapshots) <= limit
    assert broker.store.copies == 0


# -- real brokers ------------------------------------------------------------------------------


def _pub(broker, topic: str, body: bytes) -> bytes:
    with RawConn(broker, timeout=10) as conn:
        conn.send(command(f"PUB {topic}", body))
        return conn.read_frame()[1]


def _mpub(broker, topic: str, bodies: list[bytes]) -> bytes:
    with RawConn(broker, timeout=10) as conn:
        conn.send(command(f"MPUB {topic}", mpub_body(bodies)))
        return conn.read_frame()[1]


def test_snapshots_stop_at_the_reserve_and_publishes_keep_working(tmpfs, start_broker):
    mnt = tmpfs(40)
    data = mnt / "data"
    # Every message in the store (nothing in memory), so publishes need the disk.
    broker = start_broker(f"--data-path={data}", "--mem-queue-size=0", "--sync-timeout=50ms",
                          data_path=False)
    bodies = [b"%06d" % i + b"b" * 2994 for i in range(1000)]
    assert _mpub(broker, "disk", bodies) == b"OK"
    answers = []
    for i in range(15):
        status, body = raw_http(broker, "POST", f"/snapshot?out=s{i}", None, timeout=30)
        answers.append(status)
        if status != 200:
            break
    print(f"\nsnapshots on a 40 MB disk: {answers}; free after: {shutil.disk_usage(mnt).free}")
    # Some were taken, then the reserve (default: 10 MiB here, twice --max-body-size) said no.
    assert answers[-1] == 507 and answers.count(200) >= 2, answers
    assert body == b'{"message":"SNAPSHOT_LIMIT"}'
    assert "bytes kept free for the store (--snapshot-reserve-bytes)" in broker.log()
    free = shutil.disk_usage(mnt).free
    assert free >= 10 << 20, free
    # The store still takes publishes: the largest MPUB and then some, and PUBs.
    assert _mpub(broker, "disk", [b"m" * 1_000_000] * 4) == b"OK"
    for i in range(20):
        assert _pub(broker, "disk", b"after-%d" % i) == b"OK"
    assert raw_http(broker, "GET", "/ping", None) == (200, b"OK")
    assert not log_problems(broker), broker.describe()
    broker.stop_cleanly()


def test_concurrent_snapshots_on_a_real_broker_stay_within_the_limit(start_broker):
    broker = start_broker("--mem-queue-size=0")
    assert _mpub(broker, "race", [b"%06d" % i + b"r" * 1994 for i in range(500)]) == b"OK"
    status, _ = raw_http(broker, "POST", "/snapshot?out=probe", None, timeout=30)
    assert status == 200
    snapshots = broker.data_dir / "snapshots"
    size = disk_use(str(snapshots / "probe"))
    shutil.rmtree(snapshots / "probe")
    limit = int(size * 3.5)
    broker.stop_cleanly()
    broker.reconfigure("--mem-queue-size=0", f"--snapshot-max-bytes={limit}")
    broker.start()

    def snapshot(i: int) -> tuple[int, bytes]:
        return raw_http(broker, "POST", f"/snapshot?out=r{i}", None, timeout=60)

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(snapshot, range(12)))
    taken = [a for a in answers if a[0] == 200]
    print(f"\n12 concurrent snapshots, room for 3.5: {len(taken)} taken, {disk_use(str(snapshots))} "
          f"bytes of {limit}")
    assert 1 <= len(taken) <= 3, answers
    assert all(a == (507, b'{"message":"SNAPSHOT_LIMIT"}') for a in answers if a[0] != 200), answers
    assert len(_names(snapshots)) == len(taken)
    assert disk_use(str(snapshots)) <= limit
    assert "--snapshot-max-bytes" in broker.log()
    with RawConn(broker) as conn:
        conn.send(command("PUB race", b"still"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
    broker.stop_cleanly()
