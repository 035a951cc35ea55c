"""The brokers whose retained logs an offset-mode read asks: found from TCP addresses or from lookupds.

A broker is named by its TCP address (`host:port`), as the `nsqd` option
and NSQ's tools name it and as rows carry it; its logs are read over HTTP.
Given TCP addresses, the driver connects once to each, IDENTIFYs (with the
query's TLS and AUTH settings, as a consumer would) and takes the HTTP
port from mqd's answer (`http_port`, or `https_port` with TLS; nsqd has
neither, so it is named as not keeping retained logs). Given lookupds,
it asks them for the topic's producers every time, so brokers that start
or stop having the topic are followed; their TCP address is
`broadcast_address:tcp_port`, their HTTP port the lookupd's `http_port`
(with TLS, the HTTPS port from IDENTIFY).

Runs on Spark's driver side only (the source's Python process, or the
batch planner); executors get the `BrokerLog`s in their partitions.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from mqd.endpoints import join_host_port
from spark_bridge.log_fetch import BrokerLog
from spark_bridge.log_options import LogOptions
from spark_bridge.stream_options import lookupd_url

__all__ = ["BrokerError", "LogBrokers"]

IDENTIFY_TIMEOUT = 15.0
LOOKUP_TIMEOUT = 10.0


class BrokerError(RuntimeError):
    """A broker or lookupd could not be asked, or is not an mqd keeping retained logs (a one-line message)."""


class LogBrokers:
    """The brokers of each topic: TCP addresses IDENTIFYed once, or the lookupds' producers each time."""

    def __init__(self, options: LogOptions) -> None:
        self.options = options
        self._known: dict[str, BrokerLog] = {}

    def find(self, topic: str) -> tuple[dict[str, BrokerLog], dict[str, str]]:
        """The brokers that have (or may have) `topic` by name, and those that cannot be asked now (name -> why).

        One broker away never hides the others. Raises BrokerError when no
        lookupd answers.
        """
        if self.options.nsqd:
            return self._each_by_tcp(self.options.nsqd)
        return self._by_lookupd(topic)

    def known(self, name: str) -> BrokerLog | None:
        """The broker named `name` as last found, without asking anything (None: not found yet, or forgotten)."""
        return self._known.get(name)

    def forget(self, name: str) -> None:
        """Ask `name` again next time (it was restarted: its ports may have changed)."""
        self._known.pop(name, None)

    def _each_by_tcp(self, names: Iterable[str]) -> tuple[dict[str, BrokerLog], dict[str, str]]:
        found: dict[str, BrokerLog] = {}
        away: dict[str, str] = {}
        for name in names:
            try:
                found[name] = self._by_tcp(name)
            except BrokerError as e:
                away[name] = str(e)
        return found, away

    def _broker(self, name: str, http: str) -> BrokerLog:
        o = self.options
        return BrokerLog(nsqd=name, http=http, tls=o.tls, tls_root_ca_file=o.tls_root_ca_file,
                         tls_cert=o.tls_cert, tls_key=o.tls_key,
                         tls_insecure_skip_verify=o.tls_insecure_skip_verify, secret=o.secret)

    def _by_tcp(self, address: str) -> BrokerLog:
        known = self._known.get(address)
        if known is None:
            server = identify(address, self.options.config)
            key = "https_port" if self.options.tls else "http_port"
            port = server.get(key)
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                what = "an HTTPS listener (--https-address)" if self.options.tls else "retained logs"
                raise BrokerError(
                    f"mqd: nsqd {address}: its IDENTIFY answer has no {key}: it is not an mqd with {what}; "
                    "reading by offset needs one (or give a channel to consume instead)")
            known = self._known[address] = self._broker(address, join_host_port(address.rpartition(":")[0], port))
        return known

    def _by_lookupd(self, topic: str) -> tuple[dict[str, BrokerLog], dict[str, str]]:
        found: dict[str, BrokerLog] = {}
        over_tls: list[str] = []
        reasons = []
        answered = False
        for lookupd in self.options.lookupd:
            try:
                producers = lookup(lookupd, topic, self.options.secret)
            except BrokerError as e:
                reasons.append(str(e))
                continue
            answered = True
            for host, tcp_port, http_port in producers:
                name = join_host_port(host, tcp_port)
                if name in found or name in over_tls:
                    continue
                if self.options.tls:
                    over_tls.append(name)  # its HTTPS port is in its IDENTIFY answer, not the lookupd's
                    continue
                known = self._known.get(name)
                http = join_host_port(host, http_port)
                if known is None or known.http != http:
                    known = self._known[name] = self._broker(name, http)
                found[name] = known
        if not answered:
            raise BrokerError("mqd: no lookupd answered: " + "; ".join(r.removeprefix("mqd: ") for r in reasons))
        by_tcp, away = self._each_by_tcp(over_tls)
        found.update(by_tcp)
        return found, away


