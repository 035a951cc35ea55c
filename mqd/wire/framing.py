"""Frames nsqd sends: [4-byte size][4-byte type][payload], size counting type + payload."""

from __future__ import annotations

import struct

__all__ = [
    "MAGIC_V1",
    "MAGIC_V2",
    "FRAME_TYPE_RESPONSE",
    "FRAME_TYPE_ERROR",
    "FRAME_TYPE_MESSAGE",
    "frame",
    "OK",
    "HEARTBEAT",
    "CLOSE_WAIT",
    "INT32",
]

# The four bytes a connection opens with: V2 to nsqd (clients), V1 to
# nsqlookupd (brokers registering).
MAGIC_V1 = b"  V1"
MAGIC_V2 = b"  V2"

FRAME_TYPE_RESPONSE = 0
FRAME_TYPE_ERROR = 1
FRAME_TYPE_MESSAGE = 2

_FRAME_HEADER = struct.Struct(">ii")
INT32 = struct.Struct(">i")


def frame(frame_type: int, payload: bytes) -> bytes:
    return _FRAME_HEADER.pack(len(payload) + 4, frame_type) + payload


OK = frame(FRAME_TYPE_RESPONSE, b"OK")
HEARTBEAT = frame(FRAME_TYPE_RESPONSE, b"_heartbeat_")
CLOSE_WAIT = frame(FRAME_TYPE_RESPONSE, b"CLOSE_WAIT")
