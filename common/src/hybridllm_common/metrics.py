"""Prometheus metric names, one place for every component.

Names carry the ``hybridllm_`` prefix and Prometheus base units (``_seconds``,
``_tokens_total``); labels are ``service``, ``tier``, ``pool``, ``revision`` where they
apply. Dashboards, alerts and the autoscaler read these names, so they are constants here
and nowhere else.
"""

from __future__ import annotations

PREFIX = "hybridllm_"

# Request latency histograms (seconds).
TIME_TO_FIRST_TOKEN_SECONDS = "hybridllm_time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN_SECONDS = "hybridllm_time_per_output_token_seconds"
E2E_REQUEST_LATENCY_SECONDS = "hybridllm_e2e_request_latency_seconds"
QUEUE_TIME_SECONDS = "hybridllm_request_queue_time_seconds"

# Token and request counters.
PROMPT_TOKENS_TOTAL = "hybridllm_prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "hybridllm_generation_tokens_total"
REQUESTS_TOTAL = "hybridllm_requests_total"  # label: finish_reason
REQUESTS_REJECTED_TOTAL = "hybridllm_requests_rejected_total"  # label: code
# Requests decoded under a grammar (both runtimes). label: kind (json_object, json_schema,
# regex, choice, grammar, tool_calls).
STRUCTURED_REQUESTS_TOTAL = "hybridllm_structured_requests_total"

# Engine state gauges.
NUM_REQUESTS_RUNNING = "hybridllm_num_requests_running"
NUM_REQUESTS_WAITING = "hybridllm_num_requests_waiting"
KV_BLOCKS_USED = "hybridllm_kv_cache_blocks_used"
KV_BLOCKS_FREE = "hybridllm_kv_cache_blocks_free"

# Engine counters and per-step histograms.
PREFIX_CACHE_QUERIES_TOTAL = "hybridllm_prefix_cache_queries_tokens_total"
PREFIX_CACHE_HITS_TOTAL = "hybridllm_prefix_cache_hits_tokens_total"
PREFIX_CACHE_HIT_RATE = "hybridllm_prefix_cache_hit_rate"
PREEMPTIONS_TOTAL = "hybridllm_preemptions_total"
ENGINE_STEP_FAILURES_TOTAL = "hybridllm_engine_step_failures_total"
ENGINE_REQUESTS_FAILED_TOTAL = "hybridllm_engine_requests_failed_total"
BATCH_SIZE = "hybridllm_engine_step_batch_size"
TOKENS_PER_STEP = "hybridllm_engine_step_tokens"

# Disaggregated serving (cloud runtime, prefill and decode roles).
KV_TRANSFER_BYTES_TOTAL = "hybridllm_kv_transfer_bytes_total"  # label: direction (sent, received)
KV_TRANSFER_SECONDS = "hybridllm_kv_transfer_seconds"  # histogram; label: outcome
KV_TRANSFER_STREAMING_SECONDS = "hybridllm_kv_transfer_streaming_seconds"  # first to last frame
REMOTE_PREFILLS_TOTAL = "hybridllm_prefills_total"  # label: where (remote, local), outcome
KV_TRANSFERS_ACTIVE = "hybridllm_kv_transfers_active"  # gauge; label: role
ENGINE_ROLE_INFO = "hybridllm_engine_role_info"  # gauge = 1; label: role

# Response cache (edge runtime).
RESPONSE_CACHE_HITS_TOTAL = "hybridllm_response_cache_hits_total"
RESPONSE_CACHE_MISSES_TOTAL = "hybridllm_response_cache_misses_total"
RESPONSE_CACHE_ENTRIES = "hybridllm_response_cache_entries"

# Gateway.
GATEWAY_REQUESTS_TOTAL = "hybridllm_gateway_requests_total"  # labels: tier, code
GATEWAY_ROUTE_DECISIONS_TOTAL = "hybridllm_gateway_route_decisions_total"  # label: tier
# Routed requests by what they ask for. labels: tier, kind (text, structured, tools).
GATEWAY_REQUEST_KINDS_TOTAL = "hybridllm_gateway_request_kinds_total"
GATEWAY_UPSTREAM_LATENCY_SECONDS = "hybridllm_gateway_upstream_latency_seconds"
# Each replica's speed as the gateway learned it from its answers (hybridllm_common.speed;
# labels: tier, replica): the fixed cost of an answer (network included), prompt tokens
# per second, the wait each request ahead adds, output seconds per token alone and with
# every slot of a batch of 8 busy, and the answers behind the figures.
GATEWAY_REPLICA_OVERHEAD_SECONDS = "hybridllm_gateway_replica_overhead_seconds"
GATEWAY_REPLICA_PREFILL_TOKENS_PER_SECOND = "hybridllm_gateway_replica_prefill_tokens_per_second"
GATEWAY_REPLICA_WAIT_SECONDS = "hybridllm_gateway_replica_wait_seconds"
GATEWAY_REPLICA_OUTPUT_SECONDS = "hybridllm_gateway_replica_output_token_seconds"
GATEWAY_REPLICA_ANSWERS_TOTAL = "hybridllm_gateway_replica_answers_total"
# How far each answer was from what the learned speed predicted for it just before (actual
# over predicted; labels: tier, term = ttft or tpot): the model's error, term by term.
GATEWAY_PREDICTION_RATIO = "hybridllm_gateway_prediction_ratio"
PREDICTION_RATIO_BUCKETS: tuple[float, ...] = (
    0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0,
)  # fmt: skip
# 1 while a remote tier (across a WAN: a site gateway's cloud tier) answers its probes, 0
# while none of its backends does. label: tier.
GATEWAY_TIER_REACHABLE = "hybridllm_gateway_tier_reachable"