def identify(address: str, config: Any) -> dict[str, Any]:
    """The broker's IDENTIFY answer, from one connection made (and closed) on the reactor thread."""
    from twisted.internet import defer, error

    from mqd.client.errors import (
        AuthRefusedError,
        AuthRequiredError,
        ConnectionClosed,
        HandshakeRefusedError,
    )
    from mqd.client.protocol import ConnectionDelegate, connect
    from spark_bridge.reactor_thread import call

    async def ask() -> dict[str, Any]:
        from twisted.internet import reactor

        # A quiet delegate: closing this connection at once is the plan, not news.
        proto = await connect(reactor, address, config, ConnectionDelegate())
        server = dict(proto.server) if isinstance(proto.server, dict) else {}
        proto.close()
        return server

    try:
        answer: dict[str, Any] = call(lambda: defer.ensureDeferred(ask()), timeout=IDENTIFY_TIMEOUT)
    except AuthRequiredError:
        raise BrokerError(f"mqd: nsqd {address}: AUTH required: it requires a secret (option auth_secret)") from None
    except AuthRefusedError as e:
        why = ("the secret has no grant" if e.code == "E_UNAUTHORIZED"
               else "the auth server refused the secret (option auth_secret)")
        raise BrokerError(f"mqd: nsqd {address}: AUTH refused ({e}): {why}") from None
    except HandshakeRefusedError as e:
        raise BrokerError(f"mqd: nsqd {address}: {e.nsq_text}") from None
    except (error.ConnectError, ConnectionClosed, defer.TimeoutError, defer.CancelledError, OSError) as e:
        raise BrokerError(f"mqd: nsqd {address}: cannot connect ({_reason(e)})") from None
    except ValueError as e:
        raise BrokerError(f"mqd: nsqd {address}: {e}") from None
    return answer


def lookup(lookupd: str, topic: str, secret: str | None) -> list[tuple[str, int, int]]:
    """(broadcast_address, tcp_port, http_port) of the topic's producers as one lookupd lists them."""
    url = f"{lookupd_url(lookupd, 'lookup')}?topic={quote(topic)}"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.nsq; version=1.0"})
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=LOOKUP_TIMEOUT) as answer:
            document = json.load(answer)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []  # TOPIC_NOT_FOUND: no broker has it (yet)
        raise BrokerError(f"mqd: lookupd {lookupd}: HTTP {e.code} {e.reason}") from None
    except (OSError, ValueError) as e:
        raise BrokerError(f"mqd: lookupd {lookupd}: {getattr(e, 'reason', e)}") from None
    if isinstance(document, dict) and "data" in document and "status_code" in document:
        document = document["data"]
    rows = document.get("producers") if isinstance(document, dict) else None
    out = []
    for row in rows if isinstance(rows, list) else ():
        if not isinstance(row, dict):
            continue
        host, tcp, http = row.get("broadcast_address"), row.get("tcp_port"), row.get("http_port")
        if (isinstance(host, str) and host and all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536
                                                   for p in (tcp, http))):
            out.append((host, int(tcp), int(http)))  # type: ignore[arg-type]
    return out


def _reason(error: BaseException) -> str:
    """A connection failure in words: the OS's message ("Connection refused"), not its number."""
    import os

    code = getattr(error, "osError", None)
    if isinstance(code, int):
        return os.strerror(code)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__
