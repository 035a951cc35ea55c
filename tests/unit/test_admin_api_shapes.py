"""mqadmin's JSON API field for field against nsqadmin 1.3.0's own answers.

Each fixture in tests/fixtures/nsqadmin/ holds one request, what real
nsqadmin answered it over a two-broker cluster with one lookupd (a topic
with no channel, a channel with no client, one with a client and e2e
percentiles, one on a single broker), and every lookupd and broker answer
mqadmin got for the same request at the same time (timestamps, ephemeral
ports and the host name normalised). mqadmin runs in-process over those
recorded answers, so both saw the same cluster: its answer must have
nsqadmin's status, nsqadmin's exact body for errors and warnings, and, for
a page, nsqadmin's shape: every key, each value's JSON type, `null` where
nsqadmin has `null` and a list where it has one, recursively. The only
keys allowed beyond nsqadmin's are the documented additions below.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from twisted.internet.task import Clock

from mqd.admin.endpoint import Admin
from mqd.admin.web import AdminSite
from mqd.clusterinfo.cluster import Cluster
from mqd.options import MQADMIN_OPTIONS, resolve
from mqd.wire.go_json import go_kind
from tests.support.admin_fakes import CannedUpstream
from tests.support.http_client import HTTPClient

FIXTURES = pathlib.Path(__file__).parent.parent / "fixtures" / "nsqadmin"
LOOKUPD = "127.0.0.1:14161"
NOW = 1_700_000_001

# Keys mqadmin answers beyond nsqadmin's, each documented in docs/mqadmin.md:
# a merged e2e percentile's `value` (its count-weighted average).
ADDED_KEYS = {"value"}


def recorded(kind: str | None = None) -> list[str]:
    names = sorted(p.stem for p in FIXTURES.glob("*.json"))
    if kind is None:
        return names
    return [n for n in names if load(n)["request"]["method"] == kind]


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


class Replay(CannedUpstream):
    """`Upstream` answering each request with what the real lookupd or nsqd answered it."""

    def __init__(self, answers: dict[str, list]) -> None:
        self.answers = answers

    def _canned(self, method: str, url: str) -> tuple[int, bytes]:
        try:
            code, text = self.answers[f"{method} {url}"]
        except KeyError:
            raise AssertionError(f"mqadmin asked what was not recorded: {method} {url}") from None
        return code, text.encode()


class Client(HTTPClient):
    def __init__(self, site) -> None:
        self.site = site


def mqadmin(fixture: dict[str, Any]) -> tuple[int, Any]:
    clock = Clock()
    clock.advance(NOW)
    settings = resolve(MQADMIN_OPTIONS, {"lookupd-http-address": [LOOKUPD]})
    upstream = Replay(fixture["upstream"])
    admin = Admin(settings, clock, upstream=upstream, cluster=Cluster(upstream, [LOOKUPD], []))
    request = fixture["request"]
    body = request["body"].encode() if request["body"] is not None else None
    response = Client(AdminSite(admin)).request(request["method"], request["path"], body)
    return response.status, response.json()


# -- shapes ------------------------------------------------------------------------------------


def kind(value: Any) -> str:
    """A JSON value's kind as Go's encoding/json names it; null apart, as a script tests for it."""
    return "null" if value is None else go_kind(value)


def schema(samples: list[Any]) -> dict[str, Any]:
    """What nsqadmin's values at one place look like: their kinds, and (merged) their keys and items."""
    out: dict[str, Any] = {"kinds": {kind(v) for v in samples}, "keys": {}, "items": None}
    objects = [v for v in samples if isinstance(v, dict)]
    for key in dict.fromkeys(k for o in objects for k in o):
        out["keys"][key] = schema([o[key] for o in objects if key in o])
    items = [item for v in samples if isinstance(v, list) for item in v]
    if items:
        out["items"] = schema(items)
    return out