# Latency histogram buckets (seconds) shared by the runtimes.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip

# Gateway only (hybridllm_gateway.metrics)
GATEWAY_ADDED_LATENCY_SECONDS = "hybridllm_gateway_added_latency_seconds"  # time in gateway code
GATEWAY_UPSTREAM_ERRORS_TOTAL = "hybridllm_gateway_upstream_errors_total"  # labels: tier, kind


class UpstreamErrorKind:
    """Values of the ``kind`` label of GATEWAY_UPSTREAM_ERRORS_TOTAL that readers act on."""

    # an attempt that sent no first byte within the gateway's first-byte timeout: the
    # autoscaler reads it as saturation (a pool whose requests all time out answers none)
    TIMEOUT = "timeout"


GATEWAY_EJECTIONS_TOTAL = "hybridllm_gateway_ejections_total"  # label: tier
GATEWAY_CONFIG_RELOADS_TOTAL = "hybridllm_gateway_config_reloads_total"
GATEWAY_OUTSTANDING_REQUESTS = "hybridllm_gateway_outstanding_requests"  # gauge; label: tier
GATEWAY_CASCADES_TOTAL = "hybridllm_gateway_cascades_total"
# The tokens each tier answered (label: tier). Prompt tokens are the gateway's estimate
# (characters / 4, as its router counts them); completion tokens come from the answer's
# usage, or one per streamed event that carries a token (not the finish chunk, the
# usage chunk nor [DONE]).
GATEWAY_PROMPT_TOKENS_TOTAL = "hybridllm_gateway_prompt_tokens_total"
GATEWAY_COMPLETION_TOKENS_TOTAL = "hybridllm_gateway_completion_tokens_total"
# The demand offered to each tier, which the autoscaler sizes its pools by (label: tier):
# counted when a request is routed, before it is answered, so a pool that answers late
# or not at all does not hide its load. Completion tokens are estimated at arrival: the
# mean of the tier's recent answers, capped by the request's max_tokens x n.
GATEWAY_OFFERED_PROMPT_TOKENS_TOTAL = "hybridllm_gateway_offered_prompt_tokens_total"
GATEWAY_OFFERED_COMPLETION_TOKENS_TOTAL = "hybridllm_gateway_offered_completion_tokens_total"
# The part of that demand refused because its tier was unreachable from this gateway (a
# site gateway while its WAN is down; label: tier): the tier's own gateways never saw it.
# The site's agent sends it up in its heartbeats, back-dated to the minute it was offered,
# and the autoscaler adds it to the tier's demand history (docs/sites.md).
GATEWAY_STRANDED_PROMPT_TOKENS_TOTAL = "hybridllm_gateway_stranded_prompt_tokens_total"
GATEWAY_STRANDED_COMPLETION_TOKENS_TOTAL = "hybridllm_gateway_stranded_completion_tokens_total"
# Requests waiting for a replica of a tier scaled to zero (gauge), and those that found
# none (counter): what wakes a pool at zero (label: tier).
GATEWAY_HELD_REQUESTS = "hybridllm_gateway_held_requests"
GATEWAY_COLD_REQUESTS_TOTAL = "hybridllm_gateway_cold_requests_total"
# Per model revision, for the rollout analysis (labels: tier, revision): each upstream
# attempt and whether it failed (result: ok, error; a retried failure still counts), the
# time to first token and the time per output token of answered requests, and each
# revision's weight and healthy backends in the routing table the gateway serves.
GATEWAY_REVISION_ATTEMPTS_TOTAL = "hybridllm_gateway_revision_attempts_total"
GATEWAY_REVISION_TTFT_SECONDS = "hybridllm_gateway_revision_time_to_first_token_seconds"
GATEWAY_REVISION_TPOT_SECONDS = "hybridllm_gateway_revision_time_per_output_token_seconds"
GATEWAY_REVISION_WEIGHT = "hybridllm_gateway_revision_weight"
GATEWAY_REVISION_HEALTHY_BACKENDS = "hybridllm_gateway_revision_healthy_backends"
GATEWAY_REVISION_GOLDEN_PASSED = "hybridllm_gateway_revision_golden_prompt_passed"
# The routing table's generation the gateway serves (the operator bumps it with every
# change of the weights): a rollout step starts once every gateway serves it.
GATEWAY_ROUTING_GENERATION = "hybridllm_gateway_routing_generation"
# Time-per-output-token buckets (seconds): a CPU edge replica decodes at 10-100 ms a token.
TPOT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip

# The control plane (hybridllm_operator.observability.metrics), per LLMService
# (labels: namespace, llmservice) and pool. Replica-denominated series share one unit,
# replicas at the pool's target utilisation.
SERVICE_SLO_TTFT_SECONDS = "hybridllm_service_slo_ttft_seconds"
SERVICE_SLO_TBT_SECONDS = "hybridllm_service_slo_tbt_seconds"
SERVICE_SLO_AVAILABILITY_RATIO = "hybridllm_service_slo_availability_ratio"
AUTOSCALER_DESIRED_REPLICAS = "hybridllm_autoscaler_desired_replicas"
AUTOSCALER_PROVISIONED_REPLICAS = "hybridllm_autoscaler_provisioned_replicas"
AUTOSCALER_READY_REPLICAS = "hybridllm_autoscaler_ready_replicas"
AUTOSCALER_POLICY_REPLICAS = "hybridllm_autoscaler_policy_replicas"  # label: policy
AUTOSCALER_DEMAND_REPLICAS = "hybridllm_autoscaler_demand_replicas"
AUTOSCALER_FORECAST_REPLICAS = "hybridllm_autoscaler_forecast_replicas"  # label: quantile
AUTOSCALER_FORECAST_ERROR_RATIO = "hybridllm_autoscaler_forecast_error_ratio"
AUTOSCALER_CAPACITY_BOUND = "hybridllm_autoscaler_capacity_bound"
AUTOSCALER_METRICS_AVAILABLE = "hybridllm_autoscaler_metrics_available"
AUTOSCALER_DECISION_INFO = "hybridllm_autoscaler_decision_info"  # label: reason
AUTOSCALER_SCALE_EVENTS_TOTAL = "hybridllm_autoscaler_scale_events_total"  # label: direction
AUTOSCALER_REPLICA_SECONDS_TOTAL = "hybridllm_autoscaler_replica_seconds_total"
ROLLOUT_PHASE = "hybridllm_rollout_phase"  # label: phase (1 for the current one)
ROLLOUT_STEP = "hybridllm_rollout_step"
ROLLOUT_STEPS = "hybridllm_rollout_steps"
ROLLOUT_CANARY_WEIGHT = "hybridllm_rollout_canary_weight_percent"  # label: tier
ROLLOUT_ANALYSIS_VALUE = "hybridllm_rollout_analysis_value"  # labels: metric, tier, role
ROLLOUT_ANALYSIS_RESULT = "hybridllm_rollout_analysis_result"  # labels: metric, tier, result

# The edge fleet server (hybridllm_operator.edgefleet.server; labels: fleet, revision, phase).
FLEET_REQUESTS_TOTAL = "hybridllm_fleet_requests_total"
FLEET_REQUEST_SECONDS = "hybridllm_fleet_request_seconds"
FLEET_DEVICES = "hybridllm_fleet_devices"
FLEET_REVISION_DEVICES = "hybridllm_fleet_revision_devices"
FLEET_REVISION_TOKENS_PER_SECOND = "hybridllm_fleet_revision_tokens_per_second"
FLEET_REVISION_ERROR_RATE = "hybridllm_fleet_revision_error_rate"
FLEET_REVISION_TTFT_P95_SECONDS = "hybridllm_fleet_revision_ttft_p95_seconds"
FLEET_PENDING_WRITES = "hybridllm_fleet_pending_writes"
FLEET_REJECTED_TOTAL = "hybridllm_fleet_rejected_total"
FLEET_HEARTBEAT_AGE_SECONDS = "hybridllm_fleet_heartbeat_age_seconds"  # label: quantile
# Prompt tokens a site's gateways refused over the last day because the cloud tier was
# unreachable from the site, as their agents reported once the WAN was back (labels:
# fleet, site): how much a WAN cut cost a site (docs/sites.md)
FLEET_SITE_STRANDED_PROMPT_TOKENS = "hybridllm_fleet_site_stranded_prompt_tokens"
FLEET_API_WRITES_TOTAL = "hybridllm_fleet_api_writes_total"
FLEET_LEADER = "hybridllm_fleet_leader"
FLEET_DIGEST_DEVICES = "hybridllm_fleet_digest_devices"
OPERATOR_LEADER = "hybridllm_operator_leader"
