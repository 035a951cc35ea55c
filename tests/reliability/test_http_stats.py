"""Auth grants matched in linear time, odd client strings in the stats pages,
metadata writes and stats cost at many topics, and client errors answered
4xx by the HTTP API (never 500).
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mqd.http.auth import AuthError, parse_auth_response
from tests.support.auth_fuzz import AUTH_ADDRESS, REFUSED_AS, FakeAuthServer, caller
from tests.support.fuzz_inputs import EXAMPLES_OVERRIDE
from tests.support.http_client import HTTPClient, error, parse_response
from tests.support.inprocess_broker import new_broker
from tests.support.v2_client import Client
from tests.support.v2_frames import cmd, err, ok, sized

# -- auth grants are matched in linear time --------------------------------

# Nested quantifiers: backtracking tries every split of the name before failing.
EVIL_GRANT = r"^([a-z0-9]+[-_.]?)+$"
# A valid topic name (64 chars, the longest nsqd allows) that misses only at its end.
NEAR_MISS = "a" * 63 + "A"


def _auth_answer(topic: str, channels: list[str] | None = None) -> bytes:
    return json.dumps({"ttl": 60, "identity": "i", "identity_url": "",
                       "authorizations": [{"topic": topic, "channels": channels or [".*"],
                                           "permissions": ["subscribe", "publish"]}]}).encode()


@pytest.fixture
def auth_client(make_broker, tmp_path):
    """connect(answer): a client of a broker with auth on, AUTHed with `answer` as the server's reply."""
    path = tmp_path / "auth"
    path.mkdir()
    broker = make_broker(path=str(path), auth_http_address=["127.0.0.1:4181"])
    ports = iter(range(40000, 41000))

    def connect(answer: bytes) -> Client:
        from twisted.internet.defer import succeed

        broker.auth.fetch_function = lambda url, method, params: succeed(answer)
        c = Client(broker, port=next(ports))
        return c

    return connect


def test_evil_grant_near_miss_answers_at_once(auth_client):
    # With Python's backtracking re this PUB took ~2^60 steps (hours; 5-8 s at 28 chars).
    c = auth_client(_auth_answer(EVIL_GRANT))
    [frame] = c.request(cmd("AUTH") + sized(b"s"))
    assert frame.type == 0
    assert c.request(cmd("PUB", NEAR_MISS) + sized(b"x")) == [
        err(f'E_UNAUTHORIZED AUTH failed for PUB on "{NEAR_MISS}" ""')]


def test_evil_grant_still_matches_what_it_should():
    state = parse_auth_response(_auth_answer(EVIL_GRANT), 0.0)
    assert state.allows("orders-eu.v2", "")
    assert not state.allows(NEAR_MISS, "")
    subscribe = parse_auth_response(_auth_answer(".*", [EVIL_GRANT]), 0.0)
    assert subscribe.allows("t", "archive_1")
    assert not subscribe.allows("t", "a" * 63 + "A")


@pytest.mark.parametrize("pattern", [
    "(?=x)",  # lookahead: Python has it, Go's regexp (RE2) does not
    r"(a)\1",  # backreference
    r"\C",  # RE2 accepts it, Go explicitly does not
    r"x\Z",
    "a{1001}",
    "(",
])
def test_grants_go_cannot_compile_fail_auth(auth_client, pattern):
    # nsqd's QueryAuthd: a topic or channel regexp.Compile error fails the whole answer.
    with pytest.raises(AuthError):
        parse_auth_response(_auth_answer(pattern), 0.0)
    with pytest.raises(AuthError):
        parse_auth_response(_auth_answer(".*", [".*", pattern]), 0.0)
    c = auth_client(_auth_answer(pattern))
    assert c.request(cmd("AUTH") + sized(b"s")) == [err("E_AUTH_FAILED AUTH failed")]
    assert c.closed


