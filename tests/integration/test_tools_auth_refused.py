"""mq-tail and mq-to-file against a broker whose auth server refuses them: nsq_tail's exit.

nsq_tail 1.3.0, given `--nsqd-tcp-address` of an nsqd whose auth server
refuses the secret, prints go-nsq's `Error authenticating E_AUTH_FAILED
AUTH failed` (or `Auth Required` without a secret) and exits 1: a wrong
secret will not get better by retrying. With `--lookupd-http-address` it
logs the refusal at every lookupd poll and keeps running. The mq tools do
the same, with one log line per attempt and never "Unhandled error in
Deferred".
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.support.authd import SUBSCRIBE, AuthServer, grant
from tests.support.cli_tools import TIMEOUT, has_channel, tool
from tests.support.processes import http_request, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def refusing(tmp_path, start_broker):
    """A broker whose auth server knows only the secret "good"."""
    authd = AuthServer(tmp_path)
    authd.answers["good"] = grant(SUBSCRIBE)
    authd.answers["nothing"] = grant()  # no authorizations: E_UNAUTHORIZED
    broker = start_broker(f"--auth-http-address={authd.address}", "--broadcast-address=127.0.0.1")
    yield broker
    authd.close()


def run(name: str, *args: str) -> tuple[int, list[str]]:
    proc = subprocess.run(tool(name, *args), capture_output=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)
    err = proc.stderr.decode()
    assert "Traceback" not in err and "Unhandled" not in err and "critical" not in err, err
    return proc.returncode, err.splitlines()


@pytest.mark.parametrize(("secret", "last"), [
    ("--consumer-opt=auth_secret=wrong", "Error authenticating E_AUTH_FAILED AUTH failed"),
    ("--consumer-opt=auth_secret,nothing",
     "Error authenticating E_UNAUTHORIZED AUTH no authorizations found"),
    ("--max-in-flight=5", "Auth Required"),  # no secret at all
])
def test_tail_exits_1_with_go_nsqs_message(refusing, secret, last):
    code, lines = run("tail", "--topic=t", f"--nsqd-tcp-address={refusing.tcp_address}", secret)
    assert code == 1
    assert lines[-1] == last
    errors = [line for line in lines if "[mqd.client#" in line and "#info]" not in line]
    assert len(errors) == 1 and errors[0].endswith(f"{last}; not reconnecting"), lines


def test_tail_with_the_right_secret_is_let_in(refusing):
    tail = subprocess.Popen(tool("tail", "--topic=t", f"--nsqd-tcp-address={refusing.tcp_address}",
                                 "--consumer-opt=auth_secret=good", "-n", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: has_channel(refusing, "t"), TIMEOUT, "mq-tail's SUB")
        assert http_request(refusing.http_address, "POST", "/pub?topic=t", b"hello")[0] == 200
        out, err = tail.communicate(timeout=TIMEOUT)
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.communicate()
    assert tail.returncode == 0 and out == b"hello\n", err.decode()


def test_to_file_exits_1_too(refusing, tmp_path):
    out = tmp_path / "out"
    code, lines = run("to_file", "--topic=t", f"--nsqd-tcp-address={refusing.tcp_address}",
                      "--consumer-opt=auth_secret=wrong", f"--output-dir={out}")
    assert code == 1
    assert ("ERROR: couldn't create logger for topic t: "
            "Error authenticating E_AUTH_FAILED AUTH failed") in lines
    assert not out.exists() or list(out.iterdir()) == []  # nothing written


def test_tail_through_lookupd_keeps_trying_one_line_per_poll(start_lookupd, start_broker, tmp_path):
    lookupd = start_lookupd()
    authd = AuthServer(tmp_path)
    broker = start_broker(f"--auth-http-address={authd.address}", "--broadcast-address=127.0.0.1",
                          f"--lookupd-tcp-address={lookupd.tcp_address}")
    try:
        broker.post("/topic/create?topic=t")
        wait_for(lambda: lookupd.get("/lookup?topic=t")[0] == 200, TIMEOUT, "registration")
        tail = subprocess.Popen(
            tool("tail", "--topic=t", f"--lookupd-http-address={lookupd.http_address}",
                 "--consumer-opt=auth_secret=wrong", "--consumer-opt=lookupd_poll_interval=300ms"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(2.5)
        assert tail.poll() is None  # still running, as nsq_tail does with lookupd
        tail.send_signal(signal.SIGTERM)
        _, err = tail.communicate(timeout=TIMEOUT)
    finally:
        authd.close()
    text = err.decode()
    assert "Traceback" not in text and "Unhandled" not in text, text
    refusals = [line for line in text.splitlines() if "Error authenticating E_AUTH_FAILED" in line]
    warnings = [line for line in text.splitlines()
                if "[mqd.client#" in line and "#info]" not in line]
    assert len(refusals) >= 2 and warnings == refusals, text  # one line per attempt, nothing else
