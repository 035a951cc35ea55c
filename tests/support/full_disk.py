"""A full disk: an LMDB environment with room for so many records, or a real disk filled.

`SmallDisk` stands in for a store's LMDB environment in process (commits
beyond its room fail as on a full disk); `fill_disk` fills a real (tmpfs)
file system for the tests of real processes.
"""

from __future__ import annotations

import errno
from pathlib import Path

import lmdb


class SmallDiskTxn:
    """A write transaction on a disk with room for `disk.room` more records: commit fails beyond."""

    def __init__(self, disk: SmallDisk, real) -> None:
        self.disk, self.real, self.puts = disk, real, 0

    def put(self, key, value, **kw):
        self.puts += 1
        return self.real.put(key, value, **kw)

    def cursor(self, *args, **kw):
        return SmallDiskCursor(self, self.real.cursor(*args, **kw))

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self) -> SmallDiskTxn:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None or self.puts > self.disk.room:
            self.real.abort()
            if exc_type is None:
                self.disk.failed += 1
                raise lmdb.Error("mdb_txn_commit: No space left on device")
            return
        self.real.commit()
        self.disk.room -= self.puts


class SmallDiskCursor:
    """A cursor of a `SmallDiskTxn`: the records `putmulti` writes count against the room too."""

    def __init__(self, txn: SmallDiskTxn, real) -> None:
        self.txn, self.real = txn, real

    def putmulti(self, items, *args, **kw):
        items = list(items)
        self.txn.puts += len(items)
        return self.real.putmulti(items, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.real, name)


class SmallDisk:
    """Stands in for a store's LMDB environment: only `room` more records fit, in any transactions.

    Whatever the store does with LMDB goes through `env.begin`, so this
    works on any version of the commit path.
    """

    def __init__(self, store, room: int) -> None:
        self.real, self.room, self.failed = store.env, room, 0
        store.env = self

    def begin(self, write=False, **kw):
        txn = self.real.begin(write=write, **kw)
        return SmallDiskTxn(self, txn) if write else txn

    def __getattr__(self, name):
        return getattr(self.real, name)


def fill_disk(path: Path) -> Path:
    """Write a filler file until the disk is full."""
    filler = path / "filler"
    block = b"\0" * (256 * 1024)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        small = b"\0" * 4096
        try:  # the last pages too
            while True:
                f.write(small)
        except OSError:
            pass
    return filler
