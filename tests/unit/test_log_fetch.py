"""The offset mode's fetcher without a broker: frames to Arrow, the schema, and its HTTP against scripted answers.

`frames_to_batch` is checked against `iter_frames`, the framing's
reference reader, row by row; the HTTP side against a small server in a
thread that answers what each test scripts, byte for byte (an idle
connection closed, an answer cut short, headers missing).
"""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqd.wire.log_frames import FRAME_HEAD, frame_records, iter_frames
from spark_bridge.log_fetch import (
    OFFSET_ARROW_SCHEMA,
    OFFSET_SCHEMA_DDL,
    BrokerLog,
    EpochChanged,
    LogFetchError,
    OffsetOutOfRange,
    Refused,
    RetentionOff,
    TopicMissing,
    Unreachable,
    frames_to_batch,
    log_offsets,
    read_batches,
)
from spark_bridge.stream_source import ARROW_STREAM_SCHEMA, STREAM_SCHEMA_DDL

ids = st.binary(min_size=8, max_size=8).map(lambda b: b.hex().encode())
bodies = st.binary(max_size=2000)
stamps = st.integers(-(2**63), 2**63 - 1)
offsets = st.integers(0, 2**63 - 1)
records = st.lists(st.tuples(offsets, stamps, ids, bodies), max_size=30)


@st.composite
def same_size_records(draw) -> list[tuple[int, int, bytes, bytes]]:
    """Records whose bodies all have one size: the answers that need no pass over the frames."""
    size = draw(st.integers(0, 300))
    return draw(st.lists(st.tuples(offsets, stamps, ids, st.binary(min_size=size, max_size=size)),
                         min_size=1, max_size=30))


def framed(recs) -> bytes:
    return frame_records([(o, t, i + b) for o, t, i, b in recs])


def expected_rows(data: bytes, topic: str, nsqd: str) -> list[dict]:
    """The batch's rows as iter_frames, the framing's reference reader, says them."""
    return [{"topic": topic, "channel": None, "message_id": i.decode(), "timestamp": t // 1000, "attempts": a,
             "body": b, "nsqd": nsqd, "offset": o} for o, t, a, i, b in iter_frames(data)]


def rows(batch: pa.RecordBatch) -> list[dict]:
    # Timestamps as their integers: datetime cannot hold the int64 extremes the frames may carry.
    stamps = batch.column("timestamp").cast(pa.int64())
    batch = batch.set_column(3, pa.field("timestamp", pa.int64()), stamps)
    return batch.to_pylist()


# -- frames -> Arrow ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.one_of(records, same_size_records()))
def test_a_batch_holds_every_frame_as_iter_frames_reads_it(recs):
    data = framed(recs)
    batch = frames_to_batch(data, "events", "10.0.0.1:4150")
    assert batch.schema == OFFSET_ARROW_SCHEMA
    assert rows(batch) == expected_rows(data, "events", "10.0.0.1:4150")
    batch.validate(full=True)


@settings(deadline=None)
@given(records)
def test_a_batch_keeps_nothing_of_the_buffer_it_was_read_from(recs):
    buf = bytearray(framed(recs))
    batch = frames_to_batch(memoryview(buf), "t", "n:1")
    want = expected_rows(bytes(buf), "t", "n:1")
    buf[:] = b"\xff" * len(buf)
    assert rows(batch) == want


