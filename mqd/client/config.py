"""Client options: go-nsq's `nsq.Config`, with its names in snake_case and its bounds.

The names, defaults and min/max are go-nsq 1.1's (config.go struct tags)
so that an option tuned for a Go consumer means the same here, and the
CLI tools' `--consumer-opt name=value` takes what nsq_tail's does. One
addition: `max_msg_size`, go-nsq's later option of that name, whose
default here is a limit (64 MiB, not go-nsq's 0 = none) so that a hostile
or confused server cannot make a client buffer a 2 GiB frame.
Durations are seconds (floats) in Python, and also Go duration strings
("250ms", "1m30s"), because that is how they are written on command
lines. Every value is checked when it is set, so a bad option fails where
it was written with a message naming it, not later on the wire.
"""

from __future__ import annotations

import re
import socket
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from mqd import __version__
from mqd.client.errors import ClientConfigError
from mqd.options import parse_duration as _parse_go_duration
from mqd.wire.json_encoding import encode_json

__all__ = ["Config", "OPTIONS", "parse_duration", "format_duration", "split_config_opt"]

_MS = 0.001
_S = 1.0
_M = 60.0

# name → (default, min, max, doc). None for min/max: unbounded. Durations in
# seconds. client_id/hostname default to this host's names (filled per Config).
OPTIONS: OrderedDict[str, tuple[Any, Any, Any, str]] = OrderedDict([
    ("dial_timeout", (1 * _S, None, None, "deadline for establishing a TCP connection")),
    ("read_timeout", (60 * _S, 100 * _MS, 5 * _M,
                      "no complete frame read for this long (heartbeats included), or a handshake "
                      "not done within it, closes the connection")),
    ("write_timeout", (1 * _S, 100 * _MS, 5 * _M,
                       "go-nsq's write deadline; accepted and checked, not enforced "
                       "(Twisted writes never block)")),
    ("local_addr", (None, None, None, "local address to bind outgoing connections to (host or host:port)")),
    ("lookupd_poll_interval", (60 * _S, 10 * _MS, 5 * _M, "time between polls of lookupd for producers")),
    ("lookupd_poll_jitter", (0.3, 0.0, 1.0,
                             "fraction of lookupd_poll_interval of random delay before the first poll")),
    ("max_requeue_delay", (15 * _M, 0.0, 60 * _M, "longest requeue delay the consumer computes")),
    ("default_requeue_delay", (90 * _S, 0.0, 60 * _M,
                               "requeue delay unit: default_requeue_delay × attempts on handler failure")),
    ("backoff_strategy", ("exponential", None, None, "backoff on handler failure: exponential or full_jitter")),
    ("max_backoff_duration", (2 * _M, 0.0, 60 * _M, "longest backoff (0: no backoff)")),
    ("backoff_multiplier", (1 * _S, 0.0, 60 * _M, "unit of the backoff duration")),
    ("max_attempts", (5, 0, 65535, "attempts after which a message is given up (0: never)")),
    ("low_rdy_idle_timeout", (10 * _S, 1 * _S, 5 * _M,
                              "idle time after which a connection's RDY may move elsewhere "
                              "(max_in_flight < connections)")),
    ("low_rdy_timeout", (30 * _S, 1 * _S, 5 * _M,
                         "time since the last RDY after which it may move regardless of idleness")),
    ("rdy_redistribute_interval", (5 * _S, 1 * _MS, 5 * _S, "time between RDY redistributions")),
    ("client_id", (None, None, None, "client_id sent in IDENTIFY (default: short hostname)")),
    ("hostname", (None, None, None, "hostname sent in IDENTIFY (default: this host's FQDN)")),
    ("user_agent", (f"mqd.client/{__version__}", None, None, "user_agent sent in IDENTIFY")),
    ("heartbeat_interval", (30 * _S, None, None,
                            "heartbeats asked of nsqd (-1: none; at most read_timeout)")),
    ("sample_rate", (0, 0, 99, "percentage of the channel's messages to receive (0: all)")),
    ("tls_v1", (False, None, None, "upgrade the connection to TLS")),
    ("tls_root_ca_file", ("", None, None, "PEM file of the CAs that verify nsqd's certificate "
                                          "(default: the system's)")),
    ("tls_cert", ("", None, None, "PEM file of the client certificate")),
    ("tls_key", ("", None, None, "PEM file of the client certificate's key")),
    ("tls_insecure_skip_verify", (False, None, None, "do not verify nsqd's certificate")),
    ("tls_server_name", ("", None, None, "name nsqd's certificate must match (default: the address's host)")),
    ("deflate", (False, None, None, "negotiate deflate compression")),
    ("deflate_level", (6, 1, 9, "deflate compression level")),
    ("snappy", (False, None, None, "negotiate snappy compression")),
    ("output_buffer_size", (16384, None, None, "nsqd's output buffer for this connection in bytes "
                                              "(0: server default, -1: no buffering)")),
    ("output_buffer_timeout", (250 * _MS, None, None,
                               "nsqd's output buffer flush timeout (0: server default, -1: no buffering)")),
    ("max_in_flight", (1, 0, None, "messages in flight over all connections of a consumer")),
    ("msg_timeout", (0.0, 0.0, None, "server-side timeout of messages sent to this client "
                                      "(0: server default)")),
    ("max_msg_size", (64 * 1024 * 1024, 0, None,
                      "largest message body accepted from nsqd in bytes; a frame declaring more "
                      "closes the connection before it is read (0: no limit)")),
    ("auth_secret", ("", None, None, "secret sent with AUTH when nsqd requires it")),
])

