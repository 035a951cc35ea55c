"""With `--durable`, an error answer to a publish means "not stored": never stored, never delivered.

A commit that fails (a full disk) answers its publishers E_PUB_FAILED /
E_MPUB_FAILED / E_DPUB_FAILED (HTTP 500). The store used to keep what that
commit held and retry it every second, so a refused message landed once
the disk had room and was delivered, after a restart too; and a durable
queue handed out messages before their commit, so a consumer could even
get one whose publisher was then told it failed. Now a durable queue hands
out only committed messages, and a failed commit drops the new publishes
it held (everything else it held was acknowledged long ago and is
retried). A big batch that already has chunks stored does not answer an
error at all: it waits for room and finishes.

In-process tests drive a durable broker on a `task.Clock` whose commits
fail on demand; the last test fills a real tmpfs (root only).
"""

from __future__ import annotations

import select
import threading
import time

import lmdb
import pytest

from tests.support.control_checks import raw_http
from tests.support.durable_load import drain
from tests.support.full_disk import fill_disk
from tests.support.http_client import HTTPClient, error, parse_response
from tests.support.inprocess_broker import failing_once, scan
from tests.support.lmdb_stores import FULL, crash, delivered, lmdb_broker, restart
from tests.support.processes import FAST_SCAN, wait_for
from tests.support.raw_conn import FRAME_MESSAGE, FRAME_RESPONSE, RawConn, command
from tests.support.reactor_turns import CHUNK, run_turns
from tests.support.v2_client import Client, consumer, publisher_client
from tests.support.v2_frames import cmd, dpub, err, mpub, mpub_body, ok, pub

KINDS = ["PUB", "MPUB", "DPUB", "HTTP /pub", "HTTP /mpub", "HTTP /mpub binary"]


def _send(broker, kind: str, bodies: list[bytes]):
    """Start a publish of `bodies` (PUB/DPUB/HTTP /pub: the first only); returns what reads its answer."""
    if kind.startswith("HTTP"):
        http = HTTPClient(broker)
        if kind == "HTTP /pub":
            transport = http.send("POST", "/pub?topic=t", bodies[0])
        elif kind == "HTTP /mpub":
            transport = http.send("POST", "/mpub?topic=t", b"\n".join(bodies))
        else:
            transport = http.send("POST", "/mpub?topic=t&binary=true", mpub_body(bodies))
        return lambda: parse_response(transport.value())
    p = Client(broker)
    if kind == "PUB":
        p.send(pub("t", bodies[0]))
    elif kind == "MPUB":
        p.send(mpub("t", bodies))
    else:
        p.send(dpub("t", 500, bodies[0]))
    return p.read


def _sent(kind: str, bodies: list[bytes]) -> list[bytes]:
    return bodies if "MPUB" in kind.upper() else bodies[:1]


def _is_ok(kind: str, answer) -> bool:
    if kind.startswith("HTTP"):
        return (answer.status, answer.body) == (200, b"OK")
    return answer == [ok()]


def _is_refused(kind: str, answer) -> bool:
    if kind.startswith("HTTP"):
        return error(answer) == (500, "INTERNAL_ERROR")
    verb = kind.split()[0]
    return answer == [err(f"E_{verb}_FAILED {verb} failed {FULL}")]


def _everything(broker, clock, c: Client) -> list[bytes]:
    """Let deferred messages come due, then every body `c` got (FINed as it comes)."""
    got = []
    for _ in range(3):
        clock.advance(1)
        scan(broker)
        for m in delivered(c):
            got.append(m.body)
            c.fin(m)
    return got


@pytest.mark.parametrize("kind", KINDS)
def test_publish_answered_with_an_error_is_never_delivered_nor_stored(tmp_path, clock, kind):
    broker = lmdb_broker(tmp_path, clock, durable=True)
    c = consumer(broker, "t", "c", rdy=100)  # ready all along: it would get anything handed out

    good = [b"ok-%d" % i for i in range(3)]
    answer = _send(broker, kind, good)
    assert not c.read()  # not delivered before the commit holding it
    clock.advance(0)
    assert _is_ok(kind, answer())
    acked = _sent(kind, good)
    got = _everything(broker, clock, c)
    assert sorted(got) == sorted(acked)

    failing_once(broker.store)
    bad = [b"refused-%d" % i for i in range(3)]
    answer = _send(broker, kind, bad)
    assert not c.read()
    clock.advance(0)
    assert _is_refused(kind, answer())
    refused = set(_sent(kind, bad))
    assert broker.health == FULL

    got += _everything(broker, clock, c)  # the store's retry commits, and the DPUB would come due
    assert broker.health is None and broker.store.failure is None
    assert sorted(got) == sorted(acked)

    after = _send(broker, kind, [b"after-%d" % i for i in range(3)])
    clock.advance(0)
    assert _is_ok(kind, after())
    acked += _sent(kind, [b"after-%d" % i for i in range(3)])
    got += _everything(broker, clock, c)
    assert sorted(got) == sorted(acked)
    assert not refused & set(got)

    # Neither a crash nor a clean restart brings a refused message back.
    broker = crash(broker, durable=True)
    broker = restart(broker, durable=True)
    c = consumer(broker, "t", "c", rdy=100)
    again = _everything(broker, broker.clock, c)
    assert not refused & set(again), again
    broker.close()


