"""GET /channel/peek and /topic/peek on a real broker process, over real sockets.

A backlog is split over every place a message can be (memory queue,
backend, in flight at a raw TCP client, deferred by /pub?defer= and by a
REQ with a delay); each state is peeked and checked against what was
published and what /stats says, /stats must not move under the peeks, and
consuming everything afterwards delivers each message exactly once, in
the order peeked. Run for the default LMDB mode, --durable and the memory
backend.
"""

from __future__ import annotations

import base64
import json
import time

import pytest

from tests.support.processes import FAST_SCAN, http_request, wait_for
from tests.support.raw_conn import RawConn, command

MODES = {
    "lmdb": (),
    "durable": ("--durable",),
    "memory": ("--backend=memory",),
}
M = [b"m%d" % i for i in range(12)]


def get(broker, path: str) -> tuple[int, dict]:
    status, body = http_request(broker.http_address, "GET", path)
    return status, json.loads(body)


def peek(broker, path: str) -> dict:
    status, answer = get(broker, path)
    assert status == 200, answer
    return answer


def post(broker, path: str, body: bytes = b"") -> None:
    status, text = http_request(broker.http_address, "POST", path, body)
    assert status == 200, text


def bodies(answer: dict) -> list[bytes]:
    return [base64.b64decode(m["body"]) for m in answer["messages"]]


def channel_stats(broker, topic: str, channel: str) -> dict:
    status, stats = get(broker, f"/stats?format=json&topic={topic}&channel={channel}&include_mem=false")
    assert status == 200
    row = stats["topics"][0]["channels"][0]
    return {k: row[k] for k in ("depth", "backend_depth", "in_flight_count", "deferred_count",
                                "message_count", "requeue_count", "timeout_count")}


@pytest.mark.parametrize("mode", MODES)
def test_peek_every_state_then_consume_everything(start_broker, name, mode):
    broker = start_broker(*FAST_SCAN, "--mem-queue-size=4", *MODES[mode])
    topic = name()
    post(broker, f"/topic/create?topic={topic}")
    post(broker, f"/channel/create?topic={topic}&channel=c")
    base = f"/channel/peek?topic={topic}&channel=c"
    with RawConn(broker) as holder:
        holder.send(command(f"SUB {topic} c"))
        assert holder.read_frame() == (0, b"OK")
        before_pub = time.time()
        post(broker, f"/mpub?topic={topic}", b"\n".join(M))
        post(broker, f"/pub?topic={topic}&defer=4000", b"d4")
        post(broker, f"/pub?topic={topic}&defer=6000", b"d6")
        after_pub = time.time()
        holder.send(command("RDY 3"))
        got = [holder.read_message() for _ in range(3)]
        assert [m[3] for m in got] == M[:3]
        holder.send(command("RDY 0"))
        holder.send(command(b"REQ " + got[1][2] + b" 4500"))
        wait_for(lambda: channel_stats(broker, topic, "c")["deferred_count"] == 3, what="the REQ")
        stats = channel_stats(broker, topic, "c")
        assert (stats["depth"], stats["in_flight_count"], stats["deferred_count"]) == (9, 2, 3)

        queued = peek(broker, base)
        assert (queued["topic"], queued["channel"], queued["state"], queued["total"]) == (topic, "c", "queued", 9)
        assert bodies(queued) == M[3:]
        assert [m["body_text"] for m in queued["messages"]] == [b.decode() for b in M[3:]]
        for m, body in zip(queued["messages"], M[3:], strict=True):
            assert before_pub * 1e9 - 1e9 <= m["timestamp"] <= after_pub * 1e9 + 1e9
            assert (m["attempts"], m["size"], m["timeout_at"], m["client"]) == (0, len(body), None, None)

        in_flight = peek(broker, base + "&state=in_flight")
        assert in_flight["total"] == 2
        host, port = holder.sock.getsockname()[:2]
        # Delivered in one batch: the same timeout, in delivery order.
        assert [(m["id"].encode(), m["attempts"], m["client"]) for m in in_flight["messages"]] == [
            (got[0][2], 1, f"{host}:{port}"), (got[2][2], 1, f"{host}:{port}")]
        for m in in_flight["messages"]:
            assert after_pub * 1e9 + 59e9 <= m["timeout_at"] <= time.time() * 1e9 + 61e9

        deferred = peek(broker, base + "&state=deferred")
        assert deferred["total"] == 3
        assert [(b, m["attempts"]) for b, m in zip(bodies(deferred), deferred["messages"], strict=True)] == [
            (b"d4", 0), (b"m1", 1), (b"d6", 0)]
        due = [m["deferred_until"] for m in deferred["messages"]]
        assert due == sorted(due)
        assert before_pub * 1e9 + 4e9 <= due[0] <= after_pub * 1e9 + 4e9

        assert peek(broker, f"/topic/peek?topic={topic}")["total"] == 0
        # Peeking again, every state and size, moves nothing.
        for state in ("queued", "in_flight", "deferred"):
            for n in (1, 3, 1000):
                peek(broker, f"{base}&state={state}&n={n}")
        assert channel_stats(broker, topic, "c") == stats
        assert bodies(peek(broker, base)) == M[3:]

    # The holder is gone: its two in-flight messages go back to the queue at once.
    with RawConn(broker) as consumer:
        consumer.send(command(f"SUB {topic} c"))
        assert consumer.read_frame() == (0, b"OK")
        consumer.send(command("RDY 100"))
        delivered = []
        for _ in range(14):
            _, attempts, msg_id, body = consumer.read_message()
            delivered.append((body, attempts))
            consumer.send(command(b"FIN " + msg_id))
        consumer.expect_silence(0.5)
    assert delivered == [(b, 1) for b in M[3:]] + [(b"m0", 2), (b"m2", 2), (b"d4", 1), (b"m1", 2), (b"d6", 1)]
    final = channel_stats(broker, topic, "c")
    assert (final["depth"], final["in_flight_count"], final["deferred_count"]) == (0, 0, 0)
    broker.stop_cleanly()


