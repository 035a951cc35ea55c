"""`POST /snapshot[?out=DIR]`: a consistent copy of the LMDB store for the Spark bridge (issue #7).

The copy runs in a thread (`deferToThread`): it takes a few hundred
milliseconds per 250 MB, and LMDB lets it read in its own transaction
while the reactor keeps committing, so publishing and delivery go on
during a snapshot. The answer is `{"path": ..., "manifest": {...}}` once
the snapshot is in place. Only the lmdb backend has anything to copy:
other backends answer `400 SNAPSHOT_UNSUPPORTED`.

`out` defaults to `<data-path>/snapshots/<UTC time>`; it is always a name
under `<data-path>/snapshots` (absolute paths and `..` get 400 INVALID_OUT). Like the rest of nsqd's HTTP API this
is unauthenticated: expose the HTTP port only to operators.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime

from twisted.internet import threads
from twisted.web.server import Request

from spark_bridge.snapshot import SnapshotError, take_snapshot

from ..logs import get_logger
from .args import query_of
from .endpoint import LATER, Endpoint, finish_v1
from .response import ApiError

__all__ = ["Snapshot"]

log = get_logger(__name__)


class Snapshot(Endpoint):
    def handle_POST(self, request: Request, params: Mapping[str, str]) -> object:
        broker = self.broker
        store = broker.store
        env = getattr(store, "env", None)
        if broker.options.backend != "lmdb" or env is None:
            raise ApiError(400, "SNAPSHOT_UNSUPPORTED")
        base = os.path.join(broker.data_path, "snapshots")
        out = query_of(request).first("out")
        if not out:
            out = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        # Only a name under <data-path>/snapshots: the API is unauthenticated,
        # so it must not be a way to write anywhere the broker may write.
        if os.path.isabs(out) or ".." in out.split("/") or "\0" in out:
            raise ApiError(400, "INVALID_OUT")
        out = os.path.abspath(os.path.join(base, out))
        opts = broker.options
        # Everything the thread needs is taken now: it must not touch the broker.
        # The store must not resize its map while the thread reads it.
        store.copies += 1
        d = threads.deferToThread(take_snapshot, env, out, broker_id=opts.broadcast_address,
                                  node_id=opts.node_id)
        broker.background.add(d)

        def done(manifest) -> None:
            log.info("snapshot {path}: {n} messages in {q} queues", path=out,
                     n=manifest.total, q=len(manifest.queues))
            finish_v1(request, 200, {"path": out, "manifest": manifest.to_json()})

        def failed(failure) -> None:
            if failure.check(SnapshotError):
                log.error("snapshot {path} failed: {error}", path=out, error=failure.value)
            else:
                log.failure("snapshot {path} failed", failure, path=out)
            finish_v1(request, 500, "SNAPSHOT_FAILED")

        def settled(_) -> None:
            broker.background.discard(d)
            store.copies -= 1

        d.addCallbacks(done, failed)
        d.addBoth(settled)
        return LATER