def test_timestamps_are_the_records_nanoseconds_floored_to_microseconds():
    data = framed([(0, -1, b"0" * 16, b""), (1, 1999, b"1" * 16, b""), (2, -(2**63), b"2" * 16, b"")])
    got = frames_to_batch(data, "t", "n:1").column("timestamp").cast(pa.int64()).to_pylist()
    assert got == [-1, 1, -(2**63) // 1000]


def test_no_frames_is_an_empty_batch_of_the_schema():
    batch = frames_to_batch(b"", "t", "n:1")
    assert batch.num_rows == 0 and batch.schema == OFFSET_ARROW_SCHEMA


@settings(max_examples=200, deadline=None)
@given(st.one_of(records.filter(bool), same_size_records()), st.data())
def test_bytes_cut_inside_a_frame_are_refused_never_a_shorter_batch(recs, data):
    whole = framed(recs)
    cut = data.draw(st.integers(1, len(whole) - 1))
    ends = {0}
    for _offset, _stamp, _attempts, i, b in iter_frames(whole):
        ends.add(max(ends) + FRAME_HEAD.size + len(i) + len(b))
    if cut in ends:
        assert frames_to_batch(whole[:cut], "t", "n:1").num_rows < len(recs)
    else:
        with pytest.raises(LogFetchError, match="not record frames for topic t"):
            frames_to_batch(whole[:cut], "t", "n:1")


@pytest.mark.parametrize(("bad", "why"), [
    ((10).to_bytes(4, "big") + bytes(10) + frame_records([(0, 0, b"0" * 16)]), "shorter than a frame's head"),
    (FRAME_HEAD.pack(34, 0, 0, 1) + b"0" * 16, "attempts other than 0"),
    (FRAME_HEAD.pack(34, 2**63, 0, 0) + b"0" * 16, "offset is past 2\\*\\*63"),
    (FRAME_HEAD.pack(34, 0, 0, 0) + b"0123456789abcdeg", "not 16 hex characters"),
    (FRAME_HEAD.pack(34, 0, 0, 0) + b"0" * 16 + b"\x00\x00", "cut short"),
    (b"\x00\x00", "cut short"),
    (FRAME_HEAD.pack(35, 0, 0, 0) + b"0" * 16, "is 39 bytes long, 38 are left"),
], ids=["short", "attempts", "offset", "id", "tail", "stub", "long"])
def test_frames_out_of_step_are_refused_with_what_is_wrong(bad, why):
    with pytest.raises(LogFetchError, match=why) as refused:
        frames_to_batch(bad, "t", "127.0.0.1:4150")
    assert "nsqd 127.0.0.1:4150" in str(refused.value) and "\n" not in str(refused.value)


def test_the_schema_is_the_streaming_sources_plus_the_offset():
    assert OFFSET_ARROW_SCHEMA == pa.schema([*ARROW_STREAM_SCHEMA, pa.field("offset", pa.int64())])
    assert OFFSET_ARROW_SCHEMA.names[-1] == "offset" and OFFSET_ARROW_SCHEMA.field("offset").type == pa.int64()
    assert OFFSET_SCHEMA_DDL == STREAM_SCHEMA_DDL + ", offset long"


def test_the_format_and_the_fetcher_import_neither_client_nor_snapshot_code():
    # Spark starts the driver's source process afresh for every streaming query: what
    # these two import is paid at every query's start, so the NSQ client (Twisted), the
    # snapshot reader (LMDB) and pandas stay out until a read needs them.
    code = ("import sys, spark_bridge.datasource, spark_bridge.log_fetch; "
            "print(sorted(m for m in ('twisted', 'lmdb', 'pandas', 'spark_bridge.records', "
            "'spark_bridge.stream_source') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def test_a_workers_heap_is_frozen_once_at_its_first_read():
    # Spark's Python worker collects garbage after every task: what the process held at its
    # first read (its imports) is frozen then, never again, so later tasks' objects stay collectable.
    code = ("import gc; from spark_bridge.log_fetch import freeze_worker_heap; "
            "assert gc.get_freeze_count() == 0; freeze_worker_heap(); frozen = gc.get_freeze_count(); "
            "later = [[] for _ in range(1000)]; freeze_worker_heap(); "
            "print(frozen > 1000, gc.get_freeze_count() == frozen)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["True", "True"]


def test_brokers_and_errors_survive_pickling_as_spark_sends_them():
    broker = BrokerLog("10.0.0.1:4150", "10.0.0.1:4151", tls=True, secret="s3cret")
    assert pickle.loads(pickle.dumps(broker)) == broker
    out = pickle.loads(pickle.dumps(OffsetOutOfRange("gone", 5, 10, 20)))
    assert (str(out), out.offset, out.earliest, out.latest) == ("gone", 5, 10, 20)
    moved = pickle.loads(pickle.dumps(EpochChanged("moved", 1, 2)))
    assert (str(moved), moved.expected, moved.found) == ("moved", 1, 2)
    assert isinstance(moved, LogFetchError)


# -- HTTP against scripted answers ------------------------------------------------------------------

Script = Callable[[int, int, str], "bytes | tuple[bytes, bool] | None"]


@contextmanager
def scripted(script: Script) -> Iterator[list[str]]:
    """A server on 127.0.0.1 answering request r of connection c with `script(c, r, request_line)`.

    None closes the connection without an answer, (bytes, True) after
    those bytes (an answer cut short, as the broker cuts one). Yields the request
    lines received (the server's address is the list's `address`).
    """
    listener = socket.create_server(("127.0.0.1", 0))
    seen = _Seen()
    seen.address = f"127.0.0.1:{listener.getsockname()[1]}"

    def serve(conn: socket.socket, c: int) -> None:
        with conn, conn.makefile("rb") as reader:
            r = 0
            while True:
                line = reader.readline().decode().rstrip("\r\n")
                if not line:
                    return
                head = [line]
                while (header := reader.readline()) not in (b"\r\n", b""):
                    head.append(header.decode().rstrip("\r\n"))
                seen.append(line)
                seen.headers.append(head[1:])
                answer = script(c, r, line)
                r += 1
                if answer is None:
                    return
                data, close = answer if isinstance(answer, tuple) else (answer, False)
                conn.sendall(data)
                if close:
                    return

    def accept() -> None:
        c = 0
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn, c), daemon=True).start()
            c += 1

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield seen
    finally:
        listener.close()


class _Seen(list):
    address = ""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[list[str]] = []


def answer(status: str, body: bytes, headers: dict[str, str] | None = None,
           length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body) if length is None else length}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def frames_answer(recs: list[tuple[int, bytes]], epoch: int = 7, earliest: int = 0, latest: int = 100,
                  cut: int = 0, nxt: int | None = None) -> bytes:
    body = frame_records([(o, 1_700_000_000_000_000_000 + o, b"%016x" % o + data) for o, data in recs])
    if nxt is None:
        nxt = recs[-1][0] + 1 if recs else 0
    return answer("200 OK", body[:len(body) - cut], {
        "Content-Type": "application/vnd.mqd.log-frames", "X-Mqd-Epoch": str(epoch),
        "X-Mqd-Next-Offset": str(nxt), "X-Mqd-Earliest": str(earliest), "X-Mqd-Latest": str(latest)},
        length=len(body))


