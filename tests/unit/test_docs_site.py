"""The documentation: the MkDocs site builds under --strict, and the README stays an overview.

The build runs here so that CI catches a broken link or anchor, a page left
out of the navigation, and an option reference that no longer matches
`mqd.options` (the reference is generated from it at build time).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mqd.options import LOOKUPD_OPTIONS, MQADMIN_OPTIONS, MQD_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# The README's two commands, exactly: CI and new contributors copy them as they are.
RUN_BROKER = "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/twistd -n mqd -c config/mqd.yaml"
RUN_TESTS = 'python3 -m pip install "tox>=4" && python3 -m tox'


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def _reference(site: Path) -> str:
    return (site / "config-reference.html").read_text(encoding="utf-8")


def _row(html: str, flag: str) -> list[str]:
    """The cells of the reference table's row for `flag`, as HTML."""
    match = re.search(rf"<tr>\s*<td><code>{re.escape(flag)}</code></td>(.*?)</tr>", html, re.S)
    assert match, f"no row for {flag}"
    return re.findall(r"<td>(.*?)</td>", match.group(1), re.S)


def test_site_builds_strict_with_every_page(site):
    pages = sorted(p.relative_to(DOCS).with_suffix(".html") for p in DOCS.rglob("*.md"))
    assert pages, "no pages under docs/"
    for page in pages:
        assert (site / page).is_file(), f"{page} was not built"


@pytest.mark.parametrize("table", [MQD_OPTIONS, LOOKUPD_OPTIONS, MQADMIN_OPTIONS],
                         ids=["mqd", "mqlookupd", "mqadmin"])
def test_config_reference_lists_every_option(site, table):
    html = _reference(site)
    for opt in table:
        assert f"<code>--{opt.name}</code>" in html, f"--{opt.name} missing from the option reference"
    assert "<!-- options:" not in html


def test_config_reference_shows_config_names_and_defaults_as_written_in_a_flag(site):
    html = _reference(site)
    config_name, kind, default, _help = _row(html, "--mem-queue-size")
    assert (config_name, kind, default) == ("<code>mem_queue_size</code>", "integer", "<code>10000</code>")
    config_name, kind, default, _help = _row(html, "--msg-timeout")
    assert (kind, default) == ("duration", "<code>60s</code>")
    config_name, _kind, default, _help = _row(html, "--node-id")
    assert (config_name, default) == ("<code>id</code>", "computed")
    config_name, _kind, _default, _help = _row(html, "--lookupd-tcp-address")
    assert config_name == "<code>nsqlookupd_tcp_addresses</code>"
    _config_name, _kind, default, _help = _row(html, "--max-msg-size")
    assert default == "<code>1048576</code> (1 MiB)"


def test_readme_is_short_and_keeps_the_two_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; details belong in docs/"
    assert RUN_BROKER in lines
    assert RUN_TESTS in lines


def test_docs_cite_no_issue_numbers_spec_codes_or_outside_paths():
    texts = {p.relative_to(ROOT): p.read_text(encoding="utf-8")
             for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")]}
    forbidden = [
        (re.compile(r"(?<![\w&])#\d+\b"), "an issue number"),
        (re.compile(r"\bissues?\s+#?\d", re.I), "an issue number"),
        (re.compile(r"\bbehaviou?r [A-Z]\d"), "a spec code"),
        (re.compile(r"\bspec(ification)? section\b", re.I), "a spec section"),
        (re.compile(r"\.\./shared|/work/"), "a path outside the repository"),
        (re.compile(r"writeSequence per client"), "the stale output claim"),
    ]
    for path, text in texts.items():
        for pattern, what in forbidden:
            match = pattern.search(text)
            assert match is None, f"{path} cites {what}: {match.group(0)!r}"
