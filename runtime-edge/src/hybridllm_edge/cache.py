"""Response cache: a repeated deterministic question is answered without touching the model.

The edge tier answers frequent simple requests; many are the same question. The key is
the model revision, the endpoint, the normalized prompt (messages with whitespace runs
collapsed and ends stripped; roles kept), and every parameter that changes the answer
(max_tokens, temperature, top_p, top_k, stop, seed, penalties, stop_token_ids, ignore_eos).

A cached answer is only correct when the model would give it again, so the cache is used
when the request is deterministic (temperature 0) or when the client opts in (request
field ``"cache": true`` or header ``x-hybridllm-cache: allow``); ``x-hybridllm-cache:
bypass`` opts out. Requests with n > 1 or logprobs are not cached. An entry keeps the text
pieces as they were streamed, so a hit is streamed chunk by chunk like a fresh answer.
Entries expire after a TTL and the least recently used go first past ``max_entries``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridllm_common import structured

_SPACES = re.compile(r"\s+")

KEY_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "stop_token_ids",
    "ignore_eos",
    "echo",
    "suffix",
    "cache_salt",  # one partition per tenant (the gateway sets it)
    # the answer's shape: an output format or the tools offered change the answer
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    *sorted(structured.EXTRA_FIELDS),
)


def normalize(text: str) -> str:
    return _SPACES.sub(" ", text).strip()


@dataclass(frozen=True)
class CachedAnswer:
    pieces: tuple[str, ...]  # text as it was streamed, one piece per token
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    mean_logprob: float | None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def make_key(revision: str, endpoint: str, prompt: Any, body: dict[str, Any]) -> str:
    params = {name: body.get(name) for name in KEY_FIELDS}
    blob = json.dumps([revision, endpoint, prompt, params], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class ResponseCache:
    def __init__(
        self,
        ttl_seconds: float,
        max_entries: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self._clock = clock
        self._entries: collections.OrderedDict[str, tuple[float, CachedAnswer]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CachedAnswer | None:
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            expires, answer = entry
            if expires <= now:
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return answer

    def put(self, key: str, answer: CachedAnswer) -> None:
        with self._lock:
            self._entries[key] = (self._clock() + self.ttl, answer)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
