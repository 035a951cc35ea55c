"""Publish synthetic JSON click events to a topic, for events_pipeline.py to count.

    python -m examples.publish_events --nsqd-http 127.0.0.1:4151 --topic events \\
        --count 1000 --start 2026-11-26T12:00:00Z --span 60s --flush

Each event is one message, a line of JSON:

    {"user": "u3", "kind": "click", "ts": "2026-11-26T12:00:01.250Z"}

`ts` (event time) is spread evenly over `--span` seconds from `--start`,
kinds and users are drawn from a seeded random generator, so a run is
repeatable and `expected_counts` can say what the pipeline must find.

Event time is not the time of publishing, so nothing tells the pipeline
that the last window is complete: its watermark only moves when newer
events arrive. `--flush` publishes, `--flush-delay` seconds after the
events, one event far past them (kind "flush"), which moves the watermark
beyond every window of the run so Spark emits them all. It is sent apart
from the events on purpose: in a micro-batch after the flush, an event of
the run would be older than the watermark and dropped as late.

Publishing goes through nsqd's HTTP `/mpub` (newline-separated bodies, at
most `--batch` per request), so this needs nothing but the standard
library; any NSQ client would do.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

__all__ = [
    "FLUSH_KIND",
    "KINDS",
    "expected_counts",
    "flush_event",
    "main",
    "publish",
    "synthetic_events",
]

KINDS = ("click", "view", "purchase")
FLUSH_KIND = "flush"
DEFAULT_START = "2026-11-26T12:00:00Z"
# Far enough past any run that every window of it is closed by the watermark.
FLUSH_AFTER = timedelta(hours=1)


def parse_time(text: str) -> datetime:
    """An ISO 8601 instant (`Z` or an offset; naive means UTC)."""
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def format_time(value: datetime) -> str:
    """`2026-11-26T12:00:01.250Z`: what Spark's JSON reader parses as a timestamp."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def synthetic_events(count: int, start: datetime, span: float, users: int = 20,
                     seed: int = 1) -> list[dict[str, str]]:
    """`count` events with event times spread evenly over [start, start + span) seconds."""
    rng = random.Random(seed)
    step = span / count if count else 0.0
    return [
        {
            "user": f"u{rng.randrange(users)}",
            "kind": rng.choices(KINDS, weights=(6, 3, 1))[0],
            "ts": format_time(start + timedelta(seconds=i * step)),
        }
        for i in range(count)
    ]


def flush_event(events: Sequence[dict[str, str]], start: datetime) -> dict[str, str]:
    """One event an hour past the last of `events` (or of `start`), to close their windows."""
    last = max((parse_time(e["ts"]) for e in events), default=start)
    return {"user": "flush", "kind": FLUSH_KIND, "ts": format_time(last + FLUSH_AFTER)}


def expected_counts(events: Iterable[dict[str, str]], window: float) -> Counter:
    """{(window start, kind): events} as the pipeline counts them (tumbling windows from the epoch)."""
    counts: Counter = Counter()
    for event in events:
        at = parse_time(event["ts"]).timestamp()
        start = datetime.fromtimestamp(at - at % window, UTC)
        counts[(start, event["kind"])] += 1
    return counts


def publish(http_address: str, topic: str, events: Iterable[dict[str, str]],
            batch: int = 500, timeout: float = 10.0) -> int:
    """Publish `events` as JSON lines through nsqd's HTTP /mpub; how many were published."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    base = http_address if "://" in http_address else f"http://{http_address}"
    bodies = [json.dumps(e, separators=(",", ":")).encode() for e in events]
    for at in range(0, len(bodies), batch):
        request = urllib.request.Request(
            f"{base}/mpub?topic={topic}", data=b"\n".join(bodies[at:at + batch]), method="POST")
        with opener.open(request, timeout=timeout) as response:
            answer = response.read()
            if response.status != 200:  # pragma: no cover - urllib raises on error statuses
                raise RuntimeError(f"/mpub answered {response.status}: {answer!r}")
    return len(bodies)


def _duration(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for suffix in ("ms", "s", "m", "h"):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * units[suffix]
    return float(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.publish_events", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nsqd-http", default="127.0.0.1:4151",
                        help="a broker's HTTP address (default %(default)s)")
    parser.add_argument("--topic", default="events")
    parser.add_argument("--count", type=int, default=1000, help="events to publish")
    parser.add_argument("--start", default=DEFAULT_START, type=parse_time,
                        help="event time of the first event (default %(default)s)")
    parser.add_argument("--span", default="60s", type=_duration,
                        help="event times spread over this long (default %(default)s)")
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=500, help="events per /mpub request")
    parser.add_argument("--flush", action="store_true",
                        help="then publish one event an hour later, closing every window")
    parser.add_argument("--flush-delay", default="3s", type=_duration,
                        help="wait this long before the flush event (default %(default)s)")
    parser.add_argument("--window", default="10s", type=_duration,
                        help="print the counts the pipeline should find for this window")
    args = parser.parse_args(argv)

    events = synthetic_events(args.count, args.start, args.span, args.users, args.seed)
    sent = publish(args.nsqd_http, args.topic, events, args.batch)
    print(f"published {sent} events to {args.topic}", file=sys.stderr)
    if args.flush:
        time.sleep(args.flush_delay)
        publish(args.nsqd_http, args.topic, [flush_event(events, args.start)])
        print("published the flush event", file=sys.stderr)
    for (start, kind), n in sorted(expected_counts(events, args.window).items()):
        print(f"{format_time(start)}\t{kind}\t{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
