"""The routing table: one model for what the operator (and local mode) writes and what the
gateways read.

The operator renders it from an ``LLMService`` (``hybridllm_operator.llmservice.builders.routing``)
into the ConfigMap key ``routing.json``; a gateway parses it with :func:`parse`. The
policy parts are the ``LLMService``'s own models (``spec.routing.*``), taken over as they
are declared there, read leniently on the wire: a field a newer operator adds is ignored
(with a warning, at the top level) rather than stopping an older gateway from reloading.
The rest (tiers and their backends, the rate limits) exists only on the wire.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from hybridllm_common import crd

log = logging.getLogger(__name__)

_WIRE = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)

Policy = crd.RoutingPolicy
Minimize = crd.Minimize


class _Wire(BaseModel):
    model_config = _WIRE


# The LLMService's models, read leniently (and frozen: a table is replaced, never edited).
class EdgeLimits(crd.EdgeLimits):
    model_config = _WIRE


class SessionAffinity(crd.SessionAffinity):
    model_config = _WIRE


class Cascade(crd.CascadeSpec):
    model_config = _WIRE


class Balance(crd.BalanceSpec):
    model_config = _WIRE


class TierPrices(crd.TierPrices):
    model_config = _WIRE


class Objective(crd.ObjectiveSpec):
    model_config = _WIRE

    cost_per_million_tokens: TierPrices = Field(default_factory=TierPrices)


class GoldenPrompt(crd.GoldenPrompt):
    model_config = _WIRE


class Backend(_Wire):
    url: str = Field(min_length=1)
    revision: str = ""
    weight: int = Field(default=100, ge=0, le=1_000_000)
    # an enrolled device outside the cluster: never sent the backend token, which opens
    # the service's runtimes (hybridllm_common.backend_auth)
    device: bool = False
    # a device over TLS: the name its certificate must carry (hybridllm_common.device_tls),
    # verified against the table's device_ca
    server_name: str = Field(default="", max_length=253)


class Tier(_Wire):
    backends: list[Backend] = Field(default_factory=list)
    # The tier's pools may be at zero replicas (minReplicas 0): a request that finds no
    # replica waits for one (the autoscaler sees it waiting and starts one).
    scale_from_zero: bool = False
    # Across a WAN from this gateway (a site gateway's cloud tier): its backends are probed
    # every ``probe_interval_s``, and while none answers, a request that needs the tier is
    # refused at once (503 tier_unreachable) rather than waiting on a link that is down.
    remote: bool = False


class RateLimits(_Wire):
    requests_per_minute: int = Field(default=600, ge=1)
    tokens_per_minute: int = Field(default=200_000, ge=1)


class RoutingConfig(_Wire):
    service: str = ""
    namespace: str = ""
    model: str = ""
    revision: str = ""
    generation: int = Field(default=0, ge=0)  # bumped by the operator with every new weight
    policy: Policy = Policy.auto
    edge_limits: EdgeLimits = Field(default_factory=EdgeLimits)
    session_affinity: SessionAffinity = Field(default_factory=SessionAffinity)
    cascade: Cascade = Field(default_factory=Cascade)
    balance: Balance = Field(default_factory=Balance)
    objective: Objective | None = None  # route by prediction; absent: the policy alone
    slo_ttft_seconds: float = Field(default=1.0, gt=0)  # what a cheaper tier must meet
    rate_limits: RateLimits = Field(default_factory=RateLimits)
    # asked of a rollout's canary backends by the gateways (the rollout waits for them)
    golden_prompts: list[GoldenPrompt] = Field(default_factory=list)
    tiers: dict[str, Tier] = Field(default_factory=dict)
    # the CA of the fleet whose devices serve the edge tier (PEM): their certificates'
    device_ca: str = Field(default="", max_length=8192, alias="deviceCA")

    @model_validator(mode="after")
    def _known_tiers(self) -> RoutingConfig:
        unknown = set(self.tiers) - {"edge", "cloud"}
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}: only edge and cloud exist")
        if not any(t.backends for t in self.tiers.values()):
            raise ValueError("no tier has a backend")
        for tier in self.tiers.values():
            for b in tier.backends:
                if b.server_name and not (b.url.startswith("https://") and self.device_ca):
                    raise ValueError(f"backend {b.url}: a server name needs an https URL and "
                                     "the table's deviceCA")  # fmt: skip
        return self

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


def parse(data: dict[str, Any]) -> RoutingConfig:
    """A routing table from its wire form; keys this version does not know are logged."""
    known = set(RoutingConfig.model_fields) | {
        f.alias for f in RoutingConfig.model_fields.values() if f.alias
    }
    extra = sorted(set(data) - known)
    if extra:
        log.warning("routing config: ignoring unknown keys %s", extra)
    return RoutingConfig.model_validate(data)


def lenient(model: type[BaseModel], value: BaseModel) -> Any:
    """``value`` (an LLMService model) as its wire counterpart ``model``."""
    return model.model_validate(value.model_dump())
