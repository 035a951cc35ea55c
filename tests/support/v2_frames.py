"""The V2 protocol's bytes without a broker: the commands a client sends, the frames it reads.

`parse_frames` splits what a broker wrote into `Frame`s (responses and
errors) and `Msg`s, and fails on a partial frame; `cmd`, `pub`, `mpub`,
`identify` ... build the commands.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass

MAGIC = b"  V2"
RESPONSE, ERROR, MESSAGE = 0, 1, 2

_INT32 = struct.Struct(">i")


@dataclass(frozen=True)
class Frame:
    """A response (type 0) or error (type 1) frame."""

    type: int
    payload: bytes


@dataclass(frozen=True)
class Msg:
    """A message frame (type 2), decoded."""

    timestamp: int
    attempts: int
    id: bytes
    body: bytes


def ok() -> Frame:
    return Frame(RESPONSE, b"OK")


def err(text: str | bytes) -> Frame:
    return Frame(ERROR, text if isinstance(text, bytes) else text.encode())


HEARTBEAT = Frame(RESPONSE, b"_heartbeat_")
CLOSE_WAIT = Frame(RESPONSE, b"CLOSE_WAIT")


def parse_frames(data: bytes) -> list[Frame | Msg]:
    """Split what the broker wrote into frames; fails on a partial frame."""
    frames: list[Frame | Msg] = []
    pos = 0
    while pos < len(data):
        assert len(data) - pos >= 8, f"partial frame header at {pos}: {data[pos:]!r}"
        size, ftype = struct.unpack_from(">ii", data, pos)
        assert size >= 4, f"bad frame size {size} at {pos}"
        end = pos + 4 + size
        assert end <= len(data), f"partial frame at {pos}: needs {end}, have {len(data)}"
        payload = data[pos + 8 : end]
        if ftype == MESSAGE:
            assert len(payload) >= 26, f"message frame too short: {payload!r}"
            ts, attempts = struct.unpack_from(">qH", payload)
            frames.append(Msg(ts, attempts, payload[10:26], payload[26:]))
        else:
            assert ftype in (RESPONSE, ERROR), f"unknown frame type {ftype}"
            frames.append(Frame(ftype, payload))
        pos = end
    return frames


def _word(w) -> bytes:
    return w if isinstance(w, bytes) else str(w).encode()


def cmd(*words) -> bytes:
    """One command line: words joined by single spaces, ending in '\\n'."""
    return b" ".join(_word(w) for w in words) + b"\n"


def sized(data: bytes) -> bytes:
    """A body with its 4-byte big-endian size in front."""
    return _INT32.pack(len(data)) + data


def pub(topic, body: bytes) -> bytes:
    return cmd("PUB", topic) + sized(body)


def dpub(topic, ms, body: bytes) -> bytes:
    return cmd("DPUB", topic, ms) + sized(body)


def mpub_body(bodies: Iterable[bytes]) -> bytes:
    bodies = list(bodies)
    return _INT32.pack(len(bodies)) + b"".join(sized(b) for b in bodies)


def mpub(topic, bodies: list[bytes]) -> bytes:
    return cmd("MPUB", topic) + sized(mpub_body(bodies))


def identify(**fields) -> bytes:
    return cmd("IDENTIFY") + sized(json.dumps(fields).encode())
