"""``python -m bench scale-out`` without brokers: options, pinning, discovery, the report.

Figures are never asserted; these check what the figures rest on: which core
each broker is pinned to, how the load is spread, that the producers a
lookupd lists are read right in both answer shapes (and over HTTP from a
stand-in lookupd), that discovery waits for exactly the brokers started, and
the medians and ratios of the table.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.harness.broker import BenchError
from bench.scenarios import scale_out
from bench.scenarios.scale_out import (
    LOOKUP_ACCEPT,
    Run,
    assign_cores,
    base_row,
    broker_argv,
    broker_cpu_text,
    busy_percent,
    lookup_producers,
    parse,
    per_broker_core,
    run_order,
    spread,
    summarize,
    table,
    uneven,
)


def producer(host: str, port: object) -> dict:
    """A /lookup producer row as mqlookupd and nsqlookupd give it."""
    return {"remote_address": f"{host}:50000", "hostname": "h", "broadcast_address": host,
            "tcp_port": port, "http_port": 4151, "version": "1.3.0"}


# -- options ------------------------------------------------------------------------------


@pytest.fixture
def with_taskset(monkeypatch):
    monkeypatch.setattr(scale_out.shutil, "which", lambda name: f"/usr/bin/{name}")


def test_defaults_give_every_broker_a_writer_and_a_reader(with_taskset):
    args = parse([])
    assert args.brokers == [1, 2]
    assert (args.writers, args.readers) == (2, 2)
    assert (args.size, args.batch, args.pipeline, args.backend) == (200, 100, 1, "memory")
    assert (args.duration, args.repeat, args.no_pin) == (10.0, 3, False)
    assert args.timeout == 70.0
    # What the session's load line and plumbing read.
    assert (args.mode, args.count) == ("mpub", None)


def test_load_is_sized_by_the_largest_broker_count_and_the_same_for_all(with_taskset):
    args = parse(["--brokers", "1", "4", "2", "4", "--duration", "5"])
    assert args.brokers == [1, 4, 2]  # each count once, in the order given
    assert (args.writers, args.readers) == (4, 4)
    assert args.timeout == 65.0
    assert parse(["--brokers", "1", "2", "--writers", "6", "--timeout", "9"]).writers == 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--brokers", "0", "1"], "at least 1"),
        (["--brokers", "1", "3", "--writers", "2"], "at least 3"),
        (["--brokers", "2", "--readers", "1"], "at least 2"),
        (["--repeat", "0"], "--repeat"),
        (["--duration", "0"], "--duration"),
        (["--size", "4"], "8-byte timestamp"),
    ],
)
def test_rejects_options_it_cannot_run(with_taskset, capsys, argv, message):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_pinning_needs_taskset_unless_no_pin(monkeypatch, capsys):
    monkeypatch.setattr(scale_out.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit):
        parse([])
    assert "--no-pin" in capsys.readouterr().err
    assert parse(["--no-pin"]).no_pin


def test_uneven_spreads_are_pointed_out(with_taskset):
    assert uneven(parse(["--brokers", "1", "2"])) == []
    notes = uneven(parse(["--brokers", "1", "2", "--writers", "3"]))
    assert notes == ["note: 3 writers over 2 brokers: 2 on some, 1 on others"]


# -- cores, load and order ------------------------------------------------------------------


def test_broker_i_runs_on_core_i_mod_the_cores():
    assert assign_cores(1, [0, 1]) == [0]
    assert assign_cores(2, [0, 1]) == [0, 1]
    assert assign_cores(5, [0, 1]) == [0, 1, 0, 1, 0]
    # The cores this process may use, not 0..n-1: a restricted cpuset is honoured.
    assert assign_cores(3, [2, 5]) == [2, 5, 2]
    with pytest.raises(ValueError):
        assign_cores(1, [])


def test_broker_command_registers_with_the_lookupd_and_is_pinned(with_taskset):
    args = parse(["--broker-arg=--max-rdy-count=5000"])
    pinned = broker_argv(args, ("127.0.0.1", 4160), 1)
    assert pinned[:3] == ["taskset", "-c", "1"]
    assert pinned[6] == "mqd"
    assert "--lookupd-tcp-address=127.0.0.1:4160" in pinned
    assert "--broadcast-address=127.0.0.1" in pinned  # what /lookup must list to be reachable
    assert "--backend=memory" in pinned and pinned[-1] == "--max-rdy-count=5000"
    assert "--tcp-address=127.0.0.1:0" in pinned  # ephemeral ports: brokers never collide
    assert broker_argv(args, ("127.0.0.1", 4160), None)[3] == "mqd"


def test_load_is_spread_round_robin():
    a, b = ("127.0.0.1", 1), ("127.0.0.1", 2)
    assert spread(4, [a, b]) == [a, b, a, b]
    assert spread(2, [a]) == [a, a]
    with pytest.raises(ValueError):
        spread(2, [])


def test_repetitions_alternate_the_order():
    assert run_order([1, 2, 4], 0) == [1, 2, 4]
    assert run_order([1, 2, 4], 1) == [4, 2, 1]
    assert run_order([1, 2, 4], 2) == [1, 2, 4]


def test_busy_percent_is_of_one_core():
    assert busy_percent((10.0, 100.0), (15.0, 110.0), 2) == pytest.approx(100.0)
    assert busy_percent((10.0, 100.0), (10.0, 100.0), 2) is None


# -- discovery --------------------------------------------------------------------------------


def test_lookup_producers_flat_answer():
    doc = {"channels": ["ch"], "producers": [producer("127.0.0.1", 4250), producer("127.0.0.1", 4150),
                                             producer("127.0.0.1", 4150)]}
    assert lookup_producers(doc) == [("127.0.0.1", 4150), ("127.0.0.1", 4250)]


def test_lookup_producers_legacy_envelope_and_empty():
    doc = {"status_code": 200, "status_txt": "OK",
           "data": {"channels": [], "producers": [producer("10.0.0.2", 4150)]}}
    assert lookup_producers(doc) == [("10.0.0.2", 4150)]
    assert lookup_producers({"channels": ["ch"], "producers": []}) == []
    assert lookup_producers({"channels": []}) == []


def test_lookup_producers_skips_rows_without_an_address():
    doc = {"producers": [
        producer("", 4150), producer("h", 0), producer("h", True), producer("h", "4150"),
        {"tcp_port": 4150}, "garbage", producer("h", 70000), producer("ok", 4150),
    ]}
    assert lookup_producers(doc) == [("ok", 4150)]


@pytest.mark.parametrize("doc", [[], "text", {"producers": {"a": 1}}])
def test_lookup_producers_rejects_what_is_not_a_lookup_answer(doc):
    with pytest.raises(BenchError):
        lookup_producers(doc)


class StandIn:
    """A stand-in lookupd: answers /lookup from ``answers`` (the last one repeats)."""

    def __init__(self, answers: list[tuple[int, object]]) -> None:
        self.answers = answers
        self.requests: list[tuple[str, str | None]] = []


@pytest.fixture
def lookupd() -> Iterator[tuple[str, StandIn]]:
    state = StandIn([])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            state.requests.append((self.path, self.headers.get("Accept")))
            status, doc = state.answers.pop(0) if len(state.answers) > 1 else state.answers[0]
            body = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def test_lookup_asks_as_a_consumer_does(lookupd):
    address, state = lookupd
    state.answers = [(200, {"channels": ["ch"], "producers": [producer("127.0.0.1", 4150)]})]
    assert scale_out.lookup(address, "bench") == [("127.0.0.1", 4150)]
    assert state.requests == [("/lookup?topic=bench", LOOKUP_ACCEPT)]


def test_lookup_of_an_unknown_topic_is_no_producer(lookupd):
    address, state = lookupd
    state.answers = [(404, {"message": "TOPIC_NOT_FOUND"})]
    assert scale_out.lookup(address, "bench") == []


def test_lookup_answer_that_is_not_json_is_a_bench_error(lookupd):
    address, state = lookupd
    state.answers = [(200, b"<html>")]
    with pytest.raises(BenchError, match="not JSON"):
        scale_out.lookup(address, "bench")


def test_discover_waits_for_exactly_the_brokers_started(lookupd):
    address, state = lookupd
    old, a, b = ("127.0.0.1", 1000), ("127.0.0.1", 1001), ("127.0.0.1", 1002)
    state.answers = [
        (404, {"message": "TOPIC_NOT_FOUND"}),  # not registered yet
        (200, {"producers": [producer(*old), producer(*a)]}),  # a stopped broker still listed
        (200, {"producers": [producer(*a)]}),  # one of two
        (200, {"producers": [producer(*b), producer(*a)]}),
    ]
    assert scale_out.discover(address, "bench", {a, b}, timeout=10) == [a, b]
    assert len(state.requests) == 4


def test_discover_gives_up_saying_what_was_listed(lookupd):
    address, state = lookupd
    state.answers = [(200, {"producers": [producer("127.0.0.1", 1000)]})]
    with pytest.raises(BenchError, match="1000"):
        scale_out.discover(address, "bench", {("127.0.0.1", 1001)}, timeout=0.2)


# -- the report -------------------------------------------------------------------------------


def runs() -> list[Run]:
    return [
        Run(1, rate_in=100.0, rate_out=90.0, broker_cpu=[90.0], load_cpu=50.0, machine_cpu=141.0),
        Run(2, rate_in=150.0, rate_out=160.0, broker_cpu=[60.0, 70.0], load_cpu=60.0,
            machine_cpu=195.0),
        Run(2, rate_in=170.0, rate_out=180.0, broker_cpu=[64.0, 76.0], load_cpu=62.0,
            machine_cpu=196.0),
        Run(1, rate_in=120.0, rate_out=110.0, broker_cpu=[94.0], load_cpu=52.0, machine_cpu=145.0),
        Run(2, rate_in=None, rate_out=170.0, broker_cpu=[62.0, 72.0], load_cpu=None,
            machine_cpu=None),
    ]


def test_summarize_takes_each_median_per_broker_count():
    one, two = summarize(runs())
    assert (one.brokers, one.runs, one.rate_in, one.rate_out) == (1, 2, 110.0, 100.0)
    assert one.broker_cpu == [92.0]
    assert (two.brokers, two.runs) == (2, 3)
    assert (two.rate_in, two.rate_out) == (160.0, 170.0)  # a missing figure is left out
    assert two.broker_cpu == [62.0, 72.0]  # per broker position
    assert (two.load_cpu, two.machine_cpu) == (61.0, 195.5)
    # 90 / 0.9 and 110 / 0.94; 160 / 1.3, 180 / 1.4, 170 / 1.34.
    assert one.out_per_core == pytest.approx((100.0 + 110.0 / 0.94) / 2)
    assert two.out_per_core == pytest.approx(170.0 / 1.34)


def test_per_broker_core_is_the_rate_over_the_cores_the_brokers_had():
    assert per_broker_core(300.0, [75.0]) == pytest.approx(400.0)
    assert per_broker_core(300.0, [50.0, 100.0]) == pytest.approx(200.0)
    assert per_broker_core(None, [50.0]) is None
    assert per_broker_core(300.0, []) is None
    assert per_broker_core(300.0, [0.0]) is None


def test_broker_cpu_text():
    assert broker_cpu_text([]) == "-"
    assert broker_cpu_text([92.4]) == "92%"
    assert broker_cpu_text([60.0, 70.0]) == "65% (60-70%)"


def test_base_row_is_one_broker_else_the_fewest():
    rows = summarize(runs())
    assert base_row(rows).brokers == 1
    assert base_row(rows[1:]).brokers == 2
    assert base_row([]) is None


def test_table_divides_by_one_broker(with_taskset):
    args = parse(["--brokers", "1", "2", "--duration", "5"])
    text = table(summarize(runs()), args, 2, "twistd -n mqd --backend=memory", 0.4, 1.2)
    lines = text.splitlines()
    assert lines[0].startswith("mqd scale-out, ") and "load average 0.40 before, 1.20 after" in lines[0]
    assert "2 cores: 200% in all" in text
    assert "2 writers (MPUB x100, 200 B bodies, pipeline 1), 2 readers" in text
    header = next(line for line in lines if line.startswith("| brokers"))
    assert "÷ 1 broker (in / out)" in header
    rows = [line for line in lines if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows[0] == "| 1 | 110 | 100 | 92% | 51% | 143% | 143% | 109 | - / - | 1.00 / 1.00 |"
    # 160 / 110 and 170 / 100; brokers + load = 62 + 72 + 61.
    assert rows[1] == "| 2 | 160 | 170 | 67% (62-72%) | 61% | 195% | 196% | 127 | - / - | 1.45 / 1.70 |"


def test_table_without_one_broker_divides_by_the_fewest(with_taskset):
    args: argparse.Namespace = parse(["--brokers", "2", "4"])
    rows = summarize([Run(2, rate_in=200.0, rate_out=200.0, broker_cpu=[50.0, 50.0]),
                      Run(4, rate_in=300.0, rate_out=100.0, broker_cpu=[25.0] * 4)])
    text = table(rows, args, 4, "twistd -n mqd", 0.0, 0.0)
    assert "÷ 2 brokers (in / out)" in text
    assert text.splitlines()[-1].endswith("| 1.50 / 0.50 |")
