"""`python -m spark_bridge <command>`: the Spark bridge's command line.

- `snapshot` takes a consistent snapshot so analysis never touches the
  live data: `--broker URL` asks a running broker for its whole state
  (memory queues, in flight, deferred, its store) over HTTP; `--data-path`
  copies a stopped broker's store files (refused on a running broker,
  whose memory-held messages the files lack, unless `--lmdb-only`);
- `analyze` answers "what is stuck where, since when, and why" with
  PySpark (local by default, `--master` for a cluster) as a terminal
  table and an HTML report; with `--topic` instead of a snapshot, it
  analyses a window of the topics' retained logs ("the last 6 hours of
  events": `--since 6h`, or `--start-offsets` / `--end-offsets`) read
  from the brokers by offset, with the questions records can answer;
- `export` writes a snapshot as Parquet for tools outside Spark.

Imports are absolute so spark-submit can run this file directly
(`spark-submit .../spark_bridge/__main__.py analyze SNAPDIR`); pyspark is
imported only by `analyze`, so `snapshot` works without it.
"""

from __future__ import annotations

import argparse
import fcntl
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from mqd.nsqd.snapshot_format import DATA_FILE, Manifest, SnapshotError, take_snapshot

# How long `--broker` waits for the answer by default: a store of many GB takes a while to copy.
BROKER_TIMEOUT = 600.0


def summary(manifest: Manifest, path: str) -> str:
    """The manifest in a few lines: where it came from, the copy's throughput, each queue's states.

    A broker's snapshot is checked against the /stats counts it recorded at
    the same instant: they can only differ through a bug, so it says so.
    """
    mb = manifest.bytes / 1e6
    rate = mb / manifest.copy_seconds if manifest.copy_seconds > 0 else float("inf")
    copied = f"  {mb:.1f} MB copied in {manifest.copy_seconds:.3f} s ({rate:.0f} MB/s)"
    if manifest.source == "broker":
        mode = f"{manifest.backend} backend" + (", --durable" if manifest.durable else "")
        origin = f"  taken by the broker ({mode}): everything it held"
        copied += f"; reactor held {manifest.capture_seconds * 1e3:.1f} ms for the capture"
    else:
        origin = "  copied from the store's files: what the store held"
    queued = sum(q.queued for q in manifest.queues)
    in_flight = sum(q.in_flight for q in manifest.queues)
    deferred = sum(q.deferred for q in manifest.queues)
    lines = [
        f"snapshot {path}",
        f"  broker {manifest.broker_id}, taken {manifest.created_at}, format {manifest.data_format}",
        origin,
        copied,
        f"  {_queues(len(manifest.queues))}, {manifest.total} messages: "
        f"{queued} queued, {in_flight} in flight, {deferred} deferred",
    ]
    for q in manifest.queues:
        seqs = "" if q.first_seq is None else f"  stored seq {q.first_seq}..{q.last_seq}"
        lines.append(f"    {_where(q.topic, q.channel)}: {q.count} "
                     f"({q.queued} queued, {q.in_flight} in flight, {q.deferred} deferred){seqs}")
    if manifest.left_out:
        lines.append(f"  left out: {_queues(len(manifest.left_out))}")
        for left in manifest.left_out:
            lines.append(f"    {_where(left['topic'], left.get('channel'))} ({left.get('reason')}): "
                         f"depth {left.get('depth', 0)}, {left.get('in_flight_count', 0)} in flight, "
                         f"{left.get('deferred_count', 0)} deferred")
    if manifest.source == "broker":
        wrong = stats_mismatches(manifest)
        if wrong:
            lines.append(f"  !!! BUG: the rows of {_queues(len(wrong))} differ from /stats at the same "
                         "instant (please report it):")
            lines += [f"    {line}" for line in wrong]
        else:
            checked = sum(q.stats is not None for q in manifest.queues)
            lines.append(f"  stats check: the rows of {_queues(checked)} equal /stats at the capture instant")
    return "\n".join(lines)


