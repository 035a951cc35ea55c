"""RDY flow control of a consumer over its connections (go-nsq's model).

nsqd sends a connection at most RDY messages in flight, so the consumer
spreads its `max_in_flight` over its connections and never lets their sum
exceed it. Connection objects only need the attributes the client
protocol keeps (`rdy_count`, `last_rdy_count`, `last_rdy_at`,
`last_message_at`, `in_flight`, `max_rdy_count`, `address`, `closing`)
and `rdy(n)`, which writes the command; this module owns the RDY
bookkeeping attributes so that its arithmetic never depends on when the
wire write happens.

Behaviour follows go-nsq's consumer: `perConnMaxInFlight`,
`maybeUpdateRDY`, `updateRDY` (server `max_rdy_count` cap, global
`max_in_flight` budget, the 5 s retry of a starved connection),
`redistributeRDY` every `rdy_redistribute_interval` when there are more
connections than `max_in_flight` or while backing off, and
`startStopContinueBackoff`/`resume` (RDY 0 everywhere, wait, RDY 1 on a
random connection to test the waters). One deliberate difference: a
lower RDY is always sent (go-nsq refuses it when the total is already
over budget, which leaves `ChangeMaxInFlight` unable to shrink it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from twisted.internet.task import LoopingCall

from mqd.client.backoff import BackoffCounter
from mqd.logs import get_logger

__all__ = ["ReadyController", "RDY_RETRY_DELAY", "RESUME_RETRY_DELAY"]

log = get_logger("mqd.client")

# go-nsq: a connection left at RDY 0 because the budget was spent retries after 5 s.
RDY_RETRY_DELAY = 5.0
# go-nsq: no connection (or a refused RDY 1) when a backoff ends: try again in 1 s.
RESUME_RETRY_DELAY = 1.0


class ReadyController:
    """RDY state of one consumer: the total, redistribution and backoff.

    `connections` returns the connections that take part (subscribed and
    not closed); the consumer calls `connection_added`/`connection_removed`
    as they come and go, and `on_success`/`on_failure`/`on_continue` as
    messages are FINed, REQed with backoff, or REQed without.
    """

    def __init__(self, config, clock, connections: Callable[[], Iterable],
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.clock = clock
        self._connections = connections
        self._rng = rng or random.Random()
        self.max_in_flight: int = config.max_in_flight
        self.total_rdy = 0
        self.need_redistribute = False
        self.backoff = BackoffCounter(config, self._rng)
        # go-nsq's backoffDuration: > 0 while a backoff timer runs.
        self.backoff_duration = 0.0
        self._backoff_call = None
        self._retry_calls: dict = {}
        self._loop = LoopingCall(self.redistribute)
        self._loop.clock = clock
        self.stopped = False

    # -- lifecycle

    def start(self) -> None:
        if not self._loop.running:
            self._loop.start(self.config.rdy_redistribute_interval, now=False)

    def stop(self) -> None:
        """No more RDY changes from timers (the consumer is closing)."""
        self.stopped = True
        if self._loop.running:
            self._loop.stop()
        if self._backoff_call is not None and self._backoff_call.active():
            self._backoff_call.cancel()
        self._backoff_call = None
        self.backoff_duration = 0.0
        for call in self._retry_calls.values():
            if call.active():
                call.cancel()
        self._retry_calls.clear()

    def conns(self) -> list:
        return list(self._connections())

    # -- state

    def in_backoff(self) -> bool:
        return self.backoff.level > 0

    def in_backoff_timeout(self) -> bool:
        return self.backoff_duration > 0

    def per_conn_max_in_flight(self) -> int:
        """max_in_flight / connections, at least 1, at most max_in_flight."""
        total = self.max_in_flight
        n = len(self.conns())
        if n == 0:
            return total
        return int(min(max(1, total / n), total))

    def is_starved(self) -> bool:
        """A connection has (nearly) all its RDY in flight and waits for answers."""
        for conn in self.conns():
            in_flight = conn.in_flight
            if in_flight > 0 and in_flight >= int(conn.rdy_count * 0.85) and not conn.closing:
                return True
        return False

    # -- RDY

    def maybe_update_rdy(self, conn) -> None:
        """Give `conn` its share unless backing off (then the backoff owns RDY)."""
        if self.in_backoff() or self.in_backoff_timeout():
            log.debug("({address}) skip sending RDY in backoff", address=conn.address)
            return
        self.update_rdy(conn, self.per_conn_max_in_flight())

    def update_rdy(self, conn, count: int) -> bool:
        """Set `conn`'s RDY to `count` within the server cap and the global budget.

        False when nothing could be sent (closing connection, or no budget
        left: then a connection at RDY 0 retries after RDY_RETRY_DELAY so it
        is never starved forever).
        """
        if conn.closing:
            return False
        if count > conn.max_rdy_count:
            count = conn.max_rdy_count
        self._cancel_retry(conn)
        rdy = conn.rdy_count
        max_possible = self.max_in_flight - self.total_rdy + rdy
        if 0 < max_possible < count:
            count = max_possible
        # lowering only shrinks the total: always allowed (go-nsq refuses it)
        if max_possible <= 0 and count > 0 and count >= rdy:
            if rdy == 0:
                self._retry_calls[conn] = self.clock.callLater(
                    RDY_RETRY_DELAY, self._retry_rdy, conn, count)
            return False
        self._send_rdy(conn, count)
        return True

    def _retry_rdy(self, conn, count: int) -> None:
        self._retry_calls.pop(conn, None)
        if not self.stopped:
            self.update_rdy(conn, count)

    def _cancel_retry(self, conn) -> bool:
        call = self._retry_calls.pop(conn, None)
        if call is None:
            return False
        if call.active():
            call.cancel()
        return True

    def _send_rdy(self, conn, count: int) -> None:
        last = conn.rdy_count
        if count == 0 and last == 0:
            return
        self.total_rdy += count - last
        if count != last:
            conn.rdy(count)
        conn.rdy_count = count
        conn.last_rdy_count = count
        if count > 0:
            conn.last_rdy_at = self.clock.seconds()

    # -- connections

    def connection_added(self, conn) -> None:
        """A subscribed connection: lower the others' share first, then give it one."""
        if conn.max_rdy_count < self.max_in_flight:
            log.warn("({address}) max RDY count {max_rdy} < consumer max in flight "
                     "{max_in_flight}, truncation possible", address=conn.address,
                     max_rdy=conn.max_rdy_count, max_in_flight=self.max_in_flight)
        for other in self.conns():
            if other is not conn:
                self.maybe_update_rdy(other)
        self.maybe_update_rdy(conn)

    def connection_removed(self, conn, left: int | None = None) -> None:
        """Take `conn`'s RDY out of the total; flag a redistribution if it mattered.

        Call after `conn` is no longer among `connections()`.
        """
        rdy = conn.rdy_count
        self.total_rdy -= rdy
        conn.rdy_count = 0
        had_retry = self._cancel_retry(conn)
        if left is None:
            left = len(self.conns())
        if (had_retry or rdy > 0) and (left == self.max_in_flight or self.in_backoff()):
            self.need_redistribute = True

    def change_max_in_flight(self, max_in_flight: int) -> None:
        if max_in_flight == self.max_in_flight:
            return
        self.max_in_flight = max_in_flight
        for conn in self.conns():
            self.maybe_update_rdy(conn)

    def redistribute(self) -> None:
        """Move RDY from idle connections to random others when RDY is scarce."""
        if self.in_backoff_timeout():
            return
        conns = self.conns()
        if not conns:
            return
        max_in_flight = self.max_in_flight
        if len(conns) > max_in_flight:
            log.debug("redistributing RDY state ({n} conns > {max_in_flight} max_in_flight)",
                      n=len(conns), max_in_flight=max_in_flight)
            self.need_redistribute = True
        if self.in_backoff() and len(conns) > 1:
            log.debug("redistributing RDY state (in backoff and {n} conns > 1)", n=len(conns))
            self.need_redistribute = True
        if not self.need_redistribute:
            return
        self.need_redistribute = False

        now = self.clock.seconds()
        idle_timeout = self.config.low_rdy_idle_timeout
        rdy_timeout = self.config.low_rdy_timeout
        possible = []
        for conn in conns:
            if conn.rdy_count > 0:
                if now - conn.last_message_at > idle_timeout:
                    log.debug("({address}) idle connection, giving up RDY", address=conn.address)
                    self.update_rdy(conn, 0)
                elif now - conn.last_rdy_at > rdy_timeout:
                    log.debug("({address}) RDY timeout, giving up RDY", address=conn.address)
                    self.update_rdy(conn, 0)
            possible.append(conn)

        if self.in_backoff():
            available = 1 - self.total_rdy
        else:
            available = max_in_flight - self.total_rdy
        while possible and available > 0:
            available -= 1
            conn = possible.pop(self._rng.randrange(len(possible)))
            log.debug("({address}) redistributing RDY", address=conn.address)
            self.update_rdy(conn, 1)

    # -- backoff

    def on_success(self) -> None:
        """A message was FINed (go-nsq's resume signal)."""
        self._signal(-1)

    def on_failure(self) -> None:
        """A message was REQed with backoff."""
        self._signal(1)

    def on_continue(self) -> None:
        """A message was REQed without backoff: the level stays, a backoff goes on."""
        self._signal(0)

    def _signal(self, step: int) -> None:
        # Signals that arrive while the timer runs do not count: many
        # concurrent failures (or successes) must not jump straight to the
        # maximum level (or back to full speed).
        if self.stopped or self.in_backoff_timeout():
            return
        if step < 0:
            updated = self.backoff.success()
        elif step > 0:
            updated = self.backoff.failure()
        else:
            updated = False
        level = self.backoff.level
        if level == 0 and updated:
            count = self.per_conn_max_in_flight()
            log.warn("exiting backoff, returning all to RDY {count}", count=count)
            for conn in self.conns():
                self.update_rdy(conn, count)
        elif level > 0:
            duration = self.backoff.duration()
            log.warn("backing off for {duration:.3f}s (backoff level {backoff_level}), "
                     "setting all to RDY 0", duration=duration, backoff_level=level)
            for conn in self.conns():
                self.update_rdy(conn, 0)
            self._start_backoff_timer(duration)

    def _start_backoff_timer(self, duration: float) -> None:
        self.backoff_duration = duration
        if self._backoff_call is not None and self._backoff_call.active():
            self._backoff_call.cancel()
        self._backoff_call = self.clock.callLater(duration, self._resume)

    def _resume(self) -> None:
        """Backoff wait over: let exactly one message through, on one connection."""
        self._backoff_call = None
        if self.stopped:
            self.backoff_duration = 0.0
            return
        conns = self.conns()
        if not conns:
            log.warn("no connection available to resume, backing off for "
                     "{delay}s", delay=RESUME_RETRY_DELAY)
            self._start_backoff_timer(RESUME_RETRY_DELAY)
            return
        choice = conns[self._rng.randrange(len(conns))]
        log.warn("({address}) backoff timeout expired, sending RDY 1", address=choice.address)
        if not self.update_rdy(choice, 1):
            log.warn("({address}) error resuming RDY 1, backing off for {delay}s",
                     address=choice.address, delay=RESUME_RETRY_DELAY)
            self._start_backoff_timer(RESUME_RETRY_DELAY)
            return
        self.backoff_duration = 0.0
