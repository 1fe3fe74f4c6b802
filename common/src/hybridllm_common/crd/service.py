"""The LLMService kind: its spec and its status."""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field, model_validator

from hybridllm_common.crd.base import _Model, _sub, cel
from hybridllm_common.crd.policies import AutoscalingSpec, GatewaySpec, RolloutSpec, SLOSpec
from hybridllm_common.crd.tiers import (
    CloudTierSpec,
    EdgeTierSpec,
    ModelSpec,
    RoutingPolicy,
    RoutingSpec,
)

BOTH_TIERS = (
    "needs both tiers (spec.edge.enabled and spec.cloud.enabled) and a policy that may use "
    "both (auto, edge-first or cloud-first)"
)
BALANCE_NEEDS = f"routing.balance.enabled {BOTH_TIERS}"
CASCADE_NEEDS = f"routing.cascade.enabled {BOTH_TIERS}"
_BOTH_TIERS_CEL = (
    "(self.edge.enabled && self.cloud.enabled"
    " && self.routing.policy in ['auto', 'edge-first', 'cloud-first'])"
)


class LLMServiceSpec(_Model):
    """An LLM served across an edge tier, a cloud tier and a gateway."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.edge.enabled || self.cloud.enabled",
                    "at least one of spec.edge.enabled and spec.cloud.enabled must be true",
                ),
                cel(
                    "self.routing.policy != 'edge-only' || self.edge.enabled",
                    "routing.policy edge-only needs spec.edge.enabled",
                    ".routing.policy",
                ),
                cel(
                    "self.routing.policy != 'cloud-only' || self.cloud.enabled",
                    "routing.policy cloud-only needs spec.cloud.enabled",
                    ".routing.policy",
                ),
                cel(
                    "!self.routing.balance.enabled || " + _BOTH_TIERS_CEL,
                    BALANCE_NEEDS,
                    ".routing.balance.enabled",
                ),
                cel(
                    "!self.routing.cascade.enabled || " + _BOTH_TIERS_CEL,
                    CASCADE_NEEDS,
                    ".routing.cascade.enabled",
                ),
            ]
        }
    )

    model: ModelSpec = Field(description="The model and where its weights come from.")
    edge: EdgeTierSpec = _sub(
        EdgeTierSpec, "Edge tier: small quantized models on CPUs, small GPUs and devices."
    )
    cloud: CloudTierSpec = _sub(
        CloudTierSpec, "Cloud tier: GPU pools, monolithic or disaggregated."
    )
    gateway: GatewaySpec = _sub(GatewaySpec, "Gateway: the OpenAI-compatible front door.")
    routing: RoutingSpec = _sub(RoutingSpec, "How requests are split between edge and cloud.")
    autoscaling: AutoscalingSpec = _sub(AutoscalingSpec, "How replica counts follow demand.")
    rollout: RolloutSpec = _sub(RolloutSpec, "How new model revisions are rolled out.")
    slo: SLOSpec = _sub(SLOSpec, "Service-level objectives.")

    @model_validator(mode="after")
    def _cross_field(self) -> LLMServiceSpec:
        if not (self.edge.enabled or self.cloud.enabled):
            raise ValueError(
                "at least one of spec.edge.enabled and spec.cloud.enabled must be true"
            )
        if self.routing.policy == RoutingPolicy.edge_only and not self.edge.enabled:
            raise ValueError("routing.policy edge-only needs spec.edge.enabled")
        if self.routing.policy == RoutingPolicy.cloud_only and not self.cloud.enabled:
            raise ValueError("routing.policy cloud-only needs spec.cloud.enabled")
        both = (
            self.edge.enabled
            and self.cloud.enabled
            and self.routing.policy
            in (RoutingPolicy.auto, RoutingPolicy.edge_first, RoutingPolicy.cloud_first)
        )
        if self.routing.balance.enabled and not both:
            raise ValueError(BALANCE_NEEDS)
        if self.routing.cascade.enabled and not both:
            raise ValueError(CASCADE_NEEDS)
        return self


class ConditionStatus(StrEnum):
    true = "True"
    false = "False"
    unknown = "Unknown"


class Condition(_Model):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str = Field(description="Ready, Progressing or Degraded.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason code.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="Generation the condition was computed for."
    )


class PoolStatus(_Model):
    """Replicas of one pool, read from its Deployment, and the autoscaler's last decision."""

    desired_replicas: int = Field(default=0, description="Replicas the operator asked for.")
    ready_replicas: int = Field(default=0, description="Replicas passing their readiness probe.")
    revision: str | None = Field(default=None, description="Model revision the pool runs.")
    recommended_replicas: int | None = Field(
        default=None, description="What the autoscaler's policy wanted (advisory: not applied)."
    )
    reactive_replicas: int | None = Field(
        default=None, description="The reactive (HPA) policy's part of the decision."
    )
    predictive_replicas: int | None = Field(
        default=None, description="The predictive policy's part of the decision."
    )
    predicted_p50: str | None = Field(
        default=None,
        description="Median forecast of the load over the lead time, in replicas at target.",
    )
    predicted_p90: str | None = Field(
        default=None,
        description="Upper (P90) forecast of the load over the lead time, in replicas at target.",
    )
    forecast_error: str | None = Field(
        default=None,
        description="Recent error of the one-bin-ahead forecast (WAPE, percent).",
    )
    capacity_bound: bool | None = Field(
        default=None, description="New pods cannot be scheduled: not scaled further up."
    )
    budget_bound: bool | None = Field(
        default=None,
        description="spec.autoscaling.gpuBudget cut this pool's scale-up: it runs fewer "
        "replicas than its policy wants.",
    )
    capacity: str | None = Field(
        default=None,
        max_length=1024,
        description="What one replica sustains as the autoscaler sizes the pool, and where "
        "that comes from: the spec, learned from the gateways' measurements (capacity left "
        "out), or the defaults until enough answers are measured.",
    )
    scaling_reason: str | None = Field(
        default=None, max_length=1024, description="Why the autoscaler decided what it did."
    )