def stats_mismatches(manifest: Manifest) -> list[str]:
    """One line per queue whose state counts differ from the /stats counts recorded with them."""
    wrong = []
    for q in manifest.queues:
        stats = q.stats
        if stats is None:
            continue
        expected = (stats.get("depth", 0), stats.get("in_flight_count", 0), stats.get("deferred_count", 0))
        if (q.queued, q.in_flight, q.deferred) != expected:
            wrong.append(f"{_where(q.topic, q.channel)}: rows {q.queued} queued, {q.in_flight} in flight, "
                         f"{q.deferred} deferred; /stats depth {expected[0]}, in_flight_count "
                         f"{expected[1]}, deferred_count {expected[2]}")
    return wrong


def _queues(n: int) -> str:
    return "1 queue" if n == 1 else f"{n} queues"


def _where(topic: str, channel: str | None) -> str:
    return topic if channel is None else f"{topic} / {channel}"


def _snapshot(args: argparse.Namespace) -> int:
    if args.broker is not None:
        return _snapshot_from_broker(args)
    if args.timeout is not None:
        args.usage_error("--timeout goes with --broker")
    running = data_path_in_use(args.data_path)
    if running and not args.lmdb_only:
        print(f"snapshot refused: a broker is running on {args.data_path} (it holds the data path's "
              "lock).\n"
              "  A copy of its files would miss the messages it holds in memory: its memory queues,\n"
              "  the messages in flight and the deferred ones. Ask the broker for its whole state\n"
              "  at its --http-address instead:\n"
              "    python -m spark_bridge snapshot --broker http://HOST:PORT\n"
              "  or copy the store's files anyway, without those: add --lmdb-only.", file=sys.stderr)
        return 1
    out = args.out
    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        out = os.path.join(args.data_path, "snapshots", stamp)
    broker_id = socket.gethostname() if args.broker_id is None else args.broker_id
    try:
        manifest = take_snapshot(args.data_path, out, broker_id=broker_id)
    except (SnapshotError, OSError) as e:
        print(f"snapshot failed: {e}", file=sys.stderr)
        return 1
    print(summary(manifest, out))
    if running:
        print("note: --lmdb-only on a running broker: the messages it holds in memory, in flight "
              "or deferred are not in this snapshot", file=sys.stderr)
    return 0


def data_path_in_use(path: str) -> bool:
    """Whether a running broker holds `path` (its data path, or the mqd.lmdb in it).

    A broker holds an exclusive flock on its data-path directory while it
    runs (nsqd's directory lock): a shared attempt that would block means
    one is there. The attempt is released at once, so a broker starting
    meanwhile is turned away only for that instant.
    """
    directory = os.path.abspath(path)
    if os.path.exists(os.path.join(directory, DATA_FILE)):  # the store's own directory
        directory = os.path.dirname(directory)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False  # nothing to lock: take_snapshot says what is wrong with the path
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a filesystem without flock: nothing to tell
    finally:
        os.close(fd)  # and with it the lock
    return False


class _RequestFailed(Exception):
    """The broker did not answer with a snapshot; the text says why, for one line."""


def _snapshot_from_broker(args: argparse.Namespace) -> int:
    if args.lmdb_only:
        args.usage_error("--lmdb-only goes with --data-path: a broker's snapshot holds its whole state")
    if args.broker_id is not None:
        args.usage_error("--broker-id goes with --data-path: a broker records its own id")
    timeout = BROKER_TIMEOUT if args.timeout is None else args.timeout
    if not 0 < timeout < 1e9:  # NaN and inf too: a socket takes neither
        args.usage_error("--timeout must be more than 0 seconds")
    if args.out is not None and any(sep and sep in args.out for sep in ("/", os.sep, os.altsep)):
        args.usage_error(f"--out {args.out!r}: with --broker it is a NAME under the broker's "
                         "<data-path>/snapshots/, not a path (no path separator)")
    base = _broker_url(args.broker)
    if base is None:
        args.usage_error(f"--broker {args.broker!r}: expected the broker's HTTP address, "
                         "http://HOST:PORT")
    url = f"{base}/snapshot"
    if args.out is not None:
        url += "?" + urllib.parse.urlencode({"out": args.out})
    from mqd.clusterinfo.bearer import SECRET_ENV, check_secret, env_secret

    try:
        secret = args.http_auth_secret or env_secret(SECRET_ENV)
        headers = {"Authorization": f"Bearer {check_secret(secret, '--http-auth-secret')}"} if secret else {}
    except ValueError as e:
        args.usage_error(str(e))
    try:
        path, manifest = _request_snapshot(url, timeout, headers)
    except _RequestFailed as e:
        print(f"snapshot failed: {url}: {e}", file=sys.stderr)
        return 1
    print(summary(manifest, path))
    wrong = stats_mismatches(manifest) if manifest.source == "broker" else []
    if wrong:
        print(f"snapshot {path}: BUG: the rows of {_queues(len(wrong))} differ from /stats (see above)",
              file=sys.stderr)
    return 0


