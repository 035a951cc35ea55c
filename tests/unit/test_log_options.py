"""The offset mode's options: what is accepted, the defaults, and one clear line for each bad one."""

from __future__ import annotations

import pytest

from spark_bridge.log_options import EARLIEST, LATEST, log_options
from spark_bridge.stream_options import StreamOptionError

BASE = {"topic": "events", "nsqd": "127.0.0.1:4150"}


def test_a_stream_starts_at_latest_and_a_batch_read_at_earliest_as_kafka_reads_them():
    stream = log_options(BASE, batch=False)
    batch = log_options(BASE, batch=True)
    assert (stream.starting.kind, stream.ending.kind) == ("latest", "latest")
    assert (batch.starting.kind, batch.ending.kind) == ("earliest", "latest")
    assert stream.fail_on_data_loss is True
    assert stream.max_offsets_per_trigger is None
    assert stream.topics == ("events",) and stream.nsqd == ("127.0.0.1:4150",)


def test_options_are_read_whatever_their_case_as_spark_hands_them():
    options = log_options({"topic": "events", "lookupd": "127.0.0.1:4161", "startingoffsets": "earliest",
                           "maxoffsetspertrigger": "500", "minpartitions": "3", "failondataloss": "false"},
                          batch=False)
    assert options.starting.kind == "earliest"
    assert (options.max_offsets_per_trigger, options.min_partitions) == (500, 3)
    assert options.fail_on_data_loss is False
    assert options.lookupd == ("127.0.0.1:4161",)


def test_a_starting_timestamp_wins_over_starting_offsets():
    options = log_options({**BASE, "startingOffsets": "earliest", "startingTimestamp": "1700000000000"},
                          batch=False)
    assert (options.starting.kind, options.starting.timestamp_ms) == ("timestamp", 1_700_000_000_000)


def test_offsets_json_takes_numbers_kafkas_special_numbers_and_epochs():
    text = '{"events": {"10.0.0.5:4150": 12, "10.0.0.6:4150": -2, "[::1]:4150": {"offset": -1, "epoch": 7}}}'
    bound = log_options({**BASE, "startingOffsets": text}, batch=False).starting
    assert bound.kind == "offsets"
    assert bound.offsets == {"events": {"10.0.0.5:4150": (12, None), "10.0.0.6:4150": (EARLIEST, None),
                                        "[::1]:4150": (LATEST, 7)}}


def test_several_topics_are_named_with_topics():
    options = log_options({"topics": "a, b,a", "nsqd": "127.0.0.1:4150"}, batch=True)
    assert options.topics == ("a", "b")


def test_tls_and_auth_options_are_the_consumers_own():
    options = log_options({**BASE, "tls_v1": "true", "tls_root_ca_file": "/ca.pem", "auth_secret": "s3"},
                          batch=True)
    assert (options.tls, options.tls_root_ca_file, options.secret) == (True, "/ca.pem", "s3")


@pytest.mark.parametrize(("options", "says"), [
    ({"nsqd": "127.0.0.1:4150"}, "option topic is required"),
    ({"topic": "events"}, "give option nsqd"),
    ({**BASE, "topics": "x"}, "topic or topics, not both"),
    ({"topic": "bad name!", "nsqd": "127.0.0.1:4150"}, "not a valid NSQ name"),
    ({**BASE, "startingOffsets": "first"}, "startingOffsets: 'first' is not earliest or latest"),
    ({**BASE, "startingOffsets": "{nope"}, "malformed JSON"),
    ({**BASE, "startingOffsets": '{"other": {"h:1": 0}}'}, "names topic 'other'"),
    ({**BASE, "startingOffsets": '{"events": {"h:1": -3}}'}, "is not an offset"),
    ({**BASE, "startingOffsets": '{"events": {"h:1": "5"}}'}, "is not an offset"),
    ({**BASE, "startingOffsets": '{"events": {"nohost": 5}}'}, "is not a broker's host:port"),
    ({**BASE, "startingOffsets": '{"events": []}'}, "must map brokers"),
    ({**BASE, "startingTimestamp": "yesterday"}, "is not a time in milliseconds"),
    ({**BASE, "startingTimestamp": "-5"}, "must not be negative"),
    ({**BASE, "maxOffsetsPerTrigger": "0"}, "maxOffsetsPerTrigger must be at least 1"),
    ({**BASE, "minPartitions": "many"}, "minPartitions: 'many' is not a whole number"),
    ({**BASE, "failOnDataLoss": "maybe"}, "failOnDataLoss: 'maybe' is not true or false"),
    ({**BASE, "endingOffsets": "latest"}, "endingOffsets is for batch reads"),
])
def test_a_bad_option_is_one_line_naming_it(options, says):
    with pytest.raises(StreamOptionError) as caught:
        log_options(options, batch=False)
    text = str(caught.value)
    assert says in text and "\n" not in text and text.startswith("mqd: ")


def test_a_batch_read_ends_at_latest_a_time_or_offsets_only():
    assert log_options({**BASE, "endingTimestamp": "5"}, batch=True).ending.timestamp_ms == 5
    with pytest.raises(StreamOptionError, match="endingOffsets: 'earliest' is not latest"):
        log_options({**BASE, "endingOffsets": "earliest"}, batch=True)
