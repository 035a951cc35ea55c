"""Opening the store's LMDB environment: its files, its databases and its format mark.

A directory that is not an LMDB environment, holds someone else's, or
has no room to create one stops start-up with one line (StoreOpenError)
naming it; nothing in it is touched. What the environment holds is
described in backends.lmdb_records.
"""

from __future__ import annotations

import errno
import os
from typing import Any, NamedTuple

import lmdb

from backends.interface import StoreOpenError
from backends.lmdb_records import FORMAT, OUR_DBS

__all__ = ["ROOM_FOR_NEW_ENV", "Environment", "no_room", "open_environment"]

# Room a new environment needs before LMDB creates its files: LMDB writes
# its lock file through a memory map, and on a full disk a page fault there
# is a SIGBUS, which kills the process without a word.
ROOM_FOR_NEW_ENV = 1 << 20


class Environment(NamedTuple):
    """An open environment and its three databases (see backends.lmdb_records)."""

    env: lmdb.Environment
    # py-lmdb's database handles (its _Database, which it does not export).
    meta_db: Any
    registry_db: Any
    data_db: Any


def open_environment(path: str, map_size: int, durable: bool) -> Environment:
    """Open (or create) mqd's environment in `path`; raises StoreOpenError with the reason.

    A durable environment syncs every commit (and its meta page). The
    databases and the format mark are created in one transaction, so a
    crash cannot leave a half-made environment.
    """
    try:
        os.makedirs(path, exist_ok=True)
        check_room(path)
        env = lmdb.open(
            path, map_size=map_size, max_dbs=8, subdir=True,
            sync=durable, metasync=durable, readahead=False,
        )
    except lmdb.Error as e:
        raise StoreOpenError(f"{path}: not a usable LMDB environment ({e})") from None
    except OSError as e:
        if no_room(e):
            raise StoreOpenError(no_room_text(path, e.strerror or str(e))) from None
        raise StoreOpenError(f"{path}: {e.strerror}") from None
    try:
        with env.begin() as txn:
            names = {bytes(k) for k, _ in txn.cursor()}
        foreign = names - OUR_DBS
        if foreign:
            raise StoreOpenError(
                f"{path}: an LMDB environment that is not mqd's (databases {sorted(foreign)!r})"
            )
        with env.begin(write=True) as txn:
            meta_db = env.open_db(b"meta", txn=txn)
            registry_db = env.open_db(b"queues", txn=txn)
            data_db = env.open_db(b"messages", txn=txn)
            mark = txn.get(b"format", db=meta_db)
            if mark is None:
                if names & {b"queues", b"messages"}:
                    raise StoreOpenError(f"{path}: mqd data without a format mark; refusing it")
                txn.put(b"format", FORMAT, db=meta_db)
            elif mark != FORMAT:
                raise StoreOpenError(f"{path}: unknown data format {mark!r} (expected {FORMAT!r})")
    except lmdb.Error as e:
        env.close()
        if no_room(e):
            raise StoreOpenError(no_room_text(path, str(e))) from None
        raise StoreOpenError(f"{path}: corrupt LMDB environment ({e})") from None
    except StoreOpenError:
        env.close()
        raise
    return Environment(env, meta_db, registry_db, data_db)


def check_room(path: str) -> None:
    """Before LMDB creates files (a new environment): raise OSError if the disk has no room for them.

    Only creating files needs room; an existing environment opens
    without writing, so a full disk does not keep it from serving.
    """
    if all(os.path.exists(os.path.join(path, f)) for f in ("data.mdb", "lock.mdb")):
        return
    probe = os.path.join(path, ".room-check")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, ROOM_FOR_NEW_ENV)
    except OSError as e:
        if no_room(e):
            raise
        # No fallocate on this filesystem: LMDB's own errors will tell.
    finally:
        os.close(fd)
        os.unlink(probe)


def no_room(error: BaseException) -> bool:
    """A write failed for lack of space (a full disk or quota), not because the data is bad."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, lmdb.DiskError) or "No space left" in str(error) or "quota" in str(error)


def no_room_text(path: str, error: str) -> str:
    return (f"{path}: cannot create the store: {error}; "
            f"free space on that filesystem or choose another --data-path")
