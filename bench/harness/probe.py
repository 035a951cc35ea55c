"""Ceiling probe: the least per-message work a Twisted relay can do.

A yardstick, not a broker. The bench harness runs it beside mqd in the same
session so mqd's figures can be read as a fraction of what one CPython core on
this reactor allows; the gap between the two is the budget a faster mqd can
win back. It does only what NSQ's bench_writer/bench_reader and our
load processes (bench/harness/load.py) need: magic, IDENTIFY (``OK``, or the
feature-negotiation JSON), SUB, RDY, PUB, MPUB, FIN, NOP, CLS. Messages live
in a deque per channel; a read's publishes are put together, a batch per
topic, and answered with one write, and a run of PUBs to one topic is
gathered in one loop (as mqd's fast path does both); a delivery is
one preallocated struct pack per message and one ``writeSequence`` per
reader; FIN is a dict pop. No persistence,
timeouts, REQ/TOUCH, heartbeats, stats, HTTP (the harness creates topic and
channel by SUB + CLS), validation or error recovery beyond closing the
connection: adding any of them would make it a slower broker and a worse
yardstick.

``python -m bench.harness.probe --tcp-address=127.0.0.1:0`` logs
``TCP: listening on HOST:PORT`` as mqd does, so bench/harness/broker.py can start it.

``--durable DIR`` makes it the floor of a durable broker on one reactor
instead: each reactor turn's publishes (a record of length, id and body
each) and FINs (an id each) are one chunk of a log in DIR, written and
fdatasync'ed by a thread (one sync for every chunk handed over meanwhile, a
group commit), and a publish is answered and its messages delivered only
once its chunk is synced. The log is preallocated and written in place,
starting over at its end (as mqd's publish log is written in place between
checkpoints, since a sync that grows a file also commits the filesystem's
journal). No checksum, checkpoint, replay, spill or failure handling:
whatever a durable broker adds costs more.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import struct
import sys
import time
from collections import deque

from twisted.internet import protocol
from twisted.logger import globalLogBeginner, textFileLogObserver

from bench.harness.turn_log import TurnLog
from mqd.logs import get_logger

log = get_logger("bench.probe")

MAGIC = b"  V2"
# size (counts type and payload), frame type 2, timestamp ns, attempts, 16-byte id
MESSAGE_HEADER = struct.Struct(">iiqH16s")
_INT32 = struct.Struct(">i")
_FRAME = struct.Struct(">ii")
_MSG_OVERHEAD = MESSAGE_HEADER.size - 4  # the size field does not count itself
# A published message in the durable log: body length, id, then the body.
_LOG_RECORD = struct.Struct(">I16s")


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
        # The read's publishes, put (and answered) together when it ends or
        # before another answer: per topic, and how many commands.
        self.gathered: dict[Topic, list] = {}
        self.replies = 0

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)

    def connectionLost(self, reason: object = None) -> None:
        ch = self.channel
        if ch is not None:
            ch.readers.remove(self)
            ch.queue.extendleft(reversed(self.in_flight.values()))
            self.in_flight = {}
            ch.deliver()

    def _publish_gathered(self) -> None:
        """Put the read's publishes, one batch per topic, and answer them (or hand them to the log)."""
        gathered, self.gathered = self.gathered, {}
        replies, self.replies = self.replies, 0
        durable = self.factory.log
        for topic, msgs in gathered.items():
            if durable is None:
                topic.put(msgs)
            else:
                durable.publish(self, topic, msgs, replies)
                replies = 0
        if replies:
            self.transport.write(OK * replies)

    def _fatal(self, text: bytes) -> None:
        self._publish_gathered()
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
                mid = buf[pos + 4 : nl].rstrip(b"\r")
                if in_flight.pop(mid, None) is None:
                    self._publish_gathered()
                    write(FIN_FAILED)
                elif self.factory.log is not None:
                    self.factory.log.finish(mid)
                finished = True
                pos = nl + 1
                continue
            words = buf[pos:nl].rstrip(b"\r").split(b" ")
            name = words[0]
            if name == b"PUB" and len(words) == 2:
                after = self._pub_run(buf, pos, nl)
                if after == pos:
                    break  # its body is still arriving
                pos = after
                continue
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
                self._publish_gathered()
                write(OK)
            elif name == b"CLS":
                self.rdy = 0
                self._publish_gathered()
                write(CLOSE_WAIT)
            else:
                self._fatal(b"E_INVALID invalid command " + name[:32])
                return
        self.buf = buf[pos:]
        if self.replies:
            self._publish_gathered()
        if finished and self.channel is not None:
            self.channel.deliver()

    def _pub_run(self, buf: bytes, pos: int, nl: int) -> int:
        """Gather a run of whole PUBs with the same command line from `pos` (a pipelining publisher); where it ends.

        As mqd's fast path does: the line is compared, not parsed again,
        and the run's ids are made in one go.
        """
        line = buf[pos:nl + 1]
        line_len = len(line)
        end = len(buf)
        unpack = _INT32.unpack_from
        bodies = []
        while buf.startswith(line, pos):
            start = pos + line_len + 4
            if start > end:
                break
            stop = start + unpack(buf, start - 4)[0]
            if stop > end:
                break
            bodies.append(buf[start:stop])
            pos = stop
        if bodies:
            ids = self.factory.ids
            ts = time.time_ns()
            self._gather(line[4:line_len - 1].rstrip(b"\r"),
                         [(b"%016x" % next(ids), ts, body) for body in bodies], len(bodies))
        return pos

    def _gather(self, topic_name: bytes, msgs: list[tuple[bytes, int, bytes]], replies: int) -> None:
        """Hold a read's publishes to one topic until the read ends; `replies` OKs answer them."""
        topic = self.factory.topic(topic_name)
        gathered = self.gathered.get(topic)
        if gathered is None:
            self.gathered[topic] = msgs
        else:
            gathered += msgs
        self.replies += replies

    def _body_command(self, name: bytes, words: list[bytes], buf: bytes, start: int, stop: int) -> bool:
        """PUB, MPUB or IDENTIFY with its body at ``buf[start:stop]``; False once closed."""
        if name == b"IDENTIFY":
            negotiate = json.loads(buf[start:stop]).get("feature_negotiation")
            self._publish_gathered()
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
        self._gather(words[1], msgs, 1)
        return True


