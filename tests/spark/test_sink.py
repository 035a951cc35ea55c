"""The `mqd` sink against a real broker: batch and streaming writes, routing, refusals, retries.

Counts are read at the broker (/stats), bodies on a sample (/topic/peek,
which reads without consuming). A task's retry after a broker outage is
shown by running the task's `write` twice in a process of its own
(tests/support/sink_direct.py): a local[2] session does not retry failed tasks.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import FAST_SCAN, http_request, wait_for

ROWS = 100_000
ROOT = Path(__file__).resolve().parents[2]


def stats_topic(broker, topic: str) -> dict | None:
    status, raw = http_request(broker.http_address, "GET", f"/stats?format=json&topic={topic}")
    assert status == 200, raw
    for t in json.loads(raw).get("topics") or []:
        if t["topic_name"] == topic:
            return t
    return None


def message_count(broker, topic: str) -> int:
    found = stats_topic(broker, topic)
    return found["message_count"] if found else 0


def peek(broker, topic: str, n: int) -> list[bytes]:
    status, raw = http_request(broker.http_address, "GET", f"/topic/peek?topic={topic}&n={n}")
    assert status == 200, raw
    return [base64.b64decode(m["body"]) for m in json.loads(raw)["messages"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_write(options: dict, rows: list) -> subprocess.CompletedProcess:
    """One sink task run outside Spark (see tests/support/sink_direct.py)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.support.sink_direct", json.dumps(options), json.dumps(rows)],
        cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_dataframe_write_publishes_every_row_spreading_tasks_over_brokers(start_broker, spark):
    brokers = [start_broker(*FAST_SCAN), start_broker(*FAST_SCAN)]
    df = spark.range(ROWS, numPartitions=2).selectExpr(
        "concat('message-', cast(id as string)) as body")
    started = time.monotonic()
    df.write.format("mqd").option("nsqd", ",".join(b.tcp_address for b in brokers)).option(
        "topic", "bulk").mode("append").save()
    elapsed = time.monotonic() - started
    print(f"{ROWS} rows in {elapsed:.2f}s: {ROWS / elapsed:,.0f} rows/s")
    # Partition i went to broker i (round robin), so each has one partition's rows.
    assert [message_count(b, "bulk") for b in brokers] == [ROWS // 2, ROWS // 2]
    # A task publishes its partition in order, in MPUBs: each topic starts with one of them.
    for broker, start in zip(brokers, (0, ROWS // 2), strict=True):
        first = peek(broker, "bulk", 50)
        assert first == [b"message-%d" % i for i in range(start, start + 50)]
    # Each task closed its connection when it ended.
    for broker in brokers:
        wait_for(lambda b=broker: not b.get("/stats?format=json")[1].get("producers"),
                 what="the tasks' connections to close")


def test_a_streaming_query_publishes_each_micro_batch(start_broker, spark, tmp_path):
    broker = start_broker(*FAST_SCAN)
    source = tmp_path / "in"
    source.mkdir()
    for part in range(2):
        lines = [json.dumps({"body": f"event-{part}-{i}"}) for i in range(10)]
        (source / f"part{part}.json").write_text("\n".join(lines) + "\n")
    query = (spark.readStream.schema("body string").option("maxFilesPerTrigger", 1).json(str(source))
             .writeStream.format("mqd").option("nsqd", broker.tcp_address).option("topic", "events")
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    query.awaitTermination(60)
    assert query.exception() is None
    assert [p["batchId"] for p in query.recentProgress if p["numInputRows"]] == [0, 1]
    assert message_count(broker, "events") == 20
    assert sorted(peek(broker, "events", 100)) == sorted(
        f"event-{p}-{i}".encode() for p in range(2) for i in range(10))


def test_rows_are_routed_by_their_topic_column_and_deferred_by_defer_ms(start_broker, spark):
    broker = start_broker(*FAST_SCAN)
    for topic in ("orders", "audit"):
        for path in (f"/topic/create?topic={topic}", f"/channel/create?topic={topic}&channel=c"):
            status, raw = http_request(broker.http_address, "POST", path, b"")
            assert status == 200, raw
    rows = [(b"o1", "orders", None), (b"o2", "orders", 0), (b"a1", "audit", None),
            (b"d1", None, None), (b"later", "audit", 600_000)]
    df = spark.createDataFrame(rows, "body binary, topic string, defer_ms long").coalesce(1)
    # A client option (IDENTIFY snappy) travels to the executors' connections.
    df.write.format("mqd").option("nsqd", broker.tcp_address).option("topic", "default").option(
        "snappy", "true").mode("append").save()
    assert message_count(broker, "orders") == 2
    assert message_count(broker, "audit") == 2
    assert message_count(broker, "default") == 1
    audit = stats_topic(broker, "audit")["channels"][0]
    assert (audit["depth"], audit["deferred_count"]) == (1, 1)
    orders = stats_topic(broker, "orders")["channels"][0]
    assert (orders["depth"], orders["deferred_count"]) == (2, 0)


def test_a_bad_topic_in_a_row_fails_the_write_with_the_reason(start_broker, spark):
    broker = start_broker(*FAST_SCAN)
    df = spark.createDataFrame([("x", "fine"), ("y", "not a topic!")], "body string, topic string")
    with pytest.raises(Exception, match=r"topic 'not a topic!' is not a valid NSQ name"):
        df.coalesce(1).write.format("mqd").option("nsqd", broker.tcp_address).mode("append").save()


def test_the_schema_and_options_are_checked_before_any_task(spark):
    no_body = spark.createDataFrame([(1,)], "payload int")
    with pytest.raises(Exception, match="the DataFrame has no body column"):
        no_body.write.format("mqd").option("nsqd", "127.0.0.1:1").option("topic", "t").mode(
            "append").save()
    bad_defer = spark.createDataFrame([("b", "soon")], "body string, defer_ms string")
    with pytest.raises(Exception, match="column defer_ms is string, not integer or long"):
        bad_defer.write.format("mqd").option("nsqd", "127.0.0.1:1").option("topic", "t").mode(
            "append").save()
    with pytest.raises(Exception, match="snappy"):
        spark.createDataFrame([("b",)], "body string").write.format("mqd").option(
            "nsqd", "127.0.0.1:1").option("topic", "t").option("snappy", "maybe").mode("append").save()
    with pytest.raises(Exception, match="option topic: 'no/slash' is not a valid NSQ name"):
        spark.createDataFrame([("b",)], "body string").write.format("mqd").option(
            "nsqd", "127.0.0.1:1").option("topic", "no/slash").mode("append").save()


def test_brokers_are_found_through_lookupd(start_broker, start_lookupd, spark):
    lookupd = start_lookupd()
    df = spark.createDataFrame([("via lookupd",)], "body string").coalesce(1)
    write = df.write.format("mqd").option("lookupd", lookupd.http_address).option(
        "topic", "found").mode("append")
    with pytest.raises(Exception, match="knows no broker to publish to"):
        write.save()
    broker = start_broker(*FAST_SCAN, "--broadcast-address=127.0.0.1",
                          f"--lookupd-tcp-address={lookupd.tcp_address}")
    wait_for(lambda: json.loads(http_request(lookupd.http_address, "GET", "/nodes")[1])["producers"],
             what="the broker registered with lookupd")
    write.save()
    assert message_count(broker, "found") == 1


@pytest.mark.parametrize(("body", "why"), [
    (b'{"producers":' + b"[" * 100_000, "invalid JSON: nested too deep"),
    (b"<html>", "invalid JSON"),
    (b'{"producers": "everyone"}', "producers is not a list"),
])
def test_a_lookupd_answering_garbage_is_the_sinks_error(body, why):
    import http.server
    import threading

    from spark_bridge.sink import SinkError, lookupd_brokers

    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SinkError, match="no lookupd answered /nodes") as caught:
            lookupd_brokers((f"127.0.0.1:{server.server_port}",), timeout=5)
        assert why in str(caught.value)
    finally:
        server.shutdown()
        server.server_close()


def test_a_task_that_failed_on_a_down_broker_publishes_when_retried(start_broker, spark):
    tcp, http = free_port(), free_port()
    broker = start_broker(*FAST_SCAN, f"--tcp-address=127.0.0.1:{tcp}",
                          f"--http-address=127.0.0.1:{http}", addresses=False)
    broker.stop_cleanly()
    options = {"nsqd": f"127.0.0.1:{tcp}", "topic": "retried"}
    rows = [[f"r{i}", None] for i in range(1200)] + [["elsewhere", "other"]]
    failed = direct_write(options, rows)
    assert failed.returncode == 1, failed
    assert "SinkError: mqd: MPUB to topic retried on nsqd" in failed.stderr
    assert "refused" in failed.stderr.lower()
    # Through Spark the same failure fails the write, with the same line.
    with pytest.raises(Exception, match=r"mqd: MPUB to topic retried on nsqd 127\.0\.0\.1:\d+ failed"):
        spark.createDataFrame([("r",)], "body string").coalesce(1).write.format("mqd").options(
            **options).mode("append").save()
    broker.start()
    retried = direct_write(options, rows)
    assert retried.returncode == 0, retried.stderr
    sizes = sum(len(f"r{i}") for i in range(1200))
    assert json.loads(retried.stdout)["topics"] == {"retried": [1200, sizes], "other": [1, 9]}
    assert message_count(broker, "retried") == 1200
    assert message_count(broker, "other") == 1


@pytest.mark.parametrize(("secret", "refusal"), [
    ("", "401 Unauthorized (AUTH_REQUIRED): it requires a secret (option auth_secret)"),
    ("limited", "403 Forbidden (UNAUTHORIZED): the secret has no grant for this request"),
    ("good", None),
])
def test_the_lookupd_query_carries_auth_secret_and_a_refusal_is_one_line(secret, refusal):
    """The `auth_secret` option goes to lookupd as `Authorization: Bearer` (lookupd --http-auth-required)."""
    from spark_bridge.sink import SinkError, lookupd_brokers
    from tests.support.guarded_http import GuardedNode

    node = GuardedNode()
    try:
        if refusal is None:
            assert lookupd_brokers((node.address,), timeout=5, auth_secret=secret) == ["127.0.0.1:4150"]
        else:
            with pytest.raises(SinkError) as caught:
                lookupd_brokers((node.address,), timeout=5, auth_secret=secret)
            assert str(caught.value) == f"mqd: nsqlookupd {node.address} answered {refusal}"
        assert node.authorizations("/nodes") == [f"Bearer {secret}" if secret else None]
    finally:
        node.close()
