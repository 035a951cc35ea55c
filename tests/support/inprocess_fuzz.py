"""In-process fuzzing: a control channel that must survive any input; the answer-or-close oracle.

`Harness` is a broker on a task.Clock whose control channel holds
acknowledged messages; after the fuzzed input the control client must be
answered correctly and every control message still counted and delivered.
`check_answer_or_close` is the V2 oracle: a client is answered, or told why
and closed, and nothing follows the reason.
"""

from __future__ import annotations

from twisted.internet.task import Clock

from tests.support.control_checks import queue_count
from tests.support.http_client import HTTPClient
from tests.support.inprocess_broker import START_TIME, new_broker
from tests.support.v2_client import Client
from tests.support.v2_frames import ERROR, Frame, cmd, identify, ok, parse_frames, pub

CONTROL_TOPIC, CONTROL_CHANNEL = "zz_control", "zz_control_c"


class Harness:
    """A broker on a Clock with a control channel full of acknowledged messages."""

    def __init__(self, path: str, n: int = 5, **flags) -> None:
        self.clock = Clock()
        self.clock.advance(START_TIME)
        self.broker = new_broker(path, self.clock, **flags)
        self.http = HTTPClient(self.broker)
        self.publisher = Client(self.broker, port=1)
        assert self.publisher.request(identify(heartbeat_interval=-1)) == [ok()]
        assert self.http.post(f"/topic/create?topic={CONTROL_TOPIC}").status == 200
        r = self.http.post(f"/channel/create?topic={CONTROL_TOPIC}&channel={CONTROL_CHANNEL}")
        assert r.status == 200, r
        self.bodies: list[bytes] = []
        for _ in range(n):
            self.publish()

    def publish(self) -> None:
        body = b"control-%d" % len(self.bodies)
        answer = self.publisher.request(pub(CONTROL_TOPIC, body))
        assert answer == [ok()], f"control PUB answered {answer}"
        self.bodies.append(body)

    def check(self, what: str) -> None:
        """The control client is answered correctly and every control message is counted."""
        self.publish()
        assert self.publisher.request(cmd("NOP")) == []
        r = self.http.get("/ping")
        assert (r.status, r.body) == (200, b"OK"), f"/ping after {what}: {r}"
        r = self.http.get("/stats?format=json")
        assert r.status == 200, f"/stats?format=json after {what}: {r}"
        count = queue_count(r.json(), CONTROL_TOPIC, CONTROL_CHANNEL)
        assert count == len(self.bodies), f"after {what}: {count} of {len(self.bodies)} counted"
        for path in ("/stats", "/metrics", "/info"):
            r = self.http.get(path)
            assert r.status == 200, f"{path} after {what}: {r}"

    def drain(self) -> None:
        """Every acknowledged control message comes out, once, intact."""
        consumer = Client(self.broker, port=2)
        consumer.sub(CONTROL_TOPIC, CONTROL_CHANNEL, rdy=1000)
        got = [m.body for m in consumer.messages()]
        assert sorted(got) == sorted(self.bodies), (got, self.bodies)


NON_FATAL = (b"E_FIN_FAILED ", b"E_REQ_FAILED ", b"E_TOUCH_FAILED ")


def fresh_broker(path: str):
    clock = Clock()
    clock.advance(START_TIME)
    return new_broker(path, clock), clock


def check_answer_or_close(client: Client) -> list:
    frames = parse_frames(client.raw())  # whole frames only
    fatal_at = [
        i for i, f in enumerate(frames)
        if isinstance(f, Frame) and f.type == ERROR and not f.payload.startswith(NON_FATAL)
    ]
    if client.closed:
        # Closed only after saying why, and nothing after that.
        assert fatal_at == [len(frames) - 1], frames
    else:
        assert fatal_at == [], frames
    return frames
