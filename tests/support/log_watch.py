"""The log oracle of in-process fuzzing: twisted.logger events that mean a bug, whatever the input."""

from __future__ import annotations

from typing import Any

from twisted.logger import LogLevel, formatEvent, globalLogPublisher

# Where an error-level event reports a client's mistake, as nsqlookupd's own
# log does ("ERROR: [peer] - E_INVALID ..."): input may cause these.
CLIENT_ERROR_NAMESPACES = frozenset({"mqd.lookup.protocol"})


class LogWatch:
    """Collects the twisted.logger events that mean a bug, whatever the input was.

    A failure (a traceback: `log.failure`, Twisted's "Unhandled Error"), a
    critical event, or an error event from anywhere but the places that log
    a client's mistakes. Used as a context manager around in-process fuzzing.
    """

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        level = event.get("log_level")
        if (
            "log_failure" in event
            or level == LogLevel.critical
            or (level == LogLevel.error
                and event.get("log_namespace") not in CLIENT_ERROR_NAMESPACES)
        ):
            self.events.append(event)

    def __enter__(self) -> LogWatch:
        globalLogPublisher.addObserver(self)
        return self

    def __exit__(self, *exc: object) -> None:
        globalLogPublisher.removeObserver(self)

    def texts(self) -> list[str]:
        out = []
        for event in self.events:
            text = f"{event.get('log_namespace')}: {formatEvent(event)}"
            failure = event.get("log_failure")
            if failure is not None:
                text += "\n" + failure.getTraceback()
            out.append(text)
        return out

    def check(self, what: str = "") -> None:
        """Fail with the collected events, if any, and forget them."""
        texts = self.texts()
        self.events.clear()
        assert not texts, f"{what}: {len(texts)} bad log events:\n" + "\n".join(texts[:3])
