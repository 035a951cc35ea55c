"""Fuzzing a real mqadmin over a real mqlookupd and mqd that both run with `--http-auth-required`.

The cluster: an auth server process on loopback (tests/support/authd.py)
that knows auth_fuzz's secrets (`full`: admin of every topic, publish and
subscribe; the partial ones), an mqlookupd and an mqd asking it, and
mqadmin over the lookupd holding `full` (`--http-client-auth-secret-file`).
Hypothesis draws mqadmin's fuzz requests (tests/support/admin_fuzz.py),
each from a random caller (auth_fuzz's kinds: no `Authorization`, a
malformed one, a wrong, a partial or the full secret). mqadmin passes a
caller's `Bearer` header on instead of its own secret, so what the
daemons see is that caller (`seen_as`). The oracle, for every request:

* never a 5xx but the documented ones (502 UPSTREAM_ERROR, 503, 507);
* a 401 asks for a bearer secret, and names the daemons' refusal
  (`AUTH_REQUIRED`, `AUTH_FAILED`), a 403 theirs (`UNAUTHORIZED`), as
  docs/mqadmin.md words them (each daemon named, or a broker's passed on
  as it is); a caller the daemons refuse is never answered a 502 (they
  did answer) nor shown what they hold; the secret with every grant is
  never refused;
* a request answered 401 or 403, or seen as a refused caller, changes
  nothing: the broker's queues (its `/stats`, read with the admin
  secret), its snapshots, and the lookupd's topics, channels and
  tombstones are as they were;
* what an action reports done (an `ok` entry of its `results`, a
  snapshot's path) is done: the broker or lookupd shows it.

The same runs with mqadmin holding no secret (only callers' secrets get
in). At the end no log holds a traceback and every acknowledged control
message comes out. A last test sweeps every API route of an mqadmin
without a secret, over the lookupd and over the broker: each one that asks
them is their 401, naming who refused, and nothing changes.

MQD_FUZZ_EXAMPLES=N runs N examples instead of the CI count.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
from collections import Counter
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.admin_fuzz import DOCUMENTED_5XX, NODE, fuzzed_admin_request, spare_control
from tests.support.auth_fuzz import FULL, FULL_SECRET, PARTIAL, REFUSED_AS, caller
from tests.support.authd import AuthServer, grant
from tests.support.broker_fuzz import queues
from tests.support.control_checks import Control, log_problems
from tests.support.fuzz_inputs import examples
from tests.support.processes import BrokerProcess, LookupdProcess, TwistdProcess

pytestmark = pytest.mark.slow

FULL_HEADER = {"Authorization": f"Bearer {FULL_SECRET}"}
# What the daemons refuse outright: every endpoint but /ping and /info is their 401.
REFUSED = ("none", "malformed", "wrong")
REFUSAL_WORDS = {"AUTH_REQUIRED", "AUTH_FAILED", "UNAUTHORIZED"}
# auth_fuzz's callers, and now and then one whose header is not ASCII (mqadmin passes any `Bearer ...` on).
CALLERS = st.sampled_from([False] * 9 + [True]).flatmap(
    lambda odd: st.just(("malformed", {"Authorization": "Bearer \u00e9t\u00e9"})) if odd else caller())


@pytest.fixture
def guarded(authd: AuthServer, start_lookupd, start_broker) -> tuple[LookupdProcess, BrokerProcess, Control]:
    """A lookupd and a broker under --http-auth-required, asking `authd`; the broker's control channel filled."""
    authd.answers[FULL_SECRET] = grant(FULL)
    for secret, grants in PARTIAL.items():
        authd.answers[secret] = grant(*grants)
    guard = (f"--auth-http-address={authd.address}", "--http-auth-required")
    # A tombstone lasts 2 s, so a tombstoned topic is soon found again and fuzzed on.
    lookupd = start_lookupd(*guard, "--tombstone-lifetime=2s")
    broker = start_broker(*guard, f"--lookupd-tcp-address={lookupd.tcp_address}", "--broadcast-address=127.0.0.1",
                          f"--http-client-auth-secret={FULL_SECRET}")
    control = Control(broker, secret=FULL_SECRET.encode())
    control.setup(20)
    return lookupd, broker, control


