"""Replays of a topic's retained log into a channel (mqd.nsqd.replay) and `/channel/replay`.

Each scenario runs on a broker whose topics retain, on the memory store
(its log a MemoryLog in RAM) and on LMDB (an LmdbLog, a key range of the
store) in default and --durable mode, in a temporary directory, driven by
a task.Clock: a replay moves one batch per turn, so the tests turn the
clock reactor-turn by reactor-turn and look at the channel between turns.
"""

from __future__ import annotations

import base64

import pytest
from twisted.internet.defer import fail, succeed
from twisted.internet.task import Clock

from backends.interface import OffsetOutOfRange
from backends.lmdb_retained import LmdbLog
from backends.memory_log import MemoryLog
from mqd.http.auth import AuthError
from mqd.nsqd import replay as replay_module
from mqd.nsqd.replay import BATCH_RECORDS, Replay, replay_into
from tests.support.auth_fakes import answer
from tests.support.http_client import HTTPClient, error
from tests.support.inprocess_broker import START_TIME, new_broker
from tests.support.reactor_turns import turn as reactor_turn
from tests.support.v2_client import Client
from tests.support.v2_frames import cmd, identify, ok

MODES = {
    "memory": {"backend": "memory"},
    "lmdb": {"backend": "lmdb"},
    "durable": {"backend": "lmdb", "durable": True},
}
DAY_MS = 86_400_000
RETAIN = 1 << 30


def make(tmp_path, mode: str = "memory", clock: Clock | None = None, **flags):
    """A broker of `mode` whose topics retain (1 GiB), on its own clock at START_TIME."""
    if clock is None:
        clock = Clock()
        clock.advance(START_TIME)
    flags.setdefault("retention_bytes", RETAIN)
    flags.setdefault("max_heartbeat_interval", "24h")
    return new_broker(tmp_path, clock, **MODES[mode], **flags)


@pytest.fixture(params=list(MODES))
def broker(request, tmp_path):
    b = make(tmp_path, request.param)
    yield b
    b.close()


def client(broker, port: int, rdy: int | None = None, channel: str = "c", topic: str = "t") -> Client:
    """A subscribed consumer with heartbeats once a day, RDY `rdy` (none sent when None)."""
    c = Client(broker, port=port)
    assert c.request(identify(heartbeat_interval=DAY_MS)) == [ok()]
    c.sub(topic, channel, rdy)
    return c


def retained(broker, msgs: list[bytes], topic: str = "t") -> None:
    """Publish `msgs` to a topic that has a channel ("sink"), so none waits at the topic for a new channel."""
    t = broker.topic(topic)
    t.channel("sink")
    t.publish(msgs)
    broker.clock.advance(0)  # a durable store's commit: the records become readable


def bodies(n: int, start: int = 0) -> list[bytes]:
    return [b"m%d" % i for i in range(start, start + n)]


def turn(broker, times: int = 1) -> None:
    """`times` reactor turns: calls scheduled for now during a turn wait for the next (as a reactor runs them)."""
    for _ in range(times):
        reactor_turn(broker.clock)


def run_out(broker, channel, limit: int = 10_000) -> int:
    """Turn the clock until the channel's replay has ended; how many turns it took."""
    for n in range(limit):
        if channel.replay is None:
            return n
        turn(broker)
    raise AssertionError(f"the replay of {channel!r} still runs after {limit} turns")


def drain(c: Client, broker, fin: bool = True, turns: int = 10_000) -> list:
    """Every message the consumer gets while the clock turns, FINished as they come (unless not `fin`)."""
    got = []
    idle = 0
    for _ in range(turns):
        msgs = c.messages()
        if msgs:
            idle = 0
            got += msgs
            if fin:
                for m in msgs:
                    c.fin(m)
        else:
            idle += 1
            if idle > 3:
                return got
        turn(broker)
    return got


def start(broker, offset: int | str = "earliest", topic: str = "t", channel: str = "c") -> Replay:
    t = broker.topics[topic]
    log = t.log
    assert log is not None
    begin = {"earliest": log.earliest(), "latest": log.latest()}.get(offset, offset)
    return replay_into(t, t.channel(channel), log, begin, log.latest(), clock=broker.clock,
                       bound=broker.options.mem_queue_size)


# -- order, ids, attempts ------------------------------------------------------------


def test_the_log_replayed_is_the_stores_own(broker):
    expected = {"memory": MemoryLog, "lmdb": LmdbLog}[broker.options.backend]
    assert isinstance(broker.topic("t").log, expected)