class Endpoints(_Model):
    """In-cluster URLs of the service."""

    gateway: str | None = Field(default=None, description="OpenAI-compatible endpoint for clients.")
    edge: str | None = Field(default=None, description="Edge tier Service.")
    cloud: str | None = Field(
        default=None, description="Cloud tier Service (decode or monolithic)."
    )


class RolloutPhase(StrEnum):
    scheduled = "Scheduled"  # a new revision waits for its planned start (spec.rollout.window)
    progressing = "Progressing"  # a step is running
    paused = "Paused"  # held by hand (hybridllm rollout pause)
    inconclusive = "Inconclusive"  # the analysis cannot judge yet; the step holds
    failed = "Failed"  # a step failed and autoRollback is off: held at that step
    promoting = "Promoting"  # every step passed: the stable pools take the new revision
    finalizing = "Finalizing"  # traffic back on the stable pools; the canary drains
    aborting = "Aborting"  # traffic back on the stable revision; the canary drains
    aborted = "Aborted"  # the canary is gone; the stable revision serves
    completed = "Completed"  # the new revision is the stable one (or no rollout ran)


# What the analysis of a metric (or of a whole step) concludes: a MetricVerdict's result.
VERDICT_PASS, VERDICT_FAIL, VERDICT_INCONCLUSIVE, VERDICT_NA = "pass", "fail", "inconclusive", "n/a"


class MetricVerdict(_Model):
    """One analysed metric of a step: the canary's and the stable revision's values."""

    metric: str = Field(description="errorRate, ttftP95 or tbtP95.")
    tier: str | None = Field(default=None, description="The tier it was measured on.")
    canary: float | None = Field(default=None, description="The canary's value.")
    stable: float | None = Field(default=None, description="The stable revision's value.")
    p_value: float | None = Field(default=None, description="One-sided test of canary worse.")
    result: str = Field(description="pass, fail or inconclusive.")


class RolloutStatus(_Model):
    """The rollout of a new model revision, step by step. The operator keeps its whole
    state here, so a restarted operator resumes at the same step."""

    phase: RolloutPhase = Field(description="Where the rollout is.")
    stable_revision: str = Field(
        description="The revision that serves when the rollout ends or aborts."
    )
    canary_revision: str | None = Field(default=None, description="The revision being rolled out.")
    step: int = Field(default=0, ge=0, description="Index of the current step (0-based).")
    steps: int = Field(default=0, ge=0, description="Number of steps.")
    weight: int = Field(
        default=0, ge=0, le=100, description="Percent of traffic on the canary now."
    )
    weights: dict[str, int] = Field(
        default_factory=dict, description="The canary's percent of each tier's traffic now."
    )
    step_started_at: float | None = Field(
        default=None,
        description="Unix time the step's window began (the canary serving at its weight).",
    )
    message: str = Field(default="", max_length=2048, description="Why the rollout is where it is.")
    analysis: list[MetricVerdict] = Field(
        default_factory=list, max_length=12, description="The last analysis of the step."
    )
    stable_spec: str | None = Field(
        default=None,
        max_length=65_536,
        description="The spec the stable revision's pools run, as JSON (a rollout renders "
        "them from it while the new revision is the spec's).",
    )
    started_at: float | None = Field(default=None, description="Unix time the rollout started.")
    scheduled_at: float | None = Field(
        default=None,
        description="Unix time the new revision began to wait for its window (the longest "
        "wait, maxDelaySeconds, counts from then).",
    )
    planned_start: float | None = Field(
        default=None,
        description="Unix time a scheduled rollout is planned to start (spec.rollout.window).",
    )
    routing_generation: int = Field(
        default=0, ge=0,
        description="Bumped at every change of the weights; the gateways export the one "
        "they serve, so a step starts only once every gateway routes by it.",
    )  # fmt: skip
    handled_action: str | None = Field(
        default=None, description="The last hybridllm.io/rollout-action annotation acted on."
    )
    golden: str | None = Field(
        default=None, max_length=2048,
        description="The golden prompts' verdict on the canary (unset until they are asked).",
    )  # fmt: skip


class LLMServiceStatus(_Model):
    """What the operator observed."""

    observed_generation: int | None = Field(
        default=None, description="Spec generation last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16, description="Ready, Progressing, Degraded."
    )
    pools: dict[str, PoolStatus] = Field(
        default_factory=dict, description="Per pool (edge, monolithic, prefill, decode, gateway)."
    )
    edge_replicas: str | None = Field(
        default=None, description="Edge ready/desired, for kubectl get."
    )
    cloud_replicas: str | None = Field(
        default=None, description="Cloud ready/desired, for kubectl get."
    )
    current_revision: str | None = Field(
        default=None, description="Model revision serving traffic."
    )
    autoscaling: str | None = Field(
        default=None, description="The autoscaler's mode and last action, for kubectl get."
    )
    rollout: RolloutStatus | None = Field(
        default=None, description="The rollout of a new revision, while one runs or last ran."
    )
    rollout_summary: str | None = Field(
        default=None, description="Rollout phase, step and canary weight, for kubectl get."
    )
    endpoints: Endpoints | None = Field(default=None, description="In-cluster endpoints.")