def read(process: TwistdProcess, path: str) -> Any:
    """A GET with the admin secret that must answer 200: its JSON."""
    status, _, doc = ask(process, "GET", path, headers=FULL_HEADER)
    assert status == 200, f"GET {path}: {status} {doc}"
    return doc


class State:
    """What a refused request must leave as it was, read with the admin secret."""

    def __init__(self, lookupd: LookupdProcess, broker: BrokerProcess, control: Control) -> None:
        self.queues = queues(control)
        base = broker.data_dir / "snapshots"
        self.snapshots = sorted(os.listdir(base)) if base.is_dir() else []
        self.topics = sorted(read(lookupd, "/topics")["topics"] or ())
        self.channels = {t: sorted(read(lookupd, f"/channels?topic={t}")["channels"] or ()) for t in self.topics}
        # The broker's topics as the lookupd has them registered: tombstoned or not.
        self.registered = {topic: gone for node in read(lookupd, "/nodes")["producers"] or ()
                           for topic, gone in zip(node["topics"], node["tombstones"], strict=True)}
        # A tombstone ends by itself: a request may only not add one.
        self.tombstoned = {topic for topic, gone in self.registered.items() if gone}

    def same(self, before: State) -> bool:
        return ((self.queues, self.snapshots, self.topics, self.channels) ==
                (before.queues, before.snapshots, before.topics, before.channels)
                and self.tombstoned <= before.tombstoned)

    @classmethod
    def settled(cls, lookupd: LookupdProcess, broker: BrokerProcess, control: Control,
                timeout: float = 5.0) -> State:
        """The state once it stopped changing: a broker's changes reach the lookupd a moment later."""
        state = cls(lookupd, broker, control)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.05)
            again = cls(lookupd, broker, control)
            if again.same(state) and state.same(again):
                return again
            state = again
        return state

    def queue(self, topic: str, channel: str = "") -> tuple[bool, int] | None:
        """(paused, depth) of a topic or a channel of it; None when the broker has none."""
        for name, paused, _, depth, channels in self.queues:
            if name == topic:
                if not channel:
                    return paused, depth
                return next(((c[1], c[2]) for c in channels if c[0] == channel), None)
        return None


def seen_as(kind: str, headers: dict[str, str], own: str) -> str:
    """The caller the daemons see: the caller's if mqadmin passes its header on (one `Bearer ...`), else `own`'s."""
    value = headers.get("Authorization")
    if value is not None and value.strip(" \t")[:7].lower() == "bearer ":
        return kind
    return own


def names_of(target: str, body: bytes | None) -> tuple[str, str]:
    """The topic and channel an action names: in its path (`/api/topics/T[/C]`), else in its body."""
    parts = [unquote(p) for p in urlsplit(target).path.split("/")[1:]]
    if parts[:2] == ["api", "topics"] and len(parts) > 2:
        return parts[2], parts[3] if len(parts) > 3 else ""
    doc = json.loads(body or b"{}")
    return doc.get("topic") or "", doc.get("channel") or ""


def check_done(answer: dict[str, Any], target: str, body: bytes | None, node: str, after: State) -> int:
    """Each request an action reports `ok` shows in the broker or the lookupd; a snapshot's files exist.

    Returns how many were checked.
    """
    if "manifest" in answer:
        assert os.path.isdir(answer["path"]), answer
        return 1
    topic, channel = names_of(target, body)
    done_ok = [r for r in answer.get("results") or () if r["ok"]]
    for result in done_ok:
        where, path = result["target"], result["path"]
        kind, _, verb = path.strip("/").partition("/")
        queue = after.queue(topic, channel if kind == "channel" else "")
        if where == "lookupd":
            done = {"topic/create": topic in after.topics,
                    "channel/create": channel in after.channels.get(topic, ()),
                    "topic/delete": topic not in after.topics,
                    "channel/delete": channel not in after.channels.get(topic, ()),
                    # Tombstoned, or no longer registered (the broker deleted it: gone, tombstone and all).
                    "topic/tombstone": after.registered.get(topic, True)}[f"{kind}/{verb}"]
        else:
            done = {"create": queue is not None, "delete": queue is None,
                    "pause": queue is not None and queue[0] is True,
                    "unpause": queue is not None and queue[0] is False,
                    "empty": queue is not None and queue[1] == 0}[verb]
        assert done, f"{where} {node} {path} reported done for {topic}/{channel}, but: {after.queues} " \
                     f"{after.topics} {after.channels} {after.registered}"
    return len(done_ok)


