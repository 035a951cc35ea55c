"""/topic/retention, /topic/offsets and /topic/read, driven in process through real twisted.web.

The broker runs on a task.Clock; the read's pull producer is driven by
twisted's producer helper on that clock too (`pulled_on_clock`), so a read
of many chunks is written turn by turn as `HTTPClient.turned` advances it.
"""

from __future__ import annotations

import base64
import json

import pytest
from twisted.internet import _producer_helpers
from twisted.internet.task import Cooperator

from backends.memory_log import MemoryLog
from mqd.nsqd.http import retained as retained_http
from mqd.nsqd.metadata import METADATA_FILE
from mqd.nsqd.stats import stats_json
from mqd.wire.log_frames import FRAME_OVERHEAD, iter_frames
from tests.support.auth_fakes import answer
from tests.support.http_client import HTTPClient, error
from tests.support.inprocess_broker import START_TIME

START_MS = int(START_TIME * 1000)


@pytest.fixture
def pulled_on_clock(monkeypatch, clock):
    """twisted.web's pull producers driven by the test clock, one resumeProducing per turn."""
    cooperator = Cooperator(terminationPredicateFactory=lambda: (lambda: True),
                            scheduler=lambda step: clock.callLater(0, step))
    monkeypatch.setattr(_producer_helpers, "cooperate", cooperator.cooperate)


@pytest.fixture
def broker(make_broker):
    """Retention on by the options (1 MB), topic t with three records, topic plain without one."""
    b = make_broker(retention_bytes="1MB")
    b.topic("t").publish([b"one", b"two", b"three"])
    b.topic("plain")
    return b


@pytest.fixture
def http(broker, sync_threads) -> HTTPClient:
    return HTTPClient(broker)


def frames(body: bytes) -> list[tuple[int, int, bytes]]:
    """(offset, timestamp, id + body) of each frame, as the log's records."""
    return [(offset, ts, mid + body) for offset, ts, _, mid, body in iter_frames(body)]


def state(broker, tmp_path):
    """What a refused request must leave as it was."""
    meta = (tmp_path / METADATA_FILE).read_bytes() if (tmp_path / METADATA_FILE).exists() else None
    return stats_json(broker, include_mem=False), meta, {n: t.retention for n, t in broker.topics.items()}


# -- /topic/retention ----------------------------------------------------------------------------


def test_get_retention_shows_the_options_for_a_topic_without_its_own(http):
    assert http.get("/topic/retention?topic=t").json() == {
        "topic": "t", "time": "0s", "bytes": 1_000_000, "time_ms": 0, "overridden": False}


def test_post_sets_both_bounds_and_answers_once_written(http, broker, tmp_path, clock):
    r = http.post("/topic/retention?topic=t&time=24h&bytes=10GB")
    assert r.status == 200 and r.v1 and r.is_json
    assert r.json() == {"topic": "t", "time": "24h0m0s", "bytes": 10**10, "time_ms": 86_400_000,
                        "overridden": True}
    [entry] = [t for t in json.loads((tmp_path / METADATA_FILE).read_bytes())["topics"] if t["name"] == "t"]
    assert entry["retention"] == {"time_ms": 86_400_000, "bytes": 10**10}
    assert http.get("/topic/retention?topic=t").json()["overridden"] is True


def test_post_one_bound_keeps_the_other(http):
    assert http.post("/topic/retention?topic=t&time=90m").json() == {
        "topic": "t", "time": "1h30m0s", "bytes": 1_000_000, "time_ms": 5_400_000, "overridden": True}


def test_both_bounds_zero_turn_retention_off_and_delete_the_log(http, broker):
    log = broker.topics["t"].log
    assert http.post("/topic/retention?topic=t&time=0&bytes=0").json()["overridden"] is True
    assert broker.topics["t"].log is None and broker.store.log_names() == ["plain"]
    assert error(http.get("/topic/offsets?topic=t")) == (400, "RETENTION_OFF")
    assert error(http.get("/topic/read?topic=t&offset=0")) == (400, "RETENTION_OFF")
    back = http.post("/topic/retention?topic=t&default=true").json()
    assert back == {"topic": "t", "time": "0s", "bytes": 1_000_000, "time_ms": 0, "overridden": False}
    assert http.get("/topic/offsets?topic=t").json()["epoch"] != log.epoch


