"""How a device earns its place in a fleet: the credentials it enrolls with and the labels
it gets, checked before the fleet server writes anything.

Two credentials, as device fleets usually offer (one per device, one per group):

- an **invitation** (``hybridllm fleet invite FLEET NAME``): an EdgeDevice the
  administrator makes ahead of the device, with the labels the administrator gives it,
  approved, and the SHA-256 of a random token in ``spec.invite``. The device enrolls under
  that name with the token, once, before it expires; the enrollment replaces the invite by
  the device's key in one conditional patch, so a second use (or a race of two) fails.
- the fleet's **bootstrap token** (a Secret: ``token``, optional ``expiration`` in RFC 3339
  and ``labels``): shared by many devices and refused after its expiration. A device
  enrolled with it waits for approval by hand, with the labels it asked for, for the
  administrator to approve with it; or, with ``spec.enrollment.autoApprove``, it is approved
  at once and gets the labels of the token's Secret, never labels of its own choosing.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from hybridllm_common import crd

DEFAULT_TTL_S = 24 * 3600.0  # as kubeadm's bootstrap tokens
MAX_TTL_S = 365 * 86400.0
TOKEN_BYTES = 32

_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_TTL = re.compile(r"^([0-9]+)([smhd])$")


class EnrollmentError(ValueError):
    """A credential or a label set that cannot be used, with the reason for people."""


class Expired(EnrollmentError):
    """A credential past its expiry."""


# Every token made here starts with this: never with '-' (of URL-safe base64's 64 letters,
# one made a token in 64 an option to `hybridllm edge agent --token $TOKEN`, which then
# refused to start), and a secret scanner can tell a leaked fleet token by it.
TOKEN_PREFIX = "hlf_"


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def label_problem(labels: Any) -> str | None:
    """Why ``labels`` cannot be a device's labels, or None."""
    if not isinstance(labels, dict):
        return "labels must be an object of strings"
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.match(key) or len(key.split("/")[-1]) > 63:
            return f"label key {key!r} is not a Kubernetes label key"
        if key.startswith(f"{crd.GROUP}/"):
            return f"label key {key!r}: the {crd.GROUP}/ prefix is the server's"
        if not isinstance(value, str) or not _LABEL_VALUE.match(value) or len(value) > 63:
            return f"label {key}={value!r}: not a Kubernetes label value"
    return None


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` (empty: none) as checked labels."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise EnrollmentError(f"label {part!r} is not key=value")
        labels[key.strip()] = value.strip()
    problem = label_problem(labels)
    if problem:
        raise EnrollmentError(problem)
    return labels


def format_labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def parse_ttl(text: str) -> float | None:
    """``30m``, ``24h``, ``7d``; ``0`` for a credential that never expires (None)."""
    if text.strip() == "0":
        return None
    match = _TTL.match(text.strip())
    if not match:
        raise EnrollmentError(f"--ttl {text!r}: a number and s, m, h or d (e.g. 24h), or 0")
    seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    if not 0 < seconds <= MAX_TTL_S:
        raise EnrollmentError(f"--ttl {text!r}: more than 0 and at most 365d")
    return float(seconds)


def rfc3339(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class BootstrapToken:
    """A fleet's bootstrap token as its Secret holds it."""

    value: str
    expires: float | None = None
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_secret(cls, data: dict[str, str]) -> BootstrapToken:
        """From the Secret's decoded data; a malformed Secret is an error, not a token
        that never expires or labels nobody set."""
        value = data.get("token", "")
        if len(value) < 16:
            raise EnrollmentError("its `token` is missing or shorter than 16 characters")
        expires = None
        if "expiration" in data:
            text = data["expiration"].strip()
            try:
                stamp = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
            except ValueError:
                raise EnrollmentError(f"its `expiration` {text!r} is not RFC 3339") from None
            if stamp.tzinfo is None:
                raise EnrollmentError(f"its `expiration` {text!r} has no time zone")
            expires = stamp.timestamp()
        try:
            labels = parse_labels(data.get("labels", ""))
        except EnrollmentError as exc:
            raise EnrollmentError(f"its `labels`: {exc}") from None
        return cls(value, expires, labels)

    def secret_data(self) -> dict[str, str]:
        data = {"token": self.value}
        if self.expires is not None:
            data["expiration"] = rfc3339(self.expires)
        if self.labels:
            data["labels"] = format_labels(self.labels)
        return data


def check_labels(asked: dict[str, str], granted: dict[str, str], by: str) -> None:
    """A device may repeat labels it was granted, never add or change one."""
    extra = {k: v for k, v in asked.items() if granted.get(k) != v}
    if extra:
        raise EnrollmentError(
            f"labels {format_labels(extra)} are not granted by {by} (a device's labels are "
            f"set by an administrator: {format_labels(granted) or 'none'})"
        )


def check_expiry(expires: float | None, what: str, now: float | None = None) -> None:
    if expires is not None and (now if now is not None else time.time()) >= expires:
        raise Expired(f"{what} expired at {rfc3339(expires)}")


def invite_spec(fleet: str, token: str, ttl_s: float) -> crd.EdgeDeviceSpec:
    """The spec of an invited device: approved, waiting for its key."""
    invite = crd.DeviceInvite(
        token_sha256=token_sha256(token), expires=time.time() + ttl_s, used=False
    )
    return crd.EdgeDeviceSpec(fleet=fleet, invite=invite, approved=True)


def claim_patch(invite: crd.DeviceInvite, public_key: str, facts: crd.DeviceFacts) -> list[Any]:
    """A JSON patch that uses the invitation up: it applies only while the invite is the one
    checked and unused (the ``test`` operations), so two enrollments with one token cannot
    both succeed. The hash stays, so the same device may repeat its enrollment."""
    return [
        {"op": "test", "path": "/spec/invite/tokenSha256", "value": invite.token_sha256},
        {"op": "test", "path": "/spec/invite/used", "value": False},
        {"op": "replace", "path": "/spec/invite/used", "value": True},
        {"op": "add", "path": "/spec/publicKey", "value": public_key},
        {"op": "add", "path": "/spec/facts", "value": facts.to_wire()},
    ]
