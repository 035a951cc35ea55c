"""V2 connection basics: protocol magic, command framing, heartbeats and read timeouts."""

from __future__ import annotations

import gc
import weakref

import pytest

from mqd.nsqd.protocol.v2 import MAX_LINE, STATE_INIT, STATE_SUBSCRIBED
from tests.support.inprocess_broker import new_broker, scan
from tests.support.v2_client import Client
from tests.support.v2_frames import (
    CLOSE_WAIT,
    HEARTBEAT,
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

# -- magic -------------------------------------------------------------------------


def test_good_magic_is_silent(connect):
    c = connect()
    assert c.raw() == b""
    assert not c.closed
    assert c.request(cmd("NOP")) == []
    assert not c.closed


def test_nothing_is_sent_before_magic(connect):
    c = connect(magic=False)
    assert c.raw() == b""
    assert not c.closed


@pytest.mark.parametrize("magic", [b"  V1", b"V2  ", b"  v2", b"GET ", b"\x00\x00\x00\x00"])
def test_bad_magic(connect, magic):
    c = connect(magic=False)
    c.send(magic + cmd("PUB", "t"))
    assert c.raw() == b"\x00\x00\x00\x12\x00\x00\x00\x01E_BAD_PROTOCOL"
    assert c.closed
    assert "t" not in c.broker.topics


def test_bad_magic_http_request(connect):
    c = connect(magic=False)
    assert c.request(b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n") == [err("E_BAD_PROTOCOL")]
    assert c.closed


def test_nothing_after_bad_magic_is_processed(connect):
    c = connect(magic=False)
    c.send(b"  V3")
    assert c.read() == [err("E_BAD_PROTOCOL")]
    c.send(MAGIC + pub("t", b"x"))
    assert c.raw() == b""
    assert "t" not in c.broker.topics


def test_magic_split_across_two_reads(connect):
    c = connect(magic=False)
    c.send(b"  ")
    assert c.raw() == b""
    assert not c.closed
    c.send(b"V2" + pub("t", b"hello"))
    assert c.read() == [ok()]
    assert c.broker.topics["t"].depth() == 1


def test_magic_split_byte_by_byte(connect):
    c = connect(magic=False)
    for b in MAGIC:
        c.send(bytes([b]))
        assert c.raw() == b""
    assert c.request(pub("t", b"x")) == [ok()]


def test_bad_magic_split_across_reads(connect):
    c = connect(magic=False)
    c.send(b"  ")
    c.send(b"V")
    assert not c.closed
    c.send(b"1")
    assert c.read() == [err("E_BAD_PROTOCOL")]
    assert c.closed


def test_magic_and_command_in_one_read(connect):
    c = connect(magic=False)
    assert c.request(MAGIC + pub("t", b"a") + pub("t", b"b")) == [ok(), ok()]


# -- framing --------------------------------------------------------------------------


def _session() -> bytes:
    """A consumer-and-producer conversation that exercises every body command."""
    return (
        MAGIC
        + identify(feature_negotiation=True, client_id="me", heartbeat_interval=5000)
        + cmd("SUB", "t", "c")
        + cmd("RDY", 10)
        + pub("t", b"one")
        + mpub("t", [b"two", b"three", b"x" * 300])
        + cmd("DPUB", "t", 0)
        + b"\x00\x00\x00\x04four"
        + cmd("NOP")
        + cmd("FIN", "0000000000000000")
        + cmd("TOUCH", "0000000000000000")
        + cmd("REQ", "0000000000000000", 0)
        + cmd("CLS")
    )


def _run(tmp_path, clock, chunks) -> bytes:
    broker = new_broker(tmp_path, clock)
    c = Client(broker, magic=False)
    for chunk in chunks:
        c.send(chunk)
    return c.raw()


def test_byte_by_byte_equals_one_chunk(tmp_path, clock):
    stream = _session()
    whole = _run(tmp_path / "a", clock, [stream])
    bytewise = _run(tmp_path / "b", clock, [stream[i : i + 1] for i in range(len(stream))])
    assert bytewise == whole
    frames = parse_frames(whole)
    msgs = [f for f in frames if isinstance(f, Msg)]
    assert [m.body for m in msgs] == [b"one", b"two", b"three", b"x" * 300, b"four"]
    non_msgs = [f for f in frames if not isinstance(f, Msg)]
    assert non_msgs[0].payload.startswith(b"{")
    assert non_msgs[1:] == [
        ok(),  # SUB
        ok(),  # PUB
        ok(),  # MPUB
        ok(),  # DPUB
        err("E_FIN_FAILED FIN 0000000000000000 failed ID not in flight"),
        err("E_TOUCH_FAILED TOUCH 0000000000000000 failed ID not in flight"),
        err("E_REQ_FAILED REQ 0000000000000000 failed ID not in flight"),
        CLOSE_WAIT,
    ]


def test_crlf_line_endings(connect, inproc_broker):
    c = connect()
    assert c.request(b"PUB t\r\n" + b"\x00\x00\x00\x01x") == [ok()]
    assert c.request(b"NOP\r\n") == []
    assert c.request(b"SUB t c\r\n") == [ok()]
    assert list(inproc_broker.topics["t"].channels) == ["c"]
    c.send(b"RDY 1\r\n")
    [m] = c.messages()
    assert m.body == b"x"
    c.send(b"FIN " + m.id + b"\r\n")
    assert c.raw() == b""
    assert inproc_broker.topics["t"].channels["c"].in_flight_count() == 0


def test_several_commands_in_one_chunk(connect, inproc_broker):
    c = connect()
    frames = c.request(pub("t", b"1") + cmd("NOP") + pub("t", b"2") + mpub("t", [b"3", b"4"]) + pub("u", b"5"))
    assert frames == [ok(), ok(), ok(), ok()]
    assert inproc_broker.topics["t"].depth() == 4
    assert inproc_broker.topics["u"].depth() == 1


def test_incomplete_command_waits_for_more(connect, inproc_broker):
    c = connect()
    c.send(b"PU")
    c.send(b"B t")
    assert c.raw() == b""
    c.send(b"\n\x00\x00")
    c.send(b"\x00\x03ab")
    assert c.raw() == b""
    assert "t" not in inproc_broker.topics or inproc_broker.topics["t"].depth() == 0
    c.send(b"c" + cmd("NOP"))
    assert c.read() == [ok()]
    [msg] = list(inproc_broker.topics["t"]._queue.mem)
    assert msg.body == b"abc"


def test_empty_line_is_fatal(connect):
    c = connect()
    c.send(b"\n")
    assert c.raw() == b"\x00\x00\x00\x1e\x00\x00\x00\x01E_INVALID invalid command "
    assert c.closed


def test_empty_crlf_line_is_fatal(connect):
    c = connect()
    assert c.request(b"\r\n") == [err("E_INVALID invalid command ")]
    assert c.closed


@pytest.mark.parametrize(
    "line, word",
    [(b"FOO", "FOO"), (b"pub t", "pub"), (b"FOO bar baz", "FOO"), (b" PUB t", ""), (b"IDENTIFY2", "IDENTIFY2")],
)
def test_unknown_command_is_fatal(connect, line, word):
    c = connect()
    assert c.request(line + b"\n") == [err(f"E_INVALID invalid command {word}")]
    assert c.closed


def test_nothing_after_a_fatal_error_is_processed(connect, inproc_broker):
    c = connect()
    assert c.request(pub("t", b"1") + cmd("FOO") + pub("t", b"2")) == [ok(), err("E_INVALID invalid command FOO")]
    assert inproc_broker.topics["t"].depth() == 1
    c.send(pub("t", b"3"))
    assert c.raw() == b""
    assert inproc_broker.topics["t"].depth() == 1


def test_overlong_line_closes_without_a_frame(connect):
    c = connect()
    c.send(b"PUB " + b"t" * (MAX_LINE + 10))
    assert c.raw() == b""
    assert c.closed


def test_consecutive_spaces_give_empty_params(connect):
    c = connect()
    assert c.request(b"SUB  t c\n") == [err('E_BAD_TOPIC SUB topic name "" is not valid')]


# -- heartbeats and read timeout ----------------------------------------------------------


def test_default_heartbeat_every_30s(connect, clock):
    c = connect()
    clock.advance(29.9)
    assert c.raw() == b""
    clock.advance(0.1)
    assert c.read() == [HEARTBEAT]
    assert c.request(cmd("NOP")) == []
    clock.advance(30)
    assert c.read() == [HEARTBEAT]
    assert not c.closed


def test_heartbeats_start_before_magic(connect, clock):
    c = connect(magic=False)
    clock.advance(30)
    assert c.read() == [HEARTBEAT]


def test_publishers_get_heartbeats_too(connect, clock):
    c = connect()
    assert c.request(pub("t", b"x")) == [ok()]
    clock.advance(30)
    assert c.read() == [HEARTBEAT]


def test_silent_client_gets_a_second_heartbeat_then_a_graceful_close(connect, clock):
    """As nsqd: the heartbeat due with the read deadline is written, then a FIN, not a reset."""
    c = connect()
    clock.advance(30)
    assert c.read() == [HEARTBEAT]
    clock.advance(29.9)
    assert not c.closed
    clock.advance(0.1)
    assert c.read() == [HEARTBEAT]
    assert c.closed
    assert not c.transport.disconnected  # loseConnection, not abortConnection


def test_nop_resets_read_timeout(connect, clock):
    c = connect()
    clock.pump([10] * 5)
    c.send(cmd("NOP"))
    clock.pump([10] * 5 + [9.9])
    assert not c.closed
    c.send(cmd("NOP"))
    clock.pump([10] * 5 + [9.9])
    assert not c.closed
    # t = 169.8: heartbeats went out at 30, 60, 90, 120 and 150
    assert c.read() == [HEARTBEAT] * 5
    clock.advance(0.1)
    assert c.closed
    assert c.raw() == b""  # the next heartbeat was 10 s away: none written at the close


def test_partial_data_also_resets_read_timeout(connect, clock):
    c = connect()
    clock.advance(59)
    c.send(b"NO")
    clock.advance(59)
    assert not c.closed
    c.send(b"P\n")
    clock.advance(59)
    assert not c.closed
    clock.advance(1)
    assert c.closed


def test_negotiated_heartbeat_interval(connect, clock):
    c = connect()
    assert c.request(identify(heartbeat_interval=1000)) == [ok()]
    clock.advance(0.999)
    assert c.raw() == b""
    clock.advance(0.001)
    assert c.read() == [HEARTBEAT]
    c.send(cmd("NOP"))
    clock.advance(1)
    assert c.read() == [HEARTBEAT]
    assert not c.closed
    clock.advance(0.999)
    assert not c.closed
    clock.advance(0.001)
    assert c.closed


def test_heartbeat_interval_zero_keeps_default(connect, clock):
    c = connect()
    assert c.request(identify(heartbeat_interval=0)) == [ok()]
    clock.advance(29.9)
    assert c.raw() == b""
    clock.advance(0.1)
    assert c.read() == [HEARTBEAT]


def test_heartbeats_disabled(connect, clock):
    c = connect()
    assert c.request(identify(heartbeat_interval=-1)) == [ok()]
    clock.advance(3600)
    assert c.raw() == b""
    assert not c.closed
    assert c.request(pub("t", b"x")) == [ok()]
    assert c.request(cmd("SUB", "t", "c")) == [err("E_INVALID cannot SUB with heartbeats disabled")]
    assert c.closed
    assert c.proto.state == STATE_INIT


def test_no_heartbeats_after_connection_lost(connect, clock):
    c = connect()
    c.lose()
    clock.advance(300)
    assert c.raw() == b""
    assert c.proto not in c.broker.clients


def test_timed_out_consumer_messages_go_to_another_subscriber(connect, inproc_broker, clock):
    a = connect()
    a.sub(rdy=1)
    clock.advance(10)
    b = connect()
    b.sub(rdy=1)
    producer = connect()
    producer.send(identify(heartbeat_interval=-1))
    assert producer.request(pub("t", b"m")) == [ok(), ok()]
    [m] = a.messages()
    assert m.attempts == 1
    assert b.raw() == b""
    b.send(cmd("NOP"))
    clock.pump([10] * 5)  # a has been silent for 60 s
    assert set(a.read()) <= {HEARTBEAT}
    assert a.closed
    assert not b.closed
    a.lose()  # the reactor's connectionLost after the close
    got = [f for f in b.read() if f != HEARTBEAT]
    assert got == [Msg(m.timestamp, 2, m.id, b"m")]
    channel = inproc_broker.topics["t"].channels["c"]
    assert channel.in_flight_count() == 1
    assert a.proto not in channel.clients
    b.fin(m)
    assert b.raw() == b""
    assert channel.in_flight_count() == 0
    assert channel.depth() == 0


def test_disconnected_consumer_messages_requeued_at_once(connect, inproc_broker):
    a = connect()
    a.sub(rdy=5)
    assert connect().request(mpub("t", [b"1", b"2", b"3"])) == [ok()]
    assert [f.body for f in a.messages()] == [b"1", b"2", b"3"]
    a.lose()
    channel = inproc_broker.topics["t"].channels["c"]
    assert channel.in_flight_count() == 0
    assert channel.depth() == 3
    assert a.proto.in_flight_count == 0
    b = connect()
    b.sub(rdy=5)
    assert [(m.body, m.attempts) for m in b.messages()] == [(b"1", 2), (b"2", 2), (b"3", 2)]
    assert scan(inproc_broker) == 0


# -- half-close ----------------------------------------------------------------------


def test_a_half_closed_client_is_answered_then_closed(connect, inproc_broker):
    c = connect()
    c.send(pub("t", b"x") + cmd("NOP"))
    assert not c.closed
    c.proto.readConnectionLost()
    assert c.read() == [ok()]
    assert c.closed
    assert inproc_broker.topics["t"].message_count == 1


def test_a_half_close_during_a_big_mpub_closes_once_it_is_answered(connect, inproc_broker, clock):
    bodies = [b"%06d" % i for i in range(5000)]
    c = connect()
    c.send(mpub("t", bodies) + pub("t", b"tail"))
    c.proto.readConnectionLost()
    assert not c.closed  # published a chunk per reactor turn: the half-close waits
    clock.advance(0)
    assert c.read() == [ok(), ok()]
    assert c.closed
    assert inproc_broker.topics["t"].message_count == 5001


# What nsqd 1.3.0 answers when the input ends inside a command's body,
# measured from its binary: its reader's error, then the close.
_CUT_SHORT = [
    (cmd("PUB", "t"), "E_BAD_MESSAGE PUB failed to read message body size"),
    (cmd("PUB", "t") + b"\x00\x00", "E_BAD_MESSAGE PUB failed to read message body size"),
    (pub("t", b"0123456789")[:-7], "E_BAD_MESSAGE PUB failed to read message body"),
    (b"PUB t\r\n" + sized(b"abc")[:-1], "E_BAD_MESSAGE PUB failed to read message body"),
    (cmd("DPUB", "t", 100), "E_BAD_MESSAGE DPUB failed to read message body size"),
    (dpub("t", 100, b"0123456789")[:-1], "E_BAD_MESSAGE DPUB failed to read message body"),
    (cmd("IDENTIFY"), "E_BAD_BODY IDENTIFY failed to read body size"),
    (identify(client_id="x")[:-2], "E_BAD_BODY IDENTIFY failed to read body"),
    (cmd("AUTH") + b"\x00", "E_BAD_BODY AUTH failed to read body size"),
    (cmd("AUTH") + sized(b"secret")[:-1], "E_BAD_BODY AUTH failed to read body"),
    (cmd("MPUB", "t") + b"\x00", "E_BAD_BODY MPUB failed to read body size"),
    (cmd("MPUB", "t") + sized(b"x" * 20)[:6], "E_BAD_BODY MPUB failed to read message count"),
    (mpub("t", [b"abc", b"de"])[:17], "E_BAD_MESSAGE MPUB failed to read message(0) body size"),
    (mpub("t", [b"abc", b"de"])[:20], "E_BAD_MESSAGE MPUB failed to read message body"),
    (mpub("t", [b"abc", b"de"])[:24], "E_BAD_MESSAGE MPUB failed to read message(1) body size"),
    (mpub("t", [b"abc", b"de"])[:-1], "E_BAD_MESSAGE MPUB failed to read message body"),
    (mpub("t", [b"%05d" % i for i in range(3000)])[:-9], "E_BAD_MESSAGE MPUB failed to read message(2999) body size"),
]


@pytest.mark.parametrize(("sent", "error"), _CUT_SHORT)
def test_a_body_cut_short_by_a_half_close_gets_nsqds_error(connect, inproc_broker, sent, error):
    """`nc -N` with a truncated command: the client learns why nothing was published."""
    c = connect()
    c.send(pub("t", b"before") + sent)
    c.proto.readConnectionLost()
    assert c.read() == [ok(), err(error)]
    assert c.closed
    assert inproc_broker.topics["t"].message_count == 1


def test_a_body_cut_short_over_several_reads_gets_nsqds_error(connect, inproc_broker):
    data = mpub("t", [b"abc", b"de"])[:-1]
    c = connect()
    for i in range(len(data)):
        c.send(data[i:i + 1])
    c.proto.readConnectionLost()
    assert c.read() == [err("E_BAD_MESSAGE MPUB failed to read message body")]
    assert c.closed
    assert inproc_broker.topics["t"].message_count == 0


@pytest.mark.parametrize("sent", [b"SUB t c", cmd("NOP") + b"PUB", b"  V"])
def test_a_command_line_cut_short_by_a_half_close_is_closed_without_a_word(connect, sent):
    c = connect(magic=False)
    c.send(MAGIC + sent if sent != b"  V" else sent)
    c.proto.readConnectionLost()
    assert c.raw() == b""
    assert c.closed


def test_a_half_closed_consumer_is_sent_nothing_more(connect, inproc_broker):
    a = connect()
    a.sub(rdy=5)
    a.proto.readConnectionLost()
    assert a.closed
    assert connect().request(pub("t", b"x")) == [ok()]
    assert a.read() == []


def test_state_numbers(connect):
    c = connect()
    assert c.proto.state == STATE_INIT
    c.sub()
    assert c.proto.state == STATE_SUBSCRIBED


def test_a_fatal_error_leaves_no_reference_cycle(connect):
    """The closed connection is freed by reference counting, not left for the cyclic collector.

    The broker collects young objects only every 50,000 allocations, so a
    cycle per failed connection (the error's traceback holding the frame
    that held the error) would pile up under a stream of bad clients.
    """
    gc.disable()
    try:
        c = connect()
        proto = weakref.ref(c.proto)
        assert c.request(cmd("FOO")) == [err("E_INVALID invalid command FOO")]
        assert c.closed
        c.lose()
        del c
        assert proto() is None
    finally:
        gc.enable()
