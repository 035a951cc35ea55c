"""Room for snapshots: admission against the limits, retention, and what is being written.

A snapshot is a copy of the broker's whole queue state on the data
filesystem, so unchecked they fill it and the store can no longer accept
publishes. Each `POST /snapshot` is therefore admitted here first, one at
a time (a `DeferredLock`): the directory is surveyed in a thread (what
finished snapshots take, what snapshots being written have written so
far, the filesystem's free space), then, back on the reactor and in one
call, the new snapshot's estimate is checked against the limits and
reserved. A reservation lasts until its snapshot is written (it is then on
disk) or has failed (its temporary directory is gone), so concurrent
requests never all pass a check made before any of them wrote.

Limits, either one refusing with `SnapshotLimit` (507 SNAPSHOT_LIMIT):

- `--snapshot-max-bytes`: all snapshots, finished or being written, plus
  the new one's estimate;
- `--snapshot-reserve-bytes`: the free space the new snapshot (and those
  being written) would leave on the filesystem must stay at least this;
  by default 5 % of the filesystem's size and at least twice
  `--max-body-size` (the store must still take the largest MPUB, whose
  commit can copy as many pages as it writes).

Retention (`--snapshot-keep`, `--snapshot-keep-age`; off by default, so
the broker deletes nothing unless told to): snapshots beyond the newest
`keep` (the new one counted) or older than `keep-age` are removed, oldest
first. Those needed to make room for the new snapshot go before it is
written; the others once it is written, so a snapshot that fails never
costs an old one that was not in its way. A snapshot a reader holds
(`mqd.nsqd.snapshot_format.hold_snapshot`, a shared flock: per host, readers
on other hosts are not seen) is never removed; it is tried again at the
next admission.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, DeferredLock

from mqd.logs import get_logger
from mqd.nsqd.snapshot_format import MANIFEST, SnapshotError, SnapshotExists, remove_snapshot

__all__ = [
    "RESERVE_SHARE",
    "Admission",
    "Entry",
    "Limits",
    "SnapshotLimit",
    "SnapshotSpace",
    "Survey",
    "default_reserve",
    "disk_use",
    "remove_all",
    "retention_victims",
    "survey",
]

log = get_logger(__name__)

# Share of the filesystem kept free by default: the margin ext4 reserves
# for root and Elasticsearch's flood-stage watermark (95 % used) both use.
RESERVE_SHARE = 0.05


class SnapshotLimit(SnapshotError):
    """One more snapshot would pass --snapshot-max-bytes or eat into --snapshot-reserve-bytes."""


def disk_use(path: str) -> int:
    """Bytes the files under `path` take on disk, symlinks not followed."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += disk_use(entry.path)
            else:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            continue
    return total


@dataclass(frozen=True)
class Entry:
    """A finished snapshot: its name, the disk it takes, when its manifest was written."""

    name: str
    bytes: int
    mtime: float


@dataclass
class Survey:
    """The snapshots directory and its filesystem, as one admission saw them."""

    snapshots: list[Entry]  # finished (a manifest inside), oldest first
    other: int  # anything else under the directory (leftovers, files): counted, never removed
    partial: dict[str, int]  # what the snapshots being written have written so far, by name
    free: int  # bytes an unprivileged writer may still use on the filesystem
    size: int  # the filesystem's size
    estimate: int  # the new snapshot's estimate


def _written_by(hidden: str) -> str | None:
    """The snapshot a hidden temporary directory (`.<name>.XXXXXXXX.tmp`) is written for."""
    if not hidden.endswith(".tmp"):
        return None
    return hidden[1:-len(".tmp")].rpartition(".")[0] or None


