"""Start a broker (mqd under twistd, or a real nsqd), find its port in the log, watch its memory.

The broker is a separate process that the harness only observes from outside
(/proc), so measuring it costs the broker nothing and works the same for an
already running broker given by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

from bench.harness import wire

REPO = Path(__file__).resolve().parents[2]
NSQD_BIN_ENV = "NSQD_BIN"  # a real nsqd (or the directory of NSQ's binaries) to compare with
# Where a workspace may keep NSQ's release binaries beside the checkout; used only when present.
NSQ_BIN_BESIDE = REPO / ".." / "shared" / "nsq-1.3.0" / "bin"
_LISTEN = re.compile(rb"TCP: listening on (\S+)")
_HTTP = re.compile(rb"HTTP: listening on (\S+)")
_TICK = os.sysconf("SC_CLK_TCK")
# Flags that differ per run; left out when a broker's command line describes a figure.
_PER_RUN = ("--tcp-address", "--http-address", "--data-path")


def checkout_env() -> dict[str, str]:
    """This environment with the working tree first on the path.

    Child processes (twistd, `python -m spark_bridge`) then run this
    checkout's code, and twistd finds twisted/plugins/mqd_plugins.py, even
    when mqd is not (or differently) installed.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class BrokerError(Exception):
    """The broker did not start, or died; carries the tail of its log."""


class BenchError(Exception):
    """A child process failed or the run could not proceed."""


# What ends a bench with "error: ..." and exit status 1 rather than a traceback
# (python -m bench catches them for every command).
ERRORS = (BenchError, BrokerError, wire.ProtocolError, OSError)


def broker_command(
    backend: str, mem_queue_size: int, data_path: str, extra: list[str] | None = None
) -> list[str]:
    """The twistd command line; twistd from the running venv so the plugin is found."""
    twistd = str(Path(sys.executable).parent / "twistd")
    return [
        twistd,
        "-n",
        "--pidfile=",
        "mqd",
        "--tcp-address=127.0.0.1:0",
        "--http-address=127.0.0.1:0",
        f"--data-path={data_path}",
        f"--mem-queue-size={mem_queue_size}",
        f"--backend={backend}",
        *(extra or []),
    ]


def lookupd_command() -> list[str]:
    """``twistd mqlookupd`` on ephemeral loopback ports, twistd from the running venv."""
    twistd = str(Path(sys.executable).parent / "twistd")
    return [twistd, "-n", "--pidfile=", "mqlookupd", "--tcp-address=127.0.0.1:0",
            "--http-address=127.0.0.1:0"]


def find_nsqd(
    value: str | None, program: str = "nsqd", use_env: bool = True, use_beside: bool = False
) -> str | None:
    """The NSQ binary ``program`` that ``value`` names: nsqd's path, or the directory of NSQ's binaries.

    Other programs (nsqlookupd, bench_writer) are looked up beside the nsqd
    named. Without a value, ``$NSQD_BIN`` (same forms) when ``use_env``, then,
    when ``use_beside``, ``NSQ_BIN_BESIDE`` if that directory exists; ``none``
    or nothing found is None. Raises ValueError for a path that is not an
    executable, so a typo is not silently a run without nsqd.
    """
    if value is None and use_env:
        value = os.environ.get(NSQD_BIN_ENV) or None
    if value is None and use_beside and NSQ_BIN_BESIDE.is_dir():
        value = str(NSQ_BIN_BESIDE.resolve())
    if value is None or value == "none":
        return None
    if os.path.isdir(value):
        path = os.path.join(value, program)
    elif program == "nsqd":
        path = value
    else:
        path = os.path.join(os.path.dirname(value) or ".", program)
    if not os.access(path, os.X_OK) or os.path.isdir(path):
        raise ValueError(f"{path} is not an executable {program}")
    return path


def nsqd_command(nsqd: str, mem_queue_size: int, extra: list[str] | None = None) -> list[str]:
    """A real nsqd on loopback ports; ``{data}`` becomes the Broker's fresh data directory."""
    return [
        nsqd,
        "--tcp-address=127.0.0.1:0",
        "--http-address=127.0.0.1:0",
        "--data-path={data}",
        f"--mem-queue-size={mem_queue_size}",
        *(extra or []),
    ]