def json_answer(status: str, data: dict) -> bytes:
    return answer(status, json.dumps(data).encode(), {"Content-Type": "application/json; charset=utf-8"})


def broker_at(server: _Seen, **kw) -> BrokerLog:
    return BrokerLog("127.0.0.1:4150", server.address, timeout=5, **kw)


def offsets_read(batches) -> list[int]:
    return [o for b in batches for o in b.column("offset").to_pylist()]


def test_a_range_is_read_in_answers_on_one_connection_and_stops_at_its_end():
    def script(c, r, line):
        start = int(line.split("offset=")[1].split("&")[0])
        return frames_answer([(o, b"x") for o in range(start, min(start + 3, 10))])

    with scripted(script) as seen:
        batches = list(read_batches(broker_at(seen, secret="s3cret"), "t", 2, 10, max_rows=2))
    assert offsets_read(batches) == list(range(2, 10))
    assert [b.num_rows for b in batches] == [2, 1, 2, 1, 2]
    assert [line.split("?")[1].split(" ")[0] for line in seen] == [
        "topic=t&offset=2&max_messages=8&max_bytes=16777216",
        "topic=t&offset=5&max_messages=5&max_bytes=16777216",
        "topic=t&offset=8&max_messages=2&max_bytes=16777216"]
    assert all("Authorization: Bearer s3cret" in h for h in seen.headers)


