"""Client-library benchmark: txnsq (mqd.client) side by side with pynsq against one mqd.

Issue #14's target is "at least pynsq's throughput". Both libraries run the same
three scenarios against the same broker in the same run, alternating which goes
first in each repetition so machine noise hits both:

- ``pub``: publish ``--count`` bodies one ``PUB`` each, ``--window`` outstanding;
- ``mpub``: the same bodies as ``MPUB`` batches of ``--batch``, ``--mpub-window`` outstanding;
- ``consume``: drain a backlog of ``--count`` messages (filled untimed by the raw
  bench writer) with ``max_in_flight`` ``--max-in-flight``, the handler returning
  success so every message is FINed.

Every library run is its own interpreter (``python -m bench.client _child ...``):
Twisted's reactor and Tornado's IOLoop never share a process, each library pays
its own imports outside the timed window, and the child can be run under py-spy
(``--profile DIR``) without the harness in the profile. Parent and child talk over
the child's stdin/stdout: the child connects and warms up, says ``ready``, waits
for ``go`` (so the broker's CPU window starts with the timed part), says ``done``
when its last ack / message arrives, then ``result`` with a JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
import urllib.request
from array import array
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from bench import wire
from bench.broker import REPO, Broker, BrokerError, Sampler, checkout_env
from bench.run import machine, percentile
from bench.stacks import frame_counts

LIBS = ("pynsq", "txnsq")
SCENARIOS = ("pub", "mpub", "consume")
MARK = "@@bench "  # prefix of the lines the child writes for the parent; others are ignored
PUB_TOPIC = "client_pub"
SUB_TOPIC = "client_sub"
WARM_TOPIC = "client_warm"
CHANNEL = "ch"


class ChildError(Exception):
    """A library run failed (its message is reported, the other runs go on)."""


# -- pure helpers (unit-tested) ----------------------------------------------


def channel_counts(stats: dict, topic: str, channel: str) -> tuple[int, int] | None:
    """(depth, in-flight) of a channel in a /stats?format=json answer, None if absent.

    Accepts nsqd's current flat shape and the pre-1.0 ``{"status_code", "data"}``
    envelope, so the check also works against another broker.
    """
    data = stats.get("data", stats) if isinstance(stats.get("data"), dict) else stats
    for t in data.get("topics") or ():
        if t.get("topic_name") != topic:
            continue
        for c in t.get("channels") or ():
            if c.get("channel_name") == channel:
                return int(c.get("depth", 0)), int(c.get("in_flight_count", 0))
    return None


def top_frames(collapsed: str, limit: int = 15) -> list[tuple[str, int, float, float]]:
    """Hottest functions of a py-spy ``--format raw`` (collapsed stacks) profile.

    Returns (frame, self samples, self %, total %) best first, counted by
    bench.stacks.frame_counts.
    """
    own, total, samples = frame_counts(collapsed)
    if not samples:
        return []
    return [
        (frame, n, 100.0 * n / samples, 100.0 * total[frame] / samples)
        for frame, n in own.most_common(limit)
    ]


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a, the factor txnsq runs at relative to pynsq; None when either is missing."""
    if not a or b is None:
        return None
    return b / a


# -- child side: one library, one scenario ----------------------------------------


@dataclass
class ChildConfig:
    """What one child process does; JSON on the command line so it can be rerun by hand."""

    lib: str
    scenario: str
    host: str
    port: int
    count: int
    size: int = 200
    window: int = 1000
    batch: int = 100
    max_in_flight: int = 2500
    idle_timeout: float = 10.0
    topic: str = PUB_TOPIC
    channel: str = CHANNEL


@dataclass
class _State:
    """Counters shared by a child's callbacks (a plain object: no per-message allocation)."""

    total: int
    done_at: float = 0.0
    messages: int = 0
    sent: int = 0
    outstanding: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    ack_us: array = field(default_factory=lambda: array("I"))
    error: str | None = None


def _say(kind: str, data: Any = None) -> None:
    line = MARK + kind + ("" if data is None else " " + json.dumps(data))
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _wait_go() -> None:
    """Handshake with the parent: it resets its broker sampler between the two lines."""
    _say("ready")
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise ChildError(f"expected 'go' from the harness, got {line!r}")


