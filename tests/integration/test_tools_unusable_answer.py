"""The mq-* tools against a broker whose handshake answer they cannot use: exit 1 with one line.

nsq_tail 1.3.0 (and to_nsq) given `--nsqd-tcp-address` of a broker whose
IDENTIFY answer holds `"max_rdy_count": 1e30` (no int64) prints go-nsq's
`failed to IDENTIFY - json: cannot unmarshal number ... of type int64`
and exits 1 at once: the same broker gives the same answer to a retry.
mq-tail reconnected forever instead. Here a fake broker (a thread with a
socket, not a real one) answers every IDENTIFY that way, or refuses it
with an error frame, and each tool must end with status 1, that line
last, having dialed the broker once.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import threading

import pytest

from tests.support.cli_tools import TIMEOUT, tool

pytestmark = pytest.mark.slow

HUGE = b'{"max_rdy_count": 1000000000000000000000000000000, "version": "1.3.0", "tls_v1": false}'
GO_TEXT = ("failed to IDENTIFY - json: cannot unmarshal number 1000000000000000000000000000000 into "
           "Go struct field IdentifyResponse.max_rdy_count of type int64")
BAD_BODY = b"E_BAD_BODY IDENTIFY heartbeat interval (1) is invalid"


class FakeBroker:
    """Accepts connections on 127.0.0.1 and answers each IDENTIFY with one frame, then waits."""

    def __init__(self, frame_type: int, payload: bytes) -> None:
        self.frame = struct.pack(">ii", len(payload) + 4, frame_type) + payload
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        self._open: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        try:
            while b"IDENTIFY\n" not in data or len(data) < data.index(b"IDENTIFY\n") + 13:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            conn.sendall(self.frame)
            while conn.recv(4096):  # until the client closes
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()
        for conn in self._open:
            conn.close()


@pytest.fixture(params=[(0, HUGE, GO_TEXT), (1, BAD_BODY, "failed to IDENTIFY - " + BAD_BODY.decode())],
                ids=["max-rdy-count-1e30", "identify-refused"])
def broker(request):
    frame_type, payload, text = request.param
    fake = FakeBroker(frame_type, payload)
    fake.text = text  # type: ignore[attr-defined]
    yield fake
    fake.close()


def run(name: str, *args: str, stdin: bytes = b"") -> tuple[int, list[str]]:
    proc = subprocess.run(tool(name, *args), capture_output=True, timeout=TIMEOUT, input=stdin)
    err = proc.stderr.decode()
    assert "Traceback" not in err and "Unhandled" not in err and "critical" not in err, err
    return proc.returncode, err.splitlines()


def test_tail_exits_1_with_go_nsqs_line_after_one_attempt(broker):
    code, lines = run("tail", "--topic=t", f"--nsqd-tcp-address={broker.address}")
    assert code == 1
    assert lines[-1] == broker.text
    assert broker.connections == 1
    errors = [line for line in lines if "[mqd.client#" in line and "#info]" not in line]
    assert len(errors) == 1 and errors[0].endswith(f"{broker.text}; not reconnecting"), lines


def test_to_file_exits_1_naming_the_topic(broker, tmp_path):
    out = tmp_path / "out"
    code, lines = run("to_file", "--topic=t", f"--nsqd-tcp-address={broker.address}",
                      f"--output-dir={out}")
    assert code == 1
    # Its info lines (the consumer stopping) may follow: mq-to-file logs at info, as nsq_to_file.
    assert [line for line in lines if line.startswith("ERROR")] == [
        f"ERROR: couldn't create logger for topic t: {broker.text}"]
    assert broker.connections == 1
    assert not out.exists() or list(out.iterdir()) == []


def test_pub_exits_1_before_publishing(broker):
    code, lines = run("pub", "--topic=t", f"--nsqd-tcp-address={broker.address}", stdin=b"a\nb\n")
    assert code == 1
    assert lines[-1] == broker.text