@pytest.mark.parametrize("topic", ["t", "t#ephemeral"])
def test_ephemeral_consumers_never_get_a_refused_publish(tmp_path, clock, topic):
    """Ephemeral channels and topics are never stored, but their publisher waits for the
    commit all the same: they get a publish once it is over, and never when it failed."""
    broker = lmdb_broker(tmp_path, clock, durable=True)
    c = consumer(broker, topic, "e#ephemeral", rdy=10)
    if topic == "t":
        consumer(broker, topic, "stored", rdy=0)
    clock.advance(0)
    p = Client(broker)
    p.send(pub(topic, b"acked"))
    assert not c.read()  # not before the commit
    clock.advance(0)
    assert p.read() == [ok()]
    assert [m.body for m in delivered(c)] == [b"acked"]
    failing_once(broker.store)
    q = Client(broker)
    q.send(pub(topic, b"refused"))
    Client(broker).send(pub("other", b"o"))  # a commit with something to write (the ephemeral one has not)
    clock.advance(0)
    assert q.read() == [err(f"E_PUB_FAILED PUB failed {FULL}")]
    clock.advance(1)
    assert broker.store.failure is None
    assert delivered(c) == []
    broker.close()


def test_failed_commit_keeps_what_was_acknowledged_before(tmp_path, clock):
    """Only new publishes go with a failed commit: FINs and rewrites of older messages are retried."""
    broker = lmdb_broker(tmp_path, clock, durable=True)
    c = consumer(broker, "t", "c", rdy=10)
    p = Client(broker)
    p.send(mpub("t", [b"a", b"b", b"c"]))
    clock.advance(0)
    assert p.read() == [ok()]
    a, b, _ = delivered(c)
    c.send(cmd("RDY", 0))
    c.fin(a)  # a FIN, a requeue (its record rewritten: attempts 1), and a new publish, all in one commit
    c.req(b, 0)
    failing_once(broker.store)
    q = Client(broker)
    q.send(pub("t", b"refused"))
    clock.advance(0)
    assert q.read() == [err(f"E_PUB_FAILED PUB failed {FULL}")]
    clock.advance(1)  # the retry writes the FIN and the rewrite
    assert broker.store.failure is None
    broker = crash(broker, durable=True)
    c = consumer(broker, "t", "c", rdy=10)
    back = delivered(c)
    assert sorted(m.body for m in back) == [b"b", b"c"]
    assert {m.body: m.attempts for m in back} == {b"b": 2, b"c": 1}  # b's rewrite was written
    broker.close()


def _big_batch(tmp_path, clock):
    """A durable broker, a consumer of topic "big", a publisher, and the bodies of a batch of 10 chunks."""
    broker = lmdb_broker(tmp_path, clock, durable=True)
    c = consumer(broker, "big", "c", rdy=2500)
    p = publisher_client(broker)
    clock.advance(0)  # the topic and channel are written
    return broker, c, p, [b"%d" % i for i in range(10 * CHUNK)]


@pytest.mark.usefixtures("small_chunks")
def test_durable_big_batch_refused_on_its_first_chunk_stores_nothing(tmp_path, clock):
    broker, c, p, bodies = _big_batch(tmp_path, clock)
    failing_once(broker.store)  # the commit of the first chunk fails
    p.send(mpub("big", bodies))
    run_turns(clock, lambda: p.transport.value())
    assert p.read() == [err(f"E_MPUB_FAILED MPUB failed {FULL}")]
    clock.advance(1)
    assert broker.store.failure is None
    assert c.read() == []
    broker = crash(broker, durable=True)
    assert broker.topics["big"].channels["c"].depth() == 0
    broker.close()


@pytest.mark.usefixtures("small_chunks")
def test_durable_big_batch_failing_mid_way_waits_for_room_then_answers_ok(tmp_path, clock):
    """Chunks are stored already: an error answer would be a lie, so the batch waits and finishes."""
    broker, c, p, bodies = _big_batch(tmp_path, clock)
    p.send(mpub("big", bodies))
    got: list[bytes] = []

    def take() -> bool:
        got.extend(m.body for m in delivered(c))
        return bool(got)

    run_turns(clock, take)  # a chunk is committed (only committed messages are delivered)
    assert len(got) < len(bodies)

    full = [True]
    real = broker.store._write

    def write():
        if full[0]:
            raise lmdb.Error("No space left on device")
        return real()

    broker.store._write = write
    for _ in range(5):
        clock.advance(0)
        clock.advance(1)
        got.extend(m.body for m in delivered(c))
    assert broker.health == FULL
    assert p.read() == []  # no answer while the disk is full
    full[0] = False
    for _ in range(200):
        clock.advance(1)
        got.extend(m.body for m in delivered(c))
        if p.transport.value():
            break
    assert p.read() == [ok()]
    clock.advance(0)
    got.extend(m.body for m in delivered(c))
    assert got == bodies  # every message once, in order: the dropped chunk went in again
    broker.close()


