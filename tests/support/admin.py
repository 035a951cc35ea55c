"""What mqadmin's end-to-end tests share: an mqadmin process, a small real cluster, a browser.

`AdminProcess` runs `twistd mqadmin` as `TwistdProcess` runs mqd and
mqlookupd (ephemeral loopback port, log to files, waits for /ping).
`Cluster` is one mqlookupd and two mqd registered with it, plus mqadmin
over the lookupd: the smallest cluster where nsqadmin's sums across
producers mean anything.
`chromium()` is headless Debian Chromium through Selenium, as the Spark
report's test drives it; `Page` reads the pages through their `data-test`
hooks (documented at the top of mqd/admin/static/app.js), one script call
per table so a check costs one round trip, not one per cell.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from tests.ensure_browser import BROWSER, DRIVER
from tests.support.processes import (
    LISTENING,
    NO_PROXY,
    REPO_ROOT,
    BrokerProcess,
    BrokerStartError,
    LookupdProcess,
    TwistdProcess,
    child_env,
    http_request,
    wait_for,
)

# Where the README's screenshots live; written only when MQD_SCREENSHOTS=1
# (the test run that refreshes them), otherwise into the test's tmp dir.
SCREENSHOT_DIR = REPO_ROOT / "docs" / "mqadmin"
SCREENSHOTS_ENV = "MQD_SCREENSHOTS"


class AdminProcess(TwistdProcess):
    """`twistd mqadmin` on an ephemeral loopback port; its only listener is HTTP.

    `base` is its --base-path ending in '/', so `url("api/topics")` is
    right with or without one.
    """

    program = "mqadmin"

    def __init__(self, workdir: Path, args: Sequence[str] = (), *, base_path: str = "/") -> None:
        self.base = "/" + base_path.strip("/") + "/" if base_path.strip("/") else "/"
        extra = [f"--base-path={base_path}"] if base_path != "/" else []
        super().__init__(workdir, ["--http-address=127.0.0.1:0", *extra, *args])

    def start(self, timeout: float = 15.0) -> AdminProcess:
        """Start and wait until `<base>ping` answers (TwistdProcess.start waits for a TCP listener too)."""
        assert not self.running, "mqadmin already running"
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=child_env(), cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while not self.http_port:
            found = {m.group(1): (m.group(2), int(m.group(3))) for m in LISTENING.finditer(self.log())}
            if "HTTP" in found:
                self.http_host, self.http_port = found["HTTP"]
            elif self.proc.poll() is not None:
                self.returncodes.append(self.proc.returncode)
                raise BrokerStartError(f"mqadmin exited with {self.proc.returncode} before listening\n"
                                       f"argv: {self.argv}\n{self.describe()}")
            elif time.monotonic() > deadline:
                self.kill()
                raise BrokerStartError(f"mqadmin did not listen within {timeout}s\n{self.describe()}")
            else:
                time.sleep(0.02)
        while True:
            try:
                with NO_PROXY.open(self.url("ping"), timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise BrokerStartError(f"mqadmin never answered {self.url('ping')}\n{self.describe()}")
            time.sleep(0.02)

    def url(self, path: str = "") -> str:
        return f"http://{self.http_address}{self.base}{path}"

    def request(self, method: str, path: str, body: Any = None,
                headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
        """(status, decoded JSON or text) of one API call; `body` is sent as JSON."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url(path), data=data, method=method, headers=dict(headers or {}))
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with NO_PROXY.open(req, timeout=15) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode("utf-8", "replace")

    def api(self, path: str) -> Any:
        """A GET that must answer 200: its JSON."""
        status, body = self.request("GET", path)
        assert status == 200, f"GET {path}: {status} {body}\n{self.describe()}"
        return body


