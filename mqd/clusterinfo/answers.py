"""The Go types nsqadmin 1.3.0 decodes each broker's and lookupd's answer into.

mqadmin reads an answer as nsqadmin would (`mqd.wire.go_json.check_go`),
so an answer of the wrong shape is the error nsqadmin reports for it,
word for word (`json: cannot unmarshal string into Go struct field
respType.topics of type []string`), and never reaches the code that sums
the figures. Names and types are nsqadmin's (its clusterinfo package),
down to the local types its own UnmarshalJSON methods decode into; only
the fields a broker or lookupd sends are listed, as nsqadmin ignores the
rest of a document too. Go's field names (the second of each triple) are
printed only in an unnamed struct's type; in the named ones they are
there for reading.
"""

from __future__ import annotations

from mqd.wire.go_json import BOOL, FLOAT64, INT, INT32, INT64, STRING, GoType

__all__ = ["LOOKUPD_CHANNELS", "LOOKUPD_LOOKUP", "LOOKUPD_LOOKUP_WITH_CHANNELS", "LOOKUPD_NODES",
           "LOOKUPD_TOPICS", "NSQD_INFO", "NSQD_STATS", "NSQD_STATS_TOPICS", "NSQD_TOPICS"]

_PACKAGE = "clusterinfo"


def _struct(*fields: tuple[str, str, GoType], name: str = "") -> GoType:
    return GoType("struct", fields=fields, name=name, package=_PACKAGE if name else "")


def _slice(elem: GoType, name: str = "") -> GoType:
    return GoType("slice", elem, name=name, package=_PACKAGE if name else "")


def _pointer(elem: GoType) -> GoType:
    return GoType("ptr", elem)


def _custom(inner: GoType, name: str, package: str = _PACKAGE) -> GoType:
    return GoType("custom", inner, name=name, package=package)


# A broker's /stats read for its topic names only (GetNSQDTopics, GetNSQDProducers).
_TOPIC_NAMES = ("topics", "Topics", _slice(_struct(("topic_name", "Name", STRING))))
NSQD_TOPICS = _struct(_TOPIC_NAMES, name="respType")
NSQD_STATS_TOPICS = _struct(_TOPIC_NAMES, name="statsRespType")

NSQD_INFO = _struct(
    ("version", "Version", STRING),
    ("broadcast_address", "BroadcastAddress", STRING),
    ("hostname", "Hostname", STRING),
    ("http_port", "HTTPPort", INT),
    ("tcp_port", "TCPPort", INT),
    name="infoRespType",
)

# E2eProcessingLatencyAggregate decodes itself into an unnamed struct.
_E2E = _custom(_struct(
    ("count", "Count", INT),
    ("percentiles", "Percentiles", _slice(GoType("map", FLOAT64))),
    ("topic", "Topic", STRING),
    ("channel", "Channel", STRING),
    ("host", "Addr", STRING),
), name="E2eProcessingLatencyAggregate", package="quantile")

# ClientStats decodes itself into a local copy of its type, locaClientStats.
_CLIENT = _custom(_struct(
    ("client_id", "ClientID", STRING),
    ("hostname", "Hostname", STRING),
    ("version", "Version", STRING),
    ("remote_address", "RemoteAddress", STRING),
    ("ready_count", "ReadyCount", INT),
    ("in_flight_count", "InFlightCount", INT),
    ("message_count", "MessageCount", INT64),
    ("finish_count", "FinishCount", INT64),
    ("requeue_count", "RequeueCount", INT64),
    ("connect_ts", "ConnectTs", INT64),
    ("sample_rate", "SampleRate", INT32),
    ("deflate", "Deflate", BOOL),
    ("snappy", "Snappy", BOOL),
    ("user_agent", "UserAgent", STRING),
    ("authed", "Authed", BOOL),
    ("auth_identity", "AuthIdentity", STRING),
    ("auth_identity_url", "AuthIdentityURL", STRING),
    ("tls", "TLS", BOOL),
    ("tls_cipher_suite", "CipherSuite", STRING),
    ("tls_version", "TLSVersion", STRING),
    ("tls_negotiated_protocol", "NegotiatedProtocol", STRING),
    ("tls_negotiated_protocol_is_mutual", "NegotiatedProtocolIsMutual", BOOL),
    name="locaClientStats",
), name="ClientStats")

_CHANNEL = _struct(
    ("channel_name", "ChannelName", STRING),
    ("depth", "Depth", INT64),
    ("backend_depth", "BackendDepth", INT64),
    ("in_flight_count", "InFlightCount", INT64),
    ("deferred_count", "DeferredCount", INT64),
    ("message_count", "MessageCount", INT64),
    ("requeue_count", "RequeueCount", INT64),
    ("timeout_count", "TimeoutCount", INT64),
    ("client_count", "ClientCount", INT),
    ("clients", "Clients", _slice(_pointer(_CLIENT))),
    ("paused", "Paused", BOOL),
    ("e2e_processing_latency", "E2eProcessingLatency", _pointer(_E2E)),
    name="ChannelStats",
)

_TOPIC = _struct(
    ("topic_name", "TopicName", STRING),
    ("channels", "Channels", _slice(_pointer(_CHANNEL))),
    ("depth", "Depth", INT64),
    ("backend_depth", "BackendDepth", INT64),
    ("message_count", "MessageCount", INT64),
    ("paused", "Paused", BOOL),
    ("e2e_processing_latency", "E2eProcessingLatency", _pointer(_E2E)),
    name="TopicStats",
)

# A broker's /stats as GetNSQDStats reads it: the figures behind every page.
NSQD_STATS = _struct(("topics", "Topics", _slice(_pointer(_TOPIC))), name="respType")

LOOKUPD_TOPICS = _struct(("topics", "Topics", _slice(STRING)), name="respType")
LOOKUPD_CHANNELS = _struct(("channels", "Channels", _slice(STRING)), name="respType")

# Producer decodes itself into an unnamed struct.
_PRODUCER = _pointer(_custom(_struct(
    ("remote_address", "RemoteAddress", STRING),
    ("hostname", "Hostname", STRING),
    ("broadcast_address", "BroadcastAddress", STRING),
    ("tcp_port", "TCPPort", INT),
    ("http_port", "HTTPPort", INT),
    ("version", "Version", STRING),
    ("topics", "Topics", _slice(STRING)),
    ("tombstones", "Tombstoned", _slice(BOOL)),
), name="Producer"))

LOOKUPD_NODES = _struct(("producers", "Producers", _slice(_PRODUCER)), name="respType")
LOOKUPD_LOOKUP = _struct(("producers", "Producers", _slice(_PRODUCER, name="Producers")), name="respType")
# mqadmin's own lookupd page also lists each topic's channels from /lookup (nsqadmin has no such page).
LOOKUPD_LOOKUP_WITH_CHANNELS = _struct(*LOOKUPD_LOOKUP.fields, ("channels", "Channels", _slice(STRING)),
                                       name="respType")
