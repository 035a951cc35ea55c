"""The pages of the LMDB data file mapped into the broker, released once they have grown.

Every record read or written maps its page into the process (RssFile),
and it stays mapped: a broker that has moved a few GB through the store
shows GBs of RSS that are only the page cache, which a broker reading its
files (nsqd) does not count. MADV_DONTNEED drops the mappings, not the
data: the map is read-only and shared, so the pages stay in the page
cache and the next read maps them again (a minor fault), also for
readers in other threads.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Callable
from typing import Any

from twisted.internet.task import LoopingCall

from mqd.logs import get_logger

__all__ = ["MappedPages"]

# The store speaks for its pages: one namespace for every LMDB log line.
log = get_logger("backends.lmdb")

# The pages mapped from the data file are unmapped (MappedPages.release) once
# they have grown by _UNMAP_ABOVE bytes since the last time: checked every
# _UNMAP_EVERY seconds, and after a commit once _UNMAP_RECORDS records were
# read or written. Below that they stay: the pages in use would only be
# faulted in again.
_UNMAP_EVERY = 5.0
_UNMAP_RECORDS = 1 << 14
_UNMAP_ABOVE = 64 << 20


class MappedPages:
    """The data file's mapped pages: counts the records moved through the map, releases the pages when due.

    Checked every _UNMAP_EVERY seconds on `clock` (where madvise is
    available) and by `written` after a commit; `stop` ends the checks.
    """

    __slots__ = ("data_file", "io_records", "_base", "_loop")

    def __init__(self, data_file: str, clock: Any) -> None:
        self.data_file = data_file
        # Records read or written since the mapped pages were last looked at,
        # and the process's file-backed RSS after they were last released.
        self.io_records = 0
        self._base = _file_rss()
        self._loop: LoopingCall | None = None
        if _madvise is not None:
            self._loop = LoopingCall(self.check)
            self._loop.clock = clock
            self._loop.start(_UNMAP_EVERY, now=False)

    def read(self, records: int) -> None:
        """`records` were read through the map (a queue's read)."""
        self.io_records += records

    def written(self, records: int) -> None:
        """A commit wrote or deleted `records`: check the pages once enough records have moved."""
        self.io_records += records
        if self.io_records >= _UNMAP_RECORDS:
            self.check()

    def check(self) -> None:
        """Release the mapped pages (`release`) once they have grown by _UNMAP_ABOVE."""
        self.io_records = 0
        if _madvise is not None and _file_rss() - self._base > _UNMAP_ABOVE:
            self.release()

    def release(self) -> int:
        """Unmap the pages of the data file this process has mapped; bytes released.

        If madvise fails, it is not tried again for the rest of the process.
        """
        global _madvise
        self.io_records = 0
        if _madvise is None:
            return 0
        released = 0
        try:
            for start, length in _mapped_ranges(self.data_file):
                if _madvise(start, length, _MADV_DONTNEED) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
                released += length
        except (OSError, ValueError) as e:
            log.info("LMDB: mapped pages cannot be released ({error}); not tried again", error=e)
            _madvise = None
        self._base = _file_rss()
        return released

    def stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    """(address, length) of this process's mappings of `path`, from /proc/self/maps."""
    suffix = " " + os.path.realpath(path) + "\n"
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.endswith(suffix):
                low, _, high = line.partition(" ")[0].partition("-")
                ranges.append((int(low, 16), int(high, 16) - int(low, 16)))
    return ranges


def _file_rss() -> int:
    """This process's resident file-backed and shared pages in bytes (/proc/self/statm), 0 if unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def _load_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(2) (Linux, with /proc/self/maps), or None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        func = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    func.restype = ctypes.c_int
    return func


_madvise = _load_madvise()
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
