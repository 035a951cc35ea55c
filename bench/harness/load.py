"""The load processes: publishers as NSQ's bench_writer, consumers as its bench_reader.

**Publishers** send pre-built PUB/MPUB frames as fast as the broker acks them
(or paced, for latency). Each process owns one connection, like bench_writer
(one per core). All frames are built once; per command only the 8-byte send
timestamp at the start of each body is patched, so the generator costs a few
microseconds per batch and the broker stays the bottleneck.

**Consumers** IDENTIFY, SUB, RDY, then FIN every message as cheaply as
possible. FINs are batched and flushed once 75% of the RDY window has
arrived since the last flush, and also whenever the socket has nothing more
to read (just before the process would block), so the broker's in-flight
window never stalls waiting for us. Frames are parsed in place in a large
receive buffer; per message the only allocation is the 16-byte id slice
needed for the FIN.

Both run in spawned processes (``writer_main``, ``reader_main``) that report
("ready" | "result" | "error", tag, data) on a queue; ``fill`` and
``huge_publish`` publish from the calling process, untimed set-up or one
measured batch.
"""

from __future__ import annotations

import http.client
import math
import select
import socket
import struct
import time
import traceback
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.harness import wire

_TS = struct.Struct(">q")
_NEVER = float("inf")


def _child(tag: str, label: str, queue: Any, run: Callable[[Callable[[], None]], dict]) -> None:
    """Process entry point: ``run(ready)``'s result, or its error, reported on ``queue``."""
    try:
        result = run(lambda: queue.put(("ready", tag, None)))
    except (OSError, wire.ProtocolError, ValueError) as exc:
        queue.put(("error", tag, f"{label}: {exc}"))
        raise SystemExit(1) from None
    except Exception:  # noqa: BLE001 -- any crash must reach the parent, not hang it
        queue.put(("error", tag, f"{label}: {traceback.format_exc()}"))
        raise SystemExit(1) from None
    queue.put(("result", tag, result))


def _released(ready: Callable[[], None] | None, start: Any) -> None:
    """Say ``ready`` (connected), then wait for ``start``: every process of a run begins at once."""
    if ready is not None:
        ready()
    if start is not None:
        start.wait()


# -- publishers --------------------------------------------------------------------------


@dataclass
class WriterConfig:
    """What one publisher process does; picklable so it survives the spawn start method."""

    address: tuple[str, int]
    topic: str
    size: int = 200
    batch: int = 100
    mode: str = "mpub"  # "mpub" or "pub"
    pipeline: int = 1
    duration: float | None = 10.0
    count: int | None = None  # messages for this writer; overrides duration
    rate: float | None = None  # messages/s, paced (bench latency); None: as fast as acks come


def due_commands(elapsed: float, per_second: float, sent: int) -> int:
    """Commands a paced writer owes after ``elapsed`` s when command k is due at k / per_second.

    The schedule is absolute, so a writer held back by slow acks catches up
    (within its pipeline) instead of drifting below the asked rate.
    """
    if elapsed < 0:
        return 0
    return max(0, math.floor(elapsed * per_second) + 1 - sent)