_DURATION = "duration"
_INT = "int"
_FLOAT = "float"
_BOOL = "bool"
_STR = "str"
_CHOICE = "choice"
_ADDR = "addr"

_KINDS = {
    "dial_timeout": _DURATION, "read_timeout": _DURATION, "write_timeout": _DURATION,
    "local_addr": _ADDR, "lookupd_poll_interval": _DURATION, "lookupd_poll_jitter": _FLOAT,
    "max_requeue_delay": _DURATION, "default_requeue_delay": _DURATION,
    "backoff_strategy": _CHOICE, "max_backoff_duration": _DURATION,
    "backoff_multiplier": _DURATION, "max_attempts": _INT, "low_rdy_idle_timeout": _DURATION,
    "low_rdy_timeout": _DURATION, "rdy_redistribute_interval": _DURATION,
    "client_id": _STR, "hostname": _STR, "user_agent": _STR,
    "heartbeat_interval": _DURATION, "sample_rate": _INT, "tls_v1": _BOOL,
    "tls_root_ca_file": _STR, "tls_cert": _STR, "tls_key": _STR,
    "tls_insecure_skip_verify": _BOOL, "tls_server_name": _STR, "deflate": _BOOL,
    "deflate_level": _INT, "snappy": _BOOL, "output_buffer_size": _INT,
    "output_buffer_timeout": _DURATION, "max_in_flight": _INT, "msg_timeout": _DURATION,
    "max_msg_size": _INT, "auth_secret": _STR,
}
assert set(_KINDS) == set(OPTIONS)

_CHOICES = {"backoff_strategy": ("exponential", "full_jitter")}

# Go's strconv.ParseBool.
_TRUE = frozenset(("1", "t", "T", "TRUE", "true", "True"))
_FALSE = frozenset(("0", "f", "F", "FALSE", "false", "False"))

_host_names: tuple[str, str] | None = None


def _default_names() -> tuple[str, str]:
    """(short hostname, FQDN), looked up once per process: getfqdn may ask DNS."""
    global _host_names
    if _host_names is None:
        name = socket.gethostname()
        try:
            fqdn = socket.getfqdn(name)
        except OSError:
            fqdn = name
        if not fqdn or fqdn.startswith("localhost"):
            # A host mapped to localhost in /etc/hosts: its own name says more.
            fqdn = name
        _host_names = (name.split(".")[0], fqdn)
    return _host_names


