"""hybridllm forecaster: demand forecasting, capacity planning and a scaling simulator.

The operator needs only `plan_replicas` with a `DemandSeries` and a `PoolConfig`; the
rest (loaders, models, simulators, `hybridllm forecast eval`) is for checking the plan.
"""

from typing import TYPE_CHECKING, Any

from hybridllm_forecaster.capacity import DEFAULT_POOLS, CapacityModel, PoolConfig, Slo
from hybridllm_forecaster.errors import TraceFormatError
from hybridllm_forecaster.planner import Plan, PlannerState, plan_replicas
from hybridllm_forecaster.stream import DemandSeries, RequestStream

if TYPE_CHECKING:
    from hybridllm_forecaster.loaders import detect_format, load_demand, load_requests

# The trace loaders need pandas (about 45 MB of a process's memory): they are imported
# when first asked for, so the operator, which reads no trace files, never loads it.
_LOADERS = ("detect_format", "load_demand", "load_requests")


def __getattr__(name: str) -> Any:
    if name in _LOADERS:
        from hybridllm_forecaster import loaders

        return getattr(loaders, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
