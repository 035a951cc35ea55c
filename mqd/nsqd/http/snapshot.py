"""`POST /snapshot[?out=DIR]`: the broker's whole queue state at one instant, for the Spark bridge.

Every message the broker holds goes in, in every backend: what the store
holds (a compact copy of LMDB in one read transaction) and what the
broker holds outside it (memory queues, in flight with their client and
timeout, deferred with their due time), all taken at one reactor instant
(mqd.nsqd.capture) so nothing is missed or counted twice while the broker
keeps serving. The bulk of the work (the copy, the held messages written
into it, never into the live store) runs in a thread (`deferToThread`).
The answer is `{"path": ..., "manifest": {...}}` once the snapshot is in
place; the manifest's per-queue state counts are those of /stats at the
instant. Ephemeral queues are left out (the manifest lists them). A store
that is failing (a full disk) cannot give a consistent cut:
`503 STORE_FAILED`, and nothing changes.

`out` defaults to `<data-path>/snapshots/<UTC time>`; a given `out` is one
name in that directory (letters, digits and `._:+-`, at most 200, not
starting with a dot: hidden names are the copies in progress), else
`400 INVALID_OUT`; a name already taken is `400 OUT_EXISTS`. Like the
rest of nsqd's HTTP API this is unauthenticated unless auth is configured
(then a bearer secret granted `subscribe` on every topic and channel,
mqd.http.authorization): expose the HTTP port only to operators. Even so
the endpoint never writes through a symlink: a
snapshots directory that is one is refused (500 SNAPSHOT_FAILED, logged),
and a symlink at the destination is a name taken.

Snapshots must not fill the data filesystem (the store would then fail
publishes), so each one is admitted first (mqd.nsqd.snapshot_space), one at a
time, with its estimate (an upper bound of its size, taken in a thread)
reserved until it is written or has failed: the request is
`507 SNAPSHOT_LIMIT`, logged with the limit in the way, when it could pass
`--snapshot-max-bytes` (all snapshots, those being written included) or
leave less free space than `--snapshot-reserve-bytes`. With
`--snapshot-keep` / `--snapshot-keep-age` older snapshots are removed
(oldest first, never one a reader holds); by default none is.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Any

from twisted.internet import threads
from twisted.internet.defer import Deferred
from twisted.web.server import Request

from mqd.http.args import query_of
from mqd.http.auth import AuthState
from mqd.http.authorization import AuthCache, require_grant
from mqd.http.endpoint import LATER, Endpoint, finish_v1
from mqd.http.response import ApiError
from mqd.logs import get_logger
from mqd.nsqd.capture import StoreNotReady, capture
from mqd.nsqd.http.authorization import sees_every_queue
from mqd.nsqd.snapshot_format import Manifest, SnapshotError, SnapshotExists
from mqd.nsqd.snapshot_live import LiveState, snapshot_estimate, write_live_snapshot
from mqd.nsqd.snapshot_space import (
    Limits,
    SnapshotLimit,
    SnapshotSpace,
    Survey,
    disk_use,
    remove_all,
    survey,
)
from mqd.options import Settings

__all__ = ["Snapshot", "SnapshotLimit", "disk_use", "snapshot_into"]

log = get_logger(__name__)

# One plain name: no separator, no dot first (".", "..", the hidden copies in
# progress), short enough for mkdtemp's ".<name>.XXXXXXXX.tmp" to fit NAME_MAX.
_OUT_NAME = re.compile(r"[A-Za-z0-9_:+-][A-Za-z0-9._:+-]{0,199}")


def _real_directory(path: str) -> None:
    """Make `path` a directory if it is missing; refuse one that is a symlink or no directory."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as e:
        raise SnapshotError(f"{path}: cannot create ({e.strerror})") from None
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise SnapshotError(f"{path}: is a symlink, which snapshots do not follow")
    if not stat.S_ISDIR(mode):
        raise SnapshotError(f"{path}: not a directory")


def measure(state: LiveState, env, base: str, writing: Collection[str]) -> Survey:
    """The snapshots directory and the new snapshot's estimate, for its admission (run in a thread)."""
    _real_directory(base)
    return survey(base, writing, snapshot_estimate(state, env))


