"""Time `POST /channel/create` on a broker holding N topics: what one metadata change costs.

Each call creates a channel on an existing topic and is answered once
nsqd.dat holds it, so its time is the broker's work for one change plus
the file's write (temp file, fsync, rename). The topics come from an
nsqd.dat written before the broker starts (one channel each, the same JSON
for mqd and nsqd), so N topics cost no N requests. The broker is a real
`twistd mqd` (and, with `--nsqd PATH`, an nsqd beside it) on loopback;
the client is http.client on one kept-alive connection.

Usage::

    python -m bench channel-create [--topics 1 10000] [--calls 400] [--nsqd PATH]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(program: str, topics: int, calls: int) -> list[float]:
    """Seconds per call for `calls` channel creations on `program` (mqd or an nsqd path)."""
    data = tempfile.mkdtemp(prefix="bench-chan-")
    listed = [{"name": f"topic{i:05d}", "paused": False, "channels": [{"name": "c0", "paused": False}]}
              for i in range(topics)]
    with open(os.path.join(data, "nsqd.dat"), "w") as f:
        json.dump({"topics": listed, "version": "1.3.0"}, f)
    http_port, tcp_port = _free_port(), _free_port()
    flags = [f"--data-path={data}", f"--http-address=127.0.0.1:{http_port}",
             f"--tcp-address=127.0.0.1:{tcp_port}", "--log-level=warn"]
    if program == "mqd":
        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        argv = [twistd, "-n", "--pidfile=", "--logfile=/dev/null", "mqd", *flags]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    else:
        argv, env = [program, *flags], None
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                probe = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
                probe.request("GET", "/ping")
                if probe.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{program} did not start")
            time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", http_port)
        times = []
        for j in range(20 + calls):  # the first 20 warm up
            topic = f"topic{(j * 7919) % topics:05d}"
            start = time.perf_counter()
            conn.request("POST", f"/channel/create?topic={topic}&channel=bench{j}")
            answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                raise SystemExit(f"{program}: /channel/create answered {answer.status}")
            if j >= 20:
                times.append(time.perf_counter() - start)
        return times
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench channel-create", description=__doc__.splitlines()[0])
    p.add_argument("--topics", type=int, nargs="+", default=[1, 10000])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--nsqd", default=None, help="an nsqd binary to measure beside mqd")
    args = p.parse_args(argv)
    programs = ["mqd"] + ([args.nsqd] if args.nsqd else [])
    print(f"{'broker':<10} {'topics':>7} {'median':>9} {'p90':>9}")
    for topics in args.topics:
        for program in programs:
            times = sorted(measure(program, topics, args.calls))
            name = "mqd" if program == "mqd" else "nsqd"
            print(f"{name:<10} {topics:>7} {statistics.median(times) * 1000:>7.2f}ms "
                  f"{times[int(len(times) * 0.9)] * 1000:>7.2f}ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
