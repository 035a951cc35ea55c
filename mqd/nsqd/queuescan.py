"""The queue scan: NSQ's sampled sweep of in-flight timeouts and due deferred messages.

Every `queue-scan-interval` a random sample of `queue-scan-selection-count`
channels is checked; when more than `queue-scan-dirty-percent` of them had
work the sample is drawn again at once, so a busy broker catches up and an
idle one costs almost nothing. The list of channels to sample from is
rebuilt every `queue-scan-refresh-interval`, as nsqd does (a new channel's
timers can therefore fire up to that much late, as in nsqd).
"""

from __future__ import annotations

import random
from weakref import WeakSet

from twisted.application import service
from twisted.internet.task import LoopingCall

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
        # Channels whose processing failed and was logged: logged once, not every tick.
        self._failing: WeakSet = WeakSet()

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.scan)
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

    def scan(self) -> int:
        """One tick of the scan; returns how many channels had work."""
        now = self.broker.clock.seconds()
        if self._refreshed_at is None or now - self._refreshed_at >= self.refresh_interval:
            self.refresh()
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
        """Log a channel's failure the first time (the scan retries it every tick); not dirty."""
        if channel not in self._failing:
            self._failing.add(channel)
            log.failure("queue scan: processing {what} of {channel} failed", what=what, channel=channel)
        return False
