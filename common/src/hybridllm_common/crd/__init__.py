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

The models live by kind, one module each: ``service`` (LLMService; its parts in ``tiers``
and ``policies``), ``edgefleet``, ``edgedevice`` and ``checks`` (the rules no schema can
express), on ``base``. This package re-exports them: code names ``crd.LLMServiceSpec``.
"""

from __future__ import annotations

from hybridllm_common.crd.base import (
    API_VERSION,
    CIDR_PATTERN,
    GROUP,
    MAX_SERVICE_NAME_LENGTH,
    VERSION,
    cel,
)
from hybridllm_common.crd.checks import (
    SCALING_MODES,
    FieldError,
    InvalidSpec,
    parse_spec,
    pool_tier,
    scaled_pools,
    semantic_errors,
)
from hybridllm_common.crd.edgedevice import (
    DeviceFacts,
    DeviceInvite,
    DevicePhase,
    EdgeDeviceSpec,
    EdgeDeviceStatus,
)
from hybridllm_common.crd.edgefleet import (
    EdgeFleetSpec,
    EdgeFleetStatus,
    FleetConfig,
    FleetEnrollment,
    FleetRollout,
    FleetRolloutPhase,
    FleetRolloutStatus,
    FleetWave,
    HealthCheck,
    OfflineDevices,
    WaveWindow,
)
from hybridllm_common.crd.policies import (
    WINDOW_RANGE,
    AutoscalingMode,
    AutoscalingSpec,
    GatewaySpec,
    GoldenPrompt,
    RolloutAnalysis,
    RolloutSpec,
    RolloutStep,
    RolloutStrategy,
    RolloutTier,
    RolloutWindow,
    SLOSpec,
    window_range_seconds,
)
from hybridllm_common.crd.service import (
    BALANCE_NEEDS,
    BOTH_TIERS,
    CASCADE_NEEDS,
    VERDICT_FAIL,
    VERDICT_INCONCLUSIVE,
    VERDICT_NA,
    VERDICT_PASS,
    Condition,
    ConditionStatus,
    Endpoints,
    LLMServiceSpec,
    LLMServiceStatus,
    MetricVerdict,
    PoolStatus,
    RolloutPhase,
    RolloutStatus,
)
from hybridllm_common.crd.tiers import (
    EDGE_RUNTIME_QUANTIZATIONS,
    BalanceSpec,
    CascadeSpec,
    CloudDtype,
    CloudMode,
    CloudQuantization,
    CloudTierSpec,
    DeviceSelector,
    EdgeLimits,
    EdgeQuantization,
    EdgeRuntime,
    EdgeTierSpec,
    KVCacheSpec,
    Minimize,
    ModelCacheSpec,
    ModelFormat,
    ModelSpec,
    ObjectiveSpec,
    PoolSpec,
    ReplicaCapacity,
    Resources,
    ResponseCacheSpec,
    RoutingPolicy,
    RoutingSpec,
    SessionAffinity,
    TierPrices,
)

__all__ = [
    "API_VERSION",
    "BALANCE_NEEDS",
    "BOTH_TIERS",
    "CASCADE_NEEDS",
    "CIDR_PATTERN",
    "EDGE_RUNTIME_QUANTIZATIONS",
    "GROUP",
    "MAX_SERVICE_NAME_LENGTH",
    "SCALING_MODES",
    "VERDICT_FAIL",
    "VERDICT_INCONCLUSIVE",
    "VERDICT_NA",
    "VERDICT_PASS",
    "VERSION",
    "WINDOW_RANGE",
    "AutoscalingMode",
    "AutoscalingSpec",
    "BalanceSpec",
    "CascadeSpec",
    "CloudDtype",
    "CloudMode",
    "CloudQuantization",
    "CloudTierSpec",
    "Condition",
    "ConditionStatus",
    "DeviceFacts",
    "DeviceInvite",
    "DevicePhase",
    "DeviceSelector",
    "EdgeDeviceSpec",
    "EdgeDeviceStatus",
    "EdgeFleetSpec",
    "EdgeFleetStatus",
    "EdgeLimits",
    "EdgeQuantization",
    "EdgeRuntime",
    "EdgeTierSpec",
    "Endpoints",
    "FieldError",
    "FleetConfig",
    "FleetEnrollment",
    "FleetRollout",
    "FleetRolloutPhase",
    "FleetRolloutStatus",
    "FleetWave",
    "GatewaySpec",
    "GoldenPrompt",
    "HealthCheck",
    "InvalidSpec",
    "KVCacheSpec",
    "LLMServiceSpec",
    "LLMServiceStatus",
    "MetricVerdict",
    "Minimize",
    "ModelCacheSpec",
    "ModelFormat",
    "ModelSpec",
    "ObjectiveSpec",
    "OfflineDevices",
    "PoolSpec",
    "PoolStatus",
    "ReplicaCapacity",
    "Resources",
    "ResponseCacheSpec",
    "RolloutAnalysis",
    "RolloutPhase",
    "RolloutSpec",
    "RolloutStatus",
    "RolloutStep",
    "RolloutStrategy",
    "RolloutTier",
    "RolloutWindow",
    "RoutingPolicy",
    "RoutingSpec",
    "SLOSpec",
    "SessionAffinity",
    "TierPrices",
    "WaveWindow",
    "cel",
    "parse_spec",
    "pool_tier",
    "scaled_pools",
    "semantic_errors",
    "window_range_seconds",
]