def parse_duration(text: str) -> float:
    """Go's time.ParseDuration ("1m30s", "-250ms", "0") in seconds; ValueError if malformed.

    A bare number is taken as seconds, the unit durations have in Python
    (Go refuses it), so `--consumer-opt read_timeout=30` means 30 s. The
    rest is nsqd's flag parser's (mqd.options), one parser for both.
    """
    s = text.strip()
    if not s:
        raise ValueError("empty duration")
    try:
        return float(s)
    except ValueError:
        return _parse_go_duration(s)


def format_duration(seconds: float) -> str:
    """A duration as the docs and error messages print it: 250ms, 90s, 15m."""
    if seconds == 0:
        return "0"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        value = seconds / size
        if value >= 1 and abs(value - round(value)) < 1e-9:
            return f"{int(round(value))}{unit}"
    if seconds >= 1:
        return f"{seconds:g}s"
    return f"{seconds * 1000:g}ms"


def _show(name: str, value: Any) -> str:
    return format_duration(value) if _KINDS[name] == _DURATION else repr(value)


class Config:
    """One set of client options, each an attribute checked when assigned.

    `Config(read_timeout="30s", max_in_flight=100)`; `config.set(name, text)`
    parses a command-line string as go-nsq's `Config.Set` does. Assigning an
    attribute goes through the same checks; cross-field rules are checked
    by `validate()` (called by the constructor, and by the producer and
    consumer when they take a config).
    """

    __slots__ = tuple(OPTIONS)
    OPTIONS = OPTIONS

    if TYPE_CHECKING:
        # The slots' types once checked (`_check`): durations are float seconds.
        dial_timeout: float
        read_timeout: float
        write_timeout: float
        local_addr: str | None
        lookupd_poll_interval: float
        lookupd_poll_jitter: float
        max_requeue_delay: float
        default_requeue_delay: float
        backoff_strategy: str
        max_backoff_duration: float
        backoff_multiplier: float
        max_attempts: int
        low_rdy_idle_timeout: float
        low_rdy_timeout: float
        rdy_redistribute_interval: float
        client_id: str
        hostname: str
        user_agent: str
        heartbeat_interval: float
        sample_rate: int
        tls_v1: bool
        tls_root_ca_file: str
        tls_cert: str
        tls_key: str
        tls_insecure_skip_verify: bool
        tls_server_name: str
        deflate: bool
        deflate_level: int
        snappy: bool
        output_buffer_size: int
        output_buffer_timeout: float
        max_in_flight: int
        msg_timeout: float
        max_msg_size: int
        auth_secret: str

    def __init__(self, **options: Any) -> None:
        short, fqdn = _default_names()
        for name, (default, _lo, _hi, _doc) in OPTIONS.items():
            object.__setattr__(self, name, default)
        object.__setattr__(self, "client_id", short)
        object.__setattr__(self, "hostname", fqdn)
        for name, value in options.items():
            setattr(self, name, value)
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _KINDS:
            raise ClientConfigError(f"unknown option {name!r}")
        object.__setattr__(self, name, _check(name, value))

    def set(self, name: str, value: Any) -> None:
        """Set one option from a string (`--consumer-opt name=value`), as go-nsq's Config.Set.

        Dashes in the name are underscores (go-nsq's rule); booleans take
        Go's ParseBool spellings ("true", "1", "f"...); durations Go's
        duration strings. Non-string values are set as with setattr.
        """
        name = name.strip().replace("-", "_")
        if name not in _KINDS:
            raise ClientConfigError(f"unknown option {name!r}")
        if isinstance(value, str):
            value = _parse(name, value)
        setattr(self, name, value)

    def validate(self) -> None:
        """The rules across options (go-nsq's Validate plus the ones nsqd would refuse)."""
        heartbeat = self.heartbeat_interval
        if heartbeat > self.read_timeout:
            # go-nsq's rule (equal passes): a heartbeat must come before the read deadline.
            raise ClientConfigError(
                f"heartbeat_interval {format_duration(heartbeat)} must not exceed "
                f"read_timeout {format_duration(self.read_timeout)}")
        if self.snappy and self.deflate:
            raise ClientConfigError("snappy and deflate cannot both be enabled")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ClientConfigError("tls_cert and tls_key must be given together")

    def copy(self, **options: Any) -> Config:
        """A copy with some options changed (a Config is not shared between services)."""
        values = self.as_dict()
        values.update(options)
        return Config(**values)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in OPTIONS}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable; mypy has no "unhashable" type

    def __repr__(self) -> str:
        changed = ", ".join(
            f"{name}={getattr(self, name)!r}" for name, spec in OPTIONS.items()
            if getattr(self, name) != spec[0] and name not in ("client_id", "hostname", "auth_secret"))
        return f"Config({changed})"

    # -- what goes on the wire -------------------------------------------------

    def identify_body(self) -> bytes:
        """IDENTIFY's JSON body, the fields go-nsq sends; durations in milliseconds.

        A negative heartbeat_interval or output_buffer_timeout is -1 on the
        wire, nsqd's "disabled"; keys sorted, as Go marshals a map.
        """
        body = {
            "client_id": self.client_id,
            "hostname": self.hostname,
            "user_agent": self.user_agent,
            "feature_negotiation": True,
            "heartbeat_interval": _ms_or_off(self.heartbeat_interval),
            "output_buffer_size": self.output_buffer_size,
            "output_buffer_timeout": _ms_or_off(self.output_buffer_timeout),
            "msg_timeout": _ms(self.msg_timeout),
            "tls_v1": self.tls_v1,
            "snappy": self.snappy,
            "deflate": self.deflate,
            "deflate_level": self.deflate_level,
            "sample_rate": self.sample_rate,
        }
        return encode_json(body, sort_keys=True)

    def tls_creator(self, host: str):
        """The TLS client options for an upgrade to `host` (a Twisted connection creator).

        Verification against tls_root_ca_file (else the platform's CAs) and
        tls_server_name (else `host`), with the client certificate when
        tls_cert/tls_key are set; tls_insecure_skip_verify turns
        verification off (CertificateOptions(verify=False)). Files are
        read here, so a missing one fails the connection's handshake.
        """
        from twisted.internet import ssl

        client_cert = None
        if self.tls_cert and self.tls_key:
            try:
                with open(self.tls_cert, "rb") as f:
                    cert_pem = f.read()
                with open(self.tls_key, "rb") as f:
                    key_pem = f.read()
                client_cert = ssl.PrivateCertificate.loadPEM(cert_pem + b"\n" + key_pem)
            except Exception as e:  # noqa: BLE001 - OSError, or OpenSSL's errors (no common base)
                raise ClientConfigError(f"tls_cert/tls_key: cannot load {self.tls_cert!r}, "
                                        f"{self.tls_key!r}: {e}") from None
        if self.tls_insecure_skip_verify:
            if client_cert is None:
                return ssl.CertificateOptions(verify=False)
            return ssl.CertificateOptions(privateKey=client_cert.privateKey.original,
                                          certificate=client_cert.original, verify=False)
        trust_root = None
        if self.tls_root_ca_file:
            try:
                with open(self.tls_root_ca_file, "rb") as f:
                    pem = f.read()
                certs = [ssl.Certificate.loadPEM(block) for block in _pem_blocks(pem)]
            except Exception as e:  # noqa: BLE001 - OSError, or OpenSSL's errors (no common base)
                raise ClientConfigError(
                    f"tls_root_ca_file: cannot load {self.tls_root_ca_file!r}: {e}") from None
            if not certs:
                raise ClientConfigError(
                    f"tls_root_ca_file: no certificate in {self.tls_root_ca_file!r}")
            trust_root = ssl.trustRootFromCertificates(certs)
        name = self.tls_server_name or host
        if name.startswith("[") and name.endswith("]"):
            name = name[1:-1]
        return ssl.optionsForClientTLS(name, trustRoot=trust_root, clientCertificate=client_cert)


