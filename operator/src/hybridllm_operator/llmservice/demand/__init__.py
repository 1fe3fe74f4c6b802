"""Each tier's demand as the autoscaler reads it: from Prometheus, or from the gateways.

The gateway counts the demand offered to every tier, on each request's arrival
(``hybridllm_gateway_offered_prompt_tokens_total``,
``hybridllm_gateway_offered_completion_tokens_total``, by ``tier``; completion tokens
estimated from the tier's recent answers), the requests in flight to each tier and the
time to first token. Those are the demand: pods that are not Ready get no traffic from
the gateway, so nothing a starting replica reports (its model load, its warm-up) is ever
counted as load. Offered, not answered: a pool short of replicas answers late, or at its
capacity, and a history of answers would teach the forecast yesterday's lag.

Two sources give the same `Snapshot`:

- `PrometheusDemand` asks a Prometheus server over its HTTP API (the operator's
  ``prometheusUrl`` setting). The gateway's series must carry the labels ``namespace``
  and ``llmservice`` (the LLMService's name; the chart's scrape config relabels them from
  the pod's namespace and its ``app.kubernetes.io/instance`` label). The history the
  forecast needs comes from a range query, so a restarted operator has it at once.
- `GatewayScrape` reads the gateways' ``/metrics`` itself (local mode, or a cluster
  without Prometheus): rates from the counters' increase between two scrapes, summed over
  the gateway replicas, and the history in bins it accumulates in memory.

A value that cannot be trusted is left out, with the reason in ``Snapshot.problems``:
no series yet, a NaN, a gateway that did not answer (a sum missing one replica would look
like a drop in load), a counter seen for the first time. The autoscaler holds on those.

Where each part lives:

- :mod:`~hybridllm_operator.llmservice.demand.common`: what every reader gives (``Snapshot``,
  ``TierDemand``, the ``DemandSource`` interface), the tiers and series names, and
  ``histogram_quantile``;
- :mod:`~hybridllm_operator.llmservice.demand.prometheus`: ``PrometheusDemand``, the
  ``PrometheusBatch`` of queries every LLMService's reader shares, and one query
  (``prometheus_get``, ``PrometheusError``);
- :mod:`~hybridllm_operator.llmservice.demand.gateway`: ``GatewayScrape``, its history ``Bins``, one
  scrape of a gateway (``scrape``, over a kept connection) and its parsing
  (``parse_gateway_metrics``).

Every name is re-exported here: ``from hybridllm_operator.llmservice import demand`` and
``demand.NAME``.
"""

from __future__ import annotations

from hybridllm_operator.llmservice.demand.common import (
    HTTP_TIMEOUT_S,
    OFFERED_COMPLETION,
    OFFERED_PROMPT,
    TIERS,
    TTFT_QUANTILE,
    DemandSource,
    Snapshot,
    StrandedMinute,
    TierDemand,
    WithStranded,
    add_stranded,
    histogram_quantile,
)
from hybridllm_operator.llmservice.demand.gateway import (
    SCRAPE_POOLS,
    Bins,
    GatewayScrape,
    _increase,
    _Sample,
    _scrapes,
    parse_gateway_metrics,
    scrape,
)
from hybridllm_operator.llmservice.demand.prometheus import (
    BATCH_BY,
    BATCH_SELECTOR,
    EVAL_QUANTUM_S,
    MAX_RANGE_POINTS,
    PrometheusBatch,
    PrometheusDemand,
    PrometheusError,
    _http_get,
    _index,
    prometheus_get,
)

# Names other modules and tests know from here; the private ones are re-exported too.
__all__ = [
    "BATCH_BY",
    "BATCH_SELECTOR",
    "EVAL_QUANTUM_S",
    "HTTP_TIMEOUT_S",
    "MAX_RANGE_POINTS",
    "OFFERED_COMPLETION",
    "OFFERED_PROMPT",
    "SCRAPE_POOLS",
    "TIERS",
    "TTFT_QUANTILE",
    "Bins",
    "DemandSource",
    "GatewayScrape",
    "PrometheusBatch",
    "PrometheusDemand",
    "PrometheusError",
    "Snapshot",
    "StrandedMinute",
    "TierDemand",
    "WithStranded",
    "_Sample",
    "_http_get",
    "_increase",
    "_index",
    "_scrapes",
    "add_stranded",
    "histogram_quantile",
    "parse_gateway_metrics",
    "prometheus_get",
    "scrape",
]
