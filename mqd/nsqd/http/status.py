"""What monitoring reads: `/ping` (health), `/info` (version, static config), `/stats`."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from twisted.web.server import Request

from mqd import NSQ_VERSION
from mqd.http.args import Query, query_of
from mqd.http.endpoint import Endpoint, PlainTextEndpoint
from mqd.http.response import ApiError, nanoseconds
from mqd.nsqd.stats import stats_json, stats_text

__all__ = ["Info", "Ping", "Stats", "includes_clients"]

# nsqd's `boolParams` for include_clients / include_mem; anything else means the default.
_BOOL_PARAMS = {"true": True, "1": True, "false": False, "0": False}


def includes_clients(query: Query) -> bool:
    """Whether `/stats` answers with its clients' details (`include_clients`, true unless false or 0).

    Read by the endpoint and by the grant `--http-auth-required` asks of it,
    so both always agree on what the answer shows.
    """
    return _BOOL_PARAMS.get(query.first("include_clients") or "", True)


class Ping(PlainTextEndpoint):
    """`GET /ping`: `OK`, or `500 NOK - <error>` after a storage failure."""

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> str:
        health = self.broker.health
        if health:
            raise ApiError(500, f"NOK - {health}")
        return "OK"


class Info(Endpoint):
    """`GET /info`: what nsqadmin and lookupd-less tools read to identify a broker."""

    def __init__(self, broker: Any, ports: Mapping[str, int]) -> None:
        super().__init__(broker)
        # Bound ports, filled in once the listeners are up (port 0 picks one).
        self.ports = ports

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> dict[str, Any]:
        opts = self.broker.options
        return {
            "version": NSQ_VERSION,
            "broadcast_address": opts.broadcast_address,
            "hostname": socket.gethostname(),
            # The bound ports, -1 for a unix socket, as nsqd reports them.
            "http_port": self.ports.get("HTTP", -1),
            "tcp_port": self.ports.get("TCP", -1),
            "start_time": self.broker.start_time,
            "max_heartbeat_interval": nanoseconds(opts.max_heartbeat_interval),
            "max_output_buffer_size": opts.max_output_buffer_size,
            "max_output_buffer_timeout": nanoseconds(opts.max_output_buffer_timeout),
            "max_deflate_level": opts.max_deflate_level,
            # No --topology-* options (IDENTIFY answers them empty too).
            "topology_zone": "",
            "topology_region": "",
        }


class Stats(Endpoint):
    """`GET /stats`: text unless `format=json`; filters `topic`, `channel`; `include_*` flags.

    The figures are built by mqd.nsqd.stats, which statsd and Prometheus share;
    this only reads the parameters as nsqd does (an empty or missing filter
    is no filter, an unrecognised boolean means true).
    """

    def handle_GET(self, request: Request, params: Mapping[str, str]) -> Any:
        query = query_of(request)
        topic = query.first("topic") or None
        channel = query.first("channel") or None
        include_clients = includes_clients(query)
        include_mem = _BOOL_PARAMS.get(query.first("include_mem") or "", True)
        if query.first("format") == "json":
            return stats_json(self.broker, topic, channel, include_clients, include_mem)
        return stats_text(self.broker, topic, channel, include_clients, include_mem)
