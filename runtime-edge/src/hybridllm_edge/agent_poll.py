"""The agent's long polls of the fleet server (its config, its site's routing table): one
call at a time with ``If-None-Match`` and ``?wait``, backing off while the server cannot be
reached and waiting out a refusal's ``Retry-After``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import httpx

log = logging.getLogger("hybridllm_edge.agent")

Call = Callable[..., Awaitable[httpx.Response]]
MAX_BACKOFF_S = 60.0


def reason(r: httpx.Response) -> str:
    """The message of the fleet server's error answer (or the start of its body)."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less when the agent stops."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


class LongPoll:
    """One long-polled document: ``ask`` returns the server's new document (a 200), or
    None when there is none to take now (nothing changed, the server unreachable or
    refusing: it has waited as long as it should before the next ask)."""

    def __init__(self, what: str, stopping: asyncio.Event) -> None:
        self.what, self.stopping = what, stopping
        self.delay = 1.0
        self.refusal = ""  # the server's last refusal, for the heartbeat's message

    async def ask(self, call: Call, path: str, have: str, wait_s: float) -> httpx.Response | None:
        try:
            r = await call("GET", f"{path}?wait={wait_s:.0f}",
                           headers={"If-None-Match": f'"{have}"'}, timeout=wait_s + 15)  # fmt: skip
        except httpx.HTTPError as exc:
            log.info("%s: fleet server unreachable (%s); serving on, asking again in %.0f s",
                     self.what, type(exc).__name__, self.delay)  # fmt: skip
            await pause(self.stopping, self.delay)
            self.delay = min(self.delay * 2, MAX_BACKOFF_S)
            return None
        self.delay = 1.0
        if r.status_code == 304:
            return None
        if r.status_code != 200:
            wait = float(r.headers.get("Retry-After", "10"))
            self.refusal = f"{self.what}: {r.status_code} {reason(r)}"
            log.warning("%s; asking again in %.0f s", self.refusal, wait)
            await pause(self.stopping, wait)
            return None
        self.refusal = ""
        return r