def check_answer(status: int, head: dict[str, str], doc: Any, method: str, kind: str, what: str) -> None:
    """The oracle for one answer of mqadmin to a caller the daemons see as `kind` (see the module doc)."""
    message = doc.get("message", "") if isinstance(doc, dict) else ""
    if status >= 500:
        assert (status, message.split(":")[0]) in DOCUMENTED_5XX, what
    if status == 401:
        assert head.get("www-authenticate", "").startswith("Bearer"), what
    if kind == "full":
        assert status not in (401, 403) and not REFUSAL_WORDS & set(re.findall(r"[A-Z_]+", str(doc))), \
            f"{what}: the secret with every grant refused"
    if method == "HEAD":
        return
    if status in (401, 403):
        expected = REFUSED_AS[kind]
        assert status == expected[0] and names_refusal(message, status, expected[1]), f"{what}: a {kind} caller"
    if kind in REFUSED:
        assert status != 502, f"{what}: the daemons answered, refusing the {kind} caller"
        assert not _holds_data(doc), f"{what}: the daemons' data for a {kind} caller"


def names_refusal(message: str, status: int, word: str) -> bool:
    """Whether `message` words a refusal as docs/mqadmin.md does: a broker's passed on as it is (peek,
    snapshot), or each daemon named, in nsq's words (`nsqd HOST:PORT: got response 401 Unauthorized "..."`)."""
    quoted = re.escape(json.dumps(json.dumps({"message": word}, separators=(",", ":"))))
    named = rf"\bnsq(lookup)?d 127\.0\.0\.1:\d+: got response {status} {HTTPStatus(status).phrase} {quoted}"
    return message == word or re.search(named, message) is not None


def _holds_data(doc: Any) -> bool:
    """Whether an answer shows what only a secret may read: topics, channels, counts, bodies, a snapshot."""
    if not isinstance(doc, dict):
        return False
    shown = ("topics", "channels", "stats", "messages", "manifest", "depth", "clients", "lookupds")
    nodes = doc.get("nodes")
    nodes = nodes if isinstance(nodes, list) else []
    return any(doc.get(key) for key in shown) or any(isinstance(n, dict) and n.get("messages") for n in nodes)


