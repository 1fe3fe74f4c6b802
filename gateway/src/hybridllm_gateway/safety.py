"""API keys, per-key rate limits, request bounds and the sensitive-content filter.

Keys are stored hashed: the keys file (the Secret ``--api-keys-file`` names) holds one
``NAME:SHA256HEX`` per line (``#`` comments allowed; ``hybridllm-gateway hash-key`` prints
a line). A presented key is hashed and looked up, so the gateway never holds a plain key.
No keys file means no authentication (the operator passes none without a Secret); the
rate limits then apply per client address.

Rate limits are token buckets per key, refilled continuously: one for requests (capacity
and refill ``requestsPerMinute``) and one for tokens (``tokensPerMinute``). A request is
admitted when both buckets are positive; the request bucket is charged 1 and the token
bucket the estimated prompt tokens at admission, and the completion tokens when the answer
is done (the usage field, or one per streamed event that carries a token). The token
bucket may go negative, and the next request is refused with 429 and ``Retry-After`` = the
seconds until it is positive again. Buckets live in each gateway process: with N gateway replicas a key
gets up to N times the limit, the usual trade for a gateway with no shared store.

The content filter scans the prompt for built-in PII patterns (email, credit card numbers
that pass the Luhn check, US SSNs, phone numbers, IBANs), extra named regexes and a deny
list of words; in ``block`` mode a hit is a 400 ``content_filtered`` naming what was found
(never echoing it), in ``redact`` mode each hit is replaced by ``[REDACTED:<kind>]`` before
the request goes upstream.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import re2

from hybridllm_common import openai_protocol as oai
from hybridllm_gateway import config as config_mod
from hybridllm_gateway.errors import APIError

log = logging.getLogger(__name__)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    def __init__(self, hashes: dict[str, str] | None) -> None:
        self.hashes = hashes  # sha256 hex -> key name; None: authentication off

    @classmethod
    def load(cls, path: Path | None) -> ApiKeys:
        if path is None:
            return cls(None)
        hashes: dict[str, str] = {}
        for num, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, digest = line.rpartition(":")
            digest = digest.strip().lower()
            if not sep or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(f"{path}:{num}: expected NAME:SHA256HEX")
            hashes[digest] = name.strip() or digest[:8]
        return cls(hashes)

    def authenticate(self, authorization: str | None, x_api_key: str | None) -> str:
        """The key's name; raises 401 for a missing or unknown key."""
        if self.hashes is None:
            return "anonymous"
        key = x_api_key
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer":
                key = value.strip()
        if not key:
            raise APIError(oai.UNAUTHORIZED, "missing API key: send 'Authorization: Bearer KEY'")
        name = self.hashes.get(hash_key(key))
        if name is None:
            raise APIError(oai.UNAUTHORIZED, "invalid API key")
        return name


@dataclass
class TokenBucket:
    per_minute: float
    level: float = field(default=-1.0)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.level < 0:
            self.level = self.per_minute

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.stamp) * self.per_minute / 60.0)
        self.stamp = now

    def wait_s(self, need: float) -> float:
        """Seconds until the bucket holds ``need`` (0 if it does now)."""
        if self.level >= need:
            return 0.0
        return (need - self.level) * 60.0 / self.per_minute


class RateLimiter:
    def __init__(self, limits: config_mod.RateLimits) -> None:
        self.limits = limits
        self.buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}
        self.prune_above = self.PRUNE_ABOVE

    def update(self, limits: config_mod.RateLimits) -> None:
        self.limits = limits
        for req, tok in self.buckets.values():
            req.per_minute = limits.requests_per_minute
            tok.per_minute = limits.tokens_per_minute

    PRUNE_ABOVE = 4096  # keys held before idle ones are dropped

    def prune(self, now: float) -> None:
        """Drop the buckets of keys idle long enough to be full again: a new bucket for
        such a key is the same as the old one, and a map of every client address ever
        seen (limits per address when no keys are set) would only grow."""
        for key in [
            k
            for k, (req, tok) in self.buckets.items()
            if req.level + (now - req.stamp) * req.per_minute / 60.0 >= req.per_minute
            and tok.level + (now - tok.stamp) * tok.per_minute / 60.0 >= tok.per_minute
        ]:
            del self.buckets[key]
        self.prune_above = max(self.PRUNE_ABOVE, 2 * len(self.buckets))

    def admit(self, key: str, prompt_tokens: int, reserve: int = 0) -> Reservation:
        """One request of ``key`` in, or 429 with Retry-After. The token bucket is charged
        the prompt and ``reserve``, the most the answer can hold, at once: requests in
        flight together cannot spend more than the bucket holds, and what a client never
        reads (it went away mid-stream) stays charged. :meth:`Reservation.settle` gives
        back what the answer did not use."""
        buckets = self.buckets.get(key)
        if buckets is None:
            if len(self.buckets) >= self.prune_above:  # amortised: at most once per doubling
                self.prune(time.monotonic())
            buckets = (
                TokenBucket(self.limits.requests_per_minute),
                TokenBucket(self.limits.tokens_per_minute),
            )
            self.buckets[key] = buckets
        req, tok = buckets
        now = time.monotonic()
        req.refill(now)
        tok.refill(now)
        # a request larger than a whole minute's tokens waits for a full bucket, no more
        need = min(float(prompt_tokens + reserve), tok.per_minute)
        wait = max(req.wait_s(1.0), tok.wait_s(max(need, min(1.0, tok.per_minute))))
        if wait > 0:
            what = "requests" if req.level < 1.0 else "tokens"
            raise APIError(
                oai.RATE_LIMIT_EXCEEDED,
                f"rate limit exceeded for key {key!r} ({what} per minute); retry after {math.ceil(wait)} s",
                headers={"Retry-After": str(math.ceil(wait))},
            )
        req.level -= 1.0
        tok.level -= prompt_tokens + reserve
        return Reservation(tok, reserve)