def test_post_without_a_bound_changes_nothing(http, broker):
    assert http.post("/topic/retention?topic=t").json()["overridden"] is False
    assert http.post("/topic/retention?topic=t&default=false").json()["overridden"] is False


@pytest.mark.parametrize(("query", "expected"), [
    ("", (400, "MISSING_ARG_TOPIC")),
    ("topic=bad!", (400, "INVALID_TOPIC")),
    ("topic=nope&time=1h", (404, "TOPIC_NOT_FOUND")),
    ("topic=t&time=soon", (400, "INVALID_TIME")),
    ("topic=t&time=-1h", (400, "INVALID_TIME")),
    ("topic=t&time=" + "9" * 400 + "h", (400, "INVALID_TIME")),
    ("topic=t&bytes=lots", (400, "INVALID_BYTES")),
    ("topic=t&bytes=-5", (400, "INVALID_BYTES")),
    ("topic=t&bytes=" + "9" * 19 + "TB", (400, "INVALID_BYTES")),
    ("topic=t&bytes=0&time=1h", (400, "INVALID_BYTES")),  # time alone on the memory store
    ("topic=t&default=maybe", (400, "INVALID_DEFAULT")),
    ("topic=t&default=true&time=1h", (400, "INVALID_DEFAULT")),
    ("topic=t%23ephemeral&time=1h", (400, "INVALID_TOPIC")),
    ("topic=t&time=1h;x", (400, "INVALID_REQUEST")),
])
def test_bad_input_is_refused_and_changes_nothing(http, broker, tmp_path, clock, query, expected):
    broker.topic("t#ephemeral")
    clock.advance(0)
    before = state(broker, tmp_path)
    assert error(http.post(f"/topic/retention?{query}")) == expected
    clock.advance(0)
    assert state(broker, tmp_path) == before


def test_get_retention_errors(http):
    assert error(http.get("/topic/retention")) == (400, "MISSING_ARG_TOPIC")
    assert error(http.get("/topic/retention?topic=nope")) == (404, "TOPIC_NOT_FOUND")
    assert error(http.request("DELETE", "/topic/retention?topic=t")) == (405, "METHOD_NOT_ALLOWED")


# -- /topic/offsets -----------------------------------------------------------------------------------


def test_offsets(http, broker, clock):
    log = broker.topics["t"].log
    assert http.get("/topic/offsets?topic=t").json() == {
        "topic": "t", "epoch": log.epoch, "earliest": 0, "latest": 3, "retained_bytes": log.retained_bytes(),
        "oldest_timestamp": START_MS, "kept": True, "retention": {"time_ms": 0, "bytes": 1_000_000}}
    clock.advance(10)
    broker.topics["t"].publish([b"later"])
    got = http.get(f"/topic/offsets?topic=t&timestamp={START_MS + 5000}").json()
    assert got["offset_for_timestamp"] == 3 and list(got)[6] == "offset_for_timestamp"
    assert http.get(f"/topic/offsets?topic=t&timestamp={START_MS + 20_000}").json()["offset_for_timestamp"] == 4
    assert http.get("/topic/offsets?topic=t&timestamp=0").json()["offset_for_timestamp"] == 0


def test_offsets_of_an_empty_log(http, broker):
    got = http.get("/topic/offsets?topic=plain").json()
    assert (got["earliest"], got["latest"], got["oldest_timestamp"], got["retained_bytes"]) == (0, 0, None, 0)


@pytest.mark.parametrize(("query", "expected"), [
    ("", (400, "MISSING_ARG_TOPIC")),
    ("topic=bad!", (400, "INVALID_TOPIC")),
    ("topic=nope", (404, "TOPIC_NOT_FOUND")),
    ("topic=t&timestamp=yesterday", (400, "INVALID_TIMESTAMP")),
    ("topic=t&timestamp=-1", (400, "INVALID_TIMESTAMP")),
])
def test_offsets_errors(http, query, expected):
    assert error(http.get(f"/topic/offsets?{query}")) == expected


def test_a_topic_without_retention_is_retention_off(make_broker, sync_threads):
    broker = make_broker()
    broker.topic("t")
    http = HTTPClient(broker)
    assert error(http.get("/topic/offsets?topic=t")) == (400, "RETENTION_OFF")
    assert error(http.get("/topic/read?topic=t&offset=0")) == (400, "RETENTION_OFF")


