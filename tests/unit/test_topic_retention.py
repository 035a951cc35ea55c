"""A topic's retention in the broker: its log opened and deleted, appended before the fan-out, expired, kept in nsqd.dat.

An in-process broker on a task.Clock (the memory store, or LMDB where a
restart must keep the log). /stats, /metrics and IDENTIFY show what the
broker settled, and show nothing new for a topic that does not retain.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from twisted.logger import globalLogPublisher

from backends import BackendError
from backends.memory_log import MemoryLog
from mqd.message import Message
from mqd.nsqd.broker import EXPIRY_INTERVAL
from mqd.nsqd.metadata import METADATA_FILE
from mqd.nsqd.stats import stats_json
from mqd.nsqd.topic import RETENTION_OFF, Retention
from tests.support.http_client import HTTPClient, error
from tests.support.inprocess_broker import START_TIME, new_broker
from tests.support.v2_client import Client
from tests.support.v2_frames import err, identify, ok, pub

NS = 1_000_000_000


def read_meta(path) -> dict:
    return json.loads((path / METADATA_FILE).read_bytes())


def kept(topic) -> list[tuple[int, int, bytes]]:
    """(offset, timestamp, id + body) of every record the topic's log keeps."""
    return topic.log.read(topic.log.earliest(), 1000, 1 << 30)


def records(topic) -> list[tuple[int, bytes]]:
    """(offset, body) of every record the topic's log keeps."""
    return [(at, data[16:]) for at, _, data in kept(topic)]


def refusing(monkeypatch, method: str, names: set[str]) -> None:
    """MemoryLog.`method` raises BackendError for the logs of topics `names`, as a failing store would."""
    real = getattr(MemoryLog, method)

    def refuse(self, *args, **kwargs):
        if self.name in names:
            raise BackendError("disk full")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MemoryLog, method, refuse)


# -- which topics retain -------------------------------------------------------------------------


def test_without_retention_a_topic_has_no_log(inproc_broker):
    topic = inproc_broker.topic("t")
    assert topic.log is None
    assert topic.retention == RETENTION_OFF and not topic.retention.on


def test_the_broker_options_give_every_topic_a_log(make_broker):
    broker = make_broker(retention_time="1h", retention_bytes="1MB")
    topic = broker.topic("t")
    assert topic.retention == Retention(3600.0, 1_000_000, False)
    assert topic.log is not None and topic.log.name == "t"


def test_an_ephemeral_topic_never_retains(make_broker):
    broker = make_broker(retention_bytes="1MB")
    topic = broker.topic("t#ephemeral")
    assert topic.log is None and topic.retention == RETENTION_OFF
    with pytest.raises(ValueError, match="ephemeral"):
        broker.set_retention(topic, 60.0, 1000)
    assert topic.log is None


# -- publishing ------------------------------------------------------------------------------------


def test_a_publish_is_appended_in_order_and_still_reaches_the_channels(make_broker):
    broker = make_broker(retention_bytes="1MB")
    topic = broker.topic("t")
    channel = topic.channel("c")
    topic.publish([b"a"])
    topic.publish([b"b", b"c"])
    topic.publish([b"d"], defer=5.0)
    assert records(topic) == [(0, b"a"), (1, b"b"), (2, b"c"), (3, b"d")]
    assert [ts for _, ts, _ in kept(topic)] == [int(START_TIME * NS)] * 4
    assert (channel.depth(), channel.deferred_count()) == (3, 1)
    # A record is the message as published: its id, timestamp and body.
    queued = [m for piece in channel.peek_queued(10, 100) for m, _ in piece]
    assert [d for _, _, d in kept(topic)[:3]] == [m.data for m in queued]


