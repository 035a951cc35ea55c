"""txnsq: a Twisted-native NSQ client (go-nsq's model), shipped with mqd.

It lives inside the `mqd` package rather than as a top-level `txnsq`
because it shares the broker's codecs (snappy, deflate), frame constants
and name rules: one implementation of each, checked against the broker's
own tests. It speaks only NSQ's protocol and works against any nsqd.
"""

from mqd.client.config import Config
from mqd.client.consumer import Consumer
from mqd.client.errors import (
    AuthRefusedError,
    ClientConfigError,
    ConnectionClosed,
    HandshakeRefusedError,
    HeartbeatTimeout,
    NSQError,
    ProducerFullError,
    ServerProtocolError,
    StoppedError,
)
from mqd.client.message import Message
from mqd.client.producer import Producer

__all__ = [
    "AuthRefusedError",
    "ClientConfigError",
    "Config",
    "ConnectionClosed",
    "Consumer",
    "HandshakeRefusedError",
    "HeartbeatTimeout",
    "Message",
    "NSQError",
    "Producer",
    "ProducerFullError",
    "ServerProtocolError",
    "StoppedError",
]