def test_an_idle_connection_the_broker_closed_is_asked_again_once():
    def script(c, r, line):
        if c == 0 and r == 1:
            return None  # the broker closed the kept-alive connection
        start = int(line.split("offset=")[1].split("&")[0])
        return frames_answer([(start, b"x")])

    with scripted(script) as seen:
        assert offsets_read(read_batches(broker_at(seen), "t", 0, 3)) == [0, 1, 2]
    assert len(seen) == 4


def test_an_answer_cut_short_is_asked_again_and_the_416_that_follows_raised():
    def script(c, r, line):
        if c == 0:
            return frames_answer([(0, b"abc"), (1, b"def")], cut=2), True
        return json_answer("416 Requested Range Not Satisfiable",
                           {"message": "OFFSET_OUT_OF_RANGE", "earliest": 40, "latest": 100})

    with scripted(script) as seen, pytest.raises(OffsetOutOfRange) as gone:
        list(read_batches(broker_at(seen), "t", 0, 10))
    assert (gone.value.offset, gone.value.earliest, gone.value.latest) == (0, 40, 100)
    assert "offset 0 is out of range for topic t on nsqd 127.0.0.1:4150" in str(gone.value)


def test_the_first_answers_epoch_must_stay_and_a_given_one_must_match():
    def script(c, r, line):
        return frames_answer([(r, b"x")], epoch=7 if r == 0 else 8)

    with scripted(script) as seen:
        with pytest.raises(EpochChanged) as moved:
            list(read_batches(broker_at(seen), "t", 0, 5))
        assert (moved.value.expected, moved.value.found) == (7, 8)
        with pytest.raises(EpochChanged, match="epoch 7, not 3"):
            list(read_batches(broker_at(seen), "t", 0, 5, epoch=3))


def test_a_log_ending_before_the_range_does_is_read_to_its_end_then_out_of_range():
    def script(c, r, line):
        start = int(line.split("offset=")[1].split("&")[0])
        return frames_answer([(o, b"x") for o in range(start, min(start + 3, 4))], latest=4, nxt=min(start + 3, 4))

    got = []
    with scripted(script) as seen, pytest.raises(OffsetOutOfRange) as short:
        for batch in read_batches(broker_at(seen), "t", 0, 6):
            got.extend(batch.column("offset").to_pylist())
    assert got == [0, 1, 2, 3]
    assert (short.value.offset, short.value.earliest, short.value.latest) == (4, 0, 4)
    assert "offsets 4 to 5 of topic t on nsqd 127.0.0.1:4150" in str(short.value)
    assert "ends before them (earliest 0, latest 4), though it was planned to reach offset 6" in str(short.value)


@pytest.mark.parametrize(("recs", "nxt"), [
    ([(1, b"x")], 2),            # not the offset asked
    ([(0, b"x"), (2, b"x")], 2),  # a gap, though the count and the next offset agree
    ([(0, b"x")], 3),            # a next offset past the records
    ([], 0),                     # nothing, though the log has more
    ([(o, b"x") for o in range(6)], 6),  # past the end asked
])
def test_records_other_than_asked_are_refused(recs, nxt):
    with scripted(lambda c, r, line: frames_answer(recs, nxt=nxt)) as seen:
        with pytest.raises(LogFetchError, match="from offset 0 with other records than asked"):
            list(read_batches(broker_at(seen), "t", 0, 5))


