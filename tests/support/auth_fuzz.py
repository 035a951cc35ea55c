"""In-process fuzzing under `--http-auth-required`: the callers, a fake auth server, the oracle.

Each fuzzed request carries one of five kinds of caller (CALLERS): no
`Authorization` header, a malformed one, a secret the auth server refuses,
a secret with partial grants, a secret granted everything (admin of every
topic, publish and subscribe). The auth server is AuthClient's fetch seam
(`FakeAuthServer`), so answers come in the request's own turn and the
fuzzing stays as fast as without auth.

The oracle (`check_refusal`), on top of the fuzzers' own (no 500, nothing
logged as a failure, the control client still served):

* a caller without an accepted secret changes nothing, whatever the
  answer, and is answered 2xx only by an open route (`/ping`, `/info`);
* a 401 or 403 is nsqd's V1 JSON error (`AUTH_REQUIRED` with
  `WWW-Authenticate: Bearer` for a missing or malformed header,
  `AUTH_FAILED` for a refused secret, `UNAUTHORIZED` for a missing grant)
  and changes nothing (the state before and after it is compared);
* before the secret is checked only the router answers (404, 405, its
  redirects, its plain-text 400 for a path it cannot decode): never an
  endpoint's JSON 400 or anything else.
"""

from __future__ import annotations

import os
import random
from typing import Any

from hypothesis import strategies as st
from twisted.internet.defer import fail, succeed

from mqd.http.auth import AuthClient, AuthError
from mqd.http.authorization import AuthCache
from mqd.lookup.http import LookupdSite
from mqd.lookup.registry import RegistrationDB
from mqd.nsqd.stats import stats_json
from mqd.options import LOOKUPD_OPTIONS, resolve
from tests.support.auth_fakes import answer
from tests.support.http_client import HTTPClient, Response, error
from tests.support.inprocess_fuzz import CONTROL_CHANNEL, CONTROL_TOPIC, Harness
from tests.support.lookupd_clients import LookupdClient
from tests.support.v2_client import Client
from tests.support.v2_frames import cmd, sized

AUTH_ADDRESS = "127.0.0.1:4181"
FULL_SECRET = "full"

FULL = {"topic": ".*", "channels": [".*"], "permissions": ["subscribe", "publish"], "admin": True}
# Secrets the auth server accepts with some grants, never all of them.
PARTIAL: dict[str, list[dict[str, Any]]] = {
    "publisher": [{"topic": ".*", "channels": [".*"], "permissions": ["publish"]}],
    "subscriber": [{"topic": ".*", "channels": [".*"], "permissions": ["subscribe"]}],
    "t-admin": [{"topic": "^t$", "channels": ["^c$"], "permissions": ["publish"], "admin": True}],
    "control-reader": [{"topic": f"^{CONTROL_TOPIC}$", "channels": [f"^{CONTROL_CHANNEL}$"],
                        "permissions": ["subscribe"]}],
    "other-admin": [{"topic": "^other$", "channels": [".*"], "permissions": [], "admin": True}],
    "nothing": [],
}
ANSWERS: dict[str, bytes] = {FULL_SECRET: answer(authorizations=[FULL]),
                             **{secret: answer(authorizations=grants) for secret, grants in PARTIAL.items()}}

CALLERS = ("none", "malformed", "wrong", "partial", "full")
# The message a refusal of each caller must carry (a partial secret may also be let through).
REFUSED_AS = {"none": (401, "AUTH_REQUIRED"), "malformed": (401, "AUTH_REQUIRED"), "wrong": (401, "AUTH_FAILED"),
              "partial": (403, "UNAUTHORIZED"), "full": (403, "UNAUTHORIZED")}

_printable = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20)
MALFORMED = ["Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Token full", "Bearer full extra", "Bearer\tfull",
             "bearer  ", "full", "Bearer full\x7f", "Bearerfull", "Bearer \x01"]


@st.composite
def caller(draw) -> tuple[str, dict[str, str]]:
    """(the kind of caller, the headers of its request)."""
    kind = draw(st.sampled_from(CALLERS))
    if kind == "none":
        return kind, {}
    if kind == "malformed":
        value = draw(st.sampled_from(MALFORMED))
    elif kind == "wrong":
        secret = draw(st.one_of(st.sampled_from(["wrong", "Full", "fulll", "a" * 5000]), _printable))
        if secret in ANSWERS:
            secret += "-not"
        value = f"Bearer {secret}"
    elif kind == "partial":
        value = f"Bearer {draw(st.sampled_from(sorted(PARTIAL)))}"
    else:
        value = draw(st.sampled_from([f"Bearer {FULL_SECRET}", f"bEaReR   {FULL_SECRET}  "]))
    return kind, {"Authorization": value}


def random_caller(rng: random.Random) -> tuple[str, dict[str, str]]:
    """A caller for a systematic sweep: the full secret half the time, so most requests reach the endpoint."""
    kind = rng.choices(CALLERS, weights=(1, 1, 1, 2, 5))[0]
    value = {"none": None, "malformed": rng.choice(MALFORMED), "wrong": f"Bearer wrong-{rng.randrange(10**6)}",
             "partial": f"Bearer {rng.choice(sorted(PARTIAL))}", "full": f"Bearer {FULL_SECRET}"}[kind]
    return kind, {} if value is None else {"Authorization": value}