class Cluster:
    """One mqlookupd, two mqd registered with it, mqadmin over the lookupd (charts every second).

    A broker's node name is nsqadmin's `broadcast_address:http_port`;
    every broker broadcasts 127.0.0.1 so the names are reachable addresses.
    """

    def __init__(self, workdir: Path, admin_args: Sequence[str] = (), broker_args: Sequence[str] = ()) -> None:
        self.workdir = Path(workdir)
        self.lookupd = LookupdProcess(self.workdir / "lookupd")
        self.brokers: list[BrokerProcess] = []
        self.admins: list[AdminProcess] = []
        self.admin_args = tuple(admin_args)
        self.broker_args = tuple(broker_args)  # more flags for both brokers (--retention-bytes, ...)

    def start(self) -> Cluster:
        self.lookupd.start()
        for i in (1, 2):
            broker = BrokerProcess(self.workdir / f"mqd{i}", [
                f"--lookupd-tcp-address={self.lookupd.tcp_address}", "--broadcast-address=127.0.0.1",
                "--queue-scan-interval=50ms", "--e2e-processing-latency-percentile=0.5,0.99", *self.broker_args,
            ])
            self.brokers.append(broker.start())
        wait_for(lambda: len(self.lookupd_get("/nodes")["producers"]) == 2, 10,
                 "both brokers to register with the lookupd")
        self.admin = self.start_admin()
        return self

    def start_admin(self, *args: str, base_path: str = "/", nsqds: Sequence[str] = ()) -> AdminProcess:
        """Another mqadmin: over the lookupd, or over the brokers `nsqds` (HTTP addresses) when given."""
        over = [f"--nsqd-http-address={a}" for a in nsqds] or [f"--lookupd-http-address={self.lookupd.http_address}"]
        admin = AdminProcess(self.workdir / f"mqadmin{len(self.admins) + 1}", [
            *over, "--stats-interval=1s",
            "--stats-history=2m", "--http-client-request-timeout=2s", "--http-client-connect-timeout=1s",
            *self.admin_args, *args,
        ], base_path=base_path)
        self.admins.append(admin)
        return admin.start()

    def stop(self) -> None:
        for process in [*self.admins, *self.brokers, self.lookupd]:
            if process.proc is not None and process.proc.poll() is None:
                try:
                    process.proc.send_signal(signal.SIGCONT)  # a broker a test froze
                except ProcessLookupError:
                    pass
            process.kill()

    # -- the brokers' and lookupd's own view, to check the pages against -------------------

    @staticmethod
    def node(broker: BrokerProcess) -> str:
        return f"127.0.0.1:{broker.http_port}"

    def lookupd_get(self, path: str) -> Any:
        status, body = self.lookupd.get(path)
        assert status == 200, (path, status, body)
        return body

    @staticmethod
    def stats(broker: BrokerProcess, topic: str | None = None) -> dict[str, Any]:
        path = "/stats?format=json" + (f"&topic={quote(topic)}" if topic else "")
        status, body = broker.get(path)
        assert status == 200, (path, status, body)
        return body

    def topic_stats(self, broker: BrokerProcess, topic: str) -> dict[str, Any] | None:
        topics = self.stats(broker, topic)["topics"] or ()  # nsqd's JSON: null when there are none
        return next((t for t in topics if t["topic_name"] == topic), None)

    def channel_stats(self, broker: BrokerProcess, topic: str, channel: str) -> dict[str, Any] | None:
        found = self.topic_stats(broker, topic)
        if found is None:
            return None
        return next((c for c in found["channels"] or () if c["channel_name"] == channel), None)

    def wait_registered(self, topic: str, brokers: Sequence[BrokerProcess], channels: Sequence[str] = ()) -> None:
        """Wait until the lookupd lists exactly `brokers` as the topic's producers, and has `channels`.

        A broker registers what it creates with the lookupd asynchronously:
        mqadmin finds producers there, so a test checks its pages only
        once the lookupd knows what the brokers have.
        """
        def registered():
            status, body = self.lookupd.get(f"/lookup?topic={quote(topic)}")
            if status != 200:
                return False
            ports = sorted(p["http_port"] for p in body["producers"])
            return ports == sorted(b.http_port for b in brokers) and set(channels) <= set(body["channels"])
        wait_for(registered, 10, f"the lookupd to list {topic}'s producers and channels")

    @staticmethod
    def publish(broker: BrokerProcess, topic: str, bodies: Sequence[bytes]) -> None:
        for body in bodies:
            status, answer = http_request(broker.http_address, "POST", f"/pub?topic={quote(topic)}", body)
            assert status == 200, (status, answer)

    @staticmethod
    def create_channel(broker: BrokerProcess, topic: str, channel: str) -> None:
        """The topic (if new) and the channel on that broker, through its own HTTP API."""
        for path in (f"/topic/create?topic={quote(topic)}",
                     f"/channel/create?topic={quote(topic)}&channel={quote(channel)}"):
            status, answer = http_request(broker.http_address, "POST", path, b"")
            assert status == 200, (path, status, answer)


