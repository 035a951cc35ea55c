"""Measure two LMDB layouts for mqd's storage backend with many queues.

Why this exists: the LMDB backend keeps one FIFO queue per topic and per channel
in a single LMDB environment, and brokers can carry ~10,000 channels.  Two layouts
are possible and LMDB's cost model differs between them, so we decide by measuring
instead of guessing:

  A  one named database per queue (``env.open_db(name)``, ``max_dbs`` >= queues + 1),
     keys = 8-byte big-endian sequence number;
  B  one database for every queue, keys = 4-byte big-endian queue id + 8-byte
     big-endian sequence number; a small registry database maps name -> queue id.

Named databases are not free in LMDB: every transaction begin/commit walks (and a
write transaction copies) per-DBI state for all open handles, so layout A may pay a
per-transaction cost that grows with the number of queues.  Layout B pays instead
with longer keys, one shared B-tree, and a cursor range delete to drop a queue.

For each layout, in a fresh directory, this measures: creating and reopening all
queues (in-process and in a fresh subprocess), group-commit write throughput
(100 x 230-byte messages per transaction over 1 / 10 / 100 random queues), batch
read + delete of 100 records per queue (a consumer draining), empty-transaction
overhead, dropping a 10,000-record queue, and file size.  Throughput parts run with
``sync=False, metasync=False``; the "durable" variants add one ``env.sync(True)``
per commit.

Usage::

    python -m bench lmdb-layout [--queues 10000] [--dir TMP] [--json OUT]
    python bench/experiments/lmdb_layout.py ...     # the same, as a script

Standard library + ``lmdb`` only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import lmdb

MAP_SIZE = 8 << 30
MSG = bytes(range(230))  # 230-byte body; LMDB does not compress, so content is irrelevant
SEQ = struct.Struct(">Q")
QSEQ = struct.Struct(">IQ")
QID = struct.Struct(">I")
REGISTRY = b"registry"
DATA = b"data"

now = time.perf_counter


def qname(i: int) -> bytes:
    return b"topic.%06d/channel" % i


def open_env(path: str, max_dbs: int) -> lmdb.Environment:
    return lmdb.open(
        path,
        map_size=MAP_SIZE,
        max_dbs=max_dbs,
        sync=False,
        metasync=False,
        readahead=False,
        max_readers=16,
    )


# --------------------------------------------------------------------------- layouts


class LayoutA:
    """One named DB per queue; key = 8-byte BE sequence."""

    name = "A"

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n = path, n
        self.env = open_env(path, n + 1)
        self.dbs: list = [None] * n
        self.head = [0] * n  # next sequence to read
        self.tail = [0] * n  # next sequence to write

    def create_one_txn(self) -> None:
        with self.env.begin(write=True) as txn:
            for i in range(self.n):
                self.dbs[i] = self.env.open_db(qname(i), txn=txn, create=True)

    def create_txn_each(self) -> None:
        for i in range(self.n):
            self.dbs[i] = self.env.open_db(qname(i), create=True)

    @staticmethod
    def reopen(path: str, n: int) -> tuple[lmdb.Environment, int]:
        """What a restarted broker does: list the queues, open every handle."""
        env = open_env(path, n + 1)
        with env.begin(write=True) as txn:
            names = [k for k in txn.cursor().iternext(values=False)]
            dbs = [env.open_db(k, txn=txn, create=False) for k in names]
        return env, len(dbs)

    def close(self) -> None:
        self.env.close()

    def reattach(self) -> None:
        self.env = open_env(self.path, self.n + 1)
        with self.env.begin(write=True) as txn:
            for i in range(self.n):
                self.dbs[i] = self.env.open_db(qname(i), txn=txn, create=False)

    def write_txn(self, targets: list[int]) -> None:
        """Put one message per entry of targets (queue indexes) in one transaction."""
        tail, dbs, pack = self.tail, self.dbs, SEQ.pack
        with self.env.begin(write=True) as txn:
            put = txn.put
            for q in targets:
                put(pack(tail[q]), MSG, db=dbs[q])
                tail[q] += 1

    def drain(self, q: int, count: int) -> int:
        """Read the first count records with a cursor and delete them, one txn."""
        got = 0
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=self.dbs[q])
            if cur.first():
                while got < count:
                    _val = cur.value()
                    got += 1
                    if not cur.delete():  # moves to the next record
                        break
                    if not cur.key():
                        break
        self.head[q] += got
        return got

    def drop(self, q: int) -> None:
        with self.env.begin(write=True) as txn:
            txn.drop(self.dbs[q], delete=True)
        self.dbs[q] = None

    def entries(self) -> int:
        with self.env.begin() as txn:
            return sum(txn.stat(db)["entries"] for db in self.dbs if db is not None)

    def pages(self) -> int:
        total = 0
        with self.env.begin() as txn:
            for db in [None, *[d for d in self.dbs if d is not None]]:
                s = txn.stat(db) if db is not None else self.env.stat()
                total += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        return total


class LayoutB:
    """One DB for all queues; key = 4-byte BE queue id + 8-byte BE sequence."""

    name = "B"

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n = path, n
        self.env = open_env(path, 2)
        self.registry = self.env.open_db(REGISTRY)
        self.data = self.env.open_db(DATA)
        self.qid = [i + 1 for i in range(n)]  # queue index -> id (0 reserved)
        self.head = [0] * n
        self.tail = [0] * n

    def create_one_txn(self) -> None:
        with self.env.begin(write=True, db=self.registry) as txn:
            for i in range(self.n):
                txn.put(qname(i), QID.pack(self.qid[i]))

    def create_txn_each(self) -> None:
        for i in range(self.n):
            with self.env.begin(write=True, db=self.registry) as txn:
                txn.put(qname(i), QID.pack(self.qid[i]))

    @staticmethod
    def reopen(path: str, n: int) -> tuple[lmdb.Environment, int]:
        env = open_env(path, 2)
        reg = env.open_db(REGISTRY, create=False)
        env.open_db(DATA, create=False)
        with env.begin(db=reg) as txn:
            ids = {k: QID.unpack(v)[0] for k, v in txn.cursor()}
        return env, len(ids)

    def close(self) -> None:
        self.env.close()

    def reattach(self) -> None:
        self.env = open_env(self.path, 2)
        self.registry = self.env.open_db(REGISTRY, create=False)
        self.data = self.env.open_db(DATA, create=False)

    def write_txn(self, targets: list[int]) -> None:
        tail, qid, pack = self.tail, self.qid, QSEQ.pack
        with self.env.begin(write=True, db=self.data) as txn:
            put = txn.put
            for q in targets:
                put(pack(qid[q], tail[q]), MSG)
                tail[q] += 1

    def drain(self, q: int, count: int) -> int:
        prefix = QID.pack(self.qid[q])
        got = 0
        with self.env.begin(write=True, db=self.data) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                while got < count:
                    if cur.key()[:4] != prefix:
                        break
                    _val = cur.value()
                    got += 1
                    if not cur.delete():
                        break
                    if not cur.key():
                        break
        self.head[q] += got
        return got

    def drop(self, q: int) -> None:
        prefix = QID.pack(self.qid[q])
        with self.env.begin(write=True, db=self.data) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                while cur.key()[:4] == prefix:
                    if not cur.delete():
                        break
            txn.delete(qname(q), db=self.registry)

    def entries(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.data)["entries"]

    def pages(self) -> int:
        total = 0
        with self.env.begin() as txn:
            for s in (self.env.stat(), txn.stat(self.registry), txn.stat(self.data)):
                total += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        return total


LAYOUTS = {"A": LayoutA, "B": LayoutB}


# --------------------------------------------------------------------------- helpers


def summary(samples: list[float]) -> dict:
    """Mean / median / p99 in microseconds of a list of durations in seconds."""
    s = sorted(samples)
    return {
        "mean_us": statistics.fmean(s) * 1e6,
        "p50_us": s[len(s) // 2] * 1e6,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
        "n": len(s),
    }


def txn_overhead(env: lmdb.Environment, reps: int, db) -> dict:
    """Microseconds for: empty write txn begin+commit, write txn with one 8-byte put
    into db (commit has a dirty page, so it walks the DB table), read txn begin+abort."""
    begin = env.begin
    key = b"\xff" * 12  # outside every queue's key range; deleted afterwards
    for _ in range(min(reps, 200)):  # warm-up
        begin(write=True).commit()
    t0 = now()
    for _ in range(reps):
        begin(write=True).commit()
    w = (now() - t0) / reps
    t0 = now()
    for _ in range(reps):
        txn = begin(write=True, db=db)
        txn.put(key, b"x" * 8)
        txn.commit()
    w1 = (now() - t0) / reps
    with begin(write=True, db=db) as txn:
        txn.delete(key)
    t0 = now()
    for _ in range(reps):
        begin().abort()
    r = (now() - t0) / reps
    return {"write_us": w * 1e6, "put1_us": w1 * 1e6, "read_us": r * 1e6}


def subprocess_reopen(layout: str, path: str, n: int) -> float:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_reopen", layout, path, str(n)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)["seconds"]


def fill(lay, q: int, count: int, per_txn: int = 1000) -> None:
    """Untimed: append count messages to queue q."""
    while count > 0:
        k = min(per_txn, count)
        lay.write_txn([q] * k)
        count -= k


# --------------------------------------------------------------------------- phases


def run_layout(name: str, args, rng: random.Random) -> dict:
    cls = LAYOUTS[name]
    n = args.queues
    res: dict = {"layout": name}

    # 1a. create queues one transaction each (channels appear one at a time)
    path = tempfile.mkdtemp(prefix=f"lmdb-{name}-each-", dir=args.dir)
    lay = cls(path, n)
    t0 = now()
    lay.create_txn_each()
    res["create_txn_each_s"] = now() - t0
    lay.close()
    shutil.rmtree(path)

    # 1b. create all queues in one transaction; this env is used for the rest
    path = tempfile.mkdtemp(prefix=f"lmdb-{name}-", dir=args.dir)
    lay = cls(path, n)
    t0 = now()
    lay.create_one_txn()
    res["create_one_txn_s"] = now() - t0

    # 1c. reopen: close, reopen env, list registry / reopen every handle
    lay.close()
    t0 = now()
    env, count = cls.reopen(path, n)
    res["reopen_s"] = now() - t0
    assert count == n, (count, n)
    env.close()
    res["reopen_subprocess_s"] = subprocess_reopen(name, path, n)
    lay.reattach()

    # 4. per-transaction overhead with all queues open
    res["overhead"] = txn_overhead(
        lay.env, args.overhead_reps, lay.dbs[0] if name == "A" else lay.data
    )

    # 2. group-commit writes
    per_txn = 100
    res["write"] = {}
    for durable in (False, True):
        txns = args.durable_txns if durable else args.txns
        for spread in (1, 10, 100):
            times = []
            for _ in range(txns):
                qs = rng.sample(range(n), spread)
                targets = [qs[i % spread] for i in range(per_txn)]
                t0 = now()
                lay.write_txn(targets)
                if durable:
                    lay.env.sync(True)
                times.append(now() - t0)
            s = summary(times)
            s["msgs_per_s"] = per_txn * len(times) / sum(times)
            res["write"][f"{'durable' if durable else 'nosync'}/{spread}q"] = s

    # 6. file size after the write phase
    lay.env.sync(True)
    info = lay.env.info()
    psize = lay.env.stat()["psize"]
    entries = lay.entries()
    res["size"] = {
        "data_mdb_bytes": os.path.getsize(os.path.join(path, "data.mdb")),
        "last_pgno_bytes": (info["last_pgno"] + 1) * psize,
        "tree_pages_bytes": lay.pages() * psize,
        "entries": entries,
        "payload_bytes": entries * len(MSG),
        "main_db_entries": lay.env.stat()["entries"],
    }

    # 3. batch read + delete, N records per queue, over random queues
    batch = args.batch
    picks = rng.sample(range(n), args.drain_queues)
    for q in picks:  # untimed top-up: room for a nosync and a durable batch
        need = 2 * batch - (lay.tail[q] - lay.head[q])
        if need > 0:
            fill(lay, q, need)
    res["drain"] = {}
    for durable, qs in ((False, picks), (True, picks[: args.durable_drains])):
        times = []
        for q in qs:
            t0 = now()
            got = lay.drain(q, batch)
            if durable:
                lay.env.sync(True)
            times.append(now() - t0)
            assert got == batch, (q, got)
        res["drain"]["durable" if durable else "nosync"] = summary(times)

    # 5. drop one queue holding 10,000 records
    res["drop"] = {}
    victims = rng.sample([q for q in range(n) if q not in set(picks)], 2 * args.drop_reps)
    for durable, qs in ((False, victims[: args.drop_reps]), (True, victims[args.drop_reps :])):
        times = []
        for q in qs:
            fill(lay, q, args.drop_records - (lay.tail[q] - lay.head[q]))
            before = lay.entries() if name == "B" else None
            t0 = now()
            lay.drop(q)
            if durable:
                lay.env.sync(True)
            times.append(now() - t0)
            if before is not None:
                assert before - lay.entries() == lay.tail[q] - lay.head[q]
        res["drop"]["durable" if durable else "nosync"] = summary(times)

    lay.close()
    if not args.keep:
        shutil.rmtree(path)
    return res


def control_overhead(args) -> dict:
    """Empty-txn overhead with a single named DB, with max_dbs small and max_dbs = queues+1."""
    out = {}
    for label, max_dbs in (
        ("1db/max_dbs=2", 2),
        (f"1db/max_dbs={args.queues + 1}", args.queues + 1),
    ):
        path = tempfile.mkdtemp(prefix="lmdb-ctl-", dir=args.dir)
        env = open_env(path, max_dbs)
        db = env.open_db(b"q")
        out[label] = txn_overhead(env, args.overhead_reps, db)
        env.close()
        shutil.rmtree(path)
    return out


# --------------------------------------------------------------------------- report


def report(results: dict, args) -> None:
    a, b = results["A"], results["B"]
    rows: list[tuple[str, str, str]] = []

    def row(label, key, fmt):
        rows.append((label, fmt(key(a)), fmt(key(b))))

    def sec(x):
        return f"{x * 1e3:,.1f} ms"

    def us(x):
        return f"{x:,.1f} us"

    row(f"create {args.queues} queues, 1 txn each", lambda r: r["create_txn_each_s"], sec)
    row(f"create {args.queues} queues, one txn", lambda r: r["create_one_txn_s"], sec)
    row("reopen env + all queues (in-process)", lambda r: r["reopen_s"], sec)
    row("reopen env + all queues (fresh process)", lambda r: r["reopen_subprocess_s"], sec)
    row("empty write txn begin+commit", lambda r: r["overhead"]["write_us"], us)
    row("write txn with 1 put, begin+commit", lambda r: r["overhead"]["put1_us"], us)
    row("empty read txn begin+abort", lambda r: r["overhead"]["read_us"], us)
    for k in a["write"]:
        row(
            f"write {k}: msgs/s",
            lambda r, k=k: r["write"][k]["msgs_per_s"],
            lambda x: f"{x:,.0f}",
        )
        row(
            f"write {k}: us/commit mean (p99)",
            lambda r, k=k: (r["write"][k]["mean_us"], r["write"][k]["p99_us"]),
            lambda x: f"{x[0]:,.0f} ({x[1]:,.0f})",
        )
    for k in a["drain"]:
        row(
            f"drain {args.batch} recs {k}: us/batch mean (p99)",
            lambda r, k=k: (r["drain"][k]["mean_us"], r["drain"][k]["p99_us"]),
            lambda x: f"{x[0]:,.0f} ({x[1]:,.0f})",
        )
    for k in a["drop"]:
        row(
            f"drop {args.drop_records}-rec queue {k}: median",
            lambda r, k=k: r["drop"][k]["p50_us"],
            lambda x: f"{x / 1e3:,.2f} ms",
        )
    for key in ("data_mdb_bytes", "last_pgno_bytes", "tree_pages_bytes", "payload_bytes"):
        row(f"size: {key}", lambda r, key=key: r["size"][key], lambda x: f"{x / 2**20:,.1f} MiB")
    row("size: entries", lambda r: r["size"]["entries"], lambda x: f"{x:,}")

    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{'':{w0}}  {'A: DB per queue':>{max(w1, 15)}}  B: one DB, prefixed keys")
    for label, x, y in rows:
        print(f"{label:{w0}}  {x:>{max(w1, 15)}}  {y:>15}")
    print("\ncontrol, empty txn overhead with one named DB:")
    for label, o in results["control"].items():
        print(
            f"  {label:22} empty write {o['write_us']:6.1f} us   1-put write "
            f"{o['put1_us']:6.1f} us   read {o['read_us']:6.1f} us"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench lmdb-layout",
                                description=__doc__.splitlines()[0])
    p.add_argument("--queues", type=int, default=10000)
    p.add_argument("--dir", default=None, help="parent of the temp dirs (default: system tmp)")
    p.add_argument("--txns", type=int, default=2000, help="group commits per spread (nosync)")
    p.add_argument(
        "--durable-txns", type=int, default=200, help="group commits per spread (durable)"
    )
    p.add_argument("--batch", type=int, default=100, help="records per drain batch")
    p.add_argument("--drain-queues", type=int, default=1000)
    p.add_argument("--durable-drains", type=int, default=200)
    p.add_argument("--drop-records", type=int, default=10000)
    p.add_argument("--drop-reps", type=int, default=5)
    p.add_argument("--overhead-reps", type=int, default=5000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--layouts", default="AB")
    p.add_argument("--keep", action="store_true", help="keep the main temp dirs")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--_reopen", nargs=3, dest="reopen", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.reopen:  # child of subprocess_reopen(): time a cold-process reopen
        layout, path, n = args.reopen
        t0 = now()
        env, _count = LAYOUTS[layout].reopen(path, int(n))
        print(json.dumps({"seconds": now() - t0}))
        env.close()
        return 0

    print(
        f"lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}), "
        f"python {sys.version.split()[0]}, {args.queues} queues"
    )
    results: dict = {}
    t_all = now()
    for name in args.layouts:
        t0 = now()
        results[name] = run_layout(name, args, random.Random(args.seed))
        print(f"layout {name} done in {now() - t0:.1f} s", flush=True)
    results["control"] = control_overhead(args)
    if set(args.layouts) >= {"A", "B"}:
        report(results, args)
    print(f"\ntotal {now() - t_all:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