def test_a_replay_from_offset_0_delivers_every_record_again_in_order_with_its_id(broker):
    c = client(broker, 6000, rdy=50)
    retained(broker, bodies(300))
    first = drain(c, broker)
    assert [m.body for m in first] == bodies(300)
    channel = broker.topics["t"].channels["c"]
    assert channel.depth() == channel.in_flight_count() == 0

    r = start(broker, 0)
    assert (r.start, r.end, r.epoch) == (0, 300, broker.topics["t"].log.epoch)
    again = drain(c, broker)
    assert [m.body for m in again] == bodies(300)
    assert [m.id for m in again] == [m.id for m in first]
    assert [m.timestamp for m in again] == [m.timestamp for m in first]
    assert {m.attempts for m in again} == {1}
    assert channel.replay is None and r.reason == "end"
    assert (r.position, r.queued, r.duplicates, r.skipped) == (300, 300, 0, 0)


def test_a_replay_from_the_middle_queues_only_the_rest(broker):
    retained(broker, bodies(10))
    c = client(broker, 6000, rdy=100)
    start(broker, 4)
    assert [m.body for m in drain(c, broker)] == bodies(6, 4)


def test_records_published_after_the_request_are_not_replayed_but_published_once(broker):
    retained(broker, bodies(5))
    c = client(broker, 6000, rdy=100)
    r = start(broker, 0)
    retained(broker, [b"late"])
    got = [m.body for m in drain(c, broker)]
    assert r.end == 5
    assert sorted(got) == sorted(bodies(5) + [b"late"])


def test_a_replay_queues_one_bounded_batch_per_turn(tmp_path):
    broker = make(tmp_path, mem_queue_size=100_000)
    retained(broker, bodies(2500))
    r = start(broker, 0, channel="idle")
    channel = broker.topics["t"].channels["idle"]
    turn(broker)  # gathers what the channel holds, then the first batch
    assert channel.depth() == BATCH_RECORDS
    turn(broker)
    assert channel.depth() == 2 * BATCH_RECORDS
    run_out(broker, channel)
    assert channel.depth() == 2500 and r.reason == "end"


# -- what the channel already holds ---------------------------------------------------


def test_messages_the_channel_holds_queued_in_flight_or_deferred_are_not_queued_again(broker):
    holder = client(broker, 6000)
    retained(broker, bodies(20))
    holder.send(cmd("RDY", 5))
    got = holder.messages()
    assert [m.body for m in got] == bodies(5)
    holder.send(cmd("RDY", 0))
    holder.req(got[0], 60_000)  # m0 deferred; m1..m4 in flight; m5..m19 queued
    turn(broker)
    channel = broker.topics["t"].channels["c"]
    assert (channel.deferred_count(), channel.in_flight_count(), channel.depth()) == (1, 4, 15)

    r = start(broker, 0)
    run_out(broker, channel)
    assert (r.queued, r.duplicates) == (0, 20)
    assert channel.depth() == 15


def test_held_messages_are_skipped_and_the_rest_replayed_once(broker):
    retained(broker, bodies(10))
    holder = client(broker, 6000)
    retained(broker, bodies(10, 10))  # the channel exists since: it holds m10..m19
    channel = broker.topics["t"].channels["c"]
    assert channel.depth() == 10
    r = start(broker, 0)
    run_out(broker, channel)
    assert (r.queued, r.duplicates) == (10, 10)
    holder.send(cmd("RDY", 100))
    got = drain(holder, broker)
    assert sorted(m.body for m in got) == sorted(bodies(20))


def test_a_message_in_flight_when_its_record_comes_up_is_skipped(broker):
    """Held or not at the start, a message in flight when the replay reaches it is not queued twice."""
    retained(broker, bodies(3))
    r = start(broker, 0)
    channel = broker.topics["t"].channels["c"]
    turn(broker)  # nothing held: the gathering ends, the batch is queued
    assert channel.depth() == 3 and r.queued == 3
    holder = client(broker, 6000, rdy=3)
    turn(broker)  # a durable store hands them out once committed
    got = holder.messages()
    assert len(got) == 3
    # The same range again while they are in flight: each is skipped live.
    r2 = start(broker, 0)
    run_out(broker, channel)
    assert (r2.queued, r2.duplicates) == (0, 3)


