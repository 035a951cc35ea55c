"""The offset mode of `spark.readStream.format("mqd")` / `spark.read` against real brokers and real Spark.

Written as Spark's Kafka source is used: a topic named and no channel, the
checkpoint given to writeStream only. Each test publishes records whose
body names their offset (the n-th record published to a broker's topic is
offset n), so a row's body, offset and broker are checked together: every
record once, none out of place. The brokers are real `twistd mqd`s with
retention; the queries run on the shared local[2] session, or in a driver
process of their own when the driver is killed.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.authd import SUBSCRIBE, AuthServer, grant
from tests.support.certs import client_context, tls_flags
from tests.support.client_e2e import free_port
from tests.support.processes import BrokerProcess, http_request
from tests.support.stream_query import kill_driver, start_driver, start_query, wait_until

pytestmark = pytest.mark.slow

TOPIC = "events"
RETAIN = "--retention-bytes=50MB"
ERROR_LINE = re.compile(r"^[\w.]+(?:Error|Exception): (mqd: .*)$", re.MULTILINE)


# -- helpers --------------------------------------------------------------------------------------


def records(label: str, n: int, first: int = 0, pad: int = 0) -> list[bytes]:
    """Bodies `label-000042`, numbered from `first`, padded with `pad` dots."""
    return [b"%s-%06d%s" % (label.encode(), i, b"." * pad) for i in range(first, first + n)]


def publish(broker: BrokerProcess, bodies: list[bytes], topic: str = TOPIC) -> None:
    """/mpub in chunks, each acknowledged (200 OK)."""
    for at in range(0, len(bodies), 5000):
        status, answer = http_request(broker.http_address, "POST", f"/mpub?topic={topic}",
                                      b"\n".join(bodies[at:at + 5000]))
        assert (status, answer) == (200, b"OK"), answer


def log_offsets(broker: BrokerProcess, topic: str = TOPIC) -> dict[str, Any]:
    """The broker's /topic/offsets answer: epoch, earliest, latest."""
    status, answer = broker.get(f"/topic/offsets?topic={topic}")
    assert status == 200, answer
    return answer


def read_to(offsets: dict[str, Any] | None, broker: BrokerProcess | str, topic: str = TOPIC) -> int:
    """Where a query's offsets say the broker's log of `topic` is read to (-1: not in them)."""
    name = broker if isinstance(broker, str) else broker.tcp_address
    return int((offsets or {}).get(topic, {}).get(name, {}).get("offset", -1))


def query_offsets(query: Any) -> dict[str, Any]:
    """The end offsets of the query's last batch (committed: progress comes after the commit)."""
    progress = query.lastProgress
    if not progress or not progress["sources"]:
        return {}
    end = progress["sources"][0]["endOffset"]
    return json.loads(end) if isinstance(end, str) else (end or {})


def committed_offsets(checkpoint: Path) -> dict[str, Any]:
    """The source's offsets of the last batch the checkpoint says was committed."""
    commits = checkpoint / "commits"
    done = sorted(int(p.name) for p in commits.iterdir() if p.name.isdigit()) if commits.exists() else []
    if not done:
        return {}
    return json.loads((checkpoint / "offsets" / str(done[-1])).read_text().splitlines()[-1])


def reader(spark: Any, batch: bool = False, /, **options: str) -> Any:
    source = (spark.read if batch else spark.readStream).format("mqd")
    for key, value in options.items():
        source = source.option(key, value)
    return source


class Batches:
    """foreachBatch's function: each micro-batch's rows, collected in this (the driver's) process.

    `then(batch_id)` runs after a batch's rows are collected, before Spark
    commits it: a test's way to act while the query is known to be running.
    """

    def __init__(self, then: Callable[[int], None] | None = None) -> None:
        self.sizes: list[int] = []
        self.rows: list[Any] = []
        self.then = then

    def __call__(self, frame: Any, batch_id: int) -> None:
        rows = frame.select("body", "offset", "nsqd").collect()
        self.sizes.append(len(rows))
        self.rows.extend(rows)
        if self.then is not None:
            self.then(batch_id)

    @property
    def offsets(self) -> list[int]:
        return [r.offset for r in self.rows]