# -- /topic/read, binary ---------------------------------------------------------------------------------


def test_read_answers_frames_with_the_logs_headers(http, broker):
    log = broker.topics["t"].log
    r = http.get("/topic/read?topic=t&offset=1")
    assert r.status == 200
    assert r.header("Content-Type") == "application/vnd.mqd.log-frames"
    assert (r.header("X-Mqd-Epoch"), r.header("X-Mqd-Next-Offset"), r.header("X-Mqd-Earliest"),
            r.header("X-Mqd-Latest")) == (str(log.epoch), "3", "0", "3")
    assert int(r.header("Content-Length")) == len(r.body)
    got = frames(r.body)
    assert [(o, d[16:]) for o, _, d in got] == [(1, b"two"), (2, b"three")]
    assert got == log.read(1, 10, 1 << 20)
    assert {ts for _, ts, _ in got} == {int(START_TIME * 1e9)}


def test_read_from_earliest_and_latest(http, broker):
    assert [o for o, _, _ in frames(http.get("/topic/read?topic=t&offset=earliest").body)] == [0, 1, 2]
    r = http.get("/topic/read?topic=t&offset=latest")
    assert (r.status, r.body, r.header("X-Mqd-Next-Offset")) == (200, b"", "3")
    r = http.get("/topic/read?topic=t&offset=3")
    assert (r.status, r.body, r.header("X-Mqd-Next-Offset")) == (200, b"", "3")


def test_read_bounds(http, broker):
    r = http.get("/topic/read?topic=t&offset=0&max_messages=2")
    assert [o for o, _, _ in frames(r.body)] == [0, 1] and r.header("X-Mqd-Next-Offset") == "2"
    # Ids and bodies count against max_bytes; the first record always comes whole.
    r = http.get("/topic/read?topic=t&offset=0&max_bytes=1")
    assert [o for o, _, _ in frames(r.body)] == [0] and r.header("X-Mqd-Next-Offset") == "1"
    r = http.get("/topic/read?topic=t&offset=0&max_bytes=38")  # 16+3 and 16+3
    assert [o for o, _, _ in frames(r.body)] == [0, 1]
    r = http.get("/topic/read?topic=t&offset=0&max_messages=99999999999999999999999")
    assert [o for o, _, _ in frames(r.body)] == [0, 1, 2]


def test_leading_zeros_do_not_make_a_number_too_long(http):
    r = http.get("/topic/read?topic=t&offset=" + "0" * 5000 + "2")
    assert r.status == 200 and [o for o, _, _ in frames(r.body)] == [2]
    assert http.get("/topic/read?topic=t&offset=0&max_messages=" + "0" * 5000 + "1").header(
        "X-Mqd-Next-Offset") == "1"


def test_an_offset_out_of_range_is_416_with_the_bounds(http, broker, clock):
    r = http.get("/topic/read?topic=t&offset=4")
    assert r.status == 416 and r.v1 and r.is_json
    assert r.json() == {"message": "OFFSET_OUT_OF_RANGE", "earliest": 0, "latest": 3}
    log = broker.topics["t"].log
    assert log.expire(0, log.retained_bytes() - 1) == 1
    r = http.get("/topic/read?topic=t&offset=0&format=json")
    assert (r.status, r.json()) == (416, {"message": "OFFSET_OUT_OF_RANGE", "earliest": 1, "latest": 3})


@pytest.mark.parametrize(("query", "expected"), [
    ("offset=0", (400, "MISSING_ARG_TOPIC")),
    ("topic=bad!&offset=0", (400, "INVALID_TOPIC")),
    ("topic=nope&offset=0", (404, "TOPIC_NOT_FOUND")),
    ("topic=t", (400, "INVALID_OFFSET")),
    ("topic=t&offset=-1", (400, "INVALID_OFFSET")),
    ("topic=t&offset=first", (400, "INVALID_OFFSET")),
    ("topic=t&offset=" + "9" * 30, (400, "INVALID_OFFSET")),
    ("topic=t&offset=0&max_messages=0", (400, "INVALID_MAX_MESSAGES")),
    ("topic=t&offset=0&max_messages=ten", (400, "INVALID_MAX_MESSAGES")),
    ("topic=t&offset=0&max_bytes=0", (400, "INVALID_MAX_BYTES")),
    ("topic=t&offset=0&max_bytes=1MB", (400, "INVALID_MAX_BYTES")),
    ("topic=t&offset=0&format=json&max_body=x", (400, "INVALID_MAX_BODY")),
])
def test_read_errors(http, query, expected):
    assert error(http.get(f"/topic/read?{query}")) == expected