def _result(cfg: ChildConfig, st: _State, t0: float, cpu0: float) -> dict:
    seconds = max(1e-9, st.done_at - t0)
    cpu = time.process_time() - cpu0
    lat = sorted(st.ack_us)
    p50, p99 = percentile(lat, 0.50), percentile(lat, 0.99)
    return {
        "lib": cfg.lib,
        "scenario": cfg.scenario,
        "messages": st.messages,
        "seconds": seconds,
        "rate": st.messages / seconds,
        "ack_p50": None if p50 is None else p50 / 1000,
        "ack_p99": None if p99 is None else p99 / 1000,
        "client_cpu": 100.0 * cpu / seconds,
        "client_us": 1e6 * cpu / st.messages if st.messages else None,
        "error": st.error,
    }


def _bodies(cfg: ChildConfig) -> tuple[bytes, list[bytes]]:
    body = b"x" * cfg.size
    return body, [body] * (1 if cfg.scenario == "pub" else cfg.batch)


def _pynsq(cfg: ChildConfig) -> dict:
    """pynsq 0.9 on Tornado: Writer.pub/mpub with callbacks, Reader with a handler."""
    import asyncio
    import functools
    import logging

    logging.basicConfig(level=logging.ERROR)
    import nsq

    address = f"{cfg.host}:{cfg.port}"

    def quiet() -> None:
        """pynsq logs an ERROR for every connection it closes itself; the run is over."""
        logging.getLogger("nsq").setLevel(logging.CRITICAL)

    async def produce() -> dict:
        loop = asyncio.get_running_loop()
        writer = nsq.Writer([address])
        deadline = time.monotonic() + 10
        while not any(c.connected() for c in writer.conns.values()):
            if time.monotonic() > deadline:
                raise ChildError("pynsq Writer did not connect within 10 s")
            await asyncio.sleep(0.005)
        warm = loop.create_future()
        body, bodies = _bodies(cfg)
        writer.pub(WARM_TOPIC, body, callback=lambda conn, data: warm.set_result(data))
        if isinstance(await warm, nsq.Error):
            raise ChildError(f"warm-up PUB failed: {warm.result()}")
        st = _State(cfg.count)
        done = loop.create_future()
        n_per = len(bodies)
        perf_ns = time.perf_counter_ns
        ack_append = st.ack_us.append

        def on_ack(t_sent: int, n: int, conn: Any, data: Any) -> None:
            st.outstanding -= 1
            if isinstance(data, nsq.Error):
                if not done.done():
                    st.error = f"publish failed: {data!r}"
                    st.done_at = time.perf_counter()
                    done.set_result(None)
                return
            ack_append((perf_ns() - t_sent) // 1000)
            st.messages += n
            if st.sent < st.total:
                send()
            elif not st.outstanding and not done.done():
                st.done_at = time.perf_counter()
                done.set_result(None)

        if cfg.scenario == "pub":

            def send() -> None:
                st.sent += 1
                st.outstanding += 1
                writer.pub(cfg.topic, body, callback=functools.partial(on_ack, perf_ns(), 1))

        else:

            def send() -> None:
                n = min(n_per, st.total - st.sent)
                st.sent += n
                st.outstanding += 1
                chunk = bodies if n == n_per else bodies[:n]
                writer.mpub(cfg.topic, chunk, callback=functools.partial(on_ack, perf_ns(), n))

        _wait_go()
        cpu0, t0 = time.process_time(), time.perf_counter()
        while st.outstanding < cfg.window and st.sent < st.total:
            send()
        watchdog = _tornado_watchdog(st, done, cfg.idle_timeout)
        await done
        _say("done")
        watchdog.stop()
        result = _result(cfg, st, t0, cpu0)
        quiet()
        for conn in list(writer.conns.values()):
            conn.close()
        return result

    async def consume() -> dict:
        loop = asyncio.get_running_loop()
        st = _State(cfg.count)
        done = loop.create_future()

        def handler(message: Any) -> bool:
            st.messages += 1
            if st.messages == st.total:
                st.done_at = time.perf_counter()
                loop.call_soon(done.set_result, None)
            return True

        _wait_go()
        cpu0, t0 = time.process_time(), time.perf_counter()
        reader = nsq.Reader(
            topic=cfg.topic,
            channel=cfg.channel,
            message_handler=handler,
            nsqd_tcp_addresses=[address],
            max_in_flight=cfg.max_in_flight,
        )
        watchdog = _tornado_watchdog(st, done, cfg.idle_timeout)
        await done
        _say("done")
        watchdog.stop()
        result = _result(cfg, st, t0, cpu0)
        # IOStream.close drops unwritten data: let the last FINs leave first.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
            c.stream is not None and c.stream.writing() for c in reader.conns.values()
        ):
            await asyncio.sleep(0.01)
        quiet()
        reader.close()
        await asyncio.sleep(0.05)
        return result

    return asyncio.run(produce() if cfg.scenario != "consume" else consume())


