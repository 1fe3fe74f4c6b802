"""The dashboards' panels and their PromQL, in one place.

The Grafana dashboards (`grafana`), the alerts' expressions and their tests read these
definitions; nothing else writes a query. A query selects with ``{sel}`` (the
dashboard's variables: ``namespace``/``llmservice``, or ``fleet``) and takes its rate
windows as ``$__rate_interval`` and its ranges as ``$__range``, Grafana's own variables;
`render` substitutes them where there is no Grafana (tests, the built-in page).

The rules the tests hold every query to: counters only inside ``rate``/``increase``;
every quantile over ``sum by (le, ...) (rate(..._bucket[...]))``; every metric in the
catalogue (docs/metrics.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridllm_common import metrics as n

SERVICE_SEL = 'namespace="$namespace", llmservice="$llmservice"'
POOL_SEL = SERVICE_SEL + ', pool="$pool"'
FLEET_SEL = 'fleet="$fleet"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"  # a Grafana unit id
    kind: str = "timeseries"  # timeseries, stat, table
    band: tuple[str, str] | None = None  # (lower legend, upper legend) filled between
    width: int = 12


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[str, ...]  # label names, each a query variable in this order
    panels: tuple[Panel, ...]
    annotations: tuple[Query, ...] = field(default_factory=tuple)


def render(expr: str, values: dict[str, str], rate: str = "1m", range_: str = "1h") -> str:
    """The query with the variables substituted (no Grafana to do it)."""
    out = expr.replace("$__rate_interval", rate).replace("$__range", range_)
    for name, value in values.items():
        out = out.replace(f"${name}", value)
    return out


def _q(expr: str, legend: str, sel: str = SERVICE_SEL) -> Query:
    return Query(expr.replace("{sel}", "{" + sel + "}").replace("{sel,", "{" + sel + ","), legend)


def _quantiles(metric: str, by: str = "", sel: str = SERVICE_SEL) -> tuple[Query, ...]:
    group = f"le, {by}" if by else "le"
    label = f"{{{{{by}}}}} " if by else ""
    return tuple(
        _q(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{sel}}[{RATE}])))",
            f"{label}p{round(q * 100)}",
            sel,
        )
        for q in (0.5, 0.95, 0.99)
    )


def _ratio(num: str, den: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({num}[{RATE}])) / sum{group} (rate({den}[{RATE}]))"


REQUESTS = n.GATEWAY_REQUESTS_TOTAL
TTFT = n.GATEWAY_REVISION_TTFT_SECONDS
TPOT = n.GATEWAY_REVISION_TPOT_SECONDS
ATTEMPTS = n.GATEWAY_REVISION_ATTEMPTS_TOTAL

SERVICE = Dashboard(
    uid="hybridllm-service",
    title="hybridllm / Service",
    description="One LLMService as its users see it: traffic per tier, latency, errors, "
    "queues and the KV cache.",
    variables=("namespace", "llmservice"),
    panels=(
        Panel(
            "Requests per second by tier",
            "Answers of the gateway per second, by the tier that served them.",
            (_q(f"sum by (tier) (rate({REQUESTS}{{sel}}[{RATE}]))", "{{tier}}"),),
            unit="reqps",
        ),
        Panel(
            "Tokens per second by tier",
            "Prompt tokens (the gateway's estimate) and completion tokens answered, and "
            "the completion tokens offered (estimated on arrival: what the autoscaler sizes "
            "pools by; above the answered line, a tier is short of replicas).",
            (
                _q(
                    f"sum by (tier) (rate({n.GATEWAY_PROMPT_TOKENS_TOTAL}{{sel}}[{RATE}]))",
                    "{{tier}} prompt",
                ),
                _q(
                    f"sum by (tier) (rate({n.GATEWAY_COMPLETION_TOKENS_TOTAL}{{sel}}[{RATE}]))",
                    "{{tier}} completion",
                ),
                _q(
                    f"sum by (tier) (rate({n.GATEWAY_OFFERED_COMPLETION_TOKENS_TOTAL}{{sel}}"
                    f"[{RATE}]))",
                    "{{tier}} completion offered",
                ),
            ),
        ),
        Panel(
            "Time to first token",
            "p50, p95 and p99 of the time to the first token, as the gateway measured it.",
            _quantiles(TTFT),
            unit="s",
        ),
        Panel(
            "Time between tokens",
            "p50, p95 and p99 of the time per output token of streamed answers.",
            _quantiles(TPOT),
            unit="s",
        ),
        Panel(
            "Error rate",
            "Share of the gateway's answers that were 5xx.",
            (
                _q(
                    f'(sum (rate({REQUESTS}{{sel, code=~"5.."}}[{RATE}])) or vector(0)) '
                    f"/ sum (rate({REQUESTS}{{sel}}[{RATE}]))",
                    "5xx share",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Edge share",
            "Share of the answers the edge tier served.",
            (
                _q(
                    f'(sum (rate({REQUESTS}{{sel, tier="edge"}}[{RATE}])) or vector(0)) '
                    f"/ sum (rate({REQUESTS}{{sel}}[{RATE}]))",
                    "edge",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Queue depth",
            "Requests waiting in the runtimes' queues, and in flight from the gateway.",
            (
                _q(
                    f"sum by (component) ({n.NUM_REQUESTS_WAITING}{{sel}})", "{{component}} waiting"
                ),
                _q(
                    f"sum by (tier) ({n.GATEWAY_OUTSTANDING_REQUESTS}{{sel}})", "{{tier}} in flight"
                ),
            ),
        ),
        Panel(
            "KV cache use",
            "Share of the cloud pools' KV cache blocks in use.",
            (
                _q(
                    f"sum by (component) ({n.KV_BLOCKS_USED}{{sel}}) / (sum by (component) "
                    f"({n.KV_BLOCKS_USED}{{sel}}) + sum by (component) ({n.KV_BLOCKS_FREE}{{sel}}))",
                    "{{component}}",
                ),
            ),
            unit="percentunit",
        ),
    ),
)

AUTOSCALING = Dashboard(
    uid="hybridllm-autoscaling",
    title="hybridllm / Autoscaling",
    description="One pool's load against the forecast, and the replicas every policy asked "
    "for; each applied decision is annotated with its cause.",
    variables=("namespace", "llmservice", "pool"),
    panels=(
        Panel(
            "Demand and forecast (replicas at target)",
            "The load offered to the pool, and the forecast's P50-P90 band over the scale-up "
            "lead time, in replicas at the target utilisation.",
            (
                _q(f"sum ({n.AUTOSCALER_DEMAND_REPLICAS}{{sel}})", "demand", POOL_SEL),
                _q(
                    f'sum ({n.AUTOSCALER_FORECAST_REPLICAS}{{sel, quantile="0.5"}})',
                    "forecast P50",
                    POOL_SEL,
                ),
                _q(
                    f'sum ({n.AUTOSCALER_FORECAST_REPLICAS}{{sel, quantile="0.9"}})',
                    "forecast P90",
                    POOL_SEL,
                ),
            ),
            band=("forecast P50", "forecast P90"),
            width=24,
        ),
        Panel(
            "Replicas: desired, provisioned, ready",
            "What the autoscaler set, what runs, and what serves.",
            (
                _q(f"sum ({n.AUTOSCALER_DESIRED_REPLICAS}{{sel}})", "desired", POOL_SEL),
                _q(f"sum ({n.AUTOSCALER_PROVISIONED_REPLICAS}{{sel}})", "provisioned", POOL_SEL),
                _q(f"sum ({n.AUTOSCALER_READY_REPLICAS}{{sel}})", "ready", POOL_SEL),
            ),
        ),
        Panel(
            "Replicas each policy asked for",
            "The reactive floor, the forecast's part and the combined recommendation.",
            (
                _q(
                    f"sum by (policy) ({n.AUTOSCALER_POLICY_REPLICAS}{{sel}})",
                    "{{policy}}",
                    POOL_SEL,
                ),
            ),
        ),
        Panel(
            "Forecast error",
            "Recent relative error of the pool's forecast against what came.",
            (_q(f"max ({n.AUTOSCALER_FORECAST_ERROR_RATIO}{{sel}})", "error", POOL_SEL),),
            unit="percentunit",
        ),
        Panel(
            "SLO attainment (TTFT p95, last hour)",
            "Share of the last hour's minutes in which the service's p95 time to first token "
            "met its objective.",
            (
                _q(
                    f"avg_over_time((histogram_quantile(0.95, sum by (le) (rate({TTFT}_bucket"
                    f"{{sel}}[5m]))) <= bool on () max ({n.SERVICE_SLO_TTFT_SECONDS}{{sel}}))"
                    "[1h:1m])",
                    "attained",
                ),
            ),
            unit="percentunit",
            kind="stat",
        ),
        Panel(
            "Replica-hours (dashboard range)",
            "Replica-hours the pool ran over the dashboard's time range: what it cost in capacity.",
            (
                _q(
                    f"sum (increase({n.AUTOSCALER_REPLICA_SECONDS_TOTAL}{{sel}}[$__range])) / 3600",
                    "replica-hours",
                    POOL_SEL,
                ),
            ),
            kind="stat",
        ),
        Panel(
            "Scaling decisions",
            "Replica changes the autoscaler applied, by direction.",
            (
                _q(
                    f"sum by (direction) (increase({n.AUTOSCALER_SCALE_EVENTS_TOTAL}{{sel}}"
                    f"[{RATE}]))",
                    "{{direction}}",
                    POOL_SEL,
                ),
            ),
        ),
        Panel(
            "Why: the last decision",
            "The cause of the pool's last decision (the full reason is in the LLMService's "
            "status and Events); whether it is capacity-bound (1) and "
            "whether its load metric was read (1).",
            (
                _q(f"max by (cause) ({n.AUTOSCALER_DECISION_INFO}{{sel}})", "{{cause}}", POOL_SEL),
                _q(f"max ({n.AUTOSCALER_CAPACITY_BOUND}{{sel}})", "capacity-bound", POOL_SEL),
                _q(f"min ({n.AUTOSCALER_METRICS_AVAILABLE}{{sel}})", "metrics available", POOL_SEL),
            ),
            kind="table",
            width=24,
        ),
    ),
    annotations=(
        _q(
            f"max by (cause) ({n.AUTOSCALER_DECISION_INFO}{{sel}}) and on () "
            f"(sum (increase({n.AUTOSCALER_SCALE_EVENTS_TOTAL}{{sel}}[1m])) > 0)",
            "{{cause}}",
            POOL_SEL,
        ),
    ),
)

ROLLOUTS = Dashboard(
    uid="hybridllm-rollouts",
    title="hybridllm / Rollouts",
    description="A model rollout step by step: each revision's weight, and the canary "
    "against the stable revision on every analysed metric.",
    variables=("namespace", "llmservice"),
    panels=(
        Panel(
            "Weight per revision",
            "Each revision's share of its tier's traffic in the routing the gateways serve.",
            (
                _q(
                    f"max by (tier, revision) ({n.GATEWAY_REVISION_WEIGHT}{{sel}})",
                    "{{tier}} {{revision}}",
                ),
            ),
            unit="percent",
        ),
        Panel(
            "Rollout step and phase",
            "The step the rollout is at, and its phase (1 for the current one).",
            (
                _q(f"max ({n.ROLLOUT_STEP}{{sel}})", "step"),
                _q(f"max ({n.ROLLOUT_STEPS}{{sel}})", "steps"),
                _q(f"max by (phase) ({n.ROLLOUT_PHASE}{{sel}}) == 1", "{{phase}}"),
            ),
            kind="stat",
        ),
        Panel(
            "Error rate by revision",
            "Share of each revision's upstream attempts that failed (retried or not); 0 "
            "while a revision has had no error.",
            (
                _q(
                    f'(sum by (revision) (rate({ATTEMPTS}{{sel, result="error"}}[{RATE}])) '
                    f"or 0 * sum by (revision) (rate({ATTEMPTS}{{sel}}[{RATE}]))) "
                    f"/ sum by (revision) (rate({ATTEMPTS}{{sel}}[{RATE}]))",
                    "{{revision}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Time to first token by revision (p95)",
            "The canary against the stable revision.",
            (
                _q(
                    f"histogram_quantile(0.95, sum by (le, revision) (rate({TTFT}_bucket{{sel}}"
                    f"[{RATE}])))",
                    "{{revision}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Time per output token by revision (p95)",
            "The canary against the stable revision, on streamed answers.",
            (
                _q(
                    f"histogram_quantile(0.95, sum by (le, revision) (rate({TPOT}_bucket{{sel}}"
                    f"[{RATE}])))",
                    "{{revision}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Golden prompts on the canary",
            "1 when every backend of a new revision answered golden prompt N (0-based) "
            "right, 0 when one did not; asked by each gateway once per canary backend, "
            "before any traffic moves (spec.rollout.analysis.goldenPrompts).",
            (
                _q(
                    f"min by (revision, prompt) ({n.GATEWAY_REVISION_GOLDEN_PASSED}{{sel}})",
                    "{{revision}} prompt {{prompt}}",
                ),
            ),
        ),
        Panel(
            "The step's analysis",
            "The last analysis of the step: each metric on the canary and the stable "
            "revision, and its verdict.",
            (
                _q(
                    f"max by (metric, tier, role) ({n.ROLLOUT_ANALYSIS_VALUE}{{sel}})",
                    "{{metric}} {{tier}} {{role}}",
                ),
                _q(
                    f"max by (metric, tier, result) ({n.ROLLOUT_ANALYSIS_RESULT}{{sel}})",
                    "{{metric}} {{tier}} {{result}}",
                ),
            ),
            kind="table",
            width=24,
        ),
    ),
)

FLEET = Dashboard(
    uid="hybridllm-fleet",
    title="hybridllm / Edge fleet",
    description="An edge fleet's devices: their states, the revision mix, heartbeats and "
    "what the devices report.",
    variables=("fleet",),
    panels=(
        Panel(
            "Devices by state",
            "Enrolled devices by phase.",
            (_q(f"sum by (phase) ({n.FLEET_DEVICES}{{sel}})", "{{phase}}", FLEET_SEL),),
        ),
        Panel(
            "Online devices by revision",
            "The revision mix of the devices that heartbeat.",
            (
                _q(
                    f"sum by (revision) ({n.FLEET_REVISION_DEVICES}{{sel}})",
                    "{{revision}}",
                    FLEET_SEL,
                ),
            ),
        ),
        Panel(
            "Heartbeat age",
            "How long ago the online devices last heartbeat: median and the oldest.",
            (
                _q(
                    f"max by (quantile) ({n.FLEET_HEARTBEAT_AGE_SECONDS}{{sel}})",
                    "{{quantile}}",
                    FLEET_SEL,
                ),
            ),
            unit="s",
        ),
        Panel(
            "Demand stranded at sites (last day)",
            "Prompt tokens each site's gateways refused because the cloud tier was "
            "unreachable from the site, over the last day, reported once its WAN was back.",
            (
                _q(
                    f"sum by (site) ({n.FLEET_SITE_STRANDED_PROMPT_TOKENS}{{sel}})",
                    "{{site}}",
                    FLEET_SEL,
                ),
            ),
        ),
        Panel(
            "Tokens per second by revision",
            "What the online devices of each revision generate, summed.",
            (
                _q(
                    f"sum by (revision) ({n.FLEET_REVISION_TOKENS_PER_SECOND}{{sel}})",
                    "{{revision}}",
                    FLEET_SEL,
                ),
            ),
        ),
        Panel(
            "Device error rate by revision",
            "Share of the devices' requests refused, by revision.",
            (
                _q(
                    f"max by (revision) ({n.FLEET_REVISION_ERROR_RATE}{{sel}})",
                    "{{revision}}",
                    FLEET_SEL,
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Device TTFT p95 by revision",
            "The median over a revision's devices of their own TTFT p95.",
            (
                _q(
                    f"max by (revision) ({n.FLEET_REVISION_TTFT_P95_SECONDS}{{sel}})",
                    "{{revision}}",
                    FLEET_SEL,
                ),
            ),
            unit="s",
        ),
        Panel(
            "Device API calls",
            "Calls of the devices to the fleet server, by endpoint and status code (every "
            "fleet's).",
            (
                _q(
                    f"sum by (endpoint, code) (rate({n.FLEET_REQUESTS_TOTAL}[{RATE}]))",
                    "{{endpoint}} {{code}}",
                    FLEET_SEL,
                ),
            ),
            unit="reqps",
            width=24,
        ),
    ),
)

DASHBOARDS = (SERVICE, AUTOSCALING, ROLLOUTS, FLEET)
