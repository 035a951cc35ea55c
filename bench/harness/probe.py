"""Ceiling probe: the least per-message work a Twisted relay can do.

A yardstick, not a broker. The bench harness runs it beside mqd in the same
session so mqd's figures can be read as a fraction of what one CPython core on
this reactor allows; the gap between the two is the budget a faster mqd can
win back. It does only what NSQ's bench_writer/bench_reader and our
load processes (bench/harness/load.py) need: magic, IDENTIFY (``OK``, or the
feature-negotiation JSON), SUB, RDY, PUB, MPUB, FIN, NOP, CLS. Messages live
in a deque per channel; a delivery is one preallocated struct pack per message
and one ``writeSequence`` per reader; FIN is a dict pop. No persistence,
timeouts, REQ/TOUCH, heartbeats, stats, HTTP (the harness creates topic and
channel by SUB + CLS), validation or error recovery beyond closing the
connection: adding any of them would make it a slower broker and a worse
yardstick.

``python -m bench.harness.probe --tcp-address=127.0.0.1:0`` logs
``TCP: listening on HOST:PORT`` as mqd does, so bench/harness/broker.py can start it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import struct
import sys
import time
from collections import deque

from twisted.internet import protocol
from twisted.logger import globalLogBeginner, textFileLogObserver

from mqd.logs import get_logger

log = get_logger("bench.probe")

MAGIC = b"  V2"
# size (counts type and payload), frame type 2, timestamp ns, attempts, 16-byte id
MESSAGE_HEADER = struct.Struct(">iiqH16s")
_INT32 = struct.Struct(">i")
_FRAME = struct.Struct(">ii")
_MSG_OVERHEAD = MESSAGE_HEADER.size - 4  # the size field does not count itself


def response(payload: bytes, ftype: int = 0) -> bytes:
    """A response (0) or error (1) frame."""
    return _FRAME.pack(len(payload) + 4, ftype) + payload


OK = response(b"OK")
CLOSE_WAIT = response(b"CLOSE_WAIT")
FIN_FAILED = response(b"E_FIN_FAILED FIN failed", 1)
IDENTIFY_JSON = response(
    json.dumps(
        {
            "max_rdy_count": 2500,
            "version": "1.3.0",
            "max_msg_timeout": 900000,
            "msg_timeout": 60000,
            "tls_v1": False,
            "deflate": False,
            "deflate_level": 6,
            "max_deflate_level": 6,
            "snappy": False,
            "sample_rate": 0,
            "auth_required": False,
            "output_buffer_size": 16384,
            "output_buffer_timeout": 250,
        },
        separators=(",", ":"),
    ).encode()
)


class Channel:
    """Queued messages and the readers subscribed to them."""

    __slots__ = ("queue", "readers")

    def __init__(self) -> None:
        self.queue: deque[tuple[bytes, int, bytes]] = deque()  # (id, timestamp ns, body)
        self.readers: list[ProbeProtocol] = []

    def deliver(self) -> None:
        """Fill every reader's RDY window; one ``writeSequence`` per reader."""
        queue = self.queue
        pack = MESSAGE_HEADER.pack
        for reader in self.readers:
            if not queue:
                return
            in_flight = reader.in_flight
            n = min(reader.rdy - len(in_flight), len(queue))
            if n <= 0:
                continue
            out = []
            append = out.append
            popleft = queue.popleft
            for _ in range(n):
                msg = popleft()
                mid, ts, body = msg
                in_flight[mid] = msg
                append(pack(len(body) + _MSG_OVERHEAD, 2, ts, 1, mid))
                append(body)
            reader.transport.writeSequence(out)


class Topic:
    """Channels of one topic; messages published before any channel exists wait here."""

    __slots__ = ("channels", "backlog")

    def __init__(self) -> None:
        self.channels: dict[bytes, Channel] = {}
        self.backlog: list[tuple[bytes, int, bytes]] = []

    def channel(self, name: bytes) -> Channel:
        ch = self.channels.get(name)
        if ch is None:
            ch = self.channels[name] = Channel()
            if self.backlog:
                ch.queue.extend(self.backlog)
                self.backlog = []
        return ch

    def put(self, msgs: list[tuple[bytes, int, bytes]]) -> None:
        """Every channel gets references to the same message tuples, not copies."""
        if not self.channels:
            self.backlog.extend(msgs)
            return
        for ch in self.channels.values():
            ch.queue.extend(msgs)
            ch.deliver()


