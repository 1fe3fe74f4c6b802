"""Scaling, rollouts, the SLO and the gateway of an LLMService."""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import ConfigDict, Field, model_validator

from hybridllm_common.crd.base import _Model, _sub, cel
from hybridllm_common.crd.tiers import Resources


class AutoscalingMode(StrEnum):
    off = "off"
    reactive = "reactive"
    predictive = "predictive"
    hybrid = "hybrid"
    advisory = "advisory"
    external = "external"


class AutoscalingSpec(_Model):
    """How replica counts follow demand."""

    mode: AutoscalingMode = Field(
        default=AutoscalingMode.hybrid,
        description=(
            "hybrid (the larger of predictive and reactive), reactive (the HPA's rules on "
            "measured load), predictive (forecast), advisory (decide and report, change "
            "nothing), external (an HPA or KEDA owns replicas) or off (spec replicas)."
        ),
    )
    interval_seconds: int = Field(
        default=15, ge=5, le=600, description="How often each pool is sized."
    )
    target_utilization: float = Field(
        default=0.7, ge=0.05, le=1.0, description="Target share of each replica's capacity in use."
    )
    scale_up_lead_seconds: int = Field(
        default=180,
        ge=0,
        le=7200,
        description="Time a new replica needs to become ready (the forecast looks this far "
        "ahead, plus one interval).",
    )
    scale_down_delay_seconds: int = Field(
        default=300,
        ge=0,
        le=86_400,
        description="The reactive policy's stabilisation window before removing replicas.",
    )
    gpu_budget: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="The most GPUs the autoscaled pools hold at once (each pool's replicas "
        "times its resources.gpu, summed). A scale-up that would pass it is cut to what "
        "fits, the GPUs going first to the pool furthest below what it wants; unset: no "
        "budget. A rollout's canary replicas are outside it (maxReplicas and the cluster's "
        "room bound them).",
    )


class RolloutStrategy(StrEnum):
    canary = "canary"
    blue_green = "blueGreen"
    rolling = "rolling"


class RolloutTier(StrEnum):
    """A tier a rollout step moves: edge or cloud."""

    edge = "edge"
    cloud = "cloud"


class RolloutStep(_Model):
    """One stage of a canary rollout."""

    weight: int = Field(ge=1, le=100, description="Percent of traffic sent to the new revision.")
    tiers: list[RolloutTier] | None = Field(
        default=None,
        min_length=1,
        max_length=2,
        description="Tiers this step moves (default: every enabled tier). A step with "
        "[edge] sends its weight of the edge tier's traffic to the new revision and leaves "
        "the cloud tier where it was: the edge as a stage of its own. The last step moves "
        "every tier.",
    )
    devices: bool = Field(
        default=False,
        description="This step also moves the service's edge devices (spec.edge.devices): "
        "the EdgeFleet rolls them to the new revision in its waves once the rollout reaches "
        "this step, and the step's analysis starts only when the fleet has passed them "
        "all (a failed fleet rollout fails the step). The step must move the edge tier. "
        "When no step sets it, devices follow the new revision from the first step.",
    )
    pause_seconds: int = Field(
        default=300, ge=0, le=86_400, description="How long to hold and analyse this stage."
    )


class GoldenPrompt(_Model):
    """A question every new revision must still answer right before it gets traffic."""

    prompt: str = Field(
        min_length=1, max_length=4096,
        description="The user message, sent to each of the new revision's replicas at "
        "temperature 0.",
    )  # fmt: skip
    expect: str = Field(
        min_length=1, max_length=512,
        description="A regular expression (Python syntax, any case) the answer must contain.",
    )  # fmt: skip
    max_tokens: int = Field(default=32, ge=1, le=1024, description="Tokens the answer may have.")

    @model_validator(mode="after")
    def _expect_compiles(self) -> GoldenPrompt:
        try:
            re.compile(self.expect)
        except re.error as exc:
            raise ValueError(f"expect: not a regular expression: {exc}") from None
        return self


class RolloutAnalysis(_Model):
    """How each stage is judged: the canary against the stable revision over the same
    window, from the gateway's per-revision metrics."""

    interval_seconds: int = Field(
        default=30, ge=5, le=3600, description="How often a stage is analysed while it runs."
    )
    min_requests: int = Field(
        default=50,
        ge=1,
        le=10_000_000,
        description="Requests each revision must have answered in the window before a stage "
        "is judged; fewer holds the stage (inconclusive).",
    )
    max_error_rate: float = Field(
        default=0.02, ge=0, le=1,
        description="A canary failing more than this share of its attempts, significantly "
        "more than the stable revision, fails the stage.",
    )  # fmt: skip
    max_ttft_p95_seconds: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="A canary p95 time to first token above this, while the stable "
        "revision's is below it, fails the stage.",
    )
    max_tbt_p95_seconds: float = Field(
        default=0.2,
        gt=0,
        le=60,
        description="A canary p95 time between tokens above this, while the stable "
        "revision's is below it, fails the stage.",
    )
    max_latency_increase: float = Field(
        default=0.2,
        ge=0,
        le=100,
        description="A canary p95 (TTFT or time between tokens) more than this fraction "
        "above the stable revision's fails the stage (0.2: 20% slower).",
    )
    significance: float = Field(
        default=0.01,
        gt=0,
        le=0.5,
        description="A difference fails a stage only when a one-sided test (Mann-Whitney U "
        "on the latency histograms, Fisher's exact test on errors) gives a p-value "
        "below this.",
    )
    golden_prompts: list[GoldenPrompt] = Field(
        default_factory=list,
        max_length=8,
        description="Questions the new revision must answer right (asked by every gateway "
        "of each of its replicas) before any traffic moves to it; one wrong answer fails "
        "the rollout's first stage.",
    )


