"""Pushing stats to statsd over UDP, as nsqd's `--statsd-address` does.

Every `statsd-interval` the broker's /stats numbers go out as statsd
lines under nsqd's metric names, so dashboards and alerts built for
nsqd (Graphite paths like `nsq.host_4151.topic.t.channel.c.depth`) keep
working: counters as the change since the previous push (`|c`), levels
as gauges (`|g`), newline-separated, packed into datagrams of at most
`statsd-udp-packet-size` bytes and spread over the interval less a
second so a broker with many topics does not burst. A push opens its own
UDP socket, connected to the statsd address, and closes it after the
last datagram, as nsqd dials once per push.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from twisted.application import service
from twisted.internet import defer
from twisted.internet.interfaces import IListeningPort, IUDPTransport
from twisted.internet.protocol import DatagramProtocol
from twisted.internet.task import LoopingCall

from mqd.endpoints import join_host_port
from mqd.logs import get_logger
from mqd.names import EPHEMERAL_SUFFIX
from mqd.nsqd.lookup_peer import broadcast_port
from mqd.nsqd.stats import memory_stats, stats_json

if TYPE_CHECKING:
    from mqd.nsqd.broker import Broker

__all__ = ["StatsdService", "pack_lines", "prefix_of", "statsd_prefix"]

log = get_logger(__name__)

def statsd_prefix(template: str, broadcast_address: str, http_port: int) -> str:
    """nsqd's prefix: `%s` → `<broadcast-address>_<http port>` with '.' and ':' as '_', then a '.'.

    The host key is Go's net.JoinHostPort of the two (an IPv6 address in
    brackets) with statsd.HostKey's replacements; an empty template means
    no prefix at all.
    """
    if not template:
        return ""
    key = join_host_port(broadcast_address, http_port).replace(".", "_").replace(":", "_")
    prefix = template.replace("%s", key)
    return prefix if prefix.endswith(".") else prefix + "."


def prefix_of(options, ports: Mapping[str, int]) -> str:
    """The broker's prefix: its template filled with its broadcast address and HTTP port."""
    port = broadcast_port(options, ports, "HTTP")
    return statsd_prefix(options.statsd_prefix, options.broadcast_address, port)


def pack_lines(lines: Iterable[str], size: int) -> list[bytes]:
    """Datagrams of whole lines, each at most `size` bytes (nsq's BoundaryBufferedWriter).

    A line longer than `size` on its own is sent alone rather than cut,
    as nsqd's buffered writer passes an oversized write straight through.
    """
    packets: list[bytes] = []
    buf = bytearray()
    for line in lines:
        data = line.encode("utf-8")
        if buf and len(buf) + len(data) > size:
            packets.append(bytes(buf))
            buf.clear()
        buf += data
    if buf:
        packets.append(bytes(buf))
    return packets


class _Sender(DatagramProtocol):
    """One push's connected UDP socket."""

    # Set before startProtocol, by the port listenUDP made for it.
    transport: IUDPTransport

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port

    def startProtocol(self) -> None:
        self.transport.connect(self.host, self.port)

    def send(self, packet: bytes) -> None:
        try:
            # Connected: no address. Every UDP port defaults it; Twisted's interface omits the default.
            self.transport.write(packet)  # type: ignore[call-arg]
        except OSError as e:
            # Nobody listening shows up here (or as connectionRefused) on a
            # connected UDP socket; statsd being down must not stop the loop.
            log.debug("statsd: send failed: {error}", error=e)

    def connectionRefused(self) -> None:
        log.debug("statsd: {host}:{port} refused a datagram", host=self.host, port=self.port)


