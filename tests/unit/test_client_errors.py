"""mqd.client.errors: every nsqd error code as its exception class, fatality as nsqd's table."""

from __future__ import annotations

import pytest

from mqd.client import errors
from mqd.client.errors import (
    ConnectionClosed,
    HeartbeatTimeout,
    NSQError,
    error_from_frame,
)

# nsq-protocol.md §5: code → (class, fatal).
TABLE = [
    ("E_BAD_PROTOCOL", errors.BadProtocolError, True),
    ("E_INVALID", errors.InvalidError, True),
    ("E_BAD_BODY", errors.BadBodyError, True),
    ("E_BAD_TOPIC", errors.BadTopicError, True),
    ("E_BAD_CHANNEL", errors.BadChannelError, True),
    ("E_BAD_MESSAGE", errors.BadMessageError, True),
    ("E_PUB_FAILED", errors.PubFailedError, True),
    ("E_MPUB_FAILED", errors.MPubFailedError, True),
    ("E_DPUB_FAILED", errors.DPubFailedError, True),
    ("E_SUB_FAILED", errors.SubFailedError, True),
    ("E_IDENTIFY_FAILED", errors.IdentifyFailedError, True),
    ("E_AUTH_FIRST", errors.AuthFirstError, True),
    ("E_AUTH_FAILED", errors.AuthFailedError, True),
    ("E_AUTH_DISABLED", errors.AuthDisabledError, True),
    ("E_UNAUTHORIZED", errors.UnauthorizedError, True),
    ("E_AUTH_ERROR", errors.AuthError, True),
    ("E_FIN_FAILED", errors.FinFailedError, False),
    ("E_REQ_FAILED", errors.ReqFailedError, False),
    ("E_TOUCH_FAILED", errors.TouchFailedError, False),
]


@pytest.mark.parametrize(("code", "cls", "fatal"), TABLE)
def test_every_code_maps_to_its_class(code, cls, fatal):
    err = error_from_frame(code.encode() + b" something went wrong")
    assert type(err) is cls
    assert isinstance(err, NSQError)
    assert err.code == code
    assert err.detail == "something went wrong"
    assert err.fatal is fatal
    assert str(err) == f"{code} something went wrong"


def test_table_covers_every_class():
    assert set(errors.ERROR_CLASSES) == {code for code, _, _ in TABLE}


def test_frame_text_kept_exactly():
    err = error_from_frame(b'E_BAD_TOPIC PUB topic name "a b" is not valid')
    assert isinstance(err, errors.BadTopicError)
    assert str(err) == 'E_BAD_TOPIC PUB topic name "a b" is not valid'
    assert err.detail == 'PUB topic name "a b" is not valid'


def test_code_without_description():
    err = error_from_frame(b"E_BAD_PROTOCOL")
    assert isinstance(err, errors.BadProtocolError)
    assert (err.code, err.detail, str(err)) == ("E_BAD_PROTOCOL", "", "E_BAD_PROTOCOL")


def test_unknown_code_is_a_plain_fatal_nsqerror():
    err = error_from_frame(b"E_SOMETHING_NEW the future happened")
    assert type(err) is NSQError
    assert err.code == "E_SOMETHING_NEW"
    assert err.detail == "the future happened"
    assert err.fatal is True


def test_undecodable_bytes_do_not_raise():
    err = error_from_frame(b"E_BAD_TOPIC PUB topic name \"\xff\" is not valid")
    assert isinstance(err, errors.BadTopicError)
    assert "\ufffd" in err.detail


def test_made_up_error_keeps_code_and_default_fatality():
    err = NSQError("E_AUTH_REQUIRED", "auth required but no auth_secret")
    assert str(err) == "E_AUTH_REQUIRED auth required but no auth_secret"
    assert err.fatal is True
    assert errors.FinFailedError(detail="x").code == "E_FIN_FAILED"
    assert errors.FinFailedError(detail="x").fatal is False


def test_connection_closed_carries_its_reason():
    cause = errors.BadTopicError(detail="t")
    closed = ConnectionClosed(cause)
    assert closed.reason is cause
    assert "E_BAD_TOPIC" in str(closed)
    assert isinstance(HeartbeatTimeout(), ConnectionClosed)
    assert issubclass(errors.ClientConfigError, ValueError)
