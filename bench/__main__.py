"""``python -m bench``: see bench/README.md."""

import sys

from bench.run import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["torture"]:
        from bench.torture import main as torture

        sys.exit(torture(sys.argv[2:]))
    if sys.argv[1:2] == ["client"]:
        from bench.client import main as client

        sys.exit(client(sys.argv[2:]))
    if sys.argv[1:2] in (["memory"], ["latency"], ["flame"], ["lookupd"]):
        import importlib

        sys.exit(importlib.import_module(f"bench.{sys.argv[1]}").main(sys.argv[2:]))
    if sys.argv[1:2] == ["spark-stream"]:
        from bench.spark_stream import main as spark_stream

        sys.exit(spark_stream(sys.argv[2:]))
    if sys.argv[1:2] == ["snapshot"]:
        from bench.snapshot import main as snapshot

        sys.exit(snapshot(sys.argv[2:]))
    if sys.argv[1:2] == ["compare"]:
        from bench.compare import main as compare

        sys.exit(compare(sys.argv[2:]))
    sys.exit(main())
