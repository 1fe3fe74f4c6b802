"""Staged rollouts of a new model revision, one implementation for the operator and local
mode.

A change of ``spec.model.revision`` starts a rollout. The new revision's pools (the
*canary*) are created beside the stable ones; the gateway's routing table gives each
revision a weight; every ``spec.rollout.steps`` entry raises the canary's weight, holds it
for the step's pause while the analysis (:mod:`hybridllm_operator.llmservice.analysis`) compares the
canary with the stable revision over the same window, and moves on only when it passes.
When every step has passed, the stable pools take the new revision (the Deployments' own
rolling update, while the canary serves everything), traffic returns to them, and the
canary drains and goes. A failed step sends all traffic back to the stable revision at
once and drains the canary (``autoRollback``), or holds at the step (``autoRollback:
false``) until someone promotes or aborts it by hand.

Where each part lives:

- :mod:`~hybridllm_operator.llmservice.rollout.plan`: pure queries on the spec and the rollout state
  (steps, tiers, weights, windows, the forecast hold), and the ``Observation`` the
  machine takes;
- :mod:`~hybridllm_operator.llmservice.rollout.machine`: the pure state machine (:func:`advance`,
  the ``Controller`` that holds one service's state);
- :mod:`~hybridllm_operator.llmservice.rollout.observe`: what the rollout loop reads (the gateways'
  window and its analysis, the golden prompts, the devices' KPIs) to build an
  ``Observation`` (:func:`look`), and when it looks next.

``plan`` and ``machine`` do no I/O and import nothing that does. Every name is
re-exported here: ``from hybridllm_operator.llmservice import rollout`` and ``rollout.NAME``.
``observe``'s names are loaded on first use, so that importing the package (or its pure
modules) does not import the analysis and :mod:`hybridllm_operator.llmservice.demand`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hybridllm_operator.llmservice.rollout.machine import Controller, Readiness, advance
from hybridllm_operator.llmservice.rollout.plan import (
    ACTION_ANNOTATION,
    ACTIONS,
    CANARY_PHASES,
    CAPACITY_HOLD,
    EARLY_LOOK_FACTOR,
    ENDED,
    FORECAST_HOLD,
    STEPPING,
    Event,
    FleetView,
    Need,
    Observation,
    Phase,
    canary_forecast,
    canary_weight,
    devices_on_canary,
    devices_step,
    enabled_tiers,
    expected_duration_s,
    forecast_hold,
    has_canary,
    heading_step,
    is_scheduled,
    needs_analysis,
    needs_golden,
    shown_weight,
    sizing_seconds,
    sizing_weight,
    spec_wire,
    stable_spec,
    step_tiers,
    steps,
    summary,
    window_from,
    window_of,
)

if TYPE_CHECKING:
    from hybridllm_operator.llmservice.rollout.observe import (
        analyse,
        golden_verdict,
        look,
        routed,
        tick_seconds,
        with_devices,
    )

_OBSERVE = ("analyse", "golden_verdict", "look", "routed", "tick_seconds", "with_devices")

if not TYPE_CHECKING:  # mypy sees the names imported above, and flags any other

    def __getattr__(name: str) -> Any:
        """``observe``'s names, imported on first use (it imports the analysis, which
        reads Prometheus and the gateways)."""
        if name not in _OBSERVE:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.observe"), name)
        globals()[name] = value
        return value


__all__ = [
    "ACTIONS",
    "ACTION_ANNOTATION",
    "CANARY_PHASES",
    "CAPACITY_HOLD",
    "EARLY_LOOK_FACTOR",
    "ENDED",
    "FORECAST_HOLD",
    "STEPPING",
    "Controller",
    "Event",
    "FleetView",
    "Need",
    "Observation",
    "Phase",
    "Readiness",
    "advance",
    "analyse",
    "canary_forecast",
    "canary_weight",
    "devices_on_canary",
    "devices_step",
    "enabled_tiers",
    "expected_duration_s",
    "forecast_hold",
    "golden_verdict",
    "has_canary",
    "heading_step",
    "is_scheduled",
    "look",
    "needs_analysis",
    "needs_golden",
    "routed",
    "shown_weight",
    "sizing_seconds",
    "sizing_weight",
    "spec_wire",
    "stable_spec",
    "step_tiers",
    "steps",
    "summary",
    "tick_seconds",
    "window_from",
    "window_of",
    "with_devices",
]
