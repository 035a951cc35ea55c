"""Consumer processes: IDENTIFY, SUB, RDY, then FIN every message as cheaply as possible.

Mirrors NSQ's bench_reader: FINs are batched and flushed once 75% of the RDY
window has arrived since the last flush, and also whenever the socket has
nothing more to read (just before the process would block), so the broker's
in-flight window never stalls waiting for us. Frames are parsed in place in a
large receive buffer; per message the only allocation is the 16-byte id slice
needed for the FIN.
"""

from __future__ import annotations

import select
import socket
import struct
import time
import traceback
from array import array
from dataclasses import dataclass
from typing import Any

from bench import wire

_TS = struct.Struct(">q")
_NEVER = float("inf")
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
    answer = wire.identify(sock, cfg.client_id)
    rdy = cfg.rdy
    max_rdy = answer.get("max_rdy_count")
    if isinstance(max_rdy, int) and 0 < max_rdy < rdy:
        rdy = max_rdy
    sock.sendall(f"SUB {cfg.topic} {cfg.channel}\n".encode())
    wire.expect(sock, b"OK", "SUB")
    if ready is not None:
        ready()
    if start is not None:
        start.wait()

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
    }


def reader_main(index: int, cfg: ReaderConfig, queue: Any, start: Any, progress: Any) -> None:
    """Process entry point: report ("ready"|"result"|"error", "r<index>", data) on ``queue``."""
    try:
        result = consume(
            cfg, index, progress, ready=lambda: queue.put(("ready", f"r{index}", None)), start=start
        )
    except (OSError, wire.ProtocolError, ValueError) as exc:
        queue.put(("error", f"r{index}", f"reader {index}: {exc}"))
        raise SystemExit(1) from None
    except Exception:  # noqa: BLE001 -- any crash must reach the parent, not hang it
        queue.put(("error", f"r{index}", f"reader {index}: {traceback.format_exc()}"))
        raise SystemExit(1) from None
    queue.put(("result", f"r{index}", result))
