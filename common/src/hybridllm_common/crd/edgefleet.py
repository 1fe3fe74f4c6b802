"""The EdgeFleet kind: a group of devices outside the cluster, its enrollment rules, its
config and its staged rollouts (the EdgeDevice kind is ``edgedevice.py``)."""

from __future__ import annotations

import ipaddress
from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field, field_validator, model_validator

from hybridllm_common.crd.base import CIDR_PATTERN, _Model, _sub, cel
from hybridllm_common.crd.policies import RolloutWindow
from hybridllm_common.crd.service import Condition


class OfflineDevices(StrEnum):
    """What a fleet rollout does with a wave's devices that stopped reporting."""

    wait = "wait"
    skip = "skip"
    fail = "fail"


class FleetWave(_Model):
    """One batch of a fleet rollout: the devices it takes, by label and by number."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.count) && has(self.percent))",
                    "set count or percent, not both",
                ),
            ]
        }
    )

    match_labels: dict[str, str] | None = Field(
        default=None, description="Only devices with these labels (default: any device)."
    )
    count: int | None = Field(
        default=None, ge=1, le=1_000_000, description="At most this many devices."
    )
    percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="At most this share of the fleet's devices (rounded up).",
    )

    @model_validator(mode="after")
    def _one_size(self) -> FleetWave:
        if self.count is not None and self.percent is not None:
            raise ValueError("set count or percent, not both")
        return self


class WaveWindow(RolloutWindow):
    """When each wave of a fleet rollout may start. The fleet server plans each wave's
    start from the demand of that wave's own devices (the requests their heartbeats
    report, by time of day) and the schedule, shows it in status.rollout.waveStartsAt,
    and starts the wave then (or at once with `hybridllm fleet start`)."""

    below_peak_percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Start a wave only where its own devices' forecast demand (each time of "
        "day's P90 over their reported requests, up to a week) stays under this percent of "
        "their day's P90 peak for updateTimeoutSeconds. Needs a whole day of their "
        "history, kept by the fleet server since it started; until then the schedule "
        "alone decides.",
    )
    max_delay_seconds: int = Field(
        default=86_400,
        ge=0,
        le=7 * 86_400,
        description="The longest a wave waits for its window; then it starts regardless.",
    )


class FleetRollout(_Model):
    """How a new revision reaches the devices: wave by wave, each judged before the next."""

    waves: list[FleetWave] = Field(
        default_factory=list,
        max_length=20,
        description=(
            "Batches, in order. Devices no wave takes are updated in a last wave of their "
            "own; no waves: every device in one wave."
        ),
    )
    success_threshold: int = Field(
        default=100,
        ge=1,
        le=100,
        description=(
            "Percent of a wave's devices that must run the new revision and pass its health "
            "check before the next wave starts."
        ),
    )
    update_timeout_seconds: int = Field(
        default=900,
        ge=30,
        le=86_400,
        description="A device that has not reported the new revision this long after it was "
        "sent counts as failed.",
    )
    offline_devices: OfflineDevices = Field(
        default=OfflineDevices.skip,
        description=(
            "A wave device that stops reporting: wait for it, skip it (it updates when it "
            "comes back) or count it as failed."
        ),
    )
    auto_rollback: bool = Field(
        default=True,
        description="A wave below the threshold sends the previous config back to every device.",
    )
    window: WaveWindow | None = Field(
        default=None,
        description="When each wave may start (default: as soon as the one before it passed).",
    )


class FleetEnrollment(_Model):
    """How devices join: an invitation per device (`hybridllm fleet invite`: single use,
    expiring, labels set by an administrator, approved), or the fleet's bootstrap token
    (expiring; approval by hand, or by rule with the token's own labels)."""

    token_secret: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        max_length=253,
        description=(
            "Secret (same namespace) holding the fleet's bootstrap token: key `token`, and "
            "optionally `expiration` (RFC 3339; refused after it) and `labels` (k=v,...: the "
            "labels an auto-approved device gets); default `<fleet>-bootstrap`."
        ),
    )
    auto_approve: bool = Field(
        default=False,
        description=(
            "Approve a device that enrolls with the bootstrap token at once (else: `hybridllm "
            "fleet approve`). It then gets the labels of the token's Secret, never labels of "
            "its own choosing: a device asking for others is refused."
        ),
    )
    endpoint_networks: list[Annotated[str, Field(pattern=CIDR_PATTERN, max_length=49)]] | None = (
        Field(
            default=None,
            max_length=32,
            description=(
                "Networks (CIDRs, e.g. 10.20.0.0/16) a device's endpoint address must be in: the "
                "gateways send tenants' prompts there. Unset: any IP address but loopback, "
                "link-local (the cloud metadata address), unspecified and multicast ones. A host "
                "name is always refused (it could name a Service inside the cluster)."
            ),
        )
    )

    plain_http_endpoints: bool = Field(
        default=False,
        description=(
            "Let devices report plain `http://` endpoints. Off: an endpoint must be `https`, "
            "and the gateways verify the device's certificate (issued by the fleet server; "
            "the agent asks for it and renews it). On: for agents that predate certificates, "
            "on a site network trusted as it is; prompts then cross it unencrypted."
        ),
    )

    @field_validator("endpoint_networks")
    @classmethod
    def _networks(cls, value: list[str] | None) -> list[str] | None:
        for text in value or []:
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError as exc:
                raise ValueError(f"endpointNetworks: {exc}") from exc
        return value


