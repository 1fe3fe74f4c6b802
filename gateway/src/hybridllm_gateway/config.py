"""The routing table the operator renders, the gateway's own settings, and hot reload.

The routing table is the ConfigMap key ``routing.json`` written by
``hybridllm_operator.builders.build_routing_config``; :class:`RoutingConfig` parses exactly
that shape (camelCase on the wire). Unknown keys are ignored with a warning so that a newer
operator does not stop an older gateway from reloading.

Kubernetes updates a mounted ConfigMap by swapping a symlink (``..data``), so the file's
inode changes while its path stays. :class:`FileWatcher` polls ``os.stat`` (following
links) once a second and compares ``(st_ino, st_mtime_ns, st_size)``; polling one stat a
second costs nothing and works the same on every filesystem, where inotify does not see
symlink swaps made by the kubelet. A new table replaces the old one in one attribute
assignment: requests in flight keep the objects they already hold, so none is dropped. A
table that fails to parse is logged and the old one stays.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from hybridllm_common import termination

log = logging.getLogger(__name__)


class _Wire(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


class Policy(StrEnum):
    auto = "auto"
    edge_first = "edge-first"
    cloud_first = "cloud-first"
    edge_only = "edge-only"
    cloud_only = "cloud-only"


class Backend(_Wire):
    url: str = Field(min_length=1)
    revision: str = ""
    weight: int = Field(default=100, ge=0, le=1_000_000)
    # an enrolled device outside the cluster: never sent the backend token, which opens
    # the service's runtimes (hybridllm_common.backend_auth)
    device: bool = False


class Tier(_Wire):
    backends: list[Backend] = Field(default_factory=list)
    # The tier's pools may be at zero replicas (minReplicas 0): a request that finds no
    # replica waits for one (the autoscaler sees it waiting and starts one).
    scale_from_zero: bool = False
    # Across a WAN from this gateway (a site gateway's cloud tier): its backends are probed
    # every ``probe_interval_s``, and while none answers, a request that needs the tier is
    # refused at once (503 tier_unreachable) rather than waiting on a link that is down.
    remote: bool = False


class EdgeLimits(_Wire):
    max_prompt_tokens: int = Field(default=2048, ge=1)
    max_output_tokens: int = Field(default=512, ge=1)
    max_queue_depth: int = Field(default=8, ge=0)


class SessionAffinity(_Wire):
    enabled: bool = True
    header: str = "x-session-id"


class Cascade(_Wire):
    enabled: bool = False
    min_mean_logprob: float = -1.5


class Balance(_Wire):
    enabled: bool = False
    margin: int = Field(default=1, ge=0)


class Minimize(StrEnum):
    latency = "latency"
    cost = "cost"


class TierPrices(_Wire):
    edge: float | None = Field(default=None, ge=0)
    cloud: float | None = Field(default=None, ge=0)


class Objective(_Wire):
    """Route by prediction (predict.py): the tier whose predicted answer comes first
    (latency), or the cheapest whose predicted first token meets the SLO (cost)."""

    minimize: Minimize = Minimize.latency
    cost_per_million_tokens: TierPrices = Field(default_factory=TierPrices)

    @model_validator(mode="after")
    def _prices(self) -> Objective:
        prices = self.cost_per_million_tokens
        if self.minimize == Minimize.cost and (prices.edge is None or prices.cloud is None):
            raise ValueError("objective minimize: cost needs costPerMillionTokens for both tiers")
        return self


class RateLimits(_Wire):
    requests_per_minute: int = Field(default=600, ge=1)
    tokens_per_minute: int = Field(default=200_000, ge=1)


class GoldenPrompt(_Wire):
    """A question a new revision's backends must answer right (``expect``: a regular
    expression, any case) before the rollout moves traffic to it."""

    prompt: str = Field(min_length=1)
    expect: str = Field(min_length=1)
    max_tokens: int = Field(default=32, ge=1)


class RoutingConfig(_Wire):
    service: str = ""
    namespace: str = ""
    model: str = ""
    revision: str = ""
    generation: int = Field(default=0, ge=0)  # bumped by the operator with every new weight
    policy: Policy = Policy.auto
    edge_limits: EdgeLimits = Field(default_factory=EdgeLimits)
    session_affinity: SessionAffinity = Field(default_factory=SessionAffinity)
    cascade: Cascade = Field(default_factory=Cascade)
    balance: Balance = Field(default_factory=Balance)
    objective: Objective | None = None
    slo_ttft_seconds: float = Field(default=1.0, gt=0)
    rate_limits: RateLimits = Field(default_factory=RateLimits)
    golden_prompts: list[GoldenPrompt] = Field(default_factory=list)
    tiers: dict[str, Tier] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_tiers(self) -> RoutingConfig:
        unknown = set(self.tiers) - {"edge", "cloud"}
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}: only edge and cloud exist")
        if not any(t.backends for t in self.tiers.values()):
            raise ValueError("no tier has a backend")
        return self

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


def parse_routing(data: dict[str, Any]) -> RoutingConfig:
    known = set(RoutingConfig.model_fields) | {
        f.alias for f in RoutingConfig.model_fields.values() if f.alias
    }
    extra = sorted(set(data) - known)
    if extra:
        log.warning("routing config: ignoring unknown keys %s", extra)
    return RoutingConfig.model_validate(data)


def load_routing(path: Path) -> RoutingConfig:
    import json

    return parse_routing(json.loads(path.read_text()))


class FilterConfig(BaseModel):
    """The sensitive-content filter (a JSON file given by ``--filter-config``)."""

    model_config = ConfigDict(extra="forbid")

    mode: str = Field(default="off", pattern="^(off|block|redact)$")
    pii: list[str] = Field(
        default_factory=lambda: ["email", "credit_card", "us_ssn", "phone", "iban"],
        description="Built-in PII patterns to look for.",
    )
    deny: list[str] = Field(default_factory=list, description="Words or phrases, any case.")
    patterns: dict[str, str] = Field(default_factory=dict, description="Extra named regexes.")


class GatewaySettings(BaseModel):
    """Process settings (flags of ``hybridllm-gateway serve``)."""

    model_config = ConfigDict(extra="forbid")

    config: Path
    host: str = "0.0.0.0"
    port: int = 8000
    workers: int = Field(default=1, ge=1, le=64)
    api_keys_file: Path | None = None
    filter_config: Path | None = None
    classifier: Path | None = None
    reload_interval_s: float = Field(default=1.0, gt=0)
    connect_timeout_s: float = Field(
        default=5.0, gt=0, description="Above the 1 s + 3 s SYN retries."
    )
    first_byte_timeout_s: float = Field(default=60.0, gt=0)
    request_timeout_s: float = Field(default=float(termination.MAX_REQUEST_SECONDS), gt=0)
    max_attempts: int = Field(default=3, ge=1, le=10)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    max_tokens_limit: int = Field(default=32_768, ge=1)
    max_upstream_body_bytes: int = Field(
        default=64 << 20,
        ge=1 << 16,
        description="An upstream answer the gateway holds whole (not streamed, or an error) "
        "past this many bytes is refused as that replica's fault: a backend cannot fill the "
        "gateway's memory. Streams pass through at the client's pace and are not capped.",
    )
    eject_after_failures: int = Field(default=3, ge=1)
    eject_base_s: float = Field(default=5.0, gt=0)
    eject_max_s: float = Field(default=60.0, gt=0)
    prefix_chars: int = Field(
        default=256, ge=1, description="Prompt characters hashed for affinity."
    )
    load_factor: float = Field(default=1.25, ge=1.0, description="Bound on a replica's share.")
    upstream_connections: int = Field(
        default=4096, ge=1, description="Connection limit of the non-streaming upstream client."
    )
    hold_timeout_s: float = Field(
        default=240.0,
        gt=0,
        description="How long a request waits for a replica of a tier scaled to zero.",
    )
    max_held_requests: int = Field(
        default=256, ge=0, description="Requests that may wait so, per tier; beyond: 503."
    )
    probe_interval_s: float = Field(
        default=2.0, gt=0, description="How often the backends of a remote tier are probed."
    )
    probe_timeout_s: float = Field(
        default=1.0, gt=0, description="A probe of a remote tier's backend answered later fails."
    )
    unreachable_after: int = Field(
        default=2,
        ge=1,
        description="Failed probes in a row that make a remote backend unreachable.",
    )
    stream_relay: str = Field(
        default="raw",
        pattern="^(raw|aiohttp)$",
        description="Streaming path: raw (protocol-level relay) or aiohttp (generic client).",
    )


def file_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class FileWatcher:
    """Calls ``on_change(path)`` whenever the file at ``path`` is replaced or rewritten."""

    def __init__(self, path: Path, on_change: Callable[[Path], None], interval_s: float) -> None:
        self.path, self.on_change, self.interval_s = path, on_change, interval_s
        self.key = file_key(path)
        self.num_reloads = 0

    def check(self) -> bool:
        key = file_key(self.path)
        if key is None or key == self.key:
            return False
        self.key = key
        try:
            self.on_change(self.path)
        except (ValidationError, ValueError, OSError) as exc:
            log.error("keeping the previous %s: the new one is invalid: %s", self.path, exc)
            return False
        self.num_reloads += 1
        log.info("reloaded %s", self.path)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()