@pytest.mark.parametrize("pattern, topic, allowed", [
    (r"\Qa.b\E", "a.b", True),
    (r"\Qa.b\E", "axb", False),
    (r"\Q\C\E", "x", False),  # \C quoted is literal text, which Go accepts
    (r"[\d]+$", "t123", True),
    (r"(?i)^ORD", "orders", True),
    (r"(?P<x>or)ders", "orders", True),
])
def test_go_grant_syntax_still_accepted(pattern, topic, allowed):
    state = parse_auth_response(_auth_answer(pattern), 0.0)
    assert state.allows(topic, "") is allowed


def test_grant_lone_surrogate_is_a_replacement_char():
    # Go's JSON decoder turns an invalid \ud800 into U+FFFD; the grant compiles.
    body = b'{"ttl":60,"authorizations":[{"topic":"^a\\ud800?$","channels":[".*"],"permissions":["publish"]}]}'
    state = parse_auth_response(body, 0.0)
    assert state.allows("a", "")


# -- a client's odd strings do not break the stats pages -------------------

# IDENTIFY with lone surrogates, as json.dumps writes them: "\ud800" escapes.
ODD_IDENTIFY = cmd("IDENTIFY") + sized(
    b'{"hostname":"h\\ud800st","user_agent":"ua\\udfff/1","client_id":"c\\ud83d"}')


@pytest.fixture
def odd_client(connect):
    """A subscribed and publishing client whose IDENTIFY strings hold lone surrogates."""
    c = connect()
    assert c.request(ODD_IDENTIFY)[0].type == 0
    assert c.request(cmd("PUB", "t") + sized(b"x")) == [ok()]
    c.sub("t", "c")
    return c


def test_stats_text_with_lone_surrogates_is_200(http, odd_client):
    r = http.get("/stats")
    assert r.status == 200
    text = r.body.decode("utf-8")  # valid UTF-8, as Go writes it
    # Go's JSON decoder made each lone surrogate U+FFFD before nsqd ever printed it.
    assert "h\ufffdst:" in text and "ua\ufffd/1" in text
    assert text.count("h\ufffdst:") == 2  # the consumer line and the producer line


def test_stats_json_with_lone_surrogates_is_valid(http, odd_client):
    r = http.get("/stats?format=json")
    assert r.status == 200
    body = json.loads(r.body.decode("utf-8"))
    [row] = body["topics"][0]["channels"][0]["clients"]
    assert (row["hostname"], row["user_agent"], row["client_id"]) == ("h\ufffdst", "ua\ufffd/1", "c\ufffd")
    [producer] = body["producers"]
    assert producer["hostname"] == "h\ufffdst"
    # Strictly valid JSON text: no unpaired \ud800-style escape left in it.
    assert b"\\ud8" not in r.body.lower() and b"\\udf" not in r.body.lower()


def test_metrics_and_filters_with_lone_surrogates(http, odd_client):
    assert http.get("/metrics").status == 200
    assert http.get("/stats?topic=t&channel=c").status == 200
    assert http.get("/stats?format=text&include_clients=true").status == 200


def test_auth_identity_with_lone_surrogate(auth_client, make_broker):
    body = (b'{"ttl":60,"identity":"al\\udc00ce","identity_url":"http://id/\\ud800",'
            b'"authorizations":[{"topic":".*","channels":[".*"],"permissions":["publish"]}]}')
    c = auth_client(body)
    [frame] = c.request(cmd("AUTH") + sized(b"s"))
    # The AUTH answer is JSON too: valid UTF-8, with Go's U+FFFD.
    assert json.loads(frame.payload.decode("utf-8"))["identity"] == "al\ufffdce"
    assert c.request(cmd("PUB", "t") + sized(b"x")) == [ok()]
    r = HTTPClient(c.broker).get("/stats?format=json")
    assert r.status == 200
    [producer] = r.json()["producers"]
    assert (producer["auth_identity"], producer["auth_identity_url"]) == ("al\ufffdce", "http://id/\ufffd")
    assert b"\\udc00" not in r.body and b"\\ud800" not in r.body


# -- client errors are 4xx, never 500 ----------------------------------------


