"""mqadmin's retained-log additions (mqd.admin.retained): the node rows' fields, and the replay action.

The fields are checked on canned /stats entries; the action through real
twisted.web over the recording fake upstream of tests/support/admin_fakes
(every URL, its headers, the notification event).
"""

from __future__ import annotations

import copy
import json

import pytest

from mqd.admin import retained
from mqd.clusterinfo.aggregate import NodeStats, channel_stats, topic_stats
from mqd.http.router import ApiSite
from tests.support.admin_fakes import N1, N2, Cluster, Dispatch, Down
from tests.support.http_client import error

HOOK = "http://hooks.example:8080/nsqadmin"
EPOCH = 6_917_529_027_641_081_857  # more than a JavaScript number holds exactly
NOW = 1_800_000_000.0


def _stats(retention: bool, replay: bool = False) -> dict:
    channel = {"channel_name": "c", "depth": 3, "backend_depth": 0, "in_flight_count": 0, "deferred_count": 0,
               "requeue_count": 0, "timeout_count": 0, "message_count": 3, "client_count": 0, "clients": [],
               "paused": False, "e2e_processing_latency": {"count": 0, "percentiles": None}}
    if replay:
        channel["replay"] = {"position": 40, "end": 100, "epoch": EPOCH, "skipped": 2}
    topic = {"topic_name": "t", "depth": 0, "backend_depth": 0, "message_count": 100, "paused": False,
             "channels": [channel], "e2e_processing_latency": {"count": 0, "percentiles": None}}
    if retention:
        topic["retention"] = {"time_ms": 86_400_000, "bytes": 0}
        topic["retained"] = {"epoch": EPOCH, "earliest": 10, "latest": 100, "bytes": 5000,
                             "oldest_timestamp": int(NOW * 1000) - 90_000}
    return {"version": "1.3.0", "topics": [topic]}


def _per_node(*stats: dict) -> list[NodeStats]:
    return [NodeStats(node, node.split(":")[0], s) for node, s in zip((N1, N2), stats, strict=False)]


def test_topic_rows_gain_the_brokers_retained_log_and_its_oldest_age():
    per_node = _per_node(_stats(True), _stats(False))
    body = topic_stats(per_node, "t", NOW)
    before = copy.deepcopy(body)
    retained.add_topic_fields(body, per_node, "t", NOW)
    rows = {r["node"]: r for r in body["nodes"]}
    assert rows[N1]["retention"] == {"time_ms": 86_400_000, "bytes": 0}
    assert rows[N1]["retained"] == {"epoch": EPOCH, "earliest": 10, "latest": 100, "bytes": 5000,
                                    "oldest_timestamp": int(NOW * 1000) - 90_000, "epoch_text": str(EPOCH),
                                    "oldest_age_ms": 90_000}
    # A broker (or a topic) without retention: its row exactly as before, nsqadmin's fields only.
    assert rows[N2] == {r["node"]: r for r in before["nodes"]}[N2]
    assert {k: v for k, v in body.items() if k != "nodes"} == {k: v for k, v in before.items() if k != "nodes"}


def test_channel_rows_gain_the_topics_retention_and_a_running_replay():
    per_node = _per_node(_stats(True, replay=True), _stats(True))
    body = channel_stats(per_node, "t", "c", NOW)
    retained.add_channel_fields(body, per_node, "t", "c")
    rows = {r["node"]: r for r in body["nodes"]}
    assert rows[N1]["replay"] == {"position": 40, "end": 100, "epoch": EPOCH, "skipped": 2}
    assert "replay" not in rows[N2] and rows[N2]["retention"]["time_ms"] == 86_400_000


def test_an_empty_log_has_no_oldest_age():
    stats = _stats(True)
    stats["topics"][0]["retained"].update(earliest=100, oldest_timestamp=None)
    per_node = _per_node(stats)
    body = topic_stats(per_node, "t", NOW)
    retained.add_topic_fields(body, per_node, "t", NOW)
    assert body["nodes"][0]["retained"]["oldest_age_ms"] is None


# -- replay ----------------------------------------------------------------------------------------


def _cluster(clock, **flags) -> Cluster:
    c = Cluster(clock, **flags)
    c.site = ApiSite(Dispatch(retained.routes(c.admin)), reactor=clock)
    return c


