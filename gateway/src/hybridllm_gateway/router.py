"""Tier choice: which tiers to try for a request, in order, and why.

In order of precedence:

1. An explicit choice wins: the ``x-hybridllm-tier: edge|cloud`` header, or a model name
   suffix (``smollm2:edge``). No spill: the client asked for that tier. An explicit edge
   choice, like an ``edge-only`` policy, is still held to ``edgeLimits`` (a 400 naming
   the limit): the limits bound what an edge replica is asked to do.
2. ``cloud-only`` / ``edge-only`` policies, or a table with one tier, leave no choice.
3. Requests beyond ``edgeLimits`` (estimated prompt tokens, ``max_tokens``) go to the cloud.
4. ``cloud-first`` tries the cloud, then the edge; ``edge-first`` the edge, then the cloud;
   ``auto`` asks the classifier (model, or rules when no model loads).
5. An edge first choice spills to the cloud when every healthy edge replica has more than
   ``maxQueueDepth`` requests outstanding (``spill_overload``) or no edge replica is
   healthy (``spill_down``); the second tier in the list is also where a request goes
   when every replica of the first failed before the first byte.
   Requests with tools or a response format are routed like any other: both runtimes
   serve them under a grammar (docs/structured-output.md); the classifier weighs tools.
6. With ``balance`` on, a request both tiers may serve (steps 3-4) goes to the other tier
   when the first choice is busier: its least-loaded healthy replica has more than
   ``margin`` requests outstanding beyond the other tier's least-loaded one (``balance``).
   The classifier says where a request is best served; balance says where it is served
   soonest when that tier is queueing and the other has room. It never moves a request
   into an edge tier past ``maxQueueDepth``.

7. With an ``objective`` (predict.py), a request both tiers may serve (the classifier's
   verdict is the edge, or a first-choice policy) goes to the tier the prediction favours:
   the sooner answer, or the cheapest within the SLO (``predicted_latency``,
   ``predicted_cost``); before the gateway has learned both tiers' speeds, steps 4-6 decide.

The result is a :class:`Route`: the tiers to try and the reason label used in metrics and
in the ``x-hybridllm-route`` response header.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from hybridllm_common import openai_protocol as oai
from hybridllm_common import speed
from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import classifier as classifier_mod
from hybridllm_gateway import config as config_mod
from hybridllm_gateway import predict as predict_mod
from hybridllm_gateway.errors import APIError

TIER_HEADER = "x-hybridllm-tier"
DEFAULT_OUTPUT_TOKENS = 256  # expected answer length before a tier has answered any
TIERS = ("edge", "cloud")

ROUTE_REASON = web.RequestKey("route_reason", str)  # the reason label, per request
# The tier an API request was routed to ("none" before routing): every answer, an error
# included, is counted in requests_total under it.
ROUTE_TIER = web.RequestKey("route_tier", str)


@dataclass(frozen=True)
class Route:
    tiers: tuple[str, ...]
    reason: str


def split_model(model: str) -> tuple[str, str | None]:
    """``name:edge`` -> (``name``, ``edge``); other names unchanged."""
    base, sep, suffix = model.rpartition(":")
    if sep and suffix in TIERS:
        return base, suffix
    return model, None


def choose(
    routing: config_mod.RoutingConfig,
    pools: dict[str, balancer_mod.TierPool],
    classifier: classifier_mod.Classifier,
    features: classifier_mod.Features,
    explicit: str | None,
    speeds: speed.SpeedTable | None = None,
    mean_output: Callable[[str], float | None] = lambda tier: None,
) -> Route:
    present = tuple(t for t in TIERS if t in pools and pools[t].replicas)
    limits = routing.edge_limits
    policy = routing.policy
    # The edge limits bound what an edge replica is asked to do, however it was chosen.
    edge_chosen = explicit == "edge" or (explicit is None and policy == config_mod.Policy.edge_only)
    if edge_chosen and (over := over_edge_limits(limits, features)):
        param = "max_tokens" if over.startswith("max_tokens") else None
        raise APIError(oai.INVALID_PARAMETER, f"{over}: the edge tier serves no more", param)
    if explicit is not None:
        return Route((explicit,), "explicit")
    if policy == config_mod.Policy.cloud_only:
        return Route(("cloud",), "policy")
    if policy == config_mod.Policy.edge_only:
        return Route(("edge",), "policy")
    if len(present) == 1:
        return Route(present, "single_tier")
    if over_edge_limits(limits, features):
        return Route(("cloud",), "edge_limits")
    if policy == config_mod.Policy.cloud_first:
        first, reason = "cloud", "policy"
    elif policy == config_mod.Policy.edge_first:
        first, reason = "edge", "policy"
    else:
        first, reason = classifier.decide(features)
    edge = pools["edge"]
    # A request both tiers may serve (the classifier did not say it needs the cloud; a
    # first-choice policy is a preference): the objective, where predictions exist.
    if (
        routing.objective is not None
        and speeds is not None
        and (first == "edge" or reason == "policy")
    ):
        candidates = {
            t: pools[t] for t in TIERS
            if pools[t].healthy() and (t == "cloud" or not edge.overloaded(limits.max_queue_depth))
        }  # fmt: skip

        def output_tokens(tier: str) -> int:
            mean = mean_output(tier)
            expected = int(mean) if mean is not None else DEFAULT_OUTPUT_TOKENS
            return min(expected, features.max_tokens) if features.max_tokens else expected

        ranked = predict_mod.rank(routing.objective, routing.slo_ttft_seconds, candidates,
                                  speeds, features.prompt_tokens, output_tokens)  # fmt: skip
        if ranked is not None and len(ranked) == len(TIERS):
            return Route(tuple(p.tier for p in ranked), f"predicted_{routing.objective.minimize}")
    if first == "edge":
        if not edge.healthy():
            return Route(("cloud",), "spill_down")
        if edge.overloaded(limits.max_queue_depth):
            return Route(("cloud",), "spill_overload")
    second = "cloud" if first == "edge" else "edge"
    balance = routing.balance
    if (
        balance.enabled
        and busier(pools[first], pools[second], balance.margin)
        and (second == "cloud" or not edge.overloaded(limits.max_queue_depth))
    ):
        return Route((second, first), "balance")
    return Route((first, second), reason)


def over_edge_limits(limits: config_mod.EdgeLimits, features: classifier_mod.Features) -> str:
    """Which edge limit the request passes, in words ('' when none)."""
    if features.prompt_tokens > limits.max_prompt_tokens:
        return (
            f"prompt of about {features.prompt_tokens} tokens is over edgeLimits."
            f"maxPromptTokens ({limits.max_prompt_tokens})"
        )
    if features.max_tokens is not None and features.max_tokens > limits.max_output_tokens:
        return (
            f"max_tokens {features.max_tokens} is over edgeLimits.maxOutputTokens "
            f"({limits.max_output_tokens})"
        )
    return ""


def busier(a: balancer_mod.TierPool, b: balancer_mod.TierPool, margin: int) -> bool:
    """True when ``a``'s least-loaded healthy replica has more than ``margin`` outstanding
    requests beyond ``b``'s (and ``b`` has a healthy replica)."""
    la, lb = a.least_outstanding(), b.least_outstanding()
    return la is not None and lb is not None and la - lb > margin
