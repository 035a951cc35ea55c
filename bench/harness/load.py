"""Publisher processes: pre-built PUB/MPUB frames sent as fast as the broker acks them.

Each process owns one connection, like NSQ's bench_writer (one per core). All
frames are built once; per command only the 8-byte send timestamp at the start
of each body is patched, so the generator costs a few microseconds per batch
and the broker stays the bottleneck.
"""

from __future__ import annotations

import math
import select
import struct
import time
import traceback
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

from bench import wire

_TS = struct.Struct(">q")
_NEVER = float("inf")


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
    if ready is not None:
        ready()
    if start is not None:
        start.wait()

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
    """Process entry point: report ("ready"|"result"|"error", "w<index>", data) on ``queue``."""
    try:
        result = publish(cfg, ready=lambda: queue.put(("ready", f"w{index}", None)), start=start)
    except (OSError, wire.ProtocolError, ValueError) as exc:
        queue.put(("error", f"w{index}", f"writer {index}: {exc}"))
        raise SystemExit(1) from None
    except Exception:  # noqa: BLE001 -- any crash must reach the parent, not hang it
        queue.put(("error", f"w{index}", f"writer {index}: {traceback.format_exc()}"))
        raise SystemExit(1) from None
    queue.put(("result", f"w{index}", result))
