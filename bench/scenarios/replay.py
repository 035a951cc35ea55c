"""``python -m bench replay``: a retained topic replayed into a channel with one consumer attached.

One real `twistd mqd` with retention on: ``--count`` records of ``--size``
bytes are published into a topic whose channel ``c`` is then emptied, a
consumer (the bench reader: RDY ``--rdy``, FIN every message) subscribes to
``c``, and ``POST /channel/replay?offset=0`` queues the whole log into it
again. Meanwhile a bystander connection PUBs to another topic every
``--interval`` seconds (10 ms), one round trip at a time. Reported: the
replay's time (the request to the consumer's last message) and msgs/s,
the bystander's worst and 99th percentile round trip during it, and the
broker's RSS before the replay and its peak during it (with RssAnon, the
heap without the store's mapped file pages).

```sh
python -m bench replay                               # 1,000,000 x 200 B, lmdb, mem-queue-size 10000
python -m bench replay --count 100000 --backend memory
```
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue as queue_module
import threading
import time

from bench.harness import wire
from bench.harness.broker import BenchError, Broker, Sampler, proc_memory
from bench.harness.load import ReaderConfig, fill, reader_main
from bench.harness.report import percentile

TOPIC = "replay"
CHANNEL = "c"
BYSTANDER_TOPIC = "bystander"


def _bystander(address: tuple[str, int], interval: float, stop: threading.Event, out: list[float]) -> None:
    """PUB one byte to another topic every `interval` s until `stop`; each round trip's seconds into `out`."""
    sock = wire.connect(address)
    try:
        wire.identify(sock, "bystander")
        pub = f"PUB {BYSTANDER_TOPIC}\n".encode() + wire.SIZE.pack(1) + b"y"
        next_at = time.monotonic()
        while not stop.is_set():
            sent = time.monotonic()
            sock.sendall(pub)
            wire.expect(sock, b"OK", "PUB")
            out.append(time.monotonic() - sent)
            next_at += interval
            pause = next_at - time.monotonic()
            if pause > 0:
                stop.wait(pause)
            else:
                next_at = time.monotonic()
    finally:
        sock.close()


