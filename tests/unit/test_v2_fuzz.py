"""Property tests of the V2 parser: arbitrary input never escapes dataReceived, and
how a valid stream is split into reads never changes what the broker answers."""

from __future__ import annotations

import json
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqd.message import IdFactory
from tests.support.inprocess_broker import NODE_ID, START_TIME
from tests.support.inprocess_fuzz import check_answer_or_close, fresh_broker
from tests.support.v2_client import Client
from tests.support.v2_frames import (
    CLOSE_WAIT,
    MAGIC,
    Msg,
    cmd,
    dpub,
    err,
    identify,
    mpub,
    ok,
    parse_frames,
    pub,
    sized,
)

COMMAND_LINES = [
    cmd("NOP"),
    cmd("SUB", "t", "c"),
    cmd("SUB", "t#ephemeral", "c#ephemeral"),
    cmd("SUB", "t"),
    cmd("RDY", 5),
    cmd("RDY", 0),
    cmd("RDY", "x"),
    cmd("RDY"),
    cmd("FIN", "0123456789abcdef"),
    cmd("FIN", "short"),
    cmd("REQ", "0123456789abcdef", 10),
    cmd("REQ", "0123456789abcdef", "x"),
    cmd("TOUCH", "0123456789abcdef"),
    cmd("CLS"),
    cmd("PUB", "t"),
    cmd("MPUB", "t"),
    cmd("DPUB", "t", 100),
    cmd("IDENTIFY"),
    cmd("AUTH"),
    b"\n",
    b"\r\n",
    b" ",
    pub("t", b"hello"),
    mpub("t", [b"a", b"b"]),
    dpub("t", 5, b"later"),
    identify(feature_negotiation=True),
    identify(heartbeat_interval=-1),
]

token = st.one_of(
    st.sampled_from(COMMAND_LINES),
    st.binary(max_size=40),
    st.binary(max_size=12).map(sized),
    st.integers(-(2**31), 2**31 - 1).map(lambda n: n.to_bytes(4, "big", signed=True)),
)
streams = st.lists(token, max_size=16).map(b"".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=streams, chunk=st.integers(1, 64))
def test_random_input_is_answered_or_closed(data, chunk):
    with tempfile.TemporaryDirectory() as path:
        broker, clock = fresh_broker(path)
        c = Client(broker)
        for i in range(0, len(data), chunk):
            c.send(data[i : i + chunk])
        check_answer_or_close(c)
        # Whatever state it was left in, time passing and the socket closing
        # must not raise either.
        clock.advance(61)
        c.lose()
        clock.advance(61)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_after_magic(data):
    with tempfile.TemporaryDirectory() as path:
        broker, _ = fresh_broker(path)
        c = Client(broker)
        c.send(data)
        check_answer_or_close(c)
        c.lose()


def _valid_stream() -> bytes:
    return (
        MAGIC
        + identify(feature_negotiation=True, client_id="fuzz", msg_timeout=5000)
        + pub("t", b"before-sub")
        + cmd("SUB", "t", "c")
        + cmd("RDY", 3)
        + mpub("t", [b"m1", b"m2", b"m3", b"m4", b"m5", b"m6"])
        + dpub("t", 10, b"deferred")
        + cmd("NOP")
        + cmd("FIN", "0000000000000000")
        + cmd("TOUCH", "0000000000000000")
        + cmd("REQ", "0000000000000000", 100)
        + cmd("RDY", 4)
        + pub("other", b"x" * 200)
        + cmd("RDY", 5)
        + cmd("RDY", 4)
        + cmd("RDY", 10)
        + cmd("CLS")
        + cmd("RDY", 5)
        + cmd("FIN", "0000000000000000")
        + cmd("PUB", "bad!")
        + sized(b"never read")
    )


def _replay(chunks: list[bytes]) -> tuple[bytes, bool]:
    with tempfile.TemporaryDirectory() as path:
        broker, _ = fresh_broker(path)
        c = Client(broker, magic=False)
        for chunk in chunks:
            c.send(chunk)
        return c.raw(), c.closed


STREAM = _valid_stream()


_IDS = IdFactory(NODE_ID).new_ids(10, int(START_TIME * 1e9))


def _msg(n: int, body: bytes) -> Msg:
    return Msg(int(START_TIME * 1e9), 1, _IDS[n], body)


def test_valid_stream_reference_output():
    out, closed = _replay([STREAM])
    frames = parse_frames(out)
    assert json.loads(frames[0].payload)["msg_timeout"] == 5000
    assert frames[1:] == [
        ok(),  # PUB before-sub
        ok(),  # SUB
        _msg(0, b"before-sub"),  # RDY 3, delivered before the next command that answers
        ok(),  # MPUB: its messages are delivered once the command is done
        _msg(1, b"m1"),
        _msg(2, b"m2"),
        ok(),  # DPUB
        err("E_FIN_FAILED FIN 0000000000000000 failed ID not in flight"),
        err("E_TOUCH_FAILED TOUCH 0000000000000000 failed ID not in flight"),
        err("E_REQ_FAILED REQ 0000000000000000 failed ID not in flight"),
        _msg(3, b"m3"),  # RDY 4
        ok(),  # PUB other
        _msg(4, b"m4"),  # RDY 5; RDY 4 takes nothing back
        _msg(5, b"m5"),  # RDY 10
        _msg(6, b"m6"),
        CLOSE_WAIT,  # then RDY is ignored
        err("E_FIN_FAILED FIN 0000000000000000 failed ID not in flight"),
        err('E_BAD_TOPIC PUB topic name "bad!" is not valid'),
    ]
    assert closed


