"""kopf wiring of EdgeDevices and EdgeFleets, for the LLMServices that serve from them.

The fleet server (server.py, a process of its own) owns the devices' records and the
fleets' status; the operator only watches them: which devices serve which revision at
which URL (``memo.devices``) and each fleet's status with its device CA
(``memo.fleets``). A change that matters to an LLMService (a device starts or stops
serving, moves to another revision, a new CA) wakes the LLMServices of its namespace, and
their reconcile reads `serving_devices` for the gateways' routing table. These stay maps
kept by hand, not kopf indexes: a handler compares the new entry with the old one to wake
the services only on a change that matters, which an index cannot tell its reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from hybridllm_common import crd, device_tls
from hybridllm_operator.llmservice import builders


@kopf.on.event(crd.GROUP, crd.VERSION, "edgedevices")
async def device_changed(
    type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **_: Any
) -> None:
    """An edge device became ready, moved to another revision or went offline: index it,
    and wake the namespace's LLMServices (those that name its fleet list it)."""
    namespace = str(meta.get("namespace"))
    status = body.get("status") or {}
    serving = status.get("healthy") and status.get("endpoint") and status.get("phase") in (
        crd.DevicePhase.Ready.value, crd.DevicePhase.Updating.value
    )  # fmt: skip
    key = (namespace, str(meta.get("name")))
    before = memo.devices.get(key)
    if type == "DELETED" or not serving or (body.get("spec") or {}).get("revoked"):
        memo.devices.pop(key, None)
    else:
        labels = dict(meta.get("labels") or {})
        fleet = (body.get("spec") or {}).get("fleet")
        memo.devices[key] = (fleet, labels, status["endpoint"], status.get("revision") or "")
    if memo.devices.get(key) != before:
        _wake_namespace(memo, namespace)


@kopf.on.event(crd.GROUP, crd.VERSION, "edgefleets")
async def fleet_changed(
    type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **_: Any
) -> None:
    """Keep each EdgeFleet's status: a rollout step that moves the devices waits for the
    fleet's rollout of the new revision (its rollout loop looks every few seconds); a new
    device CA wakes the namespace's LLMServices (their gateways verify devices with it)."""
    key = (str(meta.get("namespace")), str(meta.get("name")))
    ca_before = memo.fleets.get(key, {}).get("deviceCA")
    if type == "DELETED":
        memo.fleets.pop(key, None)
    else:
        memo.fleets[key] = dict(body.get("status") or {})
    if memo.fleets.get(key, {}).get("deviceCA") != ca_before:
        _wake_namespace(memo, key[0])


def _wake_namespace(memo: kopf.Memo, namespace: str) -> None:
    for (ns, _), state in list(memo.services.items()):
        if ns == namespace:
            state.waker.event.set()


def serving_devices(
    memo: kopf.Memo, namespace: str, spec: Mapping[str, Any]
) -> tuple[builders.ServingDevice, ...]:
    """The serving devices of an LLMService's spec.edge.devices, sorted. A device serving
    HTTPS is left out until its fleet's CA is known (the gateways could not verify it)."""
    selector = ((spec.get("edge") or {}).get("devices")) or {}
    fleet, want = selector.get("fleet"), selector.get("matchLabels") or {}
    if not fleet:
        return ()
    ca = str(memo.fleets.get((namespace, fleet), {}).get("deviceCA") or "")
    out = []
    for (ns, name), (f, labels, url, revision) in memo.devices.items():
        if ns != namespace or f != fleet or any(labels.get(k) != v for k, v in want.items()):
            continue
        if not url.startswith("https://"):
            out.append(builders.ServingDevice(url, revision))
        elif ca:
            out.append(builders.ServingDevice(
                url, revision, device_tls.server_name(name, fleet, namespace), ca))  # fmt: skip
    return tuple(sorted(out))
