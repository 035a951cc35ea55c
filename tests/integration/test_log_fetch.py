"""The offset mode's fetcher against a real `twistd mqd`: ranges read exactly, and each way a read can fail.

One broker with `--retention-bytes` serves most tests, each on topics of
its own; the auth and TLS tests start brokers of their own (an auth
server's, and one with `--https-address` and the test CA).
"""

from __future__ import annotations

import http.client
import json
import struct
import time
from collections.abc import Iterator

import pyarrow as pa
import pytest

from spark_bridge.log_fetch import (
    OFFSET_ARROW_SCHEMA,
    BrokerLog,
    EpochChanged,
    LogFetchError,
    OffsetOutOfRange,
    Refused,
    RetentionOff,
    TopicMissing,
    log_offsets,
    read_batches,
)
from tests.support.authd import SUBSCRIBE, AuthServer, grant
from tests.support.certs import tls_flags
from tests.support.processes import FAST_SCAN, BrokerProcess, http_request, wait_for
from tests.support.raw_conn import RawConn, command

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path_factory.mktemp("retaining"), [*FAST_SCAN, "--retention-bytes=50MB"])
    try:
        yield process.start()
    finally:
        process.kill()


def publish(broker: BrokerProcess, topic: str, bodies: list[bytes]) -> None:
    """One binary MPUB over HTTP (bodies may hold any byte)."""
    data = struct.pack(">I", len(bodies)) + b"".join(struct.pack(">I", len(b)) + b for b in bodies)
    status, answer = http_request(broker.http_address, "POST", f"/mpub?topic={topic}&binary=true", data)
    assert status == 200, (status, answer)


def bodies_of(n: int, first: int = 0) -> list[bytes]:
    """Bodies of several sizes (1 to ~600 bytes) with every byte value somewhere in them."""
    return [bytes([i % 256]) * (1 + (i * 37) % 600) + b"#%d\n" % i for i in range(first, first + n)]


def log_of(broker: BrokerProcess, **kw) -> BrokerLog:
    return BrokerLog(broker.tcp_address, broker.http_address, timeout=15, **kw)


def read_all(batches) -> pa.Table:
    return pa.Table.from_batches(list(batches), schema=OFFSET_ARROW_SCHEMA)


def test_a_middle_range_is_read_exactly_over_one_connection_in_several_answers(broker, name, monkeypatch):
    topic = name()
    bodies = bodies_of(400)
    before = time.time()
    publish(broker, topic, bodies[:200])
    publish(broker, topic, bodies[200:])
    after = time.time()
    where = log_of(broker)
    offsets = log_offsets(where, topic)
    assert (offsets.earliest, offsets.latest, offsets.offset_for_timestamp) == (0, 400, None)
    assert offsets.retained_bytes > sum(map(len, bodies)) and before * 1000 - 1 <= offsets.oldest_timestamp

    connects, requests = [], []
    real_connect, real_request = http.client.HTTPConnection.connect, http.client.HTTPConnection.request
    monkeypatch.setattr(http.client.HTTPConnection, "connect",
                        lambda self: (connects.append(1), real_connect(self))[1])
    monkeypatch.setattr(http.client.HTTPConnection, "request",
                        lambda self, *a, **kw: (requests.append(a[1]), real_request(self, *a, **kw))[1])
    batches = list(read_batches(where, topic, 120, 330, epoch=offsets.epoch, max_bytes=8000, max_rows=9))
    assert len(connects) == 1 and len(requests) > 5  # one kept-alive connection, many answers
    assert all(0 < b.num_rows <= 9 for b in batches)
    table = read_all(batches)
    assert table["offset"].to_pylist() == list(range(120, 330))
    assert table["body"].to_pylist() == bodies[120:330]
    assert set(table["topic"].to_pylist()) == {topic} and set(table["nsqd"].to_pylist()) == {broker.tcp_address}
    assert set(table["channel"].to_pylist()) == {None} and set(table["attempts"].to_pylist()) == {0}
    ids = table["message_id"].to_pylist()
    assert len(set(ids)) == 210 and all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    stamps = table["timestamp"].cast(pa.int64()).to_pylist()
    assert all(before * 1e6 - 1000 <= s <= after * 1e6 + 1000 for s in stamps)


