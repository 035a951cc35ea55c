"""LookupdPoller against a twisted.web Resource playing nsqlookupd (treq's StubTreq, a task.Clock).

go-nsq's queryLookupd is the reference: one lookupd per poll, round robin,
up to three tries on the next lookupds when a query fails, the first query
at once and the periodic loop after `random × jitter × interval`.
"""

from __future__ import annotations

import json

import pytest
from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from mqd.client.discovery import (
    ACCEPT,
    MAX_RESPONSE_SIZE,
    LookupdPoller,
    lookup_url,
    producer_addresses,
)
from mqd.client.errors import ClientConfigError
from mqd.endpoints import join_host_port
from mqd.http_body import read_bounded


def peer(host: str, tcp: int, http: int = 4151) -> dict:
    return {"remote_address": f"{host}:50000", "hostname": "h", "broadcast_address": host,
            "tcp_port": tcp, "http_port": http, "version": "1.3.0"}


def flat(*producers: dict) -> tuple[int, bytes]:
    return 200, json.dumps({"channels": ["c"], "producers": list(producers)}).encode()


def wrapped(*producers: dict) -> tuple[int, bytes]:
    doc = {"status_code": 200, "status_txt": "OK", "data": {"channels": [], "producers": list(producers)}}
    return 200, json.dumps(doc).encode()


HANG = (0, b"")  # the request is never answered