class HealthCheck(_Model):
    """The golden prompt a device asks its new runtime before switching to it."""

    prompt: str = Field(
        default="What is the capital of France? Answer in one word.",
        min_length=1,
        max_length=4096,
        description="Sent as one user message, greedy decoding.",
    )
    expect: str | None = Field(
        default=None,
        max_length=1024,
        description="Python regular expression the answer must contain (default: any "
        "non-empty answer).",
    )
    max_tokens: int = Field(default=16, ge=1, le=1024, description="Tokens to generate.")
    timeout_seconds: int = Field(
        default=300,
        ge=5,
        le=3600,
        description="Time for the new runtime to load its model and answer.",
    )


class FleetSites(_Model):
    """The fleet's devices grouped into sites by a label; each site may have gateways of
    its own (agents started with ``--site-gateway``) that answer from the site's devices
    and send what needs the cloud across the WAN."""

    label: str = Field(
        default="site",
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="The device label whose value names a device's site.",
    )
    cloud_url: str = Field(
        alias="cloudURL",
        max_length=253,
        pattern=r"^https://[^\s/?#]+/?$",
        description=(
            "The cloud gateway as the sites reach it across the WAN: an `https` URL (tenant "
            "traffic never crosses the WAN in clear), verified against the site gateway's "
            "trusted CAs. Site gateways send it what their site's edge may not answer."
        ),
    )


class EdgeFleetSpec(_Model):
    """A fleet of edge devices outside the cluster that pull their config from the fleet server."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.maxUnavailable <= self.expectedDevices || self.expectedDevices == 0",
                    "maxUnavailable must not exceed expectedDevices",
                    ".maxUnavailable",
                ),
            ]
        }
    )

    service: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="Name of the LLMService (same namespace) whose edge model the devices serve.",
    )
    selector: dict[str, str] | None = Field(
        default=None, description="Device labels that make a device a member."
    )
    expected_devices: int = Field(
        default=0, ge=0, le=1_000_000, description="Devices expected to report (0: any)."
    )
    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=1_000_000,
        description="Devices of a wave that may be updating at the same time.",
    )
    heartbeat_timeout_seconds: int = Field(
        default=120,
        ge=10,
        le=86_400,
        description="A device with no heartbeat for this long counts as offline.",
    )
    config_poll_seconds: int = Field(
        default=30,
        ge=5,
        le=3600,
        description="How long a device's config request waits for a change (long poll); "
        "devices send a heartbeat at a third of the heartbeat timeout.",
    )
    config_valid_seconds: int = Field(
        default=86_400,
        ge=60,
        le=31_536_000,
        description="A signed config older than this is refused by devices (they keep "
        "running what they have).",
    )
    sites: FleetSites | None = Field(
        default=None,
        description="Sites: devices grouped by a label, each with a gateway of its own "
        "(docs/sites.md). Absent: no site gateway is served a routing table.",
    )
    enrollment: FleetEnrollment = _sub(FleetEnrollment, "How devices join.")
    rollout: FleetRollout = _sub(FleetRollout, "How a new revision reaches the devices.")
    health_check: HealthCheck = _sub(HealthCheck, "Golden prompt checked before a switch.")


class FleetRolloutPhase(StrEnum):
    Progressing = "Progressing"
    Completed = "Completed"
    RolledBack = "RolledBack"
    Stopped = "Stopped"


class FleetRolloutStatus(_Model):
    """Where the fleet's rollout is: its revisions, its wave, its failures."""

    phase: FleetRolloutPhase = Field(description="Progressing, Completed, RolledBack, Stopped.")
    from_revision: str | None = Field(default=None, description="Revision devices ran before.")
    to_revision: str = Field(description="Revision being rolled out.")
    to_content_sha256: str = Field(
        description="sha256 of the config being rolled out (a rolled-back one is not tried "
        "again until the service asks for another)."
    )
    wave: int = Field(default=0, ge=0, description="Current wave (0-based).")
    waves: int = Field(default=1, ge=1, description="Waves in this rollout.")
    wave_started_at: float | None = Field(default=None, description="Unix time the wave began.")
    wave_starts_at: float | None = Field(
        default=None,
        description="Unix time the current wave is planned to send its first device the new "
        "config (spec.rollout.window); unset once it did, or without a window.",
    )
    started_at: float | None = Field(default=None, description="Unix time the rollout began.")
    failed_devices: list[str] = Field(
        default_factory=list, max_length=100, description="Devices that failed the update."
    )
    message: str = Field(default="", description="What happened last, for people.")