class StatsdService(service.Service):
    """The statsd loop: a LoopingCall on the broker's clock, one UDP socket per push."""

    name = "statsd"

    def __init__(self, broker: Broker, ports: dict[str, int] | None = None, reactor=None) -> None:
        if reactor is None:
            from twisted.internet import reactor
        self.broker = broker
        self.reactor = reactor
        self.clock = broker.clock
        self.ports = ports if ports is not None else {}
        opts = broker.options
        self.address = opts.statsd_address
        host, _, port = self.address.rpartition(":")
        self.host = host[1:-1] if host.startswith("[") else host
        self.port = int(port)
        self.interval = opts.statsd_interval
        self.packet_size = opts.statsd_udp_packet_size
        self.mem_stats = opts.statsd_mem_stats
        self.exclude_ephemeral = opts.statsd_exclude_ephemeral
        self._last_topics: dict[str, tuple[int, int]] = {}
        self._last_channels: dict[tuple[str, str], tuple[int, int, int]] = {}
        self._last_gc_runs = 0
        self._loop: LoopingCall | None = None
        # (DelayedCall, sender, datagram) of the push being spread over the
        # interval, in the order they fire, and that push's socket.
        self._pending: deque[tuple[Any, _Sender, bytes]] = deque()
        self._udp: IListeningPort | None = None

    # -- life cycle --------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.push)
        self._loop.clock = self.clock
        self._loop.start(self.interval, now=False).addErrback(
            lambda f: log.failure("statsd loop stopped", f)
        )

    def stopService(self):
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        # As nsqd's spread writer on exit: what is left goes out now.
        self._finish_now()
        log.info("STATSD: closing")

    # -- what is sent ------------------------------------------------------------------

    def prefix(self) -> str:
        return prefix_of(self.broker.options, self.ports)

    def collect(self) -> list[str]:
        """This push's lines, nsqd's names in nsqd's order; counters relative to the last push."""
        prefix = self.prefix()
        lines: list[str] = []

        def counter(name: str, delta: int) -> None:
            lines.append(f"{prefix}{name}:{delta}|c\n")

        def gauge(name: str, value: int) -> None:
            lines.append(f"{prefix}{name}:{value}|g\n")

        def delta(now: int, before: int) -> int:
            # A topic deleted and recreated starts again from 0.
            return now - before if now >= before else now

        stats = stats_json(self.broker, include_clients=False, include_mem=False)
        topics_now: dict[str, tuple[int, int]] = {}
        channels_now: dict[tuple[str, str], tuple[int, int, int]] = {}
        for t in stats["topics"] or ():
            name = t["topic_name"]
            topics_now[name] = (t["message_count"], t["message_bytes"])
            if self.exclude_ephemeral and name.endswith(EPHEMERAL_SUFFIX):
                continue
            last_msgs, last_bytes = self._last_topics.get(name, (0, 0))
            counter(f"topic.{name}.message_count", delta(t["message_count"], last_msgs))
            counter(f"topic.{name}.message_bytes", delta(t["message_bytes"], last_bytes))
            gauge(f"topic.{name}.depth", t["depth"])
            gauge(f"topic.{name}.backend_depth", t["backend_depth"])
            for p in t["e2e_processing_latency"]["percentiles"] or ():
                gauge(f"topic.{name}.e2e_processing_latency_{p['quantile'] * 100:.0f}", int(p["value"]))
            for c in t["channels"]:
                cname = c["channel_name"]
                channels_now[(name, cname)] = (c["message_count"], c["requeue_count"], c["timeout_count"])
                if self.exclude_ephemeral and cname.endswith(EPHEMERAL_SUFFIX):
                    continue
                last = self._last_channels.get((name, cname), (0, 0, 0))
                base = f"topic.{name}.channel.{cname}"
                counter(f"{base}.message_count", delta(c["message_count"], last[0]))
                gauge(f"{base}.depth", c["depth"])
                gauge(f"{base}.backend_depth", c["backend_depth"])
                gauge(f"{base}.in_flight_count", c["in_flight_count"])
                gauge(f"{base}.deferred_count", c["deferred_count"])
                counter(f"{base}.requeue_count", delta(c["requeue_count"], last[1]))
                counter(f"{base}.timeout_count", delta(c["timeout_count"], last[2]))
                gauge(f"{base}.clients", c["client_count"])
                for p in c["e2e_processing_latency"]["percentiles"] or ():
                    gauge(f"{base}.e2e_processing_latency_{p['quantile'] * 100:.0f}", int(p["value"]))
        self._last_topics = topics_now
        self._last_channels = channels_now

        if self.mem_stats:
            ms = memory_stats()
            for key in ("heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes",
                        "gc_pause_usec_100", "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes"):
                gauge(f"mem.{key}", ms[key])
            counter("mem.gc_runs", delta(ms["gc_total_runs"], self._last_gc_runs))
            self._last_gc_runs = ms["gc_total_runs"]
        return lines

    # -- sending -------------------------------------------------------------------------

    def push(self) -> defer.Deferred:
        """One tick: gather the lines now, then send them (after resolving the host if needed)."""
        self._finish_now()
        try:
            packets = pack_lines(self.collect(), self.packet_size)
        except Exception:
            # A bug here must not end the loop: the next push may well work.
            log.failure("statsd: gathering stats failed")
            return defer.succeed(None)
        log.info("STATSD: pushing stats to {address}", address=self.address)
        if not packets:
            return defer.succeed(None)
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            d = self.reactor.resolve(self.host)
        else:
            d = defer.succeed(self.host)
        d.addCallback(self._send, packets)
        d.addErrback(lambda f: log.error("failed to create UDP socket to statsd({address}): {error}",
                                         address=self.address, error=f.getErrorMessage()))
        return d

    def _send(self, ip: str, packets: list[bytes]) -> None:
        sender = _Sender(ip, self.port)
        self._udp = self.reactor.listenUDP(0, sender, interface="::" if ":" in ip else "")
        # nsqd's SpreadWriter: the first datagram now, the others evenly
        # over the interval less a second (all at once if stopping meanwhile).
        spread = self.interval - 1.0 if self.running else 0.0
        step = spread / len(packets) if spread > 0 else 0.0
        sender.send(packets[0])
        if len(packets) == 1 or step <= 0:
            for packet in packets[1:]:
                sender.send(packet)
            self._close()
            return
        for i, packet in enumerate(packets[1:], start=1):
            call = self.clock.callLater(step * i, self._send_one, sender, packet)
            self._pending.append((call, sender, packet))

    def _send_one(self, sender: _Sender, packet: bytes) -> None:
        self._pending.popleft()  # this one: they fire in the order they were scheduled
        sender.send(packet)
        if not self._pending:
            self._close()

    def _finish_now(self) -> None:
        """Send what is still scheduled from the previous push, and close its socket."""
        pending, self._pending = self._pending, deque()
        for call, sender, packet in pending:
            if call.active():
                call.cancel()
                sender.send(packet)
        self._close()

    def _close(self) -> None:
        udp, self._udp = self._udp, None
        if udp is not None:
            udp.stopListening()
