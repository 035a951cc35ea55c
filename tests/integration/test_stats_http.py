"""/stats, /metrics and statsd of a running broker, after real publishing and consuming."""

from __future__ import annotations

import json
import socket

from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import FAST_SCAN, NO_PROXY, wait_for
from tests.support.raw_conn import RawConn, command
from tests.support.v2_frames import mpub_body


def get(broker, path: str) -> tuple[int, dict[str, str], bytes]:
    with NO_PROXY.open(f"http://{broker.http_address}{path}", timeout=5) as response:
        return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()


def traffic(broker, topic: str) -> tuple[RawConn, RawConn]:
    """Publish 3 (PUB + MPUB), consume: FIN one, REQ one, leave one in flight."""
    producer = RawConn(broker)
    producer.send(command(f"PUB {topic}", b"first"))
    assert producer.read_frame() == (0, b"OK")
    consumer = RawConn(broker)
    consumer.send(command(f"SUB {topic} archive"))
    assert consumer.read_frame() == (0, b"OK")
    producer.send(command(f"MPUB {topic}", mpub_body([b"second", b"third"])))
    assert producer.read_frame() == (0, b"OK")
    consumer.send(b"RDY 3\n")
    msgs = [consumer.read_message() for _ in range(3)]
    consumer.send(b"FIN " + msgs[0][2] + b"\n")
    consumer.send(b"REQ " + msgs[1][2] + b" 60000\n")
    consumer.send(b"NOP\n")
    return producer, consumer


def test_stats_and_metrics_over_http(start_broker, name):
    broker = start_broker(*FAST_SCAN, "--e2e-processing-latency-percentile=0.99,0.5")
    topic = name()
    producer, consumer = traffic(broker, topic)
    try:
        def channel_settled():
            _, _, body = get(broker, f"/stats?format=json&topic={topic}")
            stats = json.loads(body)
            ch = stats["topics"][0]["channels"][0]
            return stats if ch["deferred_count"] == 1 and ch["clients"][0]["finish_count"] == 1 else None

        stats = wait_for(channel_settled, what="FIN and REQ to show in /stats")
        assert list(stats) == ["version", "health", "start_time", "topics", "memory", "producers"]
        assert (stats["version"], stats["health"]) == ("1.3.0", "OK")
        [t] = stats["topics"]
        assert (t["topic_name"], t["message_count"], t["message_bytes"], t["depth"]) == (topic, 3, 16, 0)
        [ch] = t["channels"]
        assert (ch["channel_name"], ch["message_count"], ch["in_flight_count"], ch["deferred_count"],
                ch["requeue_count"], ch["depth"], ch["client_count"]) == ("archive", 3, 1, 1, 1, 0, 1)
        [client] = ch["clients"]
        assert (client["version"], client["state"], client["ready_count"], client["message_count"],
                client["finish_count"], client["requeue_count"]) == ("V2", 3, 3, 3, 1, 1)
        assert client["remote_address"].startswith("127.0.0.1:")
        assert ch["e2e_processing_latency"]["count"] == 1
        assert [p["quantile"] for p in ch["e2e_processing_latency"]["percentiles"]] == [0.99, 0.5]
        assert t["e2e_processing_latency"]["count"] == 1
        [prod] = stats["producers"]
        assert prod["pub_counts"] == [{"topic": topic, "count": 3}]

        _, _, body = get(broker, f"/stats?format=json&include_clients=false&include_mem=false&topic={topic}")
        lean = json.loads(body)
        assert "memory" not in lean and lean["producers"] is None
        assert lean["topics"][0]["channels"][0]["clients"] is None
        _, _, body = get(broker, "/stats?format=json&topic=no-such-topic")
        assert json.loads(body)["topics"] is None

        status, headers, body = get(broker, "/stats")
        text = body.decode()
        assert status == 200
        assert text.startswith("nsqd v1.3.0 (built w/")
        assert "\nHealth: OK\n" in text and "\nMemory:\n" in text and "\nTopics:\n" in text
        assert f"   [{topic:<15}] depth: 0     be-depth: 0     msgs: 3        e2e%: " in text
        assert ("      [archive                  ] depth: 0     be-depth: 0     inflt: 1    def: 1    "
                "re-q: 1     timeout: 0     msgs: 3        e2e%: ") in text
        assert "\nProducers:\n   [V2 " in text

        status, headers, body = get(broker, "/metrics")
        assert status == 200
        assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        tc = (("channel", "archive"), ("topic", topic))
        assert samples[("nsq_up", ())] == 1
        assert samples[("nsq_topic_messages_total", (("topic", topic),))] == 3
        assert samples[("nsq_topic_message_bytes_total", (("topic", topic),))] == 16
        assert samples[("nsq_channel_in_flight", tc)] == 1
        assert samples[("nsq_channel_deferred", tc)] == 1
        assert samples[("nsq_channel_requeues_total", tc)] == 1
        assert samples[("nsq_channel_clients", tc)] == 1
        assert samples[("nsq_channel_e2e_processing_latency_samples", tc)] == 1
        latency = samples[("nsq_channel_e2e_processing_latency_seconds",
                           tuple(sorted((*tc, ("quantile", "0.5")))))]
        assert 0 < latency < 5
    finally:
        producer.close()
        consumer.close()
    broker.stop_cleanly()


def test_statsd_push(start_broker, name):
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.settimeout(0.5)
    port = sink.getsockname()[1]
    broker = start_broker(*FAST_SCAN, f"--statsd-address=127.0.0.1:{port}", "--statsd-interval=1s",
                          "--broadcast-address=stats.example")
    topic = name()
    producer, consumer = traffic(broker, topic)
    prefix = f"nsq.stats_example_{broker.http_port}."
    try:
        lines: list[str] = []

        def pushed():
            try:
                data, _ = sink.recvfrom(65536)
            except TimeoutError:
                return None
            assert len(data) <= 508
            lines.extend(data.decode().splitlines())
            return f"{prefix}topic.{topic}.channel.archive.deferred_count:1|g" in lines

        wait_for(pushed, timeout=10, what="a statsd push showing the deferred message")
        while pushed() is not None:             # the rest of that push (mem.* comes last)
            pass
        assert all(line.startswith(prefix) for line in lines)
        assert f"{prefix}topic.{topic}.channel.archive.in_flight_count:1|g" in lines
        assert f"{prefix}topic.{topic}.channel.archive.clients:1|g" in lines
        assert any(line.startswith(f"{prefix}mem.heap_in_use_bytes:") for line in lines)
        # Counters are deltas: over all pushes they add up to the totals.
        total = sum(int(line.rsplit(":", 1)[1][:-2]) for line in lines
                    if line.startswith(f"{prefix}topic.{topic}.message_count:"))
        assert total == 3
    finally:
        producer.close()
        consumer.close()
        sink.close()
    broker.stop_cleanly()
    assert "STATSD: closing" in broker.log()