@dataclass
class Reservation:
    """The completion tokens a request was charged at admission, until it settles."""

    bucket: TokenBucket
    reserved: int
    settled: bool = False

    def settle(self, used: int) -> None:
        """The answer held ``used`` tokens: give back the rest of the reservation (or
        charge what went past it). Once; a request that never settles keeps it all."""
        if self.settled:
            return
        self.settled = True
        self.bucket.level = min(self.bucket.per_minute, self.bucket.level + self.reserved - used)


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


# RE2 syntax (linear time, no look-around): where a pattern must not start inside a longer
# token, it takes the character before it and marks what it redacts as the group ``hit``.
PII_PATTERNS: dict[str, str] = {
    "email": r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+",
    "credit_card": r"\b\d(?:[ -]?\d){12,18}\b",
    "us_ssn": r"\b\d{3}-\d{2}-\d{4}\b",
    "phone": r"(?:^|[^\w-])(?P<hit>\+?\d{1,3}[ .-]\(?\d{2,4}\)?[ .-]\d{3,4}[ .-]?\d{3,4}\b)",
    "iban": r"\b[A-Z]{2}\d{2}[A-Z0-9]{11,30}\b",
}


def compile_pattern(kind: str, pattern: str, ignore_case: bool = False) -> Any:
    """A filter pattern in RE2, whose matching time is linear in the text: the prompt is
    the client's, and a backtracking engine lets one prompt hold the event loop for
    hours (``[\\w.+-]+@`` over a megabyte of letters is quadratic in Python's ``re``).
    RE2 has no look-around or backreferences: a pattern that needs them is refused."""
    options = re2.Options()
    options.case_sensitive = not ignore_case
    options.max_mem = 64 << 20
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        raise ValueError(
            f"filter pattern {kind!r} is not valid RE2 syntax ({exc}); the filter takes "
            "linear-time patterns only: no look-around, no backreferences"
        ) from None


class ContentFilter:
    def __init__(self, cfg: config_mod.FilterConfig) -> None:
        self.mode = cfg.mode
        unknown = set(cfg.pii) - set(PII_PATTERNS)
        if unknown:
            raise ValueError(
                f"unknown PII patterns {sorted(unknown)}; known: {sorted(PII_PATTERNS)}"
            )
        named = {k: PII_PATTERNS[k] for k in cfg.pii} | dict(cfg.patterns)
        if cfg.deny:
            named["deny_list"] = r"\b(?:" + "|".join(re2.escape(w) for w in cfg.deny) + r")\b"
        self.patterns = {
            k: compile_pattern(k, v, ignore_case=k == "deny_list") for k, v in named.items()
        }

    def _sub(self, text: str, found: set[str]) -> str:
        for kind, pattern in self.patterns.items():
            hit = pattern.groupindex.get("hit")

            def repl(m: Any, kind: str = kind, hit: int | None = hit) -> str:
                whole = m.group()
                if kind == "credit_card" and not luhn_ok(re.sub(r"\D", "", whole)):
                    return str(whole)
                found.add(kind)
                before = whole[: m.start(hit) - m.start()] if hit else ""
                return f"{before}[REDACTED:{kind}]"

            text = pattern.sub(repl, text)
        return text

    @classmethod
    def load(cls, path: Path | None) -> ContentFilter:
        if path is None:
            return cls(config_mod.FilterConfig())
        return cls(config_mod.FilterConfig.model_validate_json(path.read_text()))

    def apply(self, body: dict[str, Any]) -> list[str]:
        """Blocks (raises 400) or redacts the body in place; returns the kinds found."""
        if self.mode == "off":
            return []
        found: set[str] = set()
        messages = body.get("messages")
        if isinstance(messages, list):
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, str):
                    m["content"] = self._sub(content, found)
                elif isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            part["text"] = self._sub(part["text"], found)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            body["prompt"] = self._sub(prompt, found)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            body["prompt"] = [self._sub(p, found) for p in prompt]
        if found and self.mode == "block":
            raise APIError(
                oai.CONTENT_FILTERED,
                f"request blocked by the content filter: it contains {', '.join(sorted(found))}",
                param="messages" if isinstance(messages, list) else "prompt",
            )
        return sorted(found)