def test_config_deep_json_is_invalid_value(http):
    deep = b"[" * 100_000 + b"]" * 100_000
    r = http.put("/config/nsqlookupd_tcp_addresses", deep)
    assert error(r) == (400, "INVALID_VALUE")
    assert http.get("/config/nsqlookupd_tcp_addresses").json() == []


@pytest.fixture
def snap_broker(tmp_path, clock, monkeypatch):
    """An lmdb broker whose snapshots run in the test's thread, and its HTTP client."""
    from twisted.internet import defer

    import mqd.nsqd.http.snapshot as endpoint

    monkeypatch.setattr(endpoint.threads, "deferToThread",
                        lambda f, *a, **kw: defer.maybeDeferred(f, *a, **kw))
    brokers = []

    def make(**flags):
        broker = new_broker(tmp_path / f"b{len(brokers)}", clock, backend="lmdb", **flags)
        brokers.append(broker)
        return broker, HTTPClient(broker)

    yield make
    for broker in brokers:
        broker.close()


@pytest.mark.parametrize("out, message", [
    (".", "INVALID_OUT"),
    ("a" * 300, "INVALID_OUT"),
    ("file/x", "INVALID_OUT"),
    ("%ff", "INVALID_OUT"),
    (".hidden", "INVALID_OUT"),
    ("taken", "OUT_EXISTS"),
])
def test_snapshot_bad_out_is_400(snap_broker, out, message):
    broker, http = snap_broker()
    snapshots = os.path.join(broker.data_path, "snapshots")
    os.makedirs(snapshots)
    open(os.path.join(snapshots, "file"), "w").close()
    os.mkdir(os.path.join(snapshots, "taken"))
    before = sorted(os.listdir(snapshots))
    assert error(http.post(f"/snapshot?out={out}")) == (400, message)
    assert sorted(os.listdir(snapshots)) == before
    assert broker.store.copies == 0


def test_snapshot_never_writes_through_a_symlink(snap_broker, tmp_path):
    broker, http = snap_broker()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    snapshots = os.path.join(broker.data_path, "snapshots")
    os.makedirs(snapshots)
    # A symlink at the destination name (dangling or not) is a name taken.
    os.symlink(elsewhere, os.path.join(snapshots, "link"))
    os.symlink(elsewhere / "nothing", os.path.join(snapshots, "dangling"))
    assert error(http.post("/snapshot?out=link")) == (400, "OUT_EXISTS")
    assert error(http.post("/snapshot?out=dangling")) == (400, "OUT_EXISTS")
    # The snapshots directory itself a symlink: refused, nothing written there.
    os.rename(snapshots, str(tmp_path / "old"))
    os.symlink(elsewhere, snapshots)
    assert error(http.post("/snapshot?out=s1")) == (500, "SNAPSHOT_FAILED")
    assert os.listdir(elsewhere) == []
    assert broker.store.copies == 0


def test_snapshots_disk_use_is_bounded(snap_broker):
    from mqd.nsqd.http.snapshot import disk_use

    broker, http = snap_broker()
    assert http.post("/pub?topic=t", b"x" * 1000).status == 200
    broker.clock.advance(0)
    first = http.post("/snapshot?out=one")
    assert first.status == 200, first.body
    snapshots = os.path.join(broker.data_path, "snapshots")
    used = disk_use(snapshots)
    assert used > 0
    # Room for what is there and not for one more: refused, nothing removed.
    broker.update_options(snapshot_max_bytes=used + 1)
    assert error(http.post("/snapshot?out=two")) == (507, "SNAPSHOT_LIMIT")
    assert sorted(os.listdir(snapshots)) == ["one"]
    broker.update_options(snapshot_max_bytes=0)
    assert http.post("/snapshot?out=two").status == 200


_KEYS = ["topic", "channel", "out", "format", "include_clients", "include_mem", "defer", "binary", "x"]
_VALUES = st.one_of(
    st.sampled_from(["t", "c", "json", "text", "true", "0", "-1", "1e9", "99999999999999999999",
                     "t#ephemeral", "", ".", "a" * 300, "%ff", "%00", "%", "%zz", "+", ";"]),
    st.text(max_size=20),
)


