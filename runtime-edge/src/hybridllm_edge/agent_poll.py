"""What the agent takes from the fleet server (its config, its site's routing table): the
long polls (one call at a time with ``If-None-Match`` and ``?wait``, backing off while the
server cannot be reached and waiting out a refusal's ``Retry-After``) and the checks every
signed document passes before it is used."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from hybridllm_common import signing

log = logging.getLogger("hybridllm_edge.agent")

Call = Callable[..., Awaitable[httpx.Response]]
MAX_BACKOFF_S = 60.0
CLOCK_SKEW_S = 300.0


class Rejected(ValueError):
    """A document the agent refuses; the message says why."""


def open_document(
    envelope: Any, fleet_key: Any, kind: str, what: str, identity: dict[str, Any], now: float,
    check_expiry: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The payload of a signed document of ``kind`` for this device, or Rejected naming
    what is wrong: a signature not by the pinned fleet key, another kind, device, fleet or
    namespace, no version or expiry, expired (unless ``check_expiry`` is off: a last good
    one from disk), or issued in the future."""
    try:
        payload: dict[str, Any] = signing.open_document(envelope, fleet_key)
    except signing.SignatureError as exc:
        raise Rejected(f"tampered or foreign: {exc}") from None
    if payload.get("kind") != kind:
        raise Rejected(f"not a {what} (kind {payload.get('kind')!r})")
    for key in ("namespace", "fleet", "device"):
        if payload.get(key) != identity.get(key):
            raise Rejected(f"for {key} {payload.get(key)!r}, this device is {identity.get(key)!r}")
    version, expires = payload.get("version"), payload.get("expiresAt")
    if not isinstance(version, int | str) or not isinstance(expires, int | float):
        raise Rejected("version or expiresAt missing")
    if check_expiry and expires < now:
        raise Rejected(f"expired {now - expires:.0f} s ago (version {version})")
    if float(payload.get("issuedAt", 0)) > now + CLOCK_SKEW_S:
        raise Rejected("issued in the future: check the device's clock")
    return payload


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
