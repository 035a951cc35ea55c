"""statsd pushes: nsqd's names, deltas and gauges, the prefix, packing, and real UDP datagrams."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer, reactor
from twisted.internet.protocol import DatagramProtocol

from mqd.nsqd.statsd import StatsdService, pack_lines, statsd_prefix
from mqd.options import MQD_OPTIONS, ConfigError, resolve
from tests.support.inprocess_broker import scan
from tests.support.v2_client import Client, mpublish
from tests.support.v2_frames import cmd

PREFIX = "nsq.test-host_4151."
MEM_GAUGES = ["heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes",
              "gc_pause_usec_100", "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes"]


def service(broker, **kw) -> StatsdService:
    return StatsdService(broker, {"HTTP": 4151}, **kw)


@pytest.fixture
def statsd_broker(make_broker):
    return make_broker(statsd_address="127.0.0.1:8125", statsd_mem_stats="false", msg_timeout="2s")


# -- the prefix and the packets ------------------------------------------------------------------


@pytest.mark.parametrize(("template", "address", "port", "prefix"), [
    ("nsq.%s", "host.example.com", 4151, "nsq.host_example_com_4151."),
    ("nsq.%s", "10.0.0.1", 4151, "nsq.10_0_0_1_4151."),
    ("nsq.%s", "::1", 4151, "nsq.[__1]_4151."),       # Go's JoinHostPort brackets IPv6
    ("stats.%s.nsqd.", "h", 1, "stats.h_1.nsqd."),    # a trailing dot is not doubled
    ("fixed", "h", 1, "fixed."),
    ("", "h", 1, ""),
])
def test_prefix(template, address, port, prefix):
    assert statsd_prefix(template, address, port) == prefix


def test_prefix_uses_broadcast_http_port(make_broker):
    broker = make_broker(statsd_address="127.0.0.1:8125", broadcast_http_port="9999")
    assert service(broker).prefix() == "nsq.test-host_9999."
    broker = make_broker(path=broker.data_path + "/2", statsd_address="127.0.0.1:8125")
    assert service(broker).prefix() == PREFIX           # else the bound HTTP port


def test_pack_lines():
    lines = [f"a.{i}:1|c\n" for i in range(10)]        # 8 bytes each
    packets = pack_lines(lines, 20)
    assert packets == [b"a.0:1|c\na.1:1|c\n", b"a.2:1|c\na.3:1|c\n", b"a.4:1|c\na.5:1|c\n",
                       b"a.6:1|c\na.7:1|c\n", b"a.8:1|c\na.9:1|c\n"]
    assert pack_lines(["x" * 30 + "\n", "y\n"], 20) == [b"x" * 30 + b"\n", b"y\n"]  # never cut
    assert pack_lines([], 508) == []
    assert b"".join(pack_lines(lines, 508)) == "".join(lines).encode()


def test_options():
    s = resolve(MQD_OPTIONS, {})
    assert (s.statsd_address, s.statsd_prefix, s.statsd_interval, s.statsd_mem_stats,
            s.statsd_udp_packet_size, s.statsd_exclude_ephemeral) == ("", "nsq.%s", 60.0, True, 508, False)
    for bad in ("localhost", "host:", ":8125", "host:port", "host:70000"):
        with pytest.raises(ConfigError, match="--statsd-address"):
            resolve(MQD_OPTIONS, {"statsd-address": bad})
    assert resolve(MQD_OPTIONS, {"statsd-address": "[::1]:8125"}).statsd_address == "[::1]:8125"


def test_service_only_when_configured(tmp_path):
    from mqd.nsqd.statsd import StatsdService as Cls
    from mqd.nsqd.tap import build_service

    base = {"data-path": str(tmp_path), "tcp-address": "127.0.0.1:0", "http-address": "127.0.0.1:0",
            "backend": "memory"}
    top = build_service(resolve(MQD_OPTIONS, base), reactor)
    assert not any(isinstance(s, Cls) for s in top)
    top = build_service(resolve(MQD_OPTIONS, {**base, "statsd-address": "127.0.0.1:8125"}), reactor)
    assert isinstance(list(top)[-1], Cls)   # last, so it stops first


# -- what a push says ------------------------------------------------------------------------------


def test_lines_and_deltas(statsd_broker, clock):
    s = service(statsd_broker)
    c = Client(statsd_broker, port=6000)
    c.sub("t", "c", rdy=2)
    mpublish(statsd_broker, "t", [b"ab", b"cde", b"f"])
    m1, _ = c.messages()
    c.req(m1, 5_000)
    assert s.collect() == [f"{PREFIX}{line}\n" for line in [
        "topic.t.message_count:3|c",
        "topic.t.message_bytes:6|c",
        "topic.t.depth:0|g",
        "topic.t.backend_depth:0|g",
        "topic.t.channel.c.message_count:3|c",
        "topic.t.channel.c.depth:0|g",       # m3 went out in m1's slot
        "topic.t.channel.c.backend_depth:0|g",
        "topic.t.channel.c.in_flight_count:2|g",
        "topic.t.channel.c.deferred_count:1|g",
        "topic.t.channel.c.requeue_count:1|c",
        "topic.t.channel.c.timeout_count:0|c",
        "topic.t.channel.c.clients:1|g",
    ]]
    # The next push: counters are what happened since, gauges what is now.
    mpublish(statsd_broker, "t", [b"xyz"], port=5001)
    c.send(cmd("RDY", 0))
    clock.advance(2)
    scan(statsd_broker)
    lines = s.collect()
    assert f"{PREFIX}topic.t.message_count:1|c\n" in lines
    assert f"{PREFIX}topic.t.message_bytes:3|c\n" in lines
    assert f"{PREFIX}topic.t.channel.c.message_count:1|c\n" in lines
    assert f"{PREFIX}topic.t.channel.c.requeue_count:0|c\n" in lines
    assert f"{PREFIX}topic.t.channel.c.timeout_count:2|c\n" in lines
    assert f"{PREFIX}topic.t.channel.c.depth:3|g\n" in lines
    assert f"{PREFIX}topic.t.channel.c.in_flight_count:0|g\n" in lines
    # Nothing new: zero counters are still sent, as nsqd does.
    assert f"{PREFIX}topic.t.message_count:0|c\n" in s.collect()


def test_recreated_topic_starts_again(statsd_broker):
    s = service(statsd_broker)
    mpublish(statsd_broker, "t", [b"1", b"2", b"3"])
    s.collect()
    statsd_broker.delete_topic("t")
    mpublish(statsd_broker, "t", [b"4"], port=5001)
    assert f"{PREFIX}topic.t.message_count:1|c\n" in s.collect()


def test_exclude_ephemeral(make_broker):
    broker = make_broker(statsd_address="127.0.0.1:8125", statsd_mem_stats="false",
                         statsd_exclude_ephemeral="true")
    Client(broker, port=1).sub("t", "c#ephemeral")
    Client(broker, port=2).sub("t", "c")
    Client(broker, port=3).sub("e#ephemeral", "c")
    names = {line.split(":")[0][len(PREFIX):] for line in service(broker).collect()}
    assert "topic.t.channel.c.depth" in names
    assert not any("#ephemeral" in name for name in names)


def test_mem_stats(make_broker):
    broker = make_broker(statsd_address="127.0.0.1:8125")
    s = service(broker)
    lines = s.collect()
    assert [line.split(":")[0] for line in lines] == [f"{PREFIX}mem.{k}" for k in MEM_GAUGES] + [
        f"{PREFIX}mem.gc_runs"]
    assert all(line.endswith("|g\n") for line in lines[:-1]) and lines[-1].endswith("|c\n")


def test_e2e_latency_gauges(make_broker, clock):
    broker = make_broker(statsd_address="127.0.0.1:8125", statsd_mem_stats="false",
                         e2e_processing_latency_percentile="0.999,0.95")
    c = Client(broker)
    c.sub("t", "c", rdy=1)
    mpublish(broker, "t", [b"x"])
    clock.advance(1.5)
    c.fin(c.messages()[0])
    values = {}
    for line in service(broker).collect():
        name, _, rest = line[len(PREFIX):].partition(":")
        values[name] = rest
    for base in ("topic.t", "topic.t.channel.c"):
        for p in ("100", "95"):                       # quantile×100 rounded, as nsqd's %.0f
            value, kind = values[f"{base}.e2e_processing_latency_{p}"].rstrip("\n").split("|")
            assert kind == "g" and int(value) == pytest.approx(1.5e9, abs=2_000)


# -- over UDP ------------------------------------------------------------------------------------


class _Receiver(DatagramProtocol):
    def __init__(self) -> None:
        self.datagrams: list[bytes] = []
        self.waiting: list[tuple[int, defer.Deferred]] = []

    def datagramReceived(self, data, addr) -> None:
        self.datagrams.append(data)
        for n, d in list(self.waiting):
            if len(self.datagrams) >= n:
                self.waiting.remove((n, d))
                d.callback(self.datagrams)

    def wait_for(self, n: int, timeout: float = 5.0) -> defer.Deferred:
        if len(self.datagrams) >= n:
            return defer.succeed(self.datagrams)
        d = defer.Deferred()
        self.waiting.append((n, d))
        return d.addTimeout(timeout, reactor)


@pytest.fixture
def receiver():
    proto = _Receiver()
    port = reactor.listenUDP(0, proto, interface="127.0.0.1")
    yield proto, port.getHost().port
    port.stopListening()


@pytest_twisted.inlineCallbacks
def test_push_over_udp(make_broker, clock, receiver):
    proto, port = receiver
    broker = make_broker(statsd_address=f"127.0.0.1:{port}", statsd_interval="10s",
                         statsd_mem_stats="false")
    mpublish(broker, "t", [b"hello"])
    s = service(broker, reactor=reactor)
    s.startService()
    try:
        clock.advance(9.9)
        assert proto.datagrams == []
        clock.advance(0.1)                      # one interval: the first push
        [datagram] = yield proto.wait_for(1)
        assert datagram.decode().splitlines() == [
            f"{PREFIX}topic.t.message_count:1|c",
            f"{PREFIX}topic.t.message_bytes:5|c",
            f"{PREFIX}topic.t.depth:1|g",
            f"{PREFIX}topic.t.backend_depth:0|g",
        ]
        mpublish(broker, "t", [b"again"], port=5001)
        clock.advance(10)
        datagrams = yield proto.wait_for(2)
        assert datagrams[1].decode().splitlines()[:3] == [
            f"{PREFIX}topic.t.message_count:1|c",
            f"{PREFIX}topic.t.message_bytes:5|c",
            f"{PREFIX}topic.t.depth:2|g",
        ]
    finally:
        s.stopService()


@pytest_twisted.inlineCallbacks
def test_datagrams_bounded_and_spread(make_broker, clock, receiver):
    proto, port = receiver
    broker = make_broker(statsd_address=f"127.0.0.1:{port}", statsd_interval="11s",
                         statsd_udp_packet_size="200", statsd_mem_stats="false")
    for i in range(5):
        Client(broker, port=7000 + i).sub("topic", f"channel{i}")
    s = service(broker, reactor=reactor)
    expected = b"".join(pack_lines(s.collect(), 10**6))
    s._last_topics, s._last_channels = {}, {}    # as if nothing had been pushed yet
    s.startService()
    try:
        clock.advance(11)
        yield proto.wait_for(1)
        packets = pack_lines([line + "\n" for line in expected.decode().splitlines()], 200)
        n = len(packets)
        assert n > 3
        # The first datagram now, the rest evenly over the interval less a second.
        clock.advance(10 / n * (n - 2) + 0.001)
        received = yield proto.wait_for(n - 1)
        assert len(received) == n - 1
        s.stopService()                          # the last one goes out on stop
        received = yield proto.wait_for(n)
        assert all(len(d) <= 200 for d in received)
        assert all(d.endswith(b"\n") for d in received)
        assert b"".join(received) == expected
    finally:
        if s.running:
            s.stopService()