@pytest.mark.parametrize(("reply", "error", "words"), [
    (json_answer("400 Bad Request", {"message": "RETENTION_OFF"}), RetentionOff,
     "retention is off for it (turn it on with the broker's --retention-time / --retention-bytes, "
     "or POST /topic/retention)"),
    (json_answer("404 Not Found", {"message": "TOPIC_NOT_FOUND"}), TopicMissing, "no such topic"),
    (json_answer("401 Unauthorized", {"message": "AUTH_REQUIRED"}), Refused,
     "answered 401 Unauthorized (AUTH_REQUIRED): it requires a secret (option auth_secret)"),
    (json_answer("403 Forbidden", {"message": "UNAUTHORIZED"}), Refused,
     "answered 403 Forbidden (UNAUTHORIZED): the secret has no grant"),
    (json_answer("500 Internal Server Error", {"message": "INTERNAL_ERROR"}), Unreachable,
     "answered 500 INTERNAL_ERROR"),
    (answer("404 Not Found", b"404 page not found\n"), LogFetchError, "it does not keep retained logs"),
    (answer("200 OK", b"{}", {"Content-Type": "application/json"}), LogFetchError,
     "200 with Content-Type application/json: it does not keep retained logs"),
    (answer("200 OK", b"", {"Content-Type": "application/vnd.mqd.log-frames"}), LogFetchError,
     "without its X-Mqd-Epoch"),
    (answer("416 Requested Range Not Satisfiable", b"", {"X-Mqd-Earliest": "3", "X-Mqd-Latest": "9"}),
     OffsetOutOfRange, "earliest 3, latest 9"),
])
def test_each_refusal_is_its_own_error_in_one_line_naming_broker_and_topic(reply, error, words):
    with scripted(lambda c, r, line: reply) as seen:
        with pytest.raises(error) as raised:
            list(read_batches(broker_at(seen), "orders", 0, 5))
    text = str(raised.value)
    assert type(raised.value) is error and words in text and "\n" not in text
    assert "orders" in text and "127.0.0.1:4150" in text and seen.address in text


def test_a_broker_that_cannot_be_reached_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
    with pytest.raises(Unreachable, match=f"topic t on nsqd n:1 .http {address}.: /topic/read: "):
        list(read_batches(BrokerLog("n:1", address, timeout=5), "t", 0, 1))


def test_a_broker_that_never_answers_is_unreachable_after_the_timeout():
    with scripted(lambda c, r, line: b"") as seen:
        with pytest.raises(Unreachable, match="no answer within 0.3s"):
            log_offsets(BrokerLog("n:1", seen.address, timeout=0.3), "t")


def test_offsets_are_read_with_the_offset_of_a_time():
    body = {"topic": "t", "epoch": 2**62, "earliest": 5, "latest": 50, "retained_bytes": 1234,
            "oldest_timestamp": 1_700_000_000_000, "offset_for_timestamp": 17, "kept": True,
            "retention": {"time_ms": 0, "bytes": 10}}
    with scripted(lambda c, r, line: json_answer("200 OK", body)) as seen:
        got = log_offsets(broker_at(seen), "t", timestamp_ms=1_700_000_000_500)
        plain = log_offsets(broker_at(seen), "t")
    assert (got.epoch, got.earliest, got.latest, got.offset_for_timestamp, got.retained_bytes,
            got.oldest_timestamp) == (2**62, 5, 50, 17, 1234, 1_700_000_000_000)
    assert plain.offset_for_timestamp is None
    assert seen[0].startswith("GET /topic/offsets?topic=t&timestamp=1700000000500 ")


@pytest.mark.parametrize(("body", "why"), [
    ({"epoch": "7", "earliest": 0, "latest": 0, "retained_bytes": 0}, "epoch is not an integer"),
    ({"epoch": 7, "earliest": -1, "latest": 0, "retained_bytes": 0}, "earliest is negative"),
    ({"epoch": 7, "earliest": 0, "latest": 0, "retained_bytes": 0, "kept": False}, "--backend dummy"),
])
def test_offsets_answers_that_are_not_a_logs_are_refused(body, why):
    with scripted(lambda c, r, line: json_answer("200 OK", body)) as seen:
        with pytest.raises(LogFetchError, match=why):
            log_offsets(broker_at(seen), "t")


def test_nothing_is_asked_for_an_empty_range_and_bad_arguments_fail_at_once():
    unused = BrokerLog("n:1", "127.0.0.1:1")
    assert list(read_batches(unused, "t", 5, 5)) == []
    with pytest.raises(ValueError):
        list(read_batches(unused, "t", 6, 5))
    with pytest.raises(ValueError):
        list(read_batches(unused, "t", 0, 5, max_rows=0))
    with pytest.raises(ValueError):
        log_offsets(unused, "t", timestamp_ms=-1)
    with pytest.raises(LogFetchError, match="printable ASCII"):
        log_offsets(BrokerLog("n:1", "127.0.0.1:1", secret="two words"), "t")
