"""Headless Debian Chromium for the page tests: the DOM after the page's scripts ran, the
console lines it logged, and screenshots."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

# The machine's network is closed: without these Chromium retries Google's hosts at start.
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
]  # fmt: skip
CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\]? (.*)")


@dataclass(frozen=True)
class Loaded:
    dom: str
    console: list[str]  # every console message and uncaught error, as Chromium logged it


def chromium() -> str:
    path = shutil.which("chromium")
    assert path, (
        "Debian chromium is not installed: hack/setup.sh installs it (apt-get install chromium)"
    )
    return path


def _run(url: str, *args: str, budget_ms: int, timeout_s: float) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        done = subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}",
             f"--virtual-time-budget={budget_ms}", *args, url],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def load(url: str, budget_ms: int = 10_000, timeout_s: float = 120) -> Loaded:
    """The page after its scripts ran for ``budget_ms`` of virtual time (Chromium waits
    for pending fetches before it lets virtual time pass)."""
    dom, log = _run(url, "--dump-dom", budget_ms=budget_ms, timeout_s=timeout_s)
    return Loaded(dom, [m.group(1) for line in log.splitlines() if (m := CONSOLE.search(line))])


def screenshot(url: str, path: Path, width: int = 1400, height: int = 2200,
               budget_ms: int = 10_000) -> Path:  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    _run(url, f"--screenshot={path}", f"--window-size={width},{height}",
         budget_ms=budget_ms, timeout_s=120)  # fmt: skip
    assert path.exists(), f"no screenshot at {path}"
    assert path.stat().st_size > 10_000, f"{path} is too small to show the page"
    return path


class _Panels(HTMLParser):
    """The panels of a dumped DOM: their data-* attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.panels: list[dict[str, str]] = []
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section" and "panel" in a.get("class", "").split():
            self.panels.append(a)
        if tag == "body":
            self.body = a


def panels_of(dom: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    parser = _Panels()
    parser.feed(dom)
    return parser.body, parser.panels