def test_every_single_cut_gives_identical_output():
    expected = _replay([STREAM])
    for i in range(1, len(STREAM)):
        assert _replay([STREAM[:i], STREAM[i:]]) == expected, f"cut at {i}: {STREAM[i - 10:i + 10]!r}"


def test_byte_by_byte_gives_identical_output():
    expected = _replay([STREAM])
    assert _replay([STREAM[i : i + 1] for i in range(len(STREAM))]) == expected


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=40))
def test_any_split_gives_identical_output(cuts):
    expected = _replay([STREAM])
    points = sorted(set(cuts) | {0, len(STREAM)})
    chunks = [STREAM[a:b] for a, b in zip(points, points[1:], strict=False)]
    assert _replay(chunks) == expected


def _fin_run_stream() -> bytes:
    """A reader's FIN pipeline (the parser's FIN fast path) broken by every
    way a FIN can fail or end a run: a repeat, a CRLF line, other commands,
    and last a malformed id, which is fatal. It names only messages the
    reader has been sent (FIN_SETUP delivers six of eight)."""
    ids = [_IDS[n].decode() for n in range(8)]
    return (
        cmd("FIN", ids[0])
        + cmd("FIN", ids[1])
        + cmd("FIN", ids[0])
        + b"FIN " + ids[2].encode() + b"\r\n"
        + cmd("FIN", ids[3])
        + cmd("TOUCH", ids[4])
        + cmd("FIN", ids[5])
        + cmd("NOP")
        + cmd("FIN", ids[6])
        + cmd("FIN", ids[4])
        + cmd("FIN", "short")
        + cmd("FIN", ids[7])
    )


FIN_SETUP = MAGIC + cmd("SUB", "t", "c") + mpub("t", [b"b%d" % n for n in range(8)]) + cmd("RDY", 6)
FIN_RUN = _fin_run_stream()


def test_fin_run_reference_output(tmp_path):
    broker, _ = fresh_broker(str(tmp_path))
    c = Client(broker, magic=False)
    c.send(FIN_SETUP)
    c.send(FIN_RUN)
    channel = broker.topics["t"].channels["c"]
    # 0, 1, 2 (CRLF), 3, 5, 6 and 4 after its TOUCH; 7 is never reached
    assert c.proto.finish_count == 7
    assert channel.depth() + channel.in_flight_count() == 1
    assert c.closed
    frames = parse_frames(c.raw())
    assert frames[:8] == [ok(), ok()] + [_msg(n, b"b%d" % n) for n in range(6)]
    assert frames[8:] == [
        _msg(6, b"b6"),  # FIN 0 and 1 free two slots of RDY 6
        _msg(7, b"b7"),
        err(f"E_FIN_FAILED FIN {_IDS[0].decode()} failed ID not in flight"),
        err("E_INVALID invalid message ID"),
    ]


def test_fin_run_any_cut_gives_identical_output():
    expected = _replay([FIN_SETUP, FIN_RUN])
    for i in range(1, len(FIN_RUN)):
        assert _replay([FIN_SETUP, FIN_RUN[:i], FIN_RUN[i:]]) == expected, f"cut at {i}"
    assert _replay([FIN_SETUP] + [FIN_RUN[i : i + 1] for i in range(len(FIN_RUN))]) == expected


PUB_RUN = (
    MAGIC
    + pub("t", b"a")
    + pub("t", b"b")
    + pub("u", b"c")
    + b"PUB t\r\n" + sized(b"d")
    + cmd("NOP")
    + pub("t", b"e" * 300)
    + cmd("PUB", "t", "extra") + sized(b"f")
    + pub("bad!", b"x")
)


def test_pub_run_reference_output(tmp_path):
    """A publisher's pipelined PUBs (the parser's PUB run): one OK each, in
    order, across topic changes, CRLF, other commands and extra params; the
    bad name after them is fatal and publishes nothing."""
    broker, _ = fresh_broker(str(tmp_path))
    c = Client(broker, magic=False)
    c.send(PUB_RUN)
    assert parse_frames(c.raw()) == [ok()] * 6 + [err('E_BAD_TOPIC PUB topic name "bad!" is not valid')]
    assert c.closed
    assert broker.topics["t"].message_count == 5
    assert broker.topics["u"].message_count == 1
    assert [m.body for m in broker.topics["t"].peek(10)] == [b"a", b"b", b"d", b"e" * 300, b"f"]


def test_pub_run_any_cut_gives_identical_output():
    expected = _replay([PUB_RUN])
    for i in range(1, len(PUB_RUN)):
        assert _replay([PUB_RUN[:i], PUB_RUN[i:]]) == expected, f"cut at {i}"
