"""--retention-time and --retention-bytes: their forms, their precedence, the sizes, the refusals."""

from __future__ import annotations

import pytest

from mqd.nsqd.broker import Broker
from mqd.nsqd.tap import Options
from mqd.options import MQD_OPTIONS, ConfigError, check_retention, parse_size, resolve
from mqd.tap import settings_from
from tests.support.http_client import HTTPClient
from tests.support.inprocess_broker import settings


def write(tmp_path, text: str) -> str:
    path = tmp_path / "mqd.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_retention_is_off_by_default():
    s = resolve(MQD_OPTIONS, {})
    assert (s.retention_time, s.retention_bytes) == (0.0, 0)


def test_flag_over_yaml_over_default(tmp_path):
    path = write(tmp_path, "retention-time: 24h\nretention_bytes: 10GB\n")
    s = resolve(MQD_OPTIONS, {"retention-bytes": "512MiB"}, path)
    assert s.retention_time == 86400.0  # the file, under its flag name
    assert s.retention_bytes == 512 << 20  # the flag beats the file's underscore spelling
    assert {"retention-time", "retention-bytes"} <= s._explicit


def test_yaml_takes_a_plain_integer_of_bytes(tmp_path):
    s = resolve(MQD_OPTIONS, {}, write(tmp_path, "retention-bytes: 1000000\n"))
    assert s.retention_bytes == 1_000_000


def test_twistd_flags_reach_the_settings():
    opts = Options()
    opts.parseOptions(["--retention-time=1h30m", "-retention-bytes=2GiB"])
    s = settings_from(opts, MQD_OPTIONS, "mqd")
    assert (s.retention_time, s.retention_bytes) == (5400.0, 2 << 30)


@pytest.mark.parametrize(("text", "size"), [
    ("0", 0), ("123", 123), ("10KB", 10_000), ("10kb", 10_000), ("3MB", 3_000_000), ("10GB", 10 * 10**9),
    ("2TB", 2 * 10**12), ("1KiB", 1024), ("512MiB", 512 << 20), ("1GiB", 1 << 30), ("1TiB", 1 << 40),
    (" 5 MB ", 5_000_000), ("7B", 7), (42, 42),
])
def test_sizes_take_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1", "1.5GB", "10XB", "GB", "10 G", "ten", "1e9", True, -5, None, 1.5])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_bad_values_are_reported_with_their_origin(tmp_path):
    with pytest.raises(ConfigError, match=r"^--retention-bytes: expected a size like"):
        resolve(MQD_OPTIONS, {"retention-bytes": "lots"})
    with pytest.raises(ConfigError, match=r"^--retention-time: must be in 0\.\."):
        resolve(MQD_OPTIONS, {"retention-time": "-1h"})
    with pytest.raises(ConfigError, match=r"^--retention-bytes: must be in 0\.\."):
        resolve(MQD_OPTIONS, {"retention-bytes": "9999999999999999999TB"})
    path = write(tmp_path, "retention-time: soon\n")
    with pytest.raises(ConfigError, match=r"mqd.yaml: retention-time: expected a duration"):
        resolve(MQD_OPTIONS, {}, path)


def test_memory_backend_with_a_time_bound_alone_is_refused():
    s = resolve(MQD_OPTIONS, {"backend": "memory", "retention-time": "1h"})
    with pytest.raises(ConfigError) as e:
        check_retention(s)
    assert str(e.value) == "--backend memory keeps the retained log in RAM: set --retention-bytes to bound it"


@pytest.mark.parametrize("flags", [
    {"backend": "memory", "retention-time": "1h", "retention-bytes": "1GB"},
    {"backend": "memory", "retention-bytes": "1GB"},
    {"backend": "lmdb", "retention-time": "1h"},
    {"backend": "memory"},
    {"backend": "dummy", "retention-bytes": "1GB"},
])
def test_other_combinations_are_accepted(flags):
    check_retention(resolve(MQD_OPTIONS, flags))


def test_the_broker_refuses_to_open_before_touching_the_data_path(tmp_path, clock):
    data = tmp_path / "data"
    broker = Broker(settings(data, backend="memory", retention_time="1h"), clock=clock)
    with pytest.raises(ConfigError, match="set --retention-bytes"):
        broker.open()
    assert not data.exists()


def test_config_shows_the_options_as_nsqd_shows_values(make_broker):
    broker = make_broker(retention_time="1h", retention_bytes="1KB")
    http = HTTPClient(broker)
    assert http.get("/config/retention_time").json() == 3_600_000_000_000
    assert http.get("/config/retention_bytes").json() == 1000