def test_the_offset_of_a_time_is_the_first_record_published_at_or_after_it(broker, name):
    topic = name()
    publish(broker, topic, bodies_of(10))
    time.sleep(0.05)
    between = int(time.time() * 1000)
    time.sleep(0.05)
    publish(broker, topic, bodies_of(5, 10))
    where = log_of(broker)
    assert log_offsets(where, topic, timestamp_ms=between).offset_for_timestamp == 10
    assert log_offsets(where, topic, timestamp_ms=0).offset_for_timestamp == 0
    assert log_offsets(where, topic, timestamp_ms=between + 3_600_000).offset_for_timestamp == 15
    table = read_all(read_batches(where, topic, 10, 15))
    assert table["body"].to_pylist() == bodies_of(5, 10)


def test_a_topic_deleted_and_created_again_is_another_epoch(broker, name):
    topic = name()
    publish(broker, topic, bodies_of(20))
    where = log_of(broker)
    old = log_offsets(where, topic).epoch
    assert broker.post(f"/topic/delete?topic={topic}") == 200
    publish(broker, topic, bodies_of(30))
    new = log_offsets(where, topic).epoch
    assert new != old
    with pytest.raises(EpochChanged) as moved:
        list(read_batches(where, topic, 0, 20, epoch=old))
    assert (moved.value.expected, moved.value.found) == (old, new)
    assert f"topic {topic} on nsqd {broker.tcp_address} (http {broker.http_address})" in str(moved.value)
    assert read_all(read_batches(where, topic, 0, 30, epoch=new))["body"].to_pylist() == bodies_of(30)


def test_records_that_expired_are_out_of_range_with_the_logs_bounds(broker, name):
    topic = name()
    publish(broker, topic, [b"x"])
    status, raw = http_request(broker.http_address, "POST", f"/topic/retention?topic={topic}&bytes=2000")
    assert status == 200, raw
    for _ in range(10):
        publish(broker, topic, [b"y" * 100] * 10)
    where = log_of(broker)
    now = wait_for(lambda: (lambda o: o if o.earliest > 0 else None)(log_offsets(where, topic)), 10,
                   "the oldest records expired")
    with pytest.raises(OffsetOutOfRange) as gone:
        list(read_batches(where, topic, 0, now.latest, epoch=now.epoch))
    assert (gone.value.offset, gone.value.earliest, gone.value.latest) == (0, now.earliest, now.latest)
    assert f"offset 0 is out of range for topic {topic} on nsqd {broker.tcp_address}" in str(gone.value)
    # A range past the log's end: what there is, then out of range from the log's end.
    got = []
    with pytest.raises(OffsetOutOfRange) as short:
        for batch in read_batches(where, topic, now.latest - 3, now.latest + 5):
            got.extend(batch.column("offset").to_pylist())
    assert got == list(range(now.latest - 3, now.latest)) and short.value.offset == now.latest


def test_a_topic_without_retention_and_a_topic_that_does_not_exist(broker, name):
    kept, off, missing = name(), name(), name()
    publish(broker, off, [b"x"])
    status, raw = http_request(broker.http_address, "POST", f"/topic/retention?topic={off}&time=0&bytes=0")
    assert status == 200, raw
    where = log_of(broker)
    for call in (lambda t: log_offsets(where, t), lambda t: list(read_batches(where, t, 0, 1))):
        with pytest.raises(RetentionOff, match="--retention-time / --retention-bytes, or POST /topic/retention"):
            call(off)
        with pytest.raises(TopicMissing, match=f"topic {missing} on nsqd"):
            call(missing)
    assert http_request(broker.http_address, "GET", f"/topic/offsets?topic={missing}")[0] == 404  # not created
    publish(broker, kept, [b"k"])
    assert log_offsets(where, kept).latest == 1


