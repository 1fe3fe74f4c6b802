"""Tier choice by prediction (``objective`` in the routing table).

For a request both tiers may serve, the gateway predicts its answer on each tier from what
it learned of each replica's speed (`hybridllm_common.speed`, fed by every streamed
answer): the time to the first token and to the last, on the tier's replica that would
answer soonest given the requests already in flight on it. Then:

- ``minimize: latency``: the tier whose predicted answer ends first;
- ``minimize: cost``: the cheapest tier (``costPerMillionTokens`` x the prompt and the
  expected output) whose predicted first token meets the SLO (``sloTtftSeconds``, the
  service's ``slo.ttftP95Seconds``); when none does, the fastest.

The expected output is the tier's mean answer length, capped by ``max_tokens``. A tier
with no healthy replica, or an edge tier past ``maxQueueDepth``, is not a candidate; while
a candidate tier has no estimate yet (fewer than 8 answers on the tier), nothing is
predicted and the policy decides as without an objective. The chosen order keeps the other
tier second, for the retries before the first byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridllm_common import speed
from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import config as config_mod


@dataclass(frozen=True)
class Prediction:
    tier: str
    replica: str
    ttft_s: float
    seconds: float  # to the last token
    cost: float  # of the request on this tier (0 without prices)


def predict(
    tier: str,
    pool: balancer_mod.TierPool,
    speeds: speed.SpeedTable,
    prompt_tokens: int,
    output_tokens: int,
    price: float | None,
) -> Prediction | None:
    """The tier's soonest answer for this request (None: no healthy replica, or no estimate)."""
    best: Prediction | None = None
    for r in pool.healthy():
        model = speeds.of(tier, r.url)
        if model is None:
            return None
        load = r.num_outstanding + 1
        seconds = model.predict_seconds(prompt_tokens, output_tokens, load)
        if best is None or seconds < best.seconds:
            cost = (price or 0.0) * (prompt_tokens + output_tokens) / 1e6
            best = Prediction(tier, r.url, model.predict_ttft(prompt_tokens, load), seconds, cost)
    return best


def rank(
    objective: config_mod.Objective,
    slo_ttft_s: float,
    candidates: dict[str, balancer_mod.TierPool],
    speeds: speed.SpeedTable,
    prompt_tokens: int,
    output_tokens: Callable[[str], int],
) -> list[Prediction] | None:
    """The candidate tiers' predictions, best first (None: some tier cannot be predicted)."""
    prices = objective.cost_per_million_tokens
    predictions = []
    for tier, pool in candidates.items():
        got = predict(tier, pool, speeds, prompt_tokens, output_tokens(tier),
                      getattr(prices, tier, None))  # fmt: skip
        if got is None:
            return None
        predictions.append(got)
    by_time = sorted(predictions, key=lambda p: (p.seconds, p.tier))
    if objective.minimize == config_mod.Minimize.latency:
        return by_time
    meeting = sorted((p for p in predictions if p.ttft_s <= slo_ttft_s),
                     key=lambda p: (p.cost, p.seconds, p.tier))  # fmt: skip
    return meeting + [p for p in by_time if p not in meeting] if meeting else by_time
