"""``python -m bench big-batch``: how long one huge publish holds everyone else up.

One client publishes a single huge batch, a TCP `MPUB` of 1,048,575 one-byte
messages (the most a default max-body-size of 5 MiB holds) or a text HTTP
`/mpub` of 2.6 M lines, while a bystander connection PUBs to another topic
round trip after round trip. Reported: the batch's own time to its OK, the
bystander's worst and 99th percentile round trip meanwhile, and the broker's
RSS growth (peak during the batch minus before it).

```sh
python -m bench big-batch                      # TCP MPUB, lmdb, mem-queue-size 10000
python -m bench big-batch --http-text          # text /mpub of 2.6 M lines
python -m bench big-batch --nsqd-bin /path/to/nsq/bin   # the same on a real nsqd
```
"""

from __future__ import annotations

import argparse
import shlex
import threading
import time

from bench.harness import wire
from bench.harness.broker import Broker, Sampler, nsqd_option, read_proc
from bench.harness.load import huge_publish
from bench.harness.report import percentile

TCP_COUNT = 1_048_575
TEXT_LINES = 2_600_000


def run(broker: Broker, http_text: bool, count: int) -> dict:
    address = broker.address
    assert address is not None
    wire.create_topic_channel(address, "big", "c")
    bystander = wire.connect(address)
    wire.identify(bystander, "bystander")
    pub = b"PUB other\n" + wire.SIZE.pack(1) + b"y"
    for _ in range(100):  # warm up
        bystander.sendall(pub)
        wire.expect(bystander, b"OK", "PUB")
    before = read_proc(broker.pid)
    sampler = Sampler(broker.pid, interval=0.02).start()
    done = threading.Event()
    result: dict = {}

    def big() -> None:
        started = time.monotonic()
        answer = huge_publish(address, broker.http_address, "big", count, http_text)
        result["batch_s"] = time.monotonic() - started
        result["answer"] = answer[:40]
        done.set()

    thread = threading.Thread(target=big)
    thread.start()
    latencies = []
    while not done.is_set():
        t = time.monotonic()
        bystander.sendall(pub)
        wire.expect(bystander, b"OK", "PUB")
        latencies.append(time.monotonic() - t)
    thread.join()
    peak_mb, _ = sampler.window()
    sampler.stop()
    bystander.close()
    latencies.sort()
    result.update(
        bystander_pubs=len(latencies),
        bystander_max_ms=1000 * latencies[-1],
        bystander_p99_ms=1000 * (percentile(latencies, 0.99) or 0.0),
        rss_growth_mb=peak_mb - (before[0] / 1024 if before else 0.0),
    )
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench big-batch",
        description="How long one huge publish holds a bystander's PUBs up, and the RSS it costs.",
    )
    p.add_argument("--http-text", action="store_true", help="text /mpub instead of TCP MPUB")
    p.add_argument("--count", type=int, help="messages in the batch")
    p.add_argument("--backend", default="lmdb")
    p.add_argument("--mem-queue-size", type=int, default=10000)
    p.add_argument("--broker-cmd", help="another broker's command line ({data}: data directory)")
    p.add_argument("--nsqd-bin", metavar="PATH",
                   help="a real nsqd (or the directory of NSQ's binaries) instead of mqd")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)
    argv_cmd = shlex.split(args.broker_cmd) if args.broker_cmd else None
    if args.nsqd_bin:
        if argv_cmd:
            p.error("--nsqd-bin and --broker-cmd exclude each other")
        argv_cmd = nsqd_option(p, args.nsqd_bin, args.mem_queue_size)
    count = args.count or (TEXT_LINES if args.http_text else TCP_COUNT)
    for _ in range(args.repeat):
        with Broker(args.backend, args.mem_queue_size, argv=argv_cmd) as broker:
            r = run(broker, args.http_text, count)
        print(f"{'HTTP text /mpub' if args.http_text else 'TCP MPUB'} of {count:,}: "
              f"OK after {r['batch_s']:.2f} s ({r['answer']!r}); bystander: {r['bystander_pubs']} PUBs, "
              f"worst {r['bystander_max_ms']:.0f} ms, p99 {r['bystander_p99_ms']:.0f} ms; "
              f"RSS +{r['rss_growth_mb']:.0f} MB")
    return 0
