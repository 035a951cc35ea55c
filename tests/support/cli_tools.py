"""The mq-* command-line tools run as subprocesses of the test, and what they leave in a broker."""

from __future__ import annotations

import sys

TIMEOUT = 30  # seconds a tool may take


def tool(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"mqd.tools.{name}", *args]


def has_channel(broker, topic: str) -> bool:
    _, stats = broker.get(f"/stats?format=json&topic={topic}")
    return any(t["topic_name"] == topic and t["channels"] for t in stats["topics"] or [])
