"""Start-up and shutdown of `twistd mqd`: the YAML file, flags over it, errors, SIGTERM."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest

from tests.support.ipv6 import host_has_ipv6_loopback
from tests.support.processes import FAST_SCAN, child_env, http_request, twistd_command
from tests.support.pynsq_loop import Collector
from tests.support.raw_conn import RawConn, command
from tests.support.v2_frames import mpub_body

# Every test starts `twistd mqd` (some as a plain subprocess, not through a fixture).
pytestmark = pytest.mark.slow


def _write_yaml(path, text: str):
    path.write_text(text)
    return path


def _held_by_ephemeral_topic(broker, name) -> list[bytes]:
    """Publish 10 to an ephemeral topic with no channel, then drain it.

    Such a topic keeps at most mem-queue-size messages and drops the rest
    (as nsqd's do), which makes the setting visible from outside.
    """
    topic = name() + "#ephemeral"
    bodies = [b"q%02d" % i for i in range(10)]
    with RawConn(broker) as producer:
        producer.send(command(f"MPUB {topic}", mpub_body(bodies)))
        assert producer.read_frame() == (0, b"OK")
    got = []
    with RawConn(broker) as consumer:
        consumer.send(command(f"SUB {topic} c") + command("RDY 100"))
        assert consumer.read_frame() == (0, b"OK")
        deadline = time.monotonic() + 0.5
        consumer.sock.settimeout(0.1)
        while time.monotonic() < deadline:
            try:
                got.append(consumer.read_message()[3])
            except TimeoutError:
                continue
    return got


def test_yaml_config_values_are_used(start_broker, tmp_path, name):
    config = _write_yaml(tmp_path / "mqd.yaml", (
        "# comments and both spellings of a key are fine\n"
        "tcp-address: 127.0.0.1:0\n"
        "http_address: '127.0.0.1:0'\n"
        "mem-queue-size: 3\n"
        f"data-path: {tmp_path / 'yamldata'}\n"
        "msg-timeout: 30s\n"
    ))
    broker = start_broker(f"--config={config}", addresses=False, data_path=False)
    # The addresses came from the file: loopback, a port picked at start-up
    # (the defaults would be every interface, 4150 and 4151).
    assert broker.tcp_host == broker.http_host == "127.0.0.1"
    assert broker.tcp_port not in (0, 4150) and broker.http_port not in (0, 4151)
    assert _held_by_ephemeral_topic(broker, name) == [b"q00", b"q01", b"q02"]
    # And the data path: the metadata file is written there.
    assert (tmp_path / "yamldata" / "nsqd.dat").exists()
    assert not broker.metadata_path.exists()


def test_flags_override_the_yaml_file(start_broker, tmp_path, name):
    config = _write_yaml(tmp_path / "mqd.yaml",
                         "tcp-address: 127.0.0.1:0\nhttp-address: 127.0.0.1:0\nmem-queue-size: 3\n")
    broker = start_broker(f"--config={config}", "--mem-queue-size=5", *FAST_SCAN,
                          addresses=False)
    assert _held_by_ephemeral_topic(broker, name) == [b"q00", b"q01", b"q02", b"q03", b"q04"]


def test_go_style_single_dash_flags_are_accepted(start_broker, tmp_path, name):
    broker = start_broker("-tcp-address=127.0.0.1:0", "-http-address=127.0.0.1:0",
                          "-mem-queue-size=4", addresses=False)
    assert broker.tcp_host == "127.0.0.1"
    assert _held_by_ephemeral_topic(broker, name) == [b"q00", b"q01", b"q02", b"q03"]


BAD_CONFIGS = {
    "unknown-key": ("tcp-address: 127.0.0.1:0\nmem-queu-size: 3\n", ["mem-queu-size"]),
    "bad-value": ("mem-queue-size: lots\n", ["mem-queue-size", "lots"]),
    "bad-duration": ("msg-timeout: soon\n", ["msg-timeout", "soon"]),
    "bad-address": ("tcp-address: nowhere\n", ["tcp-address", "nowhere"]),
    "syntax-error": ("tcp-address: [127.0.0.1:0\nmem-queue-size: 3\n", ["invalid YAML", "line"]),
    "not-a-mapping": ("- tcp-address\n", []),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_yaml_stops_start_up_with_one_line(case, tmp_path):
    text, words = BAD_CONFIGS[case]
    config = _write_yaml(tmp_path / f"{case}.yaml", text)
    proc = subprocess.run(
        twistd_command(f"--config={config}", f"--data-path={tmp_path / 'data'}"),
        env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    line = lines[0]
    assert str(config) in line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert "Traceback" not in proc.stdout + proc.stderr
    # Nothing was started: no listener, no metadata.
    assert "listening on" not in proc.stdout
    assert not (tmp_path / "data" / "nsqd.dat").exists()


def test_bad_flag_stops_start_up_with_one_line(tmp_path):
    proc = subprocess.run(
        twistd_command("--mem-queue-size=-1", f"--data-path={tmp_path}"),
        env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mem-queue-size" in lines[0], proc.stderr


def test_port_in_use_stops_start_up_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            twistd_command(f"--tcp-address=127.0.0.1:{port}", "--http-address=127.0.0.1:0",
                           f"--data-path={tmp_path}"),
            env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=30,
            stdin=subprocess.DEVNULL,
        )
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if "mqd: TCP: cannot listen" in line]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "in use" in errors[0], output
    assert "Traceback" not in output


def test_missing_config_file_is_reported(tmp_path):
    missing = tmp_path / "nope.yaml"
    proc = subprocess.run(
        twistd_command(f"--config={missing}"), env=child_env(), cwd=tmp_path,
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0], proc.stderr


def test_sigterm_shuts_down_cleanly_and_writes_metadata(start_broker, loop, name):
    broker = start_broker(*FAST_SCAN)
    topic = name()
    got = Collector()
    loop.reader(broker, topic, "c", got)
    with RawConn(broker) as producer:
        producer.send(command(f"PUB {topic}", b"x"))
        assert producer.read_frame() == (0, b"OK")
    loop.run_until(lambda: got.bodies == [b"x"], what="the message")
    # Remove the file written at start-up so the one found after is the
    # shutdown's own.
    broker.metadata_path.unlink()

    started = time.monotonic()
    broker.stop_cleanly()  # exit status, "Server Shut Down.", no traceback
    assert time.monotonic() - started < 5
    assert broker.channels_in_metadata() == {topic: ["c"]}
    # The consumer was disconnected by the shutdown, not left hanging.
    loop.run_until(lambda: not any(c.connected() for r in loop.clients for c in r.conns.values()),
                   what="the Reader to see the connection close")


def test_every_interface_means_ipv6_and_ipv4_as_for_nsqd(start_broker, name):
    """`0.0.0.0:PORT` and `:PORT` listen on IPv6 and IPv4 at once, logged as `[::]:PORT`.

    nsqd's Go listener on a wildcard address is one IPv6 socket that also
    takes IPv4; its clients appear in /stats as Go writes their addresses.
    On a host without IPv6 both listen on IPv4 alone, as nsqd's do.
    """
    broker = start_broker("--tcp-address=0.0.0.0:0", "--http-address=:0", addresses=False)
    ipv6 = host_has_ipv6_loopback()
    assert broker.tcp_host == broker.http_host == ("[::]" if ipv6 else "0.0.0.0")
    topic = name()
    expected = {}
    conns = []
    for host in ("127.0.0.1", "::1") if ipv6 else ("127.0.0.1",):
        conn = RawConn(SimpleNamespace(tcp_host=host, tcp_port=broker.tcp_port))
        conns.append(conn)
        conn.send(command(f"SUB {topic} ch"))
        assert conn.read_frame() == (0, b"OK")
        ip, port = conn.sock.getsockname()[:2]
        expected[f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"] = ip
    for http_host in ("127.0.0.1", "[::1]") if ipv6 else ("127.0.0.1",):
        status, raw = http_request(f"{http_host}:{broker.http_port}", "GET",
                                   f"/stats?format=json&topic={topic}")
        assert status == 200
        clients = json.loads(raw)["topics"][0]["channels"][0]["clients"]
        assert {c["remote_address"]: c["client_id"] for c in clients} == expected
    for conn in conns:
        conn.close()