def test_a_refused_append_fails_the_publish_before_any_channel_sees_it(make_broker, monkeypatch):
    broker = make_broker(retention_bytes="1MB")
    topic = broker.topic("t")
    channel = topic.channel("c")
    refusing(monkeypatch, "append", {"t"})
    with pytest.raises(BackendError):
        topic.publish([b"a", b"b"])
    with pytest.raises(BackendError):
        topic.publish([b"a"])
    assert (channel.depth(), topic.depth(), topic.message_count) == (0, 0, 0)
    assert topic.log.latest() == 0


def test_a_refused_append_is_e_pub_failed_and_a_500(make_broker, monkeypatch):
    broker = make_broker(retention_bytes="1MB")
    broker.topic("t")
    refusing(monkeypatch, "append", {"t"})
    c = Client(broker)
    c.send(identify(heartbeat_interval=-1))
    assert c.read() == [ok()]
    assert c.request(pub("t", b"x")) == [err("E_PUB_FAILED PUB failed disk full")]
    http = HTTPClient(broker)
    assert error(http.post("/pub?topic=t", b"x")) == (500, "INTERNAL_ERROR")
    assert error(http.post("/mpub?topic=t", b"x\ny")) == (500, "INTERNAL_ERROR")
    assert broker.topic("t").message_count == 0


# -- the override -------------------------------------------------------------------------------------


def test_an_override_turns_retention_on_and_off(make_broker):
    broker = make_broker(backend="lmdb")
    topic = broker.topic("t")
    assert broker.set_retention(topic, 60.0, None) == Retention(60.0, 0, True)
    first = topic.log
    topic.publish([b"a"])
    assert broker.set_retention(topic, None, 1000) == Retention(60.0, 1000, True)
    assert topic.log is first  # bounds changed, same log
    assert broker.set_retention(topic, 0.0, 0) == Retention(0.0, 0, True)
    assert topic.log is None and broker.store.log_names() == []
    broker.set_retention(topic, 60.0, None)
    assert topic.log is not first and topic.log.latest() == 0 and topic.log.epoch != first.epoch
    broker.close()


def test_default_drops_the_override(make_broker):
    broker = make_broker(retention_bytes="1MB")
    topic = broker.topic("t")
    broker.set_retention(topic, 0.0, 0)
    assert topic.log is None
    assert broker.set_retention(topic, default=True) == Retention(0.0, 1_000_000, False)
    assert topic.log is not None


def test_the_memory_store_refuses_a_time_bound_alone(inproc_broker):
    topic = inproc_broker.topic("t")
    with pytest.raises(ValueError, match="size bound"):
        inproc_broker.set_retention(topic, 60.0, None)
    assert topic.log is None and topic.retention == RETENTION_OFF


def test_the_override_is_kept_in_nsqd_dat_and_comes_back(tmp_path, make_broker, clock):
    broker = make_broker(backend="lmdb")
    broker.topic("t").channel("c")
    broker.topic("u")
    broker.set_retention(broker.topic("t"), 86400.0, 10**10)
    clock.advance(0)
    assert read_meta(tmp_path)["topics"] == [
        {"name": "t", "paused": False, "channels": [{"name": "c", "paused": False}],
         "retention": {"time_ms": 86_400_000, "bytes": 10**10}},
        {"name": "u", "paused": False, "channels": None},
    ]
    broker.close()
    again = new_broker(tmp_path, clock, backend="lmdb")
    assert again.topics["t"].retention == Retention(86400.0, 10**10, True)
    assert again.topics["u"].retention == RETENTION_OFF
    again.set_retention(again.topics["t"], default=True)
    clock.advance(0)
    assert "retention" not in read_meta(tmp_path)["topics"][0]
    again.close()


