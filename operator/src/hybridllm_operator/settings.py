"""Operator settings, from the environment (HYBRIDLLM_OPERATOR_*) or flags."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from hybridllm_operator import builders


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HYBRIDLLM_OPERATOR_")

    namespace: str | None = Field(
        default=None, description="Watch only this namespace; all namespaces when unset."
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

    def images(self) -> builders.Images:
        return builders.Images(
            edge=self.edge_image, cloud=self.cloud_image, gateway=self.gateway_image
        )