def _escape(value: str) -> str:
    """Mostly percent-encoded, sometimes raw: the broker must cope with both."""
    return quote(value.encode("utf-8", "surrogatepass"), safe="%+;/")


@st.composite
def _requests(draw):
    from mqd.nsqd.http.site import NsqdAPI
    from mqd.nsqd.http.state import HttpState

    paths = sorted(NsqdAPI(None, {}, HttpState(None, None)).routes) + ["/config/nsqlookupd_tcp_addresses", "/config/log_level",
                                                "/config/" + draw(st.text(min_size=1, max_size=10).filter(
                                                    lambda s: "/" not in s))]
    path = draw(st.sampled_from(paths))
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS"]))
    fields = draw(st.lists(st.tuples(st.sampled_from(_KEYS), _VALUES), max_size=4))
    query = "&".join(f"{k}={_escape(v)}" for k, v in fields)
    body = draw(st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"[" * 5000, b'["\\ud800:4160"]', b'["' + b"a" * 70000 + b'"]', b"null", b"[1]",
                         b'{"a":1}', b"DEBUG", b"\xff\xfe", b"\x00\x00\x00\x02\x00\x00\x00\x01x"])))
    return method, quote(path.encode("utf-8", "surrogatepass"), safe="/") + ("?" + query if query else ""), body


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_requests())
@example(request=("PUT", "/config/nsqlookupd_tcp_addresses", b"[" * 5000))
@example(request=("POST", "/snapshot?out=%ff", b""))
def test_no_endpoint_answers_500_to_client_input(http, request):
    method, uri, body = request
    r = http.request(method, uri, body if method in ("POST", "PUT") else None)
    assert r.status != 500, (method, uri, body[:80], r.body[:200])


# -- metadata writes off the reactor, coalesced; stats cheap at many channels --


class Jobs:
    """A stand-in for the thread pool: keeps each job until the test runs it."""

    def __init__(self) -> None:
        self.pending: list = []

    def __call__(self, f, *args):
        from twisted.internet.defer import Deferred

        d = Deferred()
        self.pending.append((f, args, d))
        return d

    def run(self, error: Exception | None = None) -> None:
        f, args, d = self.pending.pop(0)
        if error is not None:
            d.errback(error)
            return
        f(*args)
        d.callback(None)


def _meta(broker) -> dict:
    with open(broker.metadata.path, "rb") as f:
        return json.load(f)


def _names(broker) -> list[str]:
    return [t["name"] for t in _meta(broker)["topics"] or ()]


@pytest.fixture
def jobs(inproc_broker):
    inproc_broker.metadata.runner = runner = Jobs()
    return runner


def test_metadata_written_off_the_reactor_once_per_burst(inproc_broker, clock, jobs, publish):
    publish(b"x", topic="t0")
    clock.advance(0)
    # The reactor only took the state: the file is written by the job.
    assert len(jobs.pending) == 1 and _names(inproc_broker) == []
    for i in range(1, 200):
        publish(b"x", topic=f"t{i}")
        clock.advance(0)
    assert len(jobs.pending) == 1  # one write at a time; the burst waits for the next
    jobs.run()
    assert _names(inproc_broker) == ["t0"]
    clock.advance(0)
    assert len(jobs.pending) == 1
    jobs.run()
    assert _names(inproc_broker) == [f"t{i}" for i in range(200)]
    clock.advance(0)
    assert jobs.pending == []  # nothing changed since


def test_pause_answers_after_the_write(inproc_broker, clock, jobs, http):
    inproc_broker.topic("t").channel("c")
    clock.advance(0)
    jobs.run()
    for path, paused in (("/topic/pause?topic=t", (True, False)),
                         ("/channel/pause?topic=t&channel=c", (True, True)),
                         ("/topic/unpause?topic=t", (False, True))):
        transport = http.send("POST", path, b"")
        assert parse_response(transport.value()) is None  # not answered before the write
        assert len(jobs.pending) == 1
        jobs.run()
        r = parse_response(transport.value())
        assert r is not None and r.status == 200 and r.body == b""
        topic = _meta(inproc_broker)["topics"][0]
        assert (topic["paused"], topic["channels"][0]["paused"]) == paused


