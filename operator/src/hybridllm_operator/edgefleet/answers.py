"""The fleet server's answers to devices: its error shape, its refusals (counted and
logged) and a device's identity."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from hybridllm_common import signing
from hybridllm_operator.edgefleet.records import Device, Fleet

if TYPE_CHECKING:
    from hybridllm_operator.edgefleet.server import FleetServer

log = logging.getLogger("hybridllm_operator.edgefleet.api")


def error(status: int, message: str, code: str, **headers: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status, headers=headers)


def refuse(
    server: FleetServer, reason: str, status: int, message: str, **headers: str
) -> web.Response:
    """A refused call: counted by reason, logged, answered with the reason as its code."""
    server.metrics.rejected.labels(reason=reason).inc()
    log.warning("refused (%s): %s", reason, message)
    return error(status, message, reason, **headers)


def identity(server: FleetServer, fleet: Fleet, device: Device) -> dict[str, Any]:
    """What a device learns of itself: its name, fleet, approval and the fleet's key."""
    out: dict[str, Any] = {
        "device": device.name,
        "namespace": server.namespace,
        "fleet": fleet.name,
        "approved": device.approved,
        "revoked": device.revoked,
    }
    if fleet.key is not None:
        out["fleetPublicKey"] = signing.public_key_text(fleet.key)
        out["keyId"] = signing.key_id(fleet.key)
    return out
