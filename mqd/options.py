"""The option table: every setting's name, type and NSQ default, and how they resolve.

One table serves the command line, the YAML file and the defaults, so a
setting has one name everywhere (nsqd's own: `mem-queue-size`), and the
precedence is nsqd's: flag > config file > default. Values are checked
once, here, and any problem is reported as one line naming where it came
from (the flag, or the file and key) and what is wrong.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from mqd.latency import parse_percentiles
from mqd.message import default_node_id

__all__ = [
    "ConfigError",
    "check_http_auth",
    "check_retention",
    "http_client_auth_secret",
    "Option",
    "Settings",
    "parse_duration",
    "parse_size",
    "resolve",
    "to_endpoint",
    "wildcard_port",
    "MQD_OPTIONS",
    "LOOKUPD_OPTIONS",
    "MQADMIN_OPTIONS",
]


class ConfigError(Exception):
    """A configuration problem, worded for the operator who has to fix it."""


# -- value parsers -----------------------------------------------------------

# Go's units; micro as U+00B5 or U+03BC, both of which Go accepts.
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                   "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_duration(value: Any) -> float:
    """Go's duration syntax ('250ms', '1m30s', '1h'), as nsqd's flags take it, in seconds."""
    if isinstance(value, bool):
        raise ValueError(f'expected a duration like "60s" or "250ms", got {value!r}')
    if value == 0 or value == "0":
        return 0.0
    if not isinstance(value, str) or not value:
        raise ValueError(f'expected a duration like "60s" or "250ms", got {value!r}')
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    if text[:1] in ("+", "-"):
        text = text[1:]  # one sign, as Go: "--1s" is malformed
    if not text:
        raise ValueError(f'expected a duration like "60s" or "250ms", got {value!r}')
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if m is None:
            raise ValueError(f'expected a duration like "60s" or "250ms", got {value!r}')
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    return sign * total


# A byte size's units: decimal (KB = 1000) and binary (KiB = 1024), as disks and memory are counted.
_SIZE_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"(\d{1,19})\s*([A-Za-z]{0,3})")


def parse_size(value: Any) -> int:
    """A byte count: a plain integer, or one with a unit (`10GB`, `512MiB`: KB..TB are 1000s, KiB..TiB 1024s).

    Units are case-insensitive; no fractions and no sign, as a size is
    never negative.
    """
    if isinstance(value, bool):
        raise ValueError(f'expected a size like "10GB" or "512MiB", got {value!r}')
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a size of at least 0, got {value!r}")
        return value
    if isinstance(value, str):
        m = _SIZE.fullmatch(value.strip())
        if m is not None:
            unit = _SIZE_UNITS.get(m.group(2).upper())
            if unit is not None:
                return int(m.group(1)) * unit
    raise ValueError(f'expected a size like "10GB" or "512MiB", got {value!r}')


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value)
    raise ValueError(f"expected an integer, got {value!r}")


def _parse_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {value!r}") from None


_TRUE = {"1", "t", "true", "yes", "on"}
_FALSE = {"0", "f", "false", "no", "off"}


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


def _parse_str(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"expected a string, got {value!r}")


def _parse_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"expected a list of strings, got {value!r}")


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "int": _parse_int,
    "float": _parse_float,
    "bool": _parse_bool,
    "str": _parse_str,
    "duration": parse_duration,
    "list": _parse_list,
}


# -- listening addresses -----------------------------------------------------

_ENDPOINT_TYPES = ("tcp", "tcp6", "unix", "ssl", "systemd", "tls")
_HOST_PORT = re.compile(r"^(\[[^\]]*\]|[^:\[\]]*):(\d+)$")


def to_endpoint(address: str) -> str:
    """A Twisted server endpoint string for an address in nsqd's or Twisted's form.

    nsqd takes `host:port` (an empty host or 0.0.0.0 meaning every
    interface) or a filesystem path for a unix socket; anything that
    already names an endpoint type (`tcp:4150:interface=...`) passes as is.
    """
    if address.split(":", 1)[0] in _ENDPOINT_TYPES and ":" in address:
        return address
    if address.startswith(("/", "./")):
        return "unix:" + address.replace(":", r"\:")
    m = _HOST_PORT.match(address)
    if m is None:
        raise ValueError(f"expected HOST:PORT or a Twisted endpoint string, got {address!r}")
    host, port = m.group(1), m.group(2)
    if host.startswith("["):
        host = host[1:-1]
        return f"tcp6:{port}:interface={host.replace(':', chr(92) + ':')}" if host else f"tcp6:{port}"
    if host in ("", "0.0.0.0"):
        return f"tcp:{port}"
    return f"tcp:{port}:interface={host}"


def wildcard_port(address: str) -> int | None:
    """The port of an address in nsqd's form that means every interface (`:4150`, `0.0.0.0:4150`, `[::]:4150`), else None.

    Go listens on each of them with one socket for IPv6 and IPv4 alike.
    """
    m = _HOST_PORT.match(address)
    if m is None or m.group(1) not in ("", "0.0.0.0", "[::]"):
        return None
    return int(m.group(2))


def _parse_address(value: Any) -> str:
    text = _parse_str(value)
    if text:
        to_endpoint(text)
    return text


_PARSERS["address"] = _parse_address


# -- the table -----------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    name: str
    kind: str
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None
    aliases: tuple[str, ...] = ()
    # Replaces the kind's parser where the values are not plain strings
    # (a "list" of numbers); the kind still says how the flag is given.
    parser: Callable[[Any], Any] | None = None
    # The value a bare `--name` stands for, for a non-bool option that Go
    # declares as a bool flag (nsqd's --tls-required); None: a value is required.
    bare: str | None = None

    @property
    def attr(self) -> str:
        return self.name.replace("-", "_")

    def parse(self, value: Any) -> Any:
        parsed = (self.parser or _PARSERS[self.kind])(value)
        if self.check is not None:
            problem = self.check(parsed)
            if problem:
                raise ValueError(problem)
        return parsed


def _at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be at least {low:g}, got {v:g}"


def _between(low: float, high: float) -> Callable[[Any], str | None]:
    return lambda v: None if low <= v <= high else f"must be in {low:g}..{high:g}, got {v:g}"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}, got {v!r}"


def _backend_check(value: str) -> str | None:
    import backends

    names = backends.available()
    return None if value in names else f"must be one of {', '.join(names)}, got {value!r}"


_positive_duration = _at_least(0.001)
# Go's time.Duration and int64: the largest retention a duration or size can say.
_MAX_INT64 = (1 << 63) - 1
_MAX_DURATION = _MAX_INT64 / 1e9


def _statsd_address_check(value: str) -> str | None:
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"expected HOST:PORT, got {value!r}"
    return None


def _parse_tls_required(value: Any) -> str:
    """nsqd's tlsRequiredOption: true/false (and Go's other bool spellings) or tcp-https."""
    if isinstance(value, str) and value.strip().lower() == "tcp-https":
        return "tcp-https"
    try:
        return "true" if _parse_bool(value) else "false"
    except ValueError:
        raise ValueError(f"expected true, false or tcp-https, got {value!r}") from None


_LOG_LEVEL = Option("log-level", "str", "info", "debug, info, warn, error or fatal",
                    _one_of("debug", "info", "warn", "error", "fatal"))

# nsqd has no flag for it: Go listens with the kernel's limit
# (net.core.somaxconn), so a storm of connections is queued, not refused.
# Twisted's default is 50; every TCP/HTTP(S)/unix listener of both daemons
# takes this instead (`listen_endpoint`).
_LISTEN_BACKLOG = Option(
    "listen-backlog", "int", None,
    "queue of not-yet-accepted connections of every listener (default: the system's "
    "net.core.somaxconn, as nsqd; 4096 if unknown)", _between(1, 65535))

# mqd's own (nsqd's HTTP API has no authentication): both daemons take it.
_HTTP_AUTH_REQUIRED = Option(
    "http-auth-required", "bool", False,
    "every HTTP(S) endpoint but /ping and /info needs `Authorization: Bearer <secret>` with the grant "
    "docs/security.md lists, asked of the --auth-http-address servers as AUTH asks them")

# Where either daemon that sends a bearer secret (the broker, mqadmin) may read it from.
_HTTP_CLIENT_AUTH_SECRET_FILE = Option(
    "http-client-auth-secret-file", "str", "",
    "file holding --http-client-auth-secret (read at start-up), so it is not on the command line")


def check_http_auth(settings: Settings) -> None:
    """ConfigError when `--http-auth-required` is given without `--auth-http-address`.

    Without an auth server every secret would be refused: a daemon that
    answers 401 to everything is a mistake to report at start, not to run.
    """
    if settings.http_auth_required and not settings.auth_http_address:
        raise ConfigError("--http-auth-required needs --auth-http-address (the auth server to ask)")


def check_retention(settings: Settings) -> None:
    """ConfigError for retention settings the store cannot honour.

    The memory store keeps the retained log in RAM: bounded by time alone,
    a busy topic would fill the memory before its records are old enough
    to go, so it must be given a size too. (The dummy store starts with
    retention flags, its logs keeping nothing, as `/topic/offsets` says;
    the broker warns at start and refuses a topic's own retention.)
    """
    if settings.backend == "memory" and settings.retention_time and not settings.retention_bytes:
        raise ConfigError("--backend memory keeps the retained log in RAM: set --retention-bytes to bound it")


def http_client_auth_secret(settings: Settings) -> str:
    """The secret a daemon sends to lookupds (and brokers): --http-client-auth-secret, or its file's.

    `--http-client-auth-secret-file` is read here, once, at start-up; both
    given, a missing or empty file, or a secret no header can carry is a
    ConfigError of one line that never shows the secret. "" when neither
    is given.
    """
    from mqd.clusterinfo.bearer import check_secret, read_secret_file

    secret = settings.http_client_auth_secret or ""
    path = settings.http_client_auth_secret_file or ""
    if secret and path:
        raise ConfigError("use --http-client-auth-secret or --http-client-auth-secret-file not both")
    try:
        if path:
            return read_secret_file(path, "--http-client-auth-secret-file")
        return check_secret(secret, "--http-client-auth-secret")
    except ValueError as e:
        raise ConfigError(str(e)) from None


MQD_OPTIONS: tuple[Option, ...] = (
    _LOG_LEVEL,
    Option("node-id", "int", None, "unique part of message ids, 0-1023 (default: from the hostname, as nsqd)",
           _between(0, 1023), aliases=("id",)),
    Option("tcp-address", "address", "0.0.0.0:4150", "TCP clients: HOST:PORT, a unix socket path, or a Twisted endpoint string"),
    Option("http-address", "address", "0.0.0.0:4151", "HTTP clients: HOST:PORT or a Twisted endpoint string; empty disables"),
    Option("lookupd-tcp-address", "list", [], "lookupd TCP address (repeatable)",
           aliases=("nsqlookupd_tcp_addresses",)),
    Option("auth-http-address", "list", [],
           "auth server: HOST:PORT (http://HOST:PORT/auth) or a full URL (repeatable); makes AUTH mandatory",
           aliases=("auth_http_addresses",)),
    Option("auth-http-request-method", "str", "get", "how the auth server is asked: get or post",
           _one_of("get", "post")),
    _HTTP_AUTH_REQUIRED,
    Option("http-client-connect-timeout", "duration", 2.0,
           "connect timeout of requests to the auth server and of lookupd /channels queries", _positive_duration),
    Option("http-client-request-timeout", "duration", 5.0,
           "whole-request timeout of requests to the auth server and of lookupd /channels queries",
           _positive_duration),
    Option("http-client-auth-secret", "str", "",
           "secret sent as 'Authorization: Bearer' with the lookupd /channels queries, for lookupds "
           "run with --http-auth-required"),
    _HTTP_CLIENT_AUTH_SECRET_FILE,
    Option("broadcast-address", "str", None, "address this broker is known by (default: the hostname)"),
    Option("broadcast-tcp-port", "int", 0, "TCP port announced to lookupd (0: the bound port)", _between(0, 65535)),
    Option("broadcast-http-port", "int", 0, "HTTP port announced to lookupd (0: the bound port)", _between(0, 65535)),
    Option("data-path", "str", "", "directory for the metadata file and the disk store (default: the current directory)"),
    Option("backend", "str", "lmdb", "store behind the memory queues: lmdb or memory", _backend_check),
    Option("durable", "bool", False,
           "acknowledge a publish only once it is synced to disk, and keep every message until FIN (lmdb)"),
    Option("retention-time", "duration", 0.0,
           "keep every message published to a topic in its retained log for this long, readable by "
           "offset (GET /topic/read) whatever its channels did with it (0: no time bound; retention is "
           "on when this or --retention-bytes is set; POST /topic/retention overrides it per topic)",
           _between(0, _MAX_DURATION)),
    Option("retention-bytes", "int", 0,
           "keep at most this many bytes in each topic's retained log, the oldest records going first: "
           "an integer or with a unit, KB/MB/GB/TB (1000s) or KiB/MiB/GiB/TiB (1024s) "
           "(0: no size bound; required with --retention-time on --backend memory)",
           _between(0, _MAX_INT64), parser=parse_size),
    Option("sync-every", "int", 2500, "fsync the store after this many writes (when not durable)", _at_least(0)),
    Option("sync-timeout", "duration", 2.0, "fsync the store at least this often when it was written (when not durable)",
           _at_least(0)),
    Option("lmdb-map-size", "int", 1 << 30, "initial LMDB map size in bytes; it grows by itself", _at_least(1 << 20)),
    Option("snapshot-max-bytes", "int", 16 << 30,
           "disk space all snapshots under <data-path>/snapshots may take together, those being written "
           "counted at their estimate; POST /snapshot is refused (507 SNAPSHOT_LIMIT) when one more "
           "could pass it (0: no limit)",
           _at_least(0)),
    Option("snapshot-reserve-bytes", "int", -1,
           "free space a snapshot must leave on the data filesystem for the store, or POST /snapshot is "
           "refused (507 SNAPSHOT_LIMIT) (-1: 5% of the filesystem, at least twice --max-body-size; "
           "0: the snapshot only has to fit)",
           _at_least(-1)),
    Option("snapshot-keep", "int", 0,
           "when a snapshot is taken, remove the oldest beyond this many (the new one counted), except "
           "those a reader holds (0: keep all)",
           _at_least(0)),
    Option("snapshot-keep-age", "duration", 0.0,
           "when a snapshot is taken, remove those older than this, except those a reader holds "
           "(0: keep all)",
           _at_least(0)),
    Option("peek-max-body-bytes", "int", 64 << 10,
           "most bytes of each body GET /channel/peek and /topic/peek show (max_body= may ask fewer); "
           "a longer body is cut and marked truncated", _at_least(0)),
    Option("peek-max-bytes", "int", 4 << 20,
           "largest peek answer in bytes: it ends with the last message that fits (more: true); the answers "
           "being built or written hold at most 4 times this together, a peek past that is 503 PEEK_BUSY",
           _at_least(4096)),
    Option("mem-queue-size", "int", 10000, "messages kept in memory per topic and per channel", _at_least(0)),
    Option("msg-timeout", "duration", 60.0, "time a message may stay in flight before it is requeued", _positive_duration),
    Option("max-msg-timeout", "duration", 900.0, "highest msg_timeout a client may ask for", _positive_duration),
    Option("max-msg-size", "int", 1048576, "largest message body in bytes", _at_least(1)),
    Option("max-body-size", "int", 5242880, "largest command body in bytes (IDENTIFY, MPUB)", _at_least(1)),
    Option("max-req-timeout", "duration", 3600.0, "longest REQ delay", _at_least(0)),
    Option("max-defer-timeout", "duration", None,
           "longest DPUB or /pub, /mpub defer delay (default: max-req-timeout)", _at_least(0)),
    Option("max-rdy-count", "int", 2500, "highest RDY a client may send", _at_least(1)),
    Option("max-heartbeat-interval", "duration", 60.0, "longest heartbeat_interval a client may ask for", _at_least(1.0)),
    Option("max-channel-consumers", "int", 0, "subscribers allowed per channel (0: no limit)", _at_least(0)),
    Option("max-output-buffer-size", "int", 65536, "largest output_buffer_size a client may ask for", _at_least(64)),
    Option("max-output-buffer-timeout", "duration", 30.0, "longest output_buffer_timeout a client may ask for", _positive_duration),
    Option("min-output-buffer-timeout", "duration", 0.025, "shortest output_buffer_timeout a client may ask for", _at_least(0)),
    Option("output-buffer-timeout", "duration", 0.25, "default output_buffer_timeout", _at_least(0)),
    Option("queue-scan-interval", "duration", 0.1, "how often in-flight and deferred queues are scanned", _positive_duration),
    Option("queue-scan-refresh-interval", "duration", 5.0, "how often the list of channels to scan is rebuilt", _positive_duration),
    Option("queue-scan-selection-count", "int", 20, "channels sampled per scan", _at_least(1)),
    Option("queue-scan-dirty-percent", "float", 0.25, "rescan at once when more than this share of sampled channels had work",
           _between(0.0, 1.0)),
    Option("queue-scan-worker-pool-max", "int", 4, "accepted for nsqd compatibility; the scan runs on the reactor", _at_least(1)),
    Option("https-address", "address", "0.0.0.0:4152",
           "HTTPS clients (only when --tls-cert and --tls-key are set): HOST:PORT or a Twisted endpoint string; empty disables"),
    _LISTEN_BACKLOG,
    Option("tls-cert", "str", "", "path to the certificate file (PEM, may hold the chain)"),
    Option("tls-key", "str", "", "path to the private key file (PEM)"),
    Option("tls-client-auth-policy", "str", "",
           "client certificate policy: require or require-verify (sets --tls-required=true if it was false)",
           _one_of("", "require", "require-verify")),
    Option("tls-root-ca-file", "str", "", "CA bundle (PEM) client certificates are verified against"),
    Option("tls-required", "str", "false",
           "true: TCP clients must upgrade to TLS and plain HTTP answers 403; tcp-https: TCP only; false",
           parser=_parse_tls_required, bare="true"),
    Option("tls-min-version", "str", "tls1.0", "lowest TLS version accepted: tls1.0, tls1.1, tls1.2 or tls1.3",
           _one_of("tls1.0", "tls1.1", "tls1.2", "tls1.3")),
    Option("deflate", "bool", True, "allow deflate compression"),
    Option("max-deflate-level", "int", 6, "highest deflate level a client may ask for", _between(1, 9)),
    Option("snappy", "bool", True, "allow snappy compression"),
    Option("statsd-address", "str", "", "UDP HOST:PORT of a statsd daemon to push stats to; empty disables",
           _statsd_address_check),
    Option("statsd-prefix", "str", "nsq.%s",
           "prefix of the statsd keys (%s: <broadcast-address>_<broadcast-http-port>)"),
    Option("statsd-interval", "duration", 60.0, "time between pushes to statsd", _positive_duration),
    Option("statsd-mem-stats", "bool", True, "also push memory and GC gauges to statsd"),
    Option("statsd-udp-packet-size", "int", 508, "largest statsd UDP datagram in bytes", _at_least(1)),
    Option("statsd-exclude-ephemeral", "bool", False, "leave #ephemeral topics and channels out of statsd"),
    Option("e2e-processing-latency-percentile", "list", [],
           "end-to-end latency percentile to track, in (0, 1]; comma-separated and/or repeated "
           "(default: none, latency not tracked)",
           aliases=("e2e_processing_latency_percentiles",), parser=parse_percentiles),
    Option("e2e-processing-latency-window-time", "duration", 600.0,
           "end-to-end latency percentiles cover this much recent time", _positive_duration),
)


def _required(value: str) -> str | None:
    return None if value else "must not be empty"


# nsqlookupd's (`nsqlookupd/options.go`): it keeps no data, so there is no
# data path; both listeners are required, as nsqlookupd cannot run without either.
LOOKUPD_OPTIONS: tuple[Option, ...] = (
    _LOG_LEVEL,
    Option("tcp-address", "address", "0.0.0.0:4160",
           "TCP address for brokers to register on: HOST:PORT or a Twisted endpoint string", _required),
    Option("http-address", "address", "0.0.0.0:4161",
           "HTTP address for clients and admins: HOST:PORT or a Twisted endpoint string", _required),
    _LISTEN_BACKLOG,
    Option("broadcast-address", "str", None,
           "address given to brokers in the IDENTIFY response (default: the hostname)"),
    Option("inactive-producer-timeout", "duration", 300.0,
           "a broker not heard from (IDENTIFY, PING) for this long is left out of /lookup and /nodes",
           _positive_duration),
    Option("tombstone-lifetime", "duration", 45.0,
           "how long a tombstoned producer of a topic is left out of /lookup", _at_least(0)),
    Option("auth-http-address", "list", [],
           "auth server asked about the bearer secrets of --http-auth-required: HOST:PORT "
           "(http://HOST:PORT/auth) or a full URL (repeatable)",
           aliases=("auth_http_addresses",)),
    Option("auth-http-request-method", "str", "get", "how the auth server is asked: get or post",
           _one_of("get", "post")),
    _HTTP_AUTH_REQUIRED,
    Option("http-client-connect-timeout", "duration", 2.0,
           "connect timeout of requests to the auth server", _positive_duration),
    Option("http-client-request-timeout", "duration", 5.0,
           "whole-request timeout of requests to the auth server", _positive_duration),
)


def _http_address_check(value: list[str]) -> str | None:
    """nsqadmin resolves each address at start-up; the form alone is checked here (no DNS)."""
    for address in value:
        if address.startswith(("http://", "https://")):
            continue
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"expected HOST:PORT or an http(s):// URL, got {address!r}"
    return None


def _cidr_check(value: str) -> str | None:
    if not value:
        return None
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError as e:
        return f"expected a CIDR like 127.0.0.1/8, got {value!r} ({e})"
    return None


def _url_check(value: str) -> str | None:
    if value and not value.startswith(("http://", "https://")):
        return f"expected an http:// or https:// URL, got {value!r}"
    return None


# Characters a base path may hold: it is written into the pages' HTML and
# script, so anything that could end an attribute or a string is refused,
# and it is matched against decoded request paths, so no %-escapes either.
_BASE_PATH = re.compile(r"/[A-Za-z0-9._~:@!$()*+,;=/-]*")


def _parse_base_path(value: Any) -> str:
    """nsqadmin's normalizeBasePath: '/' when empty, a leading '/', then Go's path.Clean."""
    text = _parse_str(value).strip()
    if not text:
        return "/"
    cleaned = posixpath.normpath("/" + text.lstrip("/"))
    if cleaned.startswith("//"):
        cleaned = "/" + cleaned.lstrip("/")
    if not _BASE_PATH.fullmatch(cleaned):
        raise ValueError(f"expected a URL path like /nsqadmin, got {value!r}")
    return cleaned


# nsqadmin's (`apps/nsqadmin/main.go`), plus how often mqadmin polls the
# brokers' /stats and how much history the charts keep. nsqadmin's graphite,
# statsd and dev flags are accepted, so its command lines keep working, and
# change nothing: mqadmin draws its charts from its own polling. Whether lookupds or brokers
# are given (one kind, not both) is checked once everything is resolved
# (mqd.admin.tap.check_settings), as nsqadmin checks it.
MQADMIN_OPTIONS: tuple[Option, ...] = (
    _LOG_LEVEL,
    Option("http-address", "address", "0.0.0.0:4171",
           "HTTP address of the pages and the API: HOST:PORT or a Twisted endpoint string", _required),
    _LISTEN_BACKLOG,
    Option("base-path", "str", "/", "URL path everything is served under (behind a reverse proxy)",
           parser=_parse_base_path),
    Option("lookupd-http-address", "list", [], "lookupd HTTP address", _http_address_check,
           aliases=("nsqlookupd_http_addresses",)),
    Option("nsqd-http-address", "list", [],
           "broker HTTP address, for a cluster without lookupd", _http_address_check,
           aliases=("nsqd_http_addresses",)),
    Option("notification-http-endpoint", "str", "",
           "URL every admin action is POSTed to as a JSON event; empty: none", _url_check),
    Option("allow-config-from-cidr", "str", "127.0.0.1/8",
           "clients allowed to use /config/:opt (a CIDR)", _cidr_check),
    Option("http-client-connect-timeout", "duration", 2.0,
           "connect timeout of requests to lookupds and brokers", _positive_duration),
    Option("http-client-request-timeout", "duration", 5.0,
           "whole-request timeout of requests to lookupds and brokers", _positive_duration),
    Option("http-client-tls-insecure-skip-verify", "bool", False,
           "do not verify the certificates of HTTPS lookupds and brokers"),
    Option("http-client-tls-root-ca-file", "str", "", "CA bundle (PEM) HTTPS lookupds and brokers are verified against"),
    Option("http-client-tls-cert", "str", "", "client certificate (PEM) for HTTPS lookupds and brokers"),
    Option("http-client-tls-key", "str", "", "key (PEM) of --http-client-tls-cert"),
    Option("http-client-auth-secret", "str", "",
           "secret sent as 'Authorization: Bearer' to lookupds and brokers that require one "
           "(--http-auth-required); a request's own bearer header is passed on instead"),
    _HTTP_CLIENT_AUTH_SECRET_FILE,
    Option("acl-http-header", "str", "X-Forwarded-User",
           "HTTP header naming the user a reverse proxy authenticated"),
    Option("admin-user", "list", [],
           "user allowed to take actions (none given: anyone), as named by --acl-http-header",
           aliases=("admin_users",)),
    Option("stats-interval", "duration", 5.0, "how often the brokers' /stats are polled for the charts",
           _positive_duration),
    Option("stats-history", "duration", 900.0, "how much time the charts cover (kept in memory)",
           _positive_duration),
    *(Option(name, kind, default, f"accepted for nsqadmin's command lines; {why}")
      for name, kind, default, why in (
          ("graphite-url", "str", "", "charts come from mqadmin's own polling"),
          ("proxy-graphite", "bool", False, "charts come from mqadmin's own polling"),
          ("statsd-prefix", "str", "nsq.%s", "no graphite is read"),
          ("statsd-counter-format", "str", "stats.counters.%s.count", "no graphite is read"),
          ("statsd-gauge-format", "str", "stats.gauges.%s", "no graphite is read"),
          ("statsd-interval", "duration", 60.0, "no graphite is read"),
          ("log-prefix", "str", "[nsqadmin] ", "twisted.logger formats the lines"),
          ("dev-static-dir", "str", "", "the pages are served from the package"),
      )),
)


class Settings:
    """Resolved options, read once; attribute names are the option names with '_'."""

    _explicit: frozenset[str]

    def __init__(self, values: Mapping[str, Any], explicit: Iterable[str] = ()) -> None:
        self.__dict__.update(values)
        self.__dict__["_explicit"] = frozenset(explicit)

    if TYPE_CHECKING:
        # The attributes come from an option table, so the checker cannot
        # know them: each daemon's settings read as Any.
        def __getattr__(self, name: str) -> Any: ...

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Settings are read-only; run-time changes go through Settings.replace")

    def replace(self, **changes: Any) -> Settings:
        values = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        values.update(changes)
        return Settings(values, self._explicit)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __repr__(self) -> str:
        # A secret (--http-client-auth-secret) is never shown, wherever this is printed.
        shown = {k: "<hidden>" if k.endswith("_secret") and v else v for k, v in self.as_dict().items()}
        return f"Settings({shown!r})"


def load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option: value, got {type(data).__name__}")
    return data


def resolve(
    table: Iterable[Option],
    flags: Mapping[str, Any],
    config_path: str | None = None,
) -> Settings:
    """Settings from command-line flags (already split), a YAML file, and the defaults.

    Keys in the file may use '-' or '_' and nsqd's config-file aliases;
    an unknown key is an error, as a typo there would otherwise pass
    silently.
    """
    options = {opt.name: opt for opt in table}
    by_key: dict[str, Option] = {}
    for opt in options.values():
        by_key[opt.name] = opt
        for alias in opt.aliases:
            by_key[alias.replace("_", "-")] = opt

    file_values: dict[str, Any] = {}
    if config_path:
        for key, value in load_yaml(config_path).items():
            known = by_key.get(str(key).replace("_", "-"))
            if known is None:
                raise ConfigError(f"{config_path}: unknown option {key!r}")
            try:
                file_values[known.name] = known.parse(value)
            except ValueError as e:
                raise ConfigError(f"{config_path}: {key}: {e}") from None

    values: dict[str, Any] = {}
    explicit: list[str] = []
    for opt in options.values():
        if opt.name in flags and flags[opt.name] is not None:
            try:
                values[opt.attr] = opt.parse(flags[opt.name])
            except ValueError as e:
                raise ConfigError(f"--{opt.name}: {e}") from None
            explicit.append(opt.name)
        elif opt.name in file_values:
            values[opt.attr] = file_values[opt.name]
            explicit.append(opt.name)
        else:
            values[opt.attr] = opt.default
    _fill_defaults(values)
    return Settings(values, explicit)


def _fill_defaults(values: dict[str, Any]) -> None:
    """Defaults nsqd computes from the machine rather than states."""
    if "node_id" in values and values["node_id"] is None:
        values["node_id"] = default_node_id()
    if "broadcast_address" in values and not values["broadcast_address"]:
        values["broadcast_address"] = socket.gethostname()
    if "max_defer_timeout" in values and values["max_defer_timeout"] is None:
        # nsq PR #1504: unset, deferred publishes keep max-req-timeout's limit.
        values["max_defer_timeout"] = values["max_req_timeout"]
    if "listen_backlog" in values and values["listen_backlog"] is None:
        values["listen_backlog"] = system_backlog()


def system_backlog() -> int:
    """The kernel's cap on a listen backlog, read as Go reads it for nsqd's listeners.

    A larger backlog is silently cut to it by listen(2), so asking for more
    gains nothing; 4096 (Linux's default since 5.4) where it cannot be read.
    """
    try:
        with open("/proc/sys/net/core/somaxconn", encoding="ascii") as f:
            value = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 4096
    # listen(2)'s backlog was 16 bits in older kernels; Go caps it the same way.
    return max(1, min(value, 65535))
