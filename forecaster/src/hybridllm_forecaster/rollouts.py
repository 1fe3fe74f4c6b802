"""What a canary rollout does to a pool's capacity: the canary's size (the operator's
rule), and a model of one rollout for the fluid simulator.

The operator sizes a canary pool with `canary_size` (`hybridllm_operator.llmservice.rollout`
imports it from here), and the simulator's `CanaryRollout` replays the same rollout on a
trace: the canary's replicas start, cold, beside the stable pool; a step's traffic moves
once they all run; the step's pause passes; after the last step (100%) the stable pool
restarts on the new revision all at once while the canary serves every request, and the
canary goes once the stable pool is back. Every replica runs in a cluster of ``room``
replicas (GPUs): a pod that does not fit waits, the stable pool's first (the scheduler
places pods in the order they are created; the autoscaler's scale-ups come first here,
which favours the peer rules, not ours).

Two sets of rules, side by side in ``bench/rollout/schedule.py``:

- **forecast-blind** (what Argo Rollouts or KServe do without knowing demand): the
  canary is the step's share of the stable pool's replicas now; traffic moves when it
  runs;
- **capacity-safe** (ours, `hybridllm_operator.llmservice.rollout`): the canary is the step's share
  of the forecast P90 over the step (`canary_size`: the surge, up before traffic moves),
  and no move of traffic happens while the pool is forecast past its maximum over its
  lead time and the step (`forecast_hold`).

Where a rollout starts (at once, or planned into a low-demand window,
`windows.plan_start`) is the third knob. The model's simplifications: analysis always
passes (a good revision), a step's traffic moves the moment its replicas run, and the
canary's replicas serve at the same per-replica capacity as the stable ones.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# The forecast need of the pool, in replicas at its target utilisation, over its lead
# time from ``now_s`` and ``beyond_s`` more (None: no forecast).
NeedFn = Callable[[float, float], float | None]

DEFAULT_STEPS: tuple[tuple[int, float], ...] = ((10, 300.0), (50, 300.0), (100, 0.0))


def canary_size(desired: int, forecast: float | None, max_replicas: int, weight: int) -> int:
    """A canary pool's replicas for ``weight`` percent of a pool's traffic: that share of
    what the pool needs, the larger of its replicas now (``desired``, the autoscaler's)
    and the forecast P90 over the step (``forecast``, in replicas at the target
    utilisation; up to ``max_replicas``), rounded up, at least one. The replicas beyond
    the share of ``desired`` are the surge that is up before the traffic moves."""
    need = desired
    if forecast is not None:
        need = max(need, min(math.ceil(forecast - 1e-9), max_replicas))
    return max(1, -(-need * weight // 100))


@dataclass
class CanaryRollout:
    """One rollout of a new revision through ``steps`` from ``start_s``, for
    `fluid.simulate_fluid`'s ``overlay``: it caps the stable pool to the room the canary
    leaves, and says how many replicas serve and how many are paid for at each step."""

    start_s: float
    cold_start_s: float
    room: int  # replicas the cluster can run at once (the pool's maxReplicas)
    need: NeedFn | None = None  # the forecast: capacity-safe rules; None: forecast-blind
    steps: Sequence[tuple[int, float]] = DEFAULT_STEPS
    # where it is: the step, "move" (waiting to move the traffic), "pause", "promote",
    # "done"
    step: int = 0
    phase: str = "move"
    weight: int = 0  # the canary's share of the traffic now
    until_s: float = 0.0  # the end of a pause, or of the promotion's restart
    canary_ready: int = 0
    canary_starting: deque[float] = field(default_factory=deque)  # ready-at times
    held_s: float = 0.0  # time a move waited for the forecast
    end_s: float | None = None  # when the canary went (the rollout's end)

    @property
    def canary(self) -> int:
        return self.canary_ready + len(self.canary_starting)

    @property
    def active(self) -> bool:
        return self.phase != "done"

    def cap(self, now_s: float, desired: int) -> int:
        """The stable pool's replicas: what the autoscaler wants, within the room the
        canary leaves (a pod that does not fit waits: not paid, not serving)."""
        if now_s < self.start_s or not self.active:
            return desired
        return min(desired, self.room - self.canary)

    def _want(self, now_s: float, stable: int) -> int:
        """The canary's size now: the step's share (100% once promoting)."""
        weight = self.steps[self.step][0] if self.phase in ("move", "pause") else 100
        if self.need is None:
            return max(1, -(-stable * weight // 100))
        pause = self.steps[self.step][1] if self.phase in ("move", "pause") else 0.0
        return canary_size(stable, self.need(now_s, pause), self.room, weight)

    def _held(self, now_s: float) -> bool:
        """The capacity-safe rules' hold: the pool forecast past its maximum over its lead
        time and the step the move goes to."""
        if self.need is None:
            return False
        got = self.need(now_s, self.steps[self.step][1])
        return got is not None and got > self.room

    def step_at(self, now_s: float, ready: int, provisioned: int, dt: float) -> tuple[int, int]:
        """Advance to ``now_s``; (replicas serving, replicas paid) with the stable pool at
        ``ready`` of ``provisioned``."""
        if now_s < self.start_s or not self.active:
            return ready, provisioned
        while self.canary_starting and self.canary_starting[0] <= now_s:
            self.canary_starting.popleft()
            self.canary_ready += 1
        if self.phase in ("move", "pause", "promote"):
            want = self._want(now_s, provisioned)
            fits = max(0, min(want, self.room - provisioned) - self.canary)
            for _ in range(fits):
                self.canary_starting.append(now_s + self.cold_start_s)
            while self.canary > want and self.canary_starting:
                self.canary_starting.pop()
            if self.canary > want:
                self.canary_ready = want
        if self.phase == "move":
            weight = self.steps[self.step][0]
            if self._held(now_s):
                self.held_s += dt
            elif self.canary_ready >= self._want(now_s, provisioned):
                self.weight, self.phase = weight, "pause"
                self.until_s = now_s + self.steps[self.step][1]
        elif self.phase == "pause" and now_s >= self.until_s:
            if self.step + 1 < len(self.steps):
                self.step, self.phase = self.step + 1, "move"
            elif not self._held(now_s):
                self.phase, self.until_s = "promote", now_s + self.cold_start_s
        elif self.phase == "promote" and now_s >= self.until_s:
            self.phase, self.end_s, self.weight = "done", now_s, 0
            self.canary_ready = 0
            self.canary_starting.clear()
            return ready, provisioned
        if self.phase == "promote":  # the stable pool restarts; the canary serves all
            return self.canary_ready, provisioned + self.canary
        return ready + self.canary_ready, provisioned + self.canary


@dataclass
class InPlaceRollout:
    """A Deployment's own rolling update of the pool to the new revision (Kubernetes'
    defaults, ``maxSurge: 25%``, ``maxUnavailable: 25%``: what an operator that edits the
    serving Deployment in place gets): in rounds, a quarter of the replicas stops and a
    quarter more starts beside them, so each round replaces half the pool and takes a
    quarter of its serving capacity away for a cold start. The peer the canary is
    measured against; the same `cap`/`step_at` interface as `CanaryRollout`."""

    start_s: float
    cold_start_s: float
    room: int
    max_surge: float = 0.25
    max_unavailable: float = 0.25
    replaced: int = 0  # replicas on the new revision so far
    until_s: float | None = None  # the end of the round under way
    round_out: int = 0  # replicas out of service in this round
    round_surge: int = 0  # replicas paid beside the pool in this round
    end_s: float | None = None
    held_s: float = 0.0  # the update never waits for demand (kept for the report)

    @property
    def active(self) -> bool:
        return self.end_s is None

    def cap(self, now_s: float, desired: int) -> int:
        if now_s < self.start_s or not self.active:
            return desired
        return min(desired, self.room - self.round_surge)

    def step_at(self, now_s: float, ready: int, provisioned: int, dt: float) -> tuple[int, int]:
        del dt
        if now_s < self.start_s or not self.active:
            return ready, provisioned
        if self.until_s is not None and now_s >= self.until_s:
            self.replaced += self.round_out + self.round_surge
            self.until_s, self.round_out, self.round_surge = None, 0, 0
        if self.until_s is None:
            left = provisioned - self.replaced
            if left <= 0:
                self.end_s = now_s
                return ready, provisioned
            surge = min(math.ceil(self.max_surge * provisioned), max(0, self.room - provisioned))
            out = max(0, math.floor(self.max_unavailable * provisioned))
            if surge + out == 0:
                out = 1  # a Deployment always makes progress: one replica at a time
            self.round_surge = min(surge, left)
            self.round_out = min(out, left - self.round_surge)
            self.until_s = now_s + self.cold_start_s
        return max(0, ready - self.round_out), provisioned + self.round_surge
