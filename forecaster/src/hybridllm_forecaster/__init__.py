"""hybridllm forecaster: demand forecasting, capacity planning and a scaling simulator.

The operator needs only `plan_replicas` with a `DemandSeries` and a `PoolConfig`; the
rest (loaders, models, simulators, `hybridllm forecast eval`) is for checking the plan.
"""

from hybridllm_forecaster.capacity import DEFAULT_POOLS, CapacityModel, PoolConfig, Slo
from hybridllm_forecaster.errors import TraceFormatError
from hybridllm_forecaster.loaders import detect_format, load_demand, load_requests
from hybridllm_forecaster.planner import Plan, PlannerState, plan_replicas
from hybridllm_forecaster.stream import DemandSeries, RequestStream

__all__ = [
    "DEFAULT_POOLS",
    "CapacityModel",
    "DemandSeries",
    "Plan",
    "PlannerState",
    "PoolConfig",
    "RequestStream",
    "Slo",
    "TraceFormatError",
    "detect_format",
    "load_demand",
    "load_requests",
    "plan_replicas",
]