def test_a_malformed_retention_in_nsqd_dat_is_ignored(tmp_path, clock):
    (tmp_path / METADATA_FILE).write_text(json.dumps({"topics": [
        {"name": "t", "paused": False, "channels": None, "retention": {"time_ms": "1h", "bytes": 5}},
        {"name": "u", "paused": False, "channels": None, "retention": {"time_ms": 1000, "bytes": 0}},
    ], "version": "1.3.0"}))
    logged = []
    globalLogPublisher.addObserver(logged.append)
    try:
        broker = new_broker(tmp_path, clock)
    finally:
        globalLogPublisher.removeObserver(logged.append)
    assert broker.topics["t"].retention == RETENTION_OFF
    # Time alone on the memory store: not kept either.
    assert broker.topics["u"].retention == RETENTION_OFF
    text = " ".join(str(e.get("log_format", "")) for e in logged)
    assert "malformed retention" in text and "ignoring its retention" in text


# -- deleting ------------------------------------------------------------------------------------------


def test_deleting_a_topic_deletes_its_log_and_a_new_one_starts_a_new_life(make_broker):
    broker = make_broker(retention_bytes="1MB")
    topic = broker.topic("t")
    topic.publish([b"a", b"b"])
    first = topic.log
    assert broker.delete_topic("t")
    assert topic.log is None and broker.store.log_names() == []
    again = broker.topic("t")
    assert again.log is not first and again.log.epoch != first.epoch
    again.publish([b"c"])
    assert records(again) == [(0, b"c")]


def test_a_restart_without_retention_keeps_the_logs_and_they_continue_when_it_returns(tmp_path, make_broker, clock):
    broker = make_broker(backend="lmdb", retention_time="1h")
    kept = broker.topic("kept")
    kept.publish([b"a"])
    epoch = kept.log.epoch
    broker.topic("off").publish([b"b"])
    broker.set_retention(broker.topic("off"), 0.0, 0)
    # A log no topic claims (nsqd.dat lost, or a deletion cut short by a crash).
    broker.store.open_log("gone").append([Message(b"%016d" % 1, b"c", 1)])
    broker.close()
    # Restarted without the flags: nothing retains, nothing kept is deleted.
    again = new_broker(tmp_path, clock, backend="lmdb")
    assert again.store.log_names() == ["gone", "kept"]
    assert again.topics["kept"].log is None
    again.topics["kept"].publish([b"not kept"])
    again.close()
    # With the flags again, the log continues where it stopped: same life, next offset.
    third = new_broker(tmp_path, clock, backend="lmdb", retention_time="1h")
    log = third.topics["kept"].log
    assert (log.epoch, log.earliest(), log.latest()) == (epoch, 0, 1)
    third.topics["kept"].publish([b"d"])
    assert records(third.topics["kept"]) == [(0, b"a"), (1, b"d")]
    # Turning retention off explicitly, or deleting the topic, deletes a kept log too.
    third.set_retention(third.topics["kept"], 0.0, 0)
    third.delete_topic(third.topic("gone").name)
    assert third.store.log_names() == []
    third.close()


# -- expiry ----------------------------------------------------------------------------------------------


def test_records_older_than_the_time_bound_go_once_a_second(make_broker, clock):
    broker = make_broker(retention_time="10s", retention_bytes="1MB")
    topic = broker.topic("t")
    topic.publish([b"old"])
    clock.advance(5)
    topic.publish([b"new"])
    clock.advance(5 + EXPIRY_INTERVAL)
    assert records(topic) == [(1, b"new")]
    assert topic.log.earliest() == 1 and topic.log.latest() == 2


def test_records_past_the_size_bound_go(make_broker, clock):
    broker = make_broker(retention_bytes="100")
    topic = broker.topic("t")
    topic.publish([b"x" * 20 for _ in range(5)])
    clock.advance(EXPIRY_INTERVAL)
    assert topic.log.retained_bytes() <= 100
    assert topic.log.latest() == 5 and topic.log.earliest() > 0


