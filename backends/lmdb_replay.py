"""Crash replay: what the publish log holds past LMDB's last checkpoint is written into LMDB at start-up.

A durable store answers a publish once its chunk of the publish log
(backends.lmdb_log) is synced, and LMDB takes what was logged only at
the next checkpoint, which records the last chunk it holds (the
`LOG_EPOCH` meta key). After a crash, the chunks newer than that are
written into LMDB before the store serves anything.
"""

from __future__ import annotations

import os

import lmdb

from backends.interface import StoreOpenError
from backends.lmdb_env import Environment
from backends.lmdb_log import LOG_FILE, parse_chunks
from backends.lmdb_records import EPOCH, LOG_EPOCH
from mqd.logs import get_logger

__all__ = ["replay_publish_log"]

# The store speaks for its start-up: one namespace for every LMDB log line.
log = get_logger("backends.lmdb")


def replay_publish_log(handles: Environment, path: str, durable: bool) -> int:
    """Write into LMDB what the publish log in `path` holds past the last checkpoint; the last chunk's epoch.

    Torn or damaged chunks at the end are what a crash cut short: their
    publishers were never answered, so they are dropped. A durable store
    then writes the log over from its start (the returned epoch numbers
    its next chunks); any other removes it. Raises StoreOpenError if the
    log cannot be read or written into LMDB.
    """
    env, meta_db, data_db = handles.env, handles.meta_db, handles.data_db
    with env.begin(db=meta_db) as txn:
        mark = txn.get(LOG_EPOCH)
    done: int = EPOCH.unpack(mark)[0] if mark is not None else 0
    log_path = os.path.join(path, LOG_FILE)
    try:
        with open(log_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return done
    except OSError as e:
        raise StoreOpenError(f"{log_path}: cannot read the publish log: {e.strerror}") from None
    if not raw:
        return done
    try:
        with env.begin(write=True, db=data_db) as txn:
            epoch = done
            records = deleted = 0
            for epoch_, ops in parse_chunks(raw):
                if epoch_ <= done:
                    continue
                epoch = epoch_
                for key, record in ops:
                    if record is None:
                        deleted += txn.delete(key)
                    else:
                        txn.put(key, record)
                        records += 1
            if epoch != done:
                txn.put(LOG_EPOCH, EPOCH.pack(epoch), db=meta_db)
        env.sync(True)
    except lmdb.Error as e:
        raise StoreOpenError(f"{log_path}: cannot replay the publish log into LMDB ({e})") from None
    if epoch != done:
        log.info("{path}: {n} records written and {d} deleted from the publish log (chunks "
                 "{first} to {last})", path=log_path, n=records, d=deleted, first=done + 1, last=epoch)
    if not durable:
        # A durable store writes over it (replay skips what LMDB holds);
        # any other has no use for it.
        try:
            os.unlink(log_path)
        except OSError as e:
            log.warn("{path}: cannot remove the publish log ({error}); it is replayed no "
                     "further than LMDB says", path=log_path, error=e.strerror)
    return epoch
