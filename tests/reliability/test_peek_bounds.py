"""A peek of large messages stays within its byte budget and never holds the broker up.

A real broker (twistd mqd) holding 100 messages of 1 MB. Before, `GET
/channel/peek?n=200` over 200 such messages built a 1.5 GB answer in one
reactor call (9.9 s during which other PUBs waited at least 5 s, +3.4 GB
of RSS) and n=1000 got the broker OOM-killed. Now each body is cut at
--peek-max-body-bytes, the answer stops at --peek-max-bytes, and it is
built a slice at a time: a bystander's PUB round trips stay short while
peeks run back to back, and the broker's private memory barely moves.
The bounds on time and memory are generous (the machine is shared); the
exact ones (answer size, truncation, sizes) are exact.
"""

from __future__ import annotations

import base64
import json
import threading
import time

from tests.support.abuse import measured
from tests.support.processes import http_request
from tests.support.raw_conn import FRAME_RESPONSE, RawConn, command

MB = 1 << 20
BUDGET = 4 * MB


def fill(broker, topic: str, n: int, size: int = MB) -> bytes:
    body = (b"0123456789abcdef" * (size // 16))[:size]
    with RawConn(broker, timeout=60) as conn:
        conn.send(command(f"SUB {topic} c") + command("CLS"))
        assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        assert conn.read_frame() == (FRAME_RESPONSE, b"CLOSE_WAIT")
    with RawConn(broker, timeout=60) as conn:
        for _ in range(n):
            conn.send(command(f"PUB {topic}", body))
        for _ in range(n):
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
    return body


def peek(broker, path: str) -> tuple[dict, int]:
    status, raw = http_request(broker.http_address, "GET", path)
    assert status == 200, raw[:300]
    return json.loads(raw), len(raw)


def check_bounded(answer: dict, size: int, body: bytes, total: int, cut: int = 64 << 10) -> None:
    assert size <= BUDGET
    assert answer["total"] == total and answer["more"] is True and answer["max_body"] == cut
    messages = answer["messages"]
    assert 1 <= len(messages) < total
    for m in messages:
        assert (m["size"], m["truncated"]) == (len(body), True)
        assert base64.b64decode(m["body"]) == body[:cut]


def test_large_messages_peek_within_the_budget_while_the_broker_serves(start_broker):
    broker = start_broker("--mem-queue-size=1000")
    body = fill(broker, "big", 100)
    answer, size = peek(broker, "/channel/peek?topic=big&channel=c&n=100")
    check_bounded(answer, size, body, 100)
    answer, size = peek(broker, "/topic/peek?topic=big&n=1000&max_body=1")
    assert answer["messages"] == [] or size <= BUDGET  # nothing waits at the topic: it has a channel

    stop = threading.Event()
    peeks = [0]

    def peek_loop() -> None:
        while not stop.is_set():
            check_bounded(*peek(broker, "/channel/peek?topic=big&channel=c&n=100"), body, 100)
            peeks[0] += 1

    with measured(broker, "peeks of 1 MB messages") as out:
        threads = [threading.Thread(target=peek_loop, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join(30)
    result = out["result"]
    print(f"\n{peeks[0]} peeks; {result}")
    assert peeks[0] >= 4 and not result.bystander_errors
    assert result.bystander_round_trips >= 20
    # Before: the bystander waited seconds for every peek and the broker grew by gigabytes.
    assert result.worst_latency_ms < 1000, result
    assert result.anon_growth_mb < 100, result
    assert "Traceback" not in broker.log()


def test_the_store_is_read_in_pieces_within_the_budget(start_broker):
    broker = start_broker("--mem-queue-size=0", "--peek-max-body-bytes=1000", "--peek-max-bytes=65536")
    body = fill(broker, "stored", 30)
    answer, size = peek(broker, "/channel/peek?topic=stored&channel=c&n=30")
    assert size <= 65536
    check_bounded(answer, size, body, 30, cut=1000)
    answer, size = peek(broker, "/channel/peek?topic=stored&channel=c&n=30&max_body=0")
    assert len(answer["messages"]) == 30 and answer["more"] is False
    assert all((m["body"], m["size"], m["truncated"]) == ("", MB, True) for m in answer["messages"])
    status, config = http_request(broker.http_address, "GET", "/config/peek_max_bytes")
    assert (status, json.loads(config)) == (200, 65536)
