"""The rows of a topic read as a stream: the channel mode's columns, and the offset mode's with `offset`.

Kept apart from the readers so that a module needing only the schema
(the offset fetcher, imported in every query's driver source process and
in every executor) does not bring in the NSQ client and Twisted.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = ["ARROW_STREAM_SCHEMA", "OFFSET_ARROW_SCHEMA", "OFFSET_SCHEMA_DDL", "STREAM_SCHEMA_DDL"]

STREAM_SCHEMA_DDL = ("topic string, channel string, message_id string, timestamp timestamp, "
                     "attempts int, body binary, nsqd string")
ARROW_STREAM_SCHEMA = pa.schema([
    pa.field("topic", pa.string()),
    pa.field("channel", pa.string()),  # null in the offset mode: no channel is involved
    pa.field("message_id", pa.string()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
    pa.field("attempts", pa.int32()),
    pa.field("body", pa.binary()),
    pa.field("nsqd", pa.string()),
])
OFFSET_SCHEMA_DDL = STREAM_SCHEMA_DDL + ", offset long"
OFFSET_ARROW_SCHEMA = ARROW_STREAM_SCHEMA.append(pa.field("offset", pa.int64()))
