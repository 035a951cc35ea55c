"""``python -m bench [COMMAND] [OPTIONS]``: the command table; see bench/README.md.

``python -m bench`` or ``--help`` lists the commands; ``python -m bench
COMMAND --help`` gives a command's own options. Options without a command
(``python -m bench --repeat 3``) run ``all``, as they always did. A broker
that fails, a protocol error or an OS error ends any command with
``error: ...`` and exit status 1; Ctrl-C with 130.
"""

from __future__ import annotations

import importlib
import sys

from bench.harness.broker import ERRORS

# name: (module, function taking the remaining arguments, one line of help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "writer": ("bench.scenarios.throughput", "writer",
               "publishers alone (MPUB or PUB): msgs/s in, ack latency, broker RSS and CPU"),
    "reader": ("bench.scenarios.throughput", "reader",
               "consumers draining the backlog a writer left: msgs/s out"),
    "both": ("bench.scenarios.throughput", "both",
             "publishers and consumers at once: in, out, publish-to-deliver latency"),
    "all": ("bench.scenarios.throughput", "all_scenarios",
            "writer, reader and both in order on one broker, --repeat times (median)"),
    "compare": ("bench.scenarios.compare", "main",
                "an old build vs this checkout vs the ceiling probe, interleaved"),
    "latency": ("bench.scenarios.latency", "main",
                "publish-to-deliver p50/p99/p99.9 at fractions of the maximum throughput"),
    "memory": ("bench.scenarios.memory", "main",
               "RSS per queued message and per channel ('memory peaks': one huge request)"),
    "flame": ("bench.scenarios.flame", "main",
              "py-spy flame graphs of the broker under writer, reader or both"),
    "client": ("bench.scenarios.client", "main",
               "txnsq (mqd.client) vs pynsq: pub, mpub, consume"),
    "lookupd": ("bench.scenarios.lookupd", "main",
                "mqlookupd (and nsqlookupd) under thousands of registered brokers"),
    "scale-out": ("bench.scenarios.scale_out", "main",
                  "N brokers on one host behind mqlookupd, one core each: msgs/s per N"),
    "snapshot": ("bench.scenarios.snapshot", "main",
                 "POST /snapshot of a live broker: reactor stall, MB/s, then analyze"),
    "big-batch": ("bench.scenarios.big_batch", "main",
                  "one huge MPUB or text /mpub: how long it holds a bystander up"),
    "spark-bridge": ("bench.scenarios.spark_bridge", "main",
                     "the Spark bridge's snapshot, analyze and export of a backlog"),
    "spark-stream": ("bench.scenarios.spark_stream", "main",
                     "the Structured Streaming source and sink: throughput and latency"),
    "spark-cluster": ("bench.scenarios.spark_cluster", "main",
                      "the offset-mode source on a Spark standalone cluster: one worker vs two"),
    "torture": ("bench.scenarios.torture", "main",
                "fuzz, kill -9 and abuse a broker, longer than CI does"),
    "lmdb-layout": ("bench.experiments.lmdb_layout", "main",
                    "(experiment) LMDB with a named database per queue vs one shared"),
    "retention": ("bench.scenarios.retention", "main",
                  "the retained log: publishing with retention on vs off, /topic/read, bytes per record"),
    "replay": ("bench.scenarios.replay", "main",
               "a retained topic replayed into a channel: msgs/s, a bystander's PUB latency, RSS"),
    "channel-create": ("bench.experiments.channel_create", "main",
                       "POST /channel/create on a broker with N topics (one metadata change)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: python -m bench COMMAND [OPTIONS]   (python -m bench COMMAND --help: its options)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name.startswith("-"):
        name, rest = "all", argv
    entry = COMMANDS.get(name.replace("_", "-"))
    if entry is None:
        print(f"python -m bench: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, function, _ = entry
    try:
        return getattr(importlib.import_module(module), function)(rest) or 0
    except ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