def _broker_url(value: str) -> str | None:
    """The base URL of a broker's HTTP API (a bare HOST:PORT is taken as http://), or None."""
    text = value.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urllib.parse.urlsplit(text)
    try:
        parts.port  # noqa: B018 - raises on a port that is no number
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        return None
    return text.rstrip("/")


def _request_snapshot(url: str, timeout: float,
                      headers: dict[str, str] | None = None) -> tuple[str, Manifest]:
    """POST /snapshot and wait for the broker's answer: (the snapshot's path there, its manifest)."""
    request = urllib.request.Request(url, data=b"", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        with e:
            raise _RequestFailed(f"{e.code} {_error_text(e.read(), e.reason)}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, TimeoutError):
            raise _RequestFailed(f"cannot connect within {timeout:g} s (--timeout)") from None
        text = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
        raise _RequestFailed(f"cannot connect: {text}") from None
    except TimeoutError:
        raise _RequestFailed(f"no answer within {timeout:g} s (--timeout); the broker may still "
                             "finish the snapshot") from None
    except (OSError, http.client.HTTPException) as e:
        raise _RequestFailed(f"the connection failed: {e or type(e).__name__}") from None
    try:
        answer = json.loads(body)
        return answer["path"], Manifest.from_json(answer["manifest"])
    except (ValueError, KeyError, TypeError) as e:
        raise _RequestFailed(f"200 but no snapshot in the answer ({type(e).__name__}: {e})") from None


def _error_text(body: bytes, reason: str) -> str:
    """nsqd's error answer is {"message": TEXT}; anything else (a proxy's page) shows its reason phrase."""
    try:
        message = json.loads(body)["message"]
    except (ValueError, KeyError, TypeError):
        return reason
    return str(message)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spark_bridge", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    snap = sub.add_parser("snapshot", help="a consistent snapshot: a running broker's whole state, "
                                           "or a stopped broker's store")
    source = snap.add_mutually_exclusive_group(required=True)
    source.add_argument("--broker", metavar="URL",
                        help="a running broker's HTTP address (http://HOST:PORT, its --http-address): "
                             "it snapshots everything it holds (memory queues, in flight, deferred, "
                             "its store) under its <data-path>/snapshots/")
    source.add_argument("--data-path",
                        help="a stopped broker's --data-path (or its mqd.lmdb): copy its store's files")
    snap.add_argument("--out", help="with --data-path: the snapshot directory to create (default: "
                                    "DATA_PATH/snapshots/<UTC time>); with --broker: a NAME under the "
                                    "broker's <data-path>/snapshots/ (default: the UTC time)")
    snap.add_argument("--lmdb-only", action="store_true",
                      help="with --data-path on a running broker: copy its store's files anyway "
                           "(what it holds in memory, in flight or deferred is then missing)")
    snap.add_argument("--timeout", type=float, metavar="SECONDS",
                      help=f"with --broker: how long to wait for the answer (default: {BROKER_TIMEOUT:g})")
    snap.add_argument("--http-auth-secret", metavar="SECRET",
                      help="with --broker: the secret sent as Authorization: Bearer, for a broker "
                           "that asks who is calling (--auth-http-address); default: "
                           "$MQ_HTTP_AUTH_SECRET")
    snap.add_argument("--broker-id",
                      help="with --data-path: broker id recorded in the manifest (default: this host's name)")
    snap.set_defaults(run=_snapshot, usage_error=snap.error)


    an = sub.add_parser("analyze", help="backlog, ages, sizes, attempts and deferrals per queue of a snapshot, "
                                        "or a window of topics' retained logs, with PySpark")
    an.add_argument("snapshot", metavar="SNAPDIR", nargs="?",
                    help="a snapshot directory (or --topic: a window of retained logs)")
    an.add_argument("--master", help="Spark master URL (default: spark-submit's, else local[*])")
    an.add_argument("--report", metavar="FILE", help="also write an HTML report with charts here")
    an.add_argument("--json-field", metavar="NAME", help="group JSON bodies by this top-level field")
    an.add_argument("--poison-attempts", type=int, default=None, metavar="N",
                    help="messages tried more than N times are poison (default: 5, as nsq clients)")
    an.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting, as spark-submit's --conf (repeatable)")
    an.add_argument("--partitions", type=int, metavar="N",
                    help="Spark partitions to read with (default: the session's parallelism)")
    log = an.add_argument_group(
        "a window of topics' retained logs instead of a snapshot (brokers run with retention)")
    log.add_argument("--topic", action="append", metavar="TOPIC",
                     help="a topic whose retained log is analysed (repeatable)")
    log.add_argument("--nsqd-tcp-address", action="append", metavar="ADDR",
                     help="nsqd TCP address (repeatable)")
    log.add_argument("--lookupd-http-address", action="append", metavar="ADDR",
                     help="lookupd HTTP address (repeatable): every broker it lists with the topic")
    log.add_argument("--since", metavar="DURATION|RFC3339",
                     help="from the first record published at or after this time (6h: six hours ago; or "
                          "2006-01-02T15:04:05Z); default: the earliest record kept")
    log.add_argument("--until", metavar="DURATION|RFC3339",
                     help="up to the last record published before this time (default: the latest record)")
    log.add_argument("--start-offsets", metavar="earliest|JSON",
                     help='where each log starts, as offsets JSON: {"TOPIC": {"HOST:TCPPORT": OFFSET}} '
                          '(or {"offset": N, "epoch": E}; -2: earliest); default: earliest')
    log.add_argument("--end-offsets", metavar="latest|JSON",
                     help="where each log ends (exclusive), as --start-offsets (-1: latest); default: latest")
    log.add_argument("--consumer-opt", action="append", default=[], metavar="NAME=VALUE",
                     help="a client option for the brokers' IDENTIFY, as mq-tail's (tls_v1, "
                          "tls_root_ca_file, tls_cert, tls_key, auth_secret, ...; repeatable)")
    log.add_argument("--http-auth-secret", metavar="SECRET",
                     help="the secret for brokers and lookupds that ask who is calling (sent as AUTH and "
                          "as Authorization: Bearer) unless --consumer-opt gives auth_secret; default: "
                          "$MQ_HTTP_AUTH_SECRET")
    an.set_defaults(run=_analyze)

    sm = sub.add_parser("sample", help="write a sample broker backlog (to try the bridge on)")
    sm.add_argument("--data-path", required=True, help="data directory to create (must not exist)")
    sm.add_argument("--messages", type=int, default=100_000, metavar="N")
    sm.add_argument("--body-size", type=int, default=200, metavar="BYTES")
    sm.set_defaults(run=_sample)

    ja = sub.add_parser("jvm-archive", help="build the JVM class archive that halves Spark's start "
                                            "on local masters (~40 s, ~190 MB under ~/.cache/mqd)")
    ja.set_defaults(run=_jvm_archive)

    ex = sub.add_parser("export", help="write a snapshot's messages to Parquet (no Spark needed)")
    ex.add_argument("snapshot", metavar="SNAPDIR", help="a snapshot directory")
    ex.add_argument("--format", choices=["parquet"], default="parquet")
    ex.add_argument("--out", required=True, metavar="FILE", help="the Parquet file to write")
    ex.add_argument("--topic", action="append", help="only this topic (repeatable)")
    ex.add_argument("--channel", action="append", help="only this channel (repeatable)")
    ex.set_defaults(run=_export)
    return p


# The window flags of `analyze` (what goes with --topic, not with a snapshot).
_WINDOW_FLAGS = ("topic", "nsqd_tcp_address", "lookupd_http_address", "since", "until", "start_offsets",
                 "end_offsets", "consumer_opt", "http_auth_secret")
# The offset mode's option names, as the flags that set them are named (for its one-line errors).
_FLAG_OF_OPTION = {
    "startingOffsets": "--start-offsets", "endingOffsets": "--end-offsets", "startingTimestamp": "--since",
    "endingTimestamp": "--until", "topic": "--topic", "topics": "--topic", "nsqd": "--nsqd-tcp-address",
    "lookupd": "--lookupd-http-address", "minPartitions": "--partitions", "auth_secret": "--http-auth-secret",
}


class _BadWindow(Exception):
    """A window flag that cannot be used: one line (exit status 2)."""


def _flag_names(text: str) -> str:
    """An offset-mode error line with the flags' names for the options' (`option endingOffsets` -> --end-offsets)."""
    text = text.removeprefix("mqd: ")
    return re.sub(r"\boption (\w+)", lambda m: _FLAG_OF_OPTION.get(m.group(1), m.group(0)), text)


def _when(flag: str, text: str, now: float) -> int:
    """`--since` / `--until`: a duration back from `now` or an RFC 3339 time, in ms since the Unix epoch."""
    from mqd.moments import parse_since

    try:
        return parse_since(text).ms(now)
    except ValueError as e:
        raise _BadWindow(f"{flag} {text!r}: {e}") from None


def window_options(args: argparse.Namespace, now: float | None = None) -> dict[str, str]:
    """The offset mode's batch options (spark_bridge.log_options) `analyze`'s window flags ask for.

    Raises _BadWindow for flags that do not go together; the values
    themselves are checked by the options' own parser.
    """
    from mqd.client.config import Config, split_config_opt
    from mqd.client.errors import ClientConfigError
    from mqd.clusterinfo.bearer import SECRET_ENV, check_secret, env_secret

    now = time.time() if now is None else now
    topics = args.topic or []
    if not args.nsqd_tcp_address and not args.lookupd_http_address:
        raise _BadWindow("--nsqd-tcp-address or --lookupd-http-address required")
    if args.nsqd_tcp_address and args.lookupd_http_address:
        raise _BadWindow("use --nsqd-tcp-address or --lookupd-http-address not both")
    options = {"topics": ",".join(topics)} if len(topics) > 1 else {"topic": topics[0]}
    if args.nsqd_tcp_address:
        options["nsqd"] = ",".join(args.nsqd_tcp_address)
    else:
        options["lookupd"] = ",".join(args.lookupd_http_address)
    for flag, offsets in (("--since", "--start-offsets"), ("--until", "--end-offsets")):
        if getattr(args, flag[2:]) is not None and getattr(args, offsets[2:].replace("-", "_")) is not None:
            raise _BadWindow(f"use {flag} or {offsets} not both")
    since = None if args.since is None else _when("--since", args.since, now)
    until = None if args.until is None else _when("--until", args.until, now)
    if since is not None and until is not None and until < since:
        raise _BadWindow(f"--until {args.until!r} is before --since {args.since!r}")
    if since is not None:
        options["startingTimestamp"] = str(since)
    if until is not None:
        options["endingTimestamp"] = str(until)
    if args.start_offsets is not None:
        options["startingOffsets"] = args.start_offsets
    if args.end_offsets is not None:
        options["endingOffsets"] = args.end_offsets
    for opt in args.consumer_opt:
        name, value = split_config_opt(opt)
        try:
            Config().set(name, value)
        except (ClientConfigError, ValueError, TypeError) as e:
            raise _BadWindow(f"--consumer-opt {opt!r}: {e}") from None
        options[name.lower()] = value
    if "auth_secret" not in options:
        try:
            secret = check_secret(args.http_auth_secret if args.http_auth_secret is not None
                                  else env_secret(SECRET_ENV), "--http-auth-secret")
        except ValueError as e:
            raise _BadWindow(str(e)) from None
        if secret:
            options["auth_secret"] = secret
    if args.partitions is not None:
        options["minPartitions"] = str(args.partitions)
    return options


def _spark_failure(error: BaseException) -> str | None:
    """The `mqd: ...` line of a data source error Spark passed on (with its traceback), if there is one."""
    found = re.search(r"^[\w.]+: (mqd: .+)$", str(error), re.M)
    return None if found is None else _flag_names(found.group(1))


def _resolve(args: argparse.Namespace) -> tuple[int, Any]:
    """(0, the LogWindow) `analyze --topic` reads, or (exit status, None) with its one line said."""
    from spark_bridge.analysis import WindowError, WindowOptionError, resolve_window

    given = [f"--{name.replace('_', '-')}" for name in _WINDOW_FLAGS if getattr(args, name)]
    if args.snapshot is not None:
        if args.topic:
            return _failed("give a snapshot directory or --topic, not both"), None
        if given:
            return _failed(f"{given[0]} goes with --topic (a window of retained logs), not with a snapshot"), None
        return 0, None
    if not args.topic:
        return _failed("--topic required (or a snapshot directory)" if given else
                       "give a snapshot directory, or --topic with --nsqd-tcp-address or "
                       "--lookupd-http-address for a window of its retained log"), None
    if args.poison_attempts is not None:
        return _failed("--poison-attempts goes with a snapshot: records of the retained log carry no "
                       "attempts"), None
    try:
        options = window_options(args)
    except _BadWindow as e:
        return _failed(str(e)), None
    _status(f"resolving the window of {', '.join(args.topic)} on the brokers")
    try:
        return 0, resolve_window(options)
    except WindowError as e:
        return _failed(_flag_names(str(e)), status=2 if isinstance(e, WindowOptionError) else 1), None


def _failed(line: str, status: int = 2) -> int:
    print(f"analyze failed: {line}", file=sys.stderr)
    return status


def _analyze(args: argparse.Namespace) -> int:
    from mqd.nsqd.snapshot_format import read_manifest
    from spark_bridge.analysis import DEFAULT_POISON_ATTEMPTS, analyze, analyze_window
    from spark_bridge.jvm_archive import java_options
    from spark_bridge.report import load_charting, render_text, window_span, write_html
    from spark_bridge.session import build_session

    status, window = _resolve(args)
    if status:
        return status
    if window is None:
        try:
            read_manifest(args.snapshot)
        except (OSError, ValueError) as e:
            print(f"analyze failed: {args.snapshot}: not an mqd snapshot ({e})", file=sys.stderr)
            return 1
    else:
        _status(f"window: {window.records:,} records of {', '.join(window.topics)} on "
                f"{len(window.brokers())} broker(s), {window_span(window)}")
    # No web UI unless asked for (--conf spark.ui.enabled=true): a short
    # local run does not need one, and it costs start-up time.
    conf = {"spark.ui.enabled": "false"}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"analyze failed: --conf {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        conf[key] = value
    interactive = sys.stderr.isatty()
    launched_here = "PYSPARK_GATEWAY_PORT" not in os.environ  # else spark-submit started the JVM
    started = time.perf_counter()
    if args.report:
        # The driver only waits while the JVM starts: time to load matplotlib.
        threading.Thread(target=load_charting, name="load-charting", daemon=True).start()
    _status(f"starting Spark ({args.master or 'default master'})")
    spark = build_session(args.master, conf=conf, progress=interactive)
    _status(f"Spark ready in {time.perf_counter() - started:.1f} s (master {spark.sparkContext.master})")
    if (launched_here and spark.sparkContext.master.startswith("local")
            and not os.environ.get("MQD_NO_JVM_ARCHIVE") and java_options() is None):
        _status("hint: `python -m spark_bridge jvm-archive` (once, ~1 min) makes Spark start "
                "~3 s faster on this machine")

    def progress(step: int, steps: int, label: str, seconds: float | None) -> None:
        if seconds is None:
            _status(f"[{step}/{steps}] {label} ...")
        else:
            _status(f"[{step}/{steps}] {label}: {seconds:.1f} s")

    try:
        if window is not None:
            result = analyze_window(spark, window, json_field_name=args.json_field, partitions=args.partitions,
                                    progress=progress)
        else:
            poison = DEFAULT_POISON_ATTEMPTS if args.poison_attempts is None else args.poison_attempts
            result = analyze(spark, args.snapshot, poison_attempts=poison,
                             json_field_name=args.json_field, partitions=args.partitions,
                             progress=progress)
    except Exception as e:
        spark.stop()
        line = _spark_failure(e) if window is not None else None
        if line is None:
            raise
        return _failed(line, status=1)
    except BaseException:
        spark.stop()
        raise
    # Everything is collected: Spark shuts down (about a second) while the
    # report is drawn, which needs no Spark.
    stopping = threading.Thread(target=_shut_down, args=(spark,), name="spark-stop")
    stopping.start()
    try:
        print(render_text(result), end="")
        if args.report:
            _status("writing the HTML report ...")
            write_html(result, args.report)
            print(f"\nHTML report: {args.report}")
    finally:
        stopping.join()
    total = time.perf_counter() - started
    rate = result.total / total if total > 0 else 0
    print(f"analyzed {result.total:,} messages in {total:.1f} s ({rate:,.0f} msgs/s, "
          "Spark start included)")
    return 0


def _shut_down(spark) -> None:
    """Stop Spark, then let a JVM this process started exit now rather than when Python does.

    The JVM's own exit (its shutdown hooks, ~1 s) then also happens while
    the report is drawn, not after the command seems done: whoever reads
    our output through a pipe waits for every process holding it. The
    JVM pyspark launches exits when its stdin closes; under spark-submit
    there is no such child (the JVM started us) and nothing more to do.
    """
    from spark_bridge.session import launched_jvm

    launched = launched_jvm(spark)  # None under spark-submit
    spark.stop()
    if launched is not None and launched.stdin is not None:
        launched.stdin.close()
        try:
            launched.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass  # it goes when Python exits, as it would have anyway


def _status(line: str) -> None:
    """Progress on stderr: the tables on stdout stay clean for pipes."""
    print(line, file=sys.stderr, flush=True)


def _export(args: argparse.Namespace) -> int:
    from spark_bridge.export import export_parquet
    from spark_bridge.records import QueueFilter

    where = QueueFilter()
    if args.topic:
        where = where.narrowed("topic", args.topic)
    if args.channel:
        where = where.narrowed("channel", args.channel)
    try:
        result = export_parquet(args.snapshot, args.out, where)
    except (SnapshotError, OSError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 1
    rate = result.rows / result.seconds if result.seconds > 0 else 0
    print(f"exported {result.rows:,} messages to {result.path} ({result.bytes / 1e6:.1f} MB) "
          f"in {result.seconds:.2f} s ({rate:,.0f} msgs/s)")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from spark_bridge.sample import MAX_MESSAGES, write_sample

    if os.path.exists(args.data_path):
        print(f"sample failed: {args.data_path} already exists", file=sys.stderr)
        return 1
    if not 0 < args.messages <= MAX_MESSAGES:
        print(f"sample failed: --messages must be 1..{MAX_MESSAGES}", file=sys.stderr)
        return 2
    try:
        written = write_sample(args.data_path, args.messages, args.body_size)
    except ValueError as e:
        print(f"sample failed: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written['messages']:,} messages ({written['poison']:,} poison, "
          f"{written['deferred']:,} deferred) to {args.data_path}")
    return 0


def _jvm_archive(args: argparse.Namespace) -> int:
    from spark_bridge.jvm_archive import build_archive

    _status("building the JVM class archive (a sample analysis, then java -Xshare:dump) ...")
    started = time.perf_counter()
    try:
        path = build_archive()
    except (RuntimeError, OSError) as e:
        print(f"jvm-archive failed: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(path) / 1e6
    print(f"JVM class archive: {path} ({size:.0f} MB, {time.perf_counter() - started:.0f} s); "
          "local analyses use it from now on")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
