"""A topic's retained log on a real twistd mqd with the default store (LMDB): read, restarted, deleted.

Retention is turned on for one topic by its override (`POST
/topic/retention`), so the same run shows the override kept in nsqd.dat
across a restart. A read larger than one chunk goes through the pull
producer on the real reactor.
"""

from __future__ import annotations

import base64
import json
import urllib.request

import pytest

from mqd.wire.log_frames import FRAME_OVERHEAD, iter_frames
from tests.support.processes import NO_PROXY, http_request
from tests.support.raw_conn import RawConn, command

pytestmark = pytest.mark.slow


def call(broker, method: str, path: str, body: bytes | None = None):
    status, raw = http_request(broker.http_address, method, path, body)
    return status, raw


def get_json(broker, path: str):
    status, raw = call(broker, "GET", path)
    return status, json.loads(raw)


def read_binary(broker, path: str):
    """(headers, frames) of a binary /topic/read, headers by lower-case name."""
    with NO_PROXY.open(urllib.request.Request(f"http://{broker.http_address}{path}"), timeout=15) as r:
        assert r.status == 200
        headers = {k.lower(): v for k, v in r.getheaders()}
        body = r.read()
    assert int(headers["content-length"]) == len(body)
    return headers, list(iter_frames(body))


def test_retained_log_on_lmdb_survives_a_restart_and_a_deleted_topic_starts_a_new_epoch(twistd_broker, name):
    broker = twistd_broker
    topic = name()
    assert broker.post(f"/topic/create?topic={topic}") == 200
    status, raw = call(broker, "POST", f"/topic/retention?topic={topic}&time=1h", b"")
    assert (status, json.loads(raw)) == (200, {"topic": topic, "time": "1h0m0s", "bytes": 0,
                                               "time_ms": 3_600_000, "overridden": True})

    small = [b"m%d" % i for i in range(10)]
    big = [b"%04d" % i * 512 for i in range(300)]  # 2 KiB each: a read of several chunks
    assert call(broker, "POST", f"/mpub?topic={topic}", b"\n".join(small))[0] == 200
    for chunk in range(0, 300, 100):
        assert call(broker, "POST", f"/mpub?topic={topic}", b"\n".join(big[chunk:chunk + 100]))[0] == 200

    status, offsets = get_json(broker, f"/topic/offsets?topic={topic}")
    assert status == 200
    epoch = offsets["epoch"]
    assert (offsets["earliest"], offsets["latest"], offsets["kept"]) == (0, 310, True)
    assert offsets["retention"] == {"time_ms": 3_600_000, "bytes": 0}
    assert offsets["oldest_timestamp"] is not None and offsets["retained_bytes"] > 300 * 2048

    headers, frames = read_binary(broker, f"/topic/read?topic={topic}&offset=earliest&max_messages=1000"
                                          f"&max_bytes=10485760")
    assert headers["content-type"] == "application/vnd.mqd.log-frames"
    assert (headers["x-mqd-epoch"], headers["x-mqd-next-offset"], headers["x-mqd-earliest"],
            headers["x-mqd-latest"]) == (str(epoch), "310", "0", "310")
    assert [f[0] for f in frames] == list(range(310))
    assert [f[4] for f in frames] == small + big
    assert sum(FRAME_OVERHEAD + 16 + len(f[4]) for f in frames) == int(headers["content-length"])

    status, answer = get_json(broker, f"/topic/read?topic={topic}&offset=8&max_messages=3&format=json")
    assert status == 200 and answer["next_offset"] == 11 and answer["epoch"] == epoch
    assert [(m["offset"], base64.b64decode(m["body"])) for m in answer["messages"]] == [
        (8, b"m8"), (9, b"m9"), (10, big[0])]
    assert answer["messages"][0]["id"] == frames[8][3].decode()

    status, raw = call(broker, "GET", f"/topic/read?topic={topic}&offset=311")
    assert (status, json.loads(raw)) == (416, {"message": "OFFSET_OUT_OF_RANGE", "earliest": 0, "latest": 310})

    # IDENTIFY names the HTTP port.
    with RawConn(broker) as conn:
        conn.send(command("IDENTIFY", json.dumps({"feature_negotiation": True}).encode()))
        frame_type, payload = conn.read_frame()
        assert frame_type == 0 and json.loads(payload)["http_port"] == broker.http_port

    broker.restart()
    status, again = get_json(broker, f"/topic/offsets?topic={topic}")
    assert (status, again["epoch"], again["earliest"], again["latest"]) == (200, epoch, 0, 310)
    assert get_json(broker, f"/topic/retention?topic={topic}")[1]["overridden"] is True
    [entry] = [t for t in broker.metadata()["topics"] if t["name"] == topic]
    assert entry["retention"] == {"time_ms": 3_600_000, "bytes": 0}
    _, frames_again = read_binary(broker, f"/topic/read?topic={topic}&offset=300")
    assert [(f[0], f[3], f[4]) for f in frames_again] == [(f[0], f[3], f[4]) for f in frames[300:]]
    assert call(broker, "POST", f"/pub?topic={topic}", b"after")[0] == 200
    assert get_json(broker, f"/topic/offsets?topic={topic}")[1]["latest"] == 311

    assert broker.post(f"/topic/delete?topic={topic}") == 200
    assert broker.post(f"/topic/create?topic={topic}") == 200
    status, raw = call(broker, "GET", f"/topic/offsets?topic={topic}")
    assert (status, json.loads(raw)) == (400, {"message": "RETENTION_OFF"})  # the override went with the topic
    assert call(broker, "POST", f"/topic/retention?topic={topic}&bytes=1GB", b"")[0] == 200
    assert call(broker, "POST", f"/pub?topic={topic}", b"new life")[0] == 200
    status, fresh = get_json(broker, f"/topic/offsets?topic={topic}")
    assert fresh["epoch"] != epoch and (fresh["earliest"], fresh["latest"]) == (0, 1)
    broker.stop_cleanly()
