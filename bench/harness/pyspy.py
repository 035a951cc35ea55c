"""py-spy's collapsed stacks (`--format raw`) reduced to per-function sample counts.

One reader for every scenario that profiles (`client --profile`, `flame`),
so their "top entries" are counted the same way.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from bench.broker import REPO


def strip_line(frame: str) -> str:
    """``fn (path/to/file.py:123)`` -> ``fn (path/to/file.py)``; the site-packages prefix goes."""
    name, sep, where = frame.partition(" (")
    if not sep:
        return frame
    where = where.rstrip(")")
    path, colon, line = where.rpartition(":")
    if colon and line.isdigit():
        where = path
    for marker in ("site-packages/", str(REPO) + "/"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{name} ({where})"


def frame_counts(collapsed: str, name: Callable[[str], str] = strip_line,
                 ) -> tuple[collections.Counter, collections.Counter, int]:
    """(self samples, total samples, all samples) per function of collapsed stacks.

    A frame is `name(frame)`, by default ``function (file)`` without the
    line number, so a function's lines add up; total counts a function
    once per stack even when it recurses.
    """
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = [name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        count = int(count_text)
        samples += count
        own[frames[-1]] += count
        for f in set(frames):
            total[f] += count
    return own, total, samples
