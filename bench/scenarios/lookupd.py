"""``python -m bench lookupd``: a lookup daemon under thousands of registered brokers.

mqadmin polls ``/nodes`` every few seconds, and consumers and brokers must be
served meanwhile, so what matters at scale is (1) how long one ``/nodes``
takes and (2) how long a small ``/lookup`` or a broker's command waits while
it is being built. This scenario registers ``--brokers`` fake brokers over real
TCP (V1: magic, IDENTIFY, REGISTER per topic and channel, as nsqd does when it
connects), then, ``--repeat`` times, sends ``/nodes`` while one client loops
``/lookup`` of a one-producer topic and one fake broker loops PING /
REGISTER / UNREGISTER, and reports the ``/nodes`` time and both bystanders'
worst wait. It also times ``/lookup`` of a topic every broker produces and
``/topics``. Each answer is checked (every broker in ``/nodes`` with its
topics), so a fast wrong answer is not a result.

Targets, run one after the other for each broker count, so they share the
load and the machine's state: this checkout's mqlookupd, ``--tree DIR`` (the
mqlookupd of another checkout, e.g. an older commit unpacked with ``git
archive``), ``--nsqlookupd PATH`` or the nsqlookupd beside ``--nsqd-bin``
(the real one). Standard library only; the fake brokers are asyncio
connections of this process.

```sh
python -m bench lookupd --brokers 1000 3000 --repeat 3 \\
    --nsqd-bin /path/to/nsq/bin --tree /tmp/old
```
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.broker import BenchError, Broker, BrokerError, find_nsqd, lookupd_command
from bench.harness.report import machine, save_json, today
from bench.harness.wire import parse_address

PROBE_TOPIC = "probe"


@dataclass
class Target:
    """A lookup daemon to start: a label and its command line."""

    label: str
    argv: list[str]


@dataclass
class Sample:
    """One ``/nodes`` with its bystanders (seconds)."""

    nodes: float
    lookup_worst: float
    lookup_count: int
    broker_worst: float
    broker_count: int
    idle_lookup_worst: float  # the same bystanders just before, with no /nodes running
    idle_broker_worst: float


@dataclass
class Result:
    target: str
    brokers: int
    register_seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    big_lookup: list[float] = field(default_factory=list)
    topics: list[float] = field(default_factory=list)
    nodes_bytes: int = 0

    def median(self, name: str) -> float:
        return statistics.median(getattr(s, name) for s in self.samples)


def targets(args: argparse.Namespace) -> list[Target]:
    mq = lookupd_command()
    out = []
    if not args.no_mqlookupd:
        out.append(Target("mqlookupd", mq))
    for tree in args.tree:
        # `env` replaces the checkout's PYTHONPATH, so twistd loads that tree's plugin and mqd.
        out.append(Target(f"mqlookupd@{Path(tree).name}", ["env", f"PYTHONPATH={tree}", *mq]))
    if args.nsqlookupd:
        out.append(Target("nsqlookupd", [args.nsqlookupd, "--tcp-address=127.0.0.1:0",
                                         "--http-address=127.0.0.1:0"]))
    return out


# -- the fake brokers -----------------------------------------------------------------------


def topic_names(args: argparse.Namespace, i: int) -> list[str]:
    """Broker i's topics: `--topics` of a pool of `--topic-pool` (all brokers share them by default)."""
    pool = args.topic_pool or args.topics
    return [f"topic{(i * args.topics + j) % pool:04d}" for j in range(args.topics)]


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = struct.unpack(">i", await reader.readexactly(4))
    return await reader.readexactly(size)


class FakeBroker:
    """One V1 connection that identified and registered like nsqd does."""

    def __init__(self, i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.i = i
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, address: tuple[str, int], i: int, args: argparse.Namespace) -> FakeBroker:
        reader, writer = await asyncio.open_connection(*address)
        body = json.dumps({
            "broadcast_address": f"broker{i}.example", "hostname": f"broker{i}",
            "tcp_port": 4150, "http_port": 4151, "version": "1.3.0",
        }).encode()
        lines = [b"  V1IDENTIFY\n" + struct.pack(">i", len(body)) + body]
        names = topic_names(args, i) + ([PROBE_TOPIC] if i == 0 else [])
        for topic in names:
            lines.append(f"REGISTER {topic}\n".encode())
            for c in range(args.channels if topic != PROBE_TOPIC else 0):
                lines.append(f"REGISTER {topic} channel{c}\n".encode())
        writer.write(b"".join(lines))
        identified = json.loads(await read_frame(reader))
        if "version" not in identified:
            raise BrokerError(f"unexpected IDENTIFY answer {identified!r}")
        for _ in lines[1:]:
            answer = await read_frame(reader)
            if answer != b"OK":
                raise BrokerError(f"broker {i}: REGISTER answered {answer!r}")
        return cls(i, reader, writer)

    async def command(self, line: bytes) -> float:
        """Send one command, wait for its OK; the round trip in seconds."""
        t0 = time.perf_counter()
        self.writer.write(line)
        answer = await read_frame(self.reader)
        if answer != b"OK":
            raise BrokerError(f"{line!r} answered {answer!r}")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.writer.close()


