"""JSON answers in Go's bytes: its escapes, not Python's, in every answer the services write."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from mqd.wire.json_encoding import encode_json
from tests.support.v2_client import Client
from tests.support.v2_frames import identify, ok

# A user_agent as a client sent it in IDENTIFY, and the bytes nsqd 1.3.0's
# /stats wrote for it (measured from its binary): UTF-8 raw, HTML characters,
# U+2028/2029 and control characters escaped, DEL and "/" as they are.
AGENT = 'a<b>&c\u00e9\u2028\u2029\x08\x0c\x01\x7f"\\/\ufffdz\U0001F600'
NSQD_BYTES = (b'"a\\u003cb\\u003e\\u0026c\xc3\xa9\\u2028\\u2029\\u0008\\u000c\\u0001\x7f'
              b'\\"\\\\/\xef\xbf\xbdz\xf0\x9f\x98\x80"')


def test_a_string_is_written_as_go_writes_it():
    assert encode_json(AGENT) == NSQD_BYTES


def test_escape_pairs_are_not_mistaken_for_control_characters():
    assert encode_json(["\\b", "\\f", "\\\x08"]) == b'["\\\\b","\\\\f","\\\\\\u0008"]'


def test_a_lone_surrogate_is_written_as_gos_replacement_escape():
    assert encode_json({"k": "x\ud800y"}) == b'{"k":"x\\ufffdy"}'


def test_keys_are_sorted_only_when_asked_and_the_output_is_compact():
    assert encode_json({"b": 1, "a": [1, 2]}) == b'{"b":1,"a":[1,2]}'
    assert encode_json({"b": 1, "a": [1, 2]}, sort_keys=True) == b'{"a":[1,2],"b":1}'


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(_JSON)
def test_any_value_decodes_back_to_itself_from_valid_utf8(value):
    data = encode_json(value)
    assert json.loads(data.decode("utf-8")) == value
    assert not set(b"<>&") & set(data)
    assert b"\\b" not in data.replace(b"\\\\", b"") and b"\\f" not in data.replace(b"\\\\", b"")


def test_stats_shows_a_clients_user_agent_in_nsqds_bytes(inproc_broker, http):
    c = Client(inproc_broker, port=5001)
    assert c.request(identify(client_id="x", user_agent=AGENT)) == [ok()]
    c.sub("t", "c")
    body = http.get("/stats?format=json&topic=t").body
    assert b'"user_agent":' + NSQD_BYTES in body
