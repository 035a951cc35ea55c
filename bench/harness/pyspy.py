"""py-spy: attaching it to a process, and its collapsed stacks reduced to per-function counts.

One reader for every scenario that profiles (``client --profile``, ``flame``,
``spark-stream --profile-source``), so their "top entries" are counted the
same way.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.broker import REPO

TRUNK_SHARE = 0.9  # frames in at least this share of the samples: twistd's start-up, the reactor loop


def pyspy_path() -> str:
    """py-spy on PATH, else the one beside this interpreter (it may not exist)."""
    return shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")


def start_pyspy(
    pid: int, path: Path | str, fmt: str = "raw", rate: int = 200, native: bool = False,
    nonblocking: bool = False,
) -> subprocess.Popen:
    """``py-spy record`` attached to ``pid``, writing ``fmt`` to ``path`` once stopped."""
    argv = [pyspy_path(), "record", "--pid", str(pid), "--format", fmt, "--rate", str(rate),
            "-o", str(path)]
    if native:
        argv.append("--native")
    if nonblocking:
        argv.append("--nonblocking")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy reads the target's memory layout (and symbols) before sampling
    return proc


def stop_pyspy(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """SIGINT (py-spy writes its file then) and wait; its stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err.decode(errors="replace")


# -- reading collapsed stacks -------------------------------------------------------------


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


def frame_name(frame: str) -> str:
    """``fn (file)`` without line number or install prefix; unresolved native addresses merged.

    ``0x7f3a... (libc.so.6)`` becomes ``? (libc.so.6)``: the addresses of one
    library without symbols are one entry, not hundreds.
    """
    name = strip_line(frame)
    if name.startswith("0x"):
        return "?" + name[name.find(" ("):] if " (" in name else "?"
    return name


def frame_counts(collapsed: str) -> tuple[collections.Counter, collections.Counter, int]:
    """(self samples, total samples, all samples) per function of collapsed stacks.

    A frame is ``frame_name(frame)``: ``function (file)`` without the line
    number, so a function's lines add up; total counts a function once per
    stack even when it recurses.
    """
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = [frame_name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        count = int(count_text)
        samples += count
        own[frames[-1]] += count
        for f in set(frames):
            total[f] += count
    return own, total, samples


def top(
    counter: collections.Counter, samples: int, limit: int = 15, below: float | None = None
) -> list[tuple[str, int, float]]:
    """(function, samples, % of all samples), most first; only counts < ``below`` x samples if set."""
    if not samples:
        return []
    ranked = counter.most_common()
    if below is not None:
        ranked = [(f, n) for f, n in ranked if n < below * samples]
    return [(f, n, 100.0 * n / samples) for f, n in ranked[:limit]]


def top_frames(collapsed: str, limit: int = 15) -> list[tuple[str, int, float, float]]:
    """Hottest functions: (frame, self samples, self %, total %), most self time first."""
    own, total, samples = frame_counts(collapsed)
    if not samples:
        return []
    return [
        (frame, n, 100.0 * n / samples, 100.0 * total[frame] / samples)
        for frame, n in own.most_common(limit)
    ]


def top_table(collapsed: str, limit: int = 15) -> str:
    """The top ``limit`` by self and by total samples; total leaves out the trunk."""
    own, total, samples = frame_counts(collapsed)
    trunk = sum(1 for n in total.values() if n >= TRUNK_SHARE * samples)
    lines = [f"{samples:,} samples (idle excluded)"]
    for title, counter, below in (("self", own, None), ("total", total, TRUNK_SHARE)):
        note = "" if below is None else (
            f" ({trunk} trunk frames in >= {TRUNK_SHARE:.0%} of samples left out)"
        )
        lines.append(f"top {limit} by {title}{note}:")
        for i, (f, n, pct) in enumerate(top(counter, samples, limit, below), 1):
            lines.append(f"  {i:>2}. {pct:5.1f}%  {n:>7,}  {f}")
    return "\n".join(lines)


def thread_table(collapsed: str, limit: int = 25) -> str:
    """Shares of the samples per thread (``py-spy --threads``), then self time per function."""
    threads: collections.Counter[str] = collections.Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            frames = stack.split(";")
            threads[next((f for f in frames[:2] if f.startswith("thread")), frames[0])] += int(count)
    own, _, samples = frame_counts(collapsed)
    if not samples:
        return "0 samples"
    out = [f"{samples} samples; by thread:"]
    out += [f"  {c / samples:6.1%}  {k}" for k, c in threads.most_common(8)]
    out.append("self time by frame:")
    out += [f"  {pct / 100:6.1%}  {f}" for f, _, pct in top(own, samples, limit)]
    return "\n".join(out)