def survey(base: str, writing: Collection[str], estimate: int) -> Survey:
    """Walk the snapshots directory `base` (in a thread: it reads the disk); `writing`: names in progress.

    The filesystem's free space is read after the walk, so whatever the
    snapshots in progress wrote during it is already subtracted there.
    """
    snapshots: list[Entry] = []
    other = 0
    partial: dict[str, int] = {}
    try:
        entries = list(os.scandir(base))
    except FileNotFoundError:
        entries = []
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            size = disk_use(entry.path) if is_dir else entry.stat(follow_symlinks=False).st_blocks * 512
            if entry.name.startswith("."):
                owner = _written_by(entry.name)
                if owner is not None and owner in writing:
                    partial[owner] = partial.get(owner, 0) + size
                else:
                    other += size
                continue
            mtime = None
            if is_dir:
                try:
                    mtime = os.stat(os.path.join(entry.path, MANIFEST), follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    pass
            if mtime is None:
                other += size
            else:
                snapshots.append(Entry(entry.name, size, mtime))
        except OSError:
            continue
    snapshots.sort(key=lambda e: (e.mtime, e.name))
    fs = os.statvfs(base)
    return Survey(snapshots, other, partial, fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize, estimate)


def remove_all(base: str, names: Iterable[str]) -> list[str]:
    """Remove the named snapshots under `base` that no reader holds (in a thread); those removed."""
    return [name for name in names if remove_snapshot(os.path.join(base, name))]


def default_reserve(fs_size: int, max_body_size: int) -> int:
    """The free space kept for the store when --snapshot-reserve-bytes is -1 (its default)."""
    return max(int(fs_size * RESERVE_SHARE), 2 * max_body_size)


def retention_victims(snapshots: Sequence[Entry], keep: int, keep_age: float, now: float) -> list[str]:
    """Names of the finished snapshots (oldest first) a new one puts beyond --snapshot-keep/-keep-age."""
    doomed: set[str] = set()
    if keep:
        # The new snapshot is one of the `keep`.
        doomed.update(e.name for e in snapshots[:max(0, len(snapshots) - (keep - 1))])
    if keep_age:
        doomed.update(e.name for e in snapshots if e.mtime < now - keep_age)
    return [e.name for e in snapshots if e.name in doomed]


@dataclass(frozen=True)
class Limits:
    """The snapshot settings in force for one admission."""

    max_bytes: int = 0
    reserve: int = -1  # -1: default_reserve
    max_body_size: int = 5 << 20
    keep: int = 0
    keep_age: float = 0.0

    @classmethod
    def of(cls, options: Any) -> Limits:
        return cls(options.snapshot_max_bytes, options.snapshot_reserve_bytes, options.max_body_size,
                   options.snapshot_keep, options.snapshot_keep_age)

    def reserve_for(self, fs_size: int) -> int:
        if self.reserve >= 0:
            return self.reserve
        return default_reserve(fs_size, self.max_body_size)

    def retention(self) -> str:
        parts = []
        if self.keep:
            parts.append(f"--snapshot-keep={self.keep}")
        if self.keep_age:
            parts.append(f"--snapshot-keep-age={self.keep_age:g}s")
        return ", ".join(parts)


@dataclass
class Admission:
    """An admitted snapshot: its reserved estimate, what was removed for it, what goes once it is written."""

    estimate: int
    removed: list[str] = field(default_factory=list)
    later: list[str] = field(default_factory=list)


class SnapshotSpace:
    """One broker's snapshot admissions: one at a time, each reserving its estimate until written.

    `measure(writing)` surveys the directory (a Deferred of a `Survey`:
    a thread) given the names being written; `remove(names)` removes
    snapshots (a Deferred of the names removed: a thread). Both are given
    per call, so the threads and the paths stay with the caller.
    """

    def __init__(self) -> None:
        self.lock = DeferredLock()
        # Estimates reserved by the snapshots being written, by name.
        self.writing: dict[str, int] = {}
        # Snapshots written while an admission runs: its survey may have missed them.
        self._settled: list[tuple[str, int]] | None = None

    def admit(self, name: str, limits: Limits, now: float,
              measure: Callable[[Collection[str]], Deferred[Survey]],
              remove: Callable[[list[str]], Deferred[list[str]]]) -> Deferred[Admission]:
        """Admit the snapshot `name` (its estimate reserved) or fail with SnapshotLimit."""
        return self.lock.run(lambda: Deferred.fromCoroutine(self._admit(name, limits, now, measure, remove)))

    async def _admit(self, name: str, limits: Limits, now: float,
                     measure: Callable[[Collection[str]], Deferred[Survey]],
                     remove: Callable[[list[str]], Deferred[list[str]]]) -> Admission:
        if name in self.writing:
            raise SnapshotExists(f"{name}: already being written")
        settled: list[tuple[str, int]] = []
        self._settled = settled
        try:
            found = await measure(frozenset(self.writing))
            victims = retention_victims(found.snapshots, limits.keep, limits.keep_age, now)
            removed: list[str] = []
            why = self._lacking(found, settled, limits, ())
            if why is not None:
                needed = self._needed(found, settled, limits, victims)
                if needed is None:
                    if victims:
                        why = (f"{self._lacking(found, settled, limits, victims)}, even with the "
                               f"{len(victims)} snapshot(s) beyond {limits.retention()} removed")
                    raise SnapshotLimit(why)
                removed = await remove(needed)
                self._log_removal(needed, removed, limits)
                why = self._lacking(found, settled, limits, removed)
                if why is not None:
                    raise SnapshotLimit(f"{why}; {len(needed) - len(removed)} older snapshot(s) "
                                        f"beyond {limits.retention()} are held by readers")
            # Checked and reserved in this one reactor call.
            self.writing[name] = found.estimate
            return Admission(found.estimate, removed, [v for v in victims if v not in removed])
        finally:
            self._settled = None

    def settle(self, name: str, written: bool) -> None:
        """The snapshot `name` is written (on disk now) or failed (nothing left): its reservation ends."""
        estimate = self.writing.pop(name, 0)
        if written and self._settled is not None:
            self._settled.append((name, estimate))

    def prune(self, names: list[str], limits: Limits,
              remove: Callable[[list[str]], Deferred[list[str]]]) -> Deferred[list[str]]:
        """Remove the snapshots a newly written one put beyond retention (those no reader holds)."""
        async def pruning() -> list[str]:
            removed = await remove(names)
            self._log_removal(names, removed, limits)
            return removed

        return self.lock.run(lambda: Deferred.fromCoroutine(pruning()))

    def _lacking(self, found: Survey, settled: list[tuple[str, int]], limits: Limits,
                 gone: Iterable[str]) -> str | None:
        """Which limit the new snapshot would pass, were `gone` removed; None if it fits."""
        gone = set(gone)
        seen = {e.name for e in found.snapshots}
        kept = sum(e.bytes for e in found.snapshots if e.name not in gone)
        freed = sum(e.bytes for e in found.snapshots if e.name in gone)
        # Finished since the survey began: on disk, but the walk may have missed them.
        missed = sum(estimate for name, estimate in settled if name not in seen)
        if limits.max_bytes:
            used = kept + found.other + missed + sum(self.writing.values())
            if used + found.estimate > limits.max_bytes:
                return (f"snapshots take {used} bytes (those being written counted at their estimate); "
                        f"one more of up to {found.estimate} bytes could pass "
                        f"--snapshot-max-bytes={limits.max_bytes}")
        # What the snapshots being written have yet to write comes off the free space too.
        unwritten = sum(max(0, estimate - found.partial.get(name, 0)) for name, estimate in self.writing.items())
        free = found.free + freed - unwritten
        reserve = limits.reserve_for(found.size)
        if free - found.estimate < reserve:
            return (f"{free} bytes free on the data filesystem (snapshots being written counted); "
                    f"one more of up to {found.estimate} bytes would leave less than the "
                    f"{reserve} bytes kept free for the store (--snapshot-reserve-bytes)")
        return None

    def _needed(self, found: Survey, settled: list[tuple[str, int]], limits: Limits,
                victims: list[str]) -> list[str] | None:
        """The fewest oldest `victims` whose removal makes room; None if all of them would not."""
        for n in range(1, len(victims) + 1):
            if self._lacking(found, settled, limits, victims[:n]) is None:
                return victims[:n]
        return None

    @staticmethod
    def _log_removal(names: list[str], removed: list[str], limits: Limits) -> None:
        for name in names:
            if name in removed:
                log.info("snapshot {name} removed: beyond {retention}", name=name,
                         retention=limits.retention())
            else:
                log.info("snapshot {name} kept for now: beyond {retention}, but a reader holds it",
                         name=name, retention=limits.retention())
