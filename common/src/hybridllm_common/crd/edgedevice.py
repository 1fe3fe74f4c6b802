"""The EdgeDevice kind: one device outside the cluster, as it enrolled and as its fleet
server last saw it."""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field, model_validator

from hybridllm_common.crd.base import _Model, _sub, cel


class DeviceFacts(_Model):
    """What a device says about itself when it enrolls."""

    cpus: int | None = Field(default=None, ge=1, description="CPU cores.")
    memory_bytes: int | None = Field(default=None, ge=0, description="Memory.")
    accelerator: str | None = Field(default=None, max_length=128, description="GPU/NPU, if any.")
    arch: str | None = Field(default=None, max_length=32, description="CPU architecture.")
    os: str | None = Field(default=None, max_length=128, description="Operating system.")
    agent_version: str | None = Field(default=None, max_length=64, description="Agent version.")


class DeviceInvite(_Model):
    """An administrator's invitation to one device: the hash of its single-use token."""

    token_sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="SHA-256 (hex) of the invitation token."
    )
    expires: float = Field(gt=0, description="Unix time after which the token is refused.")
    used: bool = Field(
        default=False, description="The device enrolled with it (a token is good for one key)."
    )


class EdgeDeviceSpec(_Model):
    """A device outside the cluster: its identity, its facts and whether it may serve."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.publicKey) || has(self.invite)",
                    "a device has a publicKey (enrolled) or an invite (not yet)",
                ),
            ]
        }
    )

    fleet: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63, description="EdgeFleet name."
    )
    public_key: str | None = Field(
        default=None,
        min_length=44,
        max_length=44,
        description="The device's Ed25519 public key (base64); unset while it is invited.",
    )
    invite: DeviceInvite | None = Field(
        default=None,
        description="A pending invitation (`hybridllm fleet invite`): used up by the device's "
        "enrollment, which sets publicKey.",
    )
    approved: bool = Field(default=False, description="May fetch configs and serve.")
    revoked: bool = Field(default=False, description="Refused on every call from now on.")
    facts: DeviceFacts = _sub(DeviceFacts, "Reported at enrollment.")

    @model_validator(mode="after")
    def _identity(self) -> EdgeDeviceSpec:
        if self.public_key is None and self.invite is None:
            raise ValueError("a device has a publicKey (enrolled) or an invite (not yet)")
        return self


class DevicePhase(StrEnum):
    Pending = "Pending"
    Approved = "Approved"
    Ready = "Ready"
    Updating = "Updating"
    Offline = "Offline"
    Revoked = "Revoked"


class EdgeDeviceStatus(_Model):
    """The device as the fleet server last saw it (written when something changes)."""

    phase: DevicePhase = Field(default=DevicePhase.Pending, description="Lifecycle phase.")
    revision: str | None = Field(default=None, description="Revision it serves.")
    config_version: int | None = Field(default=None, description="Config version it runs.")
    assigned_version: int | None = Field(default=None, description="Config version it was sent.")
    assigned_wave: int | None = Field(default=None, description="Rollout wave it was sent in.")
    assigned_at: float | None = Field(default=None, description="Unix time it was sent.")
    failed_version: int | None = Field(
        default=None, description="Config version it could not start."
    )
    endpoint: str | None = Field(default=None, description="URL the gateway reaches it at.")
    healthy: bool = Field(default=False, description="Its runtime answers.")
    last_seen: float | None = Field(
        default=None, description="Unix time of a heartbeat (written on changes only)."
    )
    message: str = Field(default="", description="Last error or event, for people.")