class FleetConfig(_Model):
    """One config the fleet hands out: what it runs, and the version it was signed at."""

    revision: str = Field(description="Model revision.")
    version: int = Field(ge=1, description="Monotonic config version.")
    content: str = Field(description="The config's fields, JSON (what the signature covers).")


class SiteStatus(_Model):
    """One site as the fleet server last saw it."""

    name: str = Field(max_length=63, description="The site (its devices' label value).")
    devices: int = Field(default=0, ge=0, description="Approved member devices at the site.")
    ready_devices: int = Field(
        default=0, ge=0, description="Of them, online and serving the current revision."
    )
    gateways: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Online devices serving the site's gateway (their reported address).",
    )
    stranded_prompt_tokens: float = Field(
        default=0.0,
        ge=0,
        description="Prompt tokens the site's gateways refused over the last day because the "
        "cloud tier was unreachable from the site (reported once the WAN was back).",
    )


STRANDED_BIN_S = 60  # the minutes a site's stranded demand is counted in
STRANDED_KEEP_S = 86_400  # how far back the fleet's status keeps it


class StrandedBin(_Model):
    """One minute of the demand the fleet's site gateways refused because the cloud tier
    was unreachable from their site (``hybridllm_gateway_stranded_*_tokens_total``)."""

    start: int = Field(ge=0, description="The minute's start, in Unix seconds.")
    prompt_tokens: float = Field(ge=0, le=1e12, description="Prompt tokens offered (estimated).")
    completion_tokens: float = Field(
        ge=0, le=1e12, description="Completion tokens offered (estimated from recent answers)."
    )


class EdgeFleetStatus(_Model):
    """Devices as the fleet server last saw them."""

    observed_generation: int | None = Field(
        default=None, description="Spec generation last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=16, description="Ready, Progressing, Degraded."
    )
    devices: int = Field(default=0, description="Approved devices that are members.")
    ready_devices: int = Field(
        default=0, description="Devices with a recent heartbeat serving the current revision."
    )
    updated_devices: int = Field(default=0, description="Devices on the current revision.")
    offline_devices: int = Field(default=0, description="Devices with no recent heartbeat.")
    pending_devices: int = Field(default=0, description="Enrollment requests awaiting approval.")
    revisions: dict[str, int] = Field(
        default_factory=dict, description="Devices reporting each revision."
    )
    oldest_heartbeat_seconds: float | None = Field(
        default=None, description="Age of the stalest heartbeat among online devices."
    )
    current_revision: str | None = Field(default=None, description="Revision the fleet should run.")
    config_version: int = Field(default=0, ge=0, description="Last config version issued.")
    config: FleetConfig | None = Field(default=None, description="Config of the current revision.")
    previous_config: FleetConfig | None = Field(
        default=None, description="Config devices ran before the rollout (for rollback)."
    )
    rollout: FleetRolloutStatus | None = Field(default=None, description="The fleet's rollout.")
    sites: list[SiteStatus] = Field(
        default_factory=list, max_length=1000, description="Each site (with spec.sites)."
    )
    stranded_demand: list[StrandedBin] = Field(
        default_factory=list,
        max_length=STRANDED_KEEP_S // STRANDED_BIN_S,
        description=(
            "The cloud-bound demand the sites' gateways refused while the cloud tier was "
            "unreachable from them, by minute, over the last day (minutes with none left "
            "out): their agents send it once the WAN is back, and the autoscaler of the "
            "fleet's LLMService adds it to its cloud tier's demand history."
        ),
    )
    rollout_summary: str | None = Field(default=None, description="Rollout, for kubectl get.")
    signing_key_id: str | None = Field(
        default=None, description="Fingerprint of the key configs are signed with."
    )
    device_ca: str | None = Field(
        default=None,
        alias="deviceCA",
        max_length=4096,
        description=(
            "The fleet's CA certificate (PEM), made from its signing key: it signs each "
            "device's TLS certificate, and the gateways verify devices with it."
        ),
    )