def run_available_now(spark: Any, checkpoint: Path, batches: Batches | None = None, /, **options: str) -> Batches:
    """A Trigger.AvailableNow query into foreachBatch, which must stop by itself within 120 s."""
    batches = batches or Batches()
    query = (reader(spark, **options).load().writeStream.foreachBatch(batches)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    try:
        assert query.awaitTermination(120), "Trigger.AvailableNow did not stop by itself"
    finally:
        query.stop()
    assert query.exception() is None, query.exception()
    return batches


def failure_line(spark: Any, checkpoint: Path, /, **options: str) -> str:
    """Run a stream that must fail; its error's line that says `mqd: ...` (the source's one-line message)."""
    with pytest.raises(Exception) as failure:  # noqa: PT011 - Spark wraps the source's error
        query = (reader(spark, **options).load().writeStream.format("noop")
                 .option("checkpointLocation", str(checkpoint)).start())
        try:
            query.awaitTermination(120)
        finally:
            query.stop()
    return error_line(failure.value)


def error_line(failure: BaseException) -> str:
    """The source's one-line message in Spark's error: the traceback's last line, `module.SomeError: mqd: ...`."""
    lines = {m.group(1) for m in ERROR_LINE.finditer(str(failure))}
    assert len(lines) == 1, str(failure)[-3000:]
    return lines.pop()


def assert_each_record_once(rows: list[Any], expected: dict[str, dict[int, bytes]]) -> None:
    """Rows (body, offset, nsqd) are exactly `expected`: broker -> offset -> body, each once."""
    got: dict[str, dict[int, bytes]] = {}
    seen = 0
    for row in rows:
        body = row.body if isinstance(row.body, bytes) else row.body.encode()
        got.setdefault(row.nsqd, {})[row.offset] = body
        seen += 1
    assert seen == sum(len(v) for v in got.values()), f"{seen - sum(len(v) for v in got.values())} rows twice"
    assert set(got) == set(expected), (set(got), set(expected))
    for name, want in expected.items():
        mine = got[name]
        assert sorted(mine) == sorted(want), (f"{name}: missing {sorted(set(want) - set(mine))[:10]}, "
                                             f"unexpected {sorted(set(mine) - set(want))[:10]}")
        wrong = [o for o in want if mine[o] != want[o]]
        assert not wrong, f"{name}: offsets {wrong[:5]} hold other bodies, e.g. {mine[wrong[0]]!r}"


def numbered(bodies: list[bytes], first: int = 0, upper: bool = False) -> dict[int, bytes]:
    return {first + i: (b.upper() if upper else b) for i, b in enumerate(bodies)}


def topic_stats(broker: BrokerProcess, topic: str = TOPIC) -> dict[str, Any]:
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200
    [found] = [t for t in stats["topics"] if t["topic_name"] == topic]
    return found


# -- a driver of its own, killed with SIGKILL ----------------------------------------------------------


def test_a_stream_killed_with_sigkill_and_restarted_writes_every_record_once_and_takes_no_channel(
        spark, start_broker, tmp_path):
    """Records published before and while the query runs and while its driver is dead: each once, in place."""
    broker = start_broker(RETAIN)
    before, during, down = records("before", 6000), records("during", 3000, 6000), records("down", 1000, 9000)
    publish(broker, before)
    checkpoint, out, log = tmp_path / "ckpt", tmp_path / "out", tmp_path / "driver.log"
    options = {"topic": TOPIC, "nsqd": broker.tcp_address, "startingOffsets": "earliest",
               "maxOffsetsPerTrigger": "2000"}
    driver = start_driver(checkpoint, out, log, **options)
    try:
        wait_until(lambda: read_to(committed_offsets(checkpoint), broker) >= 2000 or driver.poll() is not None,
                   180, "a committed batch")
        assert driver.poll() is None, log.read_text()[-3000:]
        publish(broker, during)
        assert read_to(committed_offsets(checkpoint), broker) < 9000, "the stream should still be running"
        kill_driver(driver)
        publish(broker, down)
        driver = start_driver(checkpoint, out, log, **options)
        wait_until(lambda: read_to(committed_offsets(checkpoint), broker) == 10000 or driver.poll() is not None,
                   180, "every record committed after the restart")
        assert driver.poll() is None, log.read_text()[-3000:]
    finally:
        kill_driver(driver)
    rows = spark.read.parquet(str(out)).select("body", "offset", "nsqd").collect()
    assert_each_record_once(rows, {broker.tcp_address: numbered(before + during + down, upper=True)})
    # Offset mode takes no channel: the broker made none and delivered nothing.
    stats = topic_stats(broker)
    assert stats["channels"] == [] and stats["message_count"] == stats["depth"] == 10000, stats


# -- where a read starts and ends -----------------------------------------------------------------------


def test_starting_points_and_batch_windows_read_exactly_what_they_name(spark, start_broker, tmp_path):
    broker = start_broker(RETAIN)
    name = broker.tcp_address
    published: list[bytes] = []
    stamps = []
    for label in ("a", "b", "c"):  # offsets 0-9, 10-19, 20-29, with a time between each group
        stamps.append(int(time.time() * 1000))
        time.sleep(0.02)
        group = records(label, 10, len(published))
        publish(broker, group)
        published += group
        time.sleep(0.02)
    epoch = log_offsets(broker)["epoch"]
    everything = numbered(published)

    queries = itertools.count()

    def stream(**options: str) -> list[int]:
        got = run_available_now(spark, tmp_path / f"ckpt{next(queries)}", topic=TOPIC, nsqd=name, **options)
        assert_each_record_once(got.rows, {name: {o: everything[o] for o in got.offsets}} if got.rows else {})
        return sorted(got.offsets)

    assert stream(startingOffsets="earliest") == list(range(30))
    assert stream(startingTimestamp=str(stamps[2])) == list(range(20, 30))
    assert stream(startingOffsets=json.dumps({TOPIC: {name: {"epoch": epoch, "offset": 12}}})) == list(range(12, 30))
    assert stream(startingOffsets=json.dumps({TOPIC: {name: 27}})) == [27, 28, 29]
    # A timestamp takes precedence over startingOffsets, as Kafka's does.
    assert stream(startingOffsets="latest", startingTimestamp=str(stamps[1])) == list(range(10, 30))

    # Batch reads: [startingTimestamp, endingTimestamp) and offsets JSON; the default is the whole log.
    def batch(**options: str) -> list[int]:
        rows = reader(spark, True, topic=TOPIC, nsqd=name, **options).load().select(
            "body", "offset", "nsqd").collect()
        assert_each_record_once(rows, {name: {r.offset: everything[r.offset] for r in rows}})
        return sorted(r.offset for r in rows)

    assert batch(startingTimestamp=str(stamps[1]), endingTimestamp=str(stamps[2])) == list(range(10, 20))
    assert batch(startingOffsets=json.dumps({TOPIC: {name: {"epoch": epoch, "offset": 5}}}),
                 endingOffsets=json.dumps({TOPIC: {name: 25}})) == list(range(5, 25))
    assert batch() == list(range(30))

    # latest: what was published before the query started is not read, what comes after is.
    batches = Batches()
    query = (reader(spark, topic=TOPIC, nsqd=name, startingOffsets="latest").load().writeStream
             .foreachBatch(batches).option("checkpointLocation", str(tmp_path / "latest"))
             .trigger(processingTime="200 milliseconds").start())
    try:
        wait_until(lambda: query.recentProgress, 120, "the query's first trigger", query)
        later = records("d", 10, 30)
        publish(broker, later)
        wait_until(lambda: len(batches.rows) >= 10, 120, "the records published after the start", query)
    finally:
        query.stop()
    assert_each_record_once(batches.rows, {name: numbered(later, 30)})


def test_available_now_stops_by_itself_at_the_offsets_latest_when_it_started(spark, start_broker, tmp_path):
    broker = start_broker(RETAIN)
    first = records("first", 1000)
    publish(broker, first)
    later = records("later", 200, 1000)

    def publish_more(batch_id: int) -> None:
        if batch_id == 0:
            publish(broker, later)  # while the query runs: after its start, so not in it

    got = run_available_now(spark, tmp_path / "ckpt", Batches(publish_more), topic=TOPIC, nsqd=broker.tcp_address,
                            startingOffsets="earliest", maxOffsetsPerTrigger="300")
    assert got.sizes == [300, 300, 300, 100]
    assert_each_record_once(got.rows, {broker.tcp_address: numbered(first)})
    assert log_offsets(broker)["latest"] == 1200


# -- records gone before they were read --------------------------------------------------------------


@pytest.mark.parametrize("fail", [True, False], ids=["failOnDataLoss=true", "failOnDataLoss=false"])
def test_records_that_expire_under_a_lagging_query(spark, start_broker, tmp_path, fail):
    """After the first batch the topic's retention shrinks and records expire before the query reaches them."""
    broker = start_broker(RETAIN)
    bodies = records("r", 2000, pad=90)  # 138 retained bytes each: 20 kB keeps 144 of them
    publish(broker, bodies)

    def shrink_retention(batch_id: int) -> None:
        if batch_id == 0:
            status, answer = http_request(broker.http_address, "POST", f"/topic/retention?topic={TOPIC}&bytes=20000")
            assert status == 200, answer
            wait_until(lambda: log_offsets(broker)["earliest"] > 1000, 30, "the old records to expire")

    options = {"topic": TOPIC, "nsqd": broker.tcp_address, "startingOffsets": "earliest",
               "maxOffsetsPerTrigger": "200", "failOnDataLoss": str(fail).lower()}
    if fail:
        batches = Batches(shrink_retention)
        query = (reader(spark, **options).load().writeStream.foreachBatch(batches)
                 .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
        try:
            with pytest.raises(Exception) as failure:  # noqa: PT011 - Spark wraps the source's error
                query.awaitTermination(120)
        finally:
            query.stop()
        line = error_line(failure.value)
        earliest = log_offsets(broker)["earliest"]
        assert line.startswith(f"mqd: records 200-{earliest - 1} of topic {TOPIC} on nsqd {broker.tcp_address} "
                               "expired before they were read"), line
        assert "failOnDataLoss=false" in line
        assert batches.offsets == list(range(200))
    else:
        got = run_available_now(spark, tmp_path / "ckpt", Batches(shrink_retention), **options)
        earliest = log_offsets(broker)["earliest"]
        kept = [*range(200), *range(earliest, 2000)]
        assert_each_record_once(got.rows, {broker.tcp_address: {o: bodies[o] for o in kept}})


# -- brokers that go and come back, come and go ------------------------------------------------------


def test_a_durable_broker_killed_mid_stream_and_restarted_loses_no_acknowledged_record(
        spark, start_broker, tmp_path):
    """Killed while its records are read, then while the query has read them all: each record once.

    The first time, executors reading it try again until it is back; the
    second time, the driver skips it and reads the other broker meanwhile.
    """
    tcp, http = free_port(), free_port()
    durable = start_broker("--durable", RETAIN, f"--tcp-address=127.0.0.1:{tcp}",
                           f"--http-address=127.0.0.1:{http}", addresses=False)
    steady = start_broker(RETAIN)
    first, second = records("first", 6000), records("second", 2000, 6000)
    steady_bodies = records("steady", 1000)
    publish(durable, first)
    publish(steady, steady_bodies[:500])
    query = start_query(spark, checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "out"), topic=TOPIC,
                        nsqd=f"{durable.tcp_address},{steady.tcp_address}", startingOffsets="earliest",
                        maxOffsetsPerTrigger="1000")
    try:
        wait_until(lambda: read_to(query_offsets(query), durable) >= 1000, 120, "a first batch", query)
        durable.crash()
        time.sleep(2)
        assert read_to(query_offsets(query), durable) < 6000, "the stream should still be reading it"
        durable.start()
        wait_until(lambda: read_to(query_offsets(query), durable) == 6000, 120,
                   "its records read after its restart", query)
        durable.crash()
        for upto in (750, 1000):  # the second time, the driver has long found it away
            publish(steady, steady_bodies[upto - 250:upto])
            wait_until(functools.partial(lambda n: read_to(query_offsets(query), steady) == n, upto), 120,
                       "the other broker's records read while it is away", query)
        durable.start()
        publish(durable, second)
        wait_until(lambda: read_to(query_offsets(query), durable) == 8000, 120,
                   "what it acknowledged after its second restart", query)
    finally:
        query.stop()
    rows = spark.read.parquet(str(tmp_path / "out")).select("body", "offset", "nsqd").collect()
    assert_each_record_once(rows, {durable.tcp_address: numbered(first + second, upper=True),
                                   steady.tcp_address: numbered(steady_bodies, upper=True)})


def test_brokers_found_through_lookupd_as_they_come_and_go(spark, start_broker, start_lookupd, tmp_path):
    """One broker at the start, a second registering the topic mid-stream, then the first stopping."""
    lookupd = start_lookupd()
    flags = (RETAIN, "--broadcast-address=127.0.0.1", f"--lookupd-tcp-address={lookupd.tcp_address}")
    one = start_broker(*flags)
    one_bodies = records("one", 3000)
    publish(one, one_bodies)
    query = start_query(spark, checkpoint=str(tmp_path / "ckpt"), out=str(tmp_path / "out"), topic=TOPIC,
                        lookupd=lookupd.http_address, startingOffsets="earliest", maxOffsetsPerTrigger="1000")
    try:
        wait_until(lambda: read_to(query_offsets(query), one) >= 1000, 120, "a first batch", query)
        two = start_broker(*flags)
        two_bodies = records("two", 2000)
        publish(two, two_bodies)  # creating the topic registers it with the lookupd
        wait_until(lambda: read_to(query_offsets(query), one) == 3000 and read_to(query_offsets(query), two) == 2000,
                   120, "both brokers' records read", query)
        one.stop_cleanly()
        more = records("two", 1000, 2000)
        publish(two, more)
        two_bodies += more
        wait_until(lambda: read_to(query_offsets(query), two) == 3000, 120,
                   "the second broker's later records read after the first left", query)
    finally:
        query.stop()
    rows = spark.read.parquet(str(tmp_path / "out")).select("body", "offset", "nsqd").collect()
    assert_each_record_once(rows, {f"127.0.0.1:{one.tcp_port}": numbered(one_bodies, upper=True),
                                   f"127.0.0.1:{two.tcp_port}": numbered(two_bodies, upper=True)})


# -- secured brokers ----------------------------------------------------------------------------------


def test_over_tls_with_a_secret_the_auth_server_grants(spark, start_broker, certs, tmp_path):
    """IDENTIFY over TLS names the HTTPS port; /topic/offsets and /topic/read go there with the secret.

    The broker requires TLS: its plain HTTP listener turns every request away.
    """
    authd = AuthServer(tmp_path)
    try:
        authd.answers["good"] = grant(SUBSCRIBE)
        broker = start_broker(*tls_flags(certs, "--tls-required=true"), f"--auth-http-address={authd.address}",
                              RETAIN)
        bodies = records("secret", 500)
        https = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                            urllib.request.HTTPSHandler(context=client_context(certs)))
        request = urllib.request.Request(f"https://127.0.0.1:{broker.https_port}/mpub?topic={TOPIC}",
                                         data=b"\n".join(bodies), method="POST")
        with https.open(request, timeout=10) as answer:
            assert answer.read() == b"OK"
        assert http_request(broker.http_address, "GET", f"/topic/offsets?topic={TOPIC}")[0] == 403
        tls = {"topic": TOPIC, "nsqd": broker.tcp_address, "startingOffsets": "earliest", "tls_v1": "true",
               "tls_root_ca_file": str(certs.ca)}
        got = run_available_now(spark, tmp_path / "ckpt", auth_secret="good", **tls)
        assert_each_record_once(got.rows, {broker.tcp_address: numbered(bodies)})

        wrong = failure_line(spark, tmp_path / "wrong", auth_secret="wrong", **tls)
        assert wrong == (f"mqd: nsqd {broker.tcp_address}: AUTH refused (E_AUTH_FAILED AUTH failed): "
                         "the auth server refused the secret (option auth_secret)"), wrong
        missing = failure_line(spark, tmp_path / "missing", **tls)
        assert missing == (f"mqd: nsqd {broker.tcp_address}: AUTH required: it requires a secret "
                           "(option auth_secret)"), missing
    finally:
        authd.close()


