"""Starting and stopping on a full disk, and the listen backlog.

- A broker whose disk is full at start-up comes up serving what
  its store holds (consumers drain it, which frees space), /ping says NOK
  and publishes fail until a commit succeeds; a brand-new data directory
  that cannot even be created stops start-up with one line.
- A clean shutdown that cannot write everything writes what fits
  in bounded transactions, says in one line how many could not be written,
  and saves those to a spill file next to the store that the next start
  writes back.
- Every listener of both daemons uses a large backlog
  (--listen-backlog, default net.core.somaxconn as nsqd's Go listeners),
  not Twisted's 50.

Real-disk tests mount a tmpfs and so need root; they skip otherwise.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import lmdb
import pytest
from twisted.internet.testing import MemoryReactor

import mqd.nsqd.metadata
from backends.lmdb import SPILL_FILE, LmdbStore, StoreOpenError
from mqd.lookup.tap import build_service as build_lookupd
from mqd.nsqd.tap import build_service as build_mqd
from mqd.options import LOOKUPD_OPTIONS, MQD_OPTIONS, ConfigError, resolve, system_backlog
from mqd.service import ListeningService
from tests.support.certs import make_certs
from tests.support.durable_load import drain
from tests.support.full_disk import SmallDisk, fill_disk
from tests.support.inprocess_broker import lmdb_store, msgs, new_broker
from tests.support.lmdb_stores import bodies, expected, queue_t, records
from tests.support.processes import (
    FAST_SCAN,
    BrokerProcess,
    child_env,
    http_request,
    twistd_command,
    wait_for,
)
from tests.support.raw_conn import FRAME_ERROR, FRAME_RESPONSE, RawConn, command
from tests.support.v2_client import Client, consumer
from tests.support.v2_frames import err, mpub, mpub_body, ok, pub

# -- the listen backlog ---------------------------------------------------------


def _listen_all(top, reactor: MemoryReactor) -> None:
    """Listen as privilegedStartService would, without opening the broker's storage."""
    for svc in top:
        if isinstance(svc, ListeningService):
            svc.endpoint.listen(svc.factory)


def _backlogs(reactor: MemoryReactor) -> list[int]:
    return [entry[2] for entry in reactor.tcpServers] + [entry[2] for entry in reactor.unixServers]


@pytest.fixture
def tls_files(tmp_path):
    return make_certs(tmp_path / "certs")


def test_listeners_use_a_large_backlog_by_default(tmp_path):
    reactor = MemoryReactor()
    top = build_mqd(resolve(MQD_OPTIONS, {"data-path": str(tmp_path), "backend": "memory"}), reactor)
    _listen_all(top, reactor)
    assert len(reactor.tcpServers) == 2  # TCP and HTTP
    assert _backlogs(reactor) == [system_backlog()] * 2
    assert system_backlog() > 50

    reactor = MemoryReactor()
    _listen_all(build_lookupd(resolve(LOOKUPD_OPTIONS, {}), reactor), reactor)
    assert _backlogs(reactor) == [system_backlog()] * 2


def test_listen_backlog_is_configurable_for_every_listener(tmp_path):
    sock = tmp_path / "mqd.sock"
    reactor = MemoryReactor()
    flags = {"data-path": str(tmp_path), "backend": "memory", "listen-backlog": "1234",
             "tcp-address": str(sock), "http-address": "127.0.0.1:0"}
    _listen_all(build_mqd(resolve(MQD_OPTIONS, flags), reactor), reactor)
    assert [entry[0] for entry in reactor.unixServers] == [str(sock)]
    assert _backlogs(reactor) == [1234, 1234]

    # From the YAML file too, for mqlookupd.
    config = tmp_path / "mqlookupd.yaml"
    config.write_text("listen_backlog: 777\n")
    reactor = MemoryReactor()
    _listen_all(build_lookupd(resolve(LOOKUPD_OPTIONS, {}, str(config)), reactor), reactor)
    assert _backlogs(reactor) == [777, 777]