def test_a_read_of_many_chunks_is_measured_then_pulled(make_broker, sync_threads, pulled_on_clock, monkeypatch):
    monkeypatch.setattr(retained_http, "CHUNK_BYTES", 1000)
    broker = make_broker(retention_bytes="10MB")
    topic = broker.topic("t")
    bodies = [b"%05d" % i * 20 for i in range(200)]  # 100 bytes each
    topic.publish(bodies)
    reads = []
    measures = []
    real, real_extent = topic.log.read_frames, topic.log.frames_extent

    def counted(offset, max_messages, max_bytes):
        reads.append((offset, max_messages, max_bytes))
        return real(offset, max_messages, max_bytes)

    def measured(offset, max_messages, max_bytes):
        measures.append((offset, max_messages, max_bytes))
        return real_extent(offset, max_messages, max_bytes)

    monkeypatch.setattr(MemoryLog, "read_frames", lambda self, *a: counted(*a))
    monkeypatch.setattr(MemoryLog, "frames_extent", lambda self, *a: measured(*a))
    http = HTTPClient(broker)
    r = http.turned("GET", "/topic/read?topic=t&offset=10&max_bytes=11600")  # 100 records of 116 bytes
    assert r.status == 200 and r.header("X-Mqd-Next-Offset") == "110"
    assert int(r.header("Content-Length")) == len(r.body) == 100 * (FRAME_OVERHEAD + 116)
    assert [d[16:] for _, _, d in frames(r.body)] == bodies[10:110]
    # Every read bounded by a chunk (8 records): the first chunk read once, the
    # other 12 measured (no frame built) then read to be written.
    assert all(max_bytes <= 1000 for _, _, max_bytes in reads + measures)
    assert len(reads) == 1 + 12
    assert [offset for offset, _, _ in measures] == list(range(18, 110, 8))


def test_a_log_deleted_under_a_read_cuts_the_answer_short(make_broker, sync_threads, pulled_on_clock,
                                                          monkeypatch, clock):
    monkeypatch.setattr(retained_http, "CHUNK_BYTES", 1000)
    broker = make_broker(retention_bytes="10MB")
    broker.topic("t").publish([b"x" * 100] * 50)
    real = MemoryLog.read_frames
    calls = []

    def read_then_delete(self, *args):
        calls.append(args)
        if len(calls) == 3:  # the first chunk (measuring), one more chunk written: the topic goes
            broker.delete_topic("t")
        return real(self, *args)

    monkeypatch.setattr(MemoryLog, "read_frames", read_then_delete)
    http = HTTPClient(broker)
    transport = http.send("GET", "/topic/read?topic=t&offset=0")
    clock.advance(0)
    head, _, body = transport.value().partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert b"Content-Length: %d" % (50 * (FRAME_OVERHEAD + 116)) in head
    assert len(body) == 2 * 8 * (FRAME_OVERHEAD + 116)  # the first chunk, and one pulled before the delete
    assert transport.disconnecting


def test_the_dummy_store_keeps_nothing_and_reads_empty(make_broker, sync_threads):
    broker = make_broker(backend="dummy", retention_time="1h")
    broker.topic("t").publish([b"gone"])
    http = HTTPClient(broker)
    got = http.get("/topic/offsets?topic=t").json()
    assert (got["kept"], got["epoch"], got["earliest"], got["latest"]) == (False, 0, 0, 0)
    r = http.get("/topic/read?topic=t&offset=earliest")
    assert (r.status, r.body, r.header("X-Mqd-Next-Offset")) == (200, b"", "0")


# -- /topic/read, JSON ---------------------------------------------------------------------------------------


