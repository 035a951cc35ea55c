"""``python -m bench latency --output-buffer-timeout``: the readers' IDENTIFY carries the field.

A stand-in broker on a loopback socket records what a bench reader sends, so
the test sees the IDENTIFY body itself: ``output_buffer_timeout`` is there
when asked for, with the value asked, and absent otherwise (the broker's
default then applies, which an explicit 0 or -1 would not mean).
"""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from bench.harness import wire
from bench.harness.load import ReaderConfig, consume
from bench.harness.session import parse_args as bench_parse_args
from bench.scenarios.latency import PacedRun, PacedSession, buffer_note, markdown
from bench.scenarios.latency import parse as latency_parse


def _response(payload: bytes, ftype: int = wire.FRAME_RESPONSE) -> bytes:
    return struct.pack(">ii", len(payload) + 4, ftype) + payload


class StandInBroker:
    """Accepts one V2 connection: answers IDENTIFY (echoing the timeout it was asked for,
    as nsqd grants -1 as 0), SUB with OK, CLS with CLOSE_WAIT; keeps the IDENTIFY body."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()[:2]
        self.identify: dict | None = None
        self.commands: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            f = conn.makefile("rb")
            assert f.read(4) == wire.MAGIC
            while True:
                line = f.readline()
                if not line:
                    return
                self.commands.append(line.strip())
                if line == b"IDENTIFY\n":
                    (size,) = wire.SIZE.unpack(f.read(4))
                    self.identify = json.loads(f.read(size))
                    asked = self.identify.get("output_buffer_timeout", 0)
                    granted = 250 if asked == 0 else max(asked, 0)
                    answer = {"max_rdy_count": 2500, "output_buffer_timeout": granted}
                    conn.sendall(_response(json.dumps(answer).encode()))
                elif line.startswith(b"SUB "):
                    conn.sendall(_response(b"OK"))
                elif line == b"CLS\n":
                    conn.sendall(_response(b"CLOSE_WAIT"))
                    return

    def close(self) -> None:
        self.thread.join(10)
        self.server.close()


@pytest.fixture
def broker():
    b = StandInBroker()
    yield b
    b.close()


def _reader(address: tuple[str, int], timeout: int | None) -> ReaderConfig:
    return ReaderConfig(address, "t", "c", rdy=10, duration=0.2, output_buffer_timeout=timeout)


@pytest.mark.parametrize(("asked", "granted"), [(-1, 0), (25, 25), (0, 250)])
def test_reader_identify_carries_the_timeout_asked_for(broker, asked, granted):
    result = consume(_reader(broker.address, asked))
    assert broker.identify is not None
    assert broker.identify["output_buffer_timeout"] == asked
    assert broker.identify["feature_negotiation"] is True
    assert result["output_buffer_timeout"] == granted  # what the broker settled on
    assert broker.commands[:2] == [b"IDENTIFY", b"SUB t c"]


def test_reader_identify_leaves_the_field_out_by_default(broker):
    result = consume(_reader(broker.address, None))
    assert broker.identify is not None
    assert "output_buffer_timeout" not in broker.identify
    assert broker.identify["client_id"] == "bench"
    assert result["output_buffer_timeout"] == 250


def test_identify_body_adds_fields_only_when_given():
    assert "output_buffer_timeout" not in json.loads(wire.identify_body("x"))
    body = json.loads(wire.identify_body("x", {"output_buffer_timeout": -1}))
    assert body["output_buffer_timeout"] == -1
    assert body["client_id"] == "x" and body["feature_negotiation"] is True


def test_latency_option_reaches_every_reader_config():
    own, args = latency_parse(["--output-buffer-timeout", "-1", "--readers", "3"])
    assert own.output_buffer_timeout == -1
    session = PacedSession(args, ("127.0.0.1", 1), None, None)
    session.output_buffer_timeout = own.output_buffer_timeout
    cfgs = session._reader_cfgs(1.0, None, None)
    assert [c.output_buffer_timeout for c in cfgs] == [-1, -1, -1]
    assert all(c.identify_fields() == {"output_buffer_timeout": -1} for c in cfgs)


def test_latency_default_sends_no_timeout():
    own, args = latency_parse([])
    assert own.output_buffer_timeout is None
    session = PacedSession(args, ("127.0.0.1", 1), None, None)
    session.output_buffer_timeout = own.output_buffer_timeout
    assert all(c.identify_fields() == {} for c in session._reader_cfgs(1.0, None, None))


def test_latency_rejects_a_timeout_below_minus_one(capsys):
    with pytest.raises(SystemExit):
        latency_parse(["--output-buffer-timeout", "-2"])
    assert "--output-buffer-timeout" in capsys.readouterr().err


def test_report_says_what_was_asked_and_granted():
    assert buffer_note(-1, [0, 0]) == (
        "readers' IDENTIFY output_buffer_timeout=-1 (granted 0 ms: output buffering off)"
    )
    assert buffer_note(None, [250]).startswith("no output_buffer_timeout in the readers' IDENTIFY")
    assert "did not say" in buffer_note(25, [None])
    own, args = latency_parse(["--output-buffer-timeout", "-1"])
    run = PacedRun("50% of max", 100.0, 99.0, 98.0, 1.0, 2.0, 3.0, 10, None, [0, 0])
    text = markdown([run], args, own, "twistd -n mqd")
    assert "- output buffering: readers' IDENTIFY output_buffer_timeout=-1 (granted 0 ms" in text


def test_bench_args_are_untouched_by_the_latency_option():
    # The option is latency's own: python -m bench's parser never sees it.
    own, args = latency_parse(["--output-buffer-timeout", "25", "--duration", "2"])
    assert own.output_buffer_timeout == 25
    assert not hasattr(args, "output_buffer_timeout")
    assert vars(args).keys() == vars(bench_parse_args(["both"])).keys()