# -- the same on a real broker and a real full disk (a tmpfs, root only) -----------------------


class Watcher(threading.Thread):
    """A consumer of one channel that FINs everything and remembers every body it was handed."""

    def __init__(self, broker, topic: str, channel: str) -> None:
        super().__init__(daemon=True, name=f"watcher-{channel}")
        self.conn = RawConn(broker, timeout=10)
        self.conn.send(command(f"SUB {topic} {channel}") + command("RDY 2500"))
        assert self.conn.read_frame() == (FRAME_RESPONSE, b"OK")
        self.bodies: list[bytes] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        sock = self.conn.sock
        while not self.stopping.is_set():
            if not self.conn._buf and not select.select([sock], [], [], 0.2)[0]:
                continue
            try:
                frame_type, payload = self.conn.read_frame()  # whole frames: it is arriving
            except OSError:
                return
            if frame_type == FRAME_MESSAGE:
                self.bodies.append(payload[26:])
                self.conn.send(b"FIN " + payload[10:26] + b"\n")

    def stop(self) -> list[bytes]:
        self.stopping.set()
        self.join(10)
        self.conn.close()
        return self.bodies


def _real_publish(broker, kind: str, bodies: list[bytes]) -> bool:
    """One publish on its own connection (an error closes it); True if it was acknowledged."""
    if kind.startswith("HTTP"):
        path, body = {
            "HTTP /pub": ("/pub?topic=t", bodies[0]),
            "HTTP /mpub": ("/mpub?topic=t", b"\n".join(bodies)),
            "HTTP /mpub binary": ("/mpub?topic=t&binary=true", mpub_body(bodies)),
        }[kind]
        status, answer = raw_http(broker, "POST", path, body)
        assert status in (200, 500), (status, answer)
        return status == 200
    line = {"PUB": "PUB t", "MPUB": "MPUB t", "DPUB": "DPUB t 300"}[kind]
    with RawConn(broker, timeout=10) as conn:
        conn.send(command(line, mpub_body(bodies) if kind == "MPUB" else bodies[0]))
        frame_type, payload = conn.read_frame()
    if (frame_type, payload) == (FRAME_RESPONSE, b"OK"):
        return True
    assert payload.startswith(f"E_{kind}_FAILED".encode()), payload
    return False


def test_real_full_disk_refused_publishes_never_come_back(tmp_path, tmpfs, start_broker):
    mnt = tmpfs(16)
    broker = start_broker(f"--data-path={mnt / 'data'}", "--durable", "--lmdb-map-size=2097152",
                          *FAST_SCAN, data_path=False)
    with RawConn(broker) as conn:  # "keep" fills the disk: nobody reads it until the end
        conn.send(command("SUB t keep"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
    watcher = Watcher(broker, "t", "watch")  # sees anything ever handed out
    watcher.start()
    acked: set[bytes] = set()
    refused: set[bytes] = set()
    seq = 0
    for kind in KINDS:
        filler = fill_disk(mnt)
        deadline = time.monotonic() + 20
        while True:
            assert time.monotonic() < deadline, f"{kind}: no publish refused\n{broker.describe()}"
            n = 1 if kind in ("PUB", "DPUB", "HTTP /pub") else 4
            bodies = [b"%s-%06d-" % (kind.encode(), seq + i) + b"x" * 1500 for i in range(n)]
            seq += n
            if _real_publish(broker, kind, bodies):
                acked.update(bodies)
            else:
                refused.update(bodies)
                break
        filler.unlink()
        wait_for(lambda: raw_http(broker, "GET", "/ping", None) == (200, b"OK"), timeout=15,
                 what=f"/ping OK again\n{broker.describe()}")
    for i in range(20):  # acknowledged after the disk was full, never read before the crash
        body = b"tail-%03d" % i
        assert _real_publish(broker, "PUB", [body])
        acked.add(body)
    time.sleep(0.5)  # a DPUB refused would be due by now
    seen = watcher.stop()
    assert not refused & set(seen), sorted(refused & set(seen))[:3]

    broker.stop_cleanly()
    broker.start()
    broker.crash()
    broker.start()
    keep = [d.body for d in drain(broker, "t", "keep", expect=len(acked), silence=1.0)]
    watch = [d.body for d in drain(broker, "t", "watch", silence=0.5)]
    assert not refused & set(keep), f"{len(refused & set(keep))} refused bodies stored"
    assert not refused & set(watch), f"{len(refused & set(watch))} refused bodies stored"
    assert acked <= set(keep), f"{len(acked - set(keep))} of {len(acked)} acknowledged bodies lost"
    assert set(keep) <= acked
    broker.stop_cleanly()
