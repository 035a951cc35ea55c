"""mqadmin's pages (mqd/admin/static): what ships is complete, self-contained and what it says it is.

No browser here (the end-to-end tests drive the pages in headless
Chromium): the page must work behind --base-path, so every URL in
index.html is relative to the `<base href>` the server writes; it must
load nothing from elsewhere; app.js must parse; the test hooks the browser
tests rely on must be the ones documented at the top of app.js; and the
vendored uPlot must be the version and licence its README says, byte for
byte.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

STATIC = Path(__file__).resolve().parents[2] / "mqd" / "admin" / "static"
VENDOR = STATIC / "vendor"
UPLOT_VERSION = "1.6.32"
VENDORED = ("uPlot.iife.min.js", "uPlot.min.css", "LICENSE-uPlot")


def text(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def test_every_file_of_the_app_is_there():
    for name in ("index.html", "app.js", "style.css", "vendor/README.md", *(f"vendor/{v}" for v in VENDORED)):
        path = STATIC / name
        assert path.is_file(), name
        assert path.stat().st_size > 0, name


def test_index_takes_the_base_path_and_loads_everything_relative_to_it():
    page = text("index.html")
    assert page.count("{{BASE_PATH}}") == 1
    assert re.search(r'<base href="\{\{BASE_PATH\}\}">', page)
    # The <base> comes before anything that loads, so every URL resolves under --base-path.
    assert page.index("<base ") < min(page.index("<link "), page.index("<script "))
    urls = re.findall(r'(?:src|href)="([^"]*)"', page)
    loaded = [u for u in urls if u.startswith("static/")]
    assert sorted(loaded) == ["static/app.js", "static/style.css", "static/vendor/uPlot.iife.min.js",
                              "static/vendor/uPlot.min.css"]
    for url in urls:
        assert not url.startswith(("/", "http:", "https:", "//")), url
        if url.startswith("static/"):
            assert (STATIC / url.removeprefix("static/")).is_file(), url
    # uPlot is loaded before the app that uses it (both deferred: they run in document order).
    assert page.index("uPlot.iife.min.js") < page.index("static/app.js")


def test_nothing_is_fetched_from_elsewhere():
    for name in ("index.html", "app.js", "style.css"):
        body = text(name)
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)  # comments may name URLs
        assert not re.search(r"""["'(]\s*(?:https?:)?//""", body), name
        assert "@import" not in body, name


@pytest.mark.slow  # runs node, which only the default tox env sets up
def test_app_js_parses():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (Debian's nodejs); tests/ensure_node.py installs it")
    done = subprocess.run([node, "--check", str(STATIC / "app.js")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_app_js_calls_only_the_admin_api_relative_to_the_base():
    app = text("app.js")
    paths = set(re.findall(r"""['"](api/[a-z]+)""", app))
    assert paths == {"api/topics", "api/history", "api/nodes", "api/health", "api/counter", "api/lookup",
                     "api/peek", "api/snapshot", "api/replay"}
    # Every call goes through api(), which prefixes the base path.
    assert app.count("fetch(") == 1
    assert "fetch(BASE + path" in app


def test_every_test_hook_is_documented_at_the_top_of_app_js():
    app = text("app.js")
    header = app[:app.index("(function ()")]
    hooks = set(re.findall(r"""\btest: '([a-z0-9-]+)'""", app))
    hooks |= set(re.findall(r'data-test="([a-z0-9-]+)"', text("index.html")))
    hooks |= set(re.findall(r"""data-test="([a-z0-9-]+)"\]""", app))
    hooks |= {"action-" + a for a in re.findall(r"""actionButton\('([a-z]+)'""", app)}
    hooks |= {"chart-" + c for c in re.findall(r"""page\.chart\('([a-z]+)'""", app)}
    hooks |= set(re.findall(r"""new Table\('([a-z0-9-]+)'""", app))
    hooks = {h for h in hooks if not h.endswith("-")}  # prefixes of built names (row-, chart-, ...)
    assert {"topics-table", "confirm-dialog", "confirm-yes", "confirm-no", "action-results", "peek-table",
            "action-pause", "action-unpause", "action-empty", "action-delete", "action-tombstone",
            "action-snapshot", "action-create", "chart-cluster", "chart-topic", "chart-channel"} <= hooks
    missing = sorted(h for h in hooks if not re.search(r"(?<![a-z0-9-])" + re.escape(h) + r"(?![a-z0-9-])", header))
    assert missing == []


def test_every_ui_route_has_a_page():
    app = text("app.js")
    routes = re.findall(r"\[/\^(.*?)\$/, (\w+)\]", app)
    pages = {pattern: page for pattern, page in routes}
    assert pages == {
        "": "streamsPage",
        r"topics\/?": "streamsPage",
        r"topics\/([^/]+)\/?": "topicPage",
        r"topics\/([^/]+)\/([^/]+)\/?": "channelPage",
        r"nodes\/?": "nodesPage",
        r"nodes\/([^/]+)\/?": "nodePage",
        r"counter\/?": "counterPage",
        r"lookup\/?": "lookupPage",
    }
    for page in set(pages.values()):
        assert f"function {page}(" in app


def vendor_table() -> dict[str, tuple[str, str, str]]:
    """file -> (version, licence, sha256) from the rows of vendor/README.md's table."""
    rows = {}
    for line in (VENDOR / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in VENDORED:
            rows[cells[0]] = (cells[2], cells[3], cells[4])
    return rows


def test_vendor_readme_names_version_licence_source_and_the_right_sha256():
    readme = (VENDOR / "README.md").read_text(encoding="utf-8")
    assert f"Version: {UPLOT_VERSION}" in readme
    assert "Licence: MIT" in readme
    assert "https://github.com/leeoniya/uPlot" in readme
    rows = vendor_table()
    assert set(rows) == set(VENDORED)
    for name, (version, licence, sha256) in rows.items():
        assert version == UPLOT_VERSION, name
        assert licence.startswith("MIT"), name
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == sha256, name


def test_the_vendored_files_are_that_uplot_and_its_licence():
    assert (VENDOR / "uPlot.iife.min.js").read_text(encoding="utf-8").startswith(
        f"/*! https://github.com/leeoniya/uPlot (v{UPLOT_VERSION}) */")
    assert ".uplot" in (VENDOR / "uPlot.min.css").read_text(encoding="utf-8")
    licence = (VENDOR / "LICENSE-uPlot").read_text(encoding="utf-8")
    assert licence.startswith("The MIT License (MIT)")
    assert "Leon Sorokin" in licence
