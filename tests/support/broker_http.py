"""HTTP calls to a real broker that the snapshot tests make: create queues, publish, read /stats.

Over http.client with a long timeout: a snapshot of a big store takes a while.
"""

from __future__ import annotations

import http.client
import json


def create(broker, topic: str, channel: str) -> None:
    assert call(broker, "POST", f"/topic/create?topic={topic}")[0] == 200
    assert call(broker, "POST", f"/channel/create?topic={topic}&channel={channel}")[0] == 200


def call(broker, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(broker.http_host, broker.http_port, timeout=30)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def publish(broker, topic: str, n: int, start: int = 0) -> None:
    body = b"\n".join(b'{"n": %d}' % i for i in range(start, start + n))
    status, text = call(broker, "POST", f"/mpub?topic={topic}", body)
    assert status == 200, text


def queue_stats(broker) -> dict[str, dict]:
    """/stats of every topic and channel, by queue name (`topic` or `topic:channel`)."""
    status, text = call(broker, "GET", "/stats?format=json")
    assert status == 200
    out = {}
    for topic in json.loads(text)["topics"]:
        out[topic["topic_name"]] = topic
        for channel in topic["channels"]:
            out[f"{topic['topic_name']}:{channel['channel_name']}"] = channel
    return out