def snapshot_into(state: LiveState, env, txn, base: str, name: str,
                  broker_id: str | None, node_id: int | None) -> Manifest:
    """Write the snapshot of a capture, named `name` in `base` (run in a thread: it reads the disk).

    `txn` (the store's read transaction of the capture's instant, or None)
    is aborted whatever happens. Run once the snapshot is admitted.
    """
    try:
        _real_directory(base)
        out = os.path.join(base, name)
        if os.path.lexists(out):
            raise SnapshotExists(f"{out}: already exists")
    except BaseException:
        if txn is not None:
            txn.abort()
        raise
    return write_live_snapshot(state, out, env=env, txn=txn, broker_id=broker_id, node_id=node_id)


async def admit_and_write(space: SnapshotSpace, opts: Settings, state: LiveState, env, txn, base: str,
                          name: str) -> Manifest:
    """Admit the snapshot in `space` (mqd.nsqd.snapshot_space), write it in a thread, then apply retention.

    `txn` is aborted whatever happens, here if the snapshot is refused.
    Nothing here touches the broker: `opts` are its options as the capture saw them.
    """
    limits = Limits.of(opts)

    def remove(names: list[str]):
        return threads.deferToThread(remove_all, base, names)

    try:
        admission = await space.admit(
            name, limits, time.time(),
            lambda writing: threads.deferToThread(measure, state, env, base, writing), remove)
    except BaseException:
        if txn is not None:
            txn.abort()
        raise
    try:
        manifest = await threads.deferToThread(snapshot_into, state, env, txn, base, name,
                                               broker_id=opts.broadcast_address, node_id=opts.node_id)
    except BaseException:
        space.settle(name, written=False)
        raise
    space.settle(name, written=True)
    if admission.later:
        await space.prune(admission.later, limits, remove)
    return manifest


class Snapshot(Endpoint):
    """`POST /snapshot`: see the module doc.

    `auth` checks bearer secrets when auth is configured; `space` admits
    the snapshots (both shared by the broker's sites).
    """

    def __init__(self, broker: Any, auth: AuthCache, space: SnapshotSpace) -> None:
        super().__init__(broker)
        self.auth = auth
        self.space = space

    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        # With auth configured, a secret granted every queue's bodies first (mqd.nsqd.http.authorization).
        return self.auth.guard(request, lambda auth: self.take(request, auth))

    def take(self, request: Request, auth: AuthState | None) -> object:
        """The snapshot, for a request authenticated as `auth` (None: auth is not configured)."""
        broker = self.broker
        if auth is not None:
            # In the reactor turn of the capture below: what it writes is what was checked.
            require_grant(sees_every_queue(auth, broker.topics))
        store = broker.store
        base = os.path.join(broker.data_path, "snapshots")
        name = query_of(request).first("out")
        if not name:
            name = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        # Only a name under <data-path>/snapshots: the API is unauthenticated,
        # so it must not be a way to write anywhere the broker may write.
        if not _OUT_NAME.fullmatch(name):
            raise ApiError(400, "INVALID_OUT")
        out = os.path.abspath(os.path.join(base, name))
        if os.path.lexists(out):
            raise ApiError(400, "OUT_EXISTS")
        try:
            state, env, txn = capture(broker)
        except StoreNotReady as e:
            log.warn("snapshot {path} refused: the store is failing: {error}", path=out, error=e)
            raise ApiError(503, "STORE_FAILED") from None
        # Everything the threads need is taken now: they must not touch the broker.
        # The store must not resize its map while a thread reads it.
        if env is not None:
            store.copy_started()
        d = Deferred.fromCoroutine(admit_and_write(self.space, broker.options, state, env, txn,
                                                   os.path.abspath(base), name))
        # The broker closes the store only once the copy is done.
        broker.hold_store(d)

        def done(manifest) -> None:
            log.info("snapshot {path}: {n} messages in {q} queues", path=out,
                     n=manifest.total, q=len(manifest.queues))
            finish_v1(request, 200, {"path": out, "manifest": manifest.to_json()})

        def failed(failure) -> None:
            if failure.check(SnapshotExists):
                finish_v1(request, 400, "OUT_EXISTS")
                return
            if failure.check(SnapshotLimit):
                log.warn("snapshot {path} refused: {error}", path=out, error=failure.value)
                finish_v1(request, 507, "SNAPSHOT_LIMIT")
                return
            if failure.check(SnapshotError):
                log.error("snapshot {path} failed: {error}", path=out, error=failure.value)
            else:
                log.failure("snapshot {path} failed", failure, path=out)
            finish_v1(request, 500, "SNAPSHOT_FAILED")

        def settled(_) -> None:
            if env is not None:
                store.copy_ended()

        d.addCallbacks(done, failed)
        d.addBoth(settled)
        return LATER
