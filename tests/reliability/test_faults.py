"""Fault tests on the real broker: kill -9 in a loop, a full disk, clients that never read.

- kill -9 at a random moment of mixed PUB/MPUB/DPUB, FIN, REQ with delay and
  msg timeouts on a `--durable` broker, ten times on the same data
  directory: after each restart no acknowledged, unfinished message is
  missing, none is corrupt, none is unknown (`python -m bench torture` runs
  20+ rounds).
- a full disk (a 16 MB tmpfs, mounted here when running as root): errors
  while full, recovery by itself once there is room, nothing lost.
- a never-reading consumer and a FIN flood that never reads its answers:
  the broker's RSS stays bounded.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.support.abuse import abuse_fin_flood, abuse_never_reading_consumer, abuse_slow_consumer
from tests.support.control_checks import log_problems, raw_http
from tests.support.crash_loop import crash_rounds
from tests.support.durable_load import check_body, drain, make_body
from tests.support.full_disk import fill_disk
from tests.support.processes import FAST_SCAN, wait_for
from tests.support.raw_conn import FRAME_ERROR, FRAME_RESPONSE, RawConn, command

# -- kill -9 in a loop ----------------------------------------------------------------------


def test_kill_9_in_a_loop_loses_no_acknowledged_message(start_broker):
    broker = start_broker("--durable", "--msg-timeout=1s", *FAST_SCAN)
    report = crash_rounds(broker, int(os.environ.get("MQD_KILL_ROUNDS", "10")), seed=16)
    broker.stop_cleanly()
    print(f"\n{report.rounds} kill -9 rounds in {report.seconds:.1f} s: {report.commands} commands, "
          f"{report.acknowledged} acknowledged; {report.finished_came_back} FINished bodies "
          f"came back (allowed), {report.duplicates} duplicates")
    assert report.rounds == report.restarts == int(os.environ.get("MQD_KILL_ROUNDS", "10"))
    assert report.acknowledged > 100 * report.rounds, report
    assert not report.problems, "\n".join(report.problems[:20])
    assert (report.missing, report.corrupt, report.unknown, report.duplicates) == (0, 0, 0, 0)


# -- a full disk -------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmpfs):
    """A 16 MB tmpfs of its own, so the broker's data path can really fill up."""
    return tmpfs(16)


def _publish(broker, topic: str, body: bytes) -> bytes:
    """PUB on a new connection (E_PUB_FAILED closes it); the answer's payload."""
    with RawConn(broker, timeout=10) as conn:
        conn.send(command(f"PUB {topic}", body))
        frame_type, payload = conn.read_frame()
        assert frame_type in (FRAME_RESPONSE, FRAME_ERROR), (frame_type, payload)
        return payload