class FakeLookupd(Resource):
    """Answers /lookup from a per-host queue of (status, body); records every request."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.answers: dict[str, list[tuple[int, bytes]]] = {}
        self.default: tuple[int, bytes] = flat()
        self.requests: list[tuple[str, bytes, list[bytes]]] = []  # (host, uri, accept headers)
        self.hanging: list = []

    def answer(self, host: str, *answers: tuple[int, bytes]) -> None:
        self.answers.setdefault(host, []).extend(answers)

    def render_GET(self, request):
        host = request.getHeader(b"host").decode()
        self.requests.append((host, request.uri, request.requestHeaders.getRawHeaders(b"accept") or []))
        queue = self.answers.get(host) or []
        code, body = queue.pop(0) if queue else self.default
        if (code, body) == HANG:
            self.hanging.append(request)
            return NOT_DONE_YET
        request.setResponseCode(code)
        return body

    def hosts(self) -> list[str]:
        return [host for host, _, _ in self.requests]


class FixedRandom:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.fixture
def lookupd() -> FakeLookupd:
    return FakeLookupd()


@pytest.fixture
def stub(lookupd) -> StubTreq:
    return StubTreq(lookupd)


@pytest.fixture
def logged():
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


def make_poller(stub, clock, changes, addresses=("lk1:4161",), interval=10.0, jitter=0.3, rng=0.5, **kw):
    """A poller whose loop, with jitter 0, starts on the first `clock.advance`: ticks at 10, 20..."""
    return LookupdPoller("t", list(addresses), interval, jitter, changes.append, clock=clock, http=stub,
                         rng=FixedRandom(rng), **kw)


def errors_logged(events) -> list[str]:
    return [formatEvent(e) for e in events if e.get("log_namespace") == "mqd.client"
            and e["log_level"].name in ("error", "critical")]


# -- helpers --------------------------------------------------------------------------


def test_lookup_url_as_go_nsq_builds_it():
    assert lookup_url("127.0.0.1:4161", "t") == "http://127.0.0.1:4161/lookup?topic=t"
    assert lookup_url("http://lk:4161/", "a.b#ephemeral") == "http://lk:4161/lookup?topic=a.b%23ephemeral"
    assert lookup_url("https://lk:4161/nsq/lookup?x=1", "t") == "https://lk:4161/nsq/lookup?x=1&topic=t"
    assert lookup_url("[::1]:4161", "t") == "http://[::1]:4161/lookup?topic=t"
    with pytest.raises(ClientConfigError, match="missing port"):
        lookup_url("lookupd.example", "t")


def test_producer_addresses_both_shapes_ipv6_bracketed_bad_rows_skipped():
    rows = [peer("10.0.0.1", 4150), peer("fd00::2", 4250), {"broadcast_address": "x"}, "junk",
            peer("10.0.0.3", 70000), peer("10.0.0.4", 0)]
    want = {"10.0.0.1:4150", "[fd00::2]:4250"}
    assert producer_addresses({"channels": [], "producers": rows}) == want
    assert producer_addresses({"status_code": 200, "status_txt": "OK",
                               "data": {"channels": [], "producers": rows}}) == want
    assert producer_addresses({"channels": [], "producers": None}) == set()
    assert join_host_port("::1", 1) == "[::1]:1"
    assert join_host_port("[::1]", 1) == "[::1]:1"


# -- polling ----------------------------------------------------------------------------


def test_first_query_at_once_with_accept_header(lookupd, stub):
    lookupd.default = flat(peer("127.0.0.1", 4150), peer("::1", 4152))
    clock, changes = Clock(), []
    poller = make_poller(stub, clock, changes)
    first = poller.start()
    stub.flush()
    assert lookupd.requests == [("lk1:4161", b"/lookup?topic=t", [ACCEPT])]
    assert changes == [{"127.0.0.1:4150", "[::1]:4152"}]
    assert poller.addresses == {"127.0.0.1:4150", "[::1]:4152"}
    assert first.result == {"127.0.0.1:4150", "[::1]:4152"}
    poller.stop()


def test_old_envelope_shape_is_unwrapped(lookupd, stub):
    lookupd.default = wrapped(peer("10.1.1.1", 4150))
    changes: list = []
    poller = make_poller(stub, Clock(), changes)
    poller.start()
    stub.flush()
    assert changes == [{"10.1.1.1:4150"}]
    poller.stop()


def test_404_means_no_producers(lookupd, stub):
    lookupd.answer("lk1:4161", flat(peer("10.0.0.1", 4150)),
                   (404, b'{"message":"TOPIC_NOT_FOUND"}'))
    clock, changes = Clock(), []
    poller = make_poller(stub, clock, changes, jitter=0)
    poller.start()
    clock.advance(0)
    stub.flush()
    clock.advance(10)
    stub.flush()
    assert changes == [{"10.0.0.1:4150"}, set()]
    assert poller.addresses == set()
    poller.stop()


def test_jittered_start_then_every_interval(lookupd, stub):
    clock, changes = Clock(), []
    poller = make_poller(stub, clock, changes, interval=10.0, jitter=0.3, rng=0.5)
    poller.start()
    stub.flush()
    assert len(lookupd.requests) == 1
    # The loop starts after 0.5 × 0.3 × 10 = 1.5 s, its first tick one interval later.
    clock.advance(1.5)
    stub.flush()
    assert len(lookupd.requests) == 1
    clock.advance(9.99)
    stub.flush()
    assert len(lookupd.requests) == 1
    clock.advance(0.01)
    stub.flush()
    assert len(lookupd.requests) == 2
    clock.advance(10)
    stub.flush()
    assert len(lookupd.requests) == 3
    assert len(changes) == 3
    poller.stop()
    clock.advance(100)
    stub.flush()
    assert len(lookupd.requests) == 3
    assert clock.getDelayedCalls() == []


def test_round_robin_one_lookupd_per_poll(lookupd, stub):
    clock, changes = Clock(), []
    poller = make_poller(stub, clock, changes, addresses=("lk1:4161", "lk2:4161", "lk3:4161"), jitter=0)
    poller.start()
    clock.advance(0)
    stub.flush()
    for _ in range(3):
        clock.advance(10)
        stub.flush()
    assert lookupd.hosts() == ["lk1:4161", "lk2:4161", "lk3:4161", "lk1:4161"]
    assert len(changes) == 4
    poller.stop()


def test_error_keeps_previous_set_retries_next_lookupd(lookupd, stub, logged):
    lookupd.answer("lk1:4161", flat(peer("10.0.0.1", 4150)), (500, b'{"message":"INTERNAL_ERROR"}'),
                   (500, b"x"))
    lookupd.answer("lk2:4161", (200, b"not json"), (500, b"y"))
    clock, changes = Clock(), []
    poller = make_poller(stub, clock, changes, addresses=("lk1:4161", "lk2:4161"), jitter=0)
    poller.start()
    clock.advance(0)
    stub.flush()
    assert changes == [{"10.0.0.1:4150"}]
    # Next poll: lk2 (bad JSON), then lk1 (500), then lk2 (500): three tries, all failed.
    clock.advance(10)
    stub.flush()
    assert lookupd.hosts() == ["lk1:4161", "lk2:4161", "lk1:4161", "lk2:4161"]
    assert changes == [{"10.0.0.1:4150"}]
    assert poller.addresses == {"10.0.0.1:4150"}
    errors = errors_logged(logged)
    assert len(errors) == 3
    assert "error querying nsqlookupd (http://lk2:4161/lookup?topic=t)" in errors[0]
    assert "invalid JSON" in errors[0]
    assert "got response 500" in errors[1]
    # A later poll that works reports again.
    clock.advance(10)
    stub.flush()
    assert changes == [{"10.0.0.1:4150"}, set()]
    poller.stop()


def test_failed_try_then_next_lookupd_answers_in_the_same_poll(lookupd, stub):
    lookupd.answer("lk1:4161", (503, b""))
    lookupd.answer("lk2:4161", flat(peer("10.0.0.2", 4150)))
    changes: list = []
    poller = make_poller(stub, Clock(), changes, addresses=("lk1:4161", "lk2:4161"))
    d = poller.start()
    stub.flush()
    assert lookupd.hosts() == ["lk1:4161", "lk2:4161"]
    assert changes == [{"10.0.0.2:4150"}]
    assert d.result == {"10.0.0.2:4150"}
    poller.stop()


def test_timeout_counts_as_a_failure(lookupd, stub, logged):
    lookupd.answer("lk1:4161", HANG, HANG, HANG)
    clock, changes = Clock(), []
    poller = make_poller(stub, clock, changes, timeout=2.0, jitter=0)
    d = poller.start()
    stub.flush()
    assert len(lookupd.requests) == 1
    clock.advance(1.99)
    stub.flush()
    assert len(lookupd.requests) == 1
    clock.advance(0.01)
    stub.flush()
    assert len(lookupd.requests) == 2
    clock.advance(2)
    stub.flush()
    clock.advance(2)
    stub.flush()
    assert len(lookupd.requests) == 3
    assert d.called and d.result is None
    assert changes == []
    assert poller.addresses is None
    assert any("no answer within 2.0s" in line for line in errors_logged(logged))
    poller.stop()


def test_stop_cancels_a_query_under_way_and_drops_its_answer(lookupd, stub, logged):
    lookupd.answer("lk1:4161", HANG)
    clock, changes = Clock(), []
    poller = make_poller(stub, clock, changes)
    d = poller.start()
    stub.flush()
    poller.stop()
    stub.flush()
    assert d.called and d.result is None
    assert changes == []
    assert clock.getDelayedCalls() == []
    assert not poller.running
    assert errors_logged(logged) == []


def test_polls_join_the_one_under_way(lookupd, stub):
    lookupd.answer("lk1:4161", HANG)
    clock, changes = Clock(), []
    poller = make_poller(stub, clock, changes, timeout=1.0)
    first = poller.start()
    again = poller.poll()
    stub.flush()
    assert len(lookupd.requests) == 1
    clock.advance(1)  # the hanging try times out; the next try is answered
    stub.flush()
    assert len(lookupd.requests) == 2
    assert first.result == again.result == set()
    assert changes == [set()]
    poller.stop()


def test_on_change_failure_is_logged_and_polling_goes_on(lookupd, stub, logged):
    clock, calls = Clock(), []

    def broken(addresses):
        calls.append(addresses)
        raise RuntimeError("boom")

    poller = LookupdPoller("t", ["lk1:4161"], 10, 0, broken, clock=clock, http=stub)
    poller.start()
    clock.advance(0)
    stub.flush()
    clock.advance(10)
    stub.flush()
    assert len(calls) == 2
    assert any(e.get("log_failure") is not None for e in logged)
    poller.stop()


def test_bad_arguments():
    with pytest.raises(ClientConfigError):
        LookupdPoller("t", [], 10, 0.3, print)
    with pytest.raises(ClientConfigError):
        LookupdPoller("t", ["lk:4161"], 0, 0.3, print)
    with pytest.raises(ClientConfigError, match="missing port"):
        LookupdPoller("t", ["lk"], 10, 0.3, print)


# -- a lookupd that answers garbage --------------------------------------------------------


@pytest.mark.parametrize(("code", "body", "why"), [
    (200, b'{"producers": ' + b"[" * 100_000, "invalid JSON: nested too deep"),
    (200, b'{"a":' * 100_000, "invalid JSON: nested too deep"),
    (200, b"x" * (MAX_RESPONSE_SIZE + 1), f"answer of {MAX_RESPONSE_SIZE + 1} bytes is over"),
    (500, b"y" * (MAX_RESPONSE_SIZE + 1), "is over"),  # not read whole to quote 200 bytes
    (200, b'{"producers": "everyone"}', "producers is not a list"),
    (200, b"[]", "not a lookup answer"),
])
def test_garbage_answers_are_one_failed_query_each(lookupd, stub, logged, code, body, why):
    lookupd.default = (code, body)
    changes: list = []
    poller = make_poller(stub, Clock(), changes)
    result: list = []
    poller.poll().addBoth(result.append)
    assert result == [None] and changes == []
    errors = errors_logged(logged)
    assert len(errors) == 3 and all(why in line for line in errors), errors  # three lookupds tried
    assert not [e for e in logged if "log_failure" in e]


def test_a_body_without_a_length_is_cut_once_over_the_limit():
    """A chunked answer: refused as it arrives, the rest never buffered."""
    from twisted.python.failure import Failure
    from twisted.web.client import ResponseDone

    from mqd.client import discovery

    class Response:
        length = None
        code = 200

        def __init__(self) -> None:
            self.lost = False

        def deliverBody(self, proto) -> None:  # noqa: N802 - IResponse's name
            class Transport:
                def loseConnection(_self) -> None:
                    self.lost = True

            proto.makeConnection(Transport())
            for _ in range(10):
                proto.dataReceived(b"z" * 1000)
            proto.connectionLost(Failure(ResponseDone()))

    response = Response()
    result: list = []
    read_bounded(response, 2500, discovery.LookupdError).addBoth(result.append)
    assert isinstance(result[0].value, discovery.LookupdError)
    assert str(result[0].value) == "answer larger than 2500 bytes" and response.lost