def test_failed_write_is_retried_and_latest_state_wins(inproc_broker, clock, jobs):
    inproc_broker.topic("a")
    clock.advance(0)
    jobs.run(OSError(28, "No space left on device"))
    inproc_broker.topic("b")
    clock.advance(0)
    assert jobs.pending == []  # waits for the retry delay
    clock.advance(1.0)
    assert len(jobs.pending) == 1
    inproc_broker.topic("c")
    # A synchronous write (shutdown) while a thread write of an older state waits:
    inproc_broker.metadata.write_now()
    assert _names(inproc_broker) == ["a", "b", "c"]
    jobs.run()  # the older state does not replace the newer
    assert _names(inproc_broker) == ["a", "b", "c"]


def test_close_writes_the_final_metadata_synchronously(inproc_broker, clock, jobs):
    inproc_broker.topic("a")
    clock.advance(0)
    inproc_broker.topic("b").channel("c")
    inproc_broker.close()
    assert _names(inproc_broker) == ["a", "b"]
    jobs.run()
    clock.advance(5)
    assert jobs.pending == [] and _names(inproc_broker) == ["a", "b"]


def _calls_per_channel(broker, http, path: str, n: int = 500) -> float:
    """Python-level calls an answer makes per channel: a step count, not a timing."""
    import sys

    def calls() -> int:
        seen = [0]

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                seen[0] += 1

        sys.setprofile(profile)
        try:
            assert http.get(path).status == 200
        finally:
            sys.setprofile(None)
        return seen[0]

    topic = broker.topic("t")
    base = calls()
    for i in range(n):
        topic.channel(f"c{i:05d}")
    return (calls() - base) / n


def test_metrics_cost_per_channel(inproc_broker, http):
    # /metrics made ~200 calls per channel (a sample object, label escaping and
    # number formatting per field); 20k channels held the reactor for seconds.
    assert _calls_per_channel(inproc_broker, http, "/metrics") < 50


@pytest.mark.parametrize("path", ["/stats", "/stats?format=json"])
def test_stats_cost_per_channel_stays_bounded(inproc_broker, http, path):
    assert _calls_per_channel(inproc_broker, http, path) < 30


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(out=st.one_of(st.text(max_size=260), st.sampled_from([".", "..", "a/b", "%ff", "%2e%2e", "a" * 201, "x:y"])))
def test_snapshot_out_is_a_name_or_a_400(snap_broker_once, out):
    broker, http = snap_broker_once
    r = http.post("/snapshot?out=" + _escape(out))
    assert r.status in (200, 400), (out, r.body)
    if r.status == 200:
        path = r.json()["path"]
        assert os.path.dirname(path) == os.path.join(os.path.abspath(broker.data_path), "snapshots")
    assert broker.store.copies == 0


@pytest.fixture
def snap_broker_once(snap_broker):
    return snap_broker()


@pytest.fixture
def guarded_http(make_broker, tmp_path, sync_threads):
    """An in-process HTTP client of a broker under --http-auth-required (tests/support/auth_fuzz.py's auth server)."""
    path = tmp_path / "guarded"
    path.mkdir()
    broker = make_broker(path=str(path), auth_http_address=[AUTH_ADDRESS], http_auth_required=True)
    broker.auth.fetch_function = FakeAuthServer()
    return HTTPClient(broker)


@settings(max_examples=EXAMPLES_OVERRIDE or 200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_requests(), who=caller())
def test_no_endpoint_answers_500_to_client_input_with_http_auth_required(guarded_http, request, who):
    """The same under --http-auth-required, from a random caller: a refusal is the JSON 401/403 it must be."""
    method, uri, body = request
    kind, headers = who
    r = guarded_http.request(method, uri, body if method in ("POST", "PUT") else None, headers=headers)
    assert r.status != 500, (method, uri, kind, body[:80], r.body[:200])
    if r.status in (401, 403):
        assert error(r) == REFUSED_AS[kind], (method, uri, kind, headers, r.status, r.body[:200])