def test_the_expiry_runs_only_once_a_topic_retains_and_stops_with_the_broker(inproc_broker, clock):
    inproc_broker.topic("t")
    clock.advance(10)
    before = len(clock.getDelayedCalls())
    inproc_broker.set_retention(inproc_broker.topic("t"), None, 1000)
    inproc_broker.set_retention(inproc_broker.topic("u"), None, 1000)
    clock.advance(0)  # the metadata written
    assert len(clock.getDelayedCalls()) == before + 1  # one pass for every log
    inproc_broker.close()
    assert len(clock.getDelayedCalls()) == before


def test_an_expiry_the_store_refuses_is_logged_and_the_others_go_on(make_broker, clock, monkeypatch):
    broker = make_broker(retention_bytes="10")
    bad, good = broker.topic("bad"), broker.topic("good")
    bad.publish([b"x" * 20, b"y" * 20])
    good.publish([b"x" * 20, b"y" * 20])
    refusing(monkeypatch, "expire", {"bad"})
    clock.advance(EXPIRY_INTERVAL)
    assert good.log.earliest() == 2
    clock.advance(EXPIRY_INTERVAL)  # the loop still runs
    assert bad.log.earliest() == 0


# -- what the broker shows ---------------------------------------------------------------------------------


def test_stats_show_retention_only_for_retaining_topics(inproc_broker):
    plain = inproc_broker.topic("plain")
    plain.publish([b"a"])
    before = stats_json(inproc_broker, include_mem=False)
    kept = inproc_broker.topic("kept")
    inproc_broker.set_retention(kept, 60.0, 1000)
    kept.publish([b"hello"])
    stats = stats_json(inproc_broker, include_mem=False)
    rows = {t["topic_name"]: t for t in stats["topics"]}
    assert "retention" not in rows["plain"] and "retained" not in rows["plain"]
    assert rows["plain"] == before["topics"][0]
    assert rows["kept"]["retention"] == {"time_ms": 60_000, "bytes": 1000}
    assert rows["kept"]["retained"] == {"epoch": kept.log.epoch, "earliest": 0, "latest": 1,
                                        "bytes": kept.log.retained_bytes(),
                                        "oldest_timestamp": int(START_TIME * 1000)}
    assert list(rows["kept"])[-2:] == ["retention", "retained"]


def test_metrics_show_the_retained_logs(make_broker, clock):
    broker = make_broker(retention_bytes="1MB")
    http = HTTPClient(broker)
    assert "mqd_topic_retained" not in http.get("/metrics").body.decode()
    topic = broker.topic("t")
    topic.publish([b"a", b"b"])
    broker.set_retention(broker.topic("off"), 0.0, 0)
    clock.advance(30)
    samples = {(s.name, s.labels.get("topic")): s.value
               for f in text_string_to_metric_families(http.get("/metrics").body.decode())
               for s in f.samples if s.name.startswith("mqd_")}
    assert samples == {
        ("mqd_topic_retained_earliest", "t"): 0,
        ("mqd_topic_retained_latest", "t"): 2,
        ("mqd_topic_retained_bytes", "t"): topic.log.retained_bytes(),
        ("mqd_topic_retained_oldest_age_seconds", "t"): 30.0,
    }


def test_identify_names_the_http_port_once_the_broker_knows_it(inproc_broker):
    c = Client(inproc_broker)
    [frame] = c.request(identify(feature_negotiation=True))
    assert "http_port" not in json.loads(frame.payload)  # no HTTP listener: nsqd's answer exactly
    inproc_broker.ports["HTTP"] = 4151
    c = Client(inproc_broker)
    [frame] = c.request(identify(feature_negotiation=True))
    assert json.loads(frame.payload)["http_port"] == 4151
    c = Client(inproc_broker)
    assert c.request(identify(feature_negotiation=False)) == [ok()]


def test_identify_names_the_broadcast_http_port_when_one_is_set(make_broker):
    broker = make_broker(broadcast_http_port=8080)
    broker.ports["HTTP"] = 4151
    [frame] = Client(broker).request(identify(feature_negotiation=True))
    assert json.loads(frame.payload)["http_port"] == 8080