NSQD_FIXTURE = REPO_ROOT / "tests" / "fixtures" / "nsqd_1.3.0_node.json"


class RecordedNsqd:
    """A real nsqd 1.3.0, as recorded: its /ping, /info, /stats and /config answers replayed over HTTP.

    What mqadmin sees of an nsqd, without NSQ's binaries: a topic `legacy`
    whose channel `idle` has three consumers (one snappy with a sample rate
    and a client_id of its own, one deflate, one TLS) and whose channel
    `unread` has no end-to-end samples; and no /config/durable or
    /config/backend (400 INVALID_OPTION), as nsqd has neither. /stats
    honours `topic`, `channel` and `include_clients=false` as nsqd does.
    """

    def __init__(self) -> None:
        answers = json.loads(NSQD_FIXTURE.read_text())
        self.stats = answers["/stats?format=json"]["body"]
        replies = {path.split("?")[0]: (a["status"], a["body"]) for path, a in answers.items() if path.startswith("/")}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path, _, query = self.path.partition("?")
                if path == "/stats":
                    status, body = 200, owner.stats_for(dict(p.split("=", 1) for p in query.split("&") if "=" in p))
                else:
                    status, body = replies.get(path, (404, {"message": "NOT_FOUND"}))
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # Named after where it listens now (broadcast_address:http_port), not where it was recorded.
        status, info = replies["/info"]
        replies["/info"] = (status, {**info, "http_port": self.server.server_address[1]})
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def stats_for(self, query: Mapping[str, str]) -> dict[str, Any]:
        doc = json.loads(json.dumps(self.stats))
        topics = [t for t in doc["topics"] if query.get("topic") in (None, "", t["topic_name"])]
        for t in topics:
            t["channels"] = [c for c in t["channels"] if query.get("channel") in (None, "", c["channel_name"])]
            if query.get("include_clients") == "false":
                for c in t["channels"]:
                    c["clients"] = []
        doc["topics"] = topics
        return doc

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class NotificationSink:
    """A tiny HTTP server on loopback that keeps every JSON body POSTed to it (--notification-http-endpoint)."""

    def __init__(self) -> None:
        events = self.events = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                events.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/events"

    def actions(self) -> list[tuple[str, ...]]:
        """(action, topic[, channel]) of every event so far, in order."""
        return [tuple(e[k] for k in ("action", "topic", "channel") if k in e) for e in self.events]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """Headless Debian Chromium (tests/ensure_browser.py installs it), as tests/spark/test_analysis.py's browser."""
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1000", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


# Every table row as {key: {field: number (data-value) or text}}, the row's own
# data-* attributes under "@name"; null when the table is not on the page.
_READ_TABLE = """
var root = arguments[1] ? document.querySelector('[data-test="' + arguments[1] + '"]') : document;
var table = root && root.querySelector('table[data-test="' + arguments[0] + '"]');
if (!table) return null;
var out = {};
table.querySelectorAll('tbody > tr[data-test^="row-"]').forEach(function (tr) {
  var row = {};
  for (var i = 0; i < tr.attributes.length; i++) {
    var a = tr.attributes[i];
    if (a.name.indexOf('data-') === 0 && a.name !== 'data-test') row['@' + a.name.slice(5)] = a.value;
  }
  tr.querySelectorAll('td[data-test]').forEach(function (td) {
    var v = td.getAttribute('data-value');
    row[td.getAttribute('data-test')] = v === null ? td.textContent.trim() : Number(v);
  });
  out[tr.getAttribute('data-test').slice(4)] = row;
});
return out;
"""