class ProbeProtocol(protocol.Protocol):
    """One V2 connection: parse commands in place, act on them, answer in batches."""

    factory: ProbeFactory

    def __init__(self) -> None:
        self.buf = b""
        self.magic = False
        self.rdy = 0
        self.channel: Channel | None = None
        self.in_flight: dict[bytes, tuple[bytes, int, bytes]] = {}

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)

    def connectionLost(self, reason: object = None) -> None:
        ch = self.channel
        if ch is not None:
            ch.readers.remove(self)
            ch.queue.extendleft(reversed(self.in_flight.values()))
            self.in_flight = {}
            ch.deliver()

    def _fatal(self, text: bytes) -> None:
        self.transport.write(response(text, 1))
        self.transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        if not self.magic:
            if len(buf) < 4:
                self.buf = buf
                return
            if buf[:4] != MAGIC:
                self._fatal(b"E_BAD_PROTOCOL bad protocol magic")
                return
            self.magic = True
            pos = 4
        end = len(buf)
        in_flight = self.in_flight
        write = self.transport.write
        finished = False
        while pos < end:
            nl = buf.find(b"\n", pos)
            if nl < 0:
                break
            if buf.startswith(b"FIN ", pos):
                if in_flight.pop(buf[pos + 4 : nl].rstrip(b"\r"), None) is None:
                    write(FIN_FAILED)
                finished = True
                pos = nl + 1
                continue
            words = buf[pos:nl].rstrip(b"\r").split(b" ")
            name = words[0]
            if name in (b"MPUB", b"PUB", b"IDENTIFY"):
                if end - nl - 1 < 4:
                    break
                stop = nl + 5 + _INT32.unpack_from(buf, nl + 1)[0]
                if stop > end:
                    break
                if not self._body_command(name, words, buf, nl + 5, stop):
                    return
                pos = stop
                continue
            pos = nl + 1
            if name == b"RDY" and len(words) == 2 and self.channel is not None:
                self.rdy = int(words[1])
                self.channel.deliver()
            elif name == b"NOP":
                pass
            elif name == b"SUB" and len(words) == 3 and self.channel is None:
                self.channel = self.factory.topic(words[1]).channel(words[2])
                self.channel.readers.append(self)
                write(OK)
            elif name == b"CLS":
                self.rdy = 0
                write(CLOSE_WAIT)
            else:
                self._fatal(b"E_INVALID invalid command " + name[:32])
                return
        self.buf = buf[pos:]
        if finished and self.channel is not None:
            self.channel.deliver()

    def _body_command(self, name: bytes, words: list[bytes], buf: bytes, start: int, stop: int) -> bool:
        """PUB, MPUB or IDENTIFY with its body at ``buf[start:stop]``; False once closed."""
        if name == b"IDENTIFY":
            negotiate = json.loads(buf[start:stop]).get("feature_negotiation")
            self.transport.write(IDENTIFY_JSON if negotiate else OK)
            return True
        if len(words) != 2:
            self._fatal(b"E_INVALID " + name + b" insufficient number of parameters")
            return False
        ids = self.factory.ids
        ts = time.time_ns()
        if name == b"PUB":
            msgs = [(b"%016x" % next(ids), ts, buf[start:stop])]
        else:
            unpack = _INT32.unpack_from
            count = unpack(buf, start)[0]
            msgs = []
            append = msgs.append
            p = start + 4
            for _ in range(count):
                size = unpack(buf, p)[0]
                p += 4
                append((b"%016x" % next(ids), ts, buf[p : p + size]))
                p += size
            if p != stop:
                self._fatal(b"E_BAD_BODY MPUB invalid body size")
                return False
        self.factory.topic(words[1]).put(msgs)
        self.transport.write(OK)
        return True


class ProbeFactory(protocol.Factory):
    """Topics shared by all connections, and the message id sequence."""

    protocol = ProbeProtocol

    def __init__(self) -> None:
        self.topics: dict[bytes, Topic] = {}
        self.ids = itertools.count(1)

    def topic(self, name: bytes) -> Topic:
        t = self.topics.get(name)
        if t is None:
            t = self.topics[name] = Topic()
        return t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.harness.probe", description=__doc__.split("\n")[0])
    p.add_argument("--tcp-address", default="127.0.0.1:4150", metavar="HOST:PORT")
    args = p.parse_args(argv)
    from twisted.internet import reactor

    from bench.harness.wire import parse_address

    host, port = parse_address(args.tcp_address)
    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stdout)])
    listening = reactor.listenTCP(port, ProbeFactory(), interface=host)
    bound = listening.getHost()
    reactor.callWhenRunning(log.info, "TCP: listening on {h}:{p}", h=bound.host, p=bound.port)
    reactor.run()


if __name__ == "__main__":
    main()
