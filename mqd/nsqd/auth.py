"""nsqd's client authorization, as the broker imports it: the shared mqd.http.auth.

The auth client, its answers (AuthState) and their parsing are shared with
mqlookupd, which may not load the broker, so they live in mqd.http.auth;
the broker's modules and their tests keep importing them from here.
"""

from __future__ import annotations

from mqd.http.auth import (
    AUTH_ANSWER_MAX,
    EVERY_TOPIC,
    AuthClient,
    AuthError,
    AuthState,
    Fetch,
    auth_urls,
    compile_grant,
    parse_auth_response,
)

__all__ = ["AUTH_ANSWER_MAX", "EVERY_TOPIC", "AuthClient", "AuthError", "AuthState", "Fetch", "auth_urls",
           "compile_grant", "parse_auth_response"]
