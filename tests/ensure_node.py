"""Make sure Node.js, npm and the pinned Node NSQ clients are installed, for the Node tests.

Run by tox before the suite (`commands_pre`), and by the Node tests
themselves when run without tox: tests/integration/test_clients_node.py
drives real Node clients (nsqjs, squeaky) against the broker, and the
project's own files must set up everything its tests need. Installs
Debian's `nodejs` and `npm` with apt-get when `node` is missing (as root),
then `npm ci` in tests/integration/node from the committed package-lock.json
(exact versions and integrity hashes), unless node_modules already holds
that very lockfile's install. Exits non-zero with the reason if that is
not possible, so the suite fails rather than skips.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

NODE_DIR = Path(__file__).resolve().parent / "integration" / "node"
LOCKFILE = NODE_DIR / "package-lock.json"
# Written after a successful `npm ci` (which empties node_modules first), so
# a changed lockfile or an interrupted install means installing again.
STAMP = NODE_DIR / "node_modules" / ".mqd-lockfile-sha256"


def _say(*words: str) -> None:
    print("ensure_node:", *words, file=sys.stderr, flush=True)


def lockfile_digest() -> str:
    return hashlib.sha256(LOCKFILE.read_bytes()).hexdigest()


def installed() -> bool:
    """node_modules is the install of the committed lockfile."""
    try:
        return STAMP.read_text().strip() == lockfile_digest()
    except FileNotFoundError:
        return False


def _ensure_node_and_npm() -> str | None:
    """None when node and npm are on PATH (installing Debian's packages if need be), else why not."""
    if shutil.which("node") and shutil.which("npm"):
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return ("node and npm are needed by the Node client tests; install Debian's nodejs "
                "and npm packages (as root: apt-get install nodejs npm)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"],
                 ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nodejs", "npm"]):
        _say(" ".join(argv))
        if subprocess.run(argv, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            return f"{' '.join(argv)} failed"
    if shutil.which("node") and shutil.which("npm"):
        return None
    return "node or npm still missing after installing Debian's nodejs and npm"


def ensure() -> str | None:
    """Install what is missing; None when everything is in place, else the reason it is not."""
    problem = _ensure_node_and_npm()
    if problem is not None:
        return problem
    if installed():
        return None
    argv = ["npm", "ci", "--no-audit", "--no-fund"]
    _say(" ".join(argv), "in", str(NODE_DIR))
    done = subprocess.run(argv, cwd=NODE_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if done.returncode != 0:
        return f"npm ci failed in {NODE_DIR}:\n{done.stderr[-2000:]}"
    STAMP.write_text(lockfile_digest() + "\n")
    return None


def main() -> int:
    problem = ensure()
    if problem is not None:
        _say(problem)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
