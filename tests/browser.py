"""Headless Chromium for the console test: Debian's `chromium`, installed when missing.

    path = ensure_chromium()     # /usr/bin/chromium; runs `apt-get install -y chromium` as root if needed

CI is root on a fresh Debian machine with access to Debian's archive; when chromium is already
installed this is one `shutil.which`. Not root and no chromium: an error saying what to install.
`make install` runs the same (python -m tests.browser).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

NAMES = ("chromium", "chromium-browser")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, NAMES) if p), None)


def ensure_chromium() -> str:
    path = find_chromium()
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("chromium is not installed (the align console test drives it): "
                           "`sudo apt-get install -y chromium`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    path = find_chromium()
    if not path:
        raise RuntimeError("apt-get installed chromium but no chromium executable is on PATH")
    return path


if __name__ == "__main__":
    print(ensure_chromium())
    sys.exit(0)
