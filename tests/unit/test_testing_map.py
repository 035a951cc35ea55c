"""docs/testing.md's map from each module to its tests stays complete and true.

Every module of mqd/, backends/ and spark_bridge/ is listed with the test
files that test it, so a newcomer finds a module's tests from its name. A
package whose `__init__.py` holds nothing but its docstring has no code of
its own and needs no row.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTING = ROOT / "docs" / "testing.md"
PACKAGES = ("mqd", "backends", "spark_bridge")
SECTION = "## Where a module's tests are"

ROW = re.compile(r"^\|\s*`(?P<module>[\w.]+)`\s*\|(?P<tests>.*)\|\s*$")
TEST_FILE = re.compile(r"`(tests/[^`]+)`")


def listed() -> dict[str, list[str]]:
    """The map's rows: module -> test files, from the section's tables."""
    text = TESTING.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/testing.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            assert match["module"] not in rows, f"{match['module']} is listed twice"
            rows[match["module"]] = TEST_FILE.findall(match["tests"])
    return rows


def has_code(path: Path) -> bool:
    """Whether a module holds more than a docstring (and `from __future__` imports)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
               and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
               for node in body)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            if path.name == "__init__.py" and not has_code(path):
                continue
            found[module_name(path)] = path
    return found


def test_files() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if "node_modules" not in p.parts)


def candidates(module: str) -> list[str]:
    """Test files that import `module`, then those named after it: a start for its row."""
    leaf = module.rsplit(".", 1)[-1].strip("_")
    dotted = re.compile(rf"\b{re.escape(module)}\b")
    files = test_files()
    importing = [p for p in files if dotted.search(p.read_text(encoding="utf-8"))]
    named = [p for p in files if leaf in p.stem.split("_")[1:] and p not in importing]
    return [str(p.relative_to(ROOT)) for p in importing + named][:6]


def test_every_module_is_in_the_map():
    rows = listed()
    missing = [m for m in modules() if m not in rows]
    lines = [f"| `{m}` | " + ", ".join(f"`{t}`" for t in candidates(m)) + " |" for m in missing]
    assert not missing, (
        f"docs/testing.md ({SECTION!r}) lists no tests for {', '.join(missing)}. "
        "Add a row for each (files that import it or are named after it, to check):\n"
        + "\n".join(lines))


def test_every_listed_module_exists():
    gone = sorted(set(listed()) - set(modules()))
    assert not gone, f"docs/testing.md lists modules that no longer exist (or hold no code): {gone}"


def test_every_listed_test_file_exists_and_is_a_test_module():
    bad = [f"{module}: {test}" for module, tests in listed().items() for test in tests
           if not (ROOT / test).is_file() or not Path(test).name.startswith("test_")]
    assert not bad, "docs/testing.md names test files that do not exist:\n" + "\n".join(bad)


def test_every_row_names_at_least_one_test_file():
    empty = [module for module, tests in listed().items() if not tests]
    assert not empty, f"docs/testing.md lists no test file for {empty}"
