"""What the client raises: nsqd's error frames as exceptions, and the client's own failures.

An error frame is `CODE description`; each code nsqd sends has its own
class so callers can catch the one they care about (`BadTopicError`)
while `NSQError` catches them all. `.fatal` says whether nsqd closes the
connection after sending it: only FIN/REQ/TOUCH failures leave it open
(nsq-protocol.md §5), which is what lets the connection tell a command's
answer from a complaint about an earlier fire-and-forget FIN.
"""

from __future__ import annotations

from typing import cast

__all__ = [
    "NSQError",
    "BadProtocolError",
    "InvalidError",
    "BadBodyError",
    "BadTopicError",
    "BadChannelError",
    "BadMessageError",
    "PubFailedError",
    "MPubFailedError",
    "DPubFailedError",
    "SubFailedError",
    "IdentifyFailedError",
    "AuthFirstError",
    "AuthFailedError",
    "AuthDisabledError",
    "UnauthorizedError",
    "AuthError",
    "HandshakeRefusedError",
    "AuthRefusedError",
    "AuthRequiredError",
    "IdentifyRefusedError",
    "UnusableAnswerError",
    "auth_refused",
    "identify_refused",
    "FinFailedError",
    "ReqFailedError",
    "TouchFailedError",
    "ERROR_CLASSES",
    "error_from_frame",
    "ConnectionClosed",
    "ServerProtocolError",
    "HeartbeatTimeout",
    "ClientConfigError",
    "ProducerFullError",
    "StoppedError",
]


class NSQError(Exception):
    """An error frame from nsqd (or one the client makes up in its terms).

    A code nsqd does not document (a newer server's) still arrives as a
    plain NSQError carrying it, fatal unless the code says otherwise,
    since unknown trouble is safer treated as closing the connection.
    """

    code: str = ""
    fatal: bool = True

    def __init__(self, code: str | None = None, detail: str = "", fatal: bool | None = None) -> None:
        if code is None:
            code = type(self).code
        super().__init__(code, detail)
        self.code = code
        self.detail = detail
        if fatal is not None:
            self.fatal = fatal

    def __str__(self) -> str:
        return f"{self.code} {self.detail}" if self.detail else self.code

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class BadProtocolError(NSQError):
    code = "E_BAD_PROTOCOL"


class InvalidError(NSQError):
    code = "E_INVALID"


class BadBodyError(NSQError):
    code = "E_BAD_BODY"


class BadTopicError(NSQError):
    code = "E_BAD_TOPIC"


class BadChannelError(NSQError):
    code = "E_BAD_CHANNEL"


class BadMessageError(NSQError):
    code = "E_BAD_MESSAGE"


class PubFailedError(NSQError):
    code = "E_PUB_FAILED"


class MPubFailedError(NSQError):
    code = "E_MPUB_FAILED"


class DPubFailedError(NSQError):
    code = "E_DPUB_FAILED"


class SubFailedError(NSQError):
    code = "E_SUB_FAILED"


class IdentifyFailedError(NSQError):
    code = "E_IDENTIFY_FAILED"


class AuthFirstError(NSQError):
    code = "E_AUTH_FIRST"


class AuthFailedError(NSQError):
    code = "E_AUTH_FAILED"


class AuthDisabledError(NSQError):
    code = "E_AUTH_DISABLED"


class UnauthorizedError(NSQError):
    code = "E_UNAUTHORIZED"


class AuthError(NSQError):
    code = "E_AUTH_ERROR"


class FinFailedError(NSQError):
    code = "E_FIN_FAILED"
    fatal = False


class ReqFailedError(NSQError):
    code = "E_REQ_FAILED"
    fatal = False


class TouchFailedError(NSQError):
    code = "E_TOUCH_FAILED"
    fatal = False


ERROR_CLASSES: dict[str, type[NSQError]] = {
    cls.code: cls
    for cls in (
        BadProtocolError, InvalidError, BadBodyError, BadTopicError, BadChannelError,
        BadMessageError, PubFailedError, MPubFailedError, DPubFailedError, SubFailedError,
        IdentifyFailedError, AuthFirstError, AuthFailedError, AuthDisabledError,
        UnauthorizedError, AuthError, FinFailedError, ReqFailedError, TouchFailedError,
    )
}


class HandshakeRefusedError(Exception):
    """The handshake with an nsqd ended in a way that dialing it again will not mend.

    Either nsqd refused the client (an error frame answering IDENTIFY or
    AUTH: the client's settings or secret are not acceptable to it) or the
    client refused nsqd's answer (one it cannot use: a field out of its
    type's range, an HTTP port dialed, garbage). The same nsqd gives the
    same answer to the next attempt, so go-nsq's ConnectToNSQD returns the
    error instead of retrying, and NSQ's tools exit 1 with it: the
    consumer stops dialing an nsqd that ends its first connection this way
    and tells `on_fatal`, and the tools exit 1 with `nsq_text`, go-nsq's
    wording of the error (str() is the client's own, more precise one).
    """

    @property
    def nsq_text(self) -> str:
        return str(self)


class AuthRefusedError(NSQError, HandshakeRefusedError):
    """nsqd refused this client's credentials in the handshake: retrying cannot help.

    Either nsqd answered AUTH with an error frame (`E_AUTH_FAILED` when
    its auth server refused the secret or could not be asked,
    `E_UNAUTHORIZED` when the secret grants nothing), or it requires AUTH
    and no `auth_secret` is configured (`AuthRequiredError`). A wrong
    secret is not an unreachable broker: the consumer stops dialing an
    nsqd that refuses its first connection this way (go-nsq's
    ConnectToNSQD returns the error), and the tools exit 1.

    An error frame answering AUTH is an instance of both this class and
    its code's class (`auth_refused`), so `except AuthFailedError` still
    catches E_AUTH_FAILED, and its str() is the frame's, as for any
    NSQError. `nsq_text` is go-nsq's wording, the line nsq_tail exits
    with: `Error authenticating E_AUTH_FAILED AUTH failed`.
    """

    fatal = True

    @property
    def nsq_text(self) -> str:
        return f"Error authenticating {self}"