def run(broker: Broker, args: argparse.Namespace) -> dict:
    address = broker.address
    http = broker.http_address
    if address is None or http is None:
        raise BenchError("the broker's TCP and HTTP addresses are needed")
    wire.http_create(http, TOPIC, CHANNEL)
    wire.http_create(http, BYSTANDER_TOPIC)
    started = time.monotonic()
    fill(address, TOPIC, args.count, size=args.size)
    filled_s = time.monotonic() - started
    # The channel's copies go: the replay is what fills it again.
    wire.http_request(http, "/channel/empty", "POST", timeout=600, topic=TOPIC, channel=CHANNEL)
    time.sleep(1.0)  # a commit and a checkpoint

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Event()
    progress = ctx.Array("q", 1, lock=False)
    cfg = ReaderConfig(address=address, topic=TOPIC, channel=CHANNEL, rdy=args.rdy, duration=None,
                       expected=args.count, sample_every=1_000_000, client_id="replay-reader")
    reader = ctx.Process(target=reader_main, args=(0, cfg, results, go, progress), daemon=True)
    reader.start()
    kind, _, data = results.get(timeout=30)
    if kind != "ready":
        raise BenchError(f"the reader did not start: {data}")
    go.set()

    before = proc_memory(broker.pid)
    sampler = Sampler(broker.pid, interval=0.02).start()
    waits: list[float] = []
    stop = threading.Event()
    bystander = threading.Thread(target=_bystander, args=(address, args.interval, stop, waits), daemon=True)
    bystander.start()
    time.sleep(args.baseline)  # the bystander alone first: its round trips without a replay
    calm = len(waits)
    sampler.reset()  # the CPU figure is the replay's
    t0 = time.monotonic()
    answer = json.loads(wire.http_request(http, "/channel/replay", "POST", topic=TOPIC, channel=CHANNEL,
                                          offset="0"))
    deadline = t0 + args.timeout
    result = None
    while result is None:
        try:
            kind, _, data = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except queue_module.Empty:
            if time.monotonic() > deadline or not reader.is_alive():
                stop.set()
                raise BenchError(
                    f"the reader got {progress[0]:,} of {args.count:,} within {args.timeout:g} s") from None
            continue
        if kind == "error":
            stop.set()
            raise BenchError(str(data))
        if kind == "result":
            result = data
    stop.set()
    bystander.join(10)
    reader.join(10)
    peak_mb, cpu = sampler.window()
    anon_peak_kb = sampler.anon_peak_kb()
    sampler.stop()
    elapsed = float(result["t_end"]) - t0
    # The messages came from the replay: the channel took the fill's copies and the replay's.
    stats = json.loads(wire.http_request(http, "/stats", format="json", topic=TOPIC, channel=CHANNEL))
    row = stats["topics"][0]["channels"][0]
    if row["message_count"] != 2 * args.count or "replay" in row:
        raise BenchError(f"the channel took {row['message_count']:,} messages, not twice {args.count:,}: {row}")
    during = sorted(waits[calm:])
    before_replay = sorted(waits[:calm])
    return {
        "answer": answer,
        "filled_s": filled_s,
        "messages": int(result["messages"]),
        "elapsed_s": elapsed,
        "rate": int(result["messages"]) / max(elapsed, 1e-9),
        "bystander_pubs": len(during),
        "bystander_max_ms": 1000 * (during[-1] if during else 0.0),
        "bystander_p99_ms": 1000 * (percentile(during, 0.99) or 0.0),
        "bystander_p50_ms": 1000 * (percentile(during, 0.50) or 0.0),
        "rss_before_mb": before.get("VmRSS", 0) / 1024,
        "rss_peak_mb": peak_mb,
        "anon_before_mb": before.get("RssAnon", 0) / 1024,
        "anon_peak_mb": anon_peak_kb / 1024,
        "cpu_pct": cpu,
        "waited_pct": sampler.wait_pct,
        "baseline_p50_ms": 1000 * (percentile(before_replay, 0.50) or 0.0),
        "baseline_p99_ms": 1000 * (percentile(before_replay, 0.99) or 0.0),
        "baseline_max_ms": 1000 * (before_replay[-1] if before_replay else 0.0),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench replay", description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=1_000_000, help="records retained and replayed")
    p.add_argument("--size", type=int, default=200, help="bytes per body")
    p.add_argument("--backend", default="lmdb")
    p.add_argument("--mem-queue-size", type=int, default=10000)
    p.add_argument("--rdy", type=int, default=2500, help="the consumer's RDY")
    p.add_argument("--interval", type=float, default=0.01, help="seconds between the bystander's PUBs")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the replay may take")
    p.add_argument("--baseline", type=float, default=2.0,
                   help="seconds the bystander PUBs alone before the replay (its latency without one)")
    p.add_argument("--broker-arg", action="append", default=[], metavar="FLAG",
                   help="another flag for the broker (repeatable; use the --flag=value form)")
    args = p.parse_args(argv)
    extra = ["--retention-bytes=100GB", *args.broker_arg]
    with Broker(args.backend, args.mem_queue_size, extra) as broker:
        print(f"{broker.describe()}: {args.count:,} records of {args.size} B, consumer RDY {args.rdy}, "
              f"bystander PUB every {args.interval * 1000:g} ms", flush=True)
        r = run(broker, args)
    print(f"  filled in {r['filled_s']:.1f} s; replay of offsets [{r['answer']['start']:,}, "
          f"{r['answer']['end']:,}): {r['messages']:,} messages in {r['elapsed_s']:.2f} s, "
          f"{r['rate']:,.0f} msgs/s (broker CPU {r['cpu_pct']:.0f}% of a core, waited for one "
          f"{r['waited_pct'] or 0:.0f}%)")
    print(f"  bystander: {r['bystander_pubs']} PUBs during it, p50 {r['bystander_p50_ms']:.1f} ms, "
          f"p99 {r['bystander_p99_ms']:.1f} ms, worst {r['bystander_max_ms']:.1f} ms (alone before it: "
          f"p50 {r['baseline_p50_ms']:.1f} ms, p99 {r['baseline_p99_ms']:.1f} ms, worst {r['baseline_max_ms']:.1f} ms)")
    print(f"  broker RSS: {r['rss_before_mb']:,.0f} MB before, {r['rss_peak_mb']:,.0f} MB peak "
          f"(RssAnon {r['anon_before_mb']:,.0f} MB before, {r['anon_peak_mb']:,.0f} MB peak)")
    return 0
