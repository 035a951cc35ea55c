"""How mqd lays its queues out in LMDB: the environment, the keys and the records.

One `messages` database holds every queue, keyed by a 4-byte queue id and
an 8-byte sequence number, big-endian, so each queue is a contiguous,
ordered key range; a `queues` registry maps names to ids and a `meta`
database marks the environment as mqd's. The store, its queues and the
snapshot readers (the broker's snapshot format, the Spark bridge) all
read and write through these definitions.

A topic's retained log (backends.lmdb_retained) is one more key range of
`messages`: registered as "<topic>/log" (a name no queue can have, as `/`
is not a legal topic character), one record per batch of records keyed
by the batch's first offset, each what `encode_record` makes of the
batch's pseudo message (backends.lmdb_batches). Its epoch and offset
floor are in `meta` under `RETAINED_META` + the topic's name.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from mqd.message import Message

if TYPE_CHECKING:
    import lmdb

__all__ = ["ENV_DIR", "EPOCH", "FORMAT", "KEY", "LOG_EPOCH", "LOG_SUFFIX", "OUR_DBS", "QID", "RECORD",
           "RECORD_HEAD", "RECORD_SIZE", "RETAINED", "RETAINED_META", "decode_record", "drop_range",
           "encode_record", "is_log_name", "record_seq"]

ENV_DIR = "mqd.lmdb"
FORMAT = b"mqd-queues-1"
OUR_DBS = {b"meta", b"queues", b"messages"}
# The meta key of the last publish-log chunk (backends.lmdb_log) LMDB holds, as EPOCH.
LOG_EPOCH = b"log-epoch"
EPOCH = struct.Struct(">Q")

KEY = struct.Struct(">IQ")
QID = struct.Struct(">I")
# timestamp (ns), attempts, deferred_until (reactor seconds, 0 = due), id; then the body.
RECORD = struct.Struct(">qHd16s")
RECORD_SIZE = RECORD.size
# RECORD up to the id: the id and body follow as a message holds them (Message.data).
RECORD_HEAD = struct.Struct(">qHd")

# A retained log's registry name is its topic's with this suffix.
LOG_SUFFIX = "/log"
# The meta key of a retained log (followed by the topic's name): its epoch,
# and the offset floor, its earliest record (no offset below it is given
# again, nor served, even from a batch stored whole), as RETAINED.
RETAINED_META = b"retained:"
RETAINED = struct.Struct(">QQ")


def is_log_name(name: str) -> bool:
    """Whether a registry name is a retained log's, not a queue's: a snapshot or the broker skips those."""
    return name.endswith(LOG_SUFFIX)


def encode_record(msg: Message) -> bytes:
    # attempts is nsqd's uint16, which wraps: a record must never fail to pack,
    # or every later commit of the whole store would fail with it.
    return RECORD_HEAD.pack(msg.timestamp, msg.attempts & 0xFFFF, msg.deferred_until) + msg.data


def decode_record(key: bytes, value: bytes) -> Message:
    timestamp, attempts, deferred_until = RECORD_HEAD.unpack_from(value)
    msg = Message.of(value[RECORD_HEAD.size:], timestamp, attempts, deferred_until)
    msg.key = key
    return msg


def record_seq(msg: Message) -> int:
    """The sequence number of a message's record (-1 for one finished, whose key is gone)."""
    return KEY.unpack(msg.key)[1] if msg.key is not None else -1


def drop_range(txn: lmdb.Transaction[bytes], qid: int, bound: int) -> None:
    """Delete the queue's records below sequence `bound` (an emptied queue)."""
    cursor = txn.cursor()
    # Keys are fixed-length, so every key in [qid, (qid, bound)) is the queue's.
    stop = KEY.pack(qid, bound)
    if cursor.set_range(QID.pack(qid)):
        while cursor.key() < stop:
            if not cursor.delete():  # False once past the last record
                break
