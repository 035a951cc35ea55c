"""nsqd's response conventions (`internal/http_api/api_response.go`), in one place.

nsqd wraps every handler in one of two decorators, and clients depend on
their exact output, so mqd's endpoints never write a response themselves:
they return a value or raise `ApiError`, and `respond_v1` / `respond_plain`
turn that into status, headers and body.

* **V1** (every endpoint but `/ping`): a string result is sent as raw text
  (`OK`), nothing is an empty 200, anything else is compact JSON; an error is
  `{"message":"<CODE>"}` with its status. Every V1 response, error or not,
  carries `X-NSQ-Content-Type: nsq; version=1.0`: go-nsq and pynsq look for
  that header to tell a 1.x nsqd from a pre-1.0 one whose JSON they would
  have to unwrap from a `{"status_code","status_txt","data"}` envelope.
* **PlainText** (`/ping`): the text alone, with the status.

The `Accept` header is not looked at. nsqd before 1.0 answered the legacy
envelope unless a client sent `Accept: application/vnd.nsq; version=1.0`;
nsq 1.0 removed that negotiation and 1.3 always answers V1. Clients still
send the header, which changes nothing: the X-NSQ-Content-Type header on
the response tells them not to unwrap.
"""

from __future__ import annotations

from typing import Any

from twisted.web.server import Request

from mqd.wire.json_encoding import encode_json

__all__ = [
    "ApiError",
    "JSON_CONTENT_TYPE",
    "TEXT_CONTENT_TYPE",
    "dumps",
    "respond_plain",
    "respond_v1",
]

JSON_CONTENT_TYPE = b"application/json; charset=utf-8"
# What Go's net/http sniffs for a text body nsqd sends without a type.
TEXT_CONTENT_TYPE = b"text/plain; charset=utf-8"
_V1_HEADER = b"X-NSQ-Content-Type"
_V1_VALUE = b"nsq; version=1.0"


class ApiError(Exception):
    """An answer other than 200: the HTTP status and nsqd's error text (`MSG_TOO_BIG`)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code} {message}")
        self.code = code
        self.message = message


def dumps(value: Any) -> bytes:
    """Compact JSON, as Go's encoding/json writes it (no spaces, Go's escapes)."""
    return encode_json(value)


def respond_v1(request: Request, code: int, data: Any = None) -> bytes:
    """Status and headers set on `request` for a V1 answer; returns the body."""
    if code == 200:
        if data is None:
            body = b""
        elif isinstance(data, bytes):
            body = data
        elif isinstance(data, str):
            body = _encode(data)
        else:
            body = dumps(data)
            request.setHeader(b"Content-Type", JSON_CONTENT_TYPE)
    else:
        body = dumps({"message": str(data)})
        request.setHeader(b"Content-Type", JSON_CONTENT_TYPE)
    _text_or_nothing(request, body)
    request.setHeader(_V1_HEADER, _V1_VALUE)
    request.setResponseCode(code)
    return body


def respond_plain(request: Request, code: int, text: str) -> bytes:
    """Status set on `request` for a PlainText answer; returns the body."""
    body = _encode(text)
    _text_or_nothing(request, body)
    request.setResponseCode(code)
    return body


def _encode(text: str) -> bytes:
    """UTF-8 of a text answer; a character no encoder writes (a lone surrogate) is `?`.

    The strings the answers are built from are made valid where they come in
    (protocol.errors.go_string); this keeps one that slipped through from turning
    the answer into twisted.web's 500 page.
    """
    try:
        return text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def _text_or_nothing(request: Request, body: bytes) -> None:
    """The Content-Type Go would send for a body nsqd gave none: sniffed text, or none if empty.

    twisted.web would otherwise label every response `text/html`.
    """
    if request.responseHeaders.hasHeader(b"Content-Type"):
        return
    if body:
        request.setHeader(b"Content-Type", TEXT_CONTENT_TYPE)
    else:
        request.defaultContentType = None


def nanoseconds(seconds: float) -> int:
    """Seconds as integer nanoseconds: a time.Duration in Go's JSON, or a time's UnixNano."""
    return round(seconds * 1e9)