class _Commands:
    """``pipeline`` identical commands laid out back to back in one buffer.

    Sending k commands is then one ``sendall`` of a prefix. Timestamps are
    patched with strided memoryview assignments (8 per run of bodies, one per
    timestamp byte) instead of one ``pack_into`` per message, so the cost does
    not grow with the batch size.
    """

    def __init__(self, topic: str, size: int, batch: int, mode: str, copies: int) -> None:
        if size < 8:
            raise ValueError("--size must be at least 8 (the body carries a timestamp)")
        body = bytearray(b"x" * size)
        if mode == "pub":
            if batch != 1:
                raise ValueError("PUB carries one message; batch must be 1")
            head = f"PUB {topic}\n".encode() + wire.SIZE.pack(size)
            one = head + body
            first = len(head)
        else:
            msg = wire.SIZE.pack(size) + body
            payload = struct.pack(">i", batch) + msg * batch
            head = f"MPUB {topic}\n".encode() + wire.SIZE.pack(len(payload))
            one = head + payload
            first = len(head) + 8
        self.batch = batch
        self.length = len(one)
        self.buf = bytearray(one * copies)
        self.view = memoryview(self.buf)
        # Runs of bodies that sit at a fixed stride: for PUB every command holds one
        # body, so all bodies in the buffer form one run; for MPUB each command is a run.
        if batch == 1:
            self._runs = [(first, self.length, copies)]
            self._per_cmd = True
        else:
            self._runs = [(first + c * self.length, 4 + size, batch) for c in range(copies)]
            self._per_cmd = False
        longest = max(copies, batch)
        self._fill = [memoryview(bytes([b]) * longest) for b in range(256)]

    def stamp(self, ncmds: int) -> None:
        """Write the current time (ns, big-endian) into the first 8 bytes of every body."""
        ts = _TS.pack(time.time_ns())
        view, fill = self.view, self._fill
        if self._per_cmd:
            runs = [(self._runs[0][0], self.length, ncmds)]
        else:
            runs = self._runs[:ncmds]
        for start, stride, n in runs:
            stop = start + stride * (n - 1) + 1
            for j in range(8):
                view[start + j : stop + j : stride] = fill[ts[j]][:n]