def test_messages_leaving_the_backend_while_ids_are_gathered_are_still_skipped(tmp_path, monkeypatch):
    """LMDB with a small memory queue: the backend is read a piece per turn while a consumer drains it."""
    monkeypatch.setattr(replay_module, "GATHER_PER_TURN", 100)
    broker = make(tmp_path, "lmdb", mem_queue_size=10)
    holder = client(broker, 6000)
    retained(broker, bodies(3000))
    channel = broker.topics["t"].channels["c"]
    assert channel.backend_depth() > 2000
    r = start(broker, 0)
    holder.send(cmd("RDY", 200))
    got = []
    gathering = 0
    while channel.replay is not None:
        gathering += r.position == 0
        msgs = holder.messages()
        got += msgs
        for m in msgs:
            holder.fin(m)
        turn(broker)
    got += drain(holder, broker)
    assert gathering > 5  # the ids were gathered over several turns, the consumer taking messages meanwhile
    assert r.duplicates == 3000 and r.queued == 0
    assert sorted(m.body for m in got) == sorted(bodies(3000))
    broker.close()


# -- the memory bound -----------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_the_replay_never_queues_more_than_mem_queue_size(tmp_path, mode):
    broker = make(tmp_path, mode, mem_queue_size=50)
    retained(broker, bodies(1000))
    channel = broker.topics["t"].channel("c")
    # In default mode nothing goes to the backend; with --durable every queued message is there.
    in_memory = not broker.store.durable
    r = start(broker, 0)
    for _ in range(20):
        turn(broker)
        assert channel.depth() <= 50 and (channel.backend_depth() == 0 or not in_memory)
    assert channel.depth() == 50
    c = client(broker, 6000, rdy=7)
    seen = 0
    for _ in range(5000):
        msgs = c.messages()
        seen += len(msgs)
        for m in msgs:
            c.fin(m)
        assert channel.depth() <= 50 and (channel.backend_depth() == 0 or not in_memory)
        if channel.replay is None and not msgs and not channel.depth():
            break
        turn(broker)
    assert seen == 1000 and r.queued == 1000
    broker.close()


def test_a_waiting_replay_is_woken_by_the_drain_not_by_a_timer(tmp_path):
    broker = make(tmp_path, mem_queue_size=100)
    retained(broker, bodies(500))
    start(broker, 0)
    channel = broker.topics["t"].channels["c"]
    turn(broker, 3)
    assert channel.depth() == 100
    # Waiting: only the safety poll is scheduled.
    assert [round(call.getTime() - broker.clock.seconds(), 3) for call in broker.clock.getDelayedCalls()
            if getattr(call.func, "__self__", None) is channel.replay] == [replay_module.WAIT_POLL]
    c = client(broker, 6000, rdy=60)  # takes 60: the queue is at 40, below the low-water mark (50)
    assert len(c.messages()) == 60
    turn(broker)
    assert channel.depth() == 100


def test_a_channel_with_a_backlog_in_its_backend_waits_for_it_to_drain(tmp_path):
    broker = make(tmp_path, "lmdb", mem_queue_size=10)
    client(broker, 6000)
    retained(broker, bodies(100))
    channel = broker.topics["t"].channels["c"]
    assert channel.depth() == 100
    r = start(broker, 0)
    turn(broker, 5)
    assert channel.depth() == 100 and r.queued == 0 and r.position == 0
    broker.close()


# -- stopping -----------------------------------------------------------------------


def test_stop_ends_it_where_it_is(broker):
    retained(broker, bodies(5000))
    r = start(broker, 0)
    channel = broker.topics["t"].channels["c"]
    turn(broker, 2)
    position = r.position
    assert 0 < position < 5000
    r.stop()
    assert channel.replay is None and r.reason == "stopped"
    turn(broker, 5)
    assert r.position == position and channel.depth() == position


def test_a_new_replay_replaces_the_running_one(broker):
    retained(broker, bodies(5000))
    first = start(broker, 0)
    turn(broker, 2)
    second = start(broker, 4000)
    channel = broker.topics["t"].channels["c"]
    assert channel.replay is second and not first.running
    run_out(broker, channel)
    assert second.queued == 1000


@pytest.mark.parametrize("how", ["empty", "delete channel", "delete topic"])
def test_emptying_or_deleting_stops_it(broker, how):
    retained(broker, bodies(5000))
    r = start(broker, 0)
    topic = broker.topics["t"]
    channel = topic.channels["c"]
    turn(broker, 2)
    if how == "empty":
        channel.empty()
    elif how == "delete channel":
        topic.delete_channel("c")
    else:
        broker.delete_topic("t")
    assert not r.running and channel.replay is None
    turn(broker, 3)
    assert channel.depth() == 0