def test_under_an_auth_server_a_read_needs_a_secret_granted_subscribe(tmp_path, start_broker, name):
    authd = AuthServer(tmp_path)
    try:
        authd.answers["good"] = grant(SUBSCRIBE)
        authd.answers["nothing"] = grant()
        secured = start_broker(*FAST_SCAN, f"--auth-http-address={authd.address}", "--retention-bytes=1MB")
        topic = name()
        publish(secured, topic, bodies_of(3))
        for secret, words in ((None, "401 Unauthorized (AUTH_REQUIRED): it requires a secret (option auth_secret)"),
                              ("wrong", "401 Unauthorized (AUTH_FAILED): the auth server refused the secret"),
                              ("nothing", "403 Forbidden (UNAUTHORIZED): the secret has no grant")):
            with pytest.raises(Refused) as refused:
                list(read_batches(log_of(secured, secret=secret), topic, 0, 3))
            assert words in str(refused.value) and (secret is None or secret not in str(refused.value))
        where = log_of(secured, secret="good")
        assert log_offsets(where, topic).latest == 3
        assert read_all(read_batches(where, topic, 0, 3))["body"].to_pylist() == bodies_of(3)
    finally:
        authd.close()


def test_over_https_with_the_test_ca_and_identify_names_the_https_port(start_broker, certs, name):
    # A client certificate required (on HTTPS too); plain HTTP kept for publishing.
    secured = start_broker(*FAST_SCAN, *tls_flags(certs, "--tls-client-auth-policy=require-verify",
                                                  f"--tls-root-ca-file={certs.ca}", "--tls-required=tcp-https"),
                           "--retention-bytes=1MB")
    assert secured.https_port
    with RawConn(secured) as conn:
        conn.send(command("IDENTIFY", json.dumps({"feature_negotiation": True}).encode()))
        _, payload = conn.read_frame()
    answer = json.loads(payload)
    assert (answer["http_port"], answer["https_port"]) == (secured.http_port, secured.https_port)

    topic = name()
    publish(secured, topic, bodies_of(50))
    https = f"127.0.0.1:{secured.https_port}"
    where = BrokerLog(secured.tcp_address, https, tls=True, tls_root_ca_file=str(certs.ca),
                      tls_cert=str(certs.client_cert), tls_key=str(certs.client_key), timeout=15)
    assert log_offsets(where, topic).latest == 50
    assert read_all(read_batches(where, topic, 10, 50, max_bytes=2000))["body"].to_pylist() == bodies_of(50)[10:]
    # No certificate where the broker requires one; a CA that did not sign the broker's (the system's).
    for wrong, words in (
            (BrokerLog(secured.tcp_address, https, tls=True, tls_root_ca_file=str(certs.ca), timeout=15),
             "the broker requires a client certificate it accepts (tls_cert, tls_key)"),
            (BrokerLog(secured.tcp_address, https, tls=True, tls_cert=str(certs.client_cert),
                       tls_key=str(certs.client_key), timeout=15),
             "TLS: the broker's certificate is refused (self-signed certificate in certificate chain)"),
            (BrokerLog(secured.tcp_address, https, tls=True, tls_root_ca_file=str(certs.ca) + ".missing"),
             f"cannot load the TLS files (tls_root_ca_file {certs.ca}.missing)")):
        with pytest.raises(LogFetchError) as refused:
            log_offsets(wrong, topic)
        assert type(refused.value) is LogFetchError  # not Unreachable: asking again would not help
        assert str(refused.value).startswith(f"mqd: topic {topic} on nsqd {secured.tcp_address} (https {https}): ")
        assert words in str(refused.value)
    skipping = BrokerLog(secured.tcp_address, https, tls=True, tls_insecure_skip_verify=True,
                         tls_cert=str(certs.client_cert), tls_key=str(certs.client_key), timeout=15)
    assert log_offsets(skipping, topic).latest == 50