def _tornado_watchdog(st: _State, done: Any, idle: float) -> Any:
    """Ends the run with an error after ``idle`` seconds without progress (once a second)."""
    from tornado.ioloop import PeriodicCallback

    seen = [st.messages]

    def check() -> None:
        now = time.monotonic()
        if st.messages != seen[0]:
            seen[0] = st.messages
            st.last_progress = now
        elif now - st.last_progress > idle and not done.done():
            st.error = f"no progress for {idle:.0f} s at {st.messages:,}/{st.total:,} messages"
            st.done_at = time.perf_counter()
            done.set_result(None)

    cb = PeriodicCallback(check, 1000)
    cb.start()
    return cb


def _txnsq(cfg: ChildConfig) -> dict:
    """txnsq (mqd.client) on Twisted's default reactor: Producer and Consumer services."""
    from twisted.internet import defer, task

    out: dict = {}

    def watchdog(reactor: Any, st: _State, done: defer.Deferred) -> task.LoopingCall:
        seen = [st.messages]

        def check() -> None:
            now = time.monotonic()
            if st.messages != seen[0]:
                seen[0] = st.messages
                st.last_progress = now
            elif now - st.last_progress > cfg.idle_timeout and not done.called:
                st.error = (
                    f"no progress for {cfg.idle_timeout:.0f} s at "
                    f"{st.messages:,}/{st.total:,} messages"
                )
                st.done_at = time.perf_counter()
                done.callback(None)

        loop = task.LoopingCall(check)
        loop.clock = reactor
        loop.start(1.0, now=False)
        return loop

    async def produce(reactor: Any) -> None:
        from mqd.client.producer import Producer

        producer = Producer(
            f"{cfg.host}:{cfg.port}",
            reactor=reactor,
            max_outstanding=max(cfg.window, 1),
        )
        producer.startService()
        body, bodies = _bodies(cfg)
        await producer.publish(WARM_TOPIC, body)
        st = _State(cfg.count)
        done: defer.Deferred = defer.Deferred()
        n_per = len(bodies)
        perf_ns = time.perf_counter_ns
        ack_append = st.ack_us.append

        def on_ack(_: Any, t_sent: int, n: int) -> None:
            st.outstanding -= 1
            ack_append((perf_ns() - t_sent) // 1000)
            st.messages += n
            if st.sent < st.total:
                send()
            elif not st.outstanding and not done.called:
                st.done_at = time.perf_counter()
                done.callback(None)

        def on_error(failure: Any) -> None:
            st.outstanding -= 1
            if not done.called:
                st.error = f"publish failed: {failure.getErrorMessage()} ({failure.type.__name__})"
                st.done_at = time.perf_counter()
                done.callback(None)

        if cfg.scenario == "pub":
            publish = producer.publish

            def send() -> None:
                st.sent += 1
                st.outstanding += 1
                publish(cfg.topic, body).addCallbacks(on_ack, on_error, callbackArgs=(perf_ns(), 1))

        else:
            multi_publish = producer.multi_publish

            def send() -> None:
                n = min(n_per, st.total - st.sent)
                st.sent += n
                st.outstanding += 1
                chunk = bodies if n == n_per else bodies[:n]
                multi_publish(cfg.topic, chunk).addCallbacks(
                    on_ack, on_error, callbackArgs=(perf_ns(), n)
                )

        _wait_go()
        cpu0, t0 = time.process_time(), time.perf_counter()
        while st.outstanding < cfg.window and st.sent < st.total and not done.called:
            send()
        dog = watchdog(reactor, st, done)
        await done
        _say("done")
        dog.stop()
        out.update(_result(cfg, st, t0, cpu0))
        await producer.stop()

    async def consume(reactor: Any) -> None:
        from mqd.client.consumer import Consumer

        st = _State(cfg.count)
        done: defer.Deferred = defer.Deferred()

        def handler(message: Any) -> None:
            st.messages += 1
            if st.messages == st.total:
                st.done_at = time.perf_counter()
                reactor.callLater(0, done.callback, None)

        _wait_go()
        cpu0, t0 = time.process_time(), time.perf_counter()
        consumer = Consumer(
            cfg.topic,
            cfg.channel,
            handler,
            nsqd_tcp_addresses=[f"{cfg.host}:{cfg.port}"],
            reactor=reactor,
            max_in_flight=cfg.max_in_flight,
        )
        consumer.startService()
        dog = watchdog(reactor, st, done)
        await done
        _say("done")
        dog.stop()
        out.update(_result(cfg, st, t0, cpu0))
        await consumer.stop()

    def main(reactor: Any) -> defer.Deferred:
        run = consume if cfg.scenario == "consume" else produce
        return defer.ensureDeferred(run(reactor))

    try:
        task.react(main)
    except SystemExit as exc:
        if exc.code not in (0, None) and not out:
            raise ChildError(f"twisted run ended with exit code {exc.code}") from None
    if not out:
        raise ChildError("txnsq run ended without a result")
    return out


def child_main(argv: list[str]) -> int:
    """``python -m bench.client _child '<ChildConfig JSON>'``: one library run."""
    cfg = ChildConfig(**json.loads(argv[0]))
    try:
        result = {"pynsq": _pynsq, "txnsq": _txnsq}[cfg.lib](cfg)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on
        _say("error", {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return 1
    _say("result", result)
    return 0


# -- parent side ---------------------------------------------------------------


class Harness:
    """One broker, the untimed set-up between runs, and the child processes."""

    def __init__(self, args: argparse.Namespace, broker: Broker, sampler: Sampler) -> None:
        self.args = args
        self.broker = broker
        self.sampler = sampler
        assert broker.address is not None
        self.address = broker.address

    def _http(self, path: str, method: str = "GET", **query: str) -> bytes:
        url = f"http://{self.broker.http_address}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read()

    def counts(self, topic: str, channel: str) -> tuple[int, int] | None:
        stats = json.loads(self._http("/stats", format="json", topic=topic))
        return channel_counts(stats, topic, channel)

    def prepare(self, scenario: str) -> None:
        """Untimed: a fresh publish topic with one channel, or a backlog of --count to drain."""
        if scenario == "consume":
            left = self.counts(SUB_TOPIC, CHANNEL)
            if left and (left[0] or left[1]):
                self._http("/channel/empty", "POST", topic=SUB_TOPIC, channel=CHANNEL)
            from bench.writer import WriterConfig, publish

            wire.create_topic_channel(self.address, SUB_TOPIC, CHANNEL)
            cfg = WriterConfig(
                address=self.address,
                topic=SUB_TOPIC,
                size=self.args.size,
                batch=100,
                mode="mpub",
                pipeline=20,
                duration=None,
                count=self.args.count,
            )
            got = publish(cfg)["messages"]
            if got != self.args.count:
                raise ChildError(f"fill published {got:,} of {self.args.count:,} messages")
        else:
            wire.create_topic_channel(self.address, PUB_TOPIC, CHANNEL)

    def check(self, scenario: str, result: dict) -> str | None:
        """Untimed: what the broker holds must match what the library reported."""
        if scenario == "consume":
            deadline = time.monotonic() + 5
            while True:
                got = self.counts(SUB_TOPIC, CHANNEL)
                if got == (0, 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if got is None:
                return f"channel {SUB_TOPIC}/{CHANNEL} missing from /stats after the run"
            if got != (0, 0):
                self._http("/channel/empty", "POST", topic=SUB_TOPIC, channel=CHANNEL)
                return f"channel not empty after the run: depth {got[0]:,}, in flight {got[1]:,}"
            return None
        got = self.counts(PUB_TOPIC, CHANNEL)
        self._http("/topic/delete", "POST", topic=PUB_TOPIC)
        if got is None or got[0] != result["messages"]:
            return f"broker holds {got} (depth, in flight), library acked {result['messages']:,}"
        return None

    @staticmethod
    def start_profiler(pid: int, path: str) -> subprocess.Popen:
        """py-spy attached for the timed part only (imports and warm-up stay out of it)."""
        pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        argv = [pyspy, "record", "--pid", str(pid), "--format", "raw", "--rate", "250"]
        proc = subprocess.Popen(
            [*argv, "--nonblocking", "-o", path],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # py-spy reads the target's memory layout before its first sample
        return proc

    def run(self, lib: str, scenario: str, profile: str | None = None) -> dict:
        a = self.args
        cfg = ChildConfig(
            lib=lib,
            scenario=scenario,
            host=self.address[0],
            port=self.address[1],
            count=a.mpub_count if scenario == "mpub" else a.count,
            size=a.size,
            window=a.window if scenario == "pub" else a.mpub_window,
            batch=a.batch,
            max_in_flight=a.max_in_flight,
            idle_timeout=a.idle_timeout,
            topic=SUB_TOPIC if scenario == "consume" else PUB_TOPIC,
        )
        self.prepare(scenario)
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.client", "_child", json.dumps(asdict(cfg))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=checkout_env(),
        )
        killer = threading.Timer(a.timeout, proc.kill)
        killer.start()
        result: dict | None = None
        error: str | None = None
        rss = cpu = None
        spy: subprocess.Popen | None = None
        try:
            assert proc.stdin is not None and proc.stdout is not None
            for kind, data in _messages(proc.stdout):
                if kind == "ready":
                    if profile:
                        spy = self.start_profiler(proc.pid, profile)
                    self.sampler.reset()
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                elif kind == "done":
                    rss, cpu = self.sampler.window()
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                elif kind == "result":
                    result = data
                elif kind == "error":
                    error = data["error"]
                    if a.verbose:
                        print(data["trace"], file=sys.stderr)
            proc.wait()
        finally:
            killer.cancel()
            if spy is not None:
                try:
                    spy.wait(30)
                except subprocess.TimeoutExpired:
                    spy.kill()
                    spy.wait()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if result is None:
            raise ChildError(error or f"child exited with {proc.returncode} without a result")
        result["broker_cpu"] = cpu
        result["broker_rss"] = rss
        problem = self.check(scenario, result)
        if problem:
            result["error"] = "; ".join(filter(None, [result.get("error"), problem]))
        return result


def _messages(stream: IO[str]) -> Any:
    """(kind, data) for each line of the child starting with MARK; other output is echoed."""
    for line in stream:
        if not line.startswith(MARK):
            sys.stdout.write("  | " + line)
            continue
        kind, _, rest = line[len(MARK) :].strip().partition(" ")
        yield kind, (json.loads(rest) if rest else None)


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def run_line(rep: int, args: argparse.Namespace, r: dict) -> str:
    return (
        f"{r['scenario']:<8} {r['lib']:<6} {rep + 1}/{args.repeat}  "
        f"{_fmt(r['rate']):>9} msgs/s  "
        f"ack p50/p99 {_fmt(r.get('ack_p50'), '.2f')}/{_fmt(r.get('ack_p99'), '.2f')} ms  "
        f"client cpu {_pct(r.get('client_cpu'))} ({_fmt(r.get('client_us'), '.2f')} us/msg)  "
        f"broker cpu {_pct(r.get('broker_cpu'))}  "
        f"({r['messages']:,} msgs, {r['seconds']:.2f} s)"
        + (f"  ERROR: {r['error']}" if r.get("error") else "")
    )


def medians(runs: list[dict]) -> dict[str, float | None]:
    """Median of each figure over the successful runs of one library and scenario."""
    ok = [r for r in runs if not r.get("error")]
    out: dict[str, float | None] = {"runs": len(ok)}
    for key in ("rate", "ack_p50", "ack_p99", "client_cpu", "client_us", "broker_cpu"):
        values = [r[key] for r in ok if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def versions() -> dict[str, str]:
    """Library versions for the report, read without importing Twisted or Tornado here."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("pynsq", "tornado", "twisted", "mqd"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "?"
    return out


def markdown(table: dict[str, dict[str, dict]], args: argparse.Namespace, broker_desc: str) -> str:
    v = versions()
    lines = [
        (
            f"txnsq (mqd.client, mqd {v['mqd']}, Twisted {v['twisted']}) vs pynsq {v['pynsq']} "
            f"(Tornado {v['tornado']}), {datetime.date.today().isoformat()}, {machine()}, "
            f"Python {platform.python_version()}"
        ),
        "",
        f"- broker: `{broker_desc}`",
        (
            f"- load: {args.size} B bodies; pub: {args.count:,} messages, one PUB each, "
            f"{args.window} outstanding; mpub: {args.mpub_count:,} messages in MPUB "
            f"x{args.batch}, {args.mpub_window} outstanding; "
            f"consume: backlog of {args.count:,}, max_in_flight {args.max_in_flight}, handler "
            f"returns success (FIN); one process per library run, order alternated, "
            f"median of {args.repeat}"
        ),
        "",
        (
            "| scenario | pynsq msgs/s | txnsq msgs/s | txnsq / pynsq "
            "| ack p50 / p99 ms (pynsq) | ack p50 / p99 ms (txnsq) "
            "| client CPU pynsq / txnsq | client CPU us/msg pynsq / txnsq "
            "| broker CPU pynsq / txnsq |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario, per_lib in table.items():
        p = per_lib.get("pynsq", {})
        t = per_lib.get("txnsq", {})
        r = ratio(p.get("rate"), t.get("rate"))
        lines.append(
            f"| {scenario} | {_fmt(p.get('rate'))} | {_fmt(t.get('rate'))} "
            f"| {'-' if r is None else f'{r:.2f}x'} "
            f"| {_fmt(p.get('ack_p50'), '.2f')} / {_fmt(p.get('ack_p99'), '.2f')} "
            f"| {_fmt(t.get('ack_p50'), '.2f')} / {_fmt(t.get('ack_p99'), '.2f')} "
            f"| {_pct(p.get('client_cpu'))} / {_pct(t.get('client_cpu'))} "
            f"| {_fmt(p.get('client_us'), '.2f')} / {_fmt(t.get('client_us'), '.2f')} "
            f"| {_pct(p.get('broker_cpu'))} / {_pct(t.get('broker_cpu'))} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench client",
        description="txnsq (mqd.client) and pynsq throughput against one mqd, side by side.",
    )
    p.add_argument("--count", type=int, default=200_000, help="messages per run")
    p.add_argument("--size", type=int, default=200, help="message body bytes")
    p.add_argument("--window", type=int, default=1000, help="outstanding PUBs (pub)")
    p.add_argument("--batch", type=int, default=100, help="messages per MPUB (mpub)")
    p.add_argument(
        "--mpub-count",
        type=int,
        help="messages per mpub run (default 5 x --count: batches make it 10x faster, "
        "and a run of a few tenths of a second is mostly noise)",
    )
    p.add_argument("--mpub-window", type=int, default=20, help="outstanding MPUBs (mpub)")
    p.add_argument("--max-in-flight", type=int, default=2500, help="consumer max_in_flight")
    p.add_argument("--repeat", type=int, default=3, help="runs per library and scenario; median")
    p.add_argument(
        "--libs", default=",".join(LIBS), help=f"comma-separated subset of {','.join(LIBS)}"
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    p.add_argument("--backend", default="memory")
    p.add_argument("--mem-queue-size", type=int, default=10_000_000)
    p.add_argument("--broker-arg", action="append", default=[], metavar="ARG")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="attach py-spy to each child for its timed part (raw collapsed stacks in DIR) "
        "and print its hottest functions; profiled runs are slower, so not figures",
    )
    p.add_argument("--idle-timeout", type=float, default=10.0, help="fail a run stalled this long")
    p.add_argument("--timeout", type=float, default=300.0, help="kill a child after this long")
    p.add_argument("--json", metavar="PATH", help="also write every run as JSON")
    p.add_argument("--keep-data", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="children's tracebacks")
    args = p.parse_args(argv)
    args.libs = [x for x in args.libs.split(",") if x]
    args.scenarios = [x for x in args.scenarios.split(",") if x]
    if bad := set(args.libs) - set(LIBS):
        p.error(f"unknown library {sorted(bad)}; known: {', '.join(LIBS)}")
    if bad := set(args.scenarios) - set(SCENARIOS):
        p.error(f"unknown scenario {sorted(bad)}; known: {', '.join(SCENARIOS)}")
    if args.mpub_count is None:
        args.mpub_count = 5 * args.count
    if (
        min(
            args.count,
            args.mpub_count,
            args.size,
            args.window,
            args.batch,
            args.mpub_window,
            args.repeat,
        )
        < 1
    ):
        p.error("--count, --size, --window, --batch, --mpub-window, --repeat must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every library through every scenario ``--repeat`` times; print the comparison."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child_main(argv[1:])
    args = parse_args(argv)
    broker = Broker(args.backend, args.mem_queue_size, args.broker_arg, keep=args.keep_data)
    broker_desc = "twistd -n mqd " + " ".join(
        x
        for x in broker.argv[4:]
        if not x.startswith(("--tcp-address", "--http-address", "--data-path"))
    )
    runs: dict[str, dict[str, list[dict]]] = {
        s: {lib: [] for lib in args.libs} for s in args.scenarios
    }
    profiles: list[tuple[str, str]] = []
    sampler: Sampler | None = None
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    try:
        print(f"starting: {shlex.join(broker.argv)}", flush=True)
        address = broker.start()
        print(f"broker pid {broker.pid} on {address[0]}:{address[1]}", flush=True)
        sampler = Sampler(broker.pid).start()
        harness = Harness(args, broker, sampler)
        for rep in range(args.repeat):
            for scenario in args.scenarios:
                order = args.libs if rep % 2 == 0 else args.libs[::-1]
                for lib in order:
                    profile = None
                    if args.profile:
                        profile = os.path.join(args.profile, f"{lib}-{scenario}-{rep + 1}.txt")
                    try:
                        res = harness.run(lib, scenario, profile)
                    except ChildError as exc:
                        res = {
                            "lib": lib,
                            "scenario": scenario,
                            "messages": 0,
                            "seconds": 0.0,
                            "rate": None,
                            "error": str(exc),
                        }
                    runs[scenario][lib].append(res)
                    print(run_line(rep, args, res), flush=True)
                    if profile and os.path.exists(profile):
                        profiles.append((f"{lib} {scenario} {rep + 1}", profile))
                    if not broker.alive():
                        raise BrokerError(f"broker died:\n{broker.log_tail()}")
    except (BrokerError, wire.ProtocolError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if not isinstance(exc, BrokerError):
            print(f"broker log (tail):\n{broker.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if sampler is not None:
            sampler.stop()
        code = broker.stop()
        if code not in (0, -signal.SIGTERM):
            print(f"broker exited with {code}", file=sys.stderr)
    table = {s: {lib: medians(rs) for lib, rs in per.items()} for s, per in runs.items()}
    print()
    for name, path in profiles:
        with open(path) as f:
            top = top_frames(f.read(), 12)
        print(f"profile {name} ({path}), hottest functions (self %, total %):")
        for frame, _, own, total in top:
            print(f"  {own:5.1f}% {total:5.1f}%  {frame}")
    print()
    print(markdown(table, args, broker_desc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": datetime.date.today().isoformat(),
                    "machine": machine(),
                    "broker": broker_desc,
                    "versions": versions(),
                    "args": vars(args),
                    "runs": runs,
                    "median": table,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