class Page:
    """The browser on one mqadmin: open a UI route, wait for it, read its tables, confirm actions."""

    def __init__(self, driver: webdriver.Chrome, admin: AdminProcess, shots: Path) -> None:
        self.driver = driver
        self.admin = admin
        self.shots = shots

    def open(self, route: str, page: str, timeout: float = 15.0) -> None:
        """Load `route` (relative to the base path) and wait for its main data (data-loaded)."""
        self.driver.get(self.admin.url(route))
        self.wait_loaded(page, timeout)

    def wait_loaded(self, page: str, timeout: float = 15.0) -> None:
        def loaded():
            main = self.driver.find_elements(By.CSS_SELECTOR, '[data-test="page"]')
            return (main and main[0].get_attribute("data-page") == page
                    and main[0].get_attribute("data-loaded") == "true")
        self.until(loaded, timeout, f"the {page} page to load")

    def refreshes(self) -> int:
        return int(self.attr('[data-test="page"]', "data-refreshes") or 0)

    def wait_refresh(self, timeout: float = 15.0) -> None:
        """Wait for the page's next completed refresh (its tables re-read the API)."""
        before = self.refreshes()
        self.until(lambda: self.refreshes() > before, timeout, "the page to refresh")

    def until(self, condition, timeout: float = 15.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = condition()
            except StaleElementReferenceException:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{self.debug()}")
            time.sleep(0.05)

    def debug(self) -> str:
        """What the page said when a wait failed: its warning/error lines and the browser console."""
        texts = {}
        for test in ("page-title", "warning", "error", "action-message"):
            for el in self.driver.find_elements(By.CSS_SELECTOR, f'[data-test="{test}"]'):
                texts[test] = el.text
        try:
            console = [e["message"] for e in self.driver.get_log("browser")][-10:]
        except WebDriverException:
            console = []
        return f"url: {self.driver.current_url}\npage: {texts}\nconsole: {console}"

    def table(self, test: str, within: str | None = None) -> dict[str, dict[str, Any]] | None:
        return self.driver.execute_script(_READ_TABLE, test, within)

    def find(self, test: str, within: Any = None):
        return (within or self.driver).find_element(By.CSS_SELECTOR, f'[data-test="{test}"]')

    def attr(self, selector: str, name: str) -> str | None:
        found = self.driver.find_elements(By.CSS_SELECTOR, selector)
        return found[0].get_attribute(name) if found else None

    def text(self, test: str) -> str:
        return self.find(test).text

    def click(self, test: str, within: Any = None) -> None:
        self.find(test, within).click()

    def confirm(self, opener, expect: str | None = None) -> dict[str, Any]:
        """Click `opener` (a data-test or an element), answer the dialog yes, and wait for the results.

        Returns {"state", "action", "message", "results": [{target, address, ok}]}.
        """
        self.close_results()
        if isinstance(opener, str):
            # Some buttons show only when they apply (Pause or Unpause): wait for the page to offer it.
            opener = self.until(lambda: (b := self.find(opener)).is_displayed() and b, 10, f"{opener} to show")
        opener.click()
        dialog = self.until(lambda: (d := self.find("confirm-dialog")).is_displayed() and d,
                            5, "the confirm dialog")
        if expect is not None:
            text = self.find("confirm-text", dialog).text
            assert expect in text, f"confirm text {text!r} lacks {expect!r}"
        self.click("confirm-yes", dialog)
        self.until(lambda: not self.find("confirm-dialog").is_displayed(), 5, "the dialog to close")
        return self.results()

    def results(self, timeout: float = 15.0) -> dict[str, Any]:
        def done():
            found = self.driver.find_elements(By.CSS_SELECTOR, '[data-test="action-results"]')
            if not found or not found[0].is_displayed():
                return None
            state = found[0].get_attribute("data-state")
            return found[0] if state and state != "pending" else None
        box = self.until(done, timeout, "the action's results")
        items = box.find_elements(By.CSS_SELECTOR, '[data-test="result"]')
        return {
            "state": box.get_attribute("data-state"),
            "action": box.get_attribute("data-action"),
            "message": self.find("action-message", box).text,
            "results": [{"target": li.get_attribute("data-target"), "address": li.get_attribute("data-address"),
                         "ok": li.get_attribute("data-ok") == "true", "text": li.text} for li in items],
        }

    def close_results(self) -> None:
        for button in self.driver.find_elements(By.CSS_SELECTOR, '[data-test="action-results-close"]'):
            if button.is_displayed():
                button.click()

    def screenshot(self, name: str) -> Path:
        """Save the window as `<name>.png`; into docs/mqadmin/ too when MQD_SCREENSHOTS=1."""
        self.shots.mkdir(parents=True, exist_ok=True)
        path = self.shots / f"{name}.png"
        # The whole page, not only the window: as tall as the document (within reason).
        width = self.driver.get_window_size()["width"]
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(width, max(700, min(int(height) + 120, 2400)))
        self.driver.execute_script("window.scrollTo(0, 0)")
        try:
            assert self.driver.save_screenshot(str(path)), f"no screenshot {path}"
        finally:
            self.driver.set_window_size(width, 1000)
        if os.environ.get(SCREENSHOTS_ENV) == "1":
            SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, SCREENSHOT_DIR / path.name)
        return path