class AuthRequiredError(AuthRefusedError):
    """nsqd requires AUTH and the client has no `auth_secret` (go-nsq's "Auth Required")."""

    code = "E_AUTH_REQUIRED"

    def __init__(self, code: str | None = None,
                 detail: str = "nsqd requires AUTH and no auth_secret is configured",
                 fatal: bool | None = None) -> None:
        super().__init__(code, detail, fatal)

    @property
    def nsq_text(self) -> str:
        return "Auth Required"


class IdentifyRefusedError(NSQError, HandshakeRefusedError):
    """nsqd answered IDENTIFY (or the TLS or compression upgrade after it) with an error frame.

    nsqd refuses an IDENTIFY whose settings are outside its limits
    (`E_BAD_BODY IDENTIFY heartbeat interval (999999999) is invalid`), so
    the next attempt gets the same answer. Like AuthRefusedError, an
    instance is also of its code's class (`identify_refused`); `nsq_text`
    is go-nsq's wording: `failed to IDENTIFY - E_BAD_BODY ...`.
    """

    fatal = True

    @property
    def nsq_text(self) -> str:
        return f"failed to IDENTIFY - {self}"


# One class per (kind of refusal, code class), made once: these may be called for any frame.
_REFUSED: dict[tuple[type[NSQError], type[NSQError]], type[NSQError]] = {}


def _refused_as(err: NSQError, base: type[NSQError], answering: str) -> NSQError:
    cls = type(err)
    refused = _REFUSED.get((base, cls))
    if refused is None:
        refused = type(cls.__name__, (base, cls), {
            "__module__": __name__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__} answering {answering}: also an {base.__name__}.",
        })
        _REFUSED[(base, cls)] = refused
    return refused(err.code, err.detail)


def auth_refused(err: NSQError) -> AuthRefusedError:
    """`err` (an error frame answering AUTH) as an AuthRefusedError that is still its own class."""
    if isinstance(err, AuthRefusedError):
        return err
    return cast(AuthRefusedError, _refused_as(err, AuthRefusedError, "AUTH"))


def identify_refused(err: NSQError) -> IdentifyRefusedError:
    """`err` (an error frame answering IDENTIFY) as an IdentifyRefusedError that is still its own class."""
    if isinstance(err, IdentifyRefusedError):
        return err
    return cast(IdentifyRefusedError, _refused_as(err, IdentifyRefusedError, "IDENTIFY"))


def error_from_frame(payload: bytes) -> NSQError:
    """The exception for an error frame's payload (`CODE description`)."""
    text = bytes(payload).decode("utf-8", "replace")
    code, _, detail = text.partition(" ")
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        return NSQError(code, detail)
    return cls(code, detail)


class ConnectionClosed(Exception):
    """A command's connection ended before its answer came.

    `.reason` is what ended it (a Failure or an exception), so a caller
    can tell a server that closed from a network that failed.
    """

    def __init__(self, reason=None, message: str = "connection closed") -> None:
        super().__init__(message, reason)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        reason = self.reason
        if reason is None:
            return self.message
        value = getattr(reason, "value", reason)  # a Failure's exception
        return f"{self.message}: {value}"


class ServerProtocolError(ConnectionClosed):
    """The server broke NSQ's protocol and the client closed the connection.

    A frame of a type that does not exist, a size below 4 or above what the
    client accepts (`max_msg_size`), a handshake answer that is not the
    JSON object go-nsq decodes (too deep, wrong field types, garbage), a
    message before the handshake ended, undecodable compressed data. The
    connection is closed before anything more is read; the consumer and
    producer reconnect with backoff, and commands on it fail with this.
    """

    def __init__(self, what: str) -> None:
        super().__init__(None, f"protocol error: {what}")
        self.what = what


class UnusableAnswerError(ServerProtocolError, HandshakeRefusedError):
    """nsqd's answer in the handshake is one the client cannot use: the next attempt gets the same.

    An IDENTIFY answer that is not the JSON object go-nsq decodes (a
    `max_rdy_count` of 10^30, a boolean given as "yes"), an upgrade not
    answered OK, an AUTH answer of the wrong shape, or a frame that cannot
    be one (an HTTP port dialed, a size past `max_msg_size`) before the
    handshake ended. str() is the client's account (`protocol error: ...`);
    `nsq_text` is go-nsq's, the line nsq_tail exits with (`failed to
    IDENTIFY - json: cannot unmarshal number ... of type int64`).
    """

    def __init__(self, what: str, nsq_text: str) -> None:
        super().__init__(what)
        self._nsq_text = nsq_text

    @property
    def nsq_text(self) -> str:
        return self._nsq_text


class HeartbeatTimeout(ConnectionClosed):
    """Nothing was read for `read_timeout`: the server or the network is gone."""

    def __init__(self, reason=None, message: str = "no data read within read_timeout") -> None:
        super().__init__(reason, message)


class ClientConfigError(ValueError):
    """A client option is unknown, of the wrong type or out of its range."""


class ProducerFullError(Exception):
    """Too many publishes are waiting: the caller must slow down (backpressure)."""


class StoppedError(Exception):
    """The producer or consumer is stopping or stopped and takes no new work."""
