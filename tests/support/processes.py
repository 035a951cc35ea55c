"""Real mqd and mqlookupd processes under twistd, and blocking HTTP calls and waits on them.

Everything here waits with a deadline, so a broken broker fails a test
with a message saying what it was waiting for instead of hanging the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")

# A queue scan this fast makes msg timeouts and deferred messages fire
# within a few tens of milliseconds of their due time.
FAST_SCAN = ("--queue-scan-interval=20ms", "--queue-scan-refresh-interval=100ms")

DEFAULT_TIMEOUT = 10.0

# Loopback only: never through an http_proxy from the environment.
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

LISTENING = re.compile(r"\b(TCP|HTTPS|HTTP): listening on (\S+):(\d+)\s*$", re.MULTILINE)


def child_env() -> dict[str, str]:
    """The environment for twistd: ours, plus the checkout so the plugin is found.

    Installed non-editable (as tox does) the plugin is found anyway; in the
    dev checkout `twisted/plugins/mqd_plugins.py` is only on the path this way.
    """
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        paths.append(str(REPO_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def twistd_command(*args: str, program: str = "mqd") -> list[str]:
    return [TWISTD, "-n", "--pidfile=", program, *args]


class BrokerStartError(AssertionError):
    pass


class TwistdProcess:
    """A twistd daemon (mqd or mqlookupd) on ephemeral loopback ports, logging to files.

    Subclasses set `program`, the twistd plugin to run; its log goes to
    files in `workdir` named after it (never a pipe, so a chatty process
    cannot block).
    """

    program = "twistd"

    def __init__(self, workdir: Path, args: Sequence[str]) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.program}.log"
        self.stderr_path = self.workdir / f"{self.program}.stderr"
        self.argv = twistd_command(*args, program=self.program)
        self.proc: subprocess.Popen | None = None
        self.tcp_host = self.http_host = ""
        self.tcp_port = self.http_port = 0
        self.https_port = 0  # only when the broker has --tls-cert/--tls-key
        self.returncodes: list[int] = []
        self._log_offset = 0

    # -- addresses -----------------------------------------------------------

    @property
    def tcp_address(self) -> str:
        return f"{self.tcp_host}:{self.tcp_port}"

    @property
    def http_address(self) -> str:
        return f"{self.http_host}:{self.http_port}"

    # -- life cycle ------------------------------------------------------------

    def start(self, timeout: float = 15.0) -> TwistdProcess:
        assert self.proc is None or self.proc.poll() is not None, f"{self.program} already running"
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=child_env(),
                cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout
        while True:
            found = {m.group(1): (m.group(2), int(m.group(3)))
                     for m in LISTENING.finditer(self.log())}
            if "TCP" in found and "HTTP" in found:
                self.tcp_host, self.tcp_port = found["TCP"]
                self.http_host, self.http_port = found["HTTP"]
                self._wait_until_serving(deadline)
                # All listeners have logged by the time the reactor serves.
                found = {m.group(1): int(m.group(3)) for m in LISTENING.finditer(self.log())}
                self.https_port = found.get("HTTPS", 0)
                return self
            if self.proc.poll() is not None:
                self.returncodes.append(self.proc.returncode)
                raise BrokerStartError(
                    f"{self.program} exited with {self.proc.returncode} before listening\n"
                    f"argv: {self.argv}\n{self.describe()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise BrokerStartError(f"{self.program} did not listen within {timeout}s\n{self.describe()}")
            time.sleep(0.02)

    def _wait_until_serving(self, deadline: float) -> None:
        """Wait for /ping to answer: the reactor is running, signal handlers in place.

        The "listening on" lines are logged before twistd starts its reactor,
        and until then SIGTERM kills the process outright instead of shutting
        it down; a stop right after start must not fall into that window.
        """
        url = f"http://{self.http_address}/ping"
        while True:
            try:
                with NO_PROXY.open(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as e:
                if e.code == 403:  # --tls-required=true: plain HTTP turns everything away
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise BrokerStartError(f"{self.program} never answered {url}\n{self.describe()}")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait: the clean shutdown. Returns the exit status.

        twistd re-raises the signal that stopped it once it has shut down
        cleanly (Twisted's `_exitWithSignal`), so a clean stop is -SIGTERM
        as often as 0; `assert_clean_exit` accepts both.
        """
        proc = self.proc
        assert proc is not None, f"{self.program} never started"
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"{self.program} did not exit within {timeout}s of SIGTERM\n{self.describe()}"
                ) from None
        self.returncodes.append(proc.returncode)
        return proc.returncode

    def kill(self) -> None:
        """Make sure the process is gone (teardown); harmless if it already is."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - nothing more to do
                pass

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- what it left behind ---------------------------------------------------

    def log(self) -> str:
        """The log of the current (or last) run only."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def full_log(self) -> str:
        try:
            return self.log_path.read_text("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def describe(self) -> str:
        return f"--- log ---\n{self.log()[-4000:]}\n--- stderr ---\n{self.stderr()[-2000:]}"

    # -- its HTTP API ------------------------------------------------------------

    def get(self, path: str) -> tuple[int, Any]:
        """(status, JSON body) of a GET on its HTTP API."""
        status, raw = http_request(self.http_address, "GET", path)
        return status, json.loads(raw or b"null")

    def post(self, path: str) -> int:
        """The status of a POST without a body."""
        return http_request(self.http_address, "POST", path, b"")[0]


class BrokerProcess(TwistdProcess):
    """One mqd under twistd on ephemeral loopback ports, with its own data directory.

    `restart()` keeps the data directory and arguments, the ports change.
    """

    program = "mqd"

    def __init__(
        self,
        workdir: Path,
        args: Sequence[str] = (),
        *,
        addresses: bool = True,
        data_path: bool = True,
    ) -> None:
        self.data_dir = Path(workdir) / "data"
        self._base_argv: list[str] = []
        if addresses:
            self._base_argv += ["--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0"]
        if data_path:
            self._base_argv.append(f"--data-path={self.data_dir}")
        super().__init__(workdir, [*self._base_argv, *args])

    def assert_clean_exit(self, code: int) -> None:
        assert code in (0, -signal.SIGTERM), f"mqd exited with {code}\n{self.describe()}"
        log = self.log()
        assert "Server Shut Down." in log, f"no clean shutdown in the log\n{self.describe()}"
        assert "Traceback" not in log and "Unhandled" not in log, self.describe()

    def stop_cleanly(self) -> None:
        self.assert_clean_exit(self.stop())

    def restart(self) -> BrokerProcess:
        self.stop_cleanly()
        return self.start()

    def reconfigure(self, *args: str) -> None:
        """Other flags for the next start; the work directory, data and addresses stay."""
        assert not self.running, "reconfigure a stopped broker"
        self.argv = twistd_command(*self._base_argv, *args)

    def crash(self, timeout: float = 10.0) -> int:
        """SIGKILL, as a crash stops it: no shutdown code runs (the OS page cache survives)."""
        proc = self.proc
        assert proc is not None and proc.poll() is None, "broker not running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout)
        self.returncodes.append(proc.returncode)
        assert proc.returncode == -signal.SIGKILL, f"mqd exited with {proc.returncode}"
        return proc.returncode

    @property
    def metadata_path(self) -> Path:
        return self.data_dir / "nsqd.dat"

    def metadata(self) -> dict[str, Any]:
        return json.loads(self.metadata_path.read_bytes())

    def channels_in_metadata(self) -> dict[str, list[str]]:
        """{topic: [channel, ...]} as nsqd.dat lists them."""
        try:
            meta = self.metadata()
        except (FileNotFoundError, ValueError):
            return {}
        return {t["name"]: [c["name"] for c in t.get("channels") or []]
                for t in meta.get("topics") or []}


# -- mqlookupd -------------------------------------------------------------------------


class LookupdProcess(TwistdProcess):
    """One mqlookupd under twistd on ephemeral loopback ports, log to files.

    `restart()` keeps the arguments; the ports change (and lookupd's
    memory is gone, as nsqlookupd's is: brokers re-register).
    """

    program = "mqlookupd"

    def __init__(self, workdir: Path, args: Sequence[str] = ()) -> None:
        super().__init__(workdir, ["--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0", *args])

    def restart(self) -> LookupdProcess:
        code = self.stop()
        assert code in (0, -signal.SIGTERM), f"mqlookupd exited with {code}\n{self.describe()}"
        return self.start()


def http_request(address: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of one request to `host:port`, error statuses included, no proxy."""
    request = urllib.request.Request(f"http://{address}{path}", data=body, method=method)
    try:
        with NO_PROXY.open(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(condition, timeout: float = 5.0, what: str = "condition"):
    """Poll `condition` until it is truthy (its value is returned) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