_PEM_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def _pem_blocks(pem: bytes) -> list[bytes]:
    return _PEM_BLOCK.findall(pem)


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def _ms_or_off(seconds: float) -> int:
    return -1 if seconds < 0 else _ms(seconds)


def _parse(name: str, text: str) -> Any:
    """A command-line string as the option's type."""
    kind = _KINDS[name]
    raw = text.strip()
    try:
        if kind == _BOOL:
            if raw in _TRUE:
                return True
            if raw in _FALSE:
                return False
            raise ValueError
        if kind == _INT:
            return int(raw, 10)
        if kind == _FLOAT:
            return float(raw)
        if kind == _DURATION:
            return parse_duration(raw)
        if kind == _ADDR:
            return raw or None
    except ValueError:
        raise ClientConfigError(f"{name}: cannot parse {text!r} as a {_KIND_NAMES[kind]}") from None
    return text


_KIND_NAMES = {_BOOL: "boolean", _INT: "integer", _FLOAT: "number", _DURATION: "duration",
               _STR: "string", _CHOICE: "string", _ADDR: "address"}


def _check(name: str, value: Any) -> Any:
    """`value` for option `name` in its canonical type, or ClientConfigError."""
    kind = _KINDS[name]
    if kind == _DURATION:
        if isinstance(value, str):
            try:
                value = parse_duration(value)
            except ValueError:
                raise ClientConfigError(f"{name}: cannot parse {value!r} as a duration") from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ClientConfigError(f"{name}: expected seconds or a duration string, got {value!r}")
        value = float(value)
        if value != value:  # NaN passes every comparison
            raise ClientConfigError(f"{name}: not a number")
        if name in ("heartbeat_interval", "output_buffer_timeout"):
            if value < 0 and value != -1:
                raise ClientConfigError(f"{name}: {format_duration(value)} is negative (-1 disables it)")
    elif kind == _INT:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ClientConfigError(f"{name}: expected an integer, got {value!r}")
        if name == "output_buffer_size" and value < -1:
            raise ClientConfigError(f"{name}: {value} is invalid (-1 disables buffering)")
    elif kind == _FLOAT:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ClientConfigError(f"{name}: expected a number, got {value!r}")
        value = float(value)
        if value != value:
            raise ClientConfigError(f"{name}: not a number")
    elif kind == _BOOL:
        if not isinstance(value, bool):
            raise ClientConfigError(f"{name}: expected True or False, got {value!r}")
    elif kind == _CHOICE:
        if value not in _CHOICES[name]:
            allowed = ", ".join(_CHOICES[name])
            raise ClientConfigError(f"{name}: {value!r} is not one of {allowed}")
    elif kind == _ADDR:
        if value is not None and not isinstance(value, str):
            raise ClientConfigError(f"{name}: expected an address string or None, got {value!r}")
        return value or None
    elif not isinstance(value, str):
        raise ClientConfigError(f"{name}: expected a string, got {value!r}")
    _default, low, high, _doc = OPTIONS[name]
    if low is not None and value < low:
        raise ClientConfigError(f"{name}: {_show(name, value)} is below the minimum {_show(name, low)}")
    if high is not None and value > high:
        raise ClientConfigError(f"{name}: {_show(name, value)} is above the maximum {_show(name, high)}")
    return value


def split_config_opt(opt: str) -> tuple[str, str]:
    """`name,value` (go-nsq's ConfigFlag), `name=value`, or a bare `name` meaning true.

    Option names never contain "," or "=", so the first of either ends the
    name and the value keeps the rest (an auth secret may contain both).
    """
    cut = min((i for i in (opt.find(","), opt.find("=")) if i >= 0), default=-1)
    if cut < 0:
        return opt.strip(), "true"
    return opt[:cut].strip(), opt[cut + 1 :]
