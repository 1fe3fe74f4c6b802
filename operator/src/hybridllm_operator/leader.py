"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's semantics.

Two operator replicas (the chart runs two) must never reconcile at once: their server-side
applies would fight, and two autoscalers would each act on the same demand. A Deployment
elects nothing, and kopf's peering does not either: peers of equal priority both keep
running (kopf only warns), and a paused peer resumes on a timer, without fencing. So the
operator takes a Lease before it starts kopf, the way kube-controller-manager does
(k8s.io/client-go/tools/leaderelection):

- A candidate reads the Lease. It may take it when it is free (no holder, or a holder that
  released it) or when the holder has not renewed it for ``lease_duration``, measured on
  the candidate's own clock from when the candidate *observed* the last change of the
  record, never from the record's timestamps (clocks of two machines disagree).
- Every write is a replace with the ``resourceVersion`` that was read: of two candidates
  that both saw an expired Lease, the API server lets exactly one write win.
- The leader renews every ``retry_period``. If it has not renewed for ``renew_deadline``
  (shorter than ``lease_duration``), it stops reconciling: it gave up before anyone else
  can take over, so no two replicas act at once even when the leader is cut off from the
  API server rather than dead.
- A leader that stops cleanly releases the Lease (empty holder), so a rolling update hands
  over at once instead of after ``lease_duration``.

The elector is synchronous (the operator's API client is); ``run_renewals`` is meant for a
thread of its own. ``clock`` is injectable for tests of the timing rules.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def default_identity() -> str:
    """The pod's name (downward API ``POD_NAME``), else ``<host>_<random>``.

    A pod's name is unique while it exists, and a container restarted in the same pod
    takes its own Lease back at once (the process before it is gone). Outside a pod, two
    processes on one host must differ: hence the random part."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def default_namespace() -> str:
    """The pod's namespace (downward API, else its service account's), else ``default``."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


@dataclasses.dataclass(frozen=True)
class Timing:
    lease_duration: float = 15.0  # how long a silent holder keeps the Lease
    renew_deadline: float = 10.0  # a leader that could not renew this long steps down
    retry_period: float = 2.0  # how often candidates try and the leader renews

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retryPeriod < renewDeadline < leaseDuration, got "
                f"{self.retry_period} / {self.renew_deadline} / {self.lease_duration} s"
            )


def _now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One candidate for the Lease ``namespace/name``."""

    def __init__(
        self,
        api: Any,  # kubernetes.client.CoordinationV1Api
        namespace: str,
        name: str,
        identity: str,
        timing: Timing = Timing(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.timing, self.clock = timing, clock
        self._observed: tuple[Any, ...] | None = None  # the record as last seen
        self._observed_at = 0.0  # when it last changed, by our clock
        self.renewed_at: float | None = None  # our last successful acquire or renew
        self.transitions = 0

    @property
    def holder(self) -> str | None:
        """The holder as last read (None before the first read)."""
        return None if self._observed is None else self._observed[0]

    def _observe(self, spec: Any, now: float) -> None:
        """Remember the record, and when (by our clock) it last changed."""
        record = (
            spec.holder_identity,
            spec.lease_duration_seconds,
            spec.renew_time,
            spec.lease_transitions,
        )
        if record != self._observed:
            self._observed, self._observed_at = record, now

    # ------------------------------------------------------------------ one step

    def try_acquire_or_renew(self) -> bool:
        """One attempt (client-go's tryAcquireOrRenew): True when we hold the Lease after it."""
        from kubernetes.client.exceptions import ApiException

        now = self.clock()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("reading Lease %s/%s: %s", self.namespace, self.name, exc.reason)
                return False
            return self._create(now)
        spec = lease.spec
        self._observe(spec, now)
        holder = spec.holder_identity or ""
        if holder and holder != self.identity:
            duration = float(spec.lease_duration_seconds or self.timing.lease_duration)
            if self._observed_at + duration > now:
                return False  # held, and renewed within its duration as far as we have seen
        acquiring = holder != self.identity
        transitions = int(spec.lease_transitions or 0) + (1 if acquiring else 0)
        stamp = _now_micro()
        lease.spec.holder_identity = self.identity
        lease.spec.lease_duration_seconds = max(1, round(self.timing.lease_duration))
        lease.spec.renew_time = stamp
        lease.spec.lease_transitions = transitions
        if acquiring:
            lease.spec.acquire_time = stamp
        try:
            written = self.api.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as exc:
            # 409: someone else wrote first (another candidate, or the holder renewing)
            if exc.status != 409:
                log.warning("updating Lease %s/%s: %s", self.namespace, self.name, exc.reason)
            return False
        self._observe(written.spec, now)
        if acquiring:
            log.info(
                "acquired Lease %s/%s as %s (previous holder: %s)",
                self.namespace, self.name, self.identity, holder or "none",
            )  # fmt: skip
        self.renewed_at, self.transitions = now, transitions
        return True

    def _create(self, now: float) -> bool:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        stamp = _now_micro()
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=max(1, round(self.timing.lease_duration)),
                acquire_time=stamp,
                renew_time=stamp,
                lease_transitions=0,
            ),
        )
        try:
            created = self.api.create_namespaced_lease(self.namespace, body)
        except ApiException as exc:
            if exc.status != 409:  # 409: another candidate created it first
                log.warning("creating Lease %s/%s: %s", self.namespace, self.name, exc.reason)
            return False
        log.info("acquired Lease %s/%s as %s (new)", self.namespace, self.name, self.identity)
        self._observe(created.spec, now)
        self.renewed_at = now
        return True

    # ------------------------------------------------------------------ loops

    def acquire(self, stop: threading.Event) -> bool:
        """Block until we hold the Lease (True) or ``stop`` is set (False)."""
        logged = False
        while not stop.is_set():
            if self.try_acquire_or_renew():
                return True
            if not logged:
                log.info(
                    "standing by: Lease %s/%s is held by %s",
                    self.namespace, self.name, self.holder,
                )  # fmt: skip
                logged = True
            stop.wait(self.timing.retry_period)
        return False

    def run_renewals(self, stop: threading.Event, on_lost: Callable[[], None]) -> None:
        """Renew every ``retry_period`` until ``stop``; call ``on_lost`` once and return when
        no renewal succeeded for ``renew_deadline``."""
        while not stop.wait(self.timing.retry_period):
            if self.try_acquire_or_renew():
                continue
            if self.holder not in (None, "", self.identity):
                log.error(
                    "lost Lease %s/%s: %s holds it now; stepping down",
                    self.namespace, self.name, self.holder,
                )  # fmt: skip
                on_lost()
                return
            last = self.renewed_at if self.renewed_at is not None else float("-inf")
            if self.clock() - last >= self.timing.renew_deadline:
                log.error(
                    "lost Lease %s/%s: not renewed for %.1f s (renew deadline %.1f s); stepping "
                    "down",
                    self.namespace, self.name, self.clock() - last, self.timing.renew_deadline,
                )  # fmt: skip
                on_lost()
                return

    def release(self) -> None:
        """Give the Lease up if we hold it, so a standby takes over at once."""
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = _now_micro()
            self.api.replace_namespaced_lease(self.name, self.namespace, lease)
            log.info("released Lease %s/%s", self.namespace, self.name)
        except ApiException as exc:
            log.warning("releasing Lease %s/%s: %s", self.namespace, self.name, exc.reason)
