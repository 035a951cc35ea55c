"""The options the streaming source and the sink share: brokers, topic, and txnsq's client settings.

Spark hands a data source its options as a case-insensitive mapping of
strings. Both directions take the brokers the same way:

- `nsqd`: comma-separated `host:port` TCP addresses;
- `lookupd`: comma-separated nsqlookupd HTTP addresses (`host:port` or a
  URL), for discovery of every broker that has the topic;

and any txnsq client option by its go-nsq name (`tls_v1`, `tls_root_ca_file`,
`snappy`, `deflate`, `auth_secret`, `heartbeat_interval`, ...; the list is
`mqd.client.Config.OPTIONS`), parsed as `nsq_tail --consumer-opt` parses
them. `msgTimeout` is the IDENTIFY `msg_timeout`: a Go duration ("90s"), a
bare number being milliseconds as on the wire.

Every problem is one `StreamOptionError` line naming the option.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, overload
from urllib.parse import urlsplit, urlunsplit

from mqd.client import ClientConfigError, Config
from mqd.client.config import parse_duration
from mqd.names import is_valid_name

__all__ = ["StreamOptionError", "addresses", "client_config", "lookupd_url", "option_duration",
           "option_int", "topic_name"]


class StreamOptionError(ValueError):
    """An option of the `mqd` streaming format is missing or malformed (a one-line message)."""


def _get(options: Mapping[str, str], name: str) -> str | None:
    value = options.get(name)
    if value is None:
        value = options.get(name.lower())
    return None if value is None else str(value)


def addresses(options: Mapping[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(nsqd TCP addresses, lookupd HTTP addresses); at least one of the two must be given."""
    nsqd = _split(_get(options, "nsqd"))
    lookupd = _split(_get(options, "lookupd"))
    for address in nsqd:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StreamOptionError(f"mqd: option nsqd: {address!r} is not host:port")
    if not nsqd and not lookupd:
        raise StreamOptionError(
            "mqd: give option nsqd (host:port of brokers' TCP, comma-separated) "
            "or lookupd (nsqlookupd HTTP addresses)")
    return nsqd, lookupd


def _split(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    return tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))


@overload
def topic_name(options: Mapping[str, str], name: str = ..., *, required: Literal[True] = ...) -> str: ...
@overload
def topic_name(options: Mapping[str, str], name: str = ..., *, required: bool) -> str | None: ...
def topic_name(options: Mapping[str, str], name: str = "topic", *, required: bool = True) -> str | None:
    """A topic (or channel) name option, checked against NSQ's name rules."""
    value = _get(options, name)
    if not value:
        if required:
            raise StreamOptionError(f"mqd: option {name} is required")
        return None
    if not is_valid_name(value):
        raise StreamOptionError(
            f"mqd: option {name}: {value!r} is not a valid NSQ name "
            "(1-64 characters of [.a-zA-Z0-9_-], optionally ending in #ephemeral)")
    return value


def option_int(options: Mapping[str, str], name: str, default: int, minimum: int = 1) -> int:
    """A whole-number option of at least `minimum`."""
    text = _get(options, name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise StreamOptionError(f"mqd: option {name}: {text!r} is not a whole number") from None
    if value < minimum:
        raise StreamOptionError(f"mqd: option {name} must be at least {minimum}, got {value}")
    return value


def option_duration(options: Mapping[str, str], name: str, default: float) -> float:
    """A positive duration option in seconds: a Go duration ("30s", "1h"), a bare number of seconds."""
    text = _get(options, name)
    if text is None or text.strip() == "":
        return default
    try:
        value = parse_duration(text)
    except ValueError:
        raise StreamOptionError(f"mqd: option {name}: {text!r} is not a duration (e.g. 30s, 1h)") from None
    if value <= 0:
        raise StreamOptionError(f"mqd: option {name} must be positive")
    return value


def client_config(options: Mapping[str, str], **settings: Any) -> Config:
    """A txnsq Config from the client options among `options`, then `settings` on top."""
    config = Config()
    try:
        for key, value in options.items():
            name = key.lower()
            if name in Config.OPTIONS:
                config.set(name, value)
        timeout = _get(options, "msgTimeout")
        if timeout:
            text = timeout.strip()
            config.msg_timeout = int(text) / 1000 if text.isdigit() else parse_duration(text)
        for name, value in settings.items():
            setattr(config, name, value)
        config.validate()
    except (ClientConfigError, ValueError) as e:
        raise StreamOptionError(f"mqd: {e}") from None
    return config


def lookupd_url(address: str, endpoint: str) -> str:
    """The URL of a lookupd endpoint (`nodes`, `ping`): `host:port` gets http://, a URL keeps
    its scheme and path prefix (a lookupd behind a proxy path), less a trailing `/lookup`."""
    text = address.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    path = parts.path.rstrip("/")
    if path.endswith("/lookup"):
        path = path[: -len("/lookup")]
    return urlunsplit((parts.scheme, parts.netloc, f"{path}/{endpoint}", "", ""))