def _default_steps() -> list[RolloutStep]:
    return [
        RolloutStep(weight=10),
        RolloutStep(weight=50),
        RolloutStep(weight=100, pause_seconds=0),
    ]


WINDOW_RANGE = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])-([01][0-9]|2[0-4]):([0-5][0-9])$")


def window_range_seconds(text: str) -> tuple[int, int]:
    """'HH:MM-HH:MM' as seconds since midnight (UTC): (start, end)."""
    m = WINDOW_RANGE.match(text)
    if m is None:
        raise ValueError(f"window range {text!r} is not HH:MM-HH:MM")
    a = int(m.group(1)) * 3600 + int(m.group(2)) * 60
    b = int(m.group(3)) * 3600 + int(m.group(4)) * 60
    if b > 86_400 or a == b:
        raise ValueError(f"window range {text!r} is empty or past 24:00")
    return a, b


class RolloutWindow(_Model):
    """When a rollout of a new revision may start. The operator plans the start from the
    demand forecast and the schedule, shows it in status.rollout.plannedStart, and starts
    then (or at once with `hybridllm rollout start`)."""

    schedule: list[str] = Field(
        default_factory=list,
        max_length=8,
        description="Ranges of the UTC day in which a rollout may start, HH:MM-HH:MM (a "
        "range may pass midnight: 22:00-02:00). Empty: at any time.",
        json_schema_extra={
            "items": {
                "type": "string",
                "pattern": WINDOW_RANGE.pattern,
                "description": "One range of the UTC day, HH:MM-HH:MM.",
            }
        },
    )
    below_peak_percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Start only where the forecast demand (each time of day's P90 over "
        "the demand history, up to a week) stays under this percent of the day's P90 peak "
        "for the rollout's expected duration (its steps' pauses plus two "
        "scaleUpLeadSeconds). Needs a whole day of history, read by the autoscaler (any "
        "mode but off and external); until then the schedule alone decides.",
    )
    max_delay_seconds: int = Field(
        default=86_400,
        ge=0,
        le=7 * 86_400,
        description="The longest a new revision waits for its window; then its rollout "
        "starts regardless.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> RolloutWindow:
        for text in self.schedule:
            window_range_seconds(text)
        return self


class RolloutSpec(_Model):
    """How a new model revision replaces the current one."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.strategy != 'canary' || (size(self.steps) > 0 && self.steps[size(self.steps) - 1].weight == 100)",
                    "a canary rollout's last step must have weight 100",
                    ".steps",
                ),
                cel(
                    "self.strategy != 'rolling' || !has(self.window)",
                    "window is not supported with strategy rolling yet (the pools update in "
                    "place at once); use canary or blueGreen to schedule a rollout",
                    ".window",
                ),
            ]
        }
    )

    strategy: RolloutStrategy = Field(
        default=RolloutStrategy.canary, description="canary, blueGreen or rolling."
    )
    steps: list[RolloutStep] = Field(
        default_factory=_default_steps,
        max_length=10,
        description="Canary stages, in increasing weight, the last at 100.",
        json_schema_extra={
            "default": [
                {"weight": 10, "pauseSeconds": 300},
                {"weight": 50, "pauseSeconds": 300},
                {"weight": 100, "pauseSeconds": 0},
            ]
        },
    )
    analysis: RolloutAnalysis = _sub(RolloutAnalysis, "Thresholds that fail a stage.")
    auto_rollback: bool = Field(
        default=True, description="Return to the previous revision when a stage fails."
    )
    window: RolloutWindow | None = Field(
        default=None,
        description="When a rollout may start (default: as soon as the revision changes).",
    )


class SLOSpec(_Model):
    """Service-level objectives the autoscaler and the rollout analysis aim for."""

    ttft_p95_seconds: float = Field(
        default=1.0, gt=0, le=600, description="p95 time to first token."
    )
    tbt_p95_seconds: float = Field(default=0.1, gt=0, le=60, description="p95 time between tokens.")
    availability: float = Field(
        default=0.995,
        ge=0.5,
        le=1,
        description="Share of requests answered without a 5xx; the rest is the error budget "
        "the burn-rate alerts watch.",
    )


class GatewaySpec(_Model):
    """The OpenAI-compatible front door."""

    replicas: int = Field(default=2, ge=1, le=1000, description="Gateway replicas (stateless).")
    resources: Resources = _sub(Resources, "Compute per gateway replica.")
    api_keys_secret: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
        description="Existing Secret holding hashed API keys; none means no authentication.",
    )
    requests_per_minute: int = Field(
        default=600, ge=1, le=10_000_000, description="Per-key request rate limit."
    )
    tokens_per_minute: int = Field(
        default=200_000, ge=1, le=1_000_000_000, description="Per-key token rate limit."
    )
    image: str | None = Field(default=None, max_length=512, description="Container image override.")
