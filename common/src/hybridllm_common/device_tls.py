"""TLS between the gateways and edge devices: a certificate per device, from its fleet.

A device's endpoint is an address the device itself reports, on a site network the
platform does not own. So the gateways speak TLS to it and check that the answer comes
from the device they meant, not merely from something at that address:

- **The fleet is the authority.** Its Ed25519 signing key (the one configs are signed
  with, in its Secret) also signs certificates. The fleet's CA certificate is derived from
  that key alone (fixed names, dates and serial; Ed25519 signatures are deterministic), so
  every fleet server replica and every restart produces the same bytes, and the fleet
  server publishes it in the EdgeFleet's ``status.deviceCA``. Its name constraints allow
  only names of its own fleet.
- **A device's certificate names the device**, not its address: ``<device>.<fleet>.
  <namespace>.devices.hybridllm.internal`` (``server_name``). The gateway connects to the
  reported address and verifies the certificate for that name, so a device that reports
  another device's address cannot answer for it, and neither can anything else there.
- **The key is the device's own**: the Ed25519 key it enrolled with (made on the device,
  never leaving it). The fleet server issues the certificate for the key in the device's
  record, on a request signed with that key (``POST /v1/devices/<name>/certificate``),
  for ``DEVICE_CERT_DAYS``; the agent renews it when a third of that is left.
"""

from __future__ import annotations

import datetime
import hashlib
import ssl

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DOMAIN = "devices.hybridllm.internal"
DEVICE_CERT_DAYS = 30
RENEW_WHEN_LEFT = 1 / 3  # of a certificate's life
_PEM = serialization.Encoding.PEM
_CA_FROM = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_CA_UNTIL = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)


class CertificateError(ValueError):
    """A certificate that cannot be used; the message says why."""


def fleet_domain(fleet: str, namespace: str) -> str:
    return f"{fleet}.{namespace}.{DOMAIN}"


def server_name(device: str, fleet: str, namespace: str) -> str:
    """The name a device's certificate carries and the gateways verify (DNS labels of at
    most 63 characters each: the names are Kubernetes object names)."""
    return f"{device}.{fleet_domain(fleet, namespace)}"


def _ca_name(fleet: str, namespace: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hybridllm"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"fleet {namespace}/{fleet}"),
    ])  # fmt: skip


def _serial(*parts: bytes) -> int:
    return int.from_bytes(hashlib.sha256(b"\0".join(parts)).digest()[:16], "big") >> 1 or 1


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def ca_certificate(fleet_key: Ed25519PrivateKey, fleet: str, namespace: str) -> str:
    """The fleet's CA certificate (PEM): the same bytes for the same key and fleet."""
    name = _ca_name(fleet, namespace)
    public = fleet_key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(public)
        .serial_number(_serial(b"ca", _raw(public), fleet.encode(), namespace.encode()))
        .not_valid_before(_CA_FROM).not_valid_after(_CA_UNTIL)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                       critical=True)
        .add_extension(x509.NameConstraints(
            permitted_subtrees=[x509.DNSName(fleet_domain(fleet, namespace))],
            excluded_subtrees=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(fleet_key, None)
    )  # fmt: skip
    return cert.public_bytes(_PEM).decode()


def issue(
    fleet_key: Ed25519PrivateKey,
    fleet: str,
    namespace: str,
    device: str,
    device_key: Ed25519PublicKey,
    now: float,
    days: float = DEVICE_CERT_DAYS,
) -> str:
    """A server certificate (PEM) for ``device``'s key, signed by its fleet's key."""
    start = datetime.datetime.fromtimestamp(now, datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device)]))
        .issuer_name(_ca_name(fleet, namespace)).public_key(device_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - datetime.timedelta(minutes=5))
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False),
                       critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(server_name(device, fleet, namespace))]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            fleet_key.public_key()), critical=False)
        .sign(fleet_key, None)
    )  # fmt: skip
    return cert.public_bytes(_PEM).decode()


def private_key_pem(key: Ed25519PrivateKey) -> str:
    """The device key as a PKCS#8 PEM file, the form a TLS server loads."""
    return key.private_bytes(
        _PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def validity(pem: str) -> tuple[float, float]:
    """A certificate's (not before, not after), as Unix times."""
    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate: {exc}") from None
    return cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()


def check_issued(
    cert_pem: str,
    ca_pem: str,
    device_key: Ed25519PublicKey,
    fleet_key: Ed25519PublicKey,
    now: float,
) -> None:
    """What a device checks of the certificate it is given: for its own key, signed by
    the CA of the fleet key it pinned at enrollment, valid now; else CertificateError."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        ca = x509.load_pem_x509_certificate(ca_pem.encode())
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate: {exc}") from None
    if _raw_of(cert.public_key()) != _raw(device_key):
        raise CertificateError("the certificate is for another key than this device's")
    if _raw_of(ca.public_key()) != _raw(fleet_key):
        raise CertificateError("the CA is not the fleet's key pinned at enrollment")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise CertificateError(f"the certificate is not signed by the fleet's CA: {exc}") from None
    if not cert.not_valid_before_utc.timestamp() <= now <= cert.not_valid_after_utc.timestamp():
        raise CertificateError("the certificate is not valid now (check the device's clock)")


def _raw_of(key: object) -> bytes:
    if not isinstance(key, Ed25519PublicKey):
        raise CertificateError(f"not an Ed25519 key ({type(key).__name__})")
    return _raw(key)


def needs_renewal(pem: str | None, now: float) -> bool:
    """Whether a device should ask for a new certificate: none, unreadable, or a third of
    its life or less left."""
    if not pem:
        return True
    try:
        start, end = validity(pem)
    except CertificateError:
        return True
    return end - now <= (end - start) * RENEW_WHEN_LEFT


def client_context(ca_pem: str) -> ssl.SSLContext:
    """What a gateway verifies a fleet's devices with: that fleet's CA alone (not the
    system's), the device's name checked (the connection's ``server_hostname``)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """What a device's runtime serves with (reload the files with ``load_cert_chain``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert_file, key_file)
    return context