def nsqd_option(parser: argparse.ArgumentParser, value: str, mem_queue_size: int) -> list[str]:
    """The command line of the real nsqd a ``--nsqd-bin`` option names; a usage error if none."""
    try:
        nsqd = find_nsqd(value, use_env=False)
    except ValueError as exc:
        parser.error(f"--nsqd-bin: {exc}")
    if nsqd is None:
        parser.error("--nsqd-bin: the path of nsqd, or of the directory of NSQ's binaries")
    return nsqd_command(nsqd, mem_queue_size)


def describe_exit(code: int | None) -> str:
    """A broker's exit status in words; twistd re-raises the SIGTERM it handled."""
    status = f"exit code {code}"
    if code == -signal.SIGTERM:
        status += ": SIGTERM, as twistd exits after a graceful stop"
    return status


def clean_exit(code: int | None) -> bool:
    return code in (0, -signal.SIGTERM)


class Broker:
    """A broker subprocess with a private temporary data directory.

    The log goes to a file rather than a pipe so a chatty broker can never block
    on a full pipe while the harness is busy elsewhere.
    """

    def __init__(
        self,
        backend: str = "memory",
        mem_queue_size: int = 1_000_000,
        extra: list[str] | None = None,
        argv: list[str] | None = None,
        keep: bool = False,
        startup_timeout: float = 20.0,
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="mqd-bench-"))
        self.data_path = self.workdir / "data"
        self.data_path.mkdir()
        self.log_path = self.workdir / "broker.log"
        self.custom = bool(argv)
        if argv:
            self.argv = [a.replace("{data}", str(self.data_path)) for a in argv]
        else:
            self.argv = broker_command(backend, mem_queue_size, str(self.data_path), extra)
        self.keep = keep
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.address: tuple[str, int] | None = None
        self.http_address: str | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def describe(self) -> str:
        """The command line as a report gives it: the flags that matter, not ports or paths."""
        if self.custom:
            return " ".join(self.argv)
        return "twistd -n mqd " + " ".join(a for a in self.argv[4:] if not a.startswith(_PER_RUN))

    def start(self) -> tuple[str, int]:
        """Launch and wait for the ``TCP: listening on HOST:PORT`` log line."""
        env = checkout_env()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()
            match = _LISTEN.search(text)
            if match:
                self.address = wire.parse_address(match.group(1).decode())
                http = _HTTP.search(text)
                self.http_address = http.group(1).decode() if http else None
                return self.address
            if self.proc.poll() is not None:
                raise BrokerError(
                    f"broker exited with {self.proc.returncode} before listening:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise BrokerError(f"no 'TCP: listening on' line within {self.startup_timeout} s:\n{tail}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait; a broker flushing a large backlog to disk may need a while."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.returncode = self.proc.returncode
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return self.returncode

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of ``pid`` in kB (OSError once it is gone).

    RssAnon is the heap without file pages, such as the LMDB data file a
    broker maps, which RSS counts.
    """
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0])
    return out


def read_proc(pid: int) -> tuple[int, int, float, int] | None:
    """(VmRSS kB, VmHWM kB, CPU seconds user+system, RssAnon kB) of ``pid``; None once gone."""
    try:
        memory = proc_memory(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return memory.get("VmRSS", 0), memory.get("VmHWM", 0), cpu, memory.get("RssAnon", 0)


def run_delay(pid: int) -> float | None:
    """Seconds the threads of ``pid`` have spent runnable but waiting for a CPU, summed; None once gone.

    The second field of each thread's /proc schedstat. On a machine whose
    cores the load shares with the broker, it tells a broker short of CPU
    time (it was ready, the scheduler ran something else) from one that
    was idle; None too where the kernel keeps no schedstat.
    """
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


class Sampler:
    """Samples the broker's RSS every 100 ms in a thread and keeps per-window peaks.

    VmHWM alone only gives the lifetime peak; sampling VmRSS gives a peak per
    scenario, which is what differs between writer, reader and both. RssAnon's
    peak is kept too: the heap alone, without the store's mapped file pages.
    """

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid = pid
        self.interval = interval
        self._lock = threading.Lock()
        self._peak = 0
        self._anon_peak = 0
        self._hwm = 0
        self._stop = threading.Event()
        self._window_start = (time.monotonic(), 0.0)
        self._delay_start: float | None = None
        self.wait_pct: float | None = None
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> Sampler:
        self.reset()
        self._thread.start()
        return self

    def _sample(self) -> None:
        got = read_proc(self.pid)
        if got is None:
            return
        rss, hwm, _, anon = got
        with self._lock:
            self._peak = max(self._peak, rss)
            self._anon_peak = max(self._anon_peak, anon)
            self._hwm = max(self._hwm, hwm)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def reset(self) -> None:
        """Start a new measurement window (peak RSS, peak RssAnon, CPU time and run-queue wait)."""
        got = read_proc(self.pid)
        delay = run_delay(self.pid)
        with self._lock:
            self._peak = got[0] if got else 0
            self._anon_peak = got[3] if got else 0
            self._window_start = (time.monotonic(), got[2] if got else 0.0)
            self._delay_start = delay

    def window(self) -> tuple[float, float]:
        """(peak RSS MB, CPU % of one core) since the last reset.

        Also sets `wait_pct`: the time the broker's threads spent waiting
        for a CPU in the window, in % of one core (None without schedstat;
        a thread that ended in the window takes its wait with it, so it is
        a lower bound).
        """
        self._sample()
        got = read_proc(self.pid)
        delay = run_delay(self.pid)
        with self._lock:
            peak = self._peak
            t0, cpu0 = self._window_start
            delay0 = self._delay_start
        elapsed = time.monotonic() - t0
        cpu = (got[2] - cpu0) if got else 0.0
        if delay is None or delay0 is None or elapsed <= 0:
            self.wait_pct = None
        else:
            self.wait_pct = max(0.0, 100.0 * (delay - delay0) / elapsed)
        return peak / 1024, (100.0 * cpu / elapsed if elapsed > 0 else 0.0)

    def anon_peak_kb(self) -> int:
        """Largest RssAnon (kB) since the last reset."""
        self._sample()
        with self._lock:
            return self._anon_peak

    def lifetime_peak_mb(self) -> float:
        """Largest VmHWM seen: the broker's all-time peak RSS while it was observed."""
        self._sample()
        with self._lock:
            return self._hwm / 1024

    def stop(self) -> None:
        self._sample()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


@contextlib.contextmanager
def running(broker: Broker, verbose: bool = True) -> Iterator[Sampler]:
    """Start ``broker``, sample it, and stop it again however the block ends.

    ``verbose`` prints the command, the address and the exit status; else only
    an unclean exit is reported. A failure inside the block prints the tail of
    the broker's log before the broker (and its log, unless kept) is gone.
    """
    sampler: Sampler | None = None
    if verbose:
        print(f"starting: {shlex.join(broker.argv)}", flush=True)
    try:
        address = broker.start()
        if verbose:
            print(
                f"broker pid {broker.pid} listening on {address[0]}:{address[1]}"
                + (f" (HTTP {broker.http_address})" if broker.http_address else ""),
                flush=True,
            )
        sampler = Sampler(broker.pid).start()
        yield sampler
    except Exception as exc:
        if broker.proc is not None and not isinstance(exc, BrokerError):
            print(f"broker log (tail):\n{broker.log_tail()}", file=sys.stderr)
        raise
    finally:
        if sampler is not None:
            sampler.stop()
        code = broker.stop()
        if verbose:
            kept = f"; data kept in {broker.workdir}" if broker.keep else ""
            print(f"broker stopped ({describe_exit(code)}){kept}", flush=True)
        elif not clean_exit(code):
            print(f"  warning: broker {describe_exit(code)}", flush=True)
