"""A channel declared in mqlookupd exists on a broker from the topic's first message.

The channel is declared with mqlookupd's `POST /channel/create` (what
mqadmin and nsqadmin do); the broker, connected to that lookupd, asks its
`/channels?topic=` when the topic is created by a publish.
"""

from __future__ import annotations

from tests.support.processes import FAST_SCAN, http_request, wait_for
from tests.support.raw_conn import RawConn, command


def _channels(broker, topic: str) -> dict[str, tuple[int, int]]:
    """channel -> (depth, message_count) from the broker's /stats."""
    status, stats = broker.get(f"/stats?format=json&topic={topic}")
    assert status == 200
    return {c["channel_name"]: (c["depth"], c["message_count"])
            for t in stats["topics"] if t["topic_name"] == topic for c in t["channels"]}


def test_channel_declared_in_lookupd_holds_every_message(start_lookupd, start_broker):
    lookupd = start_lookupd("--broadcast-address=127.0.0.1")
    assert lookupd.post("/channel/create?topic=pre&channel=archive") == 200
    assert lookupd.post("/channel/create?topic=pre&channel=tmp%23ephemeral") == 200
    broker = start_broker(*FAST_SCAN, "--broadcast-address=127.0.0.1",
                          f"--lookupd-tcp-address={lookupd.tcp_address}")
    wait_for(lambda: any(p["http_port"] == broker.http_port for p in lookupd.get("/nodes")[1]["producers"]),
             what="the broker to register with lookupd")

    for i in range(5):
        assert http_request(broker.http_address, "POST", "/pub?topic=pre", b"m%d" % i) == (200, b"OK")

    wait_for(lambda: _channels(broker, "pre") == {"archive": (5, 5)}, what="archive to hold all 5")
    with RawConn(broker) as conn:
        conn.send(command(b"SUB pre archive") + command(b"RDY 10"))
        assert conn.read_frame() == (0, b"OK")
        assert [conn.read_message()[3] for _ in range(5)] == [b"m%d" % i for i in range(5)]
    assert "failed to query nsqlookupd" not in broker.log()