# -- a read that cannot start ---------------------------------------------------------------------------


def test_a_read_that_cannot_start_fails_the_query_with_one_clear_line(spark, start_broker, tmp_path):
    broker = start_broker(RETAIN)
    name = broker.tcp_address
    publish(broker, records("x", 3))
    publish(broker, records("x", 3), topic="plain")
    status, answer = http_request(broker.http_address, "POST", "/topic/retention?topic=plain&time=0&bytes=0")
    assert status == 200, answer
    cases = [
        ({"topic": "nosuch"}, f"mqd: topic 'nosuch' does not exist on nsqd {name}"),
        ({"startingOffsets": "{oops"}, "mqd: option startingOffsets: malformed JSON"),
        ({"startingOffsets": json.dumps({TOPIC: {"127.0.0.1:1": 0}})},
         f"mqd: offsets JSON names broker '127.0.0.1:1' for topic '{TOPIC}', which is not one of its brokers"),
        ({"topic": "plain"}, f"mqd: topic plain on nsqd {name}"),
    ]
    for n, (options, expected) in enumerate(cases):
        line = failure_line(spark, tmp_path / f"ckpt{n}", **{"topic": TOPIC, "nsqd": name, **options})
        assert line.startswith(expected), line
    assert "retention is off" in line and "--retention-bytes" in line and "give a channel" in line, line
