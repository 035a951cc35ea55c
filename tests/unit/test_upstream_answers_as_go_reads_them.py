"""Brokers' and lookupds' answers read as nsqadmin's Go code reads them.

An answer that is not JSON, or not of the shape nsqadmin decodes it into,
is the error nsqadmin 1.3.0 reports for it, word for word (every expected
text below was measured from nsqadmin 1.3.0 against a server answering the
same bytes), and never an internal error of mqadmin's own.
"""

from __future__ import annotations

import json

import pytest
import pytest_twisted
from hypothesis import given
from hypothesis import strategies as st
from twisted.web.resource import Resource

from mqd.clusterinfo.answers import (
    LOOKUPD_LOOKUP,
    LOOKUPD_NODES,
    LOOKUPD_TOPICS,
    NSQD_INFO,
    NSQD_STATS,
    NSQD_STATS_TOPICS,
    NSQD_TOPICS,
)
from mqd.clusterinfo.cluster import Cluster
from mqd.clusterinfo.upstream import UpstreamError, base_url
from mqd.wire.go_json import GoJSONError, check_go, unmarshal
from tests.support.admin_fakes import real_upstream
from tests.support.web_server import serving

_TOPIC_NAME_STRUCT = 'struct { Name string "json:\\"topic_name\\"" }'
_PRODUCER_STRUCT = (
    'struct { RemoteAddress string "json:\\"remote_address\\""; Hostname string "json:\\"hostname\\""; '
    'BroadcastAddress string "json:\\"broadcast_address\\""; TCPPort int "json:\\"tcp_port\\""; '
    'HTTPPort int "json:\\"http_port\\""; Version string "json:\\"version\\""; '
    'Topics []string "json:\\"topics\\""; Tombstoned []bool "json:\\"tombstones\\"" }'
)
_E2E_STRUCT = (
    'struct { Count int "json:\\"count\\""; Percentiles []map[string]float64 "json:\\"percentiles\\""; '
    'Topic string "json:\\"topic\\""; Channel string "json:\\"channel\\""; Addr string "json:\\"host\\"" }'
)


@pytest.mark.parametrize(("body", "message"), [
    (b"", "unexpected end of JSON input"),
    (b"  \n", "unexpected end of JSON input"),
    (b"{", "unexpected end of JSON input"),
    (b'{"topics":', "unexpected end of JSON input"),
    (b"[1,", "unexpected end of JSON input"),
    (b'"abc', "unexpected end of JSON input"),
    (b"nope", "invalid character 'o' in literal null (expecting 'u')"),
    (b"<html>", "invalid character '<' looking for beginning of value"),
    (b"{} x", "invalid character 'x' after top-level value"),
    (b'{"a":1}}', "invalid character '}' after top-level value"),
    (b"[1,]", "invalid character ']' looking for beginning of value"),
    (b"NaN", "invalid character 'N' looking for beginning of value"),
    (b"-Infinity", "invalid character 'I' in numeric literal"),
    # At the end of its input Go's scanner steps once more with a space, which a
    # number, literal or escape cut short then names.
    (b"1.", "invalid character ' ' after decimal point in numeric literal"),
    (b"[1.", "invalid character ' ' after decimal point in numeric literal"),
    (b"1e+", "invalid character ' ' in exponent of numeric literal"),
    (b"tru", "invalid character ' ' in literal true (expecting 'e')"),
    (b"-", "invalid character ' ' in numeric literal"),
    (b'"ab\\', "invalid character ' ' in string escape code"),
    (b'"\\u12', "invalid character ' ' in \\u hexadecimal character escape"),
    (b'{"a":"\x01"}', "invalid character '\\x01' in string literal"),
    ("é".encode(), "invalid character 'Ã' looking for beginning of value"),
    (b"[\xfe]", "invalid character 'þ' looking for beginning of value"),
    (b"[" * 100_000, "invalid character '[' exceeded max depth"),
    (b'{"a":' * 3_000, "unexpected end of JSON input"),
])
def test_an_answer_that_is_not_json_is_gos_unmarshal_error(body, message):
    with pytest.raises(GoJSONError) as caught:
        unmarshal(body)
    assert str(caught.value) == message


@given(st.binary(max_size=64) | st.text(alphabet='[]{}",:.-+eE0123456789 tfnulrase\\', max_size=32).map(str.encode))
def test_any_bytes_decode_or_fail_with_a_go_json_error(raw):
    try:
        value = unmarshal(raw)
    except GoJSONError as e:
        assert str(e)
        return
    assert value == json.loads(raw.decode("utf-8", "replace"))


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)))
def test_valid_json_reads_as_python_reads_it(value):
    assert unmarshal(json.dumps(value).encode()) == value


