"""The alerting rules (a PrometheusRule's groups), built from the same metric names as the
dashboards and checked by the same tests.

- SLO burn rate: the multiwindow, multi-burn-rate alerts of the Google SRE workbook on
  the gateway's 5xx share against each service's own availability objective
  (``spec.slo.availability``, exported by the operator: the error budget is the rest;
  page at 14.4x over 5 m and 1 h, ticket at 6x over 30 m and 6 h), and the p95 time to
  first token above the service's objective (``spec.slo.ttftP95Seconds``) for 10 minutes.
- Autoscaling: a forecast off by more than half for 30 minutes; a pool that wants more
  replicas than the cluster schedules; a pool held without its load metric.
- Rollouts: a rollout whose step has not moved for an hour.
- Edge fleet: more than a fifth of a fleet's devices offline for 15 minutes.
"""

from __future__ import annotations

from typing import Any

from hybridllm_common import metrics as n

SERVICE = ("namespace", "llmservice")


def _error_ratio(window: str) -> str:
    by = ", ".join(SERVICE)
    return (
        f'sum by ({by}) (rate({n.GATEWAY_REQUESTS_TOTAL}{{code=~"5.."}}[{window}])) '
        f"/ sum by ({by}) (rate({n.GATEWAY_REQUESTS_TOTAL}[{window}]))"
    )


def _burn(long: str, short: str, factor: float) -> str:
    """Both windows' error ratios above ``factor`` times the service's error budget."""
    by = ", ".join(SERVICE)
    budget = f"({factor:g} * (1 - max by ({by}) ({n.SERVICE_SLO_AVAILABILITY_RATIO})))"
    return (
        f"({_error_ratio(long)})\n> on ({by}) {budget}\nand\n"
        f"({_error_ratio(short)})\n> on ({by}) {budget}"
    )


def _rule(
    name: str, expr: str, for_: str, severity: str, summary: str, description: str
) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def groups() -> list[dict[str, Any]]:
    """The rule groups, as a PrometheusRule's ``spec.groups``."""
    service = "{{ $labels.namespace }}/{{ $labels.llmservice }}"
    pool = service + " pool {{ $labels.pool }}"
    ttft_p95 = (
        "histogram_quantile(0.95, sum by (le, namespace, llmservice) "
        f"(rate({n.GATEWAY_REVISION_TTFT_SECONDS}_bucket[5m])))"
    )
    return [
        {
            "name": "hybridllm.slo",
            "rules": [
                _rule(
                    "HybridllmErrorBudgetBurnFast",
                    _burn("1h", "5m", 14.4),
                    "2m",
                    "critical",
                    f"{service} burns its error budget 14x too fast",
                    "The 5xx share of the gateway's answers ({{ $value | humanizePercentage }} "
                    "over the last hour) is over 14.4 times the error budget of its "
                    "spec.slo.availability over 1 h and 5 m: 2% of a 30-day budget gone in an "
                    "hour.",
                ),
                _rule(
                    "HybridllmErrorBudgetBurnSlow",
                    _burn("6h", "30m", 6),
                    "15m",
                    "warning",
                    f"{service} burns its error budget 6x too fast",
                    "The 5xx share of the gateway's answers ({{ $value | humanizePercentage }} "
                    "over the last 6 hours) is over 6 times the error budget of its "
                    "spec.slo.availability over 6 h and 30 m: 5% of a 30-day budget gone in 6 "
                    "hours.",
                ),
                _rule(
                    "HybridllmTimeToFirstTokenOverObjective",
                    f"{ttft_p95}\n> on (namespace, llmservice)\n"
                    f"max by (namespace, llmservice) ({n.SERVICE_SLO_TTFT_SECONDS})",
                    "10m",
                    "warning",
                    f"{service}: p95 time to first token above its objective",
                    "The gateway's p95 time to first token has been above the LLMService's "
                    "spec.slo.ttftP95Seconds for 10 minutes ({{ $value | humanizeDuration }}).",
                ),
            ],
        },
        {
            "name": "hybridllm.autoscaling",
            "rules": [
                _rule(
                    "HybridllmForecastErrorHigh",
                    f"max by (namespace, llmservice, pool) ({n.AUTOSCALER_FORECAST_ERROR_RATIO})"
                    " > 0.5",
                    "30m",
                    "warning",
                    f"{pool}: the forecast is off by more than half",
                    "The forecast's recent relative error has been above 50% for 30 minutes "
                    "({{ $value | humanizePercentage }}); predictive scaling leans on the "
                    "reactive floor. Check the forecast model (operator.forecastModel).",
                ),
                _rule(
                    "HybridllmPoolCapacityBound",
                    f"max by (namespace, llmservice, pool) ({n.AUTOSCALER_CAPACITY_BOUND}) == 1",
                    "10m",
                    "warning",
                    f"{pool} cannot get the replicas it needs",
                    "The autoscaler wants more replicas than the cluster schedules (pods "
                    "Unschedulable) and has held for 10 minutes.",
                ),
                _rule(
                    "HybridllmAutoscalerBlind",
                    f"min by (namespace, llmservice, pool) ({n.AUTOSCALER_METRICS_AVAILABLE}) == 0",
                    "10m",
                    "warning",
                    f"{pool} is held without its load metric",
                    "The autoscaler has read no load metric for 10 minutes and holds the "
                    "replicas; see the LLMService's MetricsAvailable condition.",
                ),
            ],
        },
        {
            "name": "hybridllm.rollouts",
            "rules": [
                _rule(
                    "HybridllmRolloutStuck",
                    "max by (namespace, llmservice) "
                    f'({n.ROLLOUT_PHASE}{{phase=~"Progressing|Inconclusive|Failed|Paused"}}) == 1'
                    f"\nand on (namespace, llmservice)\nchanges({n.ROLLOUT_STEP}[1h]) == 0",
                    "15m",
                    "warning",
                    f"{service}: the rollout has not moved for an hour",
                    "The rollout has stayed at one step for over an hour (inconclusive "
                    "analysis, a hand pause or a failed step held by autoRollback: false). "
                    "`hybridllm rollout status` says why.",
                ),
            ],
        },
        {
            "name": "hybridllm.fleet",
            "rules": [
                _rule(
                    "HybridllmFleetOffline",
                    f'sum by (fleet) ({n.FLEET_DEVICES}{{phase="Offline"}})\n/ sum by (fleet) '
                    f'({n.FLEET_DEVICES}{{phase!~"Pending|Revoked"}}) > 0.2',
                    "15m",
                    "warning",
                    "fleet {{ $labels.fleet }}: over a fifth of it offline",
                    "More than 20% of the fleet's enrolled devices have missed their "
                    "heartbeats for 15 minutes ({{ $value | humanizePercentage }}).",
                ),
            ],
        },
    ]