def _answer(start: int, end: int) -> tuple[int, bytes]:
    return 200, json.dumps({"topic": "t", "channel": "c", "epoch": EPOCH, "start": start, "end": end}).encode()


def test_replay_asks_every_producer_of_the_topic_with_the_users_secret(clock):
    c = _cluster(clock, **{"notification-http-endpoint": HOOK})
    c.upstream.answers.update({N1: _answer(3, 50), N2: _answer(0, 7)})
    r = c.request("POST", "/api/replay/t/c", {"timestamp": 1_767_323_045_000},
                  headers={"Authorization": "Bearer s3cret"})
    assert r.status == 200
    assert c.posts() == [f"http://{N1}/channel/replay?topic=t&channel=c&timestamp=1767323045000",
                         f"http://{N2}/channel/replay?topic=t&channel=c&timestamp=1767323045000"]
    assert c.upstream.headers == [{b"Authorization": [b"Bearer s3cret"]}] * 2
    body = r.json()
    assert body["message"] == "" and body["timestamp"] == 1_767_323_045_000
    assert body["results"] == [
        {"target": "nsqd", "address": N1, "path": "/channel/replay", "ok": True, "error": None,
         "epoch": EPOCH, "start": 3, "end": 50},
        {"target": "nsqd", "address": N2, "path": "/channel/replay", "ok": True, "error": None,
         "epoch": EPOCH, "start": 0, "end": 7}]
    [sent] = c.sent()
    assert (sent["action"], sent["topic"], sent["channel"]) == ("replay_channel", "t", "c")


def test_a_broker_without_retention_is_a_warning_when_another_replayed(clock):
    c = _cluster(clock)
    c.upstream.answers.update({N1: _answer(0, 5), N2: (400, b'{"message":"RETENTION_OFF"}')})
    r = c.request("POST", "/api/replay/t/c", {"timestamp": "1000"})
    assert r.status == 200
    body = r.json()
    assert [(x["address"], x["ok"], x["error"]) for x in body["results"]] == [
        (N1, True, None), (N2, False, "400 RETENTION_OFF")]
    assert body["message"] == 'WARNING: got response 400 Bad Request "{\\"message\\":\\"RETENTION_OFF\\"}"'


@pytest.mark.parametrize("answers, status", [
    ({N1: Down, N2: Down}, 502),
    ({N1: (401, b'{"message":"AUTH_REQUIRED"}'), N2: Down}, 401),
])
def test_no_broker_replaying_is_an_error_answer(clock, answers, status):
    c = _cluster(clock, **{"notification-http-endpoint": HOOK})
    c.upstream.answers.update(answers)
    code, message = error(c.request("POST", "/api/replay/t/c", {"timestamp": 5}))
    assert code == status and message.startswith("UPSTREAM_ERROR: ")
    assert c.sent() == []


@pytest.mark.parametrize("path, body, message", [
    ("/api/replay/t/c", {}, "INVALID_TIMESTAMP"),
    ("/api/replay/t/c", {"timestamp": -1}, "INVALID_TIMESTAMP"),
    ("/api/replay/t/c", {"timestamp": "soon"}, "INVALID_TIMESTAMP"),
    ("/api/replay/t/c", {"timestamp": True}, "INVALID_TIMESTAMP"),
    ("/api/replay/bad!/c", {"timestamp": 5}, "INVALID_TOPIC"),
    ("/api/replay/t/bad!", {"timestamp": 5}, "INVALID_CHANNEL"),
])
def test_replay_refuses_a_bad_request_and_asks_nobody(clock, path, body, message):
    c = _cluster(clock)
    assert error(c.request("POST", path, body)) == (400, message)
    assert c.events == []


def test_replay_is_for_admin_users_only(clock):
    c = _cluster(clock, **{"admin-user": ["dave"]})
    assert error(c.request("POST", "/api/replay/t/c", {"timestamp": 5})) == (403, "FORBIDDEN")
    assert c.posts() == []
    r = c.request("POST", "/api/replay/t/c", {"timestamp": 5}, headers={"X-Forwarded-User": "dave"})
    assert r.status == 200 and len(c.posts()) == 2


def test_replay_is_routed_by_the_admin_site(clock):
    from mqd.admin.web import default_routes

    assert "POST" in default_routes(Cluster(clock).admin)["/api/replay/:topic/:channel"].methods