@pytest.mark.parametrize(("shape", "document", "message"), [
    (NSQD_TOPICS, [], "json: cannot unmarshal array into Go value of type clusterinfo.respType"),
    (NSQD_STATS_TOPICS, "str", "json: cannot unmarshal string into Go value of type clusterinfo.statsRespType"),
    (NSQD_INFO, 5, "json: cannot unmarshal number into Go value of type clusterinfo.infoRespType"),
    (NSQD_TOPICS, {"topics": "x"},
     f"json: cannot unmarshal string into Go struct field respType.topics of type []{_TOPIC_NAME_STRUCT}"),
    (NSQD_STATS_TOPICS, {"topics": [5]},
     f"json: cannot unmarshal number into Go struct field statsRespType.topics of type {_TOPIC_NAME_STRUCT}"),
    (NSQD_TOPICS, {"topics": [{"topic_name": 5}]},
     "json: cannot unmarshal number into Go struct field .topics.topic_name of type string"),
    (NSQD_INFO, {"http_port": "x"},
     "json: cannot unmarshal string into Go struct field infoRespType.http_port of type int"),
    (NSQD_INFO, {"version": 5},
     "json: cannot unmarshal number into Go struct field infoRespType.version of type string"),
    (NSQD_STATS, {"topics": [{"channels": 5}]},
     "json: cannot unmarshal number into Go struct field TopicStats.topics.channels of type []*clusterinfo.ChannelStats"),
    (NSQD_STATS, {"topics": [{"channels": [5]}]},
     "json: cannot unmarshal number into Go struct field TopicStats.topics.channels of type clusterinfo.ChannelStats"),
    (NSQD_STATS, {"topics": [{"depth": 1.5}]},
     "json: cannot unmarshal number 1.5 into Go struct field TopicStats.topics.depth of type int64"),
    (NSQD_STATS, {"topics": [{"Depth": "x"}]},
     "json: cannot unmarshal string into Go struct field TopicStats.topics.depth of type int64"),
    (NSQD_STATS, {"topics": [{"depth": 99999999999999999999}]},
     "json: cannot unmarshal number 99999999999999999999 into Go struct field TopicStats.topics.depth of type int64"),
    (NSQD_STATS, {"topics": [{"depth": "x", "paused": "y"}]},  # the first one, in document order
     "json: cannot unmarshal string into Go struct field TopicStats.topics.depth of type int64"),
    (NSQD_STATS, {"topics": [{"e2e_processing_latency": "x"}]},
     f"json: cannot unmarshal string into Go struct field TopicStats.topics.e2e_processing_latency of type {_E2E_STRUCT}"),
    (NSQD_STATS, {"topics": [{"e2e_processing_latency": {"percentiles": [{"quantile": "x"}]}}]},
     "json: cannot unmarshal string into Go struct field TopicStats.topics.e2e_processing_latency of type float64"),
    (NSQD_STATS, {"topics": [{"channels": [{"clients": [5]}]}]},
     "json: cannot unmarshal number into Go struct field ChannelStats.topics.channels.clients"
     " of type clusterinfo.locaClientStats"),
    (NSQD_STATS, {"topics": [{"channels": [{"clients": [{"ready_count": 1.5}]}]}]},
     "json: cannot unmarshal number 1.5 into Go struct field ChannelStats.topics.channels.clients of type int"),
    (NSQD_STATS, {"topics": [{"channels": [{"clients": [{"sample_rate": 3_000_000_000}]}]}]},
     "json: cannot unmarshal number 3000000000 into Go struct field ChannelStats.topics.channels.clients"
     " of type int32"),
    (LOOKUPD_TOPICS, {"topics": [5]},
     "json: cannot unmarshal number into Go struct field respType.topics of type string"),
    (LOOKUPD_NODES, {"producers": 5},
     "json: cannot unmarshal number into Go struct field respType.producers of type []*clusterinfo.Producer"),
    (LOOKUPD_NODES, {"producers": [5]},
     f"json: cannot unmarshal number into Go struct field respType.producers of type {_PRODUCER_STRUCT}"),
    (LOOKUPD_NODES, {"producers": [{"tcp_port": {}}]},
     "json: cannot unmarshal object into Go struct field respType.producers of type int"),
    (LOOKUPD_LOOKUP, {"producers": 5},
     "json: cannot unmarshal number into Go struct field respType.producers of type clusterinfo.Producers"),
])
def test_an_answer_of_the_wrong_shape_is_nsqadmins_type_error(shape, document, message):
    with pytest.raises(GoJSONError) as caught:
        check_go(document, shape)
    assert str(caught.value) == message


