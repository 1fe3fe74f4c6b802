"""The operator's guards around kopf's watches: it waits at start-up until the API
server's discovery lists every resource it serves, and a watchdog stops it (so that its
Deployment restarts it) when LLMServices exist that no reconciler serves, which is how a
watch that kopf resolved too early looks from inside.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import time
from typing import Any

import kopf
import urllib3
from kubernetes.client import exceptions as k8s_errors

from hybridllm_common import crd
from hybridllm_operator.llmservice import reconcile

Logger = logging.Logger | logging.LoggerAdapter[Any]


# What the operator watches, as discovery must list it: (group version path, resource).
SERVED = (
    ("/api/v1", "configmaps"),
    ("/api/v1", "services"),
    ("/api/v1", "pods"),
    ("/apis/apps/v1", "deployments"),
    ("/apis/policy/v1", "poddisruptionbudgets"),
    ("/apis/networking.k8s.io/v1", "networkpolicies"),
    (f"/apis/{crd.API_VERSION}", "llmservices"),
)


def missing_resources(cluster: reconcile.Cluster) -> list[str]:
    """The served resources the API server's discovery does not list (yet)."""
    missing = []
    for path, resource in SERVED:
        try:
            listing = cluster.dyn.request("GET", path, serialize=False)
            names = {r.get("name") for r in json.loads(listing.data).get("resources", [])}
        except (k8s_errors.ApiException, OSError, ValueError, urllib3.exceptions.HTTPError) as exc:
            missing.append(
                f"{path}/{resource} ({getattr(exc, 'status', None) or type(exc).__name__})"
            )
            continue
        if resource not in names:
            missing.append(f"{path}/{resource}")
    return missing


def wait_for_discovery(cluster: reconcile.Cluster, logger: Logger) -> None:
    delay, waited, said = 0.2, 0.0, 0.0
    while missing := missing_resources(cluster):
        if waited - said >= 10 or not said:
            logger.warning("waiting for the API server to serve %s", ", ".join(missing))
            said = waited or 1e-9
        time.sleep(delay)
        waited += delay
        delay = min(delay * 2, 5.0)


WATCHDOG_PERIOD_S = 15.0
WATCHDOG_GRACE_S = 30.0


# Only the objects' metadata, as the API server's metadata-only listing gives it: the
# watchdog reads names and times, and a full listing of every LLMService each period
# (parsed into the dynamic client's objects) was most of an idle operator's CPU.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def llmservice_metadata(cluster: reconcile.Cluster, namespace: str | None) -> list[dict[str, Any]]:
    """The metadata of every LLMService (in ``namespace``; None: all), from the API
    server's watch cache (``resourceVersion=0``: no read from etcd)."""
    where = f"/namespaces/{namespace}" if namespace else ""
    response = cluster.dyn.request(
        "GET",
        f"/apis/{crd.API_VERSION}{where}/llmservices",
        serialize=False,
        header_params={"Accept": f"{METADATA_LIST},application/json"},
        query_params=[("resourceVersion", "0")],
    )
    return [item["metadata"] for item in json.loads(response.data)["items"]]


def _unserved(
    cluster: reconcile.Cluster, namespaces: list[str | None], services: dict[Any, Any]
) -> list[str]:
    """LLMServices older than the grace period that no daemon of ours reconciles."""
    listed: list[dict[str, Any]] = []
    for ns in [*namespaces] or [None]:
        listed += llmservice_metadata(cluster, ns)
    now = datetime.datetime.now(datetime.UTC)
    out = []
    for meta in listed:
        created = datetime.datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
        if (
            not meta.get("deletionTimestamp")
            and (now - created).total_seconds() > WATCHDOG_GRACE_S
            and (meta["namespace"], meta["name"]) not in services
        ):
            out.append(f"{meta['namespace']}/{meta['name']}")
    return out


@dataclasses.dataclass
class Heard:
    """LLMService events the operator's handlers saw (shared by every copy of the memo)."""

    events: int = 0


@dataclasses.dataclass
class WatchdogCount:
    """The watchdog's verdict over its looks. A missing watch serves no LLMService and
    delivers no event; some served, or events still arriving, is kopf working through a
    burst (a thousand LLMServices applied at once start their daemons over minutes on a
    busy operator), not a missing watch."""

    events: int = 0  # LLMService events heard by the last look
    misses: int = 0

    def look(self, unserved: list[str], events: int, serving: bool) -> bool:
        """Whether to stop: the second look in a row that finds LLMServices no daemon
        serves, while none is served and no LLMService event arrived since the last."""
        progressing = events != self.events
        self.events = events
        self.misses = self.misses + 1 if unserved and not progressing and not serving else 0
        return self.misses >= 2


async def watchdog(memo: kopf.Memo, logger: Logger) -> None:
    """Stop the operator when LLMServices exist that no daemon serves, while it serves
    none and hears of none, twice in a row: kopf resolved its resources while the API
    server was not serving them all, and it never resolves them again. A restart (the
    Deployment's) does. Embedded without a stop flag (kopf's test runner), it only logs.
    It lists LLMServices only while it serves none."""
    loop = asyncio.get_running_loop()
    namespaces: list[str | None] = list(memo.get("namespaces") or [])
    count = WatchdogCount(events=memo.heard.events)
    while True:
        await asyncio.sleep(WATCHDOG_PERIOD_S)
        serving = any(not namespaces or ns in namespaces for ns, _ in list(memo.services))
        unserved: list[str] = []
        # Serving any LLMService proves the watch: no listing then (at a thousand services
        # the listing of their metadata every period was most of an idle operator's work).
        if not serving:
            try:
                unserved = await loop.run_in_executor(
                    memo.executor, _unserved, memo.cluster, namespaces, memo.services
                )
            except (k8s_errors.ApiException, OSError, urllib3.exceptions.HTTPError) as exc:
                logger.info("watchdog could not list LLMServices: %s", exc)
                continue
        if count.look(unserved, memo.heard.events, serving):
            logger.error(
                "LLMServices %s have no reconciler: the operator is not watching them (the "
                "API server did not list the resource when it started); exiting so that it "
                "restarts and watches again",
                ", ".join(unserved[:5]),
            )
            stop = memo.get("stop")
            if stop is not None:  # `hybridllm operator run`: stop kopf, exit non-zero
                memo.stopped_by_watchdog = True
                stop.set()
                return
            count.misses = 0  # embedded (no stop flag): say it again at the next misses