class DurableLog:
    """The durable probe's log: a chunk per reactor turn, written and synced by a thread, then landed."""

    def __init__(self, reactor, path: str, size: int = 32 << 20) -> None:
        self.log = TurnLog(reactor, path, size, self._take, self._land)
        # Per turn: publishes answered per connection, messages landed per topic.
        self.answers: dict[ProbeProtocol, int] = {}
        self.landing: dict[Topic, list] = {}

    def publish(self, proto: ProbeProtocol, topic: Topic, msgs: list[tuple[bytes, int, bytes]],
                replies: int) -> None:
        """Log `msgs` for `topic`; once synced they are delivered and `proto` gets `replies` OKs."""
        pack = _LOG_RECORD.pack
        append = self.log.pieces.append
        for mid, _, body in msgs:
            append(pack(len(body), mid))
            append(body)
        answers = self.answers
        answers[proto] = answers.get(proto, 0) + replies
        landing = self.landing.get(topic)
        if landing is None:
            self.landing[topic] = msgs
        else:
            landing += msgs
        self.log.turn()

    def finish(self, mid: bytes) -> None:
        self.log.pieces.append(mid)
        self.log.turn()

    def _take(self) -> tuple[dict, dict]:
        taken = (self.answers, self.landing)
        self.answers, self.landing = {}, {}
        return taken

    def _land(self, batch: list) -> None:
        for answers, landing in batch:
            for topic, msgs in landing.items():
                topic.put(msgs)
            for proto, count in answers.items():
                if count:
                    proto.transport.write(OK * count)


class ProbeFactory(protocol.Factory):
    """Topics shared by all connections, the message id sequence, and the log when durable."""

    protocol = ProbeProtocol

    def __init__(self, log: DurableLog | None = None) -> None:
        self.topics: dict[bytes, Topic] = {}
        self.ids = itertools.count(1)
        self.log = log

    def topic(self, name: bytes) -> Topic:
        t = self.topics.get(name)
        if t is None:
            t = self.topics[name] = Topic()
        return t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.harness.probe", description=__doc__.split("\n")[0])
    p.add_argument("--tcp-address", default="127.0.0.1:4150", metavar="HOST:PORT")
    p.add_argument("--durable", metavar="DIR", help="answer a publish once its log chunk in DIR is synced")
    args = p.parse_args(argv)
    from twisted.internet import reactor

    from bench.harness.wire import parse_address

    host, port = parse_address(args.tcp_address)
    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stdout)])
    durable = DurableLog(reactor, os.path.join(args.durable, "probe.log")) if args.durable else None
    listening = reactor.listenTCP(port, ProbeFactory(durable), interface=host)
    bound = listening.getHost()
    reactor.callWhenRunning(log.info, "TCP: listening on {h}:{p}", h=bound.host, p=bound.port)
    reactor.run()


if __name__ == "__main__":
    main()