def test_nulls_read_as_gos_zero_values():
    assert check_go(None, NSQD_INFO) == {}
    assert check_go({"Topics": [None, {"Topic_Name": "a", "depth": None, "paused": None, "channels": None}]},
                    NSQD_STATS) == {"topics": [{}, {"topic_name": "a", "depth": 0, "paused": False, "channels": None}]}


def test_a_huge_integer_is_a_number_error_not_a_crash():
    huge = b"9" * 5_000  # past Python's 4,300-digit int conversion limit
    assert unmarshal(b'{"x":' + huge + b"}") == {"x": float("inf")}
    with pytest.raises(GoJSONError, match="cannot unmarshal number .* of type int64"):
        check_go(unmarshal(b'{"topics":[{"depth":' + huge + b"}]}"), NSQD_STATS)


def test_strings_hold_what_go_decodes_into_them():
    # A lone surrogate escape is U+FFFD in a Go string; each byte that is not UTF-8 is one U+FFFD.
    assert check_go(unmarshal(b'{"topics":["a\\ud800"]}'), LOOKUPD_TOPICS) == {"topics": ["a\ufffd"]}
    assert unmarshal(b'["\xe2\x82"]') == ["\ufffd\ufffd"]


def test_two_keys_for_one_field_the_later_wins_as_in_go():
    assert check_go({"Topics": ["a"], "topics": ["b"]}, LOOKUPD_TOPICS) == {"topics": ["b"]}
    assert check_go({"topics": ["a"], "TOPICS": ["b"]}, LOOKUPD_TOPICS) == {"topics": ["b"]}


def test_a_well_formed_answer_comes_back_as_it_is():
    stats = {"version": "1.3.0", "topics": [{
        "topic_name": "t", "depth": 1, "backend_depth": 0, "message_count": 3, "message_bytes": 9, "paused": False,
        "e2e_processing_latency": {"count": 1, "percentiles": [{"quantile": 0.99, "value": 2.5e8}]},
        "channels": [{"channel_name": "c", "depth": 0, "client_count": 1, "paused": False,
                      "clients": [{"client_id": "vm", "ready_count": 200, "sample_rate": 0, "tls": False,
                                   "state": 3, "user_agent": "nsq_tail/1.3.0"}]}],
    }]}
    assert check_go(stats, NSQD_STATS) is stats


@pytest.fixture
def answering():
    """A twisted.web server on 127.0.0.1:0 answering every GET with `answering.body`."""

    class Answer(Resource):
        isLeaf = True
        body = b""

        def render_GET(self, request):
            return self.body

    root = Answer()
    with serving(root) as root.address:
        yield root


@pytest_twisted.inlineCallbacks
def test_a_broker_answering_no_json_is_quoted_with_gos_error(answering):
    answering.body = b'{"topics":[{"topic_name":"a"'
    upstream = real_upstream()
    try:
        with pytest.raises(UpstreamError) as caught:
            yield upstream.get_json(base_url(answering.address) + "/stats")
        assert caught.value.code == 200
        assert caught.value.go_text == "unexpected end of JSON input"
    finally:
        yield upstream.close()


@pytest_twisted.inlineCallbacks
@pytest.mark.parametrize(("body", "topics", "go_error"), [
    (b'{"topics":[{"topic_name":"b"},{"topic_name":"a"}]}', ["a", "b"], None),
    (b"null", [], None),
    (b'{"topics":"x"}', None,
     f"json: cannot unmarshal string into Go struct field respType.topics of type []{_TOPIC_NAME_STRUCT}"),
    (b'{"topics":[5]}', None,
     f"json: cannot unmarshal number into Go struct field respType.topics of type {_TOPIC_NAME_STRUCT}"),
    (b"[" * 100_000, None, "invalid character '[' exceeded max depth"),
])
def test_a_brokers_topics_of_the_wrong_shape_are_its_error_line(answering, body, topics, go_error):
    answering.body = body
    upstream = real_upstream()
    try:
        names, errors = yield Cluster(upstream, [], [answering.address]).topics()
    finally:
        yield upstream.close()
    assert names == topics
    assert [e.go for e in errors] == ([go_error] if go_error else [])
