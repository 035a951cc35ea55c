"""GET /metrics: Prometheus text format 0.0.4, read back with prometheus_client's parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mqd.nsqd.http.metrics import CONTENT_TYPE, _Family, escape_label, metrics_text
from tests.support.http_client import HTTPClient
from tests.support.inprocess_broker import START_TIME
from tests.support.v2_client import Client, mpublish


def parse(text: str) -> dict:
    """{family name: (type, {(sample name, frozenset(labels)): value})}."""
    out = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, frozenset(s.labels.items())): s.value for s in family.samples}
        out[family.name] = (family.type, samples)
    return out


def value(families, family, sample=None, **labels):
    _, samples = families[family]
    return samples[(sample or family, frozenset(labels.items()))]


def test_empty_broker(inproc_broker):
    families = parse(metrics_text(inproc_broker))
    assert value(families, "nsq_up") == 1
    assert value(families, "nsq_info", version="1.3.0") == 1
    assert value(families, "nsq_topics") == 0
    assert value(families, "nsq_channels") == 0
    assert value(families, "nsq_clients") == 0
    assert value(families, "process_start_time_seconds") == inproc_broker.start_time
    assert value(families, "process_resident_memory_bytes") > 0
    # Families without series still carry their HELP and TYPE.
    assert families["nsq_channel_depth"] == ("gauge", {})
    assert "nsq_topic_e2e_processing_latency_seconds" not in families


def test_topics_and_channels(inproc_broker, clock):
    c = Client(inproc_broker, port=6000)
    c.sub("t", "c", rdy=3)
    Client(inproc_broker, port=6001).sub("t", "idle")
    mpublish(inproc_broker, "t", [b"a", b"bb", b"ccc", b"dddd"])
    m1, m2, _ = c.messages()
    c.fin(m1)                            # m4 goes out in its place
    c.req(m2)                            # and m2 at once again
    m4, m2 = c.messages()
    c.req(m4, 10_000)                    # deferred; nothing left to send
    inproc_broker.topics["t"].channels["idle"].pause()
    mpublish(inproc_broker, "other", [b"x"], port=5001)

    text = metrics_text(inproc_broker)
    families = parse(text)
    assert value(families, "nsq_topics") == 2
    assert value(families, "nsq_channels") == 2
    assert value(families, "nsq_clients") == 4
    assert value(families, "nsq_producers") == 2
    assert families["nsq_topic_messages"][0] == "counter"
    assert value(families, "nsq_topic_messages", "nsq_topic_messages_total", topic="t") == 4
    assert value(families, "nsq_topic_message_bytes", "nsq_topic_message_bytes_total", topic="t") == 10
    assert value(families, "nsq_topic_depth", topic="other") == 1
    assert value(families, "nsq_topic_paused", topic="t") == 0
    tc = {"topic": "t", "channel": "c"}
    assert value(families, "nsq_channel_depth", **tc) == 0
    assert value(families, "nsq_channel_in_flight", **tc) == 2
    assert value(families, "nsq_channel_deferred", **tc) == 1
    assert value(families, "nsq_channel_messages", "nsq_channel_messages_total", **tc) == 4
    assert value(families, "nsq_channel_requeues", "nsq_channel_requeues_total", **tc) == 2
    assert value(families, "nsq_channel_timeouts", "nsq_channel_timeouts_total", **tc) == 0
    assert value(families, "nsq_channel_clients", **tc) == 1
    assert value(families, "nsq_channel_paused", topic="t", channel="idle") == 1
    assert value(families, "nsq_channel_depth", topic="t", channel="idle") == 4
    # Every family has HELP and TYPE, each once, before its samples.
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert helps == types and len(set(types)) == len(types)


def test_unhealthy(inproc_broker):
    inproc_broker.set_health("disk full")
    assert value(parse(metrics_text(inproc_broker)), "nsq_up") == 0


def test_e2e_latency_quantiles(make_broker, clock):
    broker = make_broker(e2e_processing_latency_percentile="0.99,0.5")
    c = Client(broker)
    c.sub("t", "c", rdy=2)
    mpublish(broker, "t", [b"1", b"2"])
    clock.advance(0.25)
    for m in c.messages():
        c.fin(m)
    families = parse(metrics_text(broker))
    for q in ("0.99", "0.5"):
        assert value(families, "nsq_topic_e2e_processing_latency_seconds", topic="t",
                     quantile=q) == pytest.approx(0.25, abs=1e-5)
        assert value(families, "nsq_channel_e2e_processing_latency_seconds", topic="t", channel="c",
                     quantile=q) == pytest.approx(0.25, abs=1e-5)
    assert value(families, "nsq_topic_e2e_processing_latency_samples", topic="t") == 2
    assert value(families, "nsq_channel_e2e_processing_latency_samples", topic="t", channel="c") == 2


def test_ephemeral_names_are_label_values(inproc_broker):
    Client(inproc_broker).sub("t#ephemeral", "c#ephemeral")
    families = parse(metrics_text(inproc_broker))
    assert value(families, "nsq_channel_clients", topic="t#ephemeral", channel="c#ephemeral") == 1


@pytest.mark.parametrize(("raw", "escaped"), [
    ("plain", "plain"), ('a"b', 'a\\"b'), ("a\\b", "a\\\\b"), ("a\nb", "a\\nb"),
])
def test_label_escaping(raw, escaped):
    assert escape_label(raw) == escaped
    f = _Family("x", "gauge", "help with a \\ and a\nnewline")
    f.add(1, name=raw)
    [family] = text_string_to_metric_families("".join(f.render()))
    assert family.samples[0].labels == {"name": raw}
    assert family.documentation == "help with a \\ and a\nnewline"


# -- through the API root -----------------------------------------------------------------------


def test_route(inproc_broker):
    inproc_broker.start_time = int(START_TIME)
    response = HTTPClient(inproc_broker).get("/metrics")
    assert response.status == 200
    assert response.header("Content-Type") == CONTENT_TYPE
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert value(parse(response.body.decode()), "process_start_time_seconds") == int(START_TIME)


def test_route_wrong_method(inproc_broker):
    response = HTTPClient(inproc_broker).post("/metrics")
    assert response.status == 405
    assert response.body == b'{"message":"METHOD_NOT_ALLOWED"}'