def test_read_as_json_shows_records_as_peek_shows_messages(http, broker):
    log = broker.topics["t"].log
    got = http.get("/topic/read?topic=t&offset=1&format=json").json()
    assert got == {"topic": "t", "epoch": log.epoch, "next_offset": 3, "messages": [
        {"offset": 1, "id": log.read(1, 1, 100)[0][2][:16].decode(), "timestamp": int(START_TIME * 1e9), "attempts": 0,
         "size": 3, "body": base64.b64encode(b"two").decode(), "body_text": "two"},
        {"offset": 2, "id": log.read(2, 1, 100)[0][2][:16].decode(), "timestamp": int(START_TIME * 1e9), "attempts": 0,
         "size": 5, "body": base64.b64encode(b"three").decode(), "body_text": "three"},
    ]}
    assert list(got) == ["topic", "epoch", "messages", "next_offset"]


def test_read_as_json_cuts_bodies_and_answers(make_broker, sync_threads):
    broker = make_broker(retention_bytes="10MB", peek_max_body_bytes=10, peek_max_bytes=4096)
    broker.topic("t").publish([b"\xff" + b"b" * 99] + [b"a" * 100] * 200)
    http = HTTPClient(broker)
    got = http.get("/topic/read?topic=t&offset=0&format=json&max_body=4").json()
    first = got["messages"][0]
    assert (first["size"], base64.b64decode(first["body"]), first["body_text"]) == (100, b"\xffbbb", None)
    assert 0 < len(got["messages"]) < 201 and got["next_offset"] == len(got["messages"])
    assert len(http.get("/topic/read?topic=t&offset=0&format=json").body) <= 4096
    assert got["messages"][1]["body_text"] == "aaaa"
    assert http.get("/topic/read?topic=t&offset=201&format=json").json()["messages"] == []


def test_read_as_json_respects_max_messages(http):
    got = http.get("/topic/read?topic=t&offset=0&format=json&max_messages=1").json()
    assert [m["offset"] for m in got["messages"]] == [0] and got["next_offset"] == 1


# -- auth configured: the readers need subscribe, as peek ------------------------------------------------------


@pytest.fixture
def secured(make_broker, tmp_path, sync_threads):
    path = tmp_path / "secured"
    path.mkdir()
    broker = make_broker(path=str(path), retention_bytes="1MB", auth_http_address=["127.0.0.1:4181"])
    answers = {"sub-t": answer(authorizations=[{"topic": "^t$", "channels": [".*"], "permissions": ["subscribe"]}]),
               "pub-t": answer(authorizations=[{"topic": "^t$", "channels": [".*"], "permissions": ["publish"]}])}

    def fetch(url, method, params):
        from twisted.internet.defer import fail, succeed

        from mqd.http.auth import AuthError
        body = answers.get(params["secret"])
        return succeed(body) if body is not None else fail(AuthError("refused"))

    broker.auth.fetch_function = fetch
    broker.topic("t").publish([b"secret"])
    return HTTPClient(broker)


@pytest.mark.parametrize("path", ["/topic/offsets?topic=t", "/topic/read?topic=t&offset=0",
                                  "/topic/read?topic=t&offset=0&format=json"])
def test_the_readers_need_a_subscribe_grant_when_auth_is_configured(secured, path):
    assert error(secured.get(path)) == (401, "AUTH_REQUIRED")
    assert error(secured.get(path, headers={"Authorization": "Bearer nobody"})) == (401, "AUTH_FAILED")
    assert error(secured.get(path, headers={"Authorization": "Bearer pub-t"})) == (403, "UNAUTHORIZED")
    assert secured.get(path, headers={"Authorization": "Bearer sub-t"}).status == 200


def test_retention_is_not_guarded_without_http_auth_required(secured):
    assert secured.get("/topic/retention?topic=t").status == 200


def test_retention_asked_of_the_dummy_store_is_refused_and_changes_nothing(make_broker, sync_threads):
    broker = make_broker(backend="dummy")
    broker.topic("t")
    http = HTTPClient(broker)
    r = http.post("/topic/retention?topic=t&bytes=1GB")
    assert (r.status, r.json()) == (400, {"message": "RETENTION_UNSUPPORTED"})
    assert broker.topics["t"].log is None and not broker.topics["t"].retention.on
    assert http.get("/topic/offsets?topic=t").json() == {"message": "RETENTION_OFF"}