async def register_all(address: tuple[str, int], args: argparse.Namespace, n: int) -> list[FakeBroker]:
    gate = asyncio.Semaphore(args.connect_concurrency)

    async def one(i: int) -> FakeBroker:
        async with gate:
            return await FakeBroker.connect(address, i, args)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


# -- HTTP -------------------------------------------------------------------------------------


async def http_get(address: tuple[str, int], path: str) -> bytes:
    """GET with `Connection: close`; the body, de-chunked (nsqlookupd chunks big answers)."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
    raw = await reader.read(-1)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise BrokerError(f"GET {path}: {head[:200]!r} {body[:200]!r}")
    if b"transfer-encoding: chunked" in head.lower():
        out, pos = [], 0
        while True:
            end = body.index(b"\r\n", pos)
            size = int(body[pos:end].split(b";")[0], 16)
            if size == 0:
                break
            out.append(body[end + 2:end + 2 + size])
            pos = end + 2 + size + 2
        body = b"".join(out)
    return body


async def timed_get(address: tuple[str, int], path: str) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    body = await http_get(address, path)
    return time.perf_counter() - t0, body


def check_nodes(body: bytes, args: argparse.Namespace, n: int) -> None:
    """Every fake broker listed once, with its topics: a wrong answer is not a result."""
    nodes = json.loads(body)["producers"]
    by_host = {node["hostname"]: node for node in nodes}
    if len(nodes) != n or len(by_host) != n:
        raise BrokerError(f"/nodes lists {len(nodes)} brokers ({len(by_host)} distinct), expected {n}")
    for i in (0, n // 2, n - 1):
        node = by_host[f"broker{i}"]
        want = set(topic_names(args, i)) | ({PROBE_TOPIC} if i == 0 else set())
        if set(node["topics"]) != want or len(node["tombstones"]) != len(node["topics"]):
            raise BrokerError(f"/nodes entry of broker{i} is wrong: {node}")


async def nodes_with_bystanders(http: tuple[str, int], prober: FakeBroker, args: argparse.Namespace,
                                n: int) -> tuple[Sample, int]:
    """One /nodes while a client loops /lookup and a broker loops PING, REGISTER, UNREGISTER."""
    done = asyncio.Event()
    lookups: list[float] = []
    commands: list[float] = []

    async def lookup_loop() -> None:
        while not done.is_set():
            seconds, body = await timed_get(http, f"/lookup?topic={PROBE_TOPIC}")
            if len(json.loads(body)["producers"]) != 1:
                raise BrokerError(f"/lookup?topic={PROBE_TOPIC}: {body[:300]!r}")
            lookups.append(seconds)

    async def broker_loop() -> None:
        cycle = [b"PING\n", b"REGISTER %s extra\n" % PROBE_TOPIC.encode(),
                 b"UNREGISTER %s extra\n" % PROBE_TOPIC.encode()]
        k = 0
        while not done.is_set():
            commands.append(await prober.command(cycle[k % 3]))
            k += 1
        while k % 3:  # leave the registrations as they were
            await prober.command(cycle[k % 3])
            k += 1

    bystanders = [asyncio.ensure_future(lookup_loop()), asyncio.ensure_future(broker_loop())]
    try:
        # The bystanders alone first: their worst wait on this machine with nothing else to do.
        await asyncio.sleep(args.idle)
        idle_lookups, idle_commands = lookups[1:], commands[1:]
        lookups, commands = [], []
        seconds, body = await timed_get(http, "/nodes")
    finally:
        done.set()
        await asyncio.gather(*bystanders)
    check_nodes(body, args, n)
    return Sample(seconds, max(lookups, default=0.0), len(lookups), max(commands, default=0.0), len(commands),
                  max(idle_lookups, default=0.0), max(idle_commands, default=0.0)), len(body)


async def measure(target: Target, args: argparse.Namespace, n: int) -> Result:
    result = Result(target.label, n)
    with Broker(argv=target.argv, startup_timeout=30) as daemon:
        assert daemon.address is not None and daemon.http_address is not None
        http = parse_address(daemon.http_address)
        t0 = time.perf_counter()
        brokers = await register_all(daemon.address, args, n)
        result.register_seconds = time.perf_counter() - t0
        try:
            await asyncio.sleep(args.settle)
            for _ in range(args.repeat):
                sample, size = await nodes_with_bystanders(http, brokers[0], args, n)
                result.samples.append(sample)
                result.nodes_bytes = size
                print(f"  {target.label:<22} {n:>5} brokers: /nodes {sample.nodes * 1e3:7.1f} ms, "
                      f"worst /lookup {sample.lookup_worst * 1e3:6.1f} ms ({sample.lookup_count}), "
                      f"worst broker command {sample.broker_worst * 1e3:6.1f} ms "
                      f"({sample.broker_count}); without /nodes: {sample.idle_lookup_worst * 1e3:.1f}"
                      f" / {sample.idle_broker_worst * 1e3:.1f} ms", flush=True)
                seconds, body = await timed_get(http, f"/lookup?topic={topic_names(args, 0)[0]}")
                result.big_lookup.append(seconds)
                seconds, body = await timed_get(http, "/topics")
                result.topics.append(seconds)
                if not daemon.alive():
                    raise BrokerError(f"{target.label} died:\n{daemon.log_tail()}")
        finally:
            for b in brokers:
                b.close()
    return result


def table(results: list[Result], args: argparse.Namespace) -> str:
    pool = args.topic_pool or args.topics
    lines = [
        f"{today()}, {machine()}; each broker {args.topics} topics "
        f"(of {pool}) x {args.channels} channels; median of {args.repeat} (first /nodes: "
        f"the first after the brokers registered, also in the median)",
        "",
        "| lookupd | brokers | register all | /nodes | first /nodes | worst /lookup during /nodes "
        "| worst broker command during /nodes | the same two without /nodes "
        "| /lookup of topic0000 (every broker's, unless --topic-pool) | /topics |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.target} | {r.brokers:,} | {r.register_seconds:.2f} s | "
            f"{r.median('nodes') * 1e3:,.0f} ms ({r.nodes_bytes / 1e6:.1f} MB) | "
            f"{r.samples[0].nodes * 1e3:,.0f} ms | "
            f"{r.median('lookup_worst') * 1e3:,.1f} ms | {r.median('broker_worst') * 1e3:,.1f} ms | "
            f"{r.median('idle_lookup_worst') * 1e3:,.1f} / {r.median('idle_broker_worst') * 1e3:,.1f} ms | "
            f"{statistics.median(r.big_lookup) * 1e3:,.1f} ms | "
            f"{statistics.median(r.topics) * 1e3:,.1f} ms |")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench lookupd", description=__doc__.split("\n\n")[0])
    p.add_argument("--brokers", type=int, nargs="+", default=[1000, 3000],
                   help="numbers of fake brokers, one run each (default 1000 3000)")
    p.add_argument("--topics", type=int, default=5, help="topics per broker (default 5)")
    p.add_argument("--channels", type=int, default=2, help="channels per topic (default 2)")
    p.add_argument("--topic-pool", type=int, default=0,
                   help="distinct topic names the brokers' topics come from (default --topics: "
                        "every broker has the same topics, as in a cluster)")
    p.add_argument("--repeat", type=int, default=3, help="/nodes measurements per run (default 3)")
    p.add_argument("--nsqlookupd", help="path of a real nsqlookupd to measure too")
    p.add_argument(
        "--nsqd-bin", metavar="DIR",
        help="the directory of NSQ's binaries: its nsqlookupd is measured too, unless "
        "--nsqlookupd names one (default: $NSQD_BIN if set)",
    )
    p.add_argument("--tree", action="append", default=[],
                   help="another checkout whose mqlookupd to measure too (repeatable)")
    p.add_argument("--no-mqlookupd", action="store_true", help="skip this checkout's mqlookupd")
    p.add_argument("--connect-concurrency", type=int, default=100,
                   help="fake brokers registering at once (default 100)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds to wait after registering, before measuring (default 1)")
    p.add_argument("--idle", type=float, default=0.3,
                   help="seconds the bystanders run alone before each /nodes (default 0.3)")
    p.add_argument("--json", help="also save every sample to this file")
    args = p.parse_args(argv)
    if not args.nsqlookupd:
        try:
            args.nsqlookupd = find_nsqd(args.nsqd_bin, "nsqlookupd")
        except ValueError as exc:
            p.error(f"--nsqd-bin: {exc}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    results = []
    try:
        for n in args.brokers:
            for target in targets(args):
                results.append(asyncio.run(measure(target, args, n)))
    except asyncio.IncompleteReadError as exc:  # a daemon that closed a connection
        raise BenchError(f"connection closed: {exc}") from None
    print()
    print(table(results, args))
    if args.json:
        save_json(args.json, args, results=results)
    return 0
