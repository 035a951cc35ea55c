"""asyncnsq, an asyncio client, against a running broker.

pynsq (tornado) is the reference client of the other integration tests; a
second Python client with its own framing, IDENTIFY handling and compression
upgrade catches what pynsq happens to tolerate. asyncnsq reads the socket in
52-byte slices and switches its decoder wherever a read ends after the
IDENTIFY response, so it needs the compressed `OK` (and nothing else) to
follow that response exactly as nsqd sends it.

The scenario is the Node clients' one (tests/integration/node/scenario.js):
PUB, MPUB and DPUB, then a consumer that requeues one message at once and one
with a delay, sees both again with attempts 2, and FINs everything.

asyncnsq 2.x needs Python 3.12, so the `test` extra pins 1.2.1 below that and
2.0.1 from it. 2.0.1 reads 64 KiB at a time, so an IDENTIFY response and the
compressed OK written together reach its plain frame parser in one read:
that is the break its snappy case is here to catch. 1.2.1 reads 52 bytes at
a time and copes with either write pattern.
"""

from __future__ import annotations

import asyncio
import sys
import time
from importlib.metadata import version

import asyncnsq
import pytest
from asyncnsq.tcp.protocol import DeflateReader, SnappyReader

from tests.support.client_scenario import DEFER_MS, REQUEUE_DELAY_MS, check_scenario
from tests.support.processes import FAST_SCAN

DEADLINE = 15.0
EXPECTED = {"pub-1", "mpub-1", "mpub-2", "dpub-1"}
PINNED = "2.0.1" if sys.version_info >= (3, 12) else "1.2.1"  # as pyproject.toml's `test` extra
DECODERS = {"snappy": SnappyReader, "deflate": DeflateReader}


async def roundtrip(address: str, topic: str, channel: str, compression: str | None) -> dict:
    """Publish, consume, requeue; what the client saw, for the assertions."""
    host, port = address.rsplit(":", 1)
    options = {compression: True} if compression else {}
    result: dict = {"deliveries": [], "decoders": {}}
    t0 = time.monotonic()
    writer = await asyncnsq.create_writer(host=host, port=int(port), **options)
    reader = None
    try:
        result["decoders"]["writer"] = type(writer._conn._parser)
        assert await writer.pub(topic, b"pub-1") == b"OK"
        assert await writer.mpub(topic, b"mpub-1", b"mpub-2") == b"OK"
        result["deferred_at"] = time.monotonic() - t0
        assert await writer.dpub(topic, DEFER_MS, b"dpub-1") == b"OK"

        reader = await asyncnsq.create_reader(nsqd_tcp_addresses=[address], max_in_flight=10,
                                              **options)
        result["decoders"]["reader"] = [type(c._parser) for c in reader._connections.values()]
        await reader.subscribe(topic, channel)
        finished: set[str] = set()
        async with asyncio.timeout(DEADLINE):
            async for message in reader.messages():
                body = message.body.decode()
                result["deliveries"].append((body, message.attempts, time.monotonic() - t0))
                if message.attempts == 1 and body == "pub-1":
                    await message.req(0)
                elif message.attempts == 1 and body == "mpub-1":
                    await message.req(REQUEUE_DELAY_MS)
                else:
                    await message.fin()
                    finished.add(body)
                    if finished == EXPECTED:
                        break
        return result
    finally:
        writer.close()
        if reader is not None:
            reader.close()
        await asyncio.sleep(0.05)  # let the cancelled reader tasks finish


@pytest.mark.parametrize("compression", [None, "snappy", "deflate"])
def test_asyncnsq_publish_consume_requeue_defer(start_broker, name, compression):
    broker = start_broker(*FAST_SCAN)
    result = asyncio.run(roundtrip(broker.tcp_address, name(), name("c"), compression))
    check_scenario(result)
    expected = DECODERS.get(compression)
    if expected is not None:
        assert result["decoders"]["writer"] is expected
        assert result["decoders"]["reader"] == [expected]
    assert "bad compressed data" not in broker.log(), broker.describe()


def test_asyncnsq_version_is_the_pinned_one():
    """The README lists the versions the tests run; a drift shows here first."""
    assert version("asyncnsq") == PINNED
