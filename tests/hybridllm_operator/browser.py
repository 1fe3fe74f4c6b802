"""Headless Debian Chromium for the page tests: the DOM after the page's scripts ran, the
console lines it logged, and screenshots."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp

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


class Tab:
    """One page in a headless Chromium driven over the DevTools protocol (a websocket):
    scripts evaluated, the mouse moved; every console message, uncaught exception and
    browser log entry kept in ``problems``."""

    def __init__(self, ws: Any) -> None:
        self.ws, self._id = ws, 0
        self.problems: list[str] = []
        self.seen: set[str] = set()
        self.requests: list[str] = []  # every URL the page asked for

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        ident = self._id
        await self.ws.send_json({"id": ident, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == ident:
                assert "error" not in msg, (method, msg["error"])
                return dict(msg.get("result") or {})
            self._event(msg)

    async def wait_event(self, method: str) -> None:
        while method not in self.seen:
            self._event(await self.ws.receive_json(timeout=60))

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params") or {}
        self.seen.add(str(method))
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled":
            self.problems.append(f"console.{params['type']}: {params.get('args')}")
        elif method == "Runtime.exceptionThrown":
            self.problems.append(f"exception: {params['exceptionDetails']}")
        elif method == "Log.entryAdded":
            self.problems.append(f"log: {params['entry']}")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)  # fmt: skip
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 60) -> Any:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            assert asyncio.get_running_loop().time() < deadline, f"never true: {expression}"
            await asyncio.sleep(0.2)

    async def move(self, x: float, y: float) -> None:
        await self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)


@contextlib.asynccontextmanager
async def tab(url: str, width: int = 1400, height: int = 1000) -> AsyncIterator[Tab]:
    """``url`` open in a fresh headless Chromium, its DevTools domains enabled."""
    # Chromium's helper processes may still write the profile as they go
    with tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            active = Path(profile) / "DevToolsActivePort"
            for _ in range(300):
                if active.exists() and len(active.read_text().splitlines()) >= 2:
                    break
                assert proc.poll() is None, "chromium exited before it listened"
                await asyncio.sleep(0.1)
            port = int(active.read_text().splitlines()[0])
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                    pages = [t for t in await r.json() if t["type"] == "page"]
                async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    t = Tab(ws)
                    for domain in ("Runtime", "Log", "Network", "Page"):
                        await t.call(f"{domain}.enable")
                    await t.call("Page.navigate", url=url)
                    await t.wait_event("Page.loadEventFired")
                    yield t
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # the browser and its helpers
            proc.wait(timeout=30)