@pytest.mark.parametrize("mode", ["durable", "default"])
def test_full_disk_fails_publishes_then_recovers_by_itself(small_disk, start_broker, mode):
    data = small_disk / "data"
    broker = start_broker(f"--data-path={data}", "--lmdb-map-size=2097152",
                          "--sync-every=1", "--sync-timeout=50ms", *FAST_SCAN,
                          *(["--durable"] if mode == "durable" else []), data_path=False)
    topic = f"disk_{mode}"
    with RawConn(broker) as conn:
        conn.send(command(f"SUB {topic} c"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
    acked: list[bytes] = []
    seq = 0

    def publish_one() -> bytes:
        nonlocal seq
        body = make_body(b"d", seq)
        seq += 1
        answer = _publish(broker, topic, body)
        if answer == b"OK":
            acked.append(body)
        return answer

    for _ in range(50):
        assert publish_one() == b"OK"
    filler = fill_disk(small_disk)

    # Publishing goes on until the store's commits fail: then PUB and /pub fail and /ping says NOK.
    answers = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        answer = publish_one()
        answers.append(answer)
        if answer != b"OK":
            break
    assert answers[-1].startswith(b"E_PUB_FAILED"), (answers[-5:], broker.describe())
    status, body = raw_http(broker, "GET", "/ping", None)
    assert status == 500 and body.startswith(b"NOK"), (status, body)
    status, body = raw_http(broker, "POST", f"/pub?topic={topic}", b"while full")
    assert status == 500, (status, body)
    assert broker.running

    # Consumers still get everything acknowledged so far.
    while_full = {d.body for d in drain(broker, topic, "c", expect=len(acked), silence=1.0)}
    missing = set(acked) - while_full
    assert not missing, f"while full: {len(missing)} of {len(acked)} acknowledged bodies not delivered"

    # Room again: publishes succeed by themselves, no restart.
    filler.unlink()
    wait_for(lambda: raw_http(broker, "GET", "/ping", None) == (200, b"OK"), timeout=15,
             what=f"/ping to say OK again\n{broker.describe()}")
    for _ in range(20):
        assert publish_one() == b"OK"

    # Every acknowledged message is delivered, intact.
    got = drain(broker, topic, "c", expect=20, silence=1.0)
    bodies = [d.body for d in got]
    for b in bodies:
        check_body(b)
    missing = set(acked) - set(bodies) - while_full
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged bodies lost"
    assert not log_problems(broker), broker.describe()
    broker.stop_cleanly()


def _queue_stats(broker) -> dict[str, tuple[int, int, int]]:
    status, body = raw_http(broker, "GET", "/stats?format=json", None)
    assert status == 200, (status, body)
    out = {}
    for t in json.loads(body)["topics"]:
        for c in t["channels"]:
            out[f"{t['topic_name']}:{c['channel_name']}"] = (
                c["depth"], c["in_flight_count"], c["deferred_count"])
    return out


def test_snapshot_on_a_full_disk_answers_an_error_and_changes_nothing(small_disk, start_broker):
    """A snapshot that cannot be written, or of a failing store, is an error; nothing moves."""
    data = small_disk / "data"
    broker = start_broker(f"--data-path={data}", "--lmdb-map-size=2097152", "--mem-queue-size=10",
                          "--sync-timeout=50ms", *FAST_SCAN, data_path=False)
    assert raw_http(broker, "POST", "/topic/create?topic=full", None)[0] == 200
    assert raw_http(broker, "POST", "/channel/create?topic=full&channel=c", None)[0] == 200
    acked = []
    for i in range(40):
        body = make_body(b"s", i)
        if _publish(broker, "full", body) == b"OK":
            acked.append(body)
    assert len(acked) == 40
    before = _queue_stats(broker)
    assert before == {"full:c": (40, 0, 0)}
    filler = fill_disk(small_disk)

    # No room for the copy: refused before writing (the free space the store
    # keeps), no snapshot (nor half of one), the broker as it was.
    status, body = raw_http(broker, "POST", "/snapshot?out=on-full-disk", None)
    assert (status, json.loads(body)) == (507, {"message": "SNAPSHOT_LIMIT"}), (status, body)
    snapshots = data / "snapshots"
    assert not snapshots.exists() or list(snapshots.iterdir()) == []
    assert _queue_stats(broker) == before

    # The store itself fails (publishes do): no consistent cut, 503, nothing changes.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _publish(broker, "full", b"more") == b"OK":
        acked.append(b"more")
    status, body = raw_http(broker, "POST", "/snapshot?out=store-failing", None)
    assert (status, json.loads(body)) == (503, {"message": "STORE_FAILED"}), (status, body)
    stats = _queue_stats(broker)
    status, body = raw_http(broker, "POST", "/snapshot?out=store-failing", None)
    assert status == 503 and _queue_stats(broker) == stats

    # Room again: the snapshot works, holds every acknowledged message, and they are all delivered.
    filler.unlink()
    wait_for(lambda: raw_http(broker, "GET", "/ping", None) == (200, b"OK"), timeout=15,
             what=f"/ping to say OK again\n{broker.describe()}")
    status, body = raw_http(broker, "POST", "/snapshot?out=after", None)
    assert status == 200, (status, body)
    queue = next(q for q in json.loads(body)["manifest"]["queues"] if q["name"] == "full:c")
    assert queue["queued"] == queue["stats"]["depth"] == len(acked)
    got = [d.body for d in drain(broker, "full", "c", expect=len(acked), silence=1.0)]
    assert sorted(got) == sorted(acked)
    assert not log_problems(broker), broker.describe()
    broker.stop_cleanly()


# -- clients that never read ---------------------------------------------------------------------

# Far above what the broker needs for the data itself (messages in flight
# included), far below what it holds when it buffers everything a client does
# not read: without flow control the never-reading consumer grew RSS by ~300 MB
# (~30 MB with it) and the FIN flood by ~100 MB (~10 MB) in these 8 s (2 cores).
NEVER_READING_LIMIT_MB = 64
FIN_FLOOD_LIMIT_MB = 48
SLOW_CONSUMER_ANON_LIMIT_MB = 64


def _assert_bounded(result, broker, limit_mb: float, anon: bool = False) -> None:
    print(f"\n{result.name}: RSS {result.baseline_mb:.0f} -> peak {result.peak_mb:.0f} MB "
          f"(RssAnon {result.anon_baseline_mb:.0f} -> {result.anon_peak_mb:.0f} MB); "
          f"bystander worst PUB {result.worst_latency_ms:.0f} ms over "
          f"{result.bystander_round_trips} round trips; {result.detail}")
    growth = result.anon_growth_mb if anon else result.growth_mb
    assert growth < limit_mb, (
        f"{result.name}: {'RssAnon' if anon else 'RSS'} grew by {growth:.0f} MB "
        f"(RSS {result.baseline_mb:.0f} -> {result.peak_mb:.0f} MB, RssAnon "
        f"{result.anon_baseline_mb:.0f} -> {result.anon_peak_mb:.0f} MB); {result.detail}")
    assert not result.bystander_errors, result.bystander_errors
    assert result.bystander_round_trips > 0
    assert broker.running and not log_problems(broker), broker.describe()


def test_never_reading_consumer_keeps_rss_bounded(start_broker):
    # A small memory queue: the backlog the other consumer has not taken yet
    # goes to disk instead of adding up to 10,000 x 16 KB of legitimate heap.
    broker = start_broker("--msg-timeout=1s", "--mem-queue-size=100", *FAST_SCAN)
    out = abuse_never_reading_consumer(broker, seconds=8)
    _assert_bounded(out["result"], broker, NEVER_READING_LIMIT_MB)
    broker.stop_cleanly()


def test_fin_flood_without_reading_keeps_rss_bounded(start_broker):
    broker = start_broker(*FAST_SCAN)
    out = abuse_fin_flood(broker, seconds=8)
    _assert_bounded(out["result"], broker, FIN_FLOOD_LIMIT_MB)
    broker.stop_cleanly()


def test_slow_consumer_keeps_memory_bounded(start_broker):
    """A consumer far slower than the publishers: the backlog goes to disk, the heap stays flat.

    Bounded on RssAnon: the backlog's LMDB pages, mapped from the page
    cache (RssFile), grow with the backlog and are the kernel's to take back.
    """
    broker = start_broker("--mem-queue-size=100", "--msg-timeout=5s", *FAST_SCAN)
    out = abuse_slow_consumer(broker, seconds=8)
    _assert_bounded(out["result"], broker, SLOW_CONSUMER_ANON_LIMIT_MB, anon=True)
    broker.stop_cleanly()
