"""The queue scan: NSQ's sampled sweep of in-flight timeouts and due deferred messages.

Every `queue-scan-interval` a random sample of `queue-scan-selection-count`
channels is checked; when more than `queue-scan-dirty-percent` of them had
work the sample is drawn again at once, so a busy broker catches up and an
idle one costs almost nothing. The list of channels to sample from is
rebuilt every `queue-scan-refresh-interval`, as nsqd does (a new channel's
timers can therefore fire up to that much late, as in nsqd).

Nothing a channel raises leaves the scan: a LoopingCall whose function
raises stops for good, which would stop every timeout and deferred
delivery of the broker. A channel repairs what it can itself (its
process_in_flight and process_deferred put a bad entry back rather than
lose it); whatever still escapes is logged once per channel and error, and
the tick goes on with the other channels and the next tick retries.
"""

from __future__ import annotations

import random
from weakref import WeakKeyDictionary

from twisted.application import service
from twisted.internet.task import LoopingCall
from twisted.logger import LogLevel
from twisted.python.failure import Failure

from mqd.logs import get_logger

__all__ = ["QueueScanner"]

log = get_logger(__name__)

# Bound on back-to-back rescans in one tick, so a flood of expiries cannot
# keep the reactor from serving connections.
_MAX_PASSES = 64


class QueueScanner(service.Service):
    name = "queue-scan"

    def __init__(self, broker) -> None:
        self.broker = broker
        opts = broker.options
        self.interval = opts.queue_scan_interval
        self.refresh_interval = opts.queue_scan_refresh_interval
        self.selection_count = opts.queue_scan_selection_count
        self.dirty_percent = opts.queue_scan_dirty_percent
        self._channels: list = []
        self._refreshed_at: float | None = None
        self._loop: LoopingCall | None = None
        # The failures already logged, per channel: (what, exception type).
        self._failing: WeakKeyDictionary = WeakKeyDictionary()
        # The same for the tick itself (the channel list, the sampling).
        self._tick_errors: set[object] = set()

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self._tick)
        self._loop.clock = self.broker.clock
        self._loop.start(self.interval, now=False).addErrback(
            lambda f: log.failure("queue scan stopped", f)
        )

    def stopService(self):
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        return super().stopService()

    def refresh(self) -> None:
        self._channels = list(self.broker.channels())
        self._refreshed_at = self.broker.clock.seconds()

    def _tick(self) -> None:
        """The LoopingCall's function: a scan that never raises, so the loop never stops."""
        try:
            self.scan()
        except Exception:
            self._tick_failed("a tick")

    def _tick_failed(self, what: str) -> None:
        """Log a failure of the scan itself (not of a channel) once per error."""
        failure = Failure()
        kind = (what, failure.type)
        if kind not in self._tick_errors:
            self._tick_errors.add(kind)
            log.failure("queue scan: {what} failed; the scan goes on (logged once per error)",
                        failure, LogLevel.error, what=what)

    def scan(self) -> int:
        """One tick of the scan; returns how many channels had work."""
        now = self.broker.clock.seconds()
        if self._refreshed_at is None or now - self._refreshed_at >= self.refresh_interval:
            try:
                self.refresh()
            except Exception:
                # The channels of the last list are still scanned; the next tick retries.
                self._tick_failed("rebuilding the channel list")
        dirty_total = 0
        for _ in range(_MAX_PASSES):
            channels = [c for c in self._channels if not c.exiting]
            if not channels:
                break
            if len(channels) > self.selection_count:
                sample = random.sample(channels, self.selection_count)
            else:
                sample = channels
            dirty = 0
            for channel in sample:
                # Both queues are always processed: `or` would skip the second.
                # A failure stays with its channel: raising out of here would
                # stop the LoopingCall, so every timeout of every topic.
                try:
                    expired = channel.process_in_flight(now)
                except Exception:
                    expired = self._failed(channel, "in-flight timeouts")
                try:
                    due = channel.process_deferred(now)
                except Exception:
                    due = self._failed(channel, "deferred messages")
                if expired or due:
                    dirty += 1
            dirty_total += dirty
            if dirty <= self.dirty_percent * len(sample):
                break
            now = self.broker.clock.seconds()
        return dirty_total

    def _failed(self, channel, what: str) -> bool:
        """Log a channel's failure once per error (the scan retries it every tick); not dirty."""
        failure = Failure()
        kind = (what, failure.type)
        try:
            seen = self._failing.setdefault(channel, set())
        except TypeError:  # not weakly referenceable: logged every time rather than never
            seen = set()
        if kind not in seen:
            seen.add(kind)
            log.failure("queue scan: processing {what} of {channel} failed; the scan goes on "
                        "with the other channels (logged once per channel and error)",
                        failure, LogLevel.error, what=what, channel=channel)
        return False
