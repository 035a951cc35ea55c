"""Fuzzing a real broker over sockets: random V2 streams and HTTP requests, checked in batches.

With `callers` (a broker under --http-auth-required), each HTTP request
comes from a random caller (tests/support/auth_fuzz.py's kinds), and a
refusal must be nsqd's JSON 401/403 and leave the broker's topics and
channels (names, pause flags, counts) as they were.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.support.control_checks import Control, raw_http
from tests.support.fuzz_inputs import (
    HTTP_BODIES,
    HTTP_QUERY_VALUES,
    random_http_request,
    random_v2_stream,
)
from tests.support.processes import BrokerProcess


@dataclass
class FuzzReport:
    streams: int = 0
    http_requests: int = 0
    closed_by_broker: int = 0
    http_500: list[str] = field(default_factory=list)
    http_no_answer: list[str] = field(default_factory=list)
    bad_refusals: list[str] = field(default_factory=list)
    refused: int = 0
    seconds: float = 0.0

    @property
    def inputs(self) -> int:
        return self.streams + self.http_requests


def _send_streams(broker: BrokerProcess, streams: list[bytes], settle: float) -> int:
    """Open one connection per stream, send it, read what comes back for `settle` seconds.

    Returns how many connections the broker closed. A send may fail (the
    broker closed on a fatal error before all was sent): that is allowed.
    """
    socks = []
    for data in streams:
        s = socket.create_connection((broker.tcp_host, broker.tcp_port), timeout=5)
        s.settimeout(1.0)
        try:
            s.sendall(data)
        except OSError:
            pass
        s.setblocking(False)
        socks.append(s)
    closed = 0
    deadline = time.monotonic() + settle
    open_socks = set(socks)
    while open_socks and time.monotonic() < deadline:
        time.sleep(0.01)
        for s in list(open_socks):
            try:
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        closed += 1
                        open_socks.discard(s)
                        break
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
                open_socks.discard(s)
    for s in socks:
        s.close()
    return closed


def fuzz_broker(broker: BrokerProcess, control: Control, *, streams: int, http_requests: int,
                seed: int, batch: int = 25, settle: float = 0.15,
                progress: Callable[[str], None] | None = None,
                callers: Callable[[random.Random], tuple[str, dict[str, str]]] | None = None) -> FuzzReport:
    """Random V2 streams over real sockets and random HTTP requests, in batches.

    After each batch the control checks run (the broker still serves a
    well-behaved client and still counts every control message). 500s and
    requests left unanswered are collected, not raised, so one run shows them all.
    `callers(rng)`: the (kind, headers) of each HTTP request's caller (see the module doc).
    """
    rng = random.Random(seed)
    report = FuzzReport()
    t0 = time.monotonic()
    while report.streams < streams or report.http_requests < http_requests:
        n = min(batch, streams - report.streams)
        if n > 0:
            report.closed_by_broker += _send_streams(
                broker, [random_v2_stream(rng) for _ in range(n)], settle)
            report.streams += n
        for _ in range(min(batch // 5 or 1, http_requests - report.http_requests)):
            method, target, body = random_http_request(rng)
            if target.startswith("/snapshot") and rng.random() < 0.7:
                target = "/ping"  # each snapshot copies the store: only a few
            _http_case(broker, report, method, target, body, control, callers, rng)
        control.check(f"{report.streams} streams / {report.http_requests} HTTP requests")
        if progress is not None:
            progress(f"fuzz: {report.streams} streams, {report.http_requests} HTTP requests")
    # The corners random requests rarely reach: every snapshot name, every config body.
    sweep = [("POST", f"/snapshot?out={value}", None) for value in HTTP_QUERY_VALUES]
    sweep += [("PUT", f"/config/{opt}", body) for opt in ("nsqlookupd_tcp_addresses", "log_level")
              for body in HTTP_BODIES]
    sweep.append(("PUT", "/config/log_level", b"info"))
    for method, target, body in sweep:
        _http_case(broker, report, method, target, body, control, callers, rng)
    if callers is not None:  # the last reset above may have been refused
        control.http("PUT", "/config/log_level", b"info")
    control.check("the snapshot and config sweep")
    report.seconds = time.monotonic() - t0
    return report


def queues(control: Control) -> list:
    """The broker's topics and channels: names, pause flags, counts (`/stats` without clients)."""
    status, body = control.http("GET", "/stats?format=json&include_clients=false")
    assert status == 200, (status, body[:300])
    return [(t["topic_name"], t["paused"], t["message_count"], t["depth"],
             [(c["channel_name"], c["paused"], c["depth"], c["message_count"]) for c in t["channels"] or []])
            for t in json.loads(body)["topics"] or []]


REFUSED_AS = {"none": (401, "AUTH_REQUIRED"), "malformed": (401, "AUTH_REQUIRED"), "wrong": (401, "AUTH_FAILED"),
              "partial": (403, "UNAUTHORIZED"), "full": (403, "UNAUTHORIZED")}


def _http_case(broker: BrokerProcess, report: FuzzReport, method: str, target: str,
               body: bytes | None, control: Control, callers, rng: random.Random) -> None:
    kind, headers = callers(rng) if callers is not None else ("", {})
    before = queues(control) if callers is not None else None
    status, answer = raw_http(broker, method, target, body, headers=headers)
    report.http_requests += 1
    shown = f"{method} {target[:120]} {kind} {str(headers)[:60]} body={(body or b'')[:40]!r} -> {answer[:200]!r}"
    if status == 500:
        report.http_500.append(shown)
    elif status == 0 and method != "CONNECT":
        report.http_no_answer.append(shown)
    elif callers is not None and (status in (401, 403) or kind in ("none", "malformed", "wrong")):
        report.refused += status in (401, 403)
        problems = []
        if queues(control) != before:
            problems.append("changed the queues")
        if status in (401, 403) and method != "HEAD":
            try:
                message = json.loads(answer)
            except ValueError:
                message = None
            if message != {"message": REFUSED_AS[kind][1]} or status != REFUSED_AS[kind][0]:
                problems.append(f"answered {status} {message}")
        if problems:
            report.bad_refusals.append(f"{shown}: " + ", ".join(problems))