def test_topic_peek_and_errors(start_broker, name):
    broker = start_broker(*FAST_SCAN, "--mem-queue-size=2")
    topic = name()
    raw = b"\x00\xff\xfe raw"
    post(broker, f"/mpub?topic={topic}", b"a\nb\nc")
    post(broker, f"/pub?topic={topic}", raw)
    answer = peek(broker, f"/topic/peek?topic={topic}")
    assert (answer["channel"], answer["state"], answer["total"]) == (None, "queued", 4)
    assert bodies(answer) == [b"a", b"b", b"c", raw]
    last = answer["messages"][-1]
    assert (last["body"], last["body_text"], last["size"]) == (base64.b64encode(raw).decode(), None, len(raw))
    assert bodies(peek(broker, f"/topic/peek?topic={topic}&n=2")) == [b"a", b"b"]

    assert get(broker, f"/topic/peek?topic={topic}&n=0") == (400, {"message": "INVALID_N"})
    assert get(broker, f"/topic/peek?topic={topic}&state=deferred") == (400, {"message": "INVALID_STATE"})
    assert get(broker, "/topic/peek?topic=nope") == (404, {"message": "TOPIC_NOT_FOUND"})
    assert get(broker, f"/channel/peek?topic={topic}&channel=nope") == (404, {"message": "CHANNEL_NOT_FOUND"})
    assert get(broker, f"/channel/peek?topic={topic}") == (400, {"message": "MISSING_ARG_CHANNEL"})
    status, text = http_request(broker.http_address, "POST", f"/topic/peek?topic={topic}")
    assert (status, json.loads(text)) == (405, {"message": "METHOD_NOT_ALLOWED"})
    # Nothing was created or consumed by any of it.
    status, stats = get(broker, f"/stats?format=json&topic={topic}")
    assert (stats["topics"][0]["depth"], stats["topics"][0]["channels"]) == (4, [])
    status, stats = get(broker, "/stats?format=json&topic=nope")
    assert stats["topics"] is None
    broker.stop_cleanly()
