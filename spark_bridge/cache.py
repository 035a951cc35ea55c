"""Where the bridge keeps what it builds once per machine to start Spark faster (~/.cache/mqd)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/mqd, else ~/.cache/mqd: per user, safe to delete (rebuilt or done without)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mqd"
