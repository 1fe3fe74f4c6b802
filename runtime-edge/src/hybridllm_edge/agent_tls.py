"""The device's TLS certificate (``hybridllm_common.device_tls``): kept in the agent's
state folder, asked of the fleet server when missing or a third of its life is left, and
checked before it is kept (for this device's own key, signed by the fleet key pinned at
enrollment, valid now). Its runtime serves HTTPS with it; the gateways verify it names
the device. Which runtime serves, and switching a plain-HTTP one to HTTPS, is
``agent.Agent``'s."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from hybridllm_common import device_tls, signing
from hybridllm_edge.agent_runtime import Tls

log = logging.getLogger("hybridllm_edge.agent")

TLS_CERT, TLS_KEY, TLS_CA = "tls.crt", "tls.key", "tls-ca.crt"
RETRY_S = 30.0  # after a failed request, the next one waits this long


def write_file(path: Path, text: str, private: bool = False) -> None:
    """Replace ``path`` whole (a rename: a reader sees the old file or the new one)."""
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    tmp.touch(mode=0o600 if private else 0o644)
    tmp.write_text(text)
    os.replace(tmp, path)


class Certificate:
    """The certificate files of one device, and their renewal."""

    def __init__(self, state: Path, key: Ed25519PrivateKey) -> None:
        self.key = key
        self.files = Tls(state / TLS_CERT, state / TLS_KEY, state / TLS_CA)
        self._retry_at = 0.0
        if not self.files.key.exists():  # the device key, in the form a TLS server loads
            write_file(self.files.key, device_tls.private_key_pem(key), private=True)

    @property
    def held(self) -> bool:
        return self.files.cert.exists() and self.files.ca.exists()

    async def renew(
        self, call: Callable[[str, str], Awaitable[httpx.Response]], identity: dict[str, Any]
    ) -> bool:
        """Ask for a certificate where none is held or the held one needs renewal; True
        when a new one was kept. ``call(method, path)`` is the agent's signed call."""
        if time.monotonic() < self._retry_at:
            return False
        try:
            have: str | None = self.files.cert.read_text()
        except OSError:
            have = None
        if not device_tls.needs_renewal(have, time.time()):
            return False
        self._retry_at = time.monotonic() + RETRY_S
        try:
            r = await call("POST", f"/v1/devices/{identity['device']}/certificate")
        except httpx.HTTPError as exc:
            log.info("no certificate yet: fleet server unreachable (%s)", type(exc).__name__)
            return False
        if r.status_code != 200:
            log.log(logging.INFO if r.status_code == 403 else logging.WARNING,
                    "no certificate yet (%s): %s", r.status_code, r.text[:200])  # fmt: skip
            return False
        try:
            body = r.json()
            cert, ca = str(body["certificate"]), str(body["ca"])
            fleet_key = signing.public_key_from_text(identity["fleetPublicKey"])
            device_tls.check_issued(cert, ca, self.key.public_key(), fleet_key, time.time())
        except (ValueError, KeyError, TypeError) as exc:  # SignatureError is a ValueError
            log.error("the fleet server's certificate is refused: %s", exc)
            return False
        write_file(self.files.ca, ca)
        write_file(self.files.cert, cert)  # last: a runtime reloads it, the CA beside it
        log.info("got a certificate for %s, valid %.0f days", body.get("serverName"),
                 (device_tls.validity(cert)[1] - time.time()) / 86400)  # fmt: skip
        return True
