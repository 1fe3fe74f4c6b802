"""Signed documents and signed requests: what verifies, and what each tampering says."""

from __future__ import annotations

import base64
import json

import pytest

from hybridllm_common import signing


def test_a_signed_document_opens_with_its_key_and_only_with_it() -> None:
    key, other = signing.generate_key(), signing.generate_key()
    envelope = signing.sign_document({"version": 3, "model": "m"}, key)
    assert signing.open_document(envelope, key.public_key()) == {"version": 3, "model": "m"}
    with pytest.raises(signing.SignatureError, match="altered or signed by another key"):
        signing.open_document(envelope, other.public_key())


def test_a_changed_payload_is_refused() -> None:
    key = signing.generate_key()
    envelope = signing.sign_document({"version": 3, "revision": "v1"}, key)
    payload = json.loads(base64.b64decode(envelope["payload"]))
    payload["revision"] = "evil"
    forged = {**envelope, "payload": base64.b64encode(signing.canonical(payload)).decode()}
    with pytest.raises(signing.SignatureError):
        signing.open_document(forged, key.public_key())
    with pytest.raises(signing.SignatureError, match="not a signed document"):
        signing.open_document({"payload": envelope["payload"]}, key.public_key())
    with pytest.raises(signing.SignatureError, match="base64"):
        signing.open_document({**envelope, "signature": "@@"}, key.public_key())


def test_keys_round_trip_as_text() -> None:
    key = signing.generate_key()
    again = signing.private_key_from_text(signing.private_key_text(key))
    assert signing.public_key_text(again) == signing.public_key_text(key)
    public = signing.public_key_from_text(signing.public_key_text(key))
    assert signing.key_id(public) == signing.key_id(key)
    with pytest.raises(signing.SignatureError, match="Ed25519 public key"):
        signing.public_key_from_text(base64.b64encode(b"short").decode())


def test_a_signed_request_checks_method_path_body_and_clock() -> None:
    key = signing.generate_key()
    headers = signing.sign_request(key, "dev-1", "POST", "/v1/x?a=1", b"{}", now=1000.0)
    ts, sig = headers[signing.TIMESTAMP_HEADER], headers[signing.SIGNATURE_HEADER]
    public = key.public_key()
    signing.check_request(public, "POST", "/v1/x?a=1", ts, sig, b"{}", now=1001.0)
    for method, path, body in (("GET", "/v1/x?a=1", b"{}"), ("POST", "/v1/x?a=2", b"{}"),
                               ("POST", "/v1/x?a=1", b'{"a":1}')):  # fmt: skip
        with pytest.raises(signing.SignatureError, match="does not match"):
            signing.check_request(public, method, path, ts, sig, body, now=1001.0)
    with pytest.raises(signing.SignatureError, match="clock"):
        signing.check_request(public, "POST", "/v1/x?a=1", ts, sig, b"{}", now=1000.0 + 301)


@pytest.mark.parametrize("ts", ["nan", "NaN", "inf", "-1", "1e3", "1_000", " 1000", "1000.", ""])
def test_a_timestamp_that_is_not_plain_seconds_is_refused(ts: str) -> None:
    """float() takes "nan", and abs(now - nan) > skew is never true: such a signed request
    passed the clock check forever (a replayable signature)."""
    key = signing.generate_key()
    base = signing.request_base("POST", "/v1/x", ts, b"{}")
    sig = base64.b64encode(key.sign(base)).decode()
    with pytest.raises(signing.SignatureError, match="not a number of seconds"):
        signing.check_request(key.public_key(), "POST", "/v1/x", ts, sig, b"{}", now=1000.0)
