"""What mqadmin's fuzzers send it, and which of its 5xx answers are part of its API.

Shared by the in-process fuzzing of mqadmin over one broker
(tests/reliability/test_fuzz_peek_snapshot_admin.py) and the fuzzing of a
real mqadmin over a real lookupd and broker under `--http-auth-required`
(tests/reliability/test_fuzz_admin_auth_required.py): the routes (peeks and
snapshots more often than the rest), their near misses, bodies, peek
queries, and `spare_control`, which keeps the control topic out of
what a fuzzed action may pause, empty or delete.
"""

from __future__ import annotations

from urllib.parse import quote

from hypothesis import strategies as st

from tests.support.fuzz_inputs import HTTP_BODIES, HTTP_QUERY_VALUES
from tests.support.inprocess_fuzz import CONTROL_CHANNEL, CONTROL_TOPIC

# 5xx answers that are part of the API (everything else 5xx is a bug).
DOCUMENTED_5XX = {(502, "UPSTREAM_ERROR"), (503, "PEEK_BUSY"), (503, "STORE_FAILED"), (507, "SNAPSHOT_LIMIT")}

_peek_values = st.one_of(
    st.sampled_from([CONTROL_TOPIC, CONTROL_CHANNEL, "t", "c", "nope", "queued", "in_flight", "deferred", "0", "1",
                     "20", "1000", "1001", "65536", "999999999999999999999", "-1", "x", "", "snap", "a/b"]),
    st.sampled_from(HTTP_QUERY_VALUES),
    st.integers(-5, 10**7).map(str),
    st.text(max_size=8).map(lambda s: quote(s, safe="", errors="surrogatepass")),
)
# A query of peek's arguments (and a few others), odd values included. Kept under 12 KiB: twisted.web
# closes a connection whose request line passes 16 KiB without an answer (Go's servers take 1 MiB).
peek_query = st.lists(st.tuples(st.sampled_from(["topic", "channel", "n", "state", "max_body", "out", "x"]),
                                _peek_values), max_size=6).map(
    lambda pairs: "&".join(f"{k}={v}" for k, v in pairs)).filter(lambda query: len(query) < 12_000)

# The broker the paths name; a fuzzer of a real cluster puts its node's name in its place.
NODE = "test-host:4151"
ADMIN_PATHS = [
    f"/api/peek/{CONTROL_TOPIC}/{CONTROL_CHANNEL}", "/api/peek/t/c", "/api/peek/t", "/api/peek/%ff/c",
    f"/api/snapshot/{NODE}", "/api/snapshot/evil.example:80", "/api/snapshot/",
    f"/api/nodes/{NODE}", "/api/nodes/127.0.0.1:1", "/api/nodes/x", "/api/nodes", f"/api/topics/{CONTROL_TOPIC}",
    "/api/topics/t", "/api/topics/t/c", "/api/topics", "/api/health", "/api/counter", "/api/history",
    "/api/topics/%ff", "/api/topics/t/%ff", "/api/nodes/%ff", "/api/peek/t/%ff", "/api/topics/%c3%a9/c",
    "/config/log_level", "/ping",
]
_admin_body = st.one_of(st.none(), st.sampled_from([b'{"topic": "t"}', b'{"topic": "zz_other"}', b"{}", b"",
                                                    b'{"action": "pause"}', b'{"action": "empty"}', b"[",
                                                    b'{"topic": "zz_control"}']),
                        st.sampled_from(HTTP_BODIES[:8]))
_user = st.one_of(st.none(), st.sampled_from(["alice", "mallory", "", "ALICE", "alice "]))
_ACTION_BODIES = (b'{"action": "pause"}', b'{"action": "unpause"}', b'{"action": "empty"}')
# (path, its natural method, bodies it takes): peeks and snapshots more often than the rest, and the
# actions with bodies they take, so that some are done.
ADMIN_ROUTES = [(f"/api/peek/{CONTROL_TOPIC}/{CONTROL_CHANNEL}", "GET", ())] * 4 + [
    (f"/api/snapshot/{NODE}", "POST", ())] * 2 + [(f"/api/nodes/{NODE}", "DELETE", (b'{"topic": "t"}',))] + [
    (path, "GET", ()) for path in ADMIN_PATHS] + [
    ("/api/topics", "POST", (b'{"topic": "t", "channel": "c2"}', b'{"topic": "zz_other"}')),
    ("/api/topics/t", "POST", _ACTION_BODIES), ("/api/topics/t/c", "POST", _ACTION_BODIES),
    ("/api/topics/t/c2", "DELETE", (b"",)), ("/api/topics/zz_other", "DELETE", (b"",))]


@st.composite
def fuzzed_admin_request(draw, authorization: st.SearchStrategy[str | None] | None = None
                         ) -> tuple[str, str, bytes | None, str | None, str | None]:
    """(method, target, body, Authorization header or None, X-Forwarded-User or None).

    `authorization`: what the header is drawn from (None: no header).
    """
    path, method, bodies = draw(st.sampled_from(ADMIN_ROUTES))
    if draw(st.integers(0, 3)) == 0:
        method = draw(st.sampled_from(["GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS", "PATCH"]))
    query = draw(peek_query)
    body = draw(st.sampled_from(bodies)) if bodies and draw(st.booleans()) else draw(_admin_body)
    header = None if authorization is None else draw(authorization)
    return method, path + (f"?{query}" if query else ""), body, header, draw(_user)


def spare_control(method: str, target: str, body: bytes | None) -> tuple[str, bytes | None]:
    """(target, body), an action that would pause, empty or delete the control topic aimed at another."""
    if CONTROL_TOPIC in target and method in ("POST", "DELETE"):
        target = target.replace(CONTROL_TOPIC, "zz_other")  # the control topic must stay
    if b"zz_control" in (body or b"") and method == "DELETE":
        body = b'{"topic": "zz_other"}'
    return target, body