def test_retention_turned_off_under_it_stops_it(broker):
    retained(broker, bodies(5000))
    r = start(broker, 0)
    turn(broker, 2)
    broker.set_retention(broker.topics["t"], 0, 0)
    turn(broker)
    assert r.reason == "retention off"


# -- records expiring under it --------------------------------------------------------


def test_records_expiring_under_it_are_counted_and_it_goes_on_from_the_earliest(tmp_path):
    broker = make(tmp_path, mem_queue_size=100)
    retained(broker, bodies(1000))
    topic = broker.topics["t"]
    channel = topic.channel("c")
    r = start(broker, 0)
    turn(broker, 3)
    assert r.position == 100
    # The channel drains nothing; meanwhile half the log expires.
    dropped = topic.log.expire(0, topic.log.retained_bytes() // 2)
    earliest = topic.log.earliest()
    assert dropped == earliest > 100
    c = client(broker, 6000, rdy=1000)
    got = drain(c, broker)
    assert r.skipped == earliest - 100
    assert [m.body for m in got] == bodies(100) + bodies(1000 - earliest, earliest)
    assert channel.replay is None and r.reason == "end"


def test_offset_out_of_range_names_the_bounds():
    e = OffsetOutOfRange(3, 5, 9)
    assert (e.offset, e.earliest, e.latest) == (3, 5, 9)


# -- /stats ---------------------------------------------------------------------------


def test_stats_show_the_replay_only_while_it_runs(broker):
    http = HTTPClient(broker)
    retained(broker, bodies(5000))
    r = start(broker, 0)
    turn(broker, 2)

    def channel_row():
        topics = http.get("/stats?format=json").json()["topics"]
        return next(t for t in topics if t["topic_name"] == "t")["channels"][0]

    assert channel_row()["replay"] == {"position": r.position, "end": 5000, "epoch": r.epoch, "skipped": 0}
    run_out(broker, broker.topics["t"].channels["c"])
    assert "replay" not in channel_row()


# -- HTTP -----------------------------------------------------------------------------


def test_post_starts_a_replay_and_delete_stops_it(broker):
    http = HTTPClient(broker)
    retained(broker, bodies(5000))
    answer = http.post("/channel/replay?topic=t&channel=new&offset=earliest")
    assert answer.status == 200 and answer.v1 and answer.is_json
    epoch = broker.topics["t"].log.epoch
    assert answer.json() == {"topic": "t", "channel": "new", "epoch": epoch, "start": 0, "end": 5000}
    channel = broker.topics["t"].channels["new"]
    turn(broker, 2)
    position = channel.replay.position
    stopped = http.request("DELETE", "/channel/replay?topic=t&channel=new")
    assert stopped.status == 200 and stopped.json() == {"stopped": True, "position": position}
    assert channel.replay is None
    assert error(http.request("DELETE", "/channel/replay?topic=t&channel=new")) == (404, "REPLAY_NOT_FOUND")


def test_post_by_offset_and_by_timestamp(broker):
    http = HTTPClient(broker)
    retained(broker, bodies(3))
    broker.clock.advance(10)
    retained(broker, bodies(3, 3))
    assert http.post("/channel/replay?topic=t&channel=c&offset=2").json()["start"] == 2
    assert http.post("/channel/replay?topic=t&channel=c&offset=latest").json()["start"] == 6
    ms = int((START_TIME + 5) * 1000)
    answer = http.post(f"/channel/replay?topic=t&channel=c&timestamp={ms}").json()
    assert (answer["start"], answer["end"]) == (3, 6)
    assert http.post("/channel/replay?topic=t&channel=c&timestamp=9999999999999999999").json()["start"] == 6
    assert http.post("/channel/replay?topic=t&channel=c&timestamp=0").json()["start"] == 0


@pytest.mark.parametrize(("query", "status", "message"), [
    ("channel=c&offset=0", 400, "MISSING_ARG_TOPIC"),
    ("topic=b@d&channel=c&offset=0", 400, "INVALID_TOPIC"),
    ("topic=t&offset=0", 400, "MISSING_ARG_CHANNEL"),
    ("topic=t&channel=b@d&offset=0", 400, "INVALID_CHANNEL"),
    ("topic=t&channel=c", 400, "INVALID_OFFSET"),
    ("topic=t&channel=c&offset=0&timestamp=0", 400, "INVALID_OFFSET"),
    ("topic=t&channel=c&offset=-1", 400, "INVALID_OFFSET"),
    ("topic=t&channel=c&offset=first", 400, "INVALID_OFFSET"),
    ("topic=t&channel=c&offset=99999999999999999999", 400, "INVALID_OFFSET"),
    ("topic=t&channel=c&offset=9223372036854775808", 400, "INVALID_OFFSET"),
    ("topic=t&channel=c&timestamp=1.5", 400, "INVALID_TIMESTAMP"),
    ("topic=t&channel=c&timestamp=99999999999999999999", 400, "INVALID_TIMESTAMP"),
    ("topic=nope&channel=c&offset=0", 404, "TOPIC_NOT_FOUND"),
])
def test_post_errors(broker, query, status, message):
    http = HTTPClient(broker)
    retained(broker, bodies(3))
    assert error(http.post(f"/channel/replay?{query}")) == (status, message)
    assert "c" not in broker.topics["t"].channels


def test_an_offset_out_of_range_is_416_with_the_bounds(broker):
    http = HTTPClient(broker)
    retained(broker, bodies(3))
    for offset in ("4", "9223372036854775807"):
        answer = http.post(f"/channel/replay?topic=t&channel=c&offset={offset}")
        assert answer.status == 416 and answer.v1 and answer.is_json
        assert answer.json() == {"message": "OFFSET_OUT_OF_RANGE", "earliest": 0, "latest": 3}
    assert "c" not in broker.topics["t"].channels


def test_a_topic_without_retention_is_retention_off(tmp_path):
    broker = make(tmp_path, retention_bytes=0)
    http = HTTPClient(broker)
    retained(broker, bodies(3))
    assert error(http.post("/channel/replay?topic=t&channel=c&offset=0")) == (400, "RETENTION_OFF")
    assert error(http.request("DELETE", "/channel/replay?topic=t&channel=c")) == (404, "REPLAY_NOT_FOUND")
    assert error(http.request("DELETE", "/channel/replay?topic=x&channel=c")) == (404, "TOPIC_NOT_FOUND")


def test_get_is_not_allowed(broker):
    http = HTTPClient(broker)
    assert http.get("/channel/replay?topic=t&channel=c").status == 405


def test_a_replayed_channel_through_http_delivers_the_bodies(broker):
    http = HTTPClient(broker)
    retained(broker, bodies(50))
    assert http.post("/channel/replay?topic=t&channel=fresh&offset=10").status == 200
    c = client(broker, 6000, rdy=100, channel="fresh")
    assert [m.body for m in drain(c, broker)] == bodies(40, 10)
    peeked = http.get("/channel/peek?topic=t&channel=fresh")
    assert peeked.status == 200 and [base64.b64decode(m["body"]) for m in peeked.json()["messages"]] == []


def test_under_http_auth_required_it_needs_admin_on_the_topic_and_the_channel(tmp_path):
    answers = {
        "ops": answer(authorizations=[{"topic": "^t$", "channels": ["^c$"], "permissions": [], "admin": True}]),
        "other": answer(authorizations=[{"topic": "^t$", "channels": ["^x$"], "permissions": [], "admin": True}]),
        "reader": answer(authorizations=[{"topic": ".*", "channels": [".*"], "permissions": ["subscribe"]}]),
    }
    broker = make(tmp_path, auth_http_address=["127.0.0.1:4181"], http_auth_required=True)
    broker.auth.fetch_function = lambda url, method, params: (
        succeed(answers[params["secret"]]) if params["secret"] in answers else fail(AuthError("403")))
    http = HTTPClient(broker)
    retained(broker, bodies(3))
    path = "/channel/replay?topic=t&channel=c&offset=0"
    assert error(http.post(path)) == (401, "AUTH_REQUIRED")
    for secret in ("other", "reader"):
        assert error(http.post(path, headers={"Authorization": f"Bearer {secret}"})) == (403, "UNAUTHORIZED")
    assert "c" not in broker.topics["t"].channels
    # The names are checked as the endpoint checks them, with its texts, before the grant.
    assert error(http.post("/channel/replay?topic=t&channel=b@d&offset=0",
                           headers={"Authorization": "Bearer ops"})) == (400, "INVALID_CHANNEL")
    assert http.post(path, headers={"Authorization": "Bearer ops"}).status == 200
    stopped = http.request("DELETE", "/channel/replay?topic=t&channel=c", headers={"Authorization": "Bearer ops"})
    assert stopped.status == 200
