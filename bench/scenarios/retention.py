"""The retained log's costs: publishing with retention on vs off, one reader of /topic/read, bytes per record.

Three measurements, each on real `twistd mqd` brokers on loopback:

- ``publish``: a publisher (MPUB x ``--batch`` of ``--size`` bytes, for
  ``--duration`` s) into a topic with one channel and a consumer-less
  backlog, retention off then on, alternating ``--repeat`` times per
  backend (memory, lmdb, lmdb --durable); the median msgs/s of each and
  the ratio on/off.
- ``read``: ``--count`` records of ``--size`` bytes retained (no channel),
  then one HTTP client reads them all with ``GET /topic/read`` (binary
  frames, ``--read-bytes`` per request, one kept-alive connection) and
  counts the frames: msgs/s delivered to the reader.
- ``size``: after that fill, the broker's RSS and the data directory's
  bytes per retained record, retention on minus retention off (the topic
  without channels holds its backlog either way).

Usage::

    python -m bench retention [--what publish,read,size] [--repeat 3] [--count 1000000]
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import time
from pathlib import Path

from bench.harness import wire
from bench.harness.broker import Broker, proc_memory
from bench.harness.load import WriterConfig, fill, publish

_BACKENDS = {
    "memory": ("memory", []),
    "lmdb": ("lmdb", []),
    "durable": ("lmdb", ["--durable"]),
}
_FRAME_SIZE = 4  # the size field of a record frame (mqd.wire.log_frames)


def _retention(on: bool, backend: str) -> list[str]:
    # The memory backend needs a bytes bound; a large one keeps every record of a run.
    return ["--retention-bytes=100GB"] if on else []


def _http(broker: Broker) -> http.client.HTTPConnection:
    host, port = wire.parse_address(broker.http_address or "")
    return http.client.HTTPConnection(host, port, timeout=600)


def _request(conn: http.client.HTTPConnection, method: str, path: str) -> tuple[int, bytes, http.client.HTTPResponse]:
    conn.request(method, path)
    answer = conn.getresponse()
    return answer.status, answer.read(), answer


def publish_rate(backend: str, on: bool, args: argparse.Namespace) -> float:
    """Messages/s a publisher gets into a topic with one channel, retention `on` or off."""
    name, extra = _BACKENDS[backend]
    with Broker(name, args.mem_queue_size, extra + _retention(on, name)) as broker:
        conn = _http(broker)
        for path in ("/topic/create?topic=bench", "/channel/create?topic=bench&channel=c"):
            status, body, _ = _request(conn, "POST", path)
            if status != 200:
                raise SystemExit(f"{path} answered {status}: {body!r}")
        cfg = WriterConfig(address=broker.address or ("127.0.0.1", 0), topic="bench", size=args.size,
                           batch=args.batch, pipeline=4, duration=args.duration)
        result = publish(cfg)
        return float(result["messages"]) / max(float(result["t_end"]) - float(result["t_start"]), 1e-9)


def _count_frames(data: bytes) -> int:
    """Frames in a whole answer, walking their size fields (what any reader must do at least)."""
    n = pos = 0
    end = len(data)
    while pos < end:
        pos += 4 + int.from_bytes(data[pos:pos + _FRAME_SIZE], "big")
        n += 1
    return n


def read_rate(broker: Broker, count: int, read_bytes: int) -> tuple[float, int]:
    """Msgs/s one client reads `count` records at, from offset 0; and the bytes it got."""
    conn = _http(broker)
    offset = got = size = 0
    start = time.perf_counter()
    while got < count:
        status, body, answer = _request(
            conn, "GET", f"/topic/read?topic=bench&offset={offset}&max_messages={count}&max_bytes={read_bytes}")
        if status != 200:
            raise SystemExit(f"/topic/read answered {status}: {body[:200]!r}")
        got += _count_frames(body)
        size += len(body)
        offset = int(answer.getheader("X-Mqd-Next-Offset") or 0)
    return got / (time.perf_counter() - start), size


def _dir_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def filled(backend: str, on: bool, args: argparse.Namespace, measure_read: bool) -> dict[str, float]:
    """Fill `--count` records into a topic without channels; RSS, disk and (if asked) the read rate."""
    name, extra = _BACKENDS[backend]
    with Broker(name, args.mem_queue_size, extra + _retention(on, name)) as broker:
        before = proc_memory(broker.pid)["VmRSS"]
        disk_before = _dir_bytes(broker.data_path)
        fill(broker.address or ("127.0.0.1", 0), "bench", args.count, size=args.size)
        time.sleep(1.0)  # a checkpoint and a sync
        out = {"rss": (proc_memory(broker.pid)["VmRSS"] - before) * 1024.0,
               "disk": float(_dir_bytes(broker.data_path) - disk_before)}
        if measure_read and on:
            rates = [read_rate(broker, args.count, args.read_bytes)[0] for _ in range(args.repeat)]
            out["read"] = statistics.median(rates)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench retention", description=__doc__.splitlines()[0])
    p.add_argument("--what", default="publish,read,size", help="comma-separated, of publish, read, size")
    p.add_argument("--backends", default="memory,lmdb,durable", help="of memory, lmdb, durable (publish)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of each publish run")
    p.add_argument("--size", type=int, default=200)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--count", type=int, default=1_000_000, help="records retained for read and size")
    p.add_argument("--read-bytes", type=int, default=16 << 20, help="max_bytes of each /topic/read")
    p.add_argument("--read-backend", default="lmdb", help="backend of the read and size runs")
    p.add_argument("--mem-queue-size", type=int, default=10000)
    args = p.parse_args(argv)
    what = set(args.what.split(","))
    if "publish" in what:
        print(f"publish: MPUB x {args.batch} of {args.size} B, {args.duration:g} s, one channel, "
              f"mem-queue-size {args.mem_queue_size}, {args.repeat} alternating runs")
        for backend in args.backends.split(","):
            off: list[float] = []
            on: list[float] = []
            for _ in range(args.repeat):
                off.append(publish_rate(backend, False, args))
                on.append(publish_rate(backend, True, args))
            print(f"  {backend:<8} off {statistics.median(off):>10,.0f}/s  on {statistics.median(on):>10,.0f}/s  "
                  f"ratio {statistics.median(on) / statistics.median(off):.2f}  (runs off {off}, on {on})",
                  flush=True)
    if "read" in what or "size" in what:
        print(f"read/size: {args.count:,} records of {args.size} B, backend {args.read_backend}, "
              f"mem-queue-size {args.mem_queue_size}, /topic/read max_bytes {args.read_bytes:,}")
        with_log = filled(args.read_backend, True, args, "read" in what)
        if "read" in what:
            print(f"  one reader of /topic/read: {with_log['read']:,.0f} msgs/s (median of {args.repeat})")
        if "size" in what:
            without = filled(args.read_backend, False, args, False)
            for key, label in (("rss", "RSS"), ("disk", "disk")):
                per = (with_log[key] - without[key]) / args.count
                print(f"  {label} per retained record: {per:,.0f} B (on {with_log[key] / 1e6:,.1f} MB, "
                      f"off {without[key] / 1e6:,.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
