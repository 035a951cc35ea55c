"""The child side of ``python -m bench client``: one client library, one scenario, one process.

Every library run is its own interpreter (``python -m bench.scenarios.client_libs
'<ChildConfig JSON>'``): Twisted's reactor and Tornado's IOLoop never share a
process, each library pays its own imports outside the timed window, and the
child can be run under py-spy without the harness in the profile. Parent and
child talk over the child's stdin/stdout: the child connects and warms up,
says ``ready``, waits for ``go`` (so the broker's CPU window starts with the
timed part), says ``done`` when its last ack / message arrives, then
``result`` with a JSON object.

- pynsq 0.9 on Tornado: ``Writer.pub``/``mpub`` with callbacks, ``Reader`` with a handler;
- txnsq (mqd.client) on Twisted: ``Producer`` and ``Consumer`` services.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.harness.report import percentile

LIBS = ("pynsq", "txnsq")
SCENARIOS = ("pub", "mpub", "consume")
MARK = "@@bench "  # prefix of the lines the child writes for the parent; others are ignored
PUB_TOPIC = "client_pub"
SUB_TOPIC = "client_sub"
WARM_TOPIC = "client_warm"
CHANNEL = "ch"


class ChildError(Exception):
    """A library run failed (its message is reported, the other runs go on)."""


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


def _stall_check(
    st: _State, idle: float, finished: Callable[[], bool], finish: Callable[[], None]
) -> Callable[[], None]:
    """A check, run once a second, that ends the run with an error after ``idle`` s stalled."""
    seen = [st.messages]

    def check() -> None:
        now = time.monotonic()
        if st.messages != seen[0]:
            seen[0] = st.messages
            st.last_progress = now
        elif now - st.last_progress > idle and not finished():
            st.error = f"no progress for {idle:.0f} s at {st.messages:,}/{st.total:,} messages"
            st.done_at = time.perf_counter()
            finish()

    return check


def _tornado_watchdog(st: _State, done: Any, idle: float) -> Any:
    """``_stall_check`` on Tornado's IOLoop; ends ``done`` (an asyncio future)."""
    from tornado.ioloop import PeriodicCallback

    cb = PeriodicCallback(_stall_check(st, idle, done.done, lambda: done.set_result(None)), 1000)
    cb.start()
    return cb


def _txnsq(cfg: ChildConfig) -> dict:
    """txnsq (mqd.client) on Twisted's default reactor: Producer and Consumer services."""
    from twisted.internet import defer, task

    out: dict = {}

    def watchdog(reactor: Any, st: _State, done: defer.Deferred) -> task.LoopingCall:
        """``_stall_check`` on the reactor; ends ``done``."""
        check = _stall_check(st, cfg.idle_timeout, lambda: done.called, lambda: done.callback(None))
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
    """``python -m bench.scenarios.client_libs '<ChildConfig JSON>'``: one library run."""
    cfg = ChildConfig(**json.loads(argv[0]))
    try:
        result = {"pynsq": _pynsq, "txnsq": _txnsq}[cfg.lib](cfg)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on
        _say("error", {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return 1
    _say("result", result)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
