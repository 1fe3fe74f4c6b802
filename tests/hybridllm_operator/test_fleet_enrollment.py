"""The credentials a device enrolls with, read strictly: a malformed bootstrap token Secret
is an error, never a token that does not expire or labels nobody set. The enrollment
itself, on the real control plane, is walked in test_k8s_fleet_replicas.py."""

from __future__ import annotations

import secrets

import pytest

from hybridllm_common import cli, crd
from hybridllm_operator.edgefleet import enrollment


def test_a_bootstrap_secret_is_read_strictly_and_written_back_the_same() -> None:
    token = enrollment.BootstrapToken.from_secret({
        "token": "x" * 43, "expiration": "2026-12-01T10:00:00Z", "labels": "tier=store, site=n1",
    })  # fmt: skip
    assert token.expires == 1796119200.0
    assert token.labels == {"tier": "store", "site": "n1"}
    assert enrollment.BootstrapToken.from_secret(token.secret_data()) == token
    assert enrollment.BootstrapToken.from_secret({"token": "y" * 20}).expires is None
    for data, problem in (
        ({"token": "short"}, "shorter than 16"),
        ({"token": "x" * 20, "expiration": "tomorrow"}, "not RFC 3339"),
        ({"token": "x" * 20, "expiration": "2026-12-01T10:00:00"}, "no time zone"),
        ({"token": "x" * 20, "labels": "tier"}, "not key=value"),
        ({"token": "x" * 20, "labels": "hybridllm.io/fleet=a"}, "prefix is the server's"),
    ):
        with pytest.raises(enrollment.EnrollmentError, match=problem):
            enrollment.BootstrapToken.from_secret(data)


def test_a_new_token_is_read_as_the_agents_token_even_when_its_random_part_starts_with_a_dash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "-" + "x" * 42)
    token = enrollment.new_token()
    assert token.startswith(enrollment.TOKEN_PREFIX)
    args = cli.build_parser("edge").parse_args(
        ["edge", "agent", "--server", "https://fleet:8443", "--fleet", "shops", "--token", token]
    )  # a token read as an option would exit here ("expected one argument")
    assert args.token == token


def test_ttls_labels_and_expiry() -> None:
    assert enrollment.parse_ttl("30m") == 1800.0
    assert enrollment.parse_ttl("7d") == 7 * 86400.0
    assert enrollment.parse_ttl("0") is None
    for bad in ("24", "1y", "-1h", "400d", "0h"):
        with pytest.raises(enrollment.EnrollmentError):
            enrollment.parse_ttl(bad)
    granted = {"tier": "store", "site": "n1"}
    enrollment.check_labels({}, granted, "the invitation")
    enrollment.check_labels({"tier": "store"}, granted, "the invitation")
    with pytest.raises(enrollment.EnrollmentError, match="site=n2 are not granted"):
        enrollment.check_labels({"site": "n2"}, granted, "the invitation")
    enrollment.check_expiry(None, "the token", now=1e12)
    enrollment.check_expiry(100.0, "the token", now=99.0)
    with pytest.raises(enrollment.EnrollmentError, match="expired at 1970-01-01T00:01:40Z"):
        enrollment.check_expiry(100.0, "the token", now=100.0)


def test_an_invitation_is_used_up_by_one_conditional_patch() -> None:
    spec = enrollment.invite_spec("shops", "secret-token", 3600)
    assert spec.approved
    assert spec.public_key is None
    assert spec.invite is not None
    assert spec.invite.token_sha256 == enrollment.token_sha256("secret-token")
    assert "secret-token" not in str(spec.to_wire())  # only its hash is stored
    patch = enrollment.claim_patch(spec.invite, "k" * 44, crd.DeviceFacts(cpus=4))
    assert patch[:2] == [
        {"op": "test", "path": "/spec/invite/tokenSha256", "value": spec.invite.token_sha256},
        {"op": "test", "path": "/spec/invite/used", "value": False},
    ]
    with pytest.raises(ValueError, match=r"publicKey \(enrolled\) or an invite"):
        crd.EdgeDeviceSpec(fleet="shops")
