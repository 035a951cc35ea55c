"""pynsq on a fresh tornado loop for one test: clients that close with it, and a recording handler.

Every wait has a deadline, so a broken broker fails a test with a message
saying what it was waiting for instead of hanging the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import nsq
from tornado.ioloop import IOLoop

from tests.support.processes import DEFAULT_TIMEOUT, BrokerProcess


class Loop:
    """A fresh asyncio/tornado loop for one test; every wait has a deadline.

    pynsq's clients take `IOLoop.current()` when they are built, so a test
    builds them after this exists and they all run on it.
    """

    def __init__(self) -> None:
        self.aio = asyncio.new_event_loop()
        asyncio.set_event_loop(self.aio)
        self.io = IOLoop.current()
        assert self.io.asyncio_loop is self.aio
        self.clients: list[Any] = []

    def run_until(self, condition: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT,
                  what: str = "condition", poll: float = 0.005) -> Any:
        """Run the loop until `condition()` is truthy; AssertionError after `timeout`."""

        async def wait() -> Any:
            deadline = time.monotonic() + timeout
            while True:
                value = condition()
                if value:
                    return value
                if time.monotonic() >= deadline:
                    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
                await asyncio.sleep(poll)

        return self.aio.run_until_complete(wait())

    def run_for(self, seconds: float) -> None:
        """Let the loop run (deliveries, heartbeats) for a while."""
        self.aio.run_until_complete(asyncio.sleep(seconds))

    # -- pynsq clients, closed with the loop --------------------------------------

    def writer(self, broker: BrokerProcess, **kwargs: Any) -> nsq.Writer:
        """A connected Writer."""
        kwargs.setdefault("reconnect_interval", 0.2)
        w = nsq.Writer([broker.tcp_address], **kwargs)
        self.clients.append(w)
        self.run_until(lambda: any(c.connected() for c in w.conns.values()),
                       what="the Writer to connect")
        return w

    def reader(self, broker: BrokerProcess, topic: str, channel: str,
               handler: Callable[[nsq.Message], Any], *, wait: bool = True,
               **kwargs: Any) -> nsq.Reader:
        """A Reader; with `wait`, returned once the broker has answered its SUB."""
        r = nsq.Reader(topic=topic, channel=channel, message_handler=handler,
                       nsqd_tcp_addresses=[broker.tcp_address], **kwargs)
        responses: list[bytes] = []
        r.sub_responses = responses
        original = r._on_connection_ready

        # The Reader sends SUB when its connection is ready; the broker's OK
        # to it arrives as the connection's first response after that. A
        # wrapper (not a change to pynsq) lets a test wait for it, so nothing
        # is published before the subscription exists.
        def on_ready(conn: Any, **kw: Any) -> None:
            conn.on("response", lambda conn, data, **_: responses.append(data))
            original(conn, **kw)

        r._on_connection_ready = on_ready
        self.clients.append(r)
        if wait:
            self.run_until(lambda: b"OK" in responses, what=f"SUB {topic} {channel} to be answered")
        return r

    def publish(self, writer: nsq.Writer, method: str, *args: Any) -> Any:
        """pub/mpub/dpub through the Writer; returns what its callback got."""
        got: list[Any] = []
        getattr(writer, method)(*args, callback=lambda conn, data: got.append(data))
        self.run_until(lambda: got, what=f"the answer to {method}")
        return got[0]

    def close_clients(self, settle: float = 0.1) -> None:
        """Close every Reader and Writer made so far, and let the closes go out."""
        clients, self.clients = self.clients, []
        for client in clients:
            try:
                if isinstance(client, nsq.Reader):
                    client.close()
                else:
                    for conn in list(client.conns.values()):
                        conn.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self.run_for(settle)

    def close(self) -> None:
        try:
            self.close_clients(0.01)
        finally:
            self.io.close(all_fds=True)
            asyncio.set_event_loop(None)


class Collector:
    """A message handler that records every delivery and finishes it."""

    def __init__(self, respond: Callable[[nsq.Message], Any] | None = None) -> None:
        self.deliveries: list[tuple[bytes, bytes, int, float]] = []  # (id, body, attempts, at)
        self.respond = respond

    def __call__(self, message: nsq.Message) -> Any:
        self.deliveries.append((bytes(message.id), bytes(message.body), message.attempts,
                                time.monotonic()))
        if self.respond is not None:
            return self.respond(message)
        return True

    @property
    def bodies(self) -> list[bytes]:
        return [d[1] for d in self.deliveries]

    def __len__(self) -> int:
        return len(self.deliveries)

    def __bool__(self) -> bool:  # pynsq tests `if message_handler:`
        return True