def publish(cfg: WriterConfig, ready: Any = None, start: Any = None) -> dict:
    """Run one publisher; returns counts, timing and per-command ack latencies.

    ``ready`` is called once connected and ``start`` waited on, so every process
    of a scenario begins at the same moment and connection set-up is not timed.
    """
    sock = wire.connect(cfg.address)
    pipeline = max(1, cfg.pipeline)
    batch = 1 if cfg.mode == "pub" else cfg.batch
    cmds = _Commands(cfg.topic, cfg.size, batch, cfg.mode, pipeline)
    full_left: float = _NEVER
    tail: _Commands | None = None
    if cfg.count is not None:
        full_left = cfg.count // batch
        if cfg.count % batch:
            tail = _Commands(cfg.topic, cfg.size, cfg.count % batch, cfg.mode, 1)
    _released(ready, start)

    t0 = time.monotonic()
    deadline = t0 + cfg.duration if cfg.count is None and cfg.duration else _NEVER
    outstanding: deque[tuple[int, int]] = deque()  # (send time ns, messages) per command
    ack_us = array("I")
    acked_msgs = 0
    acked_cmds = 0
    sendall = sock.sendall
    perf_ns = time.perf_counter_ns

    def send(k: int) -> None:
        nonlocal full_left, tail
        n_full = int(min(k, full_left))
        if n_full:
            cmds.stamp(n_full)
            t = perf_ns()
            sendall(cmds.view[: n_full * cmds.length])
            full_left -= n_full
            item = (t, batch)
            outstanding.extend([item] * n_full)
        if k > n_full and tail is not None:
            tail.stamp(1)
            outstanding.append((perf_ns(), tail.batch))
            sendall(tail.view)
            tail = None

    # Paced (cfg.rate): commands go out on schedule, at most `pipeline` unanswered.
    cmd_rate = cfg.rate / batch if cfg.rate else None
    paced = 0  # commands sent so far, when paced

    def more() -> bool:
        return cmd_rate is not None and bool(full_left or tail is not None)

    send(pipeline if cmd_rate is None else 0)
    rbuf = bytearray(1 << 16)
    rview = memoryview(rbuf)
    have = 0
    unpack = wire.HEADER.unpack_from
    t_last = t0
    while outstanding or (more() and time.monotonic() < deadline):
        if cmd_rate is not None:
            now = time.monotonic()
            wait = None
            if now < deadline and more() and len(outstanding) < pipeline:
                k = min(due_commands(now - t0, cmd_rate, paced), pipeline - len(outstanding))
                if k:
                    before = len(outstanding)
                    send(k)
                    paced += len(outstanding) - before
                if len(outstanding) < pipeline:
                    wait = max(0.0, t0 + paced / cmd_rate - time.monotonic())
            if not select.select([sock], [], [], wait)[0]:
                continue
        got = sock.recv_into(rview[have:])
        if not got:
            raise wire.ProtocolError("broker closed the connection")
        have += got
        pos = 0
        acks = 0
        while have - pos >= 8:
            size, ftype = unpack(rbuf, pos)
            end = pos + 4 + size
            if end > have:
                break
            if ftype == wire.FRAME_RESPONSE and size == 6 and rbuf[pos + 8 : end] == b"OK":
                acks += 1
            else:
                payload = bytes(rbuf[pos + 8 : end])
                if size < 4:
                    raise wire.ProtocolError(f"invalid frame size {size}")
                if ftype == wire.FRAME_RESPONSE and payload == wire.HEARTBEAT:
                    sendall(wire.NOP)
                elif ftype == wire.FRAME_ERROR:
                    raise wire.ProtocolError(f"broker error: {payload.decode(errors='replace')}")
                else:
                    raise wire.ProtocolError(f"unexpected frame type {ftype}: {payload[:100]!r}")
            pos = end
        if pos == have:
            have = 0
        elif pos:
            rbuf[: have - pos] = rbuf[pos:have]
            have -= pos
        if acks:
            now = perf_ns()
            popleft = outstanding.popleft
            for _ in range(acks):
                t_sent, n = popleft()
                ack_us.append((now - t_sent) // 1000)
                acked_msgs += n
            acked_cmds += acks
            t_last = time.monotonic()
            if cmd_rate is None and t_last < deadline and (full_left or tail is not None):
                send(acks)
    sock.close()
    return {
        "messages": acked_msgs,
        "commands": acked_cmds,
        "t_start": t0,
        "t_end": t_last,
        "ack_us": ack_us.tobytes(),
    }


def writer_main(index: int, cfg: WriterConfig, queue: Any, start: Any) -> None:
    """Publisher process: reports ("ready"|"result"|"error", "w<index>", data) on ``queue``."""
    _child(f"w{index}", f"writer {index}", queue, lambda ready: publish(cfg, ready, start))


def fill(
    address: tuple[str, int], topic: str, count: int, size: int = 200, batch: int = 100,
    pipeline: int = 4,
) -> dict:
    """Untimed set-up: exactly ``count`` messages by pipelined MPUBs, from this process.

    Returns ``publish``'s result; raises wire.ProtocolError if fewer were acked.
    """
    cfg = WriterConfig(address=address, topic=topic, size=size, batch=batch, mode="mpub",
                       pipeline=pipeline, duration=None, count=count)
    result = publish(cfg)
    if result["messages"] != count:
        raise wire.ProtocolError(f"published {result['messages']:,} of {count:,} messages")
    return result


def huge_publish(
    address: tuple[str, int], http_address: str | None, topic: str, count: int, text: bool
) -> bytes:
    """One batch of ``count`` one-byte messages; the broker's answer.

    A TCP MPUB (1,048,575 is the most a default max-body-size of 5 MiB holds)
    or, with ``text``, an HTTP text ``/mpub`` of ``count`` lines.
    """
    if text:
        host, port = wire.parse_address(http_address or "")
        conn = http.client.HTTPConnection(host, port, timeout=900)
        try:
            conn.request("POST", f"/mpub?topic={topic}", b"x\n" * count)
            return conn.getresponse().read()
        finally:
            conn.close()
    body = struct.pack(">i", count) + b"\x00\x00\x00\x01x" * count
    sock = wire.connect(address)
    try:
        wire.identify(sock, "big")
        sock.sendall(f"MPUB {topic}\n".encode() + wire.SIZE.pack(len(body)) + body)
        del body
        return wire.read_response(sock, "MPUB")
    finally:
        sock.close()


# -- consumers ---------------------------------------------------------------------------

_BUF_SIZE = 4 << 20
_CHECK_EVERY = 0.02  # seconds between stop-condition checks while data keeps flowing
_CLOSE_QUIET = 0.1  # after CLOSE_WAIT, FIN stragglers until the socket is quiet this long
_CLOSE_LIMIT = 5.0


@dataclass
class ReaderConfig:
    """What one consumer process does; picklable for the spawn start method.

    A reader stops at ``duration`` (if set), when all readers together have
    consumed ``expected`` messages (if set), or after ``idle_timeout`` seconds
    without a message (if set) -- the last one ends a drain of a backlog whose
    size is unknown.
    """

    address: tuple[str, int]
    topic: str
    channel: str
    rdy: int = 2500
    duration: float | None = 10.0
    expected: int | None = None
    idle_timeout: float | None = None
    sample_every: int = 100
    client_id: str = "bench"
    # IDENTIFY's output_buffer_timeout in ms (-1: output buffering off, 0: the broker's
    # default); None leaves the field out, so the broker's default applies.
    output_buffer_timeout: int | None = None

    def identify_fields(self) -> dict[str, Any]:
        """What this reader's IDENTIFY adds to the bench client's usual fields."""
        if self.output_buffer_timeout is None:
            return {}
        return {"output_buffer_timeout": self.output_buffer_timeout}


def _scan(
    buf: bytearray, end: int, fins: list, lat: array, countdown: int, every: int
) -> tuple[int, int, int, list | None]:
    """Parse complete frames in ``buf[:end]``.

    Returns (bytes consumed, messages seen, sampling countdown, non-message
    frames). Message ids go straight into ``fins``; every ``every``-th message
    with a body of at least 8 bytes contributes a publish-to-deliver latency.
    Kept as one flat loop with bound locals: it runs once per message.
    """
    unpack = wire.HEADER.unpack_from
    unpack_ts = _TS.unpack_from
    append = fins.append
    now_ns = time.time_ns
    pos = 0
    n = 0
    others = None
    while end - pos >= 8:
        size, ftype = unpack(buf, pos)
        stop = pos + 4 + size
        if stop > end:
            break
        if ftype == 2 and size >= 30:
            append(buf[pos + 18 : pos + 34])
            n += 1
            countdown -= 1
            if not countdown:
                countdown = every
                if size >= 38:
                    lat.append(now_ns() - unpack_ts(buf, pos + 34)[0])
        else:
            if size < 4 or ftype == 2:
                raise wire.ProtocolError(f"invalid frame (size {size}, type {ftype})")
            if others is None:
                others = []
            others.append((ftype, bytes(buf[pos + 8 : stop])))
        pos = stop
    return pos, n, countdown, others


def consume(
    cfg: ReaderConfig,
    index: int = 0,
    progress: Any = None,
    ready: Any = None,
    start: Any = None,
) -> dict:
    """Run one consumer; returns counts, timing and sampled latencies (ns).

    ``progress`` is an optional shared array with one slot per reader: each
    reader stores its own count (no lock needed) and sums all slots to know when
    the readers together reached ``expected``.
    """
    sock = wire.connect(cfg.address)
    answer = wire.identify(sock, cfg.client_id, cfg.identify_fields())
    rdy = cfg.rdy
    max_rdy = answer.get("max_rdy_count")
    if isinstance(max_rdy, int) and 0 < max_rdy < rdy:
        rdy = max_rdy
    sock.sendall(f"SUB {cfg.topic} {cfg.channel}\n".encode())
    wire.expect(sock, b"OK", "SUB")
    _released(ready, start)

    t0 = time.monotonic()
    sock.sendall(b"RDY %d\n" % rdy)
    deadline = t0 + cfg.duration if cfg.duration else _NEVER
    expected = cfg.expected
    idle = cfg.idle_timeout or _NEVER
    every = max(1, cfg.sample_every)

    buf = bytearray(_BUF_SIZE)
    view = memoryview(buf)
    have = 0
    fins: list = []
    flush_at = max(1, rdy * 3 // 4)
    lat = array("q")
    countdown = every
    count = 0
    fin_errors = 0
    t_last = t0
    sendall = sock.sendall
    recv_into = sock.recv_into
    dontwait = socket.MSG_DONTWAIT
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)

    def flush() -> None:
        sendall(b"FIN " + b"\nFIN ".join(fins) + b"\n")
        fins.clear()

    def handle(others: list) -> int:
        errors = 0
        for ftype, payload in others:
            if ftype == wire.FRAME_RESPONSE and payload == wire.HEARTBEAT:
                sendall(wire.NOP)
            elif ftype == wire.FRAME_ERROR and payload.startswith(b"E_FIN_FAILED"):
                errors += 1  # non-fatal in nsqd; counted so a broker bug shows up
            elif ftype == wire.FRAME_ERROR:
                raise wire.ProtocolError(f"broker error: {payload.decode(errors='replace')}")
            elif payload != b"CLOSE_WAIT":
                raise wire.ProtocolError(f"unexpected response {payload[:100]!r}")
        return errors

    def should_stop(now: float) -> bool:
        if now >= deadline or now - t_last >= idle:
            return True
        if expected is not None:
            done = sum(progress) if progress is not None else count
            return done >= expected
        return False

    next_check = t0 + _CHECK_EVERY
    while True:
        try:
            got = recv_into(view[have:], 0, dontwait)
        except BlockingIOError:
            # Nothing buffered: give the broker its window back before blocking.
            if fins:
                flush()
            if should_stop(time.monotonic()):
                break
            if not poller.poll(50):
                continue
            got = recv_into(view[have:])
        if not got:
            raise wire.ProtocolError("broker closed the connection")
        have += got
        pos, n, countdown, others = _scan(buf, have, fins, lat, countdown, every)
        if others:
            fin_errors += handle(others)
        if pos == have:
            have = 0
        elif pos:
            buf[: have - pos] = buf[pos:have]
            have -= pos
        if have == len(buf):  # one frame larger than the buffer: grow it
            view.release()
            buf.extend(bytes(len(buf)))
            view = memoryview(buf)
        now = time.monotonic()
        if n:
            count += n
            t_last = now
            if progress is not None:
                progress[index] = count
        if len(fins) >= flush_at:
            flush()
        if now >= next_check:
            next_check = now + _CHECK_EVERY
            if should_stop(now):
                break

    # Clean shutdown: CLS, then FIN whatever was already in flight so the broker
    # does not have to time those messages out (they count as consumed, not timed).
    if fins:
        flush()
    sendall(b"CLS\n")
    late = 0
    closed = False
    limit = time.monotonic() + _CLOSE_LIMIT
    while time.monotonic() < limit:
        if not poller.poll(int(_CLOSE_QUIET * 1000) if closed else 200):
            if closed:
                break
            continue
        got = recv_into(view[have:])
        if not got:
            break
        have += got
        pos, n, countdown, others = _scan(buf, have, fins, lat, countdown, every)
        late += n
        if others:
            closed = closed or any(p == b"CLOSE_WAIT" for t, p in others if t == 0)
            fin_errors += handle(others)
        if pos == have:
            have = 0
        elif pos:
            buf[: have - pos] = buf[pos:have]
            have -= pos
        if fins:
            flush()
    if progress is not None:
        progress[index] = count + late
    sock.close()
    return {
        "messages": count,
        "late": late,
        "t_start": t0,
        "t_end": t_last,
        "latency_ns": lat.tobytes(),
        "fin_errors": fin_errors,
        "rdy": rdy,
        "closed": closed,
        "output_buffer_timeout": answer.get("output_buffer_timeout"),  # as the broker settled it
    }


def reader_main(index: int, cfg: ReaderConfig, queue: Any, start: Any, progress: Any) -> None:
    """Consumer process: reports ("ready"|"result"|"error", "r<index>", data) on ``queue``."""
    _child(f"r{index}", f"reader {index}", queue,
           lambda ready: consume(cfg, index, progress, ready=ready, start=start))
