"""The streaming source's write-ahead log: files that give back exactly the rows written.

A batch written by `WalDirectory.write` and read back, sliced as Spark's
tasks get it and turned into Arrow by `rows_of`, must give each message's
id, body (empty and binary ones too), attempts, publish time (microseconds,
UTC) and broker address; a damaged or cut file must fail with a WalError
naming it, never decode to other rows.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqd.client.message import Message
from spark_bridge.stream_source import ARROW_STREAM_SCHEMA, rows_of
from spark_bridge.stream_wal import (
    WalDirectory,
    WalError,
    decode_batch,
    encode_batch,
    lost_offsets,
)

TOPIC, CHANNEL = "events", "spark"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_BROKERS = ["127.0.0.1:4150", "10.0.0.2:4150", "nsqd-3.example:14150"]

_message = st.builds(
    lambda broker, id, body, attempts, ts: Message(id, body, ts, attempts, _BROKERS[broker]),
    broker=st.integers(0, len(_BROKERS) - 1),
    id=st.text("0123456789abcdef", min_size=16, max_size=16).map(str.encode),
    body=st.one_of(st.just(b""), st.binary(max_size=64), st.binary(min_size=200, max_size=2000)),
    attempts=st.integers(1, 65535),
    # nanoseconds since the epoch, up to the year 2100; some not a whole microsecond
    ts=st.integers(0, 4_102_444_800 * 10**9),
)


def _expected(m: Message) -> dict:
    return {"topic": TOPIC, "channel": CHANNEL, "message_id": m.id.decode(),
            "timestamp": EPOCH + timedelta(microseconds=m.timestamp // 1000),
            "attempts": m.attempts, "body": m.body, "nsqd": m.nsqd_address}


def _rows(value: tuple) -> list[dict]:
    out = []
    for batch in rows_of(value):
        assert batch.schema == ARROW_STREAM_SCHEMA
        out.extend(batch.to_pylist())
    return out


def _messages(n: int) -> list[Message]:
    return [Message(f"{i:016x}".encode(), b"body %d" % i, 1_700_000_000_000_000_000 + i, 1,
                    _BROKERS[i % 2]) for i in range(n)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_message, max_size=40), start=st.integers(0, 10**12),
       cuts=st.lists(st.integers(0, 40), max_size=4))
def test_a_batch_read_back_and_sliced_gives_exactly_the_rows_written(tmp_path_factory, messages,
                                                                       start, cuts):
    wal = WalDirectory(tmp_path_factory.mktemp("ckpt"), TOPIC, CHANNEL)
    end = wal.write(start, messages)
    assert end == start + len(messages)
    assert wal.spans() == [(start, end)]
    batch = wal.read(start, end)
    assert (batch.topic, batch.channel, batch.start, batch.end) == (TOPIC, CHANNEL, start, end)
    assert len(batch) == len(messages)
    assert batch.keys() == [(m.nsqd_address, m.id) for m in messages]
    # brokers are stored once each, in order of first appearance
    assert list(batch.brokers) == list(dict.fromkeys(m.nsqd_address for m in messages))

    # Spark's tasks get contiguous slices; together they are the batch, in order.
    bounds = sorted({0, len(messages), *(min(c, len(messages)) for c in cuts)})
    rows = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        rows.extend(_rows(batch.slice(lo, hi)))
    assert rows == [_expected(m) for m in messages]
    assert _rows(batch.slice(0, 0)) == []


@settings(max_examples=100, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=10), start=st.integers(0, 10**6))
def test_encoded_bytes_decode_to_the_same_batch(messages, start):
    data = encode_batch(TOPIC, CHANNEL, start, messages)
    batch = decode_batch(data)
    assert batch.keys() == [(m.nsqd_address, m.id) for m in messages]
    assert _rows(batch.slice(0, len(batch))) == [_expected(m) for m in messages]
    assert encode_batch(TOPIC, CHANNEL, start, messages) == data  # deterministic


def test_rows_of_a_large_batch_come_in_several_arrow_batches_with_every_row(tmp_path):
    messages = _messages(40_000)
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    wal.write(0, messages)
    batch = wal.read(0, 40_000)
    parts = list(rows_of(batch.slice(0, len(batch))))
    assert [len(p) for p in parts] == [32_768, 40_000 - 32_768]
    ids = [i for p in parts for i in p.column("message_id").to_pylist()]
    assert ids == [m.id.decode() for m in messages]


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=5), data=st.data())
def test_any_damaged_or_cut_batch_is_refused_with_a_wal_error(messages, data):
    good = encode_batch(TOPIC, CHANNEL, 0, messages)
    if data.draw(st.booleans(), label="cut"):
        bad = good[:data.draw(st.integers(0, len(good) - 1), label="length")]
    else:
        at = data.draw(st.integers(0, len(good) - 1), label="at")
        flip = data.draw(st.integers(1, 255), label="xor")
        bad = good[:at] + bytes([good[at] ^ flip]) + good[at + 1:]
    with pytest.raises(WalError, match=r"^mqd: where/it\.wal (is damaged|is not a complete)"):
        decode_batch(bad, "where/it.wal")


def test_a_damaged_file_on_disk_names_itself_and_says_damaged(tmp_path):
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    wal.write(0, _messages(3))
    path = wal.path / f"batch-{0:020d}-{3:020d}.wal"
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WalError, match="is damaged \\(checksum mismatch\\)") as e:
        wal.read(0, 3)
    assert str(path) in str(e.value)

    path.write_bytes(bytes(data[:-20]))
    with pytest.raises(WalError, match="is not a complete write-ahead batch"):
        wal.read(0, 3)


def test_a_missing_batch_is_a_wal_error_naming_the_offsets_and_directory(tmp_path):
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    with pytest.raises(WalError, match="has no batch 5-9 under") as e:
        wal.read(5, 9)
    assert str(wal.path) in str(e.value)


def test_offsets_the_wal_lost_say_what_happened_and_how_to_start_afresh(tmp_path):
    text = str(lost_offsets(tmp_path / "mqd-source", 0, 1000))
    assert text.startswith(f"mqd: the write-ahead log under {tmp_path / 'mqd-source'} does not hold "
                           "offsets 0-1000, which the query's checkpoint has already read")
    assert "mqd-source directory was lost or altered" in text
    assert "To start afresh on purpose, run the query with a new checkpointLocation" in text
    assert "\n" not in text  # one line, as the source's other errors


def test_a_file_holding_another_span_is_refused(tmp_path):
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    wal.write(0, _messages(3))
    os.rename(wal.path / f"batch-{0:020d}-{3:020d}.wal", wal.path / f"batch-{3:020d}-{6:020d}.wal")
    with pytest.raises(WalError, match="does not hold batch 3-6 of this topic/channel"):
        wal.read(3, 6)


def test_a_batch_file_of_another_topic_is_refused(tmp_path):
    other = WalDirectory(tmp_path / "a", "other", CHANNEL)
    other.write(0, _messages(2))
    wal = WalDirectory(tmp_path / "b", TOPIC, CHANNEL)
    name = f"batch-{0:020d}-{2:020d}.wal"
    (wal.path / name).write_bytes((other.path / name).read_bytes())
    with pytest.raises(WalError, match="does not hold batch 0-2 of this topic/channel"):
        wal.read(0, 2)


@pytest.mark.parametrize("topic, channel", [("other", CHANNEL), (TOPIC, "other")])
def test_a_checkpoint_is_never_opened_for_another_topic_or_channel(tmp_path, topic, channel):
    WalDirectory(tmp_path, TOPIC, CHANNEL).write(0, _messages(1))
    with pytest.raises(WalError) as e:
        WalDirectory(tmp_path, topic, channel)
    text = str(e.value)
    assert f"belongs to topic {TOPIC!r} channel {CHANNEL!r}" in text
    assert f"not topic {topic!r} channel {channel!r}" in text
    assert "its own checkpointLocation" in text
    # and the same topic/channel still opens it, batch intact
    assert WalDirectory(tmp_path, TOPIC, CHANNEL).spans() == [(0, 1)]


def test_a_damaged_identity_file_is_a_wal_error(tmp_path):
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    (wal.path / "source.json").write_bytes(b"{not json")
    with pytest.raises(WalError, match="source.json is damaged"):
        WalDirectory(tmp_path, TOPIC, CHANNEL)


def test_the_committed_offset_survives_reopening(tmp_path):
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    assert wal.committed() == 0
    wal.set_committed(42)
    assert wal.committed() == 42
    wal.set_committed(10**15)
    assert WalDirectory(tmp_path, TOPIC, CHANNEL).committed() == 10**15


@pytest.mark.parametrize("content", [b"", b"{", b"{}", b'{"offset": "x"}', b"[1]"])
def test_a_damaged_committed_marker_is_a_wal_error(tmp_path, content):
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    (wal.path / "committed").write_bytes(content)
    with pytest.raises(WalError, match="committed is damaged"):
        wal.committed()


def test_writes_cut_short_by_a_crash_are_removed_on_open_and_never_listed(tmp_path):
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    wal.write(0, _messages(2))
    wal.set_committed(2)
    stale = [wal.path / f".batch-{2:020d}-{4:020d}.wal.4242.tmp", wal.path / ".committed.17.tmp"]
    for path in stale:
        path.write_bytes(b"half a write")
    (wal.path / "batch-2-4.wal").write_bytes(b"not a batch name")  # foreign names are ignored
    assert wal.spans() == [(0, 2)]
    reopened = WalDirectory(tmp_path, TOPIC, CHANNEL)
    assert not any(path.exists() for path in stale)
    assert reopened.spans() == [(0, 2)]
    assert reopened.committed() == 2
    assert len(reopened.read(0, 2)) == 2
    assert not list(reopened.path.glob("*.tmp")) and not list(reopened.path.glob(".*.tmp"))


def test_spans_are_listed_in_offset_order_and_removed_ones_vanish(tmp_path):
    wal = WalDirectory(tmp_path, TOPIC, CHANNEL)
    at = 0
    for n in (3, 1, 7, 2):  # 0-3, 3-4, 4-11, 11-13: 11 sorts before 4 as text, not as offset
        at = wal.write(at, _messages(n))
    assert wal.spans() == [(0, 3), (3, 4), (4, 11), (11, 13)]
    wal.remove(3, 4)
    wal.remove(3, 4)  # twice is harmless
    assert wal.spans() == [(0, 3), (4, 11), (11, 13)]
    assert not list(wal.path.glob(".*.tmp"))
