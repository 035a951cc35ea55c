"""Make sure Debian's Chromium and ChromeDriver are installed, for the browser tests.

Run by tox before the suite (`commands_pre`): the HTML report is checked in
a real browser, and the project's own files must set up everything its
tests need. Installs the `chromium` and `chromium-driver` packages with
apt-get when they are missing (as root; Debian's ChromeDriver matches its
Chromium, and nothing is downloaded at test time). Exits non-zero with the
reason if that is not possible, so the suite fails rather than skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

BROWSER = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"


def present() -> bool:
    return os.access(BROWSER, os.X_OK) and os.access(DRIVER, os.X_OK)


def main() -> int:
    if present():
        return 0
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        print(f"ensure_browser: {BROWSER} and {DRIVER} are needed by the browser tests; "
              "install Debian's chromium and chromium-driver packages (as root: apt-get install "
              "chromium chromium-driver)", file=sys.stderr)
        return 1
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"],
                 ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium",
                  "chromium-driver"]):
        print("ensure_browser:", " ".join(argv), file=sys.stderr, flush=True)
        if subprocess.run(argv, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            print(f"ensure_browser: {' '.join(argv)} failed", file=sys.stderr)
            return 1
    return 0 if present() else 1


if __name__ == "__main__":
    sys.exit(main())