def ask(process: TwistdProcess, method: str, target: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """(status, headers by lower-case name, JSON body or None) of one request, on a connection of its own."""
    conn = http.client.HTTPConnection(process.http_host, process.http_port, timeout=15)
    try:
        conn.request(method, target, body, {**(headers or {}), "Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    return response.status, {k.lower(): v for k, v in response.getheaders()}, doc


@pytest.mark.parametrize("own", ["full", "none"])
def test_mqadmin_over_daemons_that_require_a_secret_survives_random_callers(guarded, start_admin, tmp_path, own):
    """`own`: the secret mqadmin holds (`full`, from a file) or none: then only callers' secrets get in."""
    lookupd, broker, control = guarded
    flags = [f"--lookupd-http-address={lookupd.http_address}"]
    if own == "full":
        (tmp_path / "admin-secret").write_text(FULL_SECRET + "\n")
        flags.append(f"--http-client-auth-secret-file={tmp_path / 'admin-secret'}")
    admin = start_admin(*flags)
    node = f"127.0.0.1:{broker.http_port}"
    answered: Counter[tuple[str, int]] = Counter()

    @examples(100)
    @given(requests=st.lists(st.tuples(fuzzed_admin_request(), CALLERS), min_size=1, max_size=4))
    def fuzz(requests):
        # Topic t (channel c, a message) is there at the start of each example, whatever the last did.
        assert control.http("POST", "/pub?topic=t", b"m")[0] == 200
        assert control.http("POST", "/channel/create?topic=t&channel=c")[0] == 200
        changed = True
        for (method, target, body, _, user), (kind, headers) in requests:
            target, body = spare_control(method, target.replace(NODE, node), body)
            if user is not None:
                headers = {**headers, "X-Forwarded-User": user}
            sees = seen_as(kind, headers, own)
            # After a change, wait for the lookupd to hear of it: a refused request must change nothing.
            before = State.settled(lookupd, broker, control) if changed else State(lookupd, broker, control)
            status, head, doc = ask(admin, method, target, body, headers)
            changed = status == 200 and method in ("POST", "DELETE", "PUT")
            after = State(lookupd, broker, control)
            what = (f"{method} {target[:120]} {str(headers)[:80]} body={(body or b'')[:40]!r} -> {status} "
                    f"{str(doc)[:400]}")
            answered[sees, status] += 1
            check_answer(status, head, doc, method, sees, what)
            if status in (401, 403) or sees in REFUSED:
                assert after.same(before), f"{what}: refused, but changed the cluster"
            elif status == 200 and method in ("POST", "DELETE") and isinstance(doc, dict):
                answered["done", 0] += check_done(doc, target, body, node, after)
        control.check("mqadmin requests")

    fuzz()
    print(f"\nmqadmin answered (caller as the daemons saw it, status; done: effects checked): "
          f"{sorted(answered.items())}")
    control.drain_and_compare()
    for process in (broker, lookupd, admin):
        assert not log_problems(process), process.describe()


def test_mqadmin_without_a_secret_answers_every_route_with_the_daemons_401_named(guarded, start_admin):
    """Over the lookupd and over the broker: each route that asks them is their 401, naming who refused;
    nothing changes. Only what mqadmin answers alone is 200 (its pages, /ping, /config, the charts'
    history, a health page of the open /ping and /info, with the refusal as its warning)."""
    lookupd, broker, control = guarded
    node = f"127.0.0.1:{broker.http_port}"
    before = State(lookupd, broker, control)
    reads = ["/api/topics", "/api/topics?inactive=true", "/api/topics/t", "/api/topics/t/c", "/api/nodes",
             f"/api/nodes/{node}", "/api/counter", "/api/lookup", "/api/peek/t/c", "/api/health"]
    actions = [("POST", "/api/topics", b'{"topic": "t", "channel": "c"}'),
               ("POST", "/api/topics/t", b'{"action": "pause"}'), ("POST", "/api/topics/t/c", b'{"action": "empty"}'),
               ("DELETE", "/api/topics/t/c", None), ("DELETE", "/api/topics/t", None), ("DELETE", f"/api/nodes/{node}", b'{"topic": "t"}'),
               ("POST", f"/api/snapshot/{node}", None)]
    alone = ["/", "/topics/t", "/ping", "/config/log_level", "/api/history"]
    for daemon, address, flag in (("nsqlookupd", lookupd.http_address, "--lookupd-http-address"),
                                  ("nsqd", broker.http_address, "--nsqd-http-address")):
        admin = start_admin(f"{flag}={address}")
        for caller_kind, headers in (("none", {}), ("wrong", {"Authorization": "Bearer wrong"})):
            refused = f'{daemon} {address}: got response 401 Unauthorized "{{\\"message\\":\\"' \
                      f'{REFUSED_AS[caller_kind][1]}\\"}}"'
            for method, path, body in [("GET", p, None) for p in reads] + actions:
                status, head, doc = ask(admin, method, path, body, headers)
                what = f"{daemon}: {method} {path} ({caller_kind}) -> {status} {doc}"
                check_answer(status, head, doc, method, caller_kind, what)
                if path == "/api/lookup" and daemon == "nsqd":
                    assert (status, doc) == (200, {"lookupds": [], "message": ""}), what  # no lookupd to ask
                elif path == "/api/health" and status == 200:
                    assert refused in doc["message"], what  # the brokers it knows, from their open /ping and /info
                else:
                    assert status == 401 and refused in doc["message"], what
            for path in alone:
                assert ask(admin, "GET", path, None, headers)[0] == 200, path
    assert State(lookupd, broker, control).same(before)
    control.check("requests refused")
