"""A moment given on a command line: a duration back from now, or an RFC 3339 time.

`mq-tail --since`, `python -m spark_bridge analyze --since/--until` and the
example pipeline take the same spellings: a Go duration (`2h`, `90m`)
back from when the command started, or an RFC 3339 time with its zone
(`2006-01-02T15:04:05Z`, `...+07:00`), as `journalctl --since` and
Kafka's tools read a moment.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from mqd.options import parse_duration

__all__ = ["Since", "parse_since"]


@dataclass(frozen=True, slots=True)
class Since:
    """A time back from now (`ago`, seconds) or a moment (`at_ms`, ms since the Unix epoch)."""

    ago: float | None = None
    at_ms: int | None = None

    def ms(self, now: float) -> int:
        """The moment in ms since the Unix epoch, `now` (seconds) being the command's start."""
        if self.at_ms is not None:
            return self.at_ms
        return int((now - (self.ago or 0.0)) * 1000)


def parse_since(text: str) -> Since:
    """A Go duration back from now or an RFC 3339 time with its zone; ValueError says what is wanted."""
    value = text.strip()
    try:
        ago = parse_duration(value)
    except ValueError:
        pass
    else:
        if ago < 0:
            raise ValueError("a duration back from now cannot be negative")
        return Since(ago=ago)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        moment = None
    if moment is None or "T" not in value.upper() or moment.tzinfo is None:
        raise ValueError("want a duration back from now (2h) or an RFC 3339 time "
                         "(2006-01-02T15:04:05Z or with a +07:00 offset)")
    return Since(at_ms=int(moment.timestamp() * 1000))
