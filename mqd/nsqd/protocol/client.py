"""A V2 connection's client record: what nsqd's clientV2 keeps for /stats and for its channel.

The state, the RDY count and the counts /stats shows, the settings IDENTIFY
negotiated and what TLS and compression set up. Each changes only through
a method of the record, named after nsqd's client_v2.go methods where it
has one: the protocol calls those for the connection's life and commands
(connected, identified, subscribed, ...), the channel (through the
protocol, its IConsumer) for the counts of the messages it hands out and
gets back (sending_messages, finished_messages, requeued_message,
timed_out_messages, in_flight_cleared). Everything else reads the fields.
"""

from __future__ import annotations

from mqd.nsqd.protocol.identify import Negotiated

__all__ = [
    "CLIENT_TIMEOUT",
    "ClientV2",
    "DEFAULT_OUTPUT_BUFFER_SIZE",
    "STATE_CLOSING",
    "STATE_INIT",
    "STATE_SUBSCRIBED",
]

# nsqd's numeric client states, as /stats reports them.
STATE_INIT = 0
STATE_SUBSCRIBED = 3
STATE_CLOSING = 4

# nsqd's fixed client timeout (not a flag): heartbeats default to half of it.
CLIENT_TIMEOUT = 60.0
DEFAULT_OUTPUT_BUFFER_SIZE = 16 * 1024


class ClientV2:
    """One V2 connection's state, counts and negotiated settings."""

    __slots__ = (
        "id",
        "state",
        "client_id",
        "hostname",
        "user_agent",
        "topology_region",
        "topology_zone",
        "remote_address",
        "remote_ip",
        "connect_ts",
        "heartbeat_interval",
        "msg_timeout",
        "output_buffer_size",
        "output_buffer_timeout",
        "sample_rate",
        "deflate",
        "deflate_level",
        "snappy",
        "tls",
        "tls_version",
        "tls_cipher_suite",
        "tls_common_name",
        "ready_count",
        "in_flight_count",
        "message_count",
        "finish_count",
        "requeue_count",
        "pub_counts",
    )

    def __init__(self, client_number: int, msg_timeout: float, output_buffer_timeout: float) -> None:
        """The record of connection `client_number`, with the broker's defaults for what IDENTIFY may change."""
        self.id = client_number
        self.state = STATE_INIT
        self.client_id = ""
        self.hostname = ""
        self.user_agent = ""
        self.topology_region = ""  # IDENTIFY's, shown by /stats when set
        self.topology_zone = ""
        self.remote_address = ""
        self.remote_ip = ""  # what the auth server is told; "" for a unix socket peer
        self.connect_ts = 0
        self.heartbeat_interval = CLIENT_TIMEOUT / 2
        self.msg_timeout = msg_timeout
        self.output_buffer_size = DEFAULT_OUTPUT_BUFFER_SIZE
        self.output_buffer_timeout = output_buffer_timeout
        self.sample_rate = 0
        self.deflate = False
        self.deflate_level = 0
        self.snappy = False
        self.tls = False
        self.tls_version = ""
        self.tls_cipher_suite = ""
        self.tls_common_name = ""
        self.ready_count = 0
        self.in_flight_count = 0
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.pub_counts: dict[str, int] = {}

    # -- the connection's life ---------------------------------------------------

    def connected(self, remote_address: str, host: str, remote_ip: str, now: float) -> None:
        """The peer's address; client_id and hostname are its host until IDENTIFY names them."""
        self.remote_address = remote_address
        self.remote_ip = remote_ip
        self.client_id = self.hostname = host
        self.connect_ts = int(now)

    def identified(self, settled: Negotiated) -> None:
        """Take the settings IDENTIFY negotiated."""
        self.client_id = settled.client_id
        self.hostname = settled.hostname
        self.user_agent = settled.user_agent
        self.topology_region = settled.topology_region
        self.topology_zone = settled.topology_zone
        self.heartbeat_interval = settled.heartbeat_interval
        self.output_buffer_size = settled.output_buffer_size
        self.output_buffer_timeout = settled.output_buffer_timeout
        self.sample_rate = settled.sample_rate
        self.msg_timeout = settled.msg_timeout
        if settled.deflate_level is not None:
            self.deflate_level = settled.deflate_level

    def subscribed(self) -> None:
        self.state = STATE_SUBSCRIBED

    def set_ready(self, count: int) -> None:
        """RDY: how many messages the client may have in flight (nsqd's SetReadyCount)."""
        self.ready_count = count

    def closing(self) -> None:
        """CLS: ready for nothing more, closing once what is in flight is answered (nsqd's StartClose)."""
        self.ready_count = 0
        self.state = STATE_CLOSING

    def tls_started(self) -> None:
        self.tls = True

    def tls_established(self, version: str, cipher_suite: str, common_name: str) -> None:
        """The TLS handshake is done: what /stats shows of it, and the name the auth server is told."""
        self.tls_version = version
        self.tls_cipher_suite = cipher_suite
        self.tls_common_name = common_name

    def compressed(self, snappy: bool) -> None:
        """Compression is on: snappy, else deflate."""
        self.snappy = snappy
        self.deflate = not snappy

    # -- counts ------------------------------------------------------------------

    def published(self, topic_name: str, count: int) -> None:
        """`count` messages this connection published to `topic_name` (nsqd's PublishedMessage)."""
        counts = self.pub_counts
        counts[topic_name] = counts.get(topic_name, 0) + count

    def sending_messages(self, count: int) -> None:
        """The channel hands the client `count` messages (nsqd's SendingMessage, per batch)."""
        self.in_flight_count += count
        self.message_count += count

    def finished_messages(self, count: int) -> None:
        """The client FINished `count` of its messages (nsqd's FinishedMessage, per run)."""
        self.in_flight_count -= count
        self.finish_count += count

    def requeued_message(self) -> None:
        """The client REQueued one of its messages (nsqd's RequeuedMessage)."""
        self.in_flight_count -= 1
        self.requeue_count += 1

    def timed_out_messages(self, count: int) -> None:
        """`count` of the client's messages went back to the channel unanswered (nsqd's TimedOutMessage)."""
        self.in_flight_count -= count

    def in_flight_cleared(self) -> None:
        """The channel was emptied: nothing is in flight any more (nsqd's Empty)."""
        self.in_flight_count = 0