class FakeAuthServer:
    """AuthClient's fetch: ANSWERS for a known secret, a refusal (as a 403 would be) for any other."""

    def __init__(self, answers: dict[str, bytes] | None = None) -> None:
        self.answers = ANSWERS if answers is None else answers
        self.queries = 0

    def __call__(self, url: str, method: str, params: dict[str, str]):
        self.queries += 1
        body = self.answers.get(params["secret"])
        return succeed(body) if body is not None else fail(AuthError("got response 403 b'no'"))


def sending_secret(client: HTTPClient, secret: str = FULL_SECRET) -> HTTPClient:
    """`client`, its requests made without `headers` sent with `secret` (an explicit `{}` sends none)."""
    send = client.send

    def send_with_secret(method: str, path: str, body: bytes | None = None,
                         headers: dict[str, str] | None = None):
        return send(method, path, body, {"Authorization": f"Bearer {secret}"} if headers is None else headers)

    client.send = send_with_secret  # type: ignore[method-assign]
    return client


class RequiredAuthHarness(Harness):
    """test_fuzz's harness, then `--http-auth-required` on (the fake auth server), its own checks with FULL.

    The control publisher, connected before auth was configured, publishes
    as it did; the drain AUTHs with the full secret.
    """

    def __init__(self, path: str, answers: dict[str, bytes] | None = None) -> None:
        super().__init__(path)
        broker = self.broker
        broker.update_options(auth_http_address=[AUTH_ADDRESS], http_auth_required=True)
        self.auth_server = FakeAuthServer(answers)
        broker.auth = AuthClient(broker.options, self.clock, fetch=self.auth_server)
        self.http = sending_secret(HTTPClient(broker))
        assert self.http.get("/stats", headers={}).status == 401  # the site is guarded

    def state(self) -> Any:
        """What a refused request must leave as it was: queues and their counts, options, snapshots."""
        broker = self.broker
        base = os.path.join(broker.data_path, "snapshots")
        snapshots = sorted(os.listdir(base)) if os.path.isdir(base) else []
        return stats_json(broker, include_clients=False, include_mem=False), broker.options.as_dict(), snapshots

    def drain(self) -> None:
        consumer = Client(self.broker, port=2)
        consumer.send(cmd("AUTH") + sized(FULL_SECRET.encode()))
        assert consumer.read()[0].type == 0
        consumer.sub(CONTROL_TOPIC, CONTROL_CHANNEL, rdy=1000)
        got = [m.body for m in consumer.messages()]
        assert sorted(got) == sorted(self.bodies), (got, self.bodies)


def guarded_lookupd(db: RegistrationDB, clock) -> LookupdClient:
    """An in-process mqlookupd HTTP client on `db` under `--http-auth-required`, sending FULL by default."""
    settings = resolve(LOOKUPD_OPTIONS, {"auth-http-address": [AUTH_ADDRESS], "http-auth-required": True})
    client = LookupdClient(db, clock)
    client.site = LookupdSite(db, reactor=clock,
                              auth=AuthCache(AuthClient(settings, clock, fetch=FakeAuthServer()), clock))
    return sending_secret(client)  # type: ignore[return-value]


def lookupd_state(db: RegistrationDB) -> list[str]:
    """Every registration and its producers (tombstones included), for 'changed nothing'."""
    return sorted(f"{reg!r} {sorted(map(repr, producers))}" for reg, producers in db.items())


def open_answers(client: HTTPClient) -> set[bytes]:
    """The bodies of the open routes (and a HEAD's empty one): what an unauthenticated 2xx may carry."""
    return {client.get("/ping", headers={}).body, client.get("/info", headers={}).body, b""}


def check_refusal(kind: str, method: str, response: Response, before: Any, after: Any, opened: set[bytes],
                  shown: str) -> None:
    """The auth oracle for one answered request of a `kind` caller (see the module doc)."""
    status = response.status
    authenticated = kind in ("partial", "full")
    if not authenticated:
        assert after == before, f"{shown}: a {kind} caller changed the state ({status} {response.body[:200]!r})"
        if 200 <= status < 300:
            assert response.body in opened, f"{shown}: {kind} caller answered {status} {response.body[:200]!r}"
    if status in (401, 403):
        assert after == before, f"{shown}: refused {status} but changed the state"
        if method != "HEAD":
            assert error(response) == REFUSED_AS[kind], f"{shown}: {kind} caller: {status} {response.body[:200]!r}"
        if status == 401:
            assert (response.header("WWW-Authenticate") or "").startswith("Bearer"), f"{shown}: {response.headers}"
    if not authenticated and status >= 300:
        # Only the router answers before the secret is checked: 404, 405, its redirects, and its
        # plain-text 400 for a path it cannot decode (never an endpoint's JSON 400).
        routed = status in (301, 307, 401, 404, 405) or (status == 400 and not response.is_json)
        assert routed, f"{shown}: {kind} caller: {status} {response.body[:200]!r}"
