"""Operator settings, from the environment (HYBRIDLLM_OPERATOR_*) or flags."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from hybridllm_operator.llmservice import builders


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HYBRIDLLM_OPERATOR_")

    namespace: str | None = Field(
        default=None,
        description="Watch only these namespaces (comma-separated); all namespaces when unset.",
    )
    leader_election: bool = Field(
        default=True,
        description="Take the Lease before reconciling, so that of several replicas one acts.",
    )
    lease_name: str = Field(default="hybridllm-operator", description="The Lease's name.")
    lease_namespace: str | None = Field(
        default=None,
        description="The Lease's namespace; unset: the pod's namespace (POD_NAMESPACE, else "
        "its service account's), else default.",
    )
    lease_duration_seconds: float = Field(
        default=15.0, gt=0, description="How long a leader that stopped renewing keeps the Lease."
    )
    renew_deadline_seconds: float = Field(
        default=10.0, gt=0, description="A leader that could not renew this long steps down."
    )
    retry_period_seconds: float = Field(
        default=2.0, gt=0, description="How often standbys try the Lease and the leader renews."
    )
    edge_image: str = Field(default=builders.Images.edge, description="Default edge runtime image.")
    cloud_image: str = Field(
        default=builders.Images.cloud, description="Default cloud runtime image."
    )
    gateway_image: str = Field(
        default=builders.Images.gateway, description="Default gateway image."
    )
    max_workers: int = Field(
        default=8, ge=1, description="Threads running reconciliations at once."
    )
    resync_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="Reconcile every LLMService this often even without an event (a safety "
        "net for an event lost while a watch reconnected).",
    )

    metrics_address: str | None = Field(
        default=None,
        pattern=r"^[^:]*:[0-9]{1,5}$",
        description="Serve the control plane's Prometheus metrics (/metrics) on host:port, "
        "e.g. 0.0.0.0:8081; unset: not served. docs/metrics.md lists them.",
    )
    prometheus_url: str | None = Field(
        default=None,
        description="Prometheus server the autoscaler reads demand from (its gateway series "
        "labelled namespace and llmservice); unset: it reads each gateway pod's /metrics.",
    )
    prometheus_rate_window_seconds: float = Field(
        default=60.0,
        ge=1.0,
        le=3600.0,
        description="The window of the rate() queries (at least two scrape intervals).",
    )
    forecast_bin_seconds: float = Field(
        default=60.0,
        ge=1.0,
        le=3600.0,
        description="Width of the demand history's bins that the autoscaler forecasts from.",
    )
    forecast_season_seconds: float = Field(
        default=86_400.0,
        ge=60.0,
        le=7 * 86_400.0,
        description="The period over which demand repeats, which the seasonal forecast "
        "learns: a day. A time-compressed replay (a day played in minutes) sets the "
        "compressed day.",
    )
    forecast_model: str = Field(
        default="holt-winters",
        pattern="^(last|seasonal|holt-winters|gbm)$",
        description="The forecaster's model for predictive and hybrid autoscaling.",
    )

    def images(self) -> builders.Images:
        return builders.Images(
            edge=self.edge_image, cloud=self.cloud_image, gateway=self.gateway_image
        )
