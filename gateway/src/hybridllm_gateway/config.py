"""The routing table the operator renders, the gateway's own settings, and hot reload.

The routing table is the ConfigMap key ``routing.json`` written by
``hybridllm_operator.llmservice.builders.build_routing_config``; its model (:class:`RoutingConfig`,
re-exported here) is ``hybridllm_common.routing``, the one the operator writes with. Unknown
keys are ignored with a warning so that a newer operator does not stop an older gateway
from reloading.

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
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hybridllm_common import termination

# the routing table: one model, shared with the operator that writes it
from hybridllm_common.routing import (
    Backend,
    Balance,
    Cascade,
    EdgeLimits,
    GoldenPrompt,
    Minimize,
    Objective,
    Policy,
    RateLimits,
    RoutingConfig,
    SessionAffinity,
    Tier,
    TierPrices,
)
from hybridllm_common.routing import parse as parse_routing

log = logging.getLogger(__name__)


__all__ = [
    "Backend",
    "Balance",
    "Cascade",
    "EdgeLimits",
    "FileWatcher",
    "FilterConfig",
    "GatewaySettings",
    "GoldenPrompt",
    "Minimize",
    "Objective",
    "Policy",
    "RateLimits",
    "RoutingConfig",
    "SessionAffinity",
    "Tier",
    "TierPrices",
    "load_routing",
    "parse_routing",
]


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
    tls_cert_file: Path | None = Field(
        default=None,
        description="Serve HTTPS with this certificate chain (PEM; with --tls-key-file): a "
        "cloud gateway that site gateways reach across a WAN. Default: plain HTTP.",
    )
    tls_key_file: Path | None = Field(default=None, description="The certificate's key (PEM).")
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

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewaySettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        return self


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
