"""Ed25519 signing of fleet documents and device requests.

Two uses, one key type:

- **Configs.** The fleet server signs what a device should run with the fleet's key; the
  agent verifies the signature with the fleet's public key it pinned at enrollment. A
  signed document is an envelope ``{"payload": <base64 of canonical JSON>, "signature":
  <base64>, "keyId": <hex>}``: the signature covers the exact payload bytes, so the JSON
  is never re-serialised before it is checked.
- **Requests.** Each device holds its own key pair (generated on the device, the private
  key never leaves it). It signs every call: ``METHOD\\nPATH\\nTIMESTAMP\\nSHA256(BODY)``,
  sent as the ``X-Hybridllm-Device``, ``X-Hybridllm-Timestamp`` and
  ``X-Hybridllm-Signature`` headers; the server checks it against the public key in the
  device's record and refuses a timestamp more than ``MAX_SKEW_S`` away from its clock.

Keys travel as base64 of their 32 raw bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

DEVICE_HEADER = "X-Hybridllm-Device"
TIMESTAMP_HEADER = "X-Hybridllm-Timestamp"
SIGNATURE_HEADER = "X-Hybridllm-Signature"
MAX_SKEW_S = 300.0

_RAW = serialization.Encoding.Raw
_RAW_PRIVATE = serialization.PrivateFormat.Raw
_RAW_PUBLIC = serialization.PublicFormat.Raw


class SignatureError(ValueError):
    """A signature, key or envelope that does not check out; the message says which."""


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_text(key: Ed25519PrivateKey) -> str:
    raw = key.private_bytes(_RAW, _RAW_PRIVATE, serialization.NoEncryption())
    return base64.b64encode(raw).decode()


def private_key_from_text(text: str) -> Ed25519PrivateKey:
    try:
        return Ed25519PrivateKey.from_private_bytes(_b64(text.strip(), "private key"))
    except ValueError as exc:
        raise SignatureError(f"not an Ed25519 private key: {exc}") from None


def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(public.public_bytes(_RAW, _RAW_PUBLIC)).decode()


def public_key_from_text(text: str) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(_b64(text.strip(), "public key"))
    except ValueError as exc:
        raise SignatureError(f"not an Ed25519 public key: {exc}") from None


def key_id(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A short fingerprint of a public key: the first 16 hex digits of its sha256."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return hashlib.sha256(public.public_bytes(_RAW, _RAW_PUBLIC)).hexdigest()[:16]


def canonical(obj: Any) -> bytes:
    """The one byte form of a JSON document that gets signed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sign_document(payload: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, str]:
    data = canonical(payload)
    return {
        "payload": base64.b64encode(data).decode(),
        "signature": base64.b64encode(key.sign(data)).decode(),
        "keyId": key_id(key),
    }


def open_document(envelope: Any, public_key: Ed25519PublicKey) -> dict[str, Any]:
    """The payload of a signed envelope, or SignatureError saying what is wrong with it."""
    if not isinstance(envelope, dict) or not {"payload", "signature"} <= set(envelope):
        raise SignatureError("not a signed document: expected an object with payload and signature")
    data = _b64(envelope["payload"], "payload")
    try:
        public_key.verify(_b64(envelope["signature"], "signature"), data)
    except InvalidSignature:
        raise SignatureError(
            f"signature does not match the fleet key {key_id(public_key)} "
            f"(signed with {envelope.get('keyId', 'an unnamed key')}): the document was "
            "altered or signed by another key"
        ) from None
    try:
        payload = json.loads(data)
    except ValueError as exc:
        raise SignatureError(f"signed payload is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise SignatureError("signed payload is not a JSON object")
    return payload


def request_base(method: str, path: str, timestamp: str, body: bytes) -> bytes:
    """What a device signs for one request (the path includes the query string)."""
    digest = hashlib.sha256(body).hexdigest()
    return f"{method.upper()}\n{path}\n{timestamp}\n{digest}".encode()


def sign_request(
    key: Ed25519PrivateKey, device: str, method: str, path: str, body: bytes, now: float
) -> dict[str, str]:
    timestamp = f"{now:.3f}"
    signature = key.sign(request_base(method, path, timestamp, body))
    return {
        DEVICE_HEADER: device,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: base64.b64encode(signature).decode(),
    }


TIMESTAMP_RE = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,9})?")


def check_request(
    public_key: Ed25519PublicKey,
    method: str,
    path: str,
    timestamp: str,
    signature: str,
    body: bytes,
    now: float,
) -> None:
    """SignatureError unless the device's key signed this request within MAX_SKEW_S of now."""
    # Seconds as sign() writes them (digits, one point): float() also takes "nan" (never
    # "more than MAX_SKEW_S away", so a signature would pass the clock check forever),
    # "inf", exponents and underscores.
    if len(timestamp) > 32 or not TIMESTAMP_RE.fullmatch(timestamp):
        raise SignatureError(f"{TIMESTAMP_HEADER} {timestamp[:40]!r} is not a number of seconds")
    sent = float(timestamp)
    if not abs(now - sent) <= MAX_SKEW_S:
        raise SignatureError(
            f"{TIMESTAMP_HEADER} is {now - sent:+.0f} s from the server's clock "
            f"(at most {MAX_SKEW_S:.0f} s): fix the device's clock"
        )
    try:
        public_key.verify(
            _b64(signature, SIGNATURE_HEADER), request_base(method, path, timestamp, body)
        )
    except InvalidSignature:
        raise SignatureError("request signature does not match the device's key") from None


def _b64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise SignatureError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError(f"{what} is not valid base64") from None
