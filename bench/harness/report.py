"""The one set of formatting helpers every scenario reports with.

Figures are printed as a line per run while a bench runs, then as a Markdown
table headed by the date, the machine and the Python, so a table pasted into
the docs says where it came from. A missing figure prints as ``-``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
from collections.abc import Iterable
from typing import Any


def fmt(value: float | None, spec: str = ",.0f") -> str:
    """``value`` formatted with ``spec``; ``-`` when it is missing."""
    return "-" if value is None else format(value, spec)


def percent(value: float | None) -> str:
    """A share already in percent (CPU of one core), whole: ``87%``; ``-`` when missing."""
    return "-" if value is None else f"{value:.0f}%"


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted values; enough for p50/p99 over thousands of samples."""
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are present; None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a (how many times a's figure b is); None when either is missing or a is 0."""
    if not a or b is None:
        return None
    return b / a


def machine() -> str:
    """'N cores (CPU model)' as ``nproc`` and /proc/cpuinfo see it."""
    cores = len(os.sched_getaffinity(0))
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cores} cores" + (f" ({model})" if model else "")


def today() -> str:
    return datetime.date.today().isoformat()


def heading(title: str, *extra: str) -> str:
    """``title, date, machine, Python X.Y.Z[, extra...]``: the first line of every report."""
    return ", ".join([title, today(), machine(), f"Python {platform.python_version()}", *extra])


def load_average() -> float:
    """The 1-minute load average: figures taken on a shared machine carry it."""
    return os.getloadavg()[0]


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, bytes | bytearray):
        return value.decode(errors="replace")
    return str(value)


def save_json(path: str, args: Any, **sections: Any) -> None:
    """Date, machine, the arguments and ``sections`` (dataclasses as dicts) as JSON at ``path``."""
    doc = {"date": today(), "machine": machine(), "args": vars(args) if args is not None else None}
    doc.update(sections)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=_jsonable)
