"""kill -9 in a loop: load, SIGKILL, restart on the same data, compare with a ledger.

The publisher, consumer and drain are those of the durable store's crash
test (tests.support.durable_load), run round after round on the same data
directory.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.support.durable_load import (
    Consumer,
    Delivery,
    Publisher,
    check_body,
    drain_all,
    make_body,
)
from tests.support.processes import BrokerProcess
from tests.support.raw_conn import FRAME_RESPONSE, RawConn, command


class CrashPublisher(Publisher):
    """The durable load's publisher plus DPUB, with bodies unique across rounds."""

    def __init__(self, broker: BrokerProcess, index: int, topics: list[str], window: int,
                 round_no: int) -> None:
        super().__init__(broker, index, topics, window)
        self.tag = b"r%dp%d" % (round_no, index)
        self.rng = random.Random(round_no * 1000 + index)

    def _next_command(self) -> tuple[bytes, list[bytes], str]:
        if self.rng.random() < 0.15:
            topic = self.rng.choice(self.topics)
            body = make_body(self.tag, self._seq)
            self._seq += 1
            return command(f"DPUB {topic} {self.rng.randrange(1, 800)}", body), [body], topic
        return super()._next_command()


class CrashConsumer(Consumer):
    """The durable load's consumer (FIN some, let some time out), but REQ with a delay."""

    def __init__(self, broker: BrokerProcess, topic: str, channel: str, marker_topic: str,
                 seed: int) -> None:
        super().__init__(broker, topic, channel, marker_topic)
        self.rng = random.Random(seed)

    def _on_message(self, msg: Delivery, pending: dict[bytes, bytes]) -> None:
        seq = int(msg.body.split(b"-")[1])
        if seq % 4 == 2 and msg.attempts <= 1:
            self.received[msg.id] = msg.body
            self.requeued += 1
            self.conn.send(b"REQ " + msg.id + b" %d\n" % self.rng.randrange(1, 500))
            return
        super()._on_message(msg, pending)


@dataclass
class CrashReport:
    rounds: int = 0
    restarts: int = 0
    commands: int = 0
    acknowledged: int = 0
    missing: int = 0
    corrupt: int = 0
    unknown: int = 0
    duplicates: int = 0
    finished_came_back: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


class CrashLedger:
    """What must come back after a crash, and what may.

    `must[(topic, channel)]`: acknowledged bodies not FINished on that
    channel. `sent[topic]`: every body ever sent to the topic, acknowledged
    or not, FINished or not: at-least-once means any of those may come back
    (a FIN the broker got before the kill may or may not have landed), but
    nothing else may.
    """

    def __init__(self) -> None:
        self.sent: dict[str, set[bytes]] = {}
        self.must: dict[tuple[str, str], set[bytes]] = {}
        self.finished: dict[tuple[str, str], set[bytes]] = {}

    def queues(self) -> list[tuple[str, str]]:
        return list(self.must)

    def verify(self, broker: BrokerProcess, report: CrashReport, where: str) -> None:
        """Drain every queue of the restarted broker (FIN all) and compare with the ledger."""
        out = drain_all(broker, self.queues(), silence=1.5)
        for (topic, channel), deliveries in out.items():
            bodies = Counter(d.body for d in deliveries)
            report.duplicates += sum(n - 1 for n in bodies.values())
            for body in bodies:
                try:
                    check_body(body)
                except AssertionError:
                    report.corrupt += 1
                    report.problems.append(f"{where}: {topic}/{channel}: corrupt {body[:60]!r}")
                    continue
                if body not in self.sent.get(topic, ()):
                    report.unknown += 1
                    report.problems.append(f"{where}: {topic}/{channel}: unknown {body[:60]!r}")
                elif body in self.finished.get((topic, channel), ()):
                    report.finished_came_back += 1
            missing = self.must[(topic, channel)] - set(bodies)
            if missing:
                report.missing += len(missing)
                some = ", ".join(repr(b[:24]) for b in sorted(missing)[:3])
                report.problems.append(f"{where}: {topic}/{channel}: {len(missing)} acknowledged "
                                       f"bodies missing: {some}")
            self.must[(topic, channel)] = set()
            self.finished.setdefault((topic, channel), set()).update(bodies)


def crash_rounds(broker: BrokerProcess, rounds: int, *, prefix: str = "crash", seed: int = 16,
                 load: tuple[float, float] = (0.3, 1.2),
                 progress: Callable[[str], None] | None = None) -> CrashReport:
    """Mixed PUB/MPUB/DPUB, FIN, REQ with delay and msg timeouts; kill -9 at a random
    moment; restart on the same data directory; drain and compare; `rounds` times.

    `broker` must be running `--durable` with a short `--msg-timeout`; it is
    left running (verified after its last restart).
    """
    rng = random.Random(seed)
    report = CrashReport()
    ledger = CrashLedger()
    consumed, lonely = f"{prefix}.consumed", f"{prefix}.lonely"
    # c1 is consumed during the load, c2 only by the drain after each restart;
    # `lonely` has no channel until the first drain makes one.
    for channel in ("c1", "c2"):
        with RawConn(broker) as conn:
            conn.send(command(f"SUB {consumed} {channel}"))
            assert conn.read_frame() == (FRAME_RESPONSE, b"OK")
        ledger.must[(consumed, channel)] = set()
    ledger.must[(lonely, "d")] = set()
    ledger.sent[consumed], ledger.sent[lonely] = set(), set()
    t0 = time.monotonic()
    for round_no in range(rounds):
        markers = f"{prefix}.markers{round_no}"
        consumer = CrashConsumer(broker, consumed, "c1", markers, seed=rng.randrange(1 << 30))
        publishers = [CrashPublisher(broker, i, [consumed, lonely], window, round_no)
                      for i, window in enumerate((1, 4, 16))]
        consumer.start()
        for p in publishers:
            p.start()
        until = time.monotonic() + rng.uniform(*load)
        while time.monotonic() < until:
            time.sleep(0.02)
        broker.crash()
        threads = [*publishers, consumer]
        for thread in threads:
            thread.join(30)
            if thread.is_alive():
                report.problems.append(f"round {round_no}: {thread.name} hung after the kill")
            elif not isinstance(thread.ended_by, OSError):
                report.problems.append(f"round {round_no}: {thread.name} ended by {thread.ended_by!r}")
            if thread.errors:
                report.problems.append(f"round {round_no}: {thread.name} got {thread.errors[:3]!r}")
        for p in publishers:
            report.commands += p.commands
            for body, topic in p.sent.items():
                ledger.sent[topic].add(body)
            for body, topic in p.acked.items():
                report.acknowledged += 1
                channels = ("c1", "c2") if topic == consumed else ("d",)
                for channel in channels:
                    ledger.must[(topic, channel)].add(body)
        ledger.must[(consumed, "c1")] -= set(consumer.fin_sent.values())
        ledger.finished.setdefault((consumed, "c1"), set()).update(consumer.fin_sent.values())
        ledger.sent[markers] = set(consumer.markers_sent)
        ledger.must[(markers, "d")] = set(consumer.markers_acked)
        report.rounds += 1
        broker.start()
        report.restarts += 1
        ledger.verify(broker, report, f"after kill {round_no + 1}")
        if progress is not None:
            progress(f"kill -9 round {round_no + 1}/{rounds}: {report.acknowledged} acknowledged, "
                     f"{report.missing} missing, {report.corrupt} corrupt, {report.unknown} unknown")
    report.seconds = time.monotonic() - t0
    return report