def test_https_listener_and_explicit_endpoint_backlog(tmp_path, tls_files):
    reactor = MemoryReactor()
    flags = {"data-path": str(tmp_path), "backend": "memory", "listen-backlog": "300",
             # An endpoint string naming its own backlog keeps it.
             "tcp-address": "tcp:0:interface=127.0.0.1:backlog=20",
             "https-address": "127.0.0.1:0",
             "tls-cert": str(tls_files.server_cert), "tls-key": str(tls_files.server_key)}
    _listen_all(build_mqd(resolve(MQD_OPTIONS, flags), reactor), reactor)
    assert _backlogs(reactor) == [20, 300, 300]  # TCP, HTTP, HTTPS


@pytest.mark.parametrize("value", ["0", "-1", "65536", "lots"])
def test_listen_backlog_checked(value):
    with pytest.raises(ConfigError, match="--listen-backlog"):
        resolve(MQD_OPTIONS, {"listen-backlog": value})


def _listen_queue(port: int) -> int | None:
    """Send-Q of the listening socket on `port` as ss shows it: its backlog."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[2]) if len(out) >= 3 else None


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a socket's backlog")
def test_real_listeners_have_the_backlog(start_broker, start_lookupd):
    broker = start_broker("--listen-backlog=1000")
    assert _listen_queue(broker.tcp_port) == 1000
    assert _listen_queue(broker.http_port) == 1000
    lookupd = start_lookupd()
    expected = system_backlog()
    assert _listen_queue(lookupd.tcp_port) == expected
    assert _listen_queue(lookupd.http_port) == expected


# -- a clean shutdown on a nearly full disk --------------------------------------


@pytest.fixture
def log_lines():
    from twisted.logger import formatEvent, globalLogPublisher

    lines: list[str] = []

    def observe(event) -> None:
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


def test_shutdown_on_full_disk_keeps_what_fits_and_spills_the_rest(tmp_path, clock, log_lines):

    store, q = queue_t(tmp_path, clock, 3)
    clock.advance(0)  # 3 committed
    q.put(msgs(100, 3))
    disk = SmallDisk(store, room=40)
    store.close()  # the one-transaction commit of 100 does not fit; bounded ones do, up to 40

    assert disk.failed >= 1
    lines = [line for line in log_lines if "could not be written" in line]
    assert len(lines) == 1, log_lines
    assert "60 of 100 messages could not be written" in lines[0]
    assert str(tmp_path / SPILL_FILE) in lines[0]
    assert (tmp_path / SPILL_FILE).exists()

    # LMDB holds the queue's head: what fits was kept, oldest first.
    store = lmdb_store(tmp_path, clock)
    assert [r[2] for r in records(store)] == expected(43)
    # The spill file gives back the rest, in place, before the first commit...
    q = store.open_queue("t")
    assert q.depth() == 103
    got = q.read(200)
    assert bodies(got) == expected(103)
    assert any("written back" in line or "are back" in line for line in log_lines)
    # ... and goes once they are written.
    clock.advance(0)
    assert not (tmp_path / SPILL_FILE).exists()
    store.close()
    store = lmdb_store(tmp_path, clock)
    assert store.open_queue("t").depth() == 0  # default mode: a read removed them
    store.close()


def test_shutdown_spill_keeps_durable_records_and_rewrites(tmp_path, clock, log_lines):

    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t")
    q.put(msgs(5))
    clock.advance(0)
    first = q.read(2)  # in flight
    q.finish(first[:1])  # FIN: its deletion must be written first
    first[1].attempts = 7
    q.update(first[1:])  # a rewrite (timeout), then 20 new ones
    q.put(msgs(20, 5))
    SmallDisk(store, room=10)
    store.close()
    assert (tmp_path / SPILL_FILE).exists()
    assert any("11 of 21 messages could not be written" in line for line in log_lines), log_lines

    store = lmdb_store(tmp_path, clock, durable=True)
    q = store.open_queue("t")
    got = q.read(100)
    assert bodies(got) == expected(24, 1)  # m0 FINished stays gone; nothing lost, in order
    assert got[0].attempts == 7  # the rewrite was spilled and written back
    clock.advance(0)
    assert not (tmp_path / SPILL_FILE).exists()
    store.close()


def test_shutdown_waits_for_room_when_the_rest_cannot_be_saved(tmp_path, clock, log_lines):
    store, _ = queue_t(tmp_path, clock, 50)
    disk = SmallDisk(store, room=20)
    store.spill_path = str(tmp_path / "gone" / SPILL_FILE)  # a spill that cannot be written either
    closed = store.close()
    lines = [line for line in log_lines if "could not be written" in line]
    # The queue's registry entry took one of the 20 places.
    assert len(lines) == 1 and "31 of 50 messages could not be written" in lines[0], log_lines
    assert "nor saved" in lines[0] and "No such file" in lines[0] and "waiting for free space" in lines[0]
    # The store stays open, retrying, until there is room.
    done = []
    closed.addCallback(done.append)
    clock.advance(1)
    clock.advance(1)
    assert not done
    disk.room = 1000
    clock.advance(1)
    assert done == [None]
    assert any("there is room again" in line for line in log_lines)
    store = lmdb_store(tmp_path, clock)
    assert [r[2] for r in records(store)] == expected(50)
    store.close()


def test_corrupt_spill_file_stops_start_up_with_one_line(tmp_path, clock):

    store, _ = queue_t(tmp_path, clock, 10)
    SmallDisk(store, room=5)
    store.close()
    spill = tmp_path / SPILL_FILE
    spill.write_bytes(spill.read_bytes()[:-3])  # torn
    with pytest.raises(StoreOpenError, match="corrupt spill file") as info:
        lmdb_store(tmp_path, clock)
    assert str(spill) in str(info.value) and "\n" not in str(info.value)


def test_failed_store_at_shutdown_still_saves_memory(tmp_path, clock, log_lines):
    """A broker whose store already failed (a full disk) stops: what memory holds is spilled, not dropped."""

    broker = new_broker(tmp_path, clock, backend="lmdb", mem_queue_size=100)
    p = Client(broker)
    assert p.request(mpub("t", [b"a%d" % i for i in range(30)])) == [ok()]
    consumer(broker, "t", "c", rdy=0)
    clock.advance(0)
    disk = SmallDisk(broker.store, room=0)
    assert p.request(mpub("t", [b"b%d" % i for i in range(130)])) == [ok()]  # overflows to the store
    clock.advance(0)
    assert broker.store.failure and disk.failed
    broker.close()
    assert (tmp_path / SPILL_FILE).exists()
    assert not any("not stored at shutdown" in line for line in log_lines), log_lines

    broker = new_broker(tmp_path, clock, backend="lmdb", mem_queue_size=100)
    c = consumer(broker, "t", "c", rdy=500)
    clock.advance(0)
    got = sorted(m.body for m in c.messages())
    want = sorted([b"a%d" % i for i in range(30)] + [b"b%d" % i for i in range(130)])
    assert got == want
    broker.close()


# -- starting on a full disk ------------------------------------------------------


def test_start_on_full_disk_serves_what_it_holds(tmp_path, clock, monkeypatch, log_lines):


    broker = new_broker(tmp_path, clock, backend="lmdb", durable=True)
    consumer(broker, "t", "c", rdy=0)
    p = Client(broker)
    p.send(mpub("t", [b"x%d" % i for i in range(5)]))
    clock.advance(0)
    assert p.read() == [ok()]
    broker.close()

    # The disk is full: nsqd.dat cannot be written, and neither can LMDB.
    full = [True]
    real_mkstemp, real_write = mqd.nsqd.metadata.tempfile.mkstemp, LmdbStore._write

    def mkstemp(*args, **kwargs):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_mkstemp(*args, **kwargs)

    def write(store):
        if full[0]:
            raise lmdb.Error("mdb_txn_commit: No space left on device")
        return real_write(store)

    monkeypatch.setattr(mqd.nsqd.metadata.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(LmdbStore, "_write", write)
    broker = new_broker(tmp_path, clock, backend="lmdb", durable=True)
    lines = [line for line in log_lines if "cannot write metadata" in line]
    assert len(lines) == 1 and str(tmp_path / "nsqd.dat") in lines[0], log_lines
    assert "No space left on device" in lines[0] and "free space under" in lines[0]
    assert broker.health and "No space left on device" in broker.health  # /ping: NOK - ...
    # Publishes fail as when the disk fills while running ...
    q = Client(broker)
    answer = q.request(pub("t", b"refused"))
    assert len(answer) == 1 and answer[0].type == err("").type
    assert answer[0].payload.startswith(b"E_PUB_FAILED PUB failed"), answer
    # ... while consumers drain what the store holds.
    c = consumer(broker, "t", "c", rdy=10)
    got = c.messages()
    assert [m.body for m in got] == [b"x%d" % i for i in range(5)]
    for m in got:
        c.fin(m)
    clock.advance(1)
    assert broker.health  # still full
    full[0] = False
    clock.advance(1)  # the store's retry commits: healthy again, by itself
    assert broker.health is None
    assert (tmp_path / "nsqd.dat").exists()
    r = Client(broker)
    r.send(pub("t", b"after"))
    clock.advance(0)
    assert r.read() == [ok()]
    broker.close()


def test_failure_clears_when_room_returns_even_if_drained_meanwhile(tmp_path, clock):
    """A full disk, then consumers take everything that was waiting to be written: the retry must still
    find out that there is room again (it used to have nothing to write, so /ping stayed NOK forever)."""
    store = lmdb_store(tmp_path, clock)
    health: list = []
    store.health_listener = health.append
    q = store.open_queue("t")
    clock.advance(0)
    full = [True]
    real_write = store._write

    def write():
        if full[0]:
            raise lmdb.Error("mdb_txn_commit: No space left on device")
        return real_write()

    store._write = write
    q.put(msgs(3))
    clock.advance(0)
    assert store.failure
    assert bodies(q.read(10)) == expected(3)  # drained: nothing left to write
    clock.advance(1)
    assert store.failure  # still full
    full[0] = False
    clock.advance(1)
    assert store.failure is None
    assert health == ["LMDB write failed: mdb_txn_commit: No space left on device", None]
    store.close()


def test_new_store_on_full_disk_is_one_clear_error(tmp_path, clock, monkeypatch):

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(StoreOpenError) as info:
        lmdb_store(tmp_path / "new", clock)
    text = str(info.value)
    assert text == (f"{tmp_path / 'new' / 'mqd.lmdb'}: cannot create the store: No space left on device; "
                    f"free space on that filesystem or choose another --data-path")
    assert not (tmp_path / "new" / "mqd.lmdb" / "lock.mdb").exists()


# -- the same on a real broker and a real full disk (a tmpfs, root only) ---------------------


class _Broker(BrokerProcess):
    """A broker that counts as started once /ping answers at all: on a full disk it says NOK (500)."""

    def _wait_until_serving(self, deadline: float) -> None:
        wait_for(lambda: self._ping() is not None or not self.running, timeout=deadline - time.monotonic(),
                 what=f"/ping to answer\n{self.describe()}")

    def _ping(self) -> tuple[int, bytes] | None:
        try:
            return http_request(self.http_address, "GET", "/ping")
        except OSError:
            return None


def _broker(tmp_path, data: Path, *args: str) -> _Broker:
    return _Broker(tmp_path / "broker", [f"--data-path={data}", *args], data_path=False)


def _pub(broker, topic: str, body: bytes) -> tuple[int, bytes]:
    with RawConn(broker) as conn:
        conn.send(command(f"PUB {topic}", body))
        return conn.read_frame()


def test_real_broker_starts_on_a_full_disk(tmp_path, tmpfs):
    mnt = tmpfs(16)
    broker = _broker(tmp_path, mnt / "data", "--durable", "--lmdb-map-size=2097152", *FAST_SCAN)
    try:
        broker.start()
        with RawConn(broker) as conn:
            conn.send(command("SUB t c"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        bodies = [b"held%03d" % i for i in range(100)]
        with RawConn(broker) as conn:
            conn.send(command("MPUB t", mpub_body(bodies)))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        broker.stop_cleanly()
        filler = fill_disk(mnt)

        broker.start()  # before the fix: a traceback from Broker.open, and no broker
        log = broker.log()
        assert "Traceback" not in log, broker.describe()
        status, text = http_request(broker.http_address, "GET", "/ping")
        assert status == 500 and text.startswith(b"NOK - ") and b"No space left on device" in text, text
        lines = [line for line in log.splitlines() if "cannot write metadata" in line]
        assert len(lines) == 1 and str(mnt / "data" / "nsqd.dat") in lines[0], log
        frame = _pub(broker, "t", b"refused")
        assert frame[0] == FRAME_ERROR and frame[1].startswith(b"E_PUB_FAILED"), frame
        status, _ = http_request(broker.http_address, "POST", "/pub?topic=t", b"refused")
        assert status == 500
        # What it holds is served while full.
        got = drain(broker, "t", "c", expect=100, silence=0.5)
        assert sorted(d.body for d in got) == bodies

        filler.unlink()  # room again: healthy by itself, publishes work
        wait_for(lambda: http_request(broker.http_address, "GET", "/ping") == (200, b"OK"),
                 timeout=15, what=f"/ping OK\n{broker.describe()}")
        assert _pub(broker, "t", b"after") == (FRAME_RESPONSE, b"OK")
        broker.stop_cleanly()
    finally:
        broker.kill()


def test_real_broker_new_data_dir_on_a_full_disk_is_one_line(tmp_path, tmpfs):
    mnt = tmpfs(4)
    fill_disk(mnt)
    proc = subprocess.run(
        twistd_command("--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                       f"--data-path={mnt / 'new'}"),
        env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=30,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, (proc.returncode, output)  # before the fix: SIGBUS (-7), no word
    errors = [line for line in output.splitlines() if "mqd: " in line]
    assert len(errors) == 1, output
    assert str(mnt / "new" / "mqd.lmdb") in errors[0] and "No space left on device" in errors[0]
    assert "--data-path" in errors[0]
    assert "Traceback" not in output and "listening on" not in output


def _big_body(i: int, size: int) -> bytes:
    head = b"s%06d-" % i
    return head + bytes([i % 251]) * (size - len(head))


def test_real_shutdown_on_a_nearly_full_disk_loses_nothing(tmp_path, tmpfs):
    mnt = tmpfs(32)
    broker = _broker(tmp_path, mnt / "data", "--mem-queue-size=100000", "--lmdb-map-size=1048576")
    try:
        broker.start()
        with RawConn(broker) as conn:  # the channel exists: its memory queue gets every message
            conn.send(command("SUB t c"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        count, size = 4000, 4096  # ~16 MB held in memory
        with RawConn(broker) as conn:
            for start in range(0, count, 200):
                batch = [_big_body(i, size) for i in range(start, start + 200)]
                conn.send(command("MPUB t", mpub_body(batch)))
                assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        filler = fill_disk(mnt)
        os.truncate(filler, filler.stat().st_size - (6 << 20))  # 6 MB free

        broker.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "waiting for free space" in broker.log() or not broker.running, timeout=30,
                 what="the shutdown to write what fits")
        log = broker.log()
        lines = [line for line in log.splitlines() if "could not be written" in line]
        assert len(lines) == 1, broker.describe()  # before the fix: "closing LMDB with unwritten changes"
        assert f"of {count} messages could not be written" in lines[0] and "waiting" in lines[0], lines
        assert broker.running  # still up, holding what it could not write
        filler.unlink()
        broker.proc.wait(30)
        broker.returncodes.append(broker.proc.returncode)
        broker.assert_clean_exit(broker.proc.returncode)

        broker.start()
        got = drain(broker, "t", "c", expect=count, silence=1.0)
        assert sorted(d.body for d in got) == [_big_body(i, size) for i in range(count)]
        broker.stop_cleanly()
    finally:
        broker.kill()