def differences(ours: Any, theirs: dict[str, Any], path: str = "") -> list[str]:
    """Where `ours` is not shaped as nsqadmin's values at the same place (an empty list if it is)."""
    found = []
    if kind(ours) not in theirs["kinds"]:
        return [f"{path or '.'}: {kind(ours)}, nsqadmin: {' or '.join(sorted(theirs['kinds']))}"]
    if isinstance(ours, dict):
        for key in theirs["keys"]:
            if key not in ours:
                found.append(f"{path}.{key}: missing")
            else:
                found += differences(ours[key], theirs["keys"][key], f"{path}.{key}")
        found += [f"{path}.{key}: not in nsqadmin's answer" for key in ours
                  if key not in theirs["keys"] and key not in ADDED_KEYS]
    elif isinstance(ours, list) and theirs["items"] is not None:
        for i, item in enumerate(ours):
            found += differences(item, theirs["items"], f"{path}[{i}]")
    return found


def test_the_shape_check_catches_null_for_a_list_a_missing_key_and_an_extra_one():
    theirs = schema([{"a": [], "b": None, "c": [{"x": 1}]}])
    assert differences({"a": [], "b": None, "c": [{"x": 2.5}]}, theirs) == []
    assert differences({"a": None, "b": None, "c": [{"x": 1}]}, theirs) == [".a: null, nsqadmin: array"]
    assert differences({"a": [], "c": [{}], "d": 1}, theirs) == [
        ".b: missing", ".c[0].x: missing", ".d: not in nsqadmin's answer"]


def test_every_get_endpoint_is_recorded():
    paths = {load(n)["request"]["path"].split("?")[0] for n in recorded("GET")}
    for endpoint in ("/api/topics", "/api/topics/orders", "/api/topics/orders/work", "/api/nodes",
                     "/api/nodes/127.0.0.1:14151", "/api/counter", "/api/graphite"):
        assert endpoint in paths


@pytest.mark.parametrize("name", recorded("GET"))
def test_get_answer_is_shaped_as_nsqadmins(name):
    fixture = load(name)
    status, body = mqadmin(fixture)
    assert status == fixture["nsqadmin"]["status"], body
    theirs = fixture["nsqadmin"]["body"]
    if status != 200:
        assert body == theirs
        return
    assert differences(body, schema([theirs])) == []
    assert body["message"] == theirs["message"]


def test_unknown_topic_is_nsqadmins_502_to_the_byte():
    fixture = load("topic_unknown")
    assert mqadmin(fixture) == (502, fixture["nsqadmin"]["body"])
    assert fixture["nsqadmin"]["body"]["message"].startswith(
        'UPSTREAM_ERROR: failed to query any nsqlookupd: got response 404 Not Found "')


def test_null_where_nsqadmin_has_null():
    _, topic = mqadmin(load("topic_no_channels"))
    assert topic["channels"] is None
    _, channel = mqadmin(load("channel_no_clients"))
    assert channel["clients"] is None
    assert all(n["clients"] == [] for n in channel["nodes"])


def test_topic_page_channels_have_nsqadmins_e2e_fields():
    _, topic = mqadmin(load("topic"))
    work = next(c for c in topic["channels"] if c["channel_name"] == "work")
    e2e = work["e2e_processing_latency"]
    assert (e2e["topic"], e2e["channel"]) == ("", "")
    assert [sorted(p) for p in e2e["percentiles"]] == [["average", "count", "max", "min", "quantile", "value"]] * 2
    # The merged estimate: min and max over the nodes (nsqadmin's `min` is a node's max).
    p99 = e2e["percentiles"][0]
    nodes = [n["e2e_processing_latency"]["percentiles"][0]["value"] for n in work["nodes"]]
    assert (p99["min"], p99["max"], p99["value"]) == (min(nodes), max(nodes), p99["average"])


def test_partial_failure_warning_is_worded_as_nsqadmins():
    fixture = load("empty_channel_missing_on_one_node")
    status, body = mqadmin(fixture)
    assert status == 200
    assert body["message"] == fixture["nsqadmin"]["body"]["message"]
    assert body["message"] == 'WARNING: got response 404 Not Found "{\\"message\\":\\"CHANNEL_NOT_FOUND\\"}"'
